"""ModelConfig: everything the runtime and planner need to know about a model, read from GGUF metadata alone."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError, quote
from pinfer_llm.formats.header import GGUFFile

SUPPORTED_ARCHS = ("llama", "bamboo", "falcon", "opt")
FFN_ACTIVATIONS = ("silu", "relu", "drelu")  # SwiGLU, ReGLU (relu gate * up), dReLU (relu gate * relu up)
# Falcon and OPT have no gate: the FFN is down(act(up x + b_up)) + b_down, ReLU (ReluFalcon, OPT) or GELU (Falcon).
GATELESS_ARCHS = ("falcon", "opt")
GATELESS_ACTIVATIONS = ("relu", "gelu")


@dataclass
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    vocab_size: int
    n_ctx_train: int = 4096
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scale: float = 1.0  # linear scaling: positions are divided by this
    ffn_act: str = "silu"
    tied_embeddings: bool = False
    down_transposed: bool = False  # the file stores ffn_down_t (PowerInfer) instead of ffn_down
    has_predictors: bool = False
    name: str = ""
    head_dim: int = 0

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.n_embd // self.n_head
        if self.n_head % self.n_head_kv:
            raise PinferError(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        allowed = FFN_ACTIVATIONS if self.gated else GATELESS_ACTIVATIONS
        if self.ffn_act not in allowed:
            raise PinferError(f"unknown FFN activation {quote(self.ffn_act)} for architecture {self.arch} "
                              f"(expected one of {', '.join(allowed)})")

    # What sets the architectures apart, as the runtime needs it (llama.cpp's graphs for llama, falcon; PowerInfer's
    # for opt, as read in its llama.cpp).
    @property
    def gated(self) -> bool:
        """The FFN has a gate matrix (llama, bamboo); Falcon and OPT compute act(up x + b) alone."""
        return self.arch not in GATELESS_ARCHS

    @property
    def layer_norm(self) -> bool:
        """LayerNorm with bias (Falcon, OPT) instead of RMSNorm."""
        return self.arch in GATELESS_ARCHS

    @property
    def rope(self) -> str:
        """Rotary pairs: "normal" (llama GGUF: adjacent (2i, 2i+1)), "neox" (Falcon: (i, i + head_dim/2)), or "none"
        (OPT: learned absolute positions added to the embeddings instead)."""
        return {"falcon": "neox", "opt": "none"}.get(self.arch, "normal")

    @property
    def parallel(self) -> bool:
        """Falcon's parallel block: attention and FFN read normed copies of the same input, both add to it."""
        return self.arch == "falcon"

    @property
    def is_relu(self) -> bool:
        return self.ffn_act in ("relu", "drelu")

    @property
    def n_params(self) -> int:
        attn = self.n_embd * self.head_dim * (2 * self.n_head + 2 * self.n_head_kv)
        ffn = (3 if self.gated else 2) * self.n_embd * self.n_ff
        emb = self.vocab_size * self.n_embd * (1 if self.tied_embeddings else 2)
        return self.n_layer * (attn + ffn + 2 * self.n_embd) + emb + self.n_embd


def detect_ffn_activation(f: GGUFFile) -> str:
    """Decide the FFN activation from what the file says.

    PowerInfer's ReLU llama files (ReluLLaMA, ProSparse) keep architecture "llama", so the architecture alone does
    not tell SwiGLU from ReGLU. In order of evidence: an explicit pinfer.ffn_activation key; the bamboo architecture
    (dReLU); opt (ReLU); predictor tensors or the PWRI magic (PowerInfer only serves ReLU models); a model name that
    says ReLU or ProSparse. Otherwise it is the standard SwiGLU, or GELU for falcon.
    """
    explicit = f.get(C.FFN_ACTIVATION)
    if isinstance(explicit, str) and explicit:
        return explicit
    if f.architecture == "bamboo":
        return "drelu"
    if f.architecture == "opt":  # every OPT is ReLU (HF's activation_function)
        return "relu"
    if f.is_powerinfer or f.has(C.tensor(C.PRED_FC1, 0)):
        return "relu"
    if re.search(r"relu|prosparse", str(f.get(C.NAME, "")), re.IGNORECASE):
        return "relu"
    return "gelu" if f.architecture == "falcon" else "silu"  # the original Falcon's FFN is GELU


def bounded_layers(f: GGUFFile, n: int, key: str) -> int:
    """A layer count from the metadata, checked against what the file can hold before anything loops over it: every
    layer has tensors of its own, so a file of T tensors has at most T layers (one 4-byte field set to 2^32-1 made
    pi-run and pi-plan build 4.3 billion tensor names)."""
    if n > len(f.tensors):
        raise PinferError(f"{f.path}: metadata '{key}' is {n}, but the file holds only {len(f.tensors)} tensors; "
                          f"the file is corrupt")
    return n


