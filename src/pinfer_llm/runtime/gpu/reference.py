"""ReferenceDevice: CudaDevice's interface on the CPU with torch, the yardstick for the kernels and a stand-in device.

Same method signatures and semantics as CudaDevice (see the package docstring); arrays are torch tensors. Weights are
dequantised exactly from the file's encoding (layout.dequantize) and every op is computed in `dtype` (float64 by
default, so that a comparison measures the kernel's rounding, not the reference's), results returned as float32.
The KV cache is f16 like the GPU's, so attention sees the same rounded keys and values.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pinfer_llm.runtime.gpu import layout
from pinfer_llm.runtime.gpu.timing import Timeline, host_timeline
from pinfer_llm.runtime.gpu.weights import (
    GATED,
    RELU_UP,
    SILU,
    FFNRows,
    Matrix,
    PredictorWeights,
    act_code,
    gather_rows,
    upload_predictor,
)


class _Stream:
    """A stream that runs everything at once: operations are synchronous on the CPU."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self) -> None:
        pass

    def record(self) -> _Stream:  # an event that has always happened
        return self


class ReferenceDevice:
    name = "reference (torch, CPU)"
    can_capture = False  # every operation runs at once: nothing to capture (runtime/gpu/graph.py)
    timeline: Timeline | None = None  # start_timeline(): the time of each kind of work

    def __init__(self, dtype: torch.dtype = torch.float64):
        self.dtype = dtype

    def start_timeline(self) -> Timeline:
        """Time every operation from now on (synchronous: by the host clock)."""
        return host_timeline().install(self)

    # ---- memory
    def asarray(self, a) -> torch.Tensor:
        return torch.from_numpy(np.array(a, copy=True))

    def to_numpy(self, a: torch.Tensor) -> np.ndarray:
        return a.detach().cpu().numpy().copy()

    def empty(self, shape, dtype=np.float32) -> torch.Tensor:
        return torch.from_numpy(np.empty(shape, dtype))

    def zeros(self, shape, dtype=np.float32) -> torch.Tensor:
        return torch.from_numpy(np.zeros(shape, dtype))

    def synchronize(self) -> None:
        pass

    def pinned(self, shape, dtype=np.float32) -> np.ndarray:
        return np.empty(shape, dtype)

    def stream(self) -> _Stream:
        return _Stream()

    def to_device_async(self, host: np.ndarray, out: torch.Tensor, stream=None) -> torch.Tensor:
        out.copy_(torch.from_numpy(np.ascontiguousarray(host)))
        return out

    def to_host_async(self, a: torch.Tensor, out: np.ndarray, stream=None) -> np.ndarray:
        out[...] = a.numpy()
        return out

    def view(self, buf: torch.Tensor, offset: int, shape, dtype=np.float32) -> torch.Tensor:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return torch.from_numpy(buf.numpy()[offset:offset + n].view(dtype).reshape(shape))

    def zero(self, out: torch.Tensor) -> torch.Tensor:
        return out.zero_()

    def copy(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(src)

    # ---- weights
    def upload_matrix(self, raw: np.ndarray, ty: int | str, cols: int, rows=None) -> Matrix:
        ty = layout.type_id(ty)
        r = gather_rows(raw, ty, cols, rows)
        return Matrix(ty, r.shape[0], cols, torch.from_numpy(layout.dequantize(r, ty, cols)).to(self.dtype))

    def upload_ffn(self, up, down_t, ty, n_embd: int, bucket, *, act, gate=None, up_bias=None,
                   down_ty=None) -> FFNRows:
        act, ty = act_code(act), layout.type_id(ty)
        down_ty = ty if down_ty is None else layout.type_id(down_ty)
        if (act in GATED) != (gate is not None):
            raise ValueError(f"act {act} {'needs' if act in GATED else 'takes no'} gate matrix")
        bucket = np.asarray(bucket, np.int32)
        n_ff = layout.as_rows(up, ty, n_embd).shape[0]
        bias = None if up_bias is None else torch.from_numpy(np.asarray(up_bias, np.float32)[bucket].copy())
        return FFNRows(act, n_ff, None if gate is None else self.upload_matrix(gate, ty, n_embd, bucket),
                       self.upload_matrix(up, ty, n_embd, bucket), self.upload_matrix(down_t, down_ty, n_embd, bucket),
                       torch.from_numpy(bucket.copy()), bias)

    def upload_predictor(self, fc1, fc2) -> PredictorWeights:
        return upload_predictor(self.upload_matrix, fc1, fc2)

    # ---- dense
    def matmul(self, w: Matrix, x: torch.Tensor, *, bias=None, out=None, accumulate=False, relu=False) -> torch.Tensor:
        y = x.to(self.dtype) @ w.data.T
        if bias is not None:
            y = y + bias.to(self.dtype)
        if relu:
            y = y.clamp_min(0)
        if accumulate:
            y = y + out.to(self.dtype)
        return self._out(y, out)

    def dequant_rows(self, w: Matrix, idx=None, dtype=np.float32) -> torch.Tensor:
        rows = w.data if idx is None else w.data[idx.long()]
        return rows.to(torch.float16 if np.dtype(dtype) == np.float16 else torch.float32)

    # ---- sparse FFN
    def ffn_up(self, ffn: FFNRows, x: torch.Tensor, *, scores=None, threshold=0.0, cats=None,
               out=None) -> torch.Tensor:
        x = x.to(self.dtype)
        u = x @ ffn.up.data.T  # [T, k]
        if ffn.act in GATED:
            g = x @ ffn.gate.data.T
            if ffn.act == SILU:
                s = torch.nn.functional.silu(g)
                h = s * u
                if cats is not None:
                    h = torch.where(s.abs() <= cats, 0, h)
            elif ffn.act == 1:
                h = torch.relu(g) * u
            else:
                h = torch.relu(g) * torch.relu(u)
        else:
            z = u if ffn.bias is None else u + ffn.bias.to(self.dtype)
            h = torch.relu(z) if ffn.act == RELU_UP else 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
        if scores is not None:
            sel = scores.reshape(x.shape[0], -1)[:, ffn.bucket.long()] >= threshold
            h = torch.where(sel, h, 0)
        return self._out(h, out)

    def ffn_down(self, ffn: FFNRows, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out += (h.to(self.dtype) @ ffn.down.data).float()
        return out

    def ffn(self, ffn: FFNRows, x: torch.Tensor, *, scores=None, threshold=0.0, cats=None, out=None) -> torch.Tensor:
        if out is None:
            out = self.zeros((x.shape[0], ffn.d))
        return self.ffn_down(ffn, self.ffn_up(ffn, x, scores=scores, threshold=threshold, cats=cats), out)

    def predict(self, pred: PredictorWeights, x: torch.Tensor, *, threshold=0.0, skip=None, ids=False, found=None):
        hid = torch.relu(x.to(self.dtype) @ pred.fc1.data.T)
        scores = (hid @ (pred.fc2.data if pred.transposed else pred.fc2.data.T)).float()
        if not ids:
            return scores
        sel = (scores >= threshold).any(0)
        if skip is not None:
            sel &= skip == 0
        ids = torch.nonzero(sel).flatten().int()
        found = torch.zeros(1 + pred.n_ff, dtype=torch.int32) if found is None else found  # [count, ids...]
        found[0] = ids.numel()
        found[1:1 + ids.numel()] = ids
        return scores, found

    # ---- norms, attention, small ops
    def rms_norm(self, x, w, eps: float, out=None, *, add=None, copy=None) -> torch.Tensor:
        x64 = self._norm_input(x, add, copy)
        y = x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w.to(self.dtype)
        return self._out(y, out)

    def layer_norm(self, x, w, b, eps: float, out=None, *, add=None, copy=None) -> torch.Tensor:
        y = torch.nn.functional.layer_norm(self._norm_input(x, add, copy), (x.shape[-1],), w.to(self.dtype),
                                           None if b is None else b.to(self.dtype), eps)
        return self._out(y, out)

    def _norm_input(self, x, add, copy) -> torch.Tensor:
        """x += add (in place, as add() rounds it), copy = x; x in the reference's precision."""
        if add is not None:
            self.add(x, add, out=x)
        if copy is not None:
            copy.copy_(x)
        return x.to(self.dtype)

    def kv_cache(self, n_kv: int, max_ctx: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(n_kv, max_ctx, head_dim, dtype=torch.float16),
                torch.zeros(n_kv, max_ctx, head_dim, dtype=torch.float16))

    def attention(self, q, k, v, cache_k, cache_v, pos: int, *, n_rot=None, neox=False, base=10000.0,
                  rope_scale=1.0, scale=None, out=None, pos_at=None) -> torch.Tensor:
        if pos_at is not None:
            pos = int(pos_at[0])
        T, n_head, hd = q.shape
        n_kv = k.shape[1]
        n_rot = hd if n_rot is None else n_rot
        scale = 1 / math.sqrt(hd) if scale is None else scale
        half = n_rot // 2
        inv = float(base) ** (-2 * torch.arange(half, dtype=torch.float64) / n_rot)
        th = torch.outer(torch.arange(pos, pos + T, dtype=torch.float64) * np.float32(1 / rope_scale), inv)
        cos, sin = th.cos().float()[:, None], th.sin().float()[:, None]  # [T, 1, half]
        for vec in (q, k):
            a = vec[..., :half] if neox else vec[..., 0:n_rot:2]
            b = vec[..., half:n_rot] if neox else vec[..., 1:n_rot:2]
            a2, b2 = a * cos - b * sin, a * sin + b * cos
            a.copy_(a2)
            b.copy_(b2)
        cache_k[:, pos:pos + T] = k.transpose(0, 1).half()
        cache_v[:, pos:pos + T] = v.transpose(0, 1).half()
        group = n_head // n_kv
        kk = cache_k[:, :pos + T].to(self.dtype).repeat_interleave(group, 0)  # [n_head, P, hd]
        vv = cache_v[:, :pos + T].to(self.dtype).repeat_interleave(group, 0)
        s = torch.einsum("thd,hpd->thp", q.to(self.dtype) * scale, kk)
        causal = torch.arange(pos + T)[None, :] > (pos + torch.arange(T))[:, None]  # [T, P]
        s = s.masked_fill(causal[:, None, :], float("-inf"))
        return self._out(torch.einsum("thp,hpd->thd", s.softmax(-1), vv), out)

    def add(self, a, b, out=None) -> torch.Tensor:
        return self._out(a.to(self.dtype) + b.to(self.dtype), out)

    def set_cols(self, a, idx, value: float) -> torch.Tensor:
        a[:, idx.long()] = value
        return a

    def count_active(self, ffn: FFNRows, scores, threshold: float, acc) -> torch.Tensor:
        sel = scores.reshape(-1, ffn.n_ff)[:, ffn.bucket.long()] >= threshold
        acc[0] += int(sel.sum())
        acc[1] += sel.shape[0]
        return acc

    def gather_rows(self, src, idx, out=None) -> torch.Tensor:
        return self._out(src[idx.long()], out)

    @staticmethod
    def _out(y: torch.Tensor, out) -> torch.Tensor:
        if out is None:
            return y.float().contiguous()
        out.copy_(y)
        return out
