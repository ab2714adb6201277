"""CudaDevice: pinfer's GPU kernels (kernels/*.cu) through CuPy. Interface: see the package docstring.

CuPy is imported when a device is made, never at module import, so the package loads on machines without it.
Kernels compile on first use with NVRTC (cupy.RawModule, one module per .cu, quant.cuh inlined by sources.py) and
CuPy caches the binaries (~/.cupy/kernel_cache), so a process pays each module's compilation once per machine.
Launches go to CuPy's current stream: run a hybrid step's GPU work inside `with dev.stream() as s:`.
"""

from __future__ import annotations

import math
import os

import numpy as np

from pinfer_llm.planner import memory as _mem
from pinfer_llm.runtime.gpu import layout
from pinfer_llm.runtime.gpu.graph import Capture, driver_record_external
from pinfer_llm.runtime.gpu.sources import source
from pinfer_llm.runtime.gpu.timing import Timeline
from pinfer_llm.runtime.gpu.weights import (
    GATED,
    FFNRows,
    Matrix,
    PredictorWeights,
    act_code,
    gather_rows,
    upload_predictor,
)

NVRTC_OPTIONS = ("--std=c++17",)
NULL = np.uint64(0)  # a null pointer argument (CuPy passes numpy scalars by value)
MAX_T = 8  # tokens per launch of the decode kernels (gemv, sparse_up); more loop in chunks of 8
UP_THREADS = 128  # sparse_up's block (its launch bounds: 4 such blocks per SM)
SELECT_THREADS = 256  # predictor.cu's SELECT_THREADS
SEL_MAX_ROWS = 1 << 24  # a selection entry holds the GPU row in 24 bits (predictor.cu select_rows)
PREFILL_T = 32  # from this many tokens matmul dequantises W in tiles and multiplies with cuBLAS
# f32 workspace of one dequantised tile of W for the prefill path, and the most chunks attention splits a context
# into (its partial sums are [T, n_head, chunks, hd + 2]): bounds the planner's workspace counts on
# (planner/memory.py gpu_scratch_bytes). A 64 MiB tile is a [32 x 5120] x [5120 x 3276] GEMM: still bound by reading
# the tile, as a larger one would be.
DEQUANT_TILE_BYTES = _mem.DEQUANT_TILE_BYTES
ATTN_MAX_CHUNKS = _mem.ATTN_MAX_CHUNKS


class GPUUnavailable(RuntimeError):
    """No usable GPU: CuPy missing, no driver, or no device. The message is one line saying which."""


_i32 = np.int32  # an int kernel argument (CuPy passes a Python int as a 64-bit one)


def _ptr(a):
    return NULL if a is None else a


