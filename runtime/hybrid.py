"""Hybrid GPU+CPU execution: a Model whose parts run where a Placement (runtime/placement.py) puts them.

Per layer, the GPU holds what the placement gives it, in the file's own encoding: the attention projections with
the layer's KV cache (f16, in device memory), the predictor, and the rows of its hottest FFN neurons (GPU row j is
neuron bucket[j]). The CPU keeps everything else and the residual stream. A decode step of a split layer whose
predictor is on the GPU:

    host                                       device
    x (residual)      --- upload x (d floats) -->
                                                scores = predictor(x); ids of the active neurons the CPU holds
                      <-- count, ids ---------
                                                y_gpu = FFN over norm(x) on the GPU rows whose score passes (async)
    y_cpu = FFN over norm(x) on those ids       (the C++ kernels, concurrently)
    x += y_cpu + y_gpu <-- download y_gpu -----

With the predictor on the CPU the host sends the scores instead of receiving ids. Attention on the GPU is the same
shape (the normed x up, its output down). The result equals the CPU's sparse FFN with the same masks: every neuron is
computed exactly once, on one side, with the same activation rule (tests/test_hybrid.py, with a CPU stand-in device
and with the CUDA kernels under emulation).

Measured on an H200 with 8 CPU threads (benchmarks/gpu_e2e.py, Llama2-13B-shaped F16, 12 GiB budget, pi-plan's
placement): 20.3 tokens/s, of which per token 37.5 ms on the CPU (its cold neurons and this Python orchestration),
10.2 ms in copies (~7 small transfers per layer) and 1.7 ms waiting for the GPU. The next steps are fewer, batched
copies (pinned buffers) and one CUDA graph per decode step; see README "GPU".

The device is runtime.gpu.CudaDevice (CuPy) on a real GPU, or runtime.gpu.ReferenceDevice (torch on the CPU) as the
stand-in the tests use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from formats.errors import PinferError

from .ffn_dense import DenseFFN
from .ffn_sparse import CatsOracleMasker, PredictorMasker, SparseFFN, SparsityStats
from .linear import Linear
from .model import Norm
from .placement import GIB, Placement
from .predictor import as_float
from .sparse_ops import FFNRows, ffn_exact, ffn_masked, ffn_sparse
from .weights import QWeight

DEVICE_T = 8  # tokens per device FFN launch (the GPU kernels loop over at most this many tokens)


@dataclass
class Split:
    """Host time spent waiting for the GPU and in host<->device copies, summed over the decode steps since the last
    reset; the rest of a step's time is CPU work (pi-run --json reports the three per token)."""

    gpu_wait_s: float = 0.0
    transfer_s: float = 0.0

    def reset(self) -> None:
        self.gpu_wait_s = self.transfer_s = 0.0

    def per_token(self, total_s: float, steps: int) -> dict:
        n = max(steps, 1)
        cpu = max(total_s - self.gpu_wait_s - self.transfer_s, 0.0)
        return {"cpu_ms": round(1e3 * cpu / n, 3), "gpu_wait_ms": round(1e3 * self.gpu_wait_s / n, 3),
                "transfer_ms": round(1e3 * self.transfer_s / n, 3)}


class _Span:
    def __init__(self, split: Split, field: str):
        self.split, self.field = split, field

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        setattr(self.split, self.field, getattr(self.split, self.field) + time.perf_counter() - self.t0)


def _host(a) -> np.ndarray:
    return np.ascontiguousarray(a.detach().float().numpy() if isinstance(a, torch.Tensor) else a, dtype=np.float32)


class Uploader:
    """Moves hidden vectors between host and device, and times the copies and the waits."""

    def __init__(self, dev, split: Split):
        self.dev, self.split = dev, split

    def up(self, x: torch.Tensor):
        with _Span(self.split, "transfer_s"):
            return self.dev.asarray(_host(x))

    def down(self, a, dtype=np.float32) -> torch.Tensor:
        with _Span(self.split, "gpu_wait_s"):
            self.dev.synchronize()
        with _Span(self.split, "transfer_s"):
            return torch.from_numpy(np.asarray(self.dev.to_numpy(a), dtype=dtype))


def _upload(dev, w: QWeight, rows=None):  # rows: an index array gathering some rows
    return dev.upload_matrix(w.data.numpy(), int(w.qtype), w.cols, rows)


