// sparse_down as it was until issue #25's rewrite (2026-12-03): tests/test_cuda_races.py plants its original race
// (the shared `busy` flag) in this copy, so that the race detector's check of that race outlives the kernel. Only
// the F16 two-token entry; CudaDevice never launches it. Arguments: (w, stride, cols, h, k, T, y, rows_per_warp),
// grid (units, ceil(k / (8 * rows_per_warp))), 256 threads.

#include "quant.cuh"

// The lowest set bit of *todo, removed; -1 when none is left.
__device__ __forceinline__ int take_lowest(u32& todo) {
  if (!todo) return -1;
  const int l = __ffs(todo) - 1;
  todo &= todo - 1;
  return l;
}

template <class Q, int TT>
__device__ __forceinline__ void sparse_down(const u8* __restrict__ w, i64 stride, int cols,
                                            const float* __restrict__ h, int k, int T, float* __restrict__ y,
                                            int rows_per_warp) {
  // Rows loaded side by side (fewer for two tokens, whose accumulators take 64 registers): more would push ptxas
  // past the 128 registers that let two blocks share an SM.
  constexpr int R = TT > 1 ? (Q::R + 1) / 2 : Q::R;
  // The block's partial sums of its unit, per token. Tile positions p sit at p (a warp writes 512 contiguous
  // bytes per quad: no bank conflicts); tail positions at p + 4 * (p / 32), padding each 32-value block by 16 bytes
  // so that lanes 32 floats apart land in different banks.
  __shared__ __align__(16) float red[TT][1152];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, nwb = blockDim.x >> 5;
  const int nb = cols >> 5, ntile = nb >> 5, ntail = nb & 31;
  const int unit = blockIdx.x;
  const bool is_tail = unit >= ntile;
  const int ulen = is_tail ? 32 * ntail : TILE_VALUES;
  const i64 uoff = (i64)unit * Q::TILE;  // the tail region starts where tile ntile would
  const int jb = (blockIdx.y * nwb + wib) * rows_per_warp;
  const int je = imin(jb + rows_per_warp, k);
  for (int t0 = 0; t0 < T; t0 += TT) {
    float acc[TT][32];
#pragma unroll
    for (int t = 0; t < TT; ++t)
#pragma unroll
      for (int v = 0; v < 32; ++v) acc[t][v] = 0.f;
    bool worked = false;
    for (int j0 = jb; j0 < je; j0 += 32) {
      const int j = j0 + lane;
      float hv[TT];
      bool any = false;
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        hv[t] = (j < je && t0 + t < T) ? h[(i64)(t0 + t) * k + j] : 0.f;
        any |= hv[t] != 0.f;
      }
      u32 todo = __ballot_sync(FULL_MASK, any);
      worked |= todo != 0;
      while (todo) {
        typename Q::Frag f[R];
        float hr[R][TT];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int l = take_lowest(todo);
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            hr[r][t] = __shfl_sync(FULL_MASK, hv[t], l >= 0 ? l : 0);
            if (l < 0) hr[r][t] = 0.f;
          }
          const u8* row = w + (i64)(j0 + (l >= 0 ? l : 0)) * stride + uoff;
          if (l < 0 || (is_tail && lane >= ntail)) f[r] = typename Q::Frag{};
          else f[r] = is_tail ? Q::tail(row, ntail, lane) : Q::tile(row, lane);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const Quad qd = Q::quad(f[r], i);
            const float v[4] = {fmaf(qd.d, qd.q.x, qd.m), fmaf(qd.d, qd.q.y, qd.m), fmaf(qd.d, qd.q.z, qd.m),
                                fmaf(qd.d, qd.q.w, qd.m)};
#pragma unroll
            for (int t = 0; t < TT; ++t)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[t][4 * i + e] = fmaf(hr[r][t], v[e], acc[t][4 * i + e]);
          }
        }
      }
    }
    // One barrier that also tells every thread whether any warp worked: a flag in shared memory would need a
    // barrier after its reset as well (a fast warp could set it before thread 0 cleared it, and one that skipped the
    // closing barrier could clear it under a slow warp still reading it), and the block would drop its rows' sums.
    if (!__syncthreads_or(worked)) continue;  // block-uniform: no row of this block was active for these tokens
    for (int wi = 0; wi < nwb; ++wi) {  // the warps add their sums one after another
      if (wib == wi) {
#pragma unroll
        for (int t = 0; t < TT; ++t)
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            float4* p = reinterpret_cast<float4*>(&red[t][is_tail ? 36 * lane + 4 * i : 128 * i + 4 * lane]);
            float4 a = make_float4(acc[t][4 * i], acc[t][4 * i + 1], acc[t][4 * i + 2], acc[t][4 * i + 3]);
            if (wi > 0) {
              const float4 o = *p;
              a.x += o.x; a.y += o.y; a.z += o.z; a.w += o.w;
            }
            *p = a;
          }
      }
      __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t0 + t >= T) break;
      for (int p = 4 * (int)threadIdx.x; p < ulen; p += 4 * (int)blockDim.x) {
        const float4 v = *reinterpret_cast<const float4*>(&red[t][is_tail ? p + 4 * (p >> 5) : p]);
        atomic_add4(y + (i64)(t0 + t) * cols + unit * TILE_VALUES + p, v);
      }
    }
    __syncthreads();  // red is reused by the next tokens
  }
}

extern "C" __global__ void __launch_bounds__(256, 2) sparse_down_old_f16_t2(
    const u8* __restrict__ w, i64 stride, int cols, const float* __restrict__ h, int k, int T, float* __restrict__ y,
    int rows_per_warp) {
  sparse_down<TF16, 2>(w, stride, cols, h, k, T, y, rows_per_warp);
}
