// Sparse FFN over a layer's GPU-resident neurons (PowerInfer's GPU half, in pinfer's own code).
//
// The GPU holds, per layer, k "GPU rows" in the device layout (quant.cuh): gate [k, d] (absent for gate-less FFNs),
// up [k, d] and down_t [k, d] (row j = neuron bucket[j]'s output column), gathered from the file in bucket order.
//
// Stage A, sparse_up_<type>_t<TM>: h[T, k] = act(gate . x, up . x) on the rows the predictor selects.
//   A block owns `group` (<= 32) consecutive GPU rows, one per lane: each lane reads its row's scores (indexed
//   by the ORIGINAL neuron id bucket[j]; scores[t, :] per token), a ballot gives the rows any token selects, and
//   the block streams them R at a time, its W warps splitting each row's 1024-wide tiles (quant.cuh dot_rows:
//   16-byte coalesced loads, R rows side by side), partial sums added in shared memory. A row no token selects is
//   never read.
//   ReLU family (codes 1, 2) and SwiGLU with a CATS threshold: the gate rows are read first; a row whose
//   activation is exactly zero for every selected token (gate <= 0; |silu(gate)| <= t) never has its up row read.
//   Gate-less codes 3, 4 read only the up row (which plays the gate's role), h = relu/gelu(up . x + b).
//   Token t's h is 0 where its own score is below the threshold (a batch runs on the union of its tokens' rows;
//   each token's result is what it would be alone).
// Stage B, sparse_down_<type>_t<TT>: y[T, d] += sum_j h[t, j] * down_t[j, :], rows with h == 0 for every token
//   never read. Each block owns one column unit (a 1024-wide tile, or the tail) of y and a range of rows; each
//   lane accumulates its 32 positions of the unit over its warp's rows in registers (the same positions it loads,
//   so no shuffles), the block's warps add their partial sums in shared memory, and the block adds the unit to y
//   with one atomic per 4 floats (a 16-byte atomic on Hopper). Why partial sums and not PowerInfer's atomic per
//   element per row: an active row of a 5120-wide Q4_0 matrix is 2.9 KB of weights but would be 20 KB of atomics.
//   Here atomics cost 4 KB per block and block, and a block covers 8 * rows_per_warp rows, so they stay a fraction
//   of the weight bytes when rows_per_warp is sized to the active rows (runtime/gpu/cuda.py picks the grid).
//   Tokens are processed TT at a time (acc is 32 * TT registers); more tokens loop over the rows again, from L2.
//
// Measured (benchmarks/gpu_check.py on an H200, CUDA graphs, copy 4.25 TB/s; Llama-13B layer, 10% of 13824 rows
// active, one token): F16 gate+up 19 us = 35% of copy, down 9.6 us = 35%; Q8_0 20% / 21%; Q4_0 11% / 10%
// (dequantising 4-bit to fp32 is arithmetic-bound). A 10% layer is only 28 + 14 MB, so the few dependent memory
// round trips per kernel (bucket -> scores -> rows -> h; h -> rows -> atomics) dominate: the 70% goal needs fewer of
// them (scores already in GPU-row order from the predictor, stages fused), not wider loads. The dense GEMV of the
// same types reads at 90% (F16), 47% (Q8_0), 31% (Q4_0) of copy. 8-token variants spill and run 4-6x slower than
// one token: see runtime/gpu/__init__.py.
//
// Launch: sparse_up: 32 * W threads per block, W = min(6, tiles + tail) (a tile per warp), grid.x *
//         group >= k (or fewer: blocks stride).
//         sparse_down: 256 threads per block, grid = (ntile + (ntail > 0), ceil(k / (8 * rows_per_warp))).

#include "quant.cuh"

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// Is a row worth its up row for a token whose gate dot is g? (False means the activation is exactly 0.)
__device__ __forceinline__ bool gate_live(int act, float g, float cats) {
  if (act == ACT_SILU) return cats < 0.f || fabsf(silu(g)) > cats;
  return g > 0.f;  // ReGLU, dReLU
}

__device__ __forceinline__ float activate(int act, float g, float u, float b, float cats) {
  switch (act) {
    case ACT_SILU: {
      const float s = silu(g);
      return (cats >= 0.f && fabsf(s) <= cats) ? 0.f : s * u;
    }
    case ACT_RELU: return g > 0.f ? g * u : 0.f;
    case ACT_DRELU: return (g > 0.f && u > 0.f) ? g * u : 0.f;
    case ACT_RELU_UP: return fmaxf(u + b, 0.f);
    default: {  // ACT_GELU_UP, exact erf as HF's "gelu"
      const float z = u + b;
      return 0.5f * z * (1.f + erff(z * 0.70710678118654752f));
    }
  }
}

