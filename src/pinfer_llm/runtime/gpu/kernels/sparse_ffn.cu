// Sparse FFN over a layer's GPU-resident neurons (PowerInfer's GPU half, in pinfer's own code).
//
// The GPU holds, per layer, k "GPU rows" in the device layout (quant.cuh): gate and up (a neuron's two rows
// adjacent: row 2j and 2j + 1 of one buffer, runtime/gpu/cuda.py _upload_pair; gate-less FFNs hold up only) and
// down_t [k, d] (row j = neuron bucket[j]'s output column), gathered from the file in bucket order.
//
// Step 0, predictor.cu select_count + select_rows: the selection, on the device: the ascending GPU rows that any
//   token selects (scores[t, bucket[j]] >= threshold), each with its tokens' bits, and their count; h = 0 for the
//   rest. No later kernel looks at scores or bucket again, and no launch depends on the count.
// Step 1, sparse_up_<type>_t<TM>: h[t, j] = act(gate_j . x_t, up_j . x_t) for the selected rows (0 for a token
//   that did not select the row: each token's result is what it would be alone). A gathered GEMV: one warp per
//   selected row at a time, its gate and up rows streamed together with 16-byte loads, the next unit (tile or
//   tail) in flight while the current one is multiplied, across rows too; no shared memory, no barrier.
//   Gate-less codes 3, 4 read only the up row (which plays the gate's role), h = relu/gelu(up . x + b).
// Step 2, sparse_down_<type>_t<TT>: y[T, d] += sum_j h[t, j] * down_t[j, :] over the same selection (or over
//   every row, for ffn_down alone and the predictor's fc2), rows with h == 0 for every token never read. Each
//   block owns one column unit (a 1024-wide tile, or the tail) of y and a share of the selection; each lane
//   accumulates its 32 positions of the unit over its warp's rows in registers (the same positions it loads, so no
//   shuffles), the warps' sums meet in a 3-level tree in shared memory, and warp 0 adds the unit to y with one
//   atomic per 4 floats (a 16-byte atomic on Hopper). Why partial sums and not PowerInfer's atomic per element per
//   row: an active row of a 5120-wide Q4_0 matrix is 2.9 KB of weights but would be 20 KB of atomics; here a block
//   adds 4 KB per token, about two blocks per SM. Tokens are processed TT at a time (acc is 32 * TT registers);
//   more tokens loop over the rows again, from L2.
//
// Measured before this design (benchmarks/gpu_check.py on an H200, CUDA graphs, copy 4.25 TB/s; Llama-13B layer,
// 10% of 13824 rows active, one token): F16 gate+up 19 us = 35% of copy, down 9.6 us = 35%; Q8_0 20% / 21%; Q4_0
// 11% / 10%. A 10% layer is only 28 + 14 MB, so the dependent memory round trips per kernel (bucket -> scores ->
// rows -> h; h -> rows -> atomics) dominated; this design removes them from the weight stream (docs/gpu.md: the
// static estimate, not yet measured on a GPU).

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

// A selection entry (predictor.cu select_rows): GPU row in the low 24 bits, bit 24 + t set when token t selects it.
#define SEL_ROW(e) ((int)((e) & 0xffffffu))
#define SEL_TOKENS(e) ((e) >> 24)

// One unit (tile u < ntile, or the tail) of NR rows, for one lane; rows past ntail of the tail read nothing.
template <class Q, int NR>
__device__ __forceinline__ void load_unit(typename Q::Frag (&f)[NR], const u8* const (&base)[NR], i64 off, int u,
                                          int ntile, int ntail, int lane) {
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const u8* p = base[r] + off + (i64)u * Q::TILE;
    f[r] = u < ntile ? Q::tile(p, lane) : lane < ntail ? Q::tail(p, ntail, lane) : typename Q::Frag{};
  }
}

