// The predictor's last step: the ascending list of the neurons it selects, for the CPU side.
//
// PowerInfer's predictor is scores = fc2 @ relu(fc1 @ x). Its two products run on the other kernels
// (runtime/gpu/cuda.py: predict): fc1 [r, d] through gemv.cu with act = relu, then fc2 stored TRANSPOSED, [r, n_ff],
// through sparse_ffn.cu's sparse_down: scores = sum over hidden units i of hidden[i] * fc2_t[i, :], and a unit that
// ReLU zeroes is never read (the CPU kernel does the same: half or more of fc2 is skipped).
//
// select_active: ids = ascending neurons i with scores[t, i] >= threshold for some token t and skip[i] == 0
// (skip: the neurons the GPU computes itself, null for none), count[0] = their number. One block of 1024 threads:
// thread i owns one contiguous segment of the neurons, counts its active ones, a block-wide exclusive scan gives
// each its first output slot, and it writes its ids in order. All loads of a segment are independent, so the whole
// vector streams in one pass (an n_ff of 32768 is 32 neurons per thread).

#include "quant.cuh"

__device__ __forceinline__ bool selected(const float* __restrict__ scores, int T, int n, float threshold,
                                         const u8* __restrict__ skip, int i) {
  if (skip && skip[i]) return false;
  for (int t = 0; t < T; ++t)
    if (scores[(i64)t * n + i] >= threshold) return true;
  return false;
}

extern "C" __global__ void __launch_bounds__(1024) select_active(const float* __restrict__ scores, int T, int n,
                                                                 float threshold, const u8* __restrict__ skip,
                                                                 int* __restrict__ ids, int* __restrict__ count) {
  __shared__ int warp_total[32];
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, nw = blockDim.x >> 5;
  const int seg = (n + (int)blockDim.x - 1) / (int)blockDim.x;
  const int b = imin(tid * seg, n), e = imin(b + seg, n);
  int mine = 0;
  for (int i = b; i < e; ++i) mine += selected(scores, T, n, threshold, skip, i);
  int incl = mine;  // inclusive scan within the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(FULL_MASK, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_total[w] = incl;
  __syncthreads();
  if (w == 0) {  // inclusive scan of the warp totals
    int s = lane < nw ? warp_total[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(FULL_MASK, s, o);
      if (lane >= o) s += v;
    }
    warp_total[lane] = s;
  }
  __syncthreads();
  int at = (w > 0 ? warp_total[w - 1] : 0) + incl - mine;
  for (int i = b; i < e; ++i)
    if (selected(scores, T, n, threshold, skip, i)) ids[at++] = i;
  if (tid == (int)blockDim.x - 1) *count = at;
}
