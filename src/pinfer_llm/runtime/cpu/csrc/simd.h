// The instruction sets pinfer's kernels are written for, chosen at compile time from the compiler's predefined
// macros (the library is built on the machine that runs it, -march=$PINFER_CPU_MARCH, default native):
//   PINFER_AVX512  AVX-512 F+BW+VL (+FMA, F16C): float loops on 16-lane zmm vectors
//   PINFER_AVX2    AVX2+FMA+F16C (x86-64-v3, and every AVX-512 machine): float loops on 8-lane ymm vectors, and the
//                  integer dot products of 4/8-bit blocks (32 bytes = one block per ymm register)
//   PINFER_VNNI    vpdpbusd on ymm (AVX512-VNNI+VL, or AVX-VNNI): u8 x s8 dot products in one instruction
//   neither        portable C++ with GCC vector types (SSE2 at -march=x86-64), same results
// Every kernel has these paths, and the tests run all three builds (native, x86-64-v3, x86-64) against references.
//
// Minimum compiler: GCC 9 or Clang 10 (C++17, the intrinsics below; no __builtin_shufflevector, which GCC has only
// since 12). -march=x86-64-v3 as a name needs GCC 11 / Clang 12.
//
// Weights are read from a memory-mapped file at any byte offset: every vector load here is unaligned (loadu), and
// scalars are read with memcpy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PINFER_AVX2 1
#endif
#if defined(PINFER_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PINFER_AVX512 1
#endif
#if defined(PINFER_AVX2) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define PINFER_VNNI 1
#endif

// For a helper called inside a tile's loop whose vector registers are all live: left out of line (GCC's choice for
// a prefetch helper called 8 times per Q6_K super-block), each call spilled and reloaded them all, 1.4-1.65x the
// time of the inlined walk (one-token Q6_K GEMVs from memory, Xeon, paired rounds).
#define PINFER_INLINE inline __attribute__((always_inline))

namespace pinfer {

// The path this build compiled, for status lines and benchmark reports.
inline const char* isa_name() {
#if defined(PINFER_AVX512) && defined(PINFER_VNNI)
  return "avx512+vnni";
#elif defined(PINFER_AVX512)
  return "avx512";
#elif defined(PINFER_AVX2) && defined(PINFER_VNNI)
  return "avx2+avx-vnni";
#elif defined(PINFER_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

// --- scalars: unaligned reads, half and bfloat16 conversions -----------------------------------------------------

inline uint16_t rd_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline float rd_f32(const uint8_t* p) { float v; std::memcpy(&v, p, 4); return v; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// IEEE half -> float, exact for every value (subnormals, inf, nan).
inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  // Move exponent and mantissa into a float's fields (shift by 13), then scale by 2^(127-15): this rebiases normal
  // numbers and turns half subnormals (exponent 0) into the right normal floats in one exact multiplication.
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, em = h & 0x7fff;
  if (em >= 0x7c00) return bits_f32(sign | 0x7f800000u | ((em & 0x3ffu) << 13));  // inf, nan
  return bits_f32(f32_bits(bits_f32(em << 13) * 0x1p112f) | sign);
#endif
}

// float -> IEEE half, round to nearest even (what F16C's vcvtps2ph does with rounding mode 0)
inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, 0);
#else
  uint32_t x = f32_bits(f);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 : 0);  // inf, nan (quiet)
  if (x >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: overflow to inf
  if (x < 0x38800000u) {  // below 2^-14: a half subnormal (or zero). Adding 0.5 puts the half's ulp (2^-24) at the
    // float's last mantissa bit, so the float addition itself rounds to nearest even.
    return sign | (uint16_t)(f32_bits(bits_f32(x) + 0.5f) - 0x3f000000u);
  }
  // normal: rebias the exponent (-112 << 23) and round the 13 dropped bits to nearest even
  x += 0xc8000fffu + ((x >> 13) & 1);
  return sign | (uint16_t)(x >> 13);
#endif
}

inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

// --- float vectors ---------------------------------------------------------------------------------------------------
// vf: VW floats. Hot loops are written once against these few functions.

