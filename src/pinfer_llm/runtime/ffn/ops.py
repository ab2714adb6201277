"""Sparse FFN operators: the FFN of a few tokens computed on a set of neurons only.

Two implementations of the same operators, chosen per layer:
- FFNRows: the layer as the file stores it (gate, up and PowerInfer's neuron-major ffn_down_t, in F32/F16/BF16/Q4_0/
  Q4_1/Q8_0), read in place by pinfer's C++ kernel torch.ops.pinfer.qffn_sparse (runtime/cpu/csrc/sparse_ffn.cpp): one
  pass over the index list on torch's thread pool, several neurons' rows streaming side by side per thread, each
  selected row read once. For ReLU-family FFNs a neuron's gate row is read first, and its up and down rows are never
  read when its activation is exactly 0: a predictor's false positives cost a third of a neuron. More tokens than
  KERNEL_MAX_T gather the selected rows (dequantised) into a workspace and run GEMMs.
- FFNWeights: a float copy in a sparse-friendly layout (pack_ffn), for the torch fallback (no C++ compiler, or a type
  without a kernel such as the K-quants). It is described below. Gate-less FFNs (Falcon, OPT) keep only their up rows
  there, with the up bias beside them.

Everything here is exact: for any index set the result equals the dense FFN with the other neurons zeroed (up to the
8-bit activation rounding of the quantised kernels, see runtime/cpu/qops.py). `ffn_masked` (per-row masks) and
`ffn_auto` (one index set) decide dense vs union-of-masks sparse for T tokens by the measured rule `sparse_pays(T,
n_active, n_ff)`.

FFNWeights, the fallback's layout (`pack_ffn`), chosen by measurement (benchmarks/sparse_ops.py --layouts):
- gate_up [n_ff, 2, d]: neuron i's gate row and up row side by side, so one index list addresses both and a neuron's
  input weights are one 2*d run of memory; the dense path reads the same tensor as one [2*n_ff, d] GEMM. A gate-less
  FFN stores [n_ff, 1, d] (its up rows) and the same code runs with one row per neuron.
- down_t [n_ff, d]: PowerInfer's ffn_down_t, row i = neuron i's output column; the same index list selects it.
- Both live in anonymous memory advised for transparent huge pages: random neuron rows then cost no TLB misses.

Few tokens (T <= KERNEL_MAX_T, fp32) of an FFNWeights run the fp32 C++ kernel torch.ops.pinfer.ffn_sparse_rows when
the kernels are built (a K-quant model's float copy); without a compiler (or for half precision) torch's own kernels
do the same work:
- gate/up dot products with torch.sparse.sampled_addmm (SDDMM): a CSR pattern whose columns are the rows 2i, 2i+1 of
  gate_up viewed as [2*n_ff, d]; torch computes x . row for each stored column, in place, split across threads by
  CSR rows (the pattern is cut into one row per thread).
- down projection as an axpy, sum_i h_i * down_t[i], with F.embedding_bag(mode="sum", per_sample_weights=h).
  Few tokens (2 <= T < GATHER_MIN_T) use one CSR row / one bag per token.
More tokens gather the rows once into a reused workspace (index_select(out=)) and run GEMMs, which are
compute-efficient.

Measured (benchmarks/sparse_ops.py, Llama-7B layer, fp32, 2 threads, random 10% of neurons): dense 25.8 ms (21 GB/s,
MKL GEMV); the C++ kernel 2.8 ms (9.2x, 19 GB/s; 10x is the bytes bound), torch's kernels 4.2 ms (6.2x, 13 GB/s).
torch's row-gather kernels read one row at a time per thread with no lookahead; the kernel keeps 8 row streams in
flight per thread, as a dense GEMV does. Also tried with torch alone and slower: index_select(out=) + GEMV (9 GB/s),
chunked embedding_bag gathers + GEMV (3.5-9 GB/s), torch.compile (gate/up 14 GB/s, down 0.6-3 GB/s). fp32 beats
bf16/f16 on this CPU in absolute time, dense and sparse: torch's half-precision GEMV is compute-bound on two cores.
"""

from __future__ import annotations

