// Dense products over device-layout rows (quant.cuh): attention projections, the output head, predictor fc1.
//
// gemv_<type>_t<TM>: y[T, rows] = x[T, cols] @ W^T (+ bias) (relu if act == 1) (+ y if accumulate), T <= TM.
//   Decode-sized T (1..8): one warp per R rows (quant.cuh dot_rows: 16-byte coalesced loads, tiles
//   double-buffered, each x load shared by the R rows), weights read exactly once; the grid strides over row
//   groups, so any grid size is correct. 128 threads per block.
// dequant_<type>: out[n, cols] = rows idx[0..n) of W (all rows if idx is null) as f32, or f16 into out16. For
//   prefill, where the wrapper dequantises tiles of W and hands them to cuBLAS (cupy.matmul), and for gathering
//   rows (token embeddings, a layer's GPU neurons for a dense prefill GEMM). One warp per row: it decodes exactly
//   what it loads and stores 512 contiguous bytes per quad (f32). 128 threads per block, grid-stride.

#include "quant.cuh"

template <class Q, int TM>
__device__ __forceinline__ void gemv(const u8* __restrict__ w, i64 stride, int cols, int rows,
                                     const float* __restrict__ x, int T, float* __restrict__ y,
                                     const float* __restrict__ bias, int accumulate, int act) {
  constexpr int R = Rows<Q, TM>::R;
  const int lane = threadIdx.x & 31;
  const int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int nwarps = (int)((gridDim.x * blockDim.x) >> 5);
  for (int r0 = warp * R; r0 < rows; r0 += nwarps * R) {
    const u8* rp[R];
    bool live[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      live[r] = r0 + r < rows;
      rp[r] = w + (i64)(live[r] ? r0 + r : r0) * stride;
    }
    float acc[R][TM];
    dot_rows<Q, R, TM, TM == 1>(acc, rp, live, cols, x, T, lane);  // pipelined for decode
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (!live[r]) continue;
        const float b = bias ? bias[r0 + r] : 0.f;
#pragma unroll
        for (int t = 0; t < TM; ++t) {
          if (t >= T) break;
          float v = acc[r][t] + b;
          if (act == 1) v = fmaxf(v, 0.f);
          float* o = y + (i64)t * rows + r0 + r;
          *o = accumulate ? *o + v : v;
        }
      }
    }
  }
}

__device__ __forceinline__ void store_quad(float* out, u16* out16, i64 at, float4 v) {
  if (out16) {
    uint2 p = make_uint2((u32)f32_to_f16(v.x) | ((u32)f32_to_f16(v.y) << 16),
                         (u32)f32_to_f16(v.z) | ((u32)f32_to_f16(v.w) << 16));
    *reinterpret_cast<uint2*>(out16 + at) = p;
  } else {
    *reinterpret_cast<float4*>(out + at) = v;
  }
}

__device__ __forceinline__ float4 quad_values(const Quad& q) {
  return make_float4(fmaf(q.d, q.q.x, q.m), fmaf(q.d, q.q.y, q.m), fmaf(q.d, q.q.z, q.m), fmaf(q.d, q.q.w, q.m));
}

template <class Q>
__device__ __forceinline__ void dequant(const u8* __restrict__ w, i64 stride, int cols,
                                        const int* __restrict__ idx, int n, float* __restrict__ out,
                                        u16* __restrict__ out16) {
  const int lane = threadIdx.x & 31;
  const int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int nwarps = (int)((gridDim.x * blockDim.x) >> 5);
  const int nb = cols >> 5, ntile = nb >> 5, ntail = nb & 31;
  for (int i = warp; i < n; i += nwarps) {
    const u8* row = w + (i64)(idx ? idx[i] : i) * stride;
    const i64 o = (i64)i * cols;
    for (int ti = 0; ti < ntile; ++ti) {
      const typename Q::Frag f = Q::tile(row + (i64)ti * Q::TILE, lane);
#pragma unroll
      for (int c = 0; c < 8; ++c) store_quad(out, out16, o + ti * TILE_VALUES + 128 * c + 4 * lane, quad_values(Q::quad(f, c)));
    }
    if (lane < ntail) {
      const typename Q::Frag f = Q::tail(row + (i64)ntile * Q::TILE, ntail, lane);
#pragma unroll
      for (int q = 0; q < 8; ++q) store_quad(out, out16, o + ntile * TILE_VALUES + 32 * lane + 4 * q, quad_values(Q::quad(f, q)));
    }
  }
}

#define GEMV_ENTRY(sfx, Q, TM)                                                                                      \
  extern "C" __global__ void __launch_bounds__(128, 3) gemv_##sfx##_t##TM(                                           \
      const u8* __restrict__ w, i64 stride, int cols, int rows, const float* __restrict__ x, int T,                 \
      float* __restrict__ y, const float* __restrict__ bias, int accumulate, int act) {                             \
    gemv<Q, TM>(w, stride, cols, rows, x, T, y, bias, accumulate, act);                                             \
  }
#define DEQUANT_ENTRY(sfx, Q)                                                                                       \
  extern "C" __global__ void __launch_bounds__(128) dequant_##sfx(const u8* __restrict__ w, i64 stride, int cols,  \
                                                                  const int* __restrict__ idx, int n,              \
                                                                  float* __restrict__ out, u16* __restrict__ out16) { \
    dequant<Q>(w, stride, cols, idx, n, out, out16);                                                                \
  }
#define GEMV_ENTRIES(sfx, Q) GEMV_ENTRY(sfx, Q, 1) GEMV_ENTRY(sfx, Q, 8) DEQUANT_ENTRY(sfx, Q)
PINFER_FOR_TYPES(GEMV_ENTRIES)
