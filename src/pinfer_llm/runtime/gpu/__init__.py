"""pinfer's GPU half: CUDA kernels for the hot neurons (kernels/*.cu, through CuPy) and a CPU reference device.

Two devices, one interface. `CudaDevice(device_id=0)` runs the kernels (arrays are cupy arrays; it raises
`GPUUnavailable` with a one-line reason when CuPy, a driver or the device is missing). `ReferenceDevice()` computes
the same with torch on the CPU (arrays are torch tensors), exactly (float64 by default): the yardstick for the kernels
and a stand-in device for testing a hybrid executor without a GPU.

Arrays: activations and outputs are float32, C-contiguous; index arrays int32; masks uint8; the KV cache float16.
Every method that takes `out=` writes there and returns it; without it the result is a new array.

Memory and transfers
  asarray(np_array) -> array            copy to the device (dtype kept)
  to_numpy(array) -> np.ndarray         copy back (synchronises)
  empty(shape, dtype=f32), zeros(shape, dtype=f32), synchronize()
  pinned(shape, dtype=f32) -> np.ndarray            page-locked host buffer (plain numpy on the reference)
  stream() -> Stream                    `with dev.stream() as s:` launches inside go to s; s.synchronize();
                                        s.record() -> Event (event.synchronize() waits for the work queued before it)
  to_device_async(host, out, stream=None), to_host_async(array, out, stream=None)      queued on the stream; from
                                        and to pinned() buffers they do not wait (read `out` after an event)
  view(buf, offset, shape, dtype=f32)   an array over bytes offset.. of a uint8 device buffer (no copy)
  copy(src, out), zero(out)             on the device, queued
  start_timeline() -> Timeline          from now on each operation (and copy) is bracketed by events and its time
                                        summed by kind (runtime/gpu/timing.py; pi-run --gpu-timing)

Weights (from the file's encoding: numpy uint8 rows or typed arrays; types F32, F16, BF16, Q4_0, Q4_1, Q8_0 by ggml id
or name, see layout.py; row lengths multiples of 32)
  upload_matrix(raw, ty, cols, rows=None) -> Matrix             rows: index array gathering some rows, in order
  upload_ffn(up, down_t, ty, n_embd, bucket, *, act, gate=None, up_bias=None, down_ty=None) -> FFNRows
      up, gate, down_t: the layer's whole matrices [n_ff, n_embd] as in the file (down_t = PowerInfer's ffn_down_t,
      row i = neuron i's output column); bucket: int32 [k] neurons the GPU computes (GPU row j = neuron bucket[j]);
      act: "silu" | "relu" | "drelu" (gated) | "relu_up" | "gelu_up" (gate-less, Falcon/OPT: h = act(up x + b)),
      or codes 0-4 (weights.ACT_CODES); up_bias: fp32 [n_ff] in neuron order (gathered with bucket).
  upload_predictor(fc1, fc2) -> PredictorWeights   fc1 [r, n_embd], fc2 [n_ff, r] as in PowerInfer's file: float
      arrays (held as F16, fc2 transposed), or fc2 as the file's rows (raw, type, cols) of Q4_0/Q4_1/Q8_0 (held as
      stored, fc1 too when given so)

Compute
  matmul(W, x[T, cols], *, bias=None, out=None, accumulate=False, relu=False) -> y[T, rows]
      y = x W^T (+ bias) (relu) (+ out when accumulate). T <= 8 per launch streams W once; T >= 32 dequantises
      tiles of W and uses cuBLAS.
  dequant_rows(W, idx=None, dtype=f32|f16) -> [n, cols]            rows idx (int32 device array) or all, decoded
  ffn_up(ffn, x[T, d], *, scores=None, threshold=0.0, cats=None, out=None) -> h[T, k]
      the GPU rows' activations. scores: fp32 [T, n_ff] (or [n_ff] for T = 1) indexed by ORIGINAL neuron id, row j
      active for token t iff scores[t, bucket[j]] >= threshold; None = all active. h = 0 for inactive rows, and for
      rows whose activation is exactly 0. cats: SwiGLU's CATS threshold (h = 0 where |silu(g)| <= cats).
  ffn_down(ffn, h[T, k], out[T, d]) -> out                            out += h @ down rows (rows with h == 0 skipped)
  ffn(ffn, x, *, scores=None, threshold=0.0, cats=None, out=None) -> y[T, d]      both stages; adds into out if given
      (from PREFILL_T = 32 tokens: GEMMs over dequantised tiles of the rows and an activation kernel, same result)
  predict(pred, x[T, d], *, threshold=0.0, skip=None, ids=False, found=None) -> scores[T, n_ff]
      with ids=True -> (scores, found int32 [1 + n_ff]): found[0] = count, then the ascending neurons with a score
      >= threshold for some token and skip[i] == 0 (skip: uint8 [n_ff], e.g. the GPU neurons, so the list is the
      CPU's work), in one buffer so that they cross in one copy; written into `found` when given
  rms_norm(x, w, eps, out=None, *, add=None, copy=None), layer_norm(x, w, b or None, eps, out=None, ...)
      per row of x [T, d]; add [T, d]: x += add first (in place); copy [T, d]: receives x (after the add)
  kv_cache(n_kv, max_ctx, head_dim) -> (k, v)          f16 zeros [n_kv, max_ctx, head_dim]
  attention(q[T, n_head, hd], k[T, n_kv, hd], v, cache_k, cache_v, pos, *, n_rot=None, neox=False, base=10000.0,
            rope_scale=1.0, scale=None, out=None, pos_at=None) -> [T, n_head, hd]
      tokens at positions pos..pos+T-1: RoPE (llama pairs (2i, 2i+1), or NeoX halves; the first n_rot dims; angle
      pos / rope_scale * base^(-2i/n_rot)) on q and k IN PLACE, k and v into the caches, then causal attention over
      positions 0..pos+t with GQA (head h reads kv head h // (n_head // n_kv)); scale defaults to 1/sqrt(hd).
      pos_at: a device int32 [1] holding pos, read by the kernels instead (captured steps)
  add(a, b, out=None)                   b of a's shape, or of its last dimension (added to every row)
  gather_rows(src[n, cols], idx, out=None)
  set_cols(a[T, n], idx, value)          a[:, idx] = value (idx: int32 device array)
  count_active(ffn, scores, threshold, acc)        acc int32 [2]: acc[0] += (token, GPU row) pairs whose score is
                                        >= threshold, acc[1] += T (the device's share of the active-neuron count)

Captured steps (CudaDevice; runtime/gpu/graph.py). can_capture: whether the device can (ReferenceDevice: False).
  begin_capture(stream), end_capture(stream) -> graph, abort_capture(stream), launch_graph(graph, stream)
      between begin and end the work queued on the stream is kept, not run; scratch (empty/zeros) comes from a
      workspace shared by every graph
  graph_event(stream) -> event          recorded on the stream; in a capture an event node that fires each replay

Launch cost: each CuPy launch from Python costs ~10 us of host time, more than most of these kernels take on an
H200 (10-40 us per layer op), so the hybrid executor captures each layer's decode step once in a CUDA graph and
replays it (runtime/hybrid/executor.py); benchmarks/gpu_check.py times kernels that way.

Measured on an H200 (benchmarks/gpu_check.py, all 78 checks against this reference passed): see kernels/sparse_ffn.cu
for the sparse FFN at 10% active rows; F16 GEMV 90% of copy bandwidth; decode attention over 4096 positions 39%.
Known gap: the 2-8-token variants (gemv/sparse_up *_t8) spill registers and run 4-6x slower than one token.

A hybrid FFN step: the GPU computes `ffn(gpu_rows, x, scores=...)` for its k neurons while the CPU computes the rest
(predict(..., skip=gpu_mask, ids=True) gives the CPU's active neurons), then the two partial outputs are added; how
the copies are laid out and overlapped: runtime/hybrid/executor.py.
"""

from pinfer_llm.runtime.gpu.cuda import CudaDevice, GPUUnavailable
from pinfer_llm.runtime.gpu.reference import ReferenceDevice
from pinfer_llm.runtime.gpu.weights import ACT_CODES, FFNRows, Matrix, PredictorWeights

__all__ = ["ACT_CODES", "CudaDevice", "FFNRows", "GPUUnavailable", "Matrix", "PredictorWeights", "ReferenceDevice"]
