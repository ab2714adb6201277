// Selections: which rows a step computes, as compacted lists in ascending order, made on the device.
//
// PowerInfer's predictor is scores = fc2 @ relu(fc1 @ x). Its two products run on the other kernels
// (runtime/gpu/cuda.py: predict): fc1 [r, d] through gemv.cu with act = relu, then fc2 stored TRANSPOSED, [r, n_ff],
// through sparse_ffn.cu's sparse_down over every row: scores = sum over hidden units i of hidden[i] * fc2_t[i, :],
// and a unit that ReLU zeroes is never read (the CPU kernel does the same: half or more of fc2 is skipped).
//
// Item i of n is selected for token t when scores[t, c] >= threshold, c = bucket[i] (bucket null: c = i), and
// skip[i] == 0 (skip null: nothing skipped); scores null: every item for every token. Two launches, both with the
// same grid of B blocks (B from the SM count and n only, never from the data: runtime/gpu/cuda.py), block b owning
// items [b * seg, (b + 1) * seg), seg = ceil(n / B), read coalesced 256 at a time:
//   select_count: counts[b] = block b's selected items; zero (optional, [T, n]) gets 0 where a token does not
//     select an item (the GPU's h: sparse_up writes only the selected rows);
//   select_rows / select_active: block b sums counts[0..b) for its first slot and writes its items in order, one
//     ballot and one barrier per 256 items; the last block writes the total to *count.
// select_rows writes entries row | tokens << 24 (bit 24 + t: token t selects the row; T <= 8), the GPU's list for
// sparse_ffn.cu; select_active writes plain ids, the CPU's neurons. The result does not depend on timing.

#include "quant.cuh"

#define SELECT_THREADS 256

__device__ __forceinline__ u32 select_mask(const float* __restrict__ scores, const int* __restrict__ bucket, int n_ff,
                                           float threshold, const u8* __restrict__ skip, int T, int i) {
  if (skip && skip[i]) return 0u;
  if (!scores) return T >= 32 ? ~0u : (1u << T) - 1u;
  const int c = bucket ? bucket[i] : i;
  u32 m = 0;  // past 32 tokens (the CPU's list of a prefill) only m != 0 matters
  for (int t = 0; t < T; ++t) m |= (u32)(scores[(i64)t * n_ff + c] >= threshold) << (t & 31);
  return m;
}

__device__ __forceinline__ int block_isum(int v, int* buf) {  // every thread gets the block's sum; two barriers
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  if (lane == 0) buf[w] = v;
  __syncthreads();
  int s = lane < nw ? buf[lane] : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
  __syncthreads();
  return s;
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS) select_count(
    const float* __restrict__ scores, const int* __restrict__ bucket, int n_ff, float threshold,
    const u8* __restrict__ skip, int T, int n, float* __restrict__ zero, int* __restrict__ counts) {
  __shared__ int buf[32];
  const int seg = (n + (int)gridDim.x - 1) / (int)gridDim.x;
  const int b = imin((int)blockIdx.x * seg, n), e = imin(b + seg, n);
  int mine = 0;
  for (int i = b + (int)threadIdx.x; i < e; i += SELECT_THREADS) {
    const u32 m = select_mask(scores, bucket, n_ff, threshold, skip, T, i);
    mine += m != 0u;
    if (zero)
      for (int t = 0; t < T; ++t)
        if (!((m >> t) & 1u)) zero[(i64)t * n + i] = 0.f;
  }
  const int total = block_isum(mine, buf);
  if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

__device__ __forceinline__ void select_write(const float* __restrict__ scores, const int* __restrict__ bucket,
                                             int n_ff, float threshold, const u8* __restrict__ skip, int T, int n,
                                             const int* __restrict__ counts, u32* __restrict__ out,
                                             int* __restrict__ count, bool entries) {
  __shared__ int buf[32], warp_at[SELECT_THREADS / 32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int seg = (n + (int)gridDim.x - 1) / (int)gridDim.x;
  const int b = imin((int)blockIdx.x * seg, n), e = imin(b + seg, n);
  int before = 0;  // selected items of the blocks before this one
  for (int i = (int)threadIdx.x; i < (int)blockIdx.x; i += SELECT_THREADS) before += counts[i];
  int at = block_isum(before, buf);
  for (int i0 = b; i0 < e; i0 += SELECT_THREADS) {  // block-uniform loop
    const int i = i0 + (int)threadIdx.x;
    const u32 m = i < e ? select_mask(scores, bucket, n_ff, threshold, skip, T, i) : 0u;
    const u32 votes = __ballot_sync(FULL_MASK, m != 0u);
    if (lane == 0) warp_at[w] = __popc(votes);
    __syncthreads();
    int off = at;  // this warp's first slot
    for (int v = 0; v < w; ++v) off += warp_at[v];
    int round = 0;
    for (int v = 0; v < SELECT_THREADS / 32; ++v) round += warp_at[v];
    if (m) {
      const int slot = off + __popc(votes & ((1u << lane) - 1u));
      out[slot] = entries ? (u32)i | (m << 24) : (u32)i;
    }
    at += round;
    __syncthreads();  // warp_at is rewritten by the next round
  }
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) *count = at;
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS) select_rows(
    const float* __restrict__ scores, const int* __restrict__ bucket, int n_ff, float threshold,
    const u8* __restrict__ skip, int T, int n, const int* __restrict__ counts, u32* __restrict__ out,
    int* __restrict__ count) {
  select_write(scores, bucket, n_ff, threshold, skip, T, n, counts, out, count, true);
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS) select_active(
    const float* __restrict__ scores, const int* __restrict__ bucket, int n_ff, float threshold,
    const u8* __restrict__ skip, int T, int n, const int* __restrict__ counts, int* __restrict__ out,
    int* __restrict__ count) {
  select_write(scores, bucket, n_ff, threshold, skip, T, n, counts, reinterpret_cast<u32*>(out), count, false);
}
