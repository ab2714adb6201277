"""PowerInfer-GGUF formats: reading, writing, model config, tokenisers, dequantisation."""

from .config import ModelConfig, config_from_gguf
from .errors import PinferError
from .reader import GGUFFile, TensorInfo, open_gguf
from .writer import RawTensor, atomic_path, rewrite_gguf, write_gguf

__all__ = ["GGUFFile", "ModelConfig", "PinferError", "RawTensor", "TensorInfo", "atomic_path", "config_from_gguf",
           "open_gguf", "rewrite_gguf", "write_gguf"]
