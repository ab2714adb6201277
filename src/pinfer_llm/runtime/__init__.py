"""pinfer runtime: load a GGUF/PWRI model and generate on the CPU (dense or activation-sparse)."""

from pinfer_llm.runtime.engine import Model, load_model, resolve_model_path

__all__ = ["Model", "load_model", "resolve_model_path"]
