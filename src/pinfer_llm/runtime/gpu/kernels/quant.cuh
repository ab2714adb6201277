// quant.cuh: what pinfer's GPU kernels share: the device weight layout, block decoding, row dot products.
//
// One text, three compilers: NVRTC through CuPy (runtime/gpu/cuda.py inlines this header into each .cu, so CuPy's
// kernel cache keys on it), nvcc in the tests (sm_80/89/90, warnings as errors, no spills), and g++ under
// tests/cuda_emu/cuda_emu.h, which runs the kernels on CPU fibers so CI checks their results without a GPU. Hence:
// no standard headers, no dynamic shared memory, only intrinsics that header maps.
//
// Device layout of a weight matrix [rows, cols], cols % 32 == 0 (runtime/gpu/layout.py builds it from the file's
// rows; every number is the file's, bit for bit, only moved within its row). A row is
//   [tile 0] ... [tile ntile-1] [tail] [zero pad to 16 bytes],   ntile = cols / 1024, ntail = (cols % 1024) / 32
// and rows are `stride` bytes apart (16-byte aligned). A tile holds 1024 values = 32 blocks of 32, arranged for a
// warp: lane l owns the 32 values at positions c*128 + 4l + e (chunk c = 0..7, e = 0..3), which it reads with
// one 16-byte load per 512 bytes of the tile (coalesced: the warp reads each 512-byte slot whole). Those positions
// make x's reads coalesced too: chunk c of all lanes is x[c*128 .. c*128+127], one 512-byte float4 load per warp,
// so x is read straight from L1 with no shared-memory staging (and so any d and any T fit).
//   F32   8 slots; slot c lane l = the 4 floats of chunk c (this is the file's own order)
//   F16, BF16  4 slots; slot s lane l = chunk 2s then chunk 2s+1 (8 halves)
//   Q8_0  2 slots of int8 (slot s lane l = chunks 4s..4s+3), then 64 bytes of scales
//   Q4_0  1 slot of nibbles: lane l's word w holds chunk w in its low nibbles, chunk w+4 in its high nibbles
//         (the file's own nibble order within a block: byte j = value j | value j+16 << 4), then 64 bytes of scales
//   Q4_1  as Q4_0, then 64 bytes of d and 64 bytes of m
// Scales of a tile: 32 f16 as [g][c], g = lane / 8: lane l's 8 chunks lie in blocks 4c + l/8, so one 16-byte load
// gives a lane all 8 of its scales (8 lanes share it: one broadcast transaction).
// The tail keeps the file's blocks whole, one per lane (lane b < ntail owns tail block b, positions 32b + 4i + e for
// quad i = 0..7): quants of all tail blocks, then their d, then their m. Only odd widths (SmolLM2's 576, tests) have
// one; Llama-family widths (4096, 5120, 8192, 11008, 13824) are whole tiles.
// Both tiles and tail blocks thus give each lane 8 "quads" of 4 values, quad i at x offset i*qstride from the lane's
// base (tile: base 4l, qstride 128; tail: base 32l, qstride 4), and one decoder per type serves both: the nibble,
// int8 and half order inside a 16-byte fragment is the same in a tile's slot and in a tail block.

#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define FULL_MASK 0xffffffffu
#define TILE_VALUES 1024
#define NEG_INF __uint_as_float(0xff800000u)  // -infinity without math.h's INFINITY (NVRTC has no math.h)

// Act codes of the FFN kernels, shared with the CPU side (runtime/sparse_ffn.py ACT_CODES for 0-2).
#define ACT_SILU 0   // SwiGLU: silu(g) * u, optional CATS threshold on |silu(g)|
#define ACT_RELU 1   // ReGLU: relu(g) * u
#define ACT_DRELU 2  // dReLU: relu(g) * relu(u)
#define ACT_RELU_UP 3  // gate-less: relu(u + b) (Falcon, OPT); the up row plays the gate's role
#define ACT_GELU_UP 4  // gate-less: gelu(u + b), exact erf

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// Half conversions. On the GPU, the PTX instructions themselves: no cuda_fp16.h, so NVRTC needs no include path.
// Elsewhere (the CPU emulation) cuda_fp16.h's names, which tests/cuda_emu/cuda_emu.h maps to IEEE conversions.
__device__ __forceinline__ float f16_to_f32(u16 h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return __half2float(__ushort_as_half(h));
#endif
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return __half_as_ushort(__float2half_rn(f));
#endif
}

