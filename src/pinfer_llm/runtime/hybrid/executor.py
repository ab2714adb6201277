"""Hybrid GPU+CPU execution: a Model whose parts run where a Placement (runtime/hybrid/placement.py) puts them.

Per layer, the GPU holds what the placement gives it, in the file's own encoding: the attention projections with
the layer's KV cache (f16, in device memory), the predictor, and the rows of its hottest FFN neurons (GPU row j is
neuron bucket[j]). The CPU holds the other neurons, and attention where the plan leaves it.

The residual stream stays where the work is. Through layers whose attention runs on the GPU it lives on the device,
and a decode step of such a layer with a split FFN crosses the bus twice:

    host                                          device
    y_cpu of the layer before  -- one copy -->    x += y_cpu
                                                  x += attention(norm(x))
                                                  scores = predictor(x); the CPU's active neurons
                               <-- one copy --    [norm(x), x, count, ids]
    y_cpu = FFN over the CPU's active neurons     x += FFN over the GPU's active rows (at the same time)

Through layers whose attention runs on the CPU the stream lives on the host: x goes up, the active ids come back
before the device's rows are launched, and the device's partial sum comes back after them (three copies). A layer
whose FFN the CPU holds entirely, or the GPU, crosses less (none for a layer wholly on the GPU). What crosses at one
point is laid side by side in one device buffer and one page-locked host buffer (Link), copied asynchronously on the
hybrid's own stream; the host waits on an event for what it needs, so the CPU's neurons run while the GPU's do.

A decode step of a device layer is captured once as a CUDA graph and replayed (HybridTransformer._graph_step, on a
device that can: CudaDevice; runtime/gpu/graph.py): the host writes what goes up into the page-locked buffer, launches
the graph (copy up, the layer's kernels, the copy down of the normed input with the CPU's count and first
found_cap ids, an event node, the device's FFN rows) and waits on the event: two driver calls per split layer,
where eager queueing made ~20. The position is read from device memory, attention runs on a grid for the whole
cache, scratch comes from a workspace every graph shares; a graph is captured again when what it was captured over
changes (the layer's parts after a replan, a staging buffer reallocated for a longer prompt, the residual's buffer).
Prompts, the first step in a new state and timed runs (--gpu-timing) queue launch by launch.

The result equals the CPU's sparse FFN with the same masks: every neuron is computed exactly once, on one side, with
the same activation rule (tests/test_hybrid.py, with a CPU stand-in device and with the CUDA kernels under emulation).

Measured on an H200 with 8 CPU threads before this layout of copies (benchmarks/gpu_e2e.py, Llama2-13B-shaped F16,
12 GiB budget, pi-plan's placement): 20.3 tokens/s, of which per token 37.5 ms on the CPU, 10.2 ms in copies (~5
synchronous copies per layer then) and 1.7 ms waiting for the GPU. See docs/gpu.md.

The device is runtime.gpu.CudaDevice (CuPy) on a real GPU, or runtime.gpu.ReferenceDevice (torch on the CPU) as the
stand-in the tests use.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.planner.memory import GPU_CHUNK
from pinfer_llm.runtime.ffn.dense import DenseFFN
from pinfer_llm.runtime.ffn.ops import FFNRows, ffn_exact, ffn_masked, ffn_sparse
from pinfer_llm.runtime.ffn.predictor import as_float
from pinfer_llm.runtime.ffn.sparse import CatsOracleMasker, PredictorMasker, SparseFFN, SparsityStats
from pinfer_llm.runtime.gpu.timing import Timeline
from pinfer_llm.runtime.gpu.weights import STORED_PREDICTOR_TYPES
from pinfer_llm.runtime.hybrid.placement import GIB, Placement
from pinfer_llm.runtime.linear import Linear
from pinfer_llm.runtime.model import Norm, Transformer
from pinfer_llm.runtime.weights import QWeight, rows_runnable

ALIGN = 256  # bytes: where each part of a staging buffer starts


@dataclass
class Split:
    """Host time spent waiting for the GPU (for a result, or an event after a copy) and staging and queueing copies,
    summed over the decode steps since the last reset; the rest of a step's time is CPU work (pi-run --json reports
    the three per token). Copies are asynchronous, so the time a copy spends on the bus shows as waiting. With a
    timeline (apply(..., timing=True)) also the device's own time: computing and copying, from CUDA events."""

    gpu_wait_s: float = 0.0
    transfer_s: float = 0.0
    timeline: Timeline | None = None

    def reset(self) -> None:
        self.gpu_wait_s = self.transfer_s = 0.0
        if self.timeline is not None:
            self.timeline.reset()

    def per_token(self, total_s: float, steps: int) -> dict:
        n = max(steps, 1)
        cpu = max(total_s - self.gpu_wait_s - self.transfer_s, 0.0)
        out = {"cpu_ms": round(1e3 * cpu / n, 3), "gpu_wait_ms": round(1e3 * self.gpu_wait_s / n, 3),
               "transfer_ms": round(1e3 * self.transfer_s / n, 3)}
        if self.timeline is not None:
            sec = self.timeline.collect()
            out |= {"gpu_compute_ms": round(1e3 * sec["compute"] / n, 3),
                    "gpu_copy_ms": round(1e3 * sec["copy"] / n, 3)}
        return out