// Sum the W warps' partial dots of phase n (buffer n & 1) into tot. One barrier per phase is enough with two
// buffers: a warp writes buffer b for phase n + 2 only after the barrier of phase n + 1, which every thread reaches
// after reading phase n's buffer b.
template <int N, int RP, int TM>
__device__ __forceinline__ void block_reduce_rows(float (&tot)[N][TM], float (&part)[2][RP][8][TM],
                                                  const float (&mine)[N][TM], int& phase) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  float(&p)[RP][8][TM] = part[phase & 1];
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < N; ++r)
#pragma unroll
      for (int t = 0; t < TM; ++t) p[r][w][t] = mine[r][t];
  __syncthreads();
#pragma unroll
  for (int r = 0; r < N; ++r)
#pragma unroll
    for (int t = 0; t < TM; ++t) {
      float v = 0.f;
      for (int i = 0; i < nw; ++i) v += p[r][i][t];  // fixed order: the result does not depend on timing
      tot[r][t] = v;
    }
  ++phase;
}

// A block owns `group` (<= 32) candidate rows at a time; its W warps split each row's units (tiles, tail)
// between them, so a row costs about one memory latency per phase however long it is, and the warps' partial sums
// meet in shared memory. (One warp per row with a double-buffered tile loop paid one latency per tile: measured
// 27 us for a 10% F16 Llama-13B layer on an H200.) Every warp evaluates the same candidates, so the loop over the
// selected rows is uniform across the block.
template <class Q, int TM>
__device__ __forceinline__ void sparse_up(const u8* __restrict__ gate, const u8* __restrict__ up, i64 stride,
                                          int cols, const int* __restrict__ bucket, int k,
                                          const float* __restrict__ scores, int n_ff, float threshold,
                                          const float* __restrict__ bias, int act, float cats,
                                          const float* __restrict__ x, int T, float* __restrict__ h, int group) {
  constexpr int R = Rows<Q, TM>::R;
  __shared__ float part[2][2 * R][8][TM];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const bool gated = act <= ACT_DRELU;
  // SwiGLU without CATS has no zero activations: the gate cannot rule out the up row.
  const bool gate_first = gated && (act != ACT_SILU || cats >= 0.f);
  int phase = 0;
  for (int j0 = blockIdx.x * group; j0 < k; j0 += gridDim.x * group) {
    const int j = j0 + lane;
    const bool mine = lane < group && j < k;
    u32 on = 0;  // bit t: token t selects this lane's row
    if (mine) {
      if (scores) {
        const int n = bucket[j];
        for (int t = 0; t < T; ++t) on |= (u32)(scores[(i64)t * n_ff + n] >= threshold) << t;
      } else {
        on = (1u << T) - 1u;
      }
      if (!on && w == 0)
        for (int t = 0; t < T; ++t) h[(i64)t * k + j] = 0.f;
    }
    u32 todo = __ballot_sync(FULL_MASK, on != 0);
    while (todo) {  // block-uniform: todo is the same in every thread
      int li[R];
      bool live[R];
      const u8* grow[R];
      const u8* urow[R];
      u32 ron[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        li[r] = take_lowest(todo);
        live[r] = li[r] >= 0;
        const i64 row = j0 + (live[r] ? li[r] : 0);
        grow[r] = gated ? gate + row * stride : nullptr;
        urow[r] = up + row * stride;
        ron[r] = __shfl_sync(FULL_MASK, on, live[r] ? li[r] : 0);
        if (!live[r]) ron[r] = 0;
      }
      float g[R][TM], u[R][TM], acc[R][TM];
      bool uplive[R];
      if (gated && !gate_first) {  // no row can be skipped: gate and up rows stream in together, one phase
        const u8* both[2 * R];
        bool live2[2 * R];
        float acc2[2 * R][TM], tot2[2 * R][TM];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          both[r] = grow[r];
          both[R + r] = urow[r];
          live2[r] = live2[R + r] = uplive[r] = live[r];
        }
        dot_rows<Q, 2 * R, TM, false>(acc2, both, live2, cols, x, T, lane, w, nw);
        block_reduce_rows<2 * R, 2 * R, TM>(tot2, part, acc2, phase);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int t = 0; t < TM; ++t) {
            g[r][t] = tot2[r][t];
            u[r][t] = tot2[R + r][t];
          }
      } else {
        if (gated) {  // gate first: a row whose activation is 0 for every token never has its up row read
          dot_rows<Q, R, TM, false>(acc, grow, live, cols, x, T, lane, w, nw);
          block_reduce_rows<R, 2 * R, TM>(g, part, acc, phase);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            bool any = false;
#pragma unroll
            for (int t = 0; t < TM; ++t) any |= t < T && ((ron[r] >> t) & 1u) && gate_live(act, g[r][t], cats);
            uplive[r] = live[r] && any;
          }
        } else {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            uplive[r] = live[r];
#pragma unroll
            for (int t = 0; t < TM; ++t) g[r][t] = 0.f;
          }
        }
        dot_rows<Q, R, TM, false>(acc, urow, uplive, cols, x, T, lane, w, nw);
        block_reduce_rows<R, 2 * R, TM>(u, part, acc, phase);
      }
      if (threadIdx.x == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (!live[r]) continue;
          const int jr = j0 + li[r];
          const float b = bias ? bias[jr] : 0.f;
#pragma unroll
          for (int t = 0; t < TM; ++t)
            if (t < T)
              h[(i64)t * k + jr] = (uplive[r] && ((ron[r] >> t) & 1u)) ? activate(act, g[r][t], u[r][t], b, cats) : 0.f;
        }
      }
    }
  }
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

