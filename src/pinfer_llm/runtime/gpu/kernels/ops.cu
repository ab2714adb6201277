// Small elementwise and gather ops on fp32 activations, so a step never leaves the GPU for them.
//
// add_f32:         out = a + b (out may be a or b: the residual update in place), n elements, grid-stride; b has
//                  nb elements, repeated when nb < n (a bias added to every row of a [T, d] array: nb = d).
// gather_rows_f32: out[i, :] = src[idx[i], :], one block per output row (the prefill gathers of activations;
//                  weight rows are gathered by gemv.cu's dequant).
// set_cols_f32:    a[t, idx[i]] = value for every row t of a [T, n] and i < n_idx (the predictor's outlier neurons,
//                  always active: a launch, so that a captured step replays it). Grid (T), 256 threads.

#include "quant.cuh"

extern "C" __global__ void __launch_bounds__(256) add_f32(const float* a, const float* b, float* out, i64 n, i64 nb) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    out[i] = a[i] + b[nb == n ? i : i % nb];
}

extern "C" __global__ void __launch_bounds__(256) gather_rows_f32(const float* __restrict__ src,
                                                                  const int* __restrict__ idx, int cols,
                                                                  float* __restrict__ out) {
  const float* s = src + (i64)idx[blockIdx.x] * cols;
  float* o = out + (i64)blockIdx.x * cols;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = s[i];
}

extern "C" __global__ void __launch_bounds__(256) set_cols_f32(float* __restrict__ a, const int* __restrict__ idx,
                                                               int n_idx, int n, float value) {
  float* row = a + (i64)blockIdx.x * n;
  for (int i = threadIdx.x; i < n_idx; i += blockDim.x) row[idx[i]] = value;
}