// Weights (and the KV cache) stream through once: ld.global.cg keeps them in L2 only, so they do not evict x from
// L1, where every warp of the SM re-reads it (measured on an H200: with weights through L1, a 4-token F16 GEMV ran at
// 1.2 TB/s, x being re-fetched from L2; x's bytes are 2x (F16) to 8x (Q4_0, T = 1) the weights').
__device__ __forceinline__ uint4 ld16(const u8* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ u32 ld_u16(const u8* p) { return __ldcg(reinterpret_cast<const u16*>(p)); }
// Activations: read-only path, cached in L1.
__device__ __forceinline__ float4 ldf4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

// j is a compile-time constant wherever these are called (unrolled loops), so they fold to a register pick.
__device__ __forceinline__ u32 word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }
__device__ __forceinline__ u32 half_bits(const uint4& v, int i) { return (word(v, i >> 1) >> (16 * (i & 1))) & 0xffffu; }

// Integer to float without I2F (a quarter-rate instruction): PRMT places byte e of w under the exponent of 2^23,
// and the subtraction (exact) removes 2^23 and the block type's offset. Two full-rate instructions per value.
__device__ __forceinline__ float byte_to_float(u32 w, int e, float offset) {
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u + e)) - offset;
}
__device__ __forceinline__ float4 nibbles(u32 w4, float offset) {  // w4: 4 bytes holding values 0..15
  return make_float4(byte_to_float(w4, 0, offset), byte_to_float(w4, 1, offset), byte_to_float(w4, 2, offset),
                     byte_to_float(w4, 3, offset));
}
__device__ __forceinline__ uint4 splat(u32 h) { h |= h << 16; return make_uint4(h, h, h, h); }

// A quad: 4 values d * q + m.
struct Quad { float4 q; float d; float m; };

__device__ __forceinline__ float dot4(const float4& a, const float4& b) {
  return fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, a.w * b.w)));
}
__device__ __forceinline__ float sum4(const float4& a) { return (a.x + a.y) + (a.z + a.w); }

// Block-type traits. TILE: bytes of a tile; R: rows a warp streams side by side (more 16-byte loads in flight per
// warp, and each x load serves R rows; chosen so a lane's fragments stay near 32 registers); MIN: has an offset m.
// Frag: one lane's 32 values of a tile (or of its tail block) as loaded; quad(f, i) decodes quad i of it.
struct TQ4_0 {
  static constexpr int TILE = 576, R = 4;
  static constexpr bool MIN = false;
  struct Frag { uint4 qs, sc; };
  static __device__ __forceinline__ Frag tile(const u8* t, int lane) {
    return {ld16(t + 16 * lane), ld16(t + 512 + 16 * (lane >> 3))};
  }
  static __device__ __forceinline__ Frag tail(const u8* t, int ntail, int b) {
    return {ld16(t + 16 * b), splat(ld_u16(t + 16 * ntail + 2 * b))};
  }
  static __device__ __forceinline__ Quad quad(const Frag& f, int i) {
    const u32 w = word(f.qs, i & 3);
    return {nibbles(i < 4 ? (w & 0x0F0F0F0Fu) : ((w >> 4) & 0x0F0F0F0Fu), 8388616.f), f16_to_f32(half_bits(f.sc, i)),
            0.f};
  }
};

struct TQ4_1 {
  static constexpr int TILE = 640, R = 4;
  static constexpr bool MIN = true;
  struct Frag { uint4 qs, d, m; };
  static __device__ __forceinline__ Frag tile(const u8* t, int lane) {
    return {ld16(t + 16 * lane), ld16(t + 512 + 16 * (lane >> 3)), ld16(t + 576 + 16 * (lane >> 3))};
  }
  static __device__ __forceinline__ Frag tail(const u8* t, int ntail, int b) {
    return {ld16(t + 16 * b), splat(ld_u16(t + 16 * ntail + 2 * b)), splat(ld_u16(t + 18 * ntail + 2 * b))};
  }
  static __device__ __forceinline__ Quad quad(const Frag& f, int i) {
    const u32 w = word(f.qs, i & 3);
    return {nibbles(i < 4 ? (w & 0x0F0F0F0Fu) : ((w >> 4) & 0x0F0F0F0Fu), 8388608.f), f16_to_f32(half_bits(f.d, i)),
            f16_to_f32(half_bits(f.m, i))};
  }
};