import mmap
import threading
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.cpu import qops
from pinfer_llm.runtime.weights import QWeight

ACTIVATIONS = ("silu", "relu", "drelu")  # with a gate
GATELESS_ACTIVATIONS = ("relu", "gelu")  # without one (Falcon, OPT): act(up x + b)
ACT_CODES = {"silu": 0, "relu": 1, "drelu": 2}  # the act argument of torch.ops.pinfer.ffn_sparse_rows

# Tokens from which the sparse path gathers rows once and runs GEMMs instead of per-token SDDMM/axpy passes. Measured
# (benchmarks/sparse_ops.py --prefill, 1B shape, 2 threads): SDDMM/gather time = 1.17 (T=2, 10% dense) / 0.76 (30%),
# 1.51 / 1.14 at T=3, 1.44-1.79 / 1.01-1.41 for T=4..8.
GATHER_MIN_T = 3
# Tokens up to which the C++ kernel (runtime/cpu/csrc/cpu_kernels.cpp) runs, when it is built (fp32 only). Measured
# (benchmarks/sparse_ops.py --prefill, 1B shape, 2 threads): kernel time / gather+GEMM time = 0.41 / 0.34 at T = 1
# (10% / 30% of neurons), 0.51 / 0.46 at T = 8, 0.68 / 0.66 at 16, 0.82 / 0.86 at 24, 1.01 / 1.02 at 32, 1.44 at 64:
# it reads each row once and re-reads it from cache per token, which is compute-bound past ~30 tokens.
KERNEL_MAX_T = 24
SDDMM_DTYPES = (torch.float32, torch.float64)  # dtypes torch.sparse.sampled_addmm supports on the CPU
# Largest union density at which ffn_sparse still beats ffn_dense, by token count: the measured break-even
# (benchmarks/sparse_ops.py --prefill, 1B shape, 2 threads) less a 0.05 margin, since sparse that barely wins is not
# worth the risk. Linear in T between entries. With the C++ kernel the break-even was >= 0.9 (the grid's end) for
# T <= 8 (MKL's GEMM is slow for a few rows), then 0.73, 0.66, 0.58, 0.64, 0.76 at T = 16, 24, 32, 64, 128.
SPARSE_MAX_DENSITY = ((1, 0.85), (8, 0.85), (16, 0.68), (24, 0.61), (32, 0.53), (64, 0.59), (128, 0.71))
# The same with torch's kernels only (no compiler): 0.71, 0.54, 0.37, 0.46, 0.56, 0.47, 0.53, 0.64, 0.72 at
# T = 1, 2, 3, 4, 8, 16, 32, 64, 128.
SPARSE_MAX_DENSITY_TORCH = ((1, 0.65), (2, 0.50), (3, 0.35), (4, 0.40), (8, 0.45), (16, 0.45), (32, 0.50),
                            (64, 0.60), (128, 0.70))

with warnings.catch_warnings():  # torch warns once per process that CSR is "beta"; spend that warning here
    warnings.simplefilter("ignore")
    torch.sparse_csr_tensor(torch.zeros(2, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0),
                            size=(1, 1), check_invariants=False)


@dataclass(eq=False)
class FFNWeights:
    """One layer's FFN in the sparse-friendly layout. Build it with pack_ffn."""

    gate_up: torch.Tensor  # [n_ff, 2, d]: [:, 0] = gate rows, [:, 1] = up rows; gate-less: [n_ff, 1, d] up rows
    down_t: torch.Tensor  # [n_ff, d]: row i = neuron i's output column
    act: str  # "silu" (SwiGLU) | "relu" (ReGLU) | "drelu" (dReLU); gate-less: "relu" | "gelu"
    up_bias: torch.Tensor | None = None  # float32 [n_ff] (OPT)

    def __post_init__(self):
        g = self.rows_per_neuron
        # gate_up as the [d, g n_ff] operand sampled_addmm wants (a transposed view: rows stay contiguous)
        self.rows_t = self.gate_up.view(g * self.n_ff, self.n_embd).t()
        self.pair_rows = torch.arange(g * self.n_ff).view(self.n_ff, g)  # neuron i -> its rows (2i, 2i+1), or i
        self.all_idx = torch.arange(self.n_ff)
        self.code = qops.act_code(self.act, self.gated)

    @property
    def rows_per_neuron(self) -> int:
        return self.gate_up.shape[1]

    @property
    def gated(self) -> bool:
        return self.rows_per_neuron == 2

    @property
    def n_ff(self) -> int:
        return self.gate_up.shape[0]

    @property
    def n_embd(self) -> int:
        return self.gate_up.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype

    @property
    def gate(self) -> torch.Tensor | None:
        return self.gate_up[:, 0] if self.gated else None

    @property
    def up(self) -> torch.Tensor:
        return self.gate_up[:, -1]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down_t.nbytes


