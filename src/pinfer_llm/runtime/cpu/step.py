"""One token's decode step through every layer and the output head in one C++ call (runtime/cpu/csrc/step.cpp).

The Python forward (runtime/model.py) runs a token through a layer as a dozen dispatched ops, each with its own
tensors: for SmolLM2 (30 layers of 576) about 100 us of Python per layer and token against ~200 us of kernels
(issue #26). The step is built once per model from the same weights, caches and kernels, and makes the same kernel
calls in the same order, so its logits are the forward's to the bit (tests/test_decode_step.py). The forward stays
the reference and runs prefill, the torch fallback, and anything the step does not cover: a layer whose attention
or FFN neurons are on a GPU, an FFN wrapped by a profiler, a weight type without a kernel, an exact-mask SwiGLU
without a CATS threshold. `build` returns None there, and the forward runs as before.

Per layer the step holds: the two norms, the fused QKV matrices (+ bias), the cache rows, the output projection
(+ bias), and the FFN as one of three kinds (csrc/kernels.h FfnKind): FFN_MM (DenseFFN over ffn_down), FFN_ROWS
(qffn_sparse over every neuron: DenseFFN over PowerInfer's ffn_down_t, exact ReLU masks, CATS) or FFN_PRED (the
predictor's indices, then qffn_sparse over them). The hybrid executor's CPU half can reuse the FFN part for the
neurons it owns: FFN_PRED over a layer's CPU rows is qffn_sparse with the index list its predictor leaves the CPU.

PINFER_DECODE_STEP=0 turns the step off (the forward runs every token), for comparisons. With several threads the
step runs each token on one team of threads meeting at barriers (csrc/step.cpp decode_team) instead of forking the
pool per operation; PINFER_DECODE_TEAM=0, or OMP_WAIT_POLICY=passive (its barriers spin), turns that off (the same
bits).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable

import torch

from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.cpu import qops
from pinfer_llm.runtime.ffn import ops as ffn_ops
from pinfer_llm.runtime.ffn.dense import DenseFFN
from pinfer_llm.runtime.ffn.sparse import CatsOracleMasker, PredictorMasker, ReluOracleMasker, SparseFFN

FFN_MM, FFN_ROWS, FFN_PRED = 0, 1, 2  # csrc/kernels.h FfnKind


def enabled() -> bool:
    return os.environ.get("PINFER_DECODE_STEP", "1") != "0"


def team_enabled() -> bool:
    """The team step's barriers spin (then yield) while they wait: not where the user asked OpenMP's threads to sleep
    (OMP_WAIT_POLICY=passive), nor with PINFER_DECODE_TEAM=0."""
    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
    return os.environ.get("PINFER_DECODE_TEAM", "1") != "0" and not passive


def _mats(lin) -> tuple[list[torch.Tensor], list[int]] | None:
    if not lin.in_kernel:
        return None
    return [w.data for w in lin.ws], [int(w.qtype) for w in lin.ws]


def _ffn_args(b) -> tuple | None:
    """(kind, gate, up, down, act code, up_bias, cats, predictor masker or None) for the step, or None."""
    ffn = b.ffn
    if type(ffn) is DenseFFN:
        r = ffn.rows
        if ffn.down is None:
            return (FFN_ROWS, r, r.down_t, 0.0, None) if r.kernels else None
        if len(ffn.down.ws) != 1 or not qops.kernels_for(r.gate, r.up, *ffn.down.ws):
            return None
        return FFN_MM, r, ffn.down.ws[0], 0.0, None
    if type(ffn) is not SparseFFN or not ffn.w.kernels or ffn_ops.KERNEL_MAX_T < 1:
        return None  # KERNEL_MAX_T < 1: the forward masks and computes in torch (tests compare the two)
    r, m = ffn.w, ffn.masker
    if type(m) is PredictorMasker:
        return (FFN_PRED, r, r.down_t, 0.0, m) if m.pred.kernel_args() is not None else None
    if type(m) is ReluOracleMasker and r.act != "silu":
        return FFN_ROWS, r, r.down_t, 0.0, None
    if type(m) is CatsOracleMasker and r.act == "silu" and m.threshold > 0:
        return FFN_ROWS, r, r.down_t, float(m.threshold), None
    return None


class DecodeStep:
    """The step of one Transformer, valid while its blocks keep the FFN and attention objects it was built from
    (`matches`)."""

    def __init__(self, tr, native, blocks_sig: list, sparse_stats: list):
        self.native, self.sig, self.sparse_stats = native, blocks_sig, sparse_stats
        self.slots = {id(tr.cache): (0, tr.cache)}  # KV cache -> its slot in the native step (held, so ids stay unique)

    def matches(self, blocks) -> bool:
        return len(blocks) * 2 == len(self.sig) and all(map(operator.is_, self.sig, _objects(blocks)))

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x [1, d] float32 (the token's embedding) at position pos -> logits [1, vocab]; writes the KV cache."""
        logits = self.native.run(x.float().contiguous(), pos)
        self._count(1)
        return logits

    def rows(self, x: torch.Tensor, pos: torch.Tensor, caches: list, out_rows: torch.Tensor,
             launch: Callable[[], None] | None = None) -> torch.Tensor:
        """x [T, d] float32, row t at position pos[t] of KV cache caches[t] (runtime/model.py KVCache) -> logits of the
        rows out_rows [k] ([k, vocab]); writes the caches. Each row's bits are its `__call__`'s alone. launch: called
        just before the kernels start (Transformer.forward_rows says why)."""
        slot = torch.tensor([self._slot(c) for c in caches], dtype=torch.long)
        x = x.float().contiguous()
        if launch is not None:
            launch()
        logits = self.native.run_rows(x, pos, slot, out_rows)
        self._count(x.shape[0])
        return logits

    def _slot(self, cache) -> int:
        got = self.slots.get(id(cache))
        if got is None:
            got = self.slots[id(cache)] = (self.native.add_cache(cache.k, cache.v), cache)
        return got[0]

    def _count(self, tokens: int) -> None:
        if self.sparse_stats:
            active = self.native.take_active().tolist()
            read, calls = self.native.take_read().tolist()
            for li, st in self.sparse_stats:
                st.add_counts(tokens, active[li])
                if calls[li]:
                    st.add_read(calls[li], read[li])


