"""PowerInfer-GGUF formats: reading, writing, model config, tokenisers, dequantisation."""

from pinfer_llm.formats.atomic import atomic_output, atomic_path
from pinfer_llm.formats.config import ModelConfig, config_from_gguf
from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.gpuidx import GpuIndex, read_gpuidx, write_gpuidx
from pinfer_llm.formats.header import GGUFFile, TensorInfo
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.update import rewrite_gguf, store, update_model, write_copy
from pinfer_llm.formats.writer import write_gguf

__all__ = ["GGUFFile", "GpuIndex", "ModelConfig", "PinferError", "RawTensor", "TensorInfo", "atomic_output",
           "atomic_path", "config_from_gguf", "open_gguf", "read_gpuidx", "rewrite_gguf", "store", "update_model",
           "write_copy", "write_gguf", "write_gpuidx"]
