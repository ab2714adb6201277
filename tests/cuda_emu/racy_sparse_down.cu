// The known-racy original of sparse_down (runtime/gpu/kernels/sparse_ffn.cu before commit 3b64de8, issue #25), kept
// verbatim so that tests/test_cuda_races.py can show the emulation's race detector flags it however the live kernel
// is rewritten. DO NOT FIX: the race is the point. Its `busy` flag races twice: thread 0 resets it at the top of each
// token group with no barrier after the reset, so another warp's lane 0 may set it first (write after write); and
// the `continue` skips the closing barrier, so thread 0's next reset may land under a warp still reading it (write
// after read). On a GPU either one makes a block skip its reduction and drop its rows' sums.
// Self-contained: the helpers it uses are copied from quant.cuh as they were then (F16 rows only).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define FULL_MASK 0xffffffffu
#define TILE_VALUES 1024

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float f16_to_f32(u16 h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return __half2float(__ushort_as_half(h));
#endif
}
__device__ __forceinline__ uint4 ld16(const u8* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ u32 word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

struct Quad { float4 q; float d; float m; };

struct TF16 {
  static constexpr int TILE = 2048, R = 2;
  static constexpr bool MIN = false;
  struct Frag { uint4 w[4]; };
  static __device__ __forceinline__ Frag tile(const u8* t, int lane) {
    return {{ld16(t + 16 * lane), ld16(t + 512 + 16 * lane), ld16(t + 1024 + 16 * lane), ld16(t + 1536 + 16 * lane)}};
  }
  static __device__ __forceinline__ Frag tail(const u8* t, int, int b) {
    const u8* p = t + 64 * b;
    return {{ld16(p), ld16(p + 16), ld16(p + 32), ld16(p + 48)}};
  }
  static __device__ __forceinline__ Quad quad(const Frag& f, int i) {
    const u32 a = word(f.w[i >> 1], 2 * (i & 1)), b = word(f.w[i >> 1], 2 * (i & 1) + 1);
    return {make_float4(f16_to_f32(a & 0xffffu), f16_to_f32(a >> 16), f16_to_f32(b & 0xffffu), f16_to_f32(b >> 16)),
            1.f, 0.f};
  }
};

__device__ __forceinline__ int take_lowest(u32& todo) {
  if (!todo) return -1;
  const int l = __ffs(todo) - 1;
  todo &= todo - 1;
  return l;
}

__device__ __forceinline__ void atomic_add4(float* y, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(y), v);
#else
  atomicAdd(y, v.x);
  atomicAdd(y + 1, v.y);
  atomicAdd(y + 2, v.z);
  atomicAdd(y + 3, v.w);
#endif
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
  __shared__ int busy;
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, nwb = blockDim.x >> 5;
  const int nb = cols >> 5, ntile = nb >> 5, ntail = nb & 31;
  const int unit = blockIdx.x;
  const bool is_tail = unit >= ntile;
  const int ulen = is_tail ? 32 * ntail : TILE_VALUES;
  const i64 uoff = (i64)unit * Q::TILE;  // the tail region starts where tile ntile would
  const int jb = (blockIdx.y * nwb + wib) * rows_per_warp;
  const int je = imin(jb + rows_per_warp, k);
  for (int t0 = 0; t0 < T; t0 += TT) {
    if (threadIdx.x == 0) busy = 0;
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
    if (worked && lane == 0) busy = 1;
    __syncthreads();
    if (!busy) continue;  // block-uniform: no row of this block was active for these tokens
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
    __syncthreads();  // red and busy are reused by the next tokens
  }
}

#define SPARSE_DOWN_ENTRY(sfx, Q, TT)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256, 2) sparse_down_##sfx##_t##TT(                                      \
      const u8* __restrict__ w, i64 stride, int cols, const float* __restrict__ h, int k, int T,                     \
      float* __restrict__ y, int rows_per_warp) {                                                                   \
    sparse_down<Q, TT>(w, stride, cols, h, k, T, y, rows_per_warp);                                                 \
  }
SPARSE_DOWN_ENTRY(f16, TF16, 1)
SPARSE_DOWN_ENTRY(f16, TF16, 2)