// The gathered GEMV of sparse_up for NR = 2 (gate and up, adjacent in the device layout: weights.py) or NR = 1
// (the up row of gate-less codes). Warp gw takes selection entries gw, gw + nwarps, ...; it walks each entry's
// units and always holds the next unit's fragments in flight while it multiplies the current one, across the end
// of a row too (the next entry is read a whole row ahead). PIPE false (F32, whose two rows' fragments are 64
// registers, and 8 tokens, whose accumulators and x take them): one unit at a time.
template <class Q, int TM, int NR>
__device__ __forceinline__ void up_stream(const u8* __restrict__ gate, const u8* __restrict__ up, i64 stride,
                                          int cols, const u32* __restrict__ sel, int n, int k,
                                          const float* __restrict__ bias, int act, float cats,
                                          const float* __restrict__ x, int T, float* __restrict__ h) {
  constexpr bool PIPE = TM == 1 && sizeof(typename Q::Frag) * NR <= 128;
  const int lane = threadIdx.x & 31;
  const int gw = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int nwarps = (int)((gridDim.x * blockDim.x) >> 5);
  const int nb = cols >> 5, ntile = nb >> 5, ntail = nb & 31, units = ntile + (ntail > 0);
  const u32 all = ((1u << T) - 1u) << 24;
  const u8* base[NR];
  base[0] = NR == 2 ? gate : up;
  base[NR - 1] = up;
  int it = gw;
  u32 e = sel ? sel[it] : (u32)it | all;
  u32 e_next = it + nwarps < n ? (sel ? sel[it + nwarps] : (u32)(it + nwarps) | all) : 0u;
  typename Q::Frag cur[NR];
  if constexpr (PIPE) load_unit<Q, NR>(cur, base, (i64)SEL_ROW(e) * stride, 0, ntile, ntail, lane);
  float acc[NR][TM];
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int t = 0; t < TM; ++t) acc[r][t] = 0.f;
  for (int u = 0;;) {
    const bool last = u == units - 1;
    const int nu = last ? 0 : u + 1;
    const u32 ne = last ? e_next : e;
    const bool more = !last || it + nwarps < n;
    [[maybe_unused]] typename Q::Frag nxt[NR];
    if constexpr (PIPE) {
      if (more) load_unit<Q, NR>(nxt, base, (i64)SEL_ROW(ne) * stride, nu, ntile, ntail, lane);
    } else {
      load_unit<Q, NR>(cur, base, (i64)SEL_ROW(e) * stride, u, ntile, ntail, lane);
    }
    if (u < ntile) dot_unit<Q, NR, TM>(acc, cur, x + u * TILE_VALUES + 4 * lane, 128, cols, T);
    else if (lane < ntail) dot_unit<Q, NR, TM>(acc, cur, x + ntile * TILE_VALUES + 32 * lane, 4, cols, T);
    if (last) {
      const int j = SEL_ROW(e);
      const u32 on = SEL_TOKENS(e);
      const float b = bias ? bias[j] : 0.f;
#pragma unroll
      for (int t = 0; t < TM; ++t) {
        if (t >= T) break;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(FULL_MASK, acc[r][t], o);
        }
        if (lane == 0)
          h[(i64)t * k + j] = ((on >> t) & 1u) ? activate(act, NR == 2 ? acc[0][t] : 0.f, acc[NR - 1][t], b, cats)
                                               : 0.f;
      }
#pragma unroll
      for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int t = 0; t < TM; ++t) acc[r][t] = 0.f;
      if (!more) break;
      it += nwarps;
      e = e_next;
      e_next = it + nwarps < n ? (sel ? sel[it + nwarps] : (u32)(it + nwarps) | all) : 0u;
    }
    if constexpr (PIPE) {
#pragma unroll
      for (int r = 0; r < NR; ++r) cur[r] = nxt[r];
    }
    u = nu;
  }
}