#define SPARSE_UP_ENTRY(sfx, Q, TM)                                                                                  \
  extern "C" __global__ void __launch_bounds__(192, 2) sparse_up_##sfx##_t##TM(                                       \
      const u8* __restrict__ gate, const u8* __restrict__ up, i64 stride, int cols, const int* __restrict__ bucket, \
      int k, const float* __restrict__ scores, int n_ff, float threshold, const float* __restrict__ bias, int act,  \
      float cats, const float* __restrict__ x, int T, float* __restrict__ h, int group) {                           \
    sparse_up<Q, TM>(gate, up, stride, cols, bucket, k, scores, n_ff, threshold, bias, act, cats, x, T, h, group);  \
  }
#define SPARSE_DOWN_ENTRY(sfx, Q, TT)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256, 2) sparse_down_##sfx##_t##TT(                                      \
      const u8* __restrict__ w, i64 stride, int cols, const float* __restrict__ h, int k, int T,                     \
      float* __restrict__ y, int rows_per_warp) {                                                                   \
    sparse_down<Q, TT>(w, stride, cols, h, k, T, y, rows_per_warp);                                                 \
  }
#define SPARSE_ENTRIES(sfx, Q) \
  SPARSE_UP_ENTRY(sfx, Q, 1) SPARSE_UP_ENTRY(sfx, Q, 8) SPARSE_DOWN_ENTRY(sfx, Q, 1) SPARSE_DOWN_ENTRY(sfx, Q, 2)
PINFER_FOR_TYPES(SPARSE_ENTRIES)

// Prefill (many tokens): CudaDevice multiplies x by dequantised tiles of the GPU rows with cuBLAS (g = x gate^T,
// u = x up^T, [T, n] each, for n GPU rows from row r0), then ffn_act makes h [T, n] with the same activation and
// selection as sparse_up: h = 0 where token t's score of neuron bucket[j] is below the threshold (scores [T, n_ff]
// or null: every row), else activate(). bias (gate-less codes) and bucket point at row r0's entries.
// Launch: 256 threads per block, any grid (grid-stride).
extern "C" __global__ void __launch_bounds__(256) ffn_act(const float* __restrict__ g, const float* __restrict__ u,
                                                          const float* __restrict__ bias,
                                                          const float* __restrict__ scores,
                                                          const int* __restrict__ bucket, int n_ff, float threshold,
                                                          int act, float cats, int T, int n, float* __restrict__ h) {
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)T * n; i += (i64)gridDim.x * blockDim.x) {
    const int t = (int)(i / n), j = (int)(i % n);
    const bool on = scores == nullptr || scores[(i64)t * n_ff + bucket[j]] >= threshold;
    h[i] = on ? activate(act, g[i], u[i], bias != nullptr ? bias[j] : 0.f, cats) : 0.f;
  }
}