def config_from_gguf(f: GGUFFile, ffn_act: str | None = None) -> ModelConfig:
    """Build a ModelConfig from metadata and tensor shapes (no tensor data is read)."""
    arch = f.architecture
    if not arch:
        raise PinferError(f"{f.path}: no general.architecture in metadata; not a model file")
    if arch not in SUPPORTED_ARCHS:
        raise PinferError(f"{f.path}: architecture {quote(arch)} is not supported (supported: "
                          f"{', '.join(SUPPORTED_ARCHS)})")

    def num(template: str, default=None, kind=int):
        """A positive number from the metadata (a per-layer array gives its first value); PinferError otherwise."""
        key = template.format(arch=arch)
        v = f.get(key)
        if v is None:
            if default is None:
                raise PinferError(f"{f.path}: missing metadata '{key}'; the file is incomplete")
            return default
        if isinstance(v, np.ndarray) and v.size and v.dtype.kind in "uif":
            v = v.reshape(-1)[0]
        if isinstance(v, (bool, str, list, np.ndarray, np.bool_)):
            raise PinferError(f"{f.path}: metadata '{key}' is {type(v).__name__}, expected a number; the file is "
                              f"corrupt")
        try:
            x = kind(v)
        except (OverflowError, ValueError):  # int(inf), int(nan)
            x = 0
        if not (0 < x < 2**40) or (kind is float and not math.isfinite(x)):
            raise PinferError(f"{f.path}: metadata '{key}' is {v}, expected a positive number; the file is corrupt")
        return x

    n_embd = num(C.EMBEDDING_LENGTH)
    n_head = num(C.HEAD_COUNT)
    n_head_kv = num(C.HEAD_COUNT_KV, n_head)
    if f.arch_get(C.FEED_FORWARD_LENGTH) is None and f.has(C.tensor(C.FFN_UP, 0)):
        n_ff = f.info(C.tensor(C.FFN_UP, 0)).shape[0]
    else:
        n_ff = num(C.FEED_FORWARD_LENGTH)
    if f.arch_get(C.VOCAB_SIZE) is None:
        tokens = f.get(C.TOKENIZER_TOKENS)
        vocab = len(tokens) if isinstance(tokens, list) else f.info(C.TOKEN_EMBD).shape[0]
    else:
        vocab = num(C.VOCAB_SIZE)
        tokens = f.get(C.TOKENIZER_TOKENS)
        if isinstance(tokens, list) and len(tokens) != vocab:  # llama.cpp's n_vocab is the token count
            raise PinferError(f"{f.path}: the tokenizer has {len(tokens)} tokens but {arch}.vocab_size is {vocab}; "
                              f"the file is inconsistent")
    head_dim = num(C.KEY_LENGTH, max(n_embd // n_head, 1))

    rope_scale = 1.0
    scaling = f.arch_get(C.ROPE_SCALING_TYPE)
    if scaling not in (None, "none", "linear"):
        raise PinferError(f"{f.path}: rope scaling type {quote(scaling)} is not supported (only linear)")
    if scaling == "linear" or scaling is None:
        factor = C.ROPE_SCALING_FACTOR if f.arch_get(C.ROPE_SCALING_FACTOR) is not None else C.ROPE_SCALE_LINEAR
        rope_scale = num(factor, 1.0, float)
    n_rot = num(C.ROPE_DIMENSION_COUNT, head_dim)
    if arch != "opt" and n_rot != head_dim:
        raise PinferError(f"{f.path}: rope over {n_rot} of {head_dim} head dimensions (partial rotary) is not "
                          f"supported")
    layout = f.arch_get(C.TENSOR_DATA_LAYOUT)
    if arch == "falcon" and layout not in (None, "jploski"):
        raise PinferError(f"{f.path}: falcon tensor data layout {quote(layout)} is not supported (only llama.cpp's "
                          f"'jploski': attn_qkv as [all q | all k | all v])")

    n_ctx = num(C.CONTEXT_LENGTH, 4096)
    if arch == "opt":  # learned positions: the table's rows bound the context (PowerInfer writes 2050 = 2048 + 2)
        if C.POS_EMBD not in f.tensors:
            raise PinferError(f"{f.path}: opt model without {C.POS_EMBD}; the file is incomplete")
        n_ctx = min(n_ctx, f.info(C.POS_EMBD).shape[0] - C.OPT_POS_OFFSET)
        emb = f.info(C.TOKEN_EMBD).shape if C.TOKEN_EMBD in f.tensors else (0, n_embd)
        if emb[-1] != n_embd:  # OPT-350m: word_embed_proj_dim 512 with project_in / project_out around the decoder
            raise PinferError(f"{f.path}: OPT with embeddings of width {emb[-1]} and a decoder of width {n_embd} "
                              f"(word_embed_proj_dim != hidden_size, as in OPT-350m) is not supported")

    eps_key = C.LAYER_NORM_EPS if arch in GATELESS_ARCHS else C.RMS_EPS
    act = ffn_act or detect_ffn_activation(f)
    return ModelConfig(
        arch=arch,
        n_layer=bounded_layers(f, num(C.BLOCK_COUNT), f"{arch}.block_count"),
        n_embd=n_embd,
        n_ff=int(n_ff),
        n_head=n_head,
        n_head_kv=n_head_kv,
        vocab_size=int(vocab),
        n_ctx_train=n_ctx,
        norm_eps=num(eps_key, 1e-5, float),  # OPT files carry none: HF's LayerNorm default
        rope_base=num(C.ROPE_FREQ_BASE, 10000.0, float),
        rope_scale=rope_scale,
        ffn_act=act,
        tied_embeddings=not f.has(C.OUTPUT),
        down_transposed=f.has(C.tensor(C.FFN_DOWN_T, 0)) and not f.has(C.tensor(C.FFN_DOWN, 0)),
        has_predictors=f.has(C.tensor(C.PRED_FC1, 0)),
        name=str(f.get(C.NAME, "")),
        head_dim=head_dim,
    )