// h[t, j] for the selected rows j (the selection pass wrote 0 for the others). sel: entries of the selected rows,
// their number at nsel[0] (on the device: the launch does not depend on it); sel null: every row for every token.
// Gated codes read the gate and the up row of a row together (one phase: no dependent round trip per row; a gate
// that turns out dead cost its up row's bytes, which the selection had asked for). No shared memory and no block
// barrier: warps past the count exit at once.
template <class Q, int TM>
__device__ __forceinline__ void sparse_up(const u8* __restrict__ gate, const u8* __restrict__ up, i64 stride,
                                          int cols, const u32* __restrict__ sel, const int* __restrict__ nsel, int k,
                                          const float* __restrict__ bias, int act, float cats,
                                          const float* __restrict__ x, int T, float* __restrict__ h) {
  const int n = nsel ? *nsel : k;
  if ((int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) >= n) return;  // a whole warp: no warp op is left waiting
  if (gate) up_stream<Q, TM, 2>(gate, up, stride, cols, sel, n, k, bias, act, cats, x, T, h);
  else up_stream<Q, TM, 1>(gate, up, stride, cols, sel, n, k, bias, act, cats, x, T, h);
}

// A group of R rows of sparse_down: their ids (-1 past the block's range), their h, their fragments of the unit.
template <int R>
__device__ __forceinline__ void down_rows(int (&row)[R], const u32* __restrict__ sel, int i, int end) {
#pragma unroll
  for (int r = 0; r < R; ++r) row[r] = i + r < end ? (sel ? SEL_ROW(sel[i + r]) : i + r) : -1;
}
template <int R, int TT>
__device__ __forceinline__ void down_h(float (&hv)[R][TT], const int (&row)[R], const float* __restrict__ h, int k,
                                       int t0, int T) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) hv[r][t] = (row[r] >= 0 && t0 + t < T) ? h[(i64)(t0 + t) * k + row[r]] : 0.f;
}
// A row whose h is 0 for every token is not read (a dead activation, or a ReLU'd predictor unit).
template <class Q, int R, int TT>
__device__ __forceinline__ bool down_frags(typename Q::Frag (&f)[R], const int (&row)[R], const float (&hv)[R][TT],
                                           const u8* __restrict__ w, i64 stride, i64 uoff, bool is_tail, int ntail,
                                           int lane) {
  bool any = false;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    bool live = false;
#pragma unroll
    for (int t = 0; t < TT; ++t) live |= hv[r][t] != 0.f;
    any |= live;
    const u8* p = w + (i64)(live ? row[r] : 0) * stride + uoff;
    f[r] = !live ? typename Q::Frag{} : !is_tail ? Q::tile(p, lane) : lane < ntail ? Q::tail(p, ntail, lane)
                                                                                   : typename Q::Frag{};
  }
  return any;
}