class DeviceAttention:
    """One layer's attention on the device: Q/K/V and output projections as the file stores them (Falcon's fused
    attn_qkv uploaded as its three row blocks), their biases (OPT), RoPE in the model's order (llama pairs, NeoX
    halves for Falcon, none for OPT), the KV cache in device memory (f16) and attention over it. Input: the normed
    hidden state; output: the attention output, biases included."""

    def __init__(self, dev, io: Uploader, cfg, b, max_ctx: int):
        self.dev, self.io, self.cfg = dev, io, cfg
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        bounds = (0, q, q + kv, q + 2 * kv)  # q, k, v rows of the projection's output
        ws = b.wqkv.ws
        if len(ws) == 1:  # fused: gather each block's rows into its own device matrix
            self.wq, self.wk, self.wv = (_upload(dev, ws[0], np.arange(lo, hi, dtype=np.int32))
                                         for lo, hi in zip(bounds, bounds[1:], strict=False))
        else:
            self.wq, self.wk, self.wv = (_upload(dev, w) for w in ws)
        bias = b.bqkv
        self.bq, self.bk, self.bv = ((None,) * 3 if bias is None else
                                     (dev.asarray(_host(bias[lo:hi])) for lo, hi in zip(bounds, bounds[1:],
                                                                                       strict=False)))
        self.wo = _upload(dev, b.wo.ws[0])
        self.bo = None if b.bo is None else dev.asarray(_host(b.bo))
        self.k_cache, self.v_cache = dev.kv_cache(cfg.n_head_kv, max_ctx, cfg.head_dim)
        self.rope = dict(n_rot=0 if cfg.rope == "none" else cfg.head_dim, neox=cfg.rope == "neox",
                         base=cfg.rope_base, rope_scale=cfg.rope_scale)

    def __call__(self, xn: torch.Tensor, pos: int) -> torch.Tensor:
        cfg, dev, T = self.cfg, self.dev, xn.shape[0]
        x = self.io.up(xn)
        q = dev.matmul(self.wq, x, bias=self.bq).reshape(T, cfg.n_head, cfg.head_dim)
        k = dev.matmul(self.wk, x, bias=self.bk).reshape(T, cfg.n_head_kv, cfg.head_dim)
        v = dev.matmul(self.wv, x, bias=self.bv).reshape(T, cfg.n_head_kv, cfg.head_dim)
        o = dev.attention(q, k, v, self.k_cache, self.v_cache, pos, **self.rope)
        return self.io.down(dev.matmul(self.wo, o.reshape(T, cfg.n_head * cfg.head_dim), bias=self.bo))