#if defined(PINFER_AVX512)
constexpr int VW = 16;
typedef __m512 vf;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(PINFER_AVX2)
constexpr int VW = 8;
typedef __m256 vf;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
#else
constexpr int VW = 8;
typedef float vf __attribute__((vector_size(32)));  // GCC vector: two SSE registers at -march=x86-64
inline vf vzero() { return vf{}; }
inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vset1(float a) { return vf{} + a; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
#endif

#if defined(PINFER_AVX2)
inline float hsum8(__m256 v) {  // 8 lanes -> 1: two halves, then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
#if defined(PINFER_AVX2) && !defined(PINFER_AVX512)
inline float vsum(vf v) { return hsum8(v); }
#elif !defined(PINFER_AVX2)
inline float vsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}
#endif

// the largest of v's lanes (the same in any order)
inline float vmax_lanes(vf v) {
  float lanes[VW];
  vstore(lanes, v);
  float m = lanes[0];
  for (int i = 1; i < VW; ++i) m = std::max(m, lanes[i]);
  return m;
}

// e^x for VW values x <= 0 (softmax after subtracting the max): x = n ln2 + r, |r| <= ln2/2 + eps, e^r by its
// degree-6 Taylor polynomial (relative error < 2e-7), 2^n by building the float's exponent bits.
inline vf exp_nonpos(vf x) {
  x = vmax(x, vset1(-87.f));  // e^-87 ~ 1.6e-38, the smallest normal float's neighbourhood
  const vf t = vsub(vmul(x, vset1(1.44269504f)), vset1(0.5f));
#if defined(PINFER_AVX512)
  const __m512i n = _mm512_cvttps_epi32(t);  // truncation toward 0 of a value <= 0
  const vf nf = _mm512_cvtepi32_ps(n);
  const vf scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
#elif defined(PINFER_AVX2)
  const __m256i n = _mm256_cvttps_epi32(t);
  const vf nf = _mm256_cvtepi32_ps(n);
  const vf scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
#else
  typedef int32_t vi __attribute__((vector_size(32)));
  const vi n = __builtin_convertvector(t, vi);
  const vf nf = __builtin_convertvector(n, vf);
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
#endif
  const vf r = vsub(vsub(x, vmul(nf, vset1(0.693145751953125f))), vmul(nf, vset1(1.428606765330187e-06f)));
  vf p = vset1(1.f / 720);
  p = vfma(p, r, vset1(1.f / 120));
  p = vfma(p, r, vset1(1.f / 24));
  p = vfma(p, r, vset1(1.f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.f));
  p = vfma(p, r, vset1(1.f));
  return vmul(p, scale);
}

// silu(g) = g / (1 + e^-g), VW values: with e = e^-|g| (exp_nonpos, never overflowing), g / (1 + e) for g >= 0 and
// g e / (1 + e) below. libm's expf one value at a time was ~4% of a 4-row SmolLM2 decode step (perf: the activation
// loop after the gate and up rows); this is one pass of vector instructions.
inline vf silu_v(vf g) {
#if defined(PINFER_AVX512)
  const vf e = exp_nonpos(vsub(vzero(), _mm512_abs_ps(g)));
  const vf num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, vzero(), _CMP_GE_OQ), vmul(g, e), g);
  return _mm512_div_ps(num, vadd(vset1(1.f), e));
#elif defined(PINFER_AVX2)
  const vf a = _mm256_andnot_ps(_mm256_set1_ps(-0.f), g);
  const vf e = exp_nonpos(vsub(vzero(), a));
  const vf num = _mm256_blendv_ps(vmul(g, e), g, _mm256_cmp_ps(g, vzero(), _CMP_GE_OQ));
  return _mm256_div_ps(num, vadd(vset1(1.f), e));
#else
  const vf a = g >= 0.f ? g : -g;
  const vf e = exp_nonpos(-a);
  return (g >= 0.f ? g : g * e) / (1.f + e);
#endif
}

}  // namespace pinfer