// y[T, cols] += sum over the selected rows j of h[t, j] * W[j, :] (W: down_t [k, cols], or the predictor's fc2_t).
// Block (unit, s) owns one column unit (a 1024-wide tile, or the tail) and the s-th of gridDim.y equal shares of
// the selection (sel/nsel as sparse_up's; sel null: every row, a row with h == 0 for every token skipped); its 8
// warps take groups of R consecutive entries in turn. Each lane accumulates its 32 positions of the unit in
// registers over its warp's rows, with a three-stage pipeline: while a group is multiplied, the next group's
// fragments, the h of the one after and the entries of the third are in flight (the fragment loads wait on h, so a
// dead row is never read). The warps' sums meet in a tree in shared memory (3 barriers: warps 4-7 into 0-3, 2-3
// into 0-1, 1 into 0) and warp 0 adds the block's unit to y with one atomic per 4 floats. The atomics of different
// blocks meet in any order: sums are not bitwise deterministic across runs (fp32 rounding order only).
template <class Q, int TT>
__device__ __forceinline__ void sparse_down(const u8* __restrict__ w, i64 stride, int cols,
                                            const u32* __restrict__ sel, const int* __restrict__ nsel,
                                            const float* __restrict__ h, int k, int T, float* __restrict__ y) {
  // Rows loaded side by side, twice over (the pipeline): fragments of at most 48 registers for one token (32 for
  // Q4_1, whose decoding needs more): Q4_0 3 rows, Q8_0 2, F16/BF16/F32 1; one row for two tokens (whose
  // accumulators take 64). More spills on sm_80 under the 128 registers that let two blocks share an SM.
  constexpr int FB = (int)sizeof(typename Q::Frag), BUDGET = Q::MIN ? 128 : 192;
  constexpr int R = TT > 1 ? 1 : (BUDGET / (2 * FB) > 0 ? BUDGET / (2 * FB) : 1);
  constexpr int NW = 8, SLOT = 1152;  // warps per block; floats per unit and token in the tree's buffer
  // Tile positions p sit at p (a warp writes 512 contiguous bytes per quad: no bank conflicts); tail positions at
  // p + 4 * (p / 32), padding each 32-value block by 16 bytes so that lanes 32 floats apart hit different banks.
  __shared__ __align__(16) float red[4][TT][SLOT];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int nb = cols >> 5, ntile = nb >> 5, ntail = nb & 31;
  const int unit = blockIdx.x;
  const bool is_tail = unit >= ntile;
  const i64 uoff = (i64)unit * Q::TILE;  // the tail region starts where tile ntile would
  const int n = nsel ? *nsel : k;
  const int share = (n + (int)gridDim.y - 1) / (int)gridDim.y;
  const int b0 = (int)blockIdx.y * share, b1 = imin(b0 + share, n);
  if (b0 >= b1) return;  // block-uniform, before any barrier
  constexpr int GS = R * NW;  // entries between one warp's groups
  for (int t0 = 0; t0 < T; t0 += TT) {
    float acc[TT][32];
#pragma unroll
    for (int t = 0; t < TT; ++t)
#pragma unroll
      for (int v = 0; v < 32; ++v) acc[t][v] = 0.f;
    int i = b0 + R * wib;
    int rowA[R], rowB[R], rowC[R];
    float hA[R][TT], hB[R][TT];
    typename Q::Frag fA[R];
    down_rows<R>(rowA, sel, i, b1);
    down_rows<R>(rowB, sel, i + GS, b1);
    down_h<R, TT>(hA, rowA, h, k, t0, T);
    bool anyA = down_frags<Q, R, TT>(fA, rowA, hA, w, stride, uoff, is_tail, ntail, lane);
    down_h<R, TT>(hB, rowB, h, k, t0, T);
    down_rows<R>(rowC, sel, i + 2 * GS, b1);
    for (; i < b1; i += GS) {
      typename Q::Frag fB[R];
      const bool anyB = down_frags<Q, R, TT>(fB, rowB, hB, w, stride, uoff, is_tail, ntail, lane);
      float hC[R][TT];
      down_h<R, TT>(hC, rowC, h, k, t0, T);
      int rowD[R];
      down_rows<R>(rowD, sel, i + 3 * GS, b1);
      if (anyA) {  // warp-uniform: every lane holds the same h
#pragma unroll
        for (int q = 0; q < 8; ++q) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const Quad qd = Q::quad(fA[r], q);
            const float v[4] = {fmaf(qd.d, qd.q.x, qd.m), fmaf(qd.d, qd.q.y, qd.m), fmaf(qd.d, qd.q.z, qd.m),
                                fmaf(qd.d, qd.q.w, qd.m)};
#pragma unroll
            for (int t = 0; t < TT; ++t)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[t][4 * q + e] = fmaf(hA[r][t], v[e], acc[t][4 * q + e]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        fA[r] = fB[r];
        rowB[r] = rowC[r];
        rowC[r] = rowD[r];
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          hA[r][t] = hB[r][t];
          hB[r][t] = hC[r][t];
        }
      }
      anyA = anyB;
    }
    // The tree. Step 1: warp w in 4..7 writes slot w - 4, warp w - 4 adds it. Steps 2, 3 (half 2, 1): warp w in
    // half..2*half-1 writes its own slot w, which only w itself read before; warp w - half adds it.
#pragma unroll
    for (int half = 4; half > 0; half >>= 1) {
      const int wslot = half == 4 ? wib - 4 : wib;
      if (wib >= half && wib < 2 * half) {
#pragma unroll
        for (int t = 0; t < TT; ++t)
#pragma unroll
          for (int q = 0; q < 8; ++q)
            *reinterpret_cast<float4*>(&red[wslot][t][is_tail ? 36 * lane + 4 * q : 128 * q + 4 * lane]) =
                make_float4(acc[t][4 * q], acc[t][4 * q + 1], acc[t][4 * q + 2], acc[t][4 * q + 3]);
      }
      __syncthreads();
      if (wib < half) {
        const int rslot = half == 4 ? wib : wib + half;
#pragma unroll
        for (int t = 0; t < TT; ++t)
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            const float4 o =
                *reinterpret_cast<const float4*>(&red[rslot][t][is_tail ? 36 * lane + 4 * q : 128 * q + 4 * lane]);
            acc[t][4 * q] += o.x;
            acc[t][4 * q + 1] += o.y;
            acc[t][4 * q + 2] += o.z;
            acc[t][4 * q + 3] += o.w;
          }
      }
    }
    if (wib == 0 && (!is_tail || lane < ntail)) {
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t0 + t >= T) break;
#pragma unroll
        for (int q = 0; q < 8; ++q)
          atomic_add4(y + (i64)(t0 + t) * cols + unit * TILE_VALUES + (is_tail ? 32 * lane + 4 * q : 128 * q + 4 * lane),
                      make_float4(acc[t][4 * q], acc[t][4 * q + 1], acc[t][4 * q + 2], acc[t][4 * q + 3]));
      }
    }
    if (t0 + TT < T) __syncthreads();  // the next tokens' step 1 overwrites the slots warp 0 read last
  }
}