struct TQ8_0 {
  static constexpr int TILE = 1088, R = 2;
  static constexpr bool MIN = false;
  struct Frag { uint4 q0, q1, sc; };
  static __device__ __forceinline__ Frag tile(const u8* t, int lane) {
    return {ld16(t + 16 * lane), ld16(t + 512 + 16 * lane), ld16(t + 1024 + 16 * (lane >> 3))};
  }
  static __device__ __forceinline__ Frag tail(const u8* t, int ntail, int b) {
    return {ld16(t + 32 * b), ld16(t + 32 * b + 16), splat(ld_u16(t + 32 * ntail + 2 * b))};
  }
  static __device__ __forceinline__ Quad quad(const Frag& f, int i) {
    // int8 -> biased uint8 (flip the sign bit), then the same exponent trick with offset 2^23 + 128
    const u32 w = word(i < 4 ? f.q0 : f.q1, i & 3) ^ 0x80808080u;
    return {nibbles(w, 8388736.f), f16_to_f32(half_bits(f.sc, i)), 0.f};
  }
};

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

struct TBF16 {
  static constexpr int TILE = 2048, R = 2;
  static constexpr bool MIN = false;
  using Frag = TF16::Frag;
  static __device__ __forceinline__ Frag tile(const u8* t, int lane) { return TF16::tile(t, lane); }
  static __device__ __forceinline__ Frag tail(const u8* t, int ntail, int b) { return TF16::tail(t, ntail, b); }
  static __device__ __forceinline__ Quad quad(const Frag& f, int i) {  // bf16 is the top half of an f32
    const u32 a = word(f.w[i >> 1], 2 * (i & 1)), b = word(f.w[i >> 1], 2 * (i & 1) + 1);
    return {make_float4(__uint_as_float(a << 16), __uint_as_float(a & 0xffff0000u), __uint_as_float(b << 16),
                        __uint_as_float(b & 0xffff0000u)),
            1.f, 0.f};
  }
};

struct TF32 {
  static constexpr int TILE = 4096, R = 1;
  static constexpr bool MIN = false;
  struct Frag { uint4 w[8]; };
  static __device__ __forceinline__ Frag tile(const u8* t, int lane) {
    Frag f;
#pragma unroll
    for (int c = 0; c < 8; ++c) f.w[c] = ld16(t + 512 * c + 16 * lane);
    return f;
  }
  static __device__ __forceinline__ Frag tail(const u8* t, int, int b) {
    Frag f;
#pragma unroll
    for (int c = 0; c < 8; ++c) f.w[c] = ld16(t + 128 * b + 16 * c);
    return f;
  }
  static __device__ __forceinline__ Quad quad(const Frag& f, int i) {
    return {make_float4(__uint_as_float(f.w[i].x), __uint_as_float(f.w[i].y), __uint_as_float(f.w[i].z),
                        __uint_as_float(f.w[i].w)),
            1.f, 0.f};
  }
};

// Rows side by side for TM tokens: with 8 tokens the accumulators take the registers that extra rows would (and
// each fragment already serves 8 tokens' x).
template <class Q, int TM>
struct Rows { static constexpr int R = TM > 1 ? 1 : Q::R; };

// Every weight-reading kernel is instantiated once per type through this list (entry names end in the suffix).
#define PINFER_FOR_TYPES(X) X(f32, TF32) X(f16, TF16) X(bf16, TBF16) X(q4_0, TQ4_0) X(q4_1, TQ4_1) X(q8_0, TQ8_0)

// acc[r][t] += (row r's quads) . (token t's x at those positions), one unit (tile or tail block) of one lane.
// x's loads are issued together before the arithmetic that needs them: for one token the 8 quads of the unit, for
// more tokens each quad's TM tokens (8 float4 loads either way, in flight at once; issued one per quad between
// FMAs they are 8 serialised L1 round trips per tile). T >= 1: the one-token kernels are never launched for none.
template <class Q, int R, int TM>
__device__ __forceinline__ void dot_unit(float (&acc)[R][TM], const typename Q::Frag (&f)[R], const float* xp,
                                         int qstride, int ldx, int T) {
  if constexpr (TM == 1) {
    float4 xv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) xv[i] = ldf4(xp + i * qstride);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float xs = Q::MIN ? sum4(xv[i]) : 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const Quad qd = Q::quad(f[r], i);
        acc[r][0] = fmaf(qd.d, dot4(qd.q, xv[i]), acc[r][0]);
        if (Q::MIN) acc[r][0] = fmaf(qd.m, xs, acc[r][0]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float4 xv[TM];
#pragma unroll
      for (int t = 0; t < TM; ++t)
        xv[t] = t < T ? ldf4(xp + (i64)t * ldx + i * qstride) : make_float4(0.f, 0.f, 0.f, 0.f);
      Quad qd[R];
#pragma unroll
      for (int r = 0; r < R; ++r) qd[r] = Q::quad(f[r], i);
#pragma unroll
      for (int t = 0; t < TM; ++t) {
        const float xs = Q::MIN ? sum4(xv[t]) : 0.f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          acc[r][t] = fmaf(qd[r].d, dot4(qd[r].q, xv[t]), acc[r][t]);
          if (Q::MIN) acc[r][t] = fmaf(qd[r].m, xs, acc[r][t]);
        }
      }
    }
  }
}