class _Span:
    def __init__(self, split: Split, field: str):
        self.split, self.field = split, field

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        setattr(self.split, self.field, getattr(self.split, self.field) + time.perf_counter() - self.t0)


class Bus:
    """The host<->device traffic of a hybrid model: the one stream all its device work is queued on, and the time
    the host spends on copies and waits."""

    def __init__(self, dev):
        self.dev, self.stream, self.split = dev, dev.stream(), Split()
        self._norms: dict[int, DeviceNorm] = {}
        self._links: dict[str, Link] = {}
        self.touched: list | None = None  # while a step is captured: (link, its buffers' generation) it used

    def event(self):
        """An event after the work queued so far (in a capture: one that fires at each replay)."""
        return self.dev.graph_event(self.stream) if self.touched is not None else self.stream.record()

    def link(self, role: str) -> Link:
        """The staging buffers for one crossing point of a layer, shared by every layer: layers run one after
        another, and each consumes what it fetched and has waited past what it sent before the next one refills the
        same buffers (tests/strict_device.py checks this under CUDA's timing rules). One set per role instead of one
        per layer: a 70B model's sets for 32-token passes held ~550 MB of VRAM, and as much page-locked memory."""
        got = self._links.get(role)
        if got is None:
            got = self._links[role] = Link(self)
        return got

    def norm(self, n: Norm) -> DeviceNorm:
        """The device's copy of a norm, one per Norm (attention, FFN and the host-residual path share it; so do
        Falcon 7B's two branches). DeviceNorm keeps n alive, so its id is not reused."""
        d = self._norms.get(id(n))
        if d is None:
            d = self._norms[id(n)] = DeviceNorm(self.dev, n)
        return d