// Launch: sparse_up: any block size (a multiple of 32) and grid: warps stride over the selection.
//         sparse_down: 256 threads per block, grid = (ntile + (ntail > 0), shares); runtime/gpu/cuda.py sizes both
//         from the SM count and the shapes only.
// sparse_up: 4 blocks (16 warps) per SM for one token; 2 for 8 tokens, whose accumulators and x loads need the
// registers (ptxas spills at 128).
#define SPARSE_UP_ENTRY(sfx, Q, TM)                                                                                  \
  extern "C" __global__ void __launch_bounds__(128, TM == 1 ? 4 : 2) sparse_up_##sfx##_t##TM(                         \
      const u8* __restrict__ gate, const u8* __restrict__ up, i64 stride, int cols, const u32* __restrict__ sel,    \
      const int* __restrict__ nsel, int k, const float* __restrict__ bias, int act, float cats,                    \
      const float* __restrict__ x, int T, float* __restrict__ h) {                                                  \
    sparse_up<Q, TM>(gate, up, stride, cols, sel, nsel, k, bias, act, cats, x, T, h);                               \
  }
#define SPARSE_DOWN_ENTRY(sfx, Q, TT)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256, 2) sparse_down_##sfx##_t##TT(                                      \
      const u8* __restrict__ w, i64 stride, int cols, const u32* __restrict__ sel, const int* __restrict__ nsel,    \
      const float* __restrict__ h, int k, int T, float* __restrict__ y) {                                           \
    /* F32's fragment alone is 32 registers: two tokens run as one token twice (rows again, from L2) */          \
    sparse_down<Q, sizeof(typename Q::Frag) >= 128 ? 1 : TT>(w, stride, cols, sel, nsel, h, k, T, y);              \
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