def _objects(blocks):
    for b in blocks:
        yield b.ffn
        yield b.attn_dev


def signature(tr) -> list:
    return list(_objects(tr.blocks))


def build(tr, ns: str = cpu_kernels.NAMESPACE) -> DecodeStep | None:
    """The decode step of Transformer tr over the kernels of torch namespace ns, or None where it does not apply
    (see the module's docstring)."""
    if not (enabled() and qops.available()):
        return None
    cls = getattr(getattr(torch.classes, ns), "DecodeStep", None)
    if cls is None or not _mats(tr.output) or tr.output_norm is None:
        return None
    cfg = tr.cfg
    native = cls(cfg.n_embd, cfg.n_head, cfg.n_head_kv, tr.scale, cfg.rope == "neox", tr.rope_cs.contiguous())
    sparse = []
    for li, b in enumerate(tr.blocks):
        qkv, wo, ffn = _mats(b.wqkv), _mats(b.wo), _ffn_args(b)
        kc, vc = tr.cache.k[li], tr.cache.v[li]
        if b.attn_dev is not None or qkv is None or wo is None or ffn is None or kc is None:
            return None
        n = b.attn_norm
        native.add_attention(n.w, n.b, n.eps, n.layer, *qkv, b.bqkv, *wo, b.bo, kc, vc, b.parallel)
        if not (b.parallel and b.ffn_norm is b.attn_norm):
            n = b.ffn_norm
            native.set_ffn_norm(n.w, n.b, n.eps, n.layer)
        kind, r, down, cats, masker = ffn
        g = r.gate
        native.set_ffn(kind, None if g is None else g.data, 0 if g is None else int(g.qtype), r.up.data,
                       int(r.up.qtype), down.data, int(down.qtype), r.code, r.up_bias, cats, b.ffn_bias)
        if masker is not None:
            (w1, t1), (w2, t2), transposed = masker.pred.kernel_args()
            always = None if masker.always is None else masker.always.to(torch.long).contiguous()
            native.set_predictor(w1, t1, w2, t2, transposed, masker.pred.threshold, always)
        if type(b.ffn) is SparseFFN:
            sparse.append((li, b.ffn.stats))
    n = tr.output_norm
    native.set_output(n.w, n.b, n.eps, n.layer, *_mats(tr.output))
    native.set_team(team_enabled())
    return DecodeStep(tr, native, signature(tr), sparse)