// Dot products of R rows (device layout) with T <= TM tokens of x [T, cols], over the units u0, u0 + ustep, ...
// (unit = a tile; unit ntile = the tail), so that several warps can share a row; the sums (of those units) end in
// every lane. A row with live[r] false is never read (its loads are predicated off) and sums to 0. PIPE: the next
// tile's loads are issued before this tile's arithmetic (for a warp that walks a whole row: gemv); without it a
// warp holds one tile per row in registers (sparse_up, where the block's warps take one tile each).
template <class Q, int R, int TM, bool PIPE>
__device__ __forceinline__ void dot_rows(float (&acc)[R][TM], const u8* const (&rows)[R], const bool (&live)[R],
                                         int cols, const float* __restrict__ x, int T, int lane, int u0 = 0,
                                         int ustep = 1) {
  const int nb = cols >> 5, ntile = nb >> 5, ntail = nb & 31;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < TM; ++t) acc[r][t] = 0.f;
  typename Q::Frag cur[R];
  if (PIPE) {
#pragma unroll
    for (int r = 0; r < R; ++r)
      cur[r] = (live[r] && u0 < ntile) ? Q::tile(rows[r] + (i64)u0 * Q::TILE, lane) : typename Q::Frag{};
  }
  for (int i = u0; i < ntile; i += ustep) {
    if (PIPE) {
      typename Q::Frag nxt[R];
#pragma unroll
      for (int r = 0; r < R; ++r)
        nxt[r] = (live[r] && i + ustep < ntile) ? Q::tile(rows[r] + (i64)(i + ustep) * Q::TILE, lane)
                                                : typename Q::Frag{};
      dot_unit<Q, R, TM>(acc, cur, x + i * TILE_VALUES + 4 * lane, 128, cols, T);
#pragma unroll
      for (int r = 0; r < R; ++r) cur[r] = nxt[r];
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r)
        cur[r] = live[r] ? Q::tile(rows[r] + (i64)i * Q::TILE, lane) : typename Q::Frag{};
      dot_unit<Q, R, TM>(acc, cur, x + i * TILE_VALUES + 4 * lane, 128, cols, T);
    }
  }
  if (ntail && ntile >= u0 && (ntile - u0) % ustep == 0 && lane < ntail) {  // this warp's share includes the tail
#pragma unroll
    for (int r = 0; r < R; ++r)
      cur[r] = live[r] ? Q::tail(rows[r] + (i64)ntile * Q::TILE, ntail, lane) : typename Q::Frag{};
    dot_unit<Q, R, TM>(acc, cur, x + ntile * TILE_VALUES + 32 * lane, 4, cols, T);
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < TM; ++t)
      if (t < T)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(FULL_MASK, acc[r][t], o);
}

// y[0..3] += v atomically: one 16-byte reduction on Hopper, four 4-byte ones elsewhere. PINFER_ARCH: the CPU
// emulation's stand-in for __CUDA_ARCH__, so that its tests run the Hopper branch too.
__device__ __forceinline__ void atomic_add4(float* y, float4 v) {
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900) || (defined(PINFER_ARCH) && PINFER_ARCH >= 900)
  atomicAdd(reinterpret_cast<float4*>(y), v);
#else
  atomicAdd(y, v.x);
  atomicAdd(y + 1, v.y);
  atomicAdd(y + 2, v.z);
  atomicAdd(y + 3, v.w);
#endif
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it. buf: 32 floats of shared
// memory. Two barriers, so successive calls may reuse buf.
__device__ __forceinline__ float block_sum(float v, float* buf) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  if (lane == 0) buf[w] = v;
  __syncthreads();
  float s = lane < nw ? buf[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
  __syncthreads();
  return s;
}