class DeviceLinear:
    """A linear layer on the device (the output head)."""

    def __init__(self, dev, io: Uploader, lin: Linear):
        self.dev, self.io = dev, io
        self.ws = [_upload(dev, w) for w in lin.ws]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xd = self.io.up(x)
        outs = [self.io.down(self.dev.matmul(w, xd)) for w in self.ws]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class HybridFFN:
    """One layer's FFN split by neuron: the device computes the neurons of `bucket`, the CPU the others, and the
    partial outputs are added. Which neurons are active follows the layer's masker exactly as on the CPU:
    predicted masks are applied on both sides (the device reads the same scores), exact masks (ReLU, CATS, dense) are
    decided by each side's own gate rows."""

    def __init__(self, inner: SparseFFN | DenseFFN, rows: FFNRows, dev, io: Uploader, bucket: np.ndarray,
                 pred_on_gpu: bool, norm: Norm):
        self.inner, self.rows, self.dev, self.io = inner, rows, dev, io
        self.masker = inner.masker if isinstance(inner, SparseFFN) else None
        self.stats = inner.stats if isinstance(inner, SparseFFN) else SparsityStats()
        self.act, self.n_ff = rows.act, rows.n_ff
        on_gpu = np.zeros(rows.n_ff, dtype=bool)
        on_gpu[np.asarray(bucket, np.int64)] = True
        self.cpu_mask = torch.from_numpy(~on_gpu)
        self.cpu_idx = torch.from_numpy(np.flatnonzero(~on_gpu))
        up, g, dt = rows.up, rows.gate, rows.down_t
        if g is not None and g.qtype != up.qtype:
            raise PinferError(f"{g.name} and {up.name} have different types ({g.type_name}, {up.type_name}); the "
                              f"GPU FFN needs gate and up in one type")
        self.gpu = None
        if on_gpu.any():
            self.gpu = dev.upload_ffn(up.data.numpy(), dt.data.numpy(), int(up.qtype), up.cols,
                                      np.flatnonzero(on_gpu).astype(np.int32), act=rows.code,
                                      gate=None if g is None else g.data.numpy(),
                                      up_bias=None if rows.up_bias is None else rows.up_bias.numpy(),
                                      down_ty=int(dt.qtype))
        self.pred = None
        if pred_on_gpu and isinstance(self.masker, PredictorMasker):
            p = self.masker.pred
            self.pred = dev.upload_predictor(as_float(p.fc1).numpy(), as_float(p.fc2).numpy())
            self.skip = dev.asarray(on_gpu.astype(np.uint8))
            # the device norms the residual itself (RMSNorm, or LayerNorm with bias for Falcon and OPT)
            self.norm = norm
            self.norm_w = dev.asarray(_host(norm.w))
            self.norm_b = None if norm.b is None else dev.asarray(_host(norm.b))
            always = self.masker.always
            self.always = None if always is None else dev.asarray(always.numpy().astype(np.int64))

    def __call__(self, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        m = self.masker
        if isinstance(m, PredictorMasker):
            if self.pred is not None:
                return self._predicted_on_gpu(x, resid)
            if x.shape[0] == 1:  # one token: the fused predictor's ids
                mask = torch.zeros(1, self.n_ff, dtype=torch.bool)
                mask[0, m.indices(self.rows, x, resid)] = True
            else:
                mask = m(self.rows, x, resid)
            return self._masked(x, mask)
        return self._exact(x, resid)

    def _masked(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Both sides apply `mask` [T, n_ff]: the device reads it as scores >= 0.5."""
        self.stats.add(mask)
        y_gpu = self._launch(x, mask.float(), 0.5, None)
        cpu = mask & self.cpu_mask
        y = ffn_sparse(self.rows, x, cpu[0].nonzero().view(-1)) if x.shape[0] == 1 else ffn_masked(self.rows, x, cpu)
        return y + self._collect(y_gpu)

    def _exact(self, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """Dense, exact ReLU or exact CATS masks: each side decides by its own rows (the kernels' gate-first pass)."""
        m = self.masker
        cats = m.threshold if isinstance(m, CatsOracleMasker) else 0.0
        y_gpu = self._launch(x, None, 0.0, cats or None)
        done = ffn_exact(self.rows, x, cats, idx=self.cpu_idx) if m is not None else None
        if done is not None:
            y, active = done
            self.stats.add_counts(x.shape[0], active)  # the CPU's neurons; the device does not count its own
        elif m is None:  # dense
            y = ffn_sparse(self.rows, x, self.cpu_idx)
        else:  # exact masks without the kernel: decide every neuron here, compute the CPU's
            mask = m(self.rows, x, resid)
            self.stats.add(mask)
            y = ffn_masked(self.rows, x, mask & self.cpu_mask)
        return y + self._collect(y_gpu)

    def _predicted_on_gpu(self, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """The predictor runs on the device: its scores feed the device's rows directly, and the ids of the active
        neurons the CPU holds come back."""
        dev, m, T = self.dev, self.masker, x.shape[0]
        thr = m.pred.threshold
        rd = self.io.up(resid)  # one upload: the predictor reads the residual, the FFN rows its norm
        scores, found = dev.predict(self.pred, rd, threshold=thr, skip=self.skip, ids=True)
        if self.always is not None:
            scores.reshape(T, -1)[:, self.always] = float("inf")
        y_gpu = self._launch(x, scores, thr, None, xd=self._device_norm(rd) if self.gpu else None)
        found = self.io.down(found, np.int32)  # count and ids in one copy
        cpu_ids = found[1:1 + int(found[0])].long()
        if m.always is not None:
            cpu_ids = torch.unique(torch.cat([cpu_ids, m.always[self.cpu_mask[m.always]]]))
        if T == 1:
            self.stats.add_counts(1, int(cpu_ids.numel()))  # the CPU's neurons; the device does not count its own
            y = ffn_sparse(self.rows, x, cpu_ids)
        else:  # the device's ids are the union over the tokens: each token keeps its own mask
            mask = m(self.rows, x, resid)
            self.stats.add(mask)
            y = ffn_masked(self.rows, x, mask & self.cpu_mask)
        return y + self._collect(y_gpu)

    def _device_norm(self, rd):
        if self.norm.layer:
            return self.dev.layer_norm(rd, self.norm_w, self.norm_b, self.norm.eps)
        return self.dev.rms_norm(rd, self.norm_w, self.norm.eps)

    def _launch(self, x: torch.Tensor, scores, threshold: float, cats, xd=None):
        """Start the device's part (asynchronous on a real GPU); None when it holds no neurons. scores: a host
        tensor [T, n_ff], a device array, or None (every GPU row, decided by its own gate). xd: x on the device
        already (else it is uploaded)."""
        if self.gpu is None:
            return None
        dev, T = self.dev, x.shape[0]
        xd = self.io.up(x) if xd is None else xd
        if isinstance(scores, torch.Tensor):
            scores = self.io.up(scores)
        out = dev.zeros((T, self.rows.n_embd))
        for a in range(0, T, DEVICE_T):
            b = min(a + DEVICE_T, T)
            s = None if scores is None else scores.reshape(T, -1)[a:b]
            dev.ffn(self.gpu, xd[a:b], scores=s, threshold=threshold, cats=cats, out=out[a:b])
        return out

    def _collect(self, y_gpu) -> torch.Tensor | float:
        return 0.0 if y_gpu is None else self.io.down(y_gpu)


def device_bytes(tr, placement: Placement, max_ctx: int) -> int:
    """VRAM the placement's parts take on the device: weights as stored, the KV cache (f16), predictors."""
    cfg = tr.cfg
    kv = 2 * cfg.n_head_kv * max_ctx * cfg.head_dim * 2
    total = 0
    for li, b in enumerate(tr.blocks):
        if placement.attn[li]:
            total += b.wqkv.nbytes + b.wo.nbytes + kv
        rows = _rows(b.ffn)
        k = len(placement.buckets[li])
        if k:
            down_bytes = rows.down_t.row_bytes if rows.down_t is not None else rows.up.row_bytes  # made on apply
            total += k * sum(w.row_bytes for w in (rows.gate, rows.up) if w is not None) + k * down_bytes
        masker = getattr(b.ffn, "masker", None)
        if placement.pred[li] and isinstance(masker, PredictorMasker):
            total += masker.pred.nbytes
    if placement.output:
        total += tr.output.nbytes
    return total


def _rows(ffn) -> FFNRows:
    return ffn.w if isinstance(ffn, SparseFFN) else ffn.rows  # DenseFFN, HybridFFN


def apply(model, placement: Placement, dev, *, budget: int | None = None) -> Split:
    """Move the parts `placement` puts on the GPU onto `dev` and wrap the model's layers; returns the Split that
    accumulates the host's time per category. Raises a one-line PinferError when the parts do not fit `budget`."""
    from .loader import transposed

    tr = model.transformer
    need = device_bytes(tr, placement, tr.max_ctx)
    if budget is not None and need > budget:
        raise PinferError(f"the placement needs {need / GIB:.2f} GiB of VRAM for its weights and KV cache, the budget "
                          f"is {budget / GIB:.2f} GiB; lower --ctx-size or choose --placement layers|cpu")
    split = Split()
    io = Uploader(dev, split)
    for li, b in enumerate(tr.blocks):
        if placement.attn[li]:
            b.attn_dev = DeviceAttention(dev, io, tr.cfg, b, tr.max_ctx)
            tr.cache.free(li)
        bucket = placement.buckets[li]
        if len(bucket) or placement.pred[li]:
            rows = _rows(b.ffn)
            if rows.down_t is None:  # dense mode over a file with ffn_down: neuron-major rows for both halves
                rows.down_t = transposed(b.ffn.down.ws[0])
            b.ffn = HybridFFN(b.ffn, rows, dev, io, bucket, bool(placement.pred[li]), b.ffn_norm)
    if placement.output:
        tr.output = DeviceLinear(dev, io, tr.output)
    return split