def _huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in anonymous memory advised for transparent huge pages (falls back to torch.empty)."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < 4 << 20 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mem.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP disabled: ordinary pages still work
    return torch.frombuffer(mem, dtype=dtype, count=numel).view(shape)  # the tensor keeps `mem` alive


def pack_ffn(gate, up, down, *, down_transposed: bool, act: str, dtype: torch.dtype | None = None,
             up_bias=None) -> FFNWeights:
    """Copy a layer's FFN matrices (numpy arrays or tensors, GGUF numpy shapes) into the sparse layout.

    gate, up: [n_ff, d]; gate None for a gate-less FFN (Falcon, OPT), which may have an up bias [n_ff]. down:
    [n_ff, d] if down_transposed (PowerInfer's ffn_down_t) else [d, n_ff] (ffn_down). dtype: storage/compute dtype
    (default: that of up). The copy is the only one made; sources may be mmap views.
    """
    allowed = ACTIVATIONS if gate is not None else GATELESS_ACTIVATIONS
    if act not in allowed:
        raise PinferError(f"unknown FFN activation '{act}' {'with' if gate is not None else 'without'} a gate "
                          f"(expected one of {', '.join(allowed)})")
    mats = [torch.as_tensor(t) for t in (gate, up) if t is not None]
    down = torch.as_tensor(down)
    dtype = dtype or mats[-1].dtype
    n_ff, d = mats[-1].shape
    down_shape = (n_ff, d) if down_transposed else (d, n_ff)
    if any(m.shape != (n_ff, d) for m in mats) or tuple(down.shape) != down_shape:
        raise PinferError(f"FFN shapes do not match: {'gate, ' if gate is not None else ''}up "
                          f"{[tuple(m.shape) for m in mats]}, down{'_t' if down_transposed else ''} "
                          f"{tuple(down.shape)} (expected {down_shape}); the model file is inconsistent")
    gate_up = _huge_empty((n_ff, len(mats), d), dtype)
    for j, m in enumerate(mats):
        gate_up[:, j].copy_(m)
    down_t = _huge_empty((n_ff, d), dtype)
    down_t.copy_(down if down_transposed else down.T)
    bias = None if up_bias is None else torch.as_tensor(up_bias).to(dtype).reshape(n_ff).contiguous()
    return FFNWeights(gate_up, down_t, act, bias)


