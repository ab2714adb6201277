// Norms over rows of fp32 activations: out[t, :] = norm(x[t, :]), one block per row (256 threads).
//
// rms_norm:   x / sqrt(mean(x^2) + eps) * w
// layer_norm: (x - mean) / sqrt(var + eps) * w + b (Falcon, OPT; b may be null), the variance in a second pass
//             over x (from L1) rather than E[x^2] - mean^2, which cancels badly when |mean| >> std.
// Two optional extras, each null or a [T, d] array, so that a hybrid layer's step needs no separate launches for
// them: `add` is added into x first (x += add, in place: the CPU's share of the layer before, into the residual),
// and `copy` receives x as normed (the residual that goes to the host beside the normed input).
// d % 4 == 0: 16-byte loads and stores, coalesced. A row is a few KB, so these kernels are latency-bound; what
// matters is one launch per row set and no host round trip. x is read with plain loads (not the read-only path):
// with `add` the kernel writes it.

#include "quant.cuh"

// The first pass over a row: x (+= add), copied out when asked; returns the row's 4 values at i.
__device__ __forceinline__ float4 norm_input(float* xr, const float* add, float* copy, int i) {
  float4 v = *reinterpret_cast<const float4*>(xr + i);
  if (add) {
    const float4 a = ldf4(add + i);
    v = make_float4(v.x + a.x, v.y + a.y, v.z + a.z, v.w + a.w);
    *reinterpret_cast<float4*>(xr + i) = v;
  }
  if (copy) *reinterpret_cast<float4*>(copy + i) = v;
  return v;
}

extern "C" __global__ void __launch_bounds__(256) rms_norm(float* __restrict__ x, const float* __restrict__ add,
                                                           const float* __restrict__ w, float* __restrict__ out,
                                                           float* __restrict__ copy, int d, float eps) {
  __shared__ float buf[32];
  const i64 row = (i64)blockIdx.x * d;
  float* xr = x + row;
  float* o = out + row;
  const float* ar = add ? add + row : nullptr;
  float* cr = copy ? copy + row : nullptr;
  float ss = 0.f;
  for (int i = 4 * threadIdx.x; i < d; i += 4 * blockDim.x) {
    const float4 v = norm_input(xr, ar, cr, i);
    ss += dot4(v, v);
  }
  const float inv = rsqrtf(block_sum(ss, buf) / (float)d + eps);
  for (int i = 4 * threadIdx.x; i < d; i += 4 * blockDim.x) {  // the same thread's own positions: its own writes
    const float4 v = *reinterpret_cast<const float4*>(xr + i), g = ldf4(w + i);
    *reinterpret_cast<float4*>(o + i) = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
  }
}

extern "C" __global__ void __launch_bounds__(256) layer_norm(float* __restrict__ x, const float* __restrict__ add,
                                                             const float* __restrict__ w, const float* __restrict__ b,
                                                             float* __restrict__ out, float* __restrict__ copy, int d,
                                                             float eps) {
  __shared__ float buf[32];
  const i64 row = (i64)blockIdx.x * d;
  float* xr = x + row;
  float* o = out + row;
  const float* ar = add ? add + row : nullptr;
  float* cr = copy ? copy + row : nullptr;
  float s = 0.f;
  for (int i = 4 * threadIdx.x; i < d; i += 4 * blockDim.x) s += sum4(norm_input(xr, ar, cr, i));
  const float mean = block_sum(s, buf) / (float)d;
  float ss = 0.f;
  for (int i = 4 * threadIdx.x; i < d; i += 4 * blockDim.x) {
    const float4 v = *reinterpret_cast<const float4*>(xr + i);
    const float4 c = make_float4(v.x - mean, v.y - mean, v.z - mean, v.w - mean);
    ss += dot4(c, c);
  }
  const float inv = rsqrtf(block_sum(ss, buf) / (float)d + eps);
  for (int i = 4 * threadIdx.x; i < d; i += 4 * blockDim.x) {
    const float4 v = *reinterpret_cast<const float4*>(xr + i), g = ldf4(w + i);
    const float4 c = b ? ldf4(b + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    *reinterpret_cast<float4*>(o + i) = make_float4((v.x - mean) * inv * g.x + c.x, (v.y - mean) * inv * g.y + c.y,
                                                    (v.z - mean) * inv * g.z + c.z, (v.w - mean) * inv * g.w + c.w);
  }
}
