"""PowerInfer-GGUF formats: reading, writing, model config, tokenisers, dequantisation."""

from .config import ModelConfig, config_from_gguf
from .errors import PinferError
from .gpuidx import GpuIndex, read_gpuidx, write_gpuidx
from .reader import GGUFFile, TensorInfo, open_gguf
from .update import store, update_model, write_copy
from .writer import RawTensor, atomic_output, atomic_path, rewrite_gguf, write_gguf

__all__ = ["GGUFFile", "GpuIndex", "ModelConfig", "PinferError", "RawTensor", "TensorInfo", "atomic_output",
           "atomic_path", "config_from_gguf", "open_gguf", "read_gpuidx", "rewrite_gguf", "store", "update_model",
           "write_copy", "write_gguf", "write_gpuidx"]
