// Small elementwise and gather ops on fp32 activations, so a step never leaves the GPU for them.
//
// add_f32:         out = a + b (out may be a or b: the residual update in place), n elements, grid-stride; b has
//                  nb elements, repeated when nb < n (a bias added to every row of a [T, d] array: nb = d).
// gather_rows_f32: out[i, :] = src[idx[i], :], one block per output row (the prefill gathers of activations;
//                  weight rows are gathered by gemv.cu's dequant).
// set_cols_f32:    a[t, idx[i]] = value for every row t of a [T, n] and i < n_idx (the predictor's outlier neurons,
//                  always active: a launch, so that a captured step replays it). Grid (T), 256 threads.
// count_active:    acc[0] += the (token, row) pairs of a split FFN's GPU rows whose score (original neuron ids:
//                  scores[t, bucket[j]]) is >= threshold, acc[1] += T: the device's share of ffn_active_fraction,
//                  kept on the device (the host reads it once, at the end of a run). One block, 256 threads.

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

extern "C" __global__ void __launch_bounds__(256) count_active(const float* __restrict__ scores,
                                                               const int* __restrict__ bucket, int k, int n, int T,
                                                               float threshold, int* __restrict__ acc) {
  int c = 0;
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int i = bucket[j];
    for (int t = 0; t < T; ++t) c += scores[(i64)t * n + i] >= threshold;
  }
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(FULL_MASK, c, o);
  if ((threadIdx.x & 31) == 0 && c) atomicAdd(acc, c);
  if (threadIdx.x == 0) atomicAdd(acc + 1, T);
}