class CudaDevice:
    """One CUDA device. `cupy`: the module to use (tests pass the CPU emulation in tests/cuda_emu)."""

    timeline: Timeline | None = None  # start_timeline(): the device's own time per kind of work

    def __init__(self, device_id: int = 0, *, cupy=None):
        if cupy is None:
            try:
                import cupy
            except ImportError as e:
                raise GPUUnavailable(f"CuPy is not installed: pip install 'pinfer-llm[gpu-cuda12]' "
                                     f"(or 'pinfer-llm[gpu-cuda13]' for CUDA 13) ({e})") from None
        self.cp = cupy
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # cupy raises CUDARuntimeError (no driver) or its own errors when libcuda is absent
            raise GPUUnavailable(f"no usable CUDA driver: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
                from None
        if n <= device_id:
            raise GPUUnavailable(f"no CUDA device {device_id} ({n} found)")
        self.device = cupy.cuda.Device(device_id)
        self.device.use()
        self.sm_count = int(self.device.attributes["MultiProcessorCount"])
        self.name = f"cuda:{device_id} ({self.sm_count} SMs, compute capability {self.device.compute_capability})"
        self._modules: dict[str, object] = {}
        self._kernels: dict[str, object] = {}  # by kernel name (unique across the modules)
        # Grid shapes: None picks by the rules in _up_blocks / _down_splits; benchmarks/gpu_check.py sweeps them on
        # a real GPU. They depend on shapes only, never on a step's data (a captured CUDA graph replays them).
        self.up_blocks: int | None = None
        self.down_splits: int | None = None
        self._pred_counts = None  # select_count's per-block counts for predict's selection (sm_count int32)
        self.attn_chunk = _mem.ATTN_CHUNK
        # Stream capture (runtime/gpu/graph.py): the fake CuPy of the tests brings its own external event record.
        # PINFER_CUDA_GRAPHS=0 queues every step launch by launch (to compare, or where capture misbehaves).
        record = getattr(cupy.cuda, "record_external", None)
        self._record_external = None if os.environ.get("PINFER_CUDA_GRAPHS") == "0" else \
            record if record is not None else driver_record_external()
        self._capture: Capture | None = None
        self._workspace: dict = {}
        self._rope: dict[tuple, object] = {}  # (base, n_rot) -> each pair's frequency as two floats

    # ---- captured steps (runtime/gpu/graph.py)
    @property
    def can_capture(self) -> bool:
        return self._record_external is not None and self.timeline is None  # a timeline's events are plain records

    def begin_capture(self, stream) -> None:
        """Queue nothing from here on: capture the work queued on `stream` until end_capture(). Scratch allocated
        meanwhile comes from the device's workspace (shared by every graph, never freed)."""
        stream.begin_capture()
        self._capture = Capture(self._workspace)

    def end_capture(self, stream):
        self._capture = None
        return stream.end_capture()

    def abort_capture(self, stream) -> None:
        if self._capture is not None:
            self._capture = None
            try:
                stream.end_capture()
            except Exception:  # an invalidated capture ends with an error; the one that invalidated it is raised
                pass

    def launch_graph(self, graph, stream) -> None:
        graph.launch(stream)

    def graph_event(self, stream):
        """An event recorded on `stream`, as an external event node when it captures: the host can wait on it at
        each replay."""
        ev = self.cp.cuda.Event(block=False, disable_timing=True)
        if self._capture is None:
            ev.record(stream)
        else:
            self._record_external(ev, stream)
        return ev

    def start_timeline(self) -> Timeline:
        """Time every operation from now on with CUDA events (runtime/gpu/timing.py)."""
        ev = self.cp.cuda
        return Timeline(ev.Event, lambda a, b: ev.get_elapsed_time(a, b) / 1e3).install(self)

    # ---- kernels
    def _fn(self, module: str, name: str):
        # Kept per name: CuPy's RawModule.get_function makes a new RawKernel each call and looks the function up in
        # the driver again (cuModuleGetFunction), which a launch per kernel per layer per token would repeat.
        fn = self._kernels.get(name)
        if fn is None:
            mod = self._modules.get(module)
            if mod is None:
                mod = self._modules[module] = self.cp.RawModule(code=source(module), options=NVRTC_OPTIONS)
            fn = self._kernels[name] = mod.get_function(name)
        return fn

    def _launch(self, module: str, name: str, grid, block, args) -> None:
        self._fn(module, name)(grid, block, args)

    # ---- memory
    def asarray(self, a):
        return self.cp.asarray(np.ascontiguousarray(a))

    def to_numpy(self, a) -> np.ndarray:
        return self.cp.asnumpy(a)

    def empty(self, shape, dtype=np.float32):
        if self._capture is not None:
            return self._capture.scratch(shape, np.dtype(dtype), self.cp.empty)
        return self.cp.empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32):
        if self._capture is not None:
            a = self.empty(shape, dtype)
            a.fill(0)  # a memset node of the graph
            return a
        return self.cp.zeros(shape, dtype)

    def synchronize(self) -> None:
        self.device.synchronize()

    def pinned(self, shape, dtype=np.float32) -> np.ndarray:
        """A page-locked host array: transfers from and to it run asynchronously and at full PCIe speed."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        mem = self.cp.cuda.alloc_pinned_memory(max(n, 1))
        return np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)

    def stream(self):
        """A new non-blocking stream; `with stream:` makes it current for the kernels launched inside."""
        return self.cp.cuda.Stream(non_blocking=True)

    def to_device_async(self, host: np.ndarray, out, stream=None):
        out.set(host, stream=stream)
        return out

    def to_host_async(self, a, out: np.ndarray, stream=None) -> np.ndarray:
        """Queue a copy into `out` (page-locked, from pinned()); wait on an event recorded after it before reading."""
        a.get(stream=stream, out=out, blocking=False)
        return out

    def view(self, buf, offset: int, shape, dtype=np.float32):
        """An array of `shape` and `dtype` over bytes offset.. of the uint8 device buffer `buf` (no copy)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return buf[offset:offset + n].view(dtype).reshape(shape)

    def zero(self, out):
        out.fill(0)
        return out

    def copy(self, src, out):
        self.cp.copyto(out, src)
        return out

    # ---- weights
    def upload_matrix(self, raw: np.ndarray, ty: int | str, cols: int, rows=None) -> Matrix:
        ty = layout.type_id(ty)
        r = gather_rows(raw, ty, cols, rows)
        return Matrix(ty, r.shape[0], cols, self.asarray(layout.to_device(r, ty, cols)), layout.device_stride(ty, cols))

    def upload_ffn(self, up, down_t, ty, n_embd: int, bucket, *, act, gate=None, up_bias=None,
                   down_ty=None) -> FFNRows:
        act, ty = act_code(act), layout.type_id(ty)
        down_ty = ty if down_ty is None else layout.type_id(down_ty)
        if (act in GATED) != (gate is not None):
            raise ValueError(f"act {act} {'needs' if act in GATED else 'takes no'} gate matrix")
        bucket = np.asarray(bucket, np.int32)
        n_ff = layout.as_rows(up, ty, n_embd).shape[0]
        if bucket.size and (bucket.min() < 0 or bucket.max() >= n_ff):
            raise ValueError(f"bucket holds neurons outside 0..{n_ff - 1}")
        if bucket.size >= SEL_MAX_ROWS:
            raise ValueError(f"{bucket.size} GPU rows in one layer: the kernels' selection holds at most "
                             f"{SEL_MAX_ROWS - 1}")
        bias = None if up_bias is None else self.asarray(np.asarray(up_bias, np.float32)[bucket])
        if gate is None:
            g, u = None, self.upload_matrix(up, ty, n_embd, bucket)
        else:
            g, u = self._upload_pair(gate, up, ty, n_embd, bucket)
        k = bucket.size
        work = self.empty((k + 1 + self.sm_count,), np.int32)  # the selection: entries, count, per-block counts
        return FFNRows(act, n_ff, g, u, self.upload_matrix(down_t, down_ty, n_embd, bucket), self.asarray(bucket),
                       bias, (work[:k].view(np.uint32), work[k:k + 1], work[k + 1:]))

    def _upload_pair(self, gate, up, ty: int, cols: int, bucket) -> tuple[Matrix, Matrix]:
        # A neuron's gate and up rows adjacent: device rows 2j and 2j + 1 of one buffer, so sparse_up reads one
        # contiguous 2 * stride bytes per neuron. Both Matrix views keep the usual kernel interface with a row stride
        # of 2 * stride (gemv, dequant_rows and the prefill GEMM read them as they read any matrix).
        stride = layout.device_stride(ty, cols)
        rows = [layout.to_device(gather_rows(m, ty, cols, bucket), ty, cols) for m in (gate, up)]
        both = np.empty((rows[0].shape[0], 2, stride), np.uint8)
        both[:, 0], both[:, 1] = rows
        flat = self.asarray(both).reshape(-1)
        k = rows[0].shape[0]
        return (Matrix(ty, k, cols, flat, 2 * stride), Matrix(ty, k, cols, flat[stride:], 2 * stride))

    def upload_predictor(self, fc1, fc2) -> PredictorWeights:
        return upload_predictor(self.upload_matrix, fc1, fc2)

    # ---- dense
    def matmul(self, w: Matrix, x, *, bias=None, out=None, accumulate=False, relu=False):
        """y[T, rows] = x[T, cols] @ W^T (+ bias) (relu) (+ out if accumulate), into out when given."""
        T = x.shape[0]
        _check(x, (T, w.cols), "x")
        if out is None:
            if accumulate:
                raise ValueError("accumulate needs out")
            out = self.empty((T, w.rows))
        _check(out, (T, w.rows), "out")
        if T >= PREFILL_T:
            return self._matmul_prefill(w, x, bias, out, accumulate, relu)
        for t0 in range(0, T, MAX_T):
            n = min(MAX_T, T - t0)
            tm = 1 if n == 1 else MAX_T
            r = _rows_per_pass(w.ty, tm)
            groups = -(-w.rows // r)
            xs, ys = (x, out) if n == T else (x[t0:t0 + n], out[t0:t0 + n])  # one launch: no CuPy slices
            self._launch("gemv", f"gemv_{layout.NAMES[w.ty]}_t{tm}", (-(-groups // 4),), (128,),
                         (w.data, np.int64(w.stride), _i32(w.cols), _i32(w.rows), xs, _i32(n), ys, _ptr(bias),
                          _i32(accumulate), _i32(relu)))
        return out

    def _matmul_prefill(self, w: Matrix, x, bias, out, accumulate, relu):
        # cuBLAS on dequantised tiles of W: prefill is compute-bound, and a GEMM reads each weight once per tile.
        cp = self.cp
        rows_per_tile = max(1, min(w.rows, DEQUANT_TILE_BYTES // (4 * w.cols)))
        for r0 in range(0, w.rows, rows_per_tile):
            n = min(rows_per_tile, w.rows - r0)
            wt = self.dequant_rows(w, self.asarray(np.arange(r0, r0 + n, dtype=np.int32)))
            y = cp.matmul(x, wt.T)
            if bias is not None:
                y += bias[r0:r0 + n]
            if relu:
                cp.maximum(y, 0, out=y)
            if accumulate:
                out[:, r0:r0 + n] += y
            else:
                out[:, r0:r0 + n] = y
        return out

    def dequant_rows(self, w: Matrix, idx=None, dtype=np.float32):
        """Rows idx (device int32, or all) of W decoded, [n, cols] f32 or f16: gathers and prefill GEMM operands."""
        n = w.rows if idx is None else idx.shape[0]
        f16 = np.dtype(dtype) == np.float16
        out = self.empty((n, w.cols), np.float16 if f16 else np.float32)
        if n:
            self._launch("gemv", f"dequant_{layout.NAMES[w.ty]}", (min(-(-n // 4), 65535),), (128,),
                         (w.data, np.int64(w.stride), _i32(w.cols), _ptr(idx), _i32(n), NULL if f16 else out,
                          out.view(np.uint16) if f16 else NULL))
        return out

    # ---- sparse FFN
    def ffn_up(self, ffn: FFNRows, x, *, scores=None, threshold=0.0, cats=None, out=None):
        """h[T, k]: the activations of the GPU rows; 0 where a token's score (original neuron ids) < threshold."""
        T = x.shape[0]
        scores = self._check_up(ffn, x, scores)
        h = self.empty((T, ffn.k)) if out is None else out
        _check(h, (T, ffn.k), "out")
        if ffn.k == 0:
            return h
        for t0 in range(0, T, MAX_T):
            n = min(MAX_T, T - t0)
            # one launch (decode) takes the arrays as they are: each CuPy slice costs the host microseconds
            xs, hs, ss = (x, h, scores) if n == T else (x[t0:t0 + n], h[t0:t0 + n],
                                                         None if scores is None else scores[t0:t0 + n])
            self._up(ffn, xs, ss, threshold, cats, hs)
        return h

    def _check_up(self, ffn: FFNRows, x, scores):
        _check(x, (x.shape[0], ffn.d), "x")
        if scores is not None:
            _check(scores, (x.shape[0], ffn.n_ff) if scores.ndim == 2 else (ffn.n_ff,), "scores")
            if scores.ndim == 1:
                scores = scores.reshape(x.shape[0], ffn.n_ff)
        return scores

    def _up(self, ffn: FFNRows, x, scores, threshold, cats, h):
        """h for n <= MAX_T tokens; returns the selection (entries, count) on the device, or (None, None): every
        row for every token."""
        n = x.shape[0]
        sel = nsel = None
        if scores is not None:
            sel, nsel, counts = ffn.work
            self._select("select_rows", ffn.k, n, sel, nsel, counts, scores=scores, bucket=ffn.bucket,
                         n_ff=ffn.n_ff, threshold=threshold, zero=h)
        blocks = self.up_blocks or self._up_blocks(ffn.k)
        self._launch("sparse_ffn", f"sparse_up_{layout.NAMES[ffn.up.ty]}_t{1 if n == 1 else MAX_T}", (blocks,),
                     (UP_THREADS,),
                     (_ptr(None if ffn.gate is None else ffn.gate.data), ffn.up.data, np.int64(ffn.up.stride),
                      _i32(ffn.d), _ptr(sel), _ptr(nsel), _i32(ffn.k), _ptr(ffn.bias), _i32(ffn.act),
                      np.float32(-1.0 if cats is None else cats), x, _i32(n), h))
        return sel, nsel

    def _select(self, name, n, T, out, count, counts, *, scores=None, bucket=None, n_ff=0, threshold=0.0,
                skip=None, zero=None):
        """predictor.cu's two passes: out[0..count) = the selected items of n in ascending order (select_rows:
        entries with their tokens; select_active: ids), count[0] their number, all on the device."""
        blocks = self._select_blocks(n)
        args = (_ptr(scores), _ptr(bucket), _i32(n_ff), np.float32(threshold), _ptr(skip), _i32(T), _i32(n))
        self._launch("predictor", "select_count", (blocks,), (SELECT_THREADS,), (*args, _ptr(zero), counts))
        self._launch("predictor", name, (blocks,), (SELECT_THREADS,), (*args, counts, out, count))

    def ffn_down(self, ffn: FFNRows, h, out):
        """out[T, d] += h[T, k] @ down_t (rows whose h is 0 for every token are not read)."""
        return self._axpy(ffn.down, h, out)

    def _axpy(self, w: Matrix, h, out, sel=None, nsel=None):
        """out += h @ W over the rows of the selection (sel/nsel from _up), or over every row whose h is not 0."""
        T = h.shape[0]
        _check(h, (T, w.rows), "h")
        _check(out, (T, w.cols), "out")
        if w.rows == 0 or T == 0:
            return out
        nb = w.cols // 32
        units = nb // 32 + (nb % 32 > 0)
        splits = self.down_splits or self._down_splits(w.rows, units)
        self._launch("sparse_ffn", f"sparse_down_{layout.NAMES[w.ty]}_t{1 if T == 1 else 2}", (units, splits),
                     (256,), (w.data, np.int64(w.stride), _i32(w.cols), _ptr(sel), _ptr(nsel), h, _i32(w.rows),
                              _i32(T), out))
        return out

    def ffn(self, ffn: FFNRows, x, *, scores=None, threshold=0.0, cats=None, out=None):
        """y[T, d] = FFN of the GPU rows (added into out when given: the CPU part or the residual). From PREFILL_T
        tokens on, GEMMs over dequantised tiles of the rows (_ffn_prefill) instead of the sparse kernels."""
        if out is None:
            out = self.zeros((x.shape[0], ffn.d))
        T = x.shape[0]
        if T >= PREFILL_T:
            return self._ffn_prefill(ffn, x, scores, threshold, cats, out)
        scores = self._check_up(ffn, x, scores)
        _check(out, (T, ffn.d), "out")
        if ffn.k == 0 or T == 0:
            return out
        for t0 in range(0, T, MAX_T):  # sparse_down runs over the selection sparse_up just made
            n = min(MAX_T, T - t0)
            xs, ys, ss = (x, out, scores) if n == T else (x[t0:t0 + n], out[t0:t0 + n],
                                                         None if scores is None else scores[t0:t0 + n])
            h = self.empty((n, ffn.k))
            sel, nsel = self._up(ffn, xs, ss, threshold, cats, h)
            self._axpy(ffn.down, h, ys, sel, nsel)
        return out

    def _ffn_prefill(self, ffn: FFNRows, x, scores, threshold, cats, out):
        # Many tokens select most rows between them, so the sparse kernels would read nearly every row once per 8
        # tokens; a GEMM reads each row once per tile. The same h as ffn_up (selection, activation), then h @ down.
        T = x.shape[0]
        _check(x, (T, ffn.d), "x")
        _check(out, (T, ffn.d), "out")
        if scores is not None:
            scores = scores.reshape(T, ffn.n_ff)
            _check(scores, (T, ffn.n_ff), "scores")
        mats = 3 if ffn.gate is not None else 2
        rows_per_tile = max(1, min(ffn.k, DEQUANT_TILE_BYTES // (4 * ffn.d * mats)))
        for r0 in range(0, ffn.k, rows_per_tile):
            n = min(rows_per_tile, ffn.k - r0)
            idx = self.asarray(np.arange(r0, r0 + n, dtype=np.int32))
            u = self.cp.matmul(x, self.dequant_rows(ffn.up, idx).T)
            g = u if ffn.gate is None else self.cp.matmul(x, self.dequant_rows(ffn.gate, idx).T)
            h = self.empty((T, n))
            self._launch("sparse_ffn", "ffn_act", (min(-(-T * n // 256), 4096),), (256,),
                         (self.cp.ascontiguousarray(g), self.cp.ascontiguousarray(u),
                          _ptr(None if ffn.bias is None else ffn.bias[r0:r0 + n]), _ptr(scores), ffn.bucket[r0:r0 + n],
                          _i32(ffn.n_ff), np.float32(threshold), _i32(ffn.act),
                          np.float32(-1.0 if cats is None else cats), _i32(T), _i32(n), h))
            out += self.cp.matmul(h, self.dequant_rows(ffn.down, idx))
        return out

    def _up_blocks(self, k: int) -> int:
        # sparse_up: 4 blocks of 4 warps per SM (its launch bounds), a warp per selected row at a time, never more
        # warps than rows; past the count, warps exit at once.
        return max(1, min(-(-k // (UP_THREADS // 32)), 4 * self.sm_count))

    def _down_splits(self, k: int, units: int) -> int:
        # sparse_down: two blocks of 8 warps per SM (its launch bounds), units x splits of them in one wave (a
        # 5-tile Llama-13B row on 132 SMs: 5 x 52 = 260 blocks, where rounding up would leave one block for a
        # second wave); each block adds its unit to y once (4 KB of atomics per token, ~7% of a 10% 13B layer's
        # weight bytes). No more splits than 8-row groups of all k rows.
        return max(1, min(2 * self.sm_count // units, -(-k // 8)))

    def _select_blocks(self, n: int) -> int:
        # One block per 256 items, at most one per SM: select_write's blocks each sum the counts before them.
        return max(1, min(-(-n // SELECT_THREADS), self.sm_count))

    def predict(self, pred: PredictorWeights, x, *, threshold=0.0, skip=None, ids=False, found=None):
        """scores[T, n_ff] = fc2 @ relu(fc1 @ x); with ids also found, int32 [1 + n_ff]: found[0] = count, then
        the ascending neurons with a score >= threshold for some token and skip == 0 (skip: uint8 [n_ff] or None).
        One buffer (`found`, when given: e.g. part of a staging buffer), so that count and ids cross in one copy."""
        hid = self.matmul(pred.fc1, x, relu=True)
        if pred.transposed:
            scores = self._axpy(pred.fc2, hid, self.zeros((x.shape[0], pred.n_ff)))
        else:
            scores = self.matmul(pred.fc2, hid)
        if not ids:
            return scores
        found = self.empty((1 + pred.n_ff,), np.int32) if found is None else found
        _check(found, (1 + pred.n_ff,), "found")
        if self._pred_counts is None:
            self._pred_counts = self.empty((self.sm_count,), np.int32)
        self._select("select_active", pred.n_ff, x.shape[0], found[1:], found[:1], self._pred_counts, scores=scores,
                     n_ff=pred.n_ff, threshold=threshold, skip=skip)
        return scores, found

    # ---- norms, attention, small ops
    def rms_norm(self, x, w, eps: float, out=None, *, add=None, copy=None):
        return self._norm("rms_norm", x, add, (w,), out, copy, eps)

    def layer_norm(self, x, w, b, eps: float, out=None, *, add=None, copy=None):
        return self._norm("layer_norm", x, add, (w, _ptr(b)), out, copy, eps)

    def _norm(self, name, x, add, params, out, copy, eps):
        T, d = x.shape
        if d % 4:
            raise ValueError(f"norm width {d} is not a multiple of 4")
        out = self.empty((T, d)) if out is None else out
        for a, what in ((add, "add"), (copy, "copy")):
            if a is not None:
                _check(a, (T, d), what)
        self._launch("norm", name, (T,), (256,), (x, _ptr(add), *params, out, _ptr(copy), _i32(d), np.float32(eps)))
        return out

    def kv_cache(self, n_kv: int, max_ctx: int, head_dim: int):
        return self.zeros((n_kv, max_ctx, head_dim), np.float16), self.zeros((n_kv, max_ctx, head_dim), np.float16)

    def attention(self, q, k, v, cache_k, cache_v, pos: int, *, n_rot=None, neox=False, base=10000.0,
                  rope_scale=1.0, scale=None, out=None, pos_at=None):
        """Tokens at positions pos..pos+T-1: RoPE on q [T, n_head, hd] and k [T, n_kv, hd] (in place), k and v
        into the f16 caches [n_kv, max_ctx, hd], causal softmax(q k^T * scale) v with GQA -> out [T, n_head, hd].
        pos_at: a device int32 [1] holding pos, which the kernels read instead (a captured step replays with the
        position of each step); the attention grid then covers the whole cache, its blocks past pos + T idle."""
        T, n_head, hd = q.shape
        n_kv, max_ctx = cache_k.shape[0], cache_k.shape[1]
        n_rot = hd if n_rot is None else n_rot
        if hd % 8 or hd > 256 or n_head % n_kv or n_rot % 2 or n_rot > hd:
            raise ValueError(f"attention shapes: head_dim {hd} (multiple of 8, <= 256), n_head {n_head} "
                             f"(multiple of n_kv {n_kv}), n_rot {n_rot} (even, <= head_dim)")
        if pos + T > max_ctx:
            raise ValueError(f"positions up to {pos + T - 1} do not fit a cache of {max_ctx}")
        _check(k, (T, n_kv, hd), "k")
        _check(v, (T, n_kv, hd), "v")
        kc, vc = cache_k.view(np.uint16), cache_v.view(np.uint16)
        at = _ptr(pos_at)
        self._launch("attention", "rope_kv_store", (n_head + n_kv, T), (64,),
                     (q, k, v, kc, vc, _i32(pos), at, _i32(n_head), _i32(n_kv), _i32(hd), _i32(n_rot), _i32(neox),
                      self._rope_table(base, n_rot), np.float32(1.0 / rope_scale), _i32(max_ctx)))
        # Chunks of one length for the whole cache (a long context: longer chunks, not more), so that a step of a
        # fixed grid (pos_at) sums exactly what a step sized for its position does.
        chunk = max(self.attn_chunk, -(-max_ctx // ATTN_MAX_CHUNKS))
        n_chunks = -(-(max_ctx if pos_at is not None else pos + T) // chunk)
        part = self.empty((T, n_head, n_chunks, hd + 2))
        scale = 1.0 / math.sqrt(hd) if scale is None else scale
        self._launch("attention", "attn_partial", (n_chunks, n_head, T), (128,),
                     (q, kc, vc, part, _i32(pos), at, _i32(n_head), _i32(n_kv), _i32(hd), _i32(max_ctx),
                      np.float32(scale), _i32(chunk), _i32(n_chunks)))
        out = self.empty((T, n_head, hd)) if out is None else out
        self._launch("attention", "attn_combine", (n_head, T), (128,),
                     (part, out, _i32(n_head), _i32(hd), _i32(n_chunks)))
        return out

    def _rope_table(self, base: float, n_rot: int):
        # base^(-2i/n_rot) in float64, as the CPU side computes it, held as hi + lo floats (attention.cu)
        key = (float(base), n_rot)
        t = self._rope.get(key)
        if t is None:
            inv = float(base) ** (-2.0 * np.arange(max(n_rot // 2, 1), dtype=np.float64) / max(n_rot, 1))
            hi = inv.astype(np.float32)
            t = self._rope[key] = self.asarray(np.stack([hi, (inv - hi).astype(np.float32)], 1).reshape(-1))
        return t

    def add(self, a, b, out=None):
        """a + b, b of a's shape or of its last dimension (added to every row)."""
        if b.shape != a.shape and b.shape != a.shape[-1:]:
            raise ValueError(f"add: b has shape {tuple(b.shape)}, expected {tuple(a.shape)} or {tuple(a.shape[-1:])}")
        out = self.empty(a.shape) if out is None else out
        n = a.size
        self._launch("ops", "add_f32", (max(1, min(-(-n // 256), 4096)),), (256,),
                     (a, b, out, np.int64(n), np.int64(b.size)))
        return out

    def set_cols(self, a, idx, value: float):
        """a[t, idx] = value for every row t of a [T, n]; idx: device int32."""
        T, n = a.shape
        if idx.shape[0]:
            self._launch("ops", "set_cols_f32", (T,), (256,), (a, idx, _i32(idx.shape[0]), _i32(n), np.float32(value)))
        return a

    def count_active(self, ffn: FFNRows, scores, threshold: float, acc):
        """acc[0] += (token, GPU row) pairs with scores[t, bucket[j]] >= threshold, acc[1] += T (acc: int32 [2])."""
        T = scores.shape[0] if scores.ndim == 2 else 1
        self._launch("ops", "count_active", (1,), (256,), (scores, ffn.bucket, _i32(ffn.k), _i32(ffn.n_ff), _i32(T),
                                                          np.float32(threshold), acc))
        return acc

    def gather_rows(self, src, idx, out=None):
        n, cols = idx.shape[0], src.shape[1]
        out = self.empty((n, cols)) if out is None else out
        if n:
            self._launch("ops", "gather_rows_f32", (n,), (256,), (src, idx, _i32(cols), out))
        return out


# quant.cuh's Rows<Q, 1>::R: rows a warp of gemv reads side by side for one token (one for more tokens).
_ROWS_T1 = {layout.Q4_0: 4, layout.Q4_1: 4, layout.Q8_0: 2, layout.F16: 2, layout.BF16: 2, layout.F32: 1}


def _rows_per_pass(ty: int, tm: int) -> int:
    """quant.cuh's Rows<Q, TM>::R: rows a warp of gemv reads side by side."""
    return _ROWS_T1[ty] if tm == 1 else 1


def _check(a, shape, what: str) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} is not contiguous")