@dataclass(eq=False)
class FFNRows:
    """One layer's FFN as the file stores it, neuron-major: row i of gate, up and down_t belongs to neuron i.
    down_t is PowerInfer's ffn_down_t (W_down transposed; runtime/loader.py makes one when the file has none)."""

    gate: QWeight | None  # None: a gate-less FFN (Falcon, OPT), act(up x + b), where up decides activity
    up: QWeight
    down_t: QWeight | None  # None in dense mode over a file that stores ffn_down (runtime.ffn.dense uses that)
    act: str  # "silu" | "relu" | "drelu" (gated); "relu" | "gelu" (gate-less)
    up_bias: torch.Tensor | None = None  # float32 [n_ff] (OPT)
    _packed: FFNWeights | None = field(default=None, repr=False)

    def __post_init__(self):
        self.code = qops.act_code(self.act, self.gate is not None)
        self.all_idx = torch.arange(self.n_ff)

    @property
    def n_ff(self) -> int:
        return self.up.rows

    @property
    def n_embd(self) -> int:
        return self.up.cols

    @property
    def kernels(self) -> bool:
        """Whether the C++ kernel reads these rows in place (else the float copy of packed() is used)."""
        return qops.kernels_for(self.gate, self.up, self.down_t)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (self.gate, self.up, self.down_t) if w is not None)

    def packed(self) -> FFNWeights:
        """The float32 copy the torch fallback computes on, made on first use."""
        if self._packed is None:
            if self.down_t is None:
                raise ValueError("no down_t rows: the loader builds FFNRows with down_t for sparse execution")
            self._packed = pack_ffn(None if self.gate is None else self.gate.dequantize(), self.up.dequantize(),
                                    self.down_t.dequantize(), down_transposed=True, act=self.act,
                                    up_bias=self.up_bias)
        return self._packed

    def pre_activations(self, x: torch.Tensor, idx: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(gate, up + bias) [T, k] of neurons idx (all by default) for x [T, d]; gate is None for gate-less FFNs.
        GEMMs over the weights (all neurons) or over the selected rows dequantised into a workspace: never a copy of
        a whole matrix."""
        ws = [w for w in (self.gate, self.up) if w is not None]
        if idx is None:
            a = qops.matmul(x, ws)  # (T, n_gates * n_ff): the gate block, then the up block
            k = self.n_ff
        else:
            k = idx.numel()
            a = F.linear(x.float(), torch.cat([qops.embed(w, idx) for w in ws]))
        u = a[:, -k:]
        if self.up_bias is not None:
            u = u + (self.up_bias if idx is None else self.up_bias[idx])
        return (a[:, :k] if self.gate is not None else None), u

    def hidden(self, x: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Activations h [T, k] of neurons idx (all by default)."""
        return activate(*self.pre_activations(x, idx), self.act)

    def down(self, h: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """sum_j h[:, j] * down_t[idx_j] -> [T, d] (idx: all neurons by default)"""
        if idx is None:
            return qops.matmul_t(h, self.down_t)
        return h.float() @ qops.embed(self.down_t, idx)


def activate(gate: torch.Tensor | None, up: torch.Tensor, act: str) -> torch.Tensor:
    """The FFN's hidden activation from its pre-activations; gate is None for gate-less FFNs (Falcon, OPT).
    SwiGLU goes through the C++ activation where the kernels are loaded: the C++ FFNs' silu is a vector exp of their
    own, a few ulps from torch's, and the torch-side users (pi-profile's layer by layer pass, the FFNs' torch paths)
    must compute what they compute."""
    if act == "silu" and gate is not None and _kernel_act(gate, up):
        return torch.ops.pinfer.ffn_act(gate.contiguous(), up.contiguous(), qops.act_code("silu", True))
    if gate is None:
        if act == "relu":  # ReluFalcon, OPT
            return F.relu(up)
        if act == "gelu":  # Falcon (exact erf form, as HF's "gelu")
            return F.gelu(up)
    elif act == "silu":  # SwiGLU (Llama, SmolLM2)
        return F.silu(gate) * up
    elif act == "relu":  # ReGLU (ReluLLaMA, ProSparse)
        return F.relu(gate) * up
    elif act == "drelu":  # dReLU (Bamboo)
        return F.relu(gate) * F.relu(up)
    raise ValueError(f"unknown FFN activation {act!r} {'with' if gate is not None else 'without'} a gate")


def _kernel_act(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (gate.dtype == up.dtype == torch.float32 and gate.device.type == up.device.type == "cpu"
            and qops.available())


def _activate(w: FFNWeights, a: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
    """a: (T, k, rows_per_neuron) pre-activations (gate, up) or (up,) of neurons idx (all by default) -> hidden
    activations (T, k)."""
    if w.gated:
        return activate(a[..., 0], a[..., 1], w.act)
    u = a[..., 0]
    if w.up_bias is not None:
        u = u + (w.up_bias if idx is None else w.up_bias[idx])
    return activate(None, u, w.act)


def ffn_dense(w: FFNRows | FFNWeights, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The whole FFN for x [T, d] -> [T, d]. keep: optional indices; every other neuron's activation is zeroed (the
    semantics of ffn_sparse)."""
    if isinstance(w, FFNRows):
        if not w.kernels:
            return ffn_dense(w.packed(), x, keep)
        if x.shape[0] <= KERNEL_MAX_T:  # the kernel over every neuron (or keep): each row read once, in place
            return _qffn(w, x, keep, None)[0]
        h = w.hidden(x)
        if keep is not None:
            h = h * _keep_mask(keep, w.n_ff)
        return w.down(h)
    g = w.rows_per_neuron
    a = F.linear(x, w.gate_up.view(g * w.n_ff, w.n_embd))  # (T, g n_ff), pairs (gate_i, up_i) or up_i alone
    h = _activate(w, a.view(-1, w.n_ff, g))  # (T, n_ff)
    if keep is not None:
        h = h * _keep_mask(keep, w.n_ff, h.dtype)
    return h @ w.down_t


def _keep_mask(keep: torch.Tensor, n_ff: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    mask = torch.zeros(n_ff, dtype=dtype)
    mask[keep] = 1
    return mask


def _qffn(w: FFNRows, x: torch.Tensor, idx: torch.Tensor | None, row_mask: torch.Tensor | None,
          cats: float = 0.0) -> tuple[torch.Tensor, int]:
    """torch.ops.pinfer.qffn_sparse over the rows in place: (y [T, d], nonzero (token, neuron) pairs)."""
    g = w.gate
    return torch.ops.pinfer.qffn_sparse(
        x.float().contiguous(), None if g is None else g.data, 0 if g is None else int(g.qtype), w.up.data,
        int(w.up.qtype), w.down_t.data, int(w.down_t.qtype), None if idx is None else idx.contiguous(),
        None if row_mask is None else row_mask.to(torch.bool).contiguous(), w.code, w.up_bias, cats)


def ffn_qrows(w: FFNRows, x: torch.Tensor, idx: torch.Tensor | None, row_mask: torch.Tensor | None) -> torch.Tensor:
    """The C++ kernel over the rows in place, whatever the token count: neurons idx (ascending; None: all), row t
    masked by row_mask[t] (None: none masked). Row t's result is the bits the kernel gives it alone over its own
    neurons (runtime/cpu/csrc/sparse_ffn.cpp, batch invariance)."""
    return _qffn(w, x, idx, row_mask)[0]


# --- sparse ------------------------------------------------------------------------------------------------------

class _Workspace(threading.local):
    """Per-thread scratch for the gathering path, grown on demand and reused (no page faults per call)."""

    def __init__(self):
        self.bufs: dict[tuple, torch.Tensor] = {}

    def get(self, key: str, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.bufs.get((key, width, dtype))
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty(max(rows, 64), width, dtype=dtype)
            self.bufs[(key, width, dtype)] = buf
        return buf[:rows]


_ws = _Workspace()


def _sddmm_gate_up(w: FFNWeights, x: torch.Tensor, idx: torch.Tensor, parts: int) -> torch.Tensor:
    """(T, k, g) gate/up pre-activations of neurons idx for every row of x (g = 2; 1 for gate-less FFNs, up alone),
    reading the rows in place.

    The CSR pattern has one row per token (T > 1) or, for one token, `parts` rows that split idx between threads
    (sampled_addmm parallelises over CSR rows). Few ops: at 10% of a 1B model's layer the whole call is ~1 ms."""
    T, k, g = x.shape[0], idx.numel(), w.rows_per_neuron
    cols = w.pair_rows[idx].view(-1)  # rows 2i, 2i+1 of gate_up viewed as [2 n_ff, d] (gate-less: row i)
    if T == 1 and parts > 1 and k >= 2 * parts:
        crow = torch.tensor([i * k // parts * g for i in range(parts + 1)])  # cut between (gate, up) pairs
        mat1 = x.expand(parts, -1).contiguous()
    else:
        parts = T
        crow = torch.tensor([i * g * k for i in range(T + 1)])
        cols = cols.repeat(T) if T > 1 else cols
        mat1 = x
    pattern = torch.sparse_csr_tensor(crow, cols, x.new_zeros(cols.numel()), size=(parts, g * w.n_ff),
                                      check_invariants=False)
    return torch.sparse.sampled_addmm(pattern, mat1, w.rows_t, beta=0.0).values().view(T, k, g)


_OFFSET0 = torch.zeros(1, dtype=torch.long)


def _axpy_down(w: FFNWeights, h: torch.Tensor, idx: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """sum_j h[t, j] * down_t[idx[j]] for every row t of h (T, k) -> (T, d), reading the rows in place.

    embedding_bag parallelises over bags: one token's index list is cut into `parts` bags whose sums are added."""
    T, k = h.shape
    if T == 1:
        ind = idx
        parts = parts if k >= 2 * parts else 1
        offsets = _OFFSET0 if parts == 1 else torch.tensor([i * k // parts for i in range(parts)])
    else:
        ind, offsets, parts = idx.repeat(T), torch.arange(0, T * k, k), 1
    # torch.embedding_bag skips F.embedding_bag's Python-side checks; mode 0 = sum
    out = torch.embedding_bag(w.down_t, ind, offsets, False, 0, False, h.reshape(-1))[0]
    return out if parts == 1 else out.sum(0, keepdim=True)


def kernel_applies(w: FFNWeights, T: int) -> bool:
    """Whether T tokens of this layer run through the C++ kernel (fp32, few tokens, kernels built)."""
    return T <= KERNEL_MAX_T and w.dtype == torch.float32 and cpu_kernels.available()


def _packed_kernel(w: FFNWeights, x: torch.Tensor, idx: torch.Tensor | None, row_mask: torch.Tensor | None
                   ) -> tuple[torch.Tensor, int]:
    """The C++ kernel over the float32 copy: ffn_sparse_rows for gated FFNs; gate-less ones (act 3, 4 with the up
    bias) go through qffn_sparse, which reads F32 rows in place as well (the up rows have a row stride of one row)."""
    rm = None if row_mask is None else row_mask.to(torch.bool).contiguous()
    if w.gated:
        return torch.ops.pinfer.ffn_sparse_rows(x.contiguous(), w.gate_up, w.down_t,
                                                w.all_idx if idx is None else idx.contiguous(), rm, ACT_CODES[w.act])
    f32 = int(GGMLQuantizationType.F32)
    return torch.ops.pinfer.qffn_sparse(x.float().contiguous(), None, 0, w.up, f32, w.down_t, f32,
                                        None if idx is None else idx.contiguous(), rm, w.code, w.up_bias, 0.0)


def ffn_sparse(w: FFNRows | FFNWeights, x: torch.Tensor, idx: torch.Tensor, *, threads: int | None = None,
               row_mask: torch.Tensor | None = None, use_kernels: bool = True) -> torch.Tensor:
    """The FFN for x [T, d] computed on neurons idx only (LongTensor, sorted or not, no duplicates): the dense FFN with
    every other neuron's activation set to zero. For ReLU variants and idx = every neuron that fires for any row
    (the union of the rows' masks), this equals ffn_dense exactly up to float rounding.
    row_mask: optional bool [T, len(idx)]; row t then also zeroes the neurons idx[j] where row_mask[t, j] is False.
    use_kernels: False forces torch's own kernels (tests and benchmarks compare the two)."""
    T = x.shape[0]
    k = idx.numel()
    if k == 0:
        return x.new_zeros(T, w.n_embd)
    if isinstance(w, FFNRows):
        if not (use_kernels and w.kernels):
            return ffn_sparse(w.packed(), x, idx, threads=threads, row_mask=row_mask, use_kernels=use_kernels)
        if T <= KERNEL_MAX_T:
            return _qffn(w, x, idx, row_mask)[0]
        h = w.hidden(x, idx)  # many tokens: the selected rows dequantised into a workspace, then GEMMs
        return w.down(h if row_mask is None else h * row_mask, idx)
    if use_kernels and kernel_applies(w, T):
        return _packed_kernel(w, x, idx, row_mask)[0]
    d, g = w.n_embd, w.rows_per_neuron
    parts = threads or torch.get_num_threads()
    if T < GATHER_MIN_T and w.dtype in SDDMM_DTYPES:
        a = _sddmm_gate_up(w, x, idx, parts)  # (T, k, g)
    else:  # sampled_addmm has no half-precision CPU kernel: gather the rows once, then one GEMM
        gu = torch.index_select(w.gate_up.view(w.n_ff, g * d), 0, idx, out=_ws.get("gate_up", k, g * d, w.dtype))
        a = F.linear(x, gu.view(g * k, d)).view(T, k, g)
    h = _activate(w, a, idx)  # (T, k)
    if row_mask is not None:
        h = h * row_mask
    if T < GATHER_MIN_T:
        return _axpy_down(w, h, idx, parts)
    down = torch.index_select(w.down_t, 0, idx, out=_ws.get("down", k, d, w.dtype))
    return h @ down


def ffn_exact(w: FFNRows | FFNWeights, x: torch.Tensor, cats: float = 0.0, idx: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, int] | None:
    """Exact sparse FFN of a few tokens through the C++ kernel over every neuron (or the neurons idx): for ReLU-family
    FFNs it reads each gate row and the other rows of the active neurons only (~40% of the dense bytes at 90%
    sparsity); for SwiGLU with a CATS threshold (cats > 0) the neurons with |silu(gate)| <= cats count as inactive.
    Returns (result, number of active (token, neuron) pairs), or None where the kernel does not apply (then mask and
    compute)."""
    if isinstance(w, FFNRows):
        if not w.kernels:
            return ffn_exact(w.packed(), x, cats, idx)
        if x.shape[0] > KERNEL_MAX_T or (w.act == "silu" and cats <= 0):
            return None
        return _qffn(w, x, idx, None, cats)
    if w.act in ("silu", "gelu") or not kernel_applies(w, x.shape[0]):
        return None  # SwiGLU (CATS): the masker computes the masks
    return _packed_kernel(w, x, idx, None)


# --- dense or sparse ---------------------------------------------------------------------------------------------

def sparse_max_density(T: int) -> float:
    """Largest fraction of active neurons (union over the T rows) at which ffn_sparse beats ffn_dense."""
    pts = SPARSE_MAX_DENSITY if KERNEL_MAX_T > 0 and cpu_kernels.available() else SPARSE_MAX_DENSITY_TORCH
    if T <= pts[0][0]:
        return pts[0][1]
    for (t0, d0), (t1, d1) in zip(pts, pts[1:], strict=False):
        if T <= t1:
            return d0 + (d1 - d0) * (T - t0) / (t1 - t0)
    return pts[-1][1]


def sparse_pays(T: int, n_active: int, n_ff: int) -> bool:
    return n_active <= sparse_max_density(T) * n_ff


def union_indices(mask: torch.Tensor) -> torch.Tensor:
    """Sorted indices of neurons active in any row of a bool mask [T, n_ff] (or [n_ff])."""
    m = mask if mask.dim() == 1 else mask.any(dim=0)
    return m.nonzero().view(-1)


def ffn_masked(w: FFNRows | FFNWeights, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Row t of x [T, d] computed on its own active neurons mask[t] (bool [T, n_ff]; the others zeroed), so a row's
    result never depends on the other rows of the batch. Runs on the union of the rows' masks by ffn_sparse, or by
    ffn_dense when the measured rule says the union is too dense for sparse to pay."""
    idx = union_indices(mask)
    if sparse_pays(x.shape[0], idx.numel(), w.n_ff):
        return ffn_sparse(w, x, idx, row_mask=mask[:, idx])
    if isinstance(w, FFNRows):
        if not w.kernels:
            return ffn_masked(w.packed(), x, mask)
        return w.down(w.hidden(x) * mask)
    g = w.rows_per_neuron
    a = F.linear(x, w.gate_up.view(g * w.n_ff, w.n_embd))  # (T, g n_ff)
    return (_activate(w, a.view(-1, w.n_ff, g)) * mask) @ w.down_t


def ffn_auto(w: FFNRows | FFNWeights, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The FFN on neurons idx (the union of the rows' masks), by ffn_sparse when the measured rule says it pays for
    this many tokens, else by ffn_dense with the other neurons zeroed: the result never depends on the choice."""
    if sparse_pays(x.shape[0], idx.numel(), w.n_ff):
        return ffn_sparse(w, x, idx)
    return ffn_dense(w, x, keep=idx)