class Link:
    """The parts that cross the bus together at one point of a layer, side by side in one device buffer and one
    page-locked host buffer of the same size, so that they cross in one copy. The device writes its parts straight
    into their views (layout -> device views; fetch; wait -> host views); the host fills its parts and sends them
    (put -> device views). Buffers grow for a longer chunk of tokens, never shrink; host views stay valid until the
    link is used again (by the next layer), so a caller keeping a result copies it."""

    def __init__(self, bus: Bus):
        self.bus, self.dev, self.cap, self.used = bus, bus.dev, 0, 0
        self.gen = 0  # counts the buffers' reallocations: a captured step that used older ones is captured again
        self.host: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, int] = {}
        self.event = None
        self._parts: dict | None = None  # the last layout, whose views are reused while it repeats (each decode step)

    def layout(self, **parts) -> dict:
        """parts: name=(shape, dtype). Returns the device views by name."""
        if self.bus.touched is not None:
            self.bus.touched.append((self, self.gen))
        if parts == self._parts:
            return self._views
        offs, n = {}, 0
        for name, (shape, dtype) in parts.items():
            offs[name] = n
            n += -(-math.prod(shape) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
        if n > self.cap or not self.cap:  # (a copy may still read the old buffers: let it finish first)
            self.bus.stream.synchronize()
            self.gen += 1
            self.cap = max(n, 2 * self.cap, ALIGN)
            self.d = self.dev.empty((self.cap,), np.uint8)
            self.h = self.dev.pinned((self.cap,), np.uint8)
        self.used = n
        self._whole = self.dev.view(self.d, 0, (n,), np.uint8), self.h[:n]
        self._views, self.host = {}, {}
        for name, (shape, dtype) in parts.items():
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            self._views[name] = self.dev.view(self.d, offs[name], shape, dtype)
            self.host[name] = torch.from_numpy(self.h[offs[name]:offs[name] + nbytes].view(dtype).reshape(shape))
        self._parts, self.offsets = parts, offs
        return self._views

    def put(self, **tensors: torch.Tensor) -> dict:
        """Copy host tensors to the device in one copy; returns their device views."""
        with _Span(self.bus.split, "transfer_s"):
            views = self.fill(**tensors)
            self.send()
        return views

    def fill(self, **tensors: torch.Tensor) -> dict:
        """put()'s host half: lay out the parts and write the tensors into the page-locked buffer."""
        views = self.layout(**{k: (tuple(t.shape), _NP[t.dtype]) for k, t in tensors.items()})
        for k, t in tensors.items():
            self.host[k].copy_(t)
        return views

    def send(self) -> None:
        """put()'s copy: the page-locked buffer to the device."""
        self.dev.to_device_async(self._whole[1], self._whole[0], self.bus.stream)

    def fetch(self, upto: int | None = None) -> None:
        """Queue the copy of every part (or of the first `upto` bytes) to the host, after the work queued so far."""
        with _Span(self.bus.split, "transfer_s"):
            whole = self._whole if upto is None else (self.dev.view(self.d, 0, (upto,), np.uint8), self.h[:upto])
            self.dev.to_host_async(*whole, self.bus.stream)
            self.event = self.bus.event()

    def wait(self) -> dict[str, torch.Tensor]:
        with _Span(self.bus.split, "gpu_wait_s"):
            self.event.synchronize()
        return self.host


_NP = {torch.float32: np.float32, torch.int32: np.int32, torch.uint8: np.uint8}


def found_cap(n_ff: int) -> int:
    """How many of the CPU's active neuron ids a decode step's copy down brings (with their count): an eighth of the
    layer, at least 32. A step that selects more fetches the rest in a second copy, after waiting."""
    return min(n_ff, max(32, -(-n_ff // 8)))


def _stored_on_device(pred) -> bool:
    """Whether the device keeps this predictor as stored (a Q4_0/Q4_1/Q8_0 fc2), not as transposed F16."""
    return isinstance(pred.fc2, QWeight) and int(pred.fc2.qtype) in STORED_PREDICTOR_TYPES


def _upload_predictor(dev, p):
    if _stored_on_device(p):
        fc1 = (p.fc1.data.numpy(), int(p.fc1.qtype), p.fc1.cols) if isinstance(p.fc1, QWeight) else \
            as_float(p.fc1).numpy()
        return dev.upload_predictor(fc1, (p.fc2.data.numpy(), int(p.fc2.qtype), p.fc2.cols))
    return dev.upload_predictor(as_float(p.fc1).numpy(), as_float(p.fc2).numpy())


def predictor_device_bytes(pred) -> int:
    """VRAM a predictor takes on the device, in the form _upload_predictor gives it (runtime/gpu/weights.py)."""
    r, d = pred.fc1.shape if isinstance(pred.fc1, torch.Tensor) else (pred.fc1.rows, pred.fc1.cols)
    n_ff = pred.fc2.shape[0] if isinstance(pred.fc2, torch.Tensor) else pred.fc2.rows
    if _stored_on_device(pred):
        return (pred.fc1.nbytes if isinstance(pred.fc1, QWeight) else 2 * r * d) + pred.fc2.nbytes
    return 2 * -(-r // 32) * 32 * (d + n_ff)  # F16, hidden units padded to 32


def _host(a) -> np.ndarray:
    return np.ascontiguousarray(a.detach().float().numpy() if isinstance(a, torch.Tensor) else a, dtype=np.float32)


def _upload(dev, w: QWeight, rows=None):  # rows: an index array gathering some rows
    w = rows_runnable(w)  # the device's kernels read the row types: a K-quant, IQ4 or Q5_* matrix goes as Q4_1 / Q8_0
    return dev.upload_matrix(w.data.numpy(), int(w.qtype), w.cols, rows)


class DeviceNorm:
    """RMSNorm, or LayerNorm with its bias (Falcon, OPT), on the device."""

    def __init__(self, dev, norm: Norm):
        self.dev, self.norm = dev, norm
        self.w = dev.asarray(_host(norm.w))
        self.b = None if norm.b is None else dev.asarray(_host(norm.b))

    def __call__(self, x, out=None, add=None, copy=None):
        """norm(x); with add, x += add first (in place); with copy, copy = x (after the add). One launch."""
        if self.norm.layer:
            return self.dev.layer_norm(x, self.w, self.b, self.norm.eps, out=out, add=add, copy=copy)
        return self.dev.rms_norm(x, self.w, self.norm.eps, out=out, add=add, copy=copy)


class DeviceAttention:
    """One layer's attention on the device: Q/K/V and output projections as the file stores them, their biases (OPT),
    RoPE in the model's order (llama pairs, NeoX halves for Falcon, none for OPT), the KV cache in device memory (f16)
    and attention over it. Q, K and V of one type are one device matrix (Falcon's attn_qkv as it is; llama's three
    stacked), so a token's projections are one launch over all their rows. heads() takes the normed hidden state on
    the device; project() adds the output projection (biases included) into the residual."""

    def __init__(self, dev, bus: Bus, cfg, b, max_ctx: int):
        self.dev, self.cfg = dev, cfg
        self.norm = bus.norm(b.attn_norm)
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        self.bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]  # q, k, v columns of the projections' output
        ws, bias = [rows_runnable(w) for w in b.wqkv.ws], b.bqkv
        if len({(int(w.qtype), w.cols) for w in ws}) == 1:
            raw = ws[0].data.numpy() if len(ws) == 1 else np.concatenate([w.data.numpy() for w in ws])
            self.parts = [(dev.upload_matrix(raw, int(ws[0].qtype), ws[0].cols),
                           None if bias is None else dev.asarray(_host(bias)))]
        else:  # types differ (a mixed quantisation): one matrix each
            self.parts = [(_upload(dev, w), None if bias is None else dev.asarray(_host(bias[lo:hi])))
                          for w, (lo, hi) in zip(ws, self.bounds, strict=True)]
        self.wo = _upload(dev, b.wo.ws[0])
        self.bo = None if b.bo is None else dev.asarray(_host(b.bo))
        self.k_cache, self.v_cache = dev.kv_cache(cfg.n_head_kv, max_ctx, cfg.head_dim)
        self.rope = dict(n_rot=0 if cfg.rope == "none" else cfg.head_dim, neox=cfg.rope == "neox",
                         base=cfg.rope_base, rope_scale=cfg.rope_scale)

    def heads(self, xa, pos: int, pos_at=None):
        """The attention heads' output [T, n_head * head_dim] for the normed input xa [T, d], cache written. pos_at:
        the position in device memory (a captured step)."""
        cfg, dev, T = self.cfg, self.dev, xa.shape[0]
        outs = [dev.matmul(w, xa, bias=bias) for w, bias in self.parts]
        if len(outs) == 1:  # q, k, v side by side: one token's column blocks are contiguous, more tokens' are copied
            y = outs[0]
            outs = [y[:, lo:hi] if T == 1 else dev.copy(y[:, lo:hi], dev.empty((T, hi - lo))) for lo, hi in self.bounds]
        q, k, v = (a.reshape(T, n, cfg.head_dim) for a, n in zip(outs, (cfg.n_head, cfg.n_head_kv, cfg.n_head_kv),
                                                                 strict=True))
        o = dev.attention(q, k, v, self.k_cache, self.v_cache, pos, pos_at=pos_at, **self.rope)
        return o.reshape(T, cfg.n_head * cfg.head_dim)

    def project(self, o, out):
        """out += o @ wo^T (+ bo)."""
        return self.dev.matmul(self.wo, o, bias=self.bo, out=out, accumulate=True)


class DeviceLinear:
    """The output head on the device: logits [T, vocab] of the normed hidden state, fetched in one copy."""

    def __init__(self, dev, bus: Bus, lin: Linear):
        self.dev, self.link = dev, bus.link("logits")
        self.ws = [_upload(dev, w) for w in lin.ws]

    def __call__(self, xn) -> torch.Tensor:
        T = xn.shape[0]
        views = self.link.layout(**{f"w{i}": ((T, w.rows), np.float32) for i, w in enumerate(self.ws)})
        for i, w in enumerate(self.ws):
            self.dev.matmul(w, xn, out=views[f"w{i}"])
        self.link.fetch()
        parts = list(self.link.wait().values())
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).clone()


class HybridFFN:
    """One layer's FFN split by neuron: the device computes the neurons of `bucket`, the CPU the others, and the
    partial outputs are added. Which neurons are active follows the layer's masker exactly as on the CPU:
    predicted masks are applied on both sides (the device reads the same scores), exact masks (ReLU, CATS, dense) are
    decided by each side's own gate rows.

    The parts a layer's step is made of, in the order they are queued: predict() (the predictor on the device),
    launch() (the device's rows, for predicted masks once the scores are on the device), host() (the CPU's rows)."""

    def __init__(self, inner: SparseFFN | DenseFFN, rows: FFNRows, dev, bus: Bus, bucket: np.ndarray,
                 pred_on_gpu: bool, norm: Norm):
        self.inner, self.rows, self.dev, self.bus = inner, rows, dev, bus
        self.masker = inner.masker if isinstance(inner, SparseFFN) else None
        self.stats = inner.stats if isinstance(inner, SparseFFN) else SparsityStats()
        self.act, self.n_ff = rows.act, rows.n_ff
        on_gpu = np.zeros(rows.n_ff, dtype=bool)
        on_gpu[np.asarray(bucket, np.int64)] = True
        self.cpu_mask = torch.from_numpy(~on_gpu)
        self.cpu_idx = torch.from_numpy(np.flatnonzero(~on_gpu))
        self.cpu_holds = bool(self.cpu_idx.numel())
        up, g, dt = rows_runnable(rows.up), None if rows.gate is None else rows_runnable(rows.gate), rows.down_t
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
        self.predicted = isinstance(self.masker, PredictorMasker)
        self.host_works = self.cpu_holds or (self.predicted and not pred_on_gpu)  # its neurons, or the mask
        self.pred = None
        if pred_on_gpu and self.predicted:
            self.pred = _upload_predictor(dev, self.masker.pred)
            self.skip = dev.asarray(on_gpu.astype(np.uint8))
            always = self.masker.always
            self.always = None if always is None else dev.asarray(always.numpy().astype(np.int32))
        self.norm = bus.norm(norm)  # for a residual stream on the host: the device norms x itself
        self.up_link, self.ids_link, self.out_link = bus.link("ffn up"), bus.link("ffn ids"), bus.link("ffn sum")
        # The device counts its own rows of a decode step with its predictor (and the step), so that the layer's
        # share of active neurons counts both sides without a copy per step; read when the stats are.
        self.active_dev = dev.zeros((2,), np.int32) if self.pred is not None and self.gpu is not None else None
        self.stats = _BothSides(self.stats, self) if self.active_dev is not None else self.stats

    def predict(self, r, found=None):
        """The device's predictor over the residual r [T, d]: scores [T, n_ff] for the device's rows, and into
        `found` the CPU's active neurons (the union over the tokens) when the CPU holds any."""
        m, T = self.masker, r.shape[0]
        thr = m.pred.threshold
        scores, _ = self.dev.predict(self.pred, r, threshold=thr, skip=self.skip, ids=True, found=found)
        if self.always is not None:
            self.dev.set_cols(scores.reshape(T, -1), self.always, float("inf"))
        return scores

    def launch(self, xf, out, scores=None) -> None:
        """Queue the device's rows over the normed input xf [T, d], added into out [T, d]. scores: the device
        predictor's, or a host mask's sent as 0/1 (threshold 0.5), or None for exact masks (each row's own gate)."""
        if self.gpu is None:
            return
        m = self.masker
        if scores is None:
            thr, cats = 0.0, (m.threshold if isinstance(m, CatsOracleMasker) else None)
        else:
            thr, cats = (m.pred.threshold if self.pred is not None else 0.5), None
            # the device's rows, where the host does not count the whole mask (a prompt's, beside neurons of its own)
            if self.pred is not None and (xf.shape[0] == 1 or not self.cpu_holds):
                self.dev.count_active(self.gpu, scores, thr, self.active_dev)
        self.dev.ffn(self.gpu, xf, scores=scores, threshold=thr, cats=cats, out=out)  # the device chunks tokens

    def host(self, xf: torch.Tensor, resid: torch.Tensor, found: torch.Tensor | None, send) -> torch.Tensor | None:
        """The CPU's rows for the normed input xf and residual resid (host tensors [T, d]); None when the CPU holds
        no neuron. found: the device predictor's [count, ids...]. send(mask): a host mask's part for the device
        (the predictor on the CPU), called before the CPU's rows are computed so that both sides run at once."""
        m, T = self.masker, xf.shape[0]
        if self.predicted and self.pred is not None:
            if not self.cpu_holds:
                return None
            if T == 1:
                f = found.numpy()  # numpy's slice and cast: a fifth of torch's host time
                ids = torch.from_numpy(f[1:1 + int(f[0])].astype(np.int64))
                if m.always is not None:
                    ids = torch.unique(torch.cat([ids, m.always[self.cpu_mask[m.always]]]))
                # the CPU's neurons; the device counts its own, and the step, where it holds any
                self.stats.add_counts(int(self.active_dev is None), int(ids.numel()))
                return ffn_sparse(self.rows, xf, ids)
            mask = m(self.rows, xf, resid)  # the device's ids are the union over the tokens: each keeps its own
            self.stats.add(mask)
            return ffn_masked(self.rows, xf, mask & self.cpu_mask)
        if self.predicted:  # the predictor on the CPU: its mask, sent to the device's rows
            if T == 1:
                mask = torch.zeros(1, self.n_ff, dtype=torch.bool)
                mask[0, m.indices(self.rows, xf, resid)] = True
            else:
                mask = m(self.rows, xf, resid)
            self.stats.add(mask)
            if self.gpu is not None:
                send(mask)
            cpu = mask & self.cpu_mask
            if not self.cpu_holds:
                return None
            return ffn_sparse(self.rows, xf, cpu[0].nonzero().view(-1)) if T == 1 else ffn_masked(self.rows, xf, cpu)
        if not self.cpu_holds:
            return None
        # dense, exact ReLU or exact CATS masks: the CPU decides for its own neurons (the kernels' gate-first pass)
        cats = m.threshold if isinstance(m, CatsOracleMasker) else 0.0
        done = ffn_exact(self.rows, xf, cats, idx=self.cpu_idx) if m is not None else None
        if done is not None:
            y, active = done
            self.stats.add_counts(T, active)  # the CPU's neurons; the device does not count its own
            return y
        if m is None:  # dense
            return ffn_sparse(self.rows, xf, self.cpu_idx)
        mask = m(self.rows, xf, resid)  # exact masks without the kernel: decide every neuron here
        self.stats.add(mask)
        return ffn_masked(self.rows, xf, mask & self.cpu_mask)

    def __call__(self, xf: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """The layer's FFN for a residual stream on the host: x up (the device norms it), the CPU's active ids back
        before the device's rows are queued, the device's partial sum back after them."""
        dev, T, d = self.dev, xf.shape[0], self.rows.n_embd
        pred = self.pred is not None
        y_gpu = None if self.gpu is None else dev.zero(self.out_link.layout(y=((T, d), np.float32))["y"])
        found = None
        if pred:
            r = self.up_link.put(r=resid.contiguous())["r"]
            if self.cpu_holds:
                found = self.ids_link.layout(found=((1 + self.n_ff,), np.int32))["found"]
            scores = self.predict(r, found)
            if found is not None:
                self.ids_link.fetch()
            if self.gpu is not None:
                self.launch(self.norm(r), y_gpu, scores)
        elif not self.predicted and self.gpu is not None:  # exact masks: each side decides by its own rows
            self.launch(self.up_link.put(xf=xf.contiguous())["xf"], y_gpu)
        early = y_gpu is not None and (pred or not self.predicted)
        if early:
            self.out_link.fetch()

        def send(mask):  # the CPU's predictor decided: the device's rows go with its mask
            s = self.up_link.put(xf=xf.contiguous(), s=mask.float())
            self.launch(s["xf"], y_gpu, s["s"])
            self.out_link.fetch()

        y = self.host(xf, resid, None if found is None else self.ids_link.wait()["found"], send)
        if y_gpu is not None:
            y_gpu = self.out_link.wait()["y"]
            y = y_gpu.clone() if y is None else y + y_gpu
        return torch.zeros(T, d) if y is None else y


class _BothSides:
    """A split FFN's SparsityStats: the host's counts (what the CPU computed; a prompt's whole masks) plus what the
    device counted of its decode steps (its rows and the steps: HybridFFN.active_dev), read from the device, after
    the queued work, whenever tokens or active are read (at the end of a run, not per step). int32 on the device:
    2^31 (token, row) pairs per layer, ~155,000 tokens of a 13824-neuron layer."""

    def __init__(self, host: SparsityStats, ffn: HybridFFN):
        self.host, self.ffn = host, ffn

    def add(self, mask: torch.Tensor) -> None:
        self.host.add(mask)

    def add_counts(self, tokens: int, active: int) -> None:
        self.host.add_counts(tokens, active)

    def _device(self) -> np.ndarray:
        self.ffn.bus.stream.synchronize()
        return self.ffn.dev.to_numpy(self.ffn.active_dev)

    @property
    def tokens(self) -> int:
        return self.host.tokens + int(self._device()[1])

    @property
    def active(self) -> int:
        return self.host.active + int(self._device()[0])


class HybridTransformer:
    """The model's forward pass with its parts on the device where the placement puts them (module docstring);
    everything else (the KV cache of host layers, embeddings, blocks, stats) is the wrapped Transformer's."""

    def __init__(self, tr: Transformer, dev, bus: Bus, head: DeviceLinear | None):
        self.tr, self.dev, self.bus, self.head = tr, dev, bus, head
        # the stream sent up where it was on the host (it then lives in this buffer while it stays on the device), the
        # host's share of the layer before sent up, a device layer's FFN input sent down, the stream sent down
        self.x_link, self.add_link = bus.link("stream up"), bus.link("share up")
        self.ffn_link, self.out_link = bus.link("ffn down"), bus.link("stream down")
        self.ffn_norm = [bus.norm(b.ffn_norm) if b.attn_dev is not None else None for b in tr.blocks]
        self.ffn_bias = [None if b.attn_dev is None or b.ffn_bias is None else dev.asarray(_host(b.ffn_bias))
                         for b in tr.blocks]
        self.out_norm = bus.norm(tr.output_norm) if head is not None else None
        self.pos_link = bus.link("position")  # a decode step's position, read by the captured steps' attention
        self._graphs: dict[int, _Graph] = {}  # device layer -> its captured decode step

    def __getattr__(self, name):
        return getattr(self.tr, name)

    def forward(self, tokens: torch.Tensor, pos: int, all_logits: bool = False) -> torch.Tensor:
        # GPU_CHUNK tokens at a time: the device's buffers for activations grow with the tokens of a pass, and the
        # planner kept only gpu_scratch_bytes free for them (by that bound a 13B model's 4096-token prompt in one pass
        # would take 6.5 GB). The KV caches make passes over consecutive chunks one pass; the head reads only the last.
        n = tokens.numel()
        logits = [self._forward(tokens[s:s + GPU_CHUNK], pos + s, all_logits or s + GPU_CHUNK >= n, all_logits)
                  for s in range(0, n, GPU_CHUNK)]
        if self.bus.split.timeline is not None:  # the pass's work is done: its events are read and reused
            self.bus.split.timeline.collect()
        return torch.cat([g for g in logits if g is not None]) if all_logits else logits[-1]

    def _forward(self, tokens: torch.Tensor, pos: int, head: bool, all_logits: bool) -> torch.Tensor | None:
        x = _Residual(self.tr.embed(tokens, pos))
        with self.bus.stream:
            # a decode step replays each device layer's captured step; they read the position from the device
            graphs = tokens.numel() == 1 and self.dev.can_capture and pos < self.tr.max_ctx
            if graphs:
                self.pos_link.fill(pos=torch.tensor([pos], dtype=torch.int32))
                self.pos_link.send()
            for li, b in enumerate(self.tr.blocks):
                if b.attn_dev is not None:
                    q = self._graph_step(li, b, x, pos) if graphs else None
                    if q is None:
                        xd, add = self._on_device(x)
                        q = self._queue_layer(li, b, xd, add, pos)
                    self._finish_layer(b, x, q)
                else:
                    self._host_layer(li, b, x, pos)
            if not head:  # a chunk before the last: its residual stream is not needed; what it queued must be done
                self.bus.stream.synchronize()  # before the next chunk refills the page-locked buffers
                return None
            return self._head(x, all_logits)

    def _host_layer(self, li: int, b, x: _Residual, pos: int) -> None:
        tr = self.tr
        xf, resid, y = tr.attend(li, b, self._on_host(x), pos)
        x.host = y + tr.ffn(b, xf, resid)  # a HybridFFN crosses the bus itself

    def _queue_layer(self, li: int, b, xd, add, pos: int, pos_at=None) -> _Queued:
        """Queue a device layer's work on the device, the copy down of what the host needs and its event included:
        everything up to the host's wait (a captured step is this, replayed)."""
        dev, att, ffn = self.dev, b.attn_dev, b.ffn
        T, d = xd.shape
        xa = att.norm(xd, add=add)  # the host's share of the layer before goes into the residual here
        if b.parallel:  # Falcon: the FFN reads the layer input, attention is added after it was read
            o = att.heads(xa, pos, pos_at)
        else:
            att.project(att.heads(xa, pos, pos_at), out=xd)
        hf = ffn if isinstance(ffn, HybridFFN) else None
        q = _Queued(xd, hf, hf is None or hf.host_works)
        link = self.ffn_link
        parts = {"xf": ((T, d), np.float32)} if q.cpu_work else {}
        # the residual goes down for what reads it: a host FFN's masker, the CPU's predictor, a prompt's masks
        if q.cpu_work and (hf is None or hf.pred is None or T > 1):
            parts["r"] = ((T, d), np.float32)
        if hf is not None and hf.pred is not None and hf.cpu_holds:
            parts["found"] = ((1 + hf.n_ff,), np.int32)  # last: a decode step's copy stops after found_cap ids
        views = link.layout(**parts) if parts else {}
        xf = views.get("xf")
        r = views.get("r")
        if b.parallel and b.ffn_norm is b.attn_norm:  # Falcon 7B: one norm for both branches
            xf = xa if xf is None else dev.copy(xa, xf)
            if r is not None:
                dev.copy(xd, r)
        else:
            xf = self.ffn_norm[li](xd, out=xf, copy=r)  # the residual for the host in the same launch
        q.xf, q.found = xf, views.get("found")
        scores = hf.predict(xd, q.found) if hf is not None and hf.pred is not None else None
        if q.cpu_work:
            upto = None
            if q.found is not None and T == 1:
                q.cap = found_cap(hf.n_ff)
                upto = link.offsets["found"] + 4 * (1 + q.cap)
            link.fetch(upto)
            q.event, q.host = link.event, link.host
        if b.parallel:
            att.project(o, out=xd)
        if hf is not None and (hf.pred is not None or not hf.predicted):
            hf.launch(xf, xd, scores)  # the device's rows, into the residual, while the CPU computes its own
        if not q.cpu_work and self.ffn_bias[li] is not None:  # the down bias of an FFN wholly on the device (OPT)
            dev.add(xd, self.ffn_bias[li], out=xd)
        return q

    def _finish_layer(self, b, x: _Residual, q: _Queued) -> None:
        """The host's part of a device layer, once its device work is queued: wait for what came down, the CPU's
        neurons (the device's run meanwhile), and their sum left pending for the next layer to send up."""
        if not q.cpu_work:
            return
        hf = q.hf
        with _Span(self.bus.split, "gpu_wait_s"):
            q.event.synchronize()
        h = q.host
        found = h.get("found")
        if q.cap is not None and int(found.numpy()[0]) > q.cap:  # more ids than the first copy brought: the rest now
            n = int(found.numpy()[0])
            with _Span(self.bus.split, "gpu_wait_s"):
                self.dev.to_host_async(q.found[1 + q.cap:1 + n], found.numpy()[1 + q.cap:1 + n], self.bus.stream)
                self.bus.stream.record().synchronize()

        def send(mask):  # the CPU's predictor decided: its mask for the device's rows
            hf.launch(q.xf, q.xd, hf.up_link.put(s=mask.float())["s"])

        y = hf.host(h["xf"], h.get("r"), found, send) if hf is not None else b.ffn(h["xf"], h["r"])
        if b.ffn_bias is not None:
            y = b.ffn_bias if y is None else y + b.ffn_bias
        x.pending = y

    def _graph_step(self, li: int, b, x: _Residual, pos: int) -> _Queued | None:
        """A decode step of device layer li through its captured graph: what comes up is written into the page-locked
        buffer, and one graph launch does the rest up to the host's wait (the copy up, the layer's device work, the
        copy down, its event, the device's FFN rows). None: run this step eagerly instead (the first step in a new
        state, which warms buffers and kernels so that nothing allocates or compiles while capturing)."""
        if x.dev is None:
            mode, link, tensor = "up", self.x_link, x.host
        elif x.pending is not None:
            mode, link, tensor = "add", self.add_link, x.pending
        else:
            mode, link, tensor = None, None, None
        deps = (mode, b.attn_dev, b.ffn, getattr(b.ffn, "gpu", None), None if mode == "up" else x.dev)
        g = self._graphs.get(li)
        if g is None or not g.matches(deps):
            self._graphs[li] = _Graph(deps)  # seen once: eager now, captured next time
            return None
        t0 = time.perf_counter()
        if g.graph is None:
            self._capture(g, b, link, tensor, li, pos)
        elif tensor is not None:
            g.fill.copy_(tensor)
        self.dev.launch_graph(g.graph, self.bus.stream)
        self.bus.split.transfer_s += time.perf_counter() - t0
        if mode == "up":
            x.dev, x.host = g.q.xd, None
        x.pending = None
        return g.q

    def _capture(self, g: _Graph, b, link: Link | None, tensor, li: int, pos: int) -> None:
        bus, dev = self.bus, self.dev
        if link is not None:
            view = link.fill(**{"x" if link is self.x_link else "p": tensor})
            g.fill = next(iter(link.host.values()))
        touched = [(self.pos_link, self.pos_link.gen)] + ([(link, link.gen)] if link is not None else [])
        bus.touched = touched
        dev.begin_capture(bus.stream)
        try:
            xd, add = (g.deps[4], None) if link is None else (
                (view["x"], None) if link is self.x_link else (g.deps[4], view["p"]))
            if link is not None:
                link.send()
            g.q = self._queue_layer(li, b, xd, add, pos, self.pos_link.layout(pos=((1,), np.int32))["pos"])
            g.graph = dev.end_capture(bus.stream)
        except BaseException:
            dev.abort_capture(bus.stream)
            self._graphs.pop(li, None)
            raise
        finally:
            bus.touched = None
        g.links = list({id(link): (link, gen) for link, gen in touched}.values())

    def _on_device(self, x: _Residual):
        """x on the device, and on the device what the host still has to add to it (or None): one copy (the whole
        stream when it was on the host, else the host's share of the last FFN). The caller's norm adds it into x in
        its own launch (DeviceNorm add=). The stream then lives in x_link's device buffer until it goes down
        (_on_host), which is the next time x_link is filled."""
        add = None
        if x.dev is None:
            x.dev, x.host = self.x_link.put(x=x.host.contiguous())["x"], None
        elif x.pending is not None:
            add = self.add_link.put(p=x.pending.contiguous())["p"]
            x.pending = None
        return x.dev, add

    def _on_host(self, x: _Residual) -> torch.Tensor:
        if x.host is None:
            self.dev.copy(x.dev, self.out_link.layout(x=(tuple(x.dev.shape), np.float32))["x"])
            self.out_link.fetch()
            h = self.out_link.wait()["x"].clone()
            x.host, x.dev = (h if x.pending is None else h + x.pending), None
            x.pending = None
        return x.host

    def _head(self, x: _Residual, all_logits: bool) -> torch.Tensor:
        tr = self.tr
        if self.head is None:
            h = self._on_host(x)
            h = h if all_logits else h[-1:]
            return tr.output(tr.norm(h, tr.output_norm))
        if x.dev is None:  # the stream on the host: the rows the head reads go up
            h = x.host if all_logits else x.host[-1:]
            xd = self.x_link.put(x=h.contiguous())["x"]
            return self.head(self.out_norm(xd))
        xd, add = self._on_device(x)
        if not all_logits:  # only the last row is read: only its sum is made
            xd, add = xd[-1:], None if add is None else add[-1:]
        return self.head(self.out_norm(xd, add=add))


class _Queued:
    """What a device layer's queued work leaves for the host part: the residual and normed input on the device, the
    event after the copy down and the host views it fills, the CPU's ids on the device and how many came down."""

    def __init__(self, xd, hf, cpu_work: bool):
        self.xd, self.hf, self.cpu_work = xd, hf, cpu_work
        self.xf = self.found = self.event = self.cap = None
        self.host: dict = {}


class _Graph:
    """A device layer's captured decode step and what it was captured over: replayed only while the layer's parts
    (attention, FFN, the device's rows: a replan replaces them), the residual's buffer and every staging buffer it
    used (they are reallocated when a longer prompt needs more) are the same objects."""

    def __init__(self, deps: tuple):
        self.deps, self.graph, self.q, self.fill = deps, None, None, None
        self.links: list = []

    def matches(self, deps: tuple) -> bool:
        mine = self.deps
        if mine[0] != deps[0] or mine[1] is not deps[1] or mine[2] is not deps[2] or mine[3] is not deps[3] or \
                mine[4] is not deps[4]:
            return False
        for link, gen in self.links:
            if link.gen != gen:
                return False
        return True


class _Residual:
    """The residual stream x [T, d] of one forward pass, where the last layer left it: on the host, or on the device
    with `pending`, the host's share of the last FFN (its neurons' sum, and a down bias) still to add."""

    def __init__(self, host: torch.Tensor):
        self.host, self.dev, self.pending = host, None, None


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
            total += predictor_device_bytes(masker.pred)
    if placement.output:
        total += tr.output.nbytes
    return total


def _rows(ffn) -> FFNRows:
    return ffn.w if isinstance(ffn, SparseFFN) else ffn.rows  # DenseFFN, HybridFFN


def apply(model, placement: Placement, dev, *, budget: int | None = None, timing: bool = False) -> Split:
    """Move the parts `placement` puts on the GPU onto `dev` and run the model through a HybridTransformer; returns
    the Split that accumulates the host's time per category (with `timing`, the device's too: runtime/gpu/timing.py).
    Raises a one-line PinferError when the parts do not fit `budget`."""
    from pinfer_llm.runtime.loader import transposed

    tr = model.transformer
    need = device_bytes(tr, placement, tr.max_ctx)
    if budget is not None and need > budget:
        raise PinferError(f"the placement needs {need / GIB:.2f} GiB of VRAM for its weights and KV cache, the budget "
                          f"is {budget / GIB:.2f} GiB; lower --ctx-size or choose --placement layers|cpu")
    bus = Bus(dev)
    try:
        for li, b in enumerate(tr.blocks):
            if placement.attn[li]:
                b.attn_dev = DeviceAttention(dev, bus, tr.cfg, b, tr.max_ctx)
                tr.cache.free(li)
            bucket = placement.buckets[li]
            if len(bucket) or placement.pred[li]:
                rows = _rows(b.ffn)
                if rows.down_t is None:  # dense mode over a file with ffn_down: neuron-major rows for both halves
                    rows.down_t = transposed(b.ffn.down.ws[0])
                b.ffn = HybridFFN(b.ffn, rows, dev, bus, bucket, bool(placement.pred[li]), b.ffn_norm)
        head = DeviceLinear(dev, bus, tr.output) if placement.output else None
    except MemoryError as e:  # CuPy's OutOfMemoryError is one: VRAM the budget counted on is held by someone else
        within = "" if budget is None else f", within the budget of {budget / GIB:.2f} GiB"
        raise PinferError(f"out of GPU memory while loading the placement ({need / GIB:.2f} GiB{within}) onto "
                          f"{getattr(dev, 'name', 'the GPU')}: {str(e).splitlines()[0] if str(e) else 'no detail'}; "
                          f"free the GPU, or pass a lower --vram-budget or --placement layers|cpu") from None
    model.transformer = HybridTransformer(tr, dev, bus, head)
    dev.synchronize()  # the uploads ran on the default stream; the hybrid's own stream does not wait for it
    if timing:
        bus.split.timeline = dev.start_timeline()
    return bus.split
