// Weight encodings as stored in GGUF files (ggml's, little-endian), 8-bit activation blocks, and the per-type,
// per-ISA primitives every kernel is built from: dot-product tiles, row dequantisation and axpy.
//
// A matrix is [rows, cols], each row contiguous, read in place (a memory-mapped file: never written, any alignment).
// Block types hold 32 values per block, so cols % 32 == 0 and a row is cols / 32 blocks:
//   Q4_0  18 bytes {f16 d; u8 qs[16]}          value j = d * ((qs[j] & 15) - 8), value j + 16 = d * ((qs[j] >> 4) - 8)
//   Q4_1  20 bytes {f16 d; f16 m; u8 qs[16]}   value = d * q + m, q the nibble in the same order
//   Q8_0  34 bytes {f16 d; i8 qs[32]}          value j = d * qs[j]
// and F32, F16 (IEEE half), BF16 (upper 16 bits of a float) hold one value per element.
//
// Why 8-bit activations for the block types (what llama.cpp does): a 4-bit weight unpacked to floats costs ~5
// instructions per 16 values before its multiply, which on two AVX2 cores is slower than DRAM delivers the bytes. With
// x quantised once per call to blocks of 32 int8 values (scale d = max|x| / 127, q = round-to-nearest-even(x / d)), a
// block's dot product is one or two integer instructions (vpdpbusd; or vpmaddubsw + vpmaddwd) on the raw bytes, then
// one float multiply-add with the two scales. The result is exact for the quantised x: the kernels equal
// sum_b d_w d_x sum_j w_j q_j in fp32, which the tests reproduce by applying the same q8 round trip to x.
// Float types (F32, F16, BF16) take fp32 activations as they are: their weights convert to fp32 in registers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace pinfer {

enum WType : int {  // ggml / GGUF type ids
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20,
  IQ4_XS = 23, BF16 = 30
};
constexpr int QK = 32;  // values per block

constexpr bool type_known(int t) {
  return t == F32 || t == F16 || t == Q4_0 || t == Q4_1 || t == Q8_0 || t == BF16 || t == Q4_K || t == Q5_K ||
         t == Q6_K || t == IQ4_NL || t == IQ4_XS || t == Q5_0 || t == Q5_1;
}
// the 32-value block types: the tiles and axpy of this file
constexpr bool is_block(int t) { return t == Q4_0 || t == Q4_1 || t == Q8_0; }
// The K-quants Q4_K, Q5_K and Q6_K (256-value super-blocks of 144, 176 and 210 bytes), IQ4_NL / IQ4_XS (32 values
// in 18 bytes, 256 in 136) and Q5_0 / Q5_1 (32 values in 22 and 24 bytes; kquant.cpp) are read only by dot products
// (dot_rows) and dequantisation: matrices of rows, never neuron rows for axpy (ffn_down_t) or a KV cache
constexpr bool dot_only(int t) {
  return t == Q4_K || t == Q5_K || t == Q6_K || t == IQ4_NL || t == IQ4_XS || t == Q5_0 || t == Q5_1;
}
// the types whose dot products take q8 activations
constexpr bool needs_q8(int t) { return is_block(t) || dot_only(t); }
// values per encoding unit, and its bytes
constexpr int64_t unit_values(int t) {
  return is_block(t) || t == IQ4_NL || t == Q5_0 || t == Q5_1 ? QK : dot_only(t) ? 256 : 1;
}
constexpr int64_t unit_bytes(int t) {
  return t == F32 ? 4 : t == F16 || t == BF16 ? 2 : t == Q4_0 ? 18 : t == Q4_1 ? 20 : t == Q8_0 ? 34
         : t == Q4_K ? 144 : t == Q5_K ? 176 : t == Q6_K ? 210 : t == IQ4_NL ? 18 : t == IQ4_XS ? 136
         : t == Q5_0 ? 22 : t == Q5_1 ? 24 : 0;
}
constexpr int64_t row_bytes(int t, int64_t cols) { return cols / unit_values(t) * unit_bytes(t); }
inline const char* type_name(int t) {
  switch (t) {
    case F32: return "F32"; case F16: return "F16"; case BF16: return "BF16";
    case Q4_0: return "Q4_0"; case Q4_1: return "Q4_1"; case Q8_0: return "Q8_0";
    case Q5_0: return "Q5_0"; case Q5_1: return "Q5_1"; case Q4_K: return "Q4_K"; case Q5_K: return "Q5_K";
    case Q6_K: return "Q6_K"; case IQ4_NL: return "IQ4_NL"; case IQ4_XS: return "IQ4_XS";
    default: return "unknown";
  }
}

// A weight matrix as stored: row i starts at p + i * stride (stride >= row_bytes; views of interleaved layouts too).
struct Mat {
  const uint8_t* p = nullptr;
  int64_t rows = 0, cols = 0, stride = 0;
  int type = F32;
  const uint8_t* row(int64_t i) const { return p + i * stride; }
};

// rows of matrices stacked (a fused QKV, gate and up, a split output head)
inline int64_t rows_of(const std::vector<Mat>& ms) {
  int64_t n = 0;
  for (const Mat& m : ms) n += m.rows;
  return n;
}

// One value of a row, any type: for tails, tests and reference paths.
inline float welem(int type, const uint8_t* row, int64_t j) {
  switch (type) {
    case F32: return rd_f32(row + 4 * j);
    case F16: return f16_to_f32(rd_u16(row + 2 * j));
    case BF16: return bf16_to_f32(rd_u16(row + 2 * j));
    default: break;
  }
  const uint8_t* blk = row + j / QK * unit_bytes(type);
  const int i = (int)(j % QK);
  const float d = f16_to_f32(rd_u16(blk));
  if (type == Q8_0) return d * (float)(int8_t)blk[2 + i];
  const uint8_t* qs = blk + (type == Q4_1 ? 4 : 2);
  const int q = i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4);
  return type == Q4_0 ? d * (float)(q - 8) : d * (float)q + f16_to_f32(rd_u16(blk + 2));
}

// Block scales (half floats) as floats through a 64K-entry table (256 KB, filled once when the library loads; it stays
// in L2): a scale becomes one load that a broadcast takes straight from memory, instead of 2-3 vector instructions
// (vpbroadcastw + vcvtph2ps) on the ports the arithmetic needs (measured on the earlier per-row Q4_0 GEMV tile: 20%
// fewer cycles per block). The axpy and dequantisation loops and the portable tile use it; the lane tiles convert 8
// or 16 rows' scales at once with vcvtph2ps instead.
extern const float* const f16_table;
inline float f16_scale(const uint8_t* p) { return f16_table[rd_u16(p)]; }

// the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block's 12 scale bytes q (ggml's get_scale_min_k4)
inline void k4_scale_min(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Software prefetch, two kinds. Within the rows a tile streams, PF_AHEAD bytes ahead (into L1): the hardware
// prefetchers follow 8 rows side by side but start each row late. And the rows the caller reads next (the next group
// of a GEMV, the next 8 scattered neurons, the down rows of the neurons whose up rows are being read), in step with
// the current rows, into L2: they start streaming one group early. Measured on a Q4_0 GEMV (4096 x 11008, one core,
// from DRAM): 7.3 GB/s with neither, 9.5-10 with the first (256 to 512 bytes ahead alike; 1024 is worse), 12.4 with
// both; 2 threads 19.9 -> 26.7 GB/s (fp32 mv: 31).
constexpr int64_t PF_AHEAD = 256;
inline void prefetch(const void* p) {
#if defined(__SSE__) || defined(__x86_64__)
  _mm_prefetch((const char*)p, _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}
inline void prefetch_l2(const void* p) {
#if defined(__SSE__) || defined(__x86_64__)
  _mm_prefetch((const char*)p, _MM_HINT_T1);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}
// both kinds for a tile's N rows at byte offset bo: its rows PF_AHEAD on, the caller's next rows (if any) at bo
template <int N>
inline void prefetch_rows(const uint8_t* const* rows, int64_t bo, const uint8_t* const* nxt) {
  for (int r = 0; r < N; ++r) {
    prefetch(rows[r] + bo + PF_AHEAD);
    if (nxt) prefetch_l2(nxt[r] + bo);
  }
}

// --- 8-bit activation blocks ---------------------------------------------------------------------------------------

struct Q8 {  // one token's activations, nb blocks
  const int8_t* qs;     // [nb * 32]
  const float* d;       // [nb] scale: x ~ d * qs
  const float* s;       // [nb] d * sum(qs), Q4_1's offset term m * s
  const int32_t* bsum;  // [nb] sum(qs), folded into the integer sums of Q4_0 and Q8_0
};

// max |x_j| over one block of 32 floats (exact in any order of the comparisons)
inline float absmax_block(const float* x) {
#if defined(PINFER_AVX2)
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_and_ps(_mm256_loadu_ps(x), absmask);
  for (int k = 8; k < QK; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + k), absmask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
#else
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  return amax;
#endif
}

// Quantise one block of 32 floats: d = max|x| / 127, q = nearest-even(x * (1 / d)) (0 when the block is all zero).
inline void quantize_block(const float* x, int8_t* q, float* d_out, int32_t* bsum_out) {
#if defined(PINFER_AVX512)
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));  // MXCSR: round to nearest even
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(q1));
  *bsum_out = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(PINFER_AVX2)
  const float d = absmax_block(x) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  __m256i q32[4];
  for (int k = 0; k < 4; ++k) q32[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), _mm256_set1_ps(id)));
  // i32 -> i8: the packs work within 128-bit lanes, so the dwords come out in the order 0,2,4,6,1,3,5,7 of four
  // groups each; one permute restores element order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]), _mm256_packs_epi32(q32[2], q32[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q32[0], q32[1]), _mm256_add_epi32(q32[2], q32[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *bsum_out = _mm_cvtsi128_si32(s4);
#else
  const float d = absmax_block(x) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < QK; ++j) {
    q[j] = (int8_t)std::nearbyint(x[j] * id);  // default rounding mode: nearest even, as cvtps2dq
    sum += q[j];
  }
  *bsum_out = sum;
#endif
  *d_out = d;
}

// T tokens' activations (x [T, n], row stride ldx) as q8 blocks, one allocation reused per thread.
struct Q8Acts {
  int64_t T = 0, nb = 0;
  std::vector<int8_t> qs;
  std::vector<float> d, s;
  std::vector<int32_t> bsum;
  void quantize(const float* x, int64_t T_, int64_t n, int64_t ldx) {
    shape(T_, n / QK);
    for (int64_t t = 0; t < T; ++t) quantize_blocks(x + t * ldx, t, 0, nb);
  }
  Q8 tok(int64_t t) const {
    return {qs.data() + t * nb * QK, d.data() + t * nb, s.data() + t * nb, bsum.data() + t * nb};
  }
  // Room for T tokens of nb blocks, filled block range by block range (quantize_blocks) by several threads at once
  void shape(int64_t T_, int64_t nb_) {
    T = T_, nb = nb_;
    qs.resize(T * nb * QK), d.resize(T * nb), s.resize(T * nb), bsum.resize(T * nb);
  }
  // token t's blocks [b0, b1) of x (that token's row): quantize's bits for them
  void quantize_blocks(const float* x, int64_t t, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i = t * nb + b;
      quantize_block(x + b * QK, qs.data() + i * QK, &d[i], &bsum[i]);
      s[i] = d[i] * (float)bsum[i];
    }
  }
};

// --- integer dot-product tiles: rows x C tokens of q8 activations ---------------------------------------------------
// out[c * ostride + r] = row r . token c over nb blocks. A tile reads each weight block once for its C tokens and each
// activation block once for its rows.

#if defined(PINFER_AVX2)
// One row per lane: 8 (or 16, below) rows x C tokens (C <= 4). A block's dot product as one row's 32 products in 8 i32
// lanes of a (row, token) register (what the tiles here did before, and llama.cpp's) leaves every (row, token) pair a
// conversion, a scale multiply and a multiply-add per block: 4 of a 4 x 4 tile's ~6 instructions per pair and block, so
// 4 tokens cost ~2x one (instruction-bound). Here the 8 rows' bytes are transposed by dwords, so that lane j of
// register k holds row j's weights for values 4k..4k+3, and each register is multiplied by the token's matching 4 int8
// values, broadcast. After a block's 8 products lane j holds row j's whole i32 block sum, and one conversion and one
// multiply-add (the 8 rows' scales, collected once per block, times the token's scale) finish 8 pairs at once. The
// transpose is cheap: rows r and r + 4 share a register (one in each 128-bit lane), and one 4 x 4 dword transpose
// within lanes (8 shuffles) serves 8 rows; for Q4 the nibble masks that follow are the unpacking any tile does. Per
// (row, token) and block that is 1 + 3/8 instructions (VNNI) instead of 4; per row and block ~3 (Q4) or ~4.5 (Q8_0) for
// the unpacking, the transpose and the scales, shared by the tokens. Measured (Xeon, AVX-512 + VNNI, 2 threads,
// SmolLM2's shapes in L3, benchmarks/qtiles.py): Q4_1 gate+up 3072 x 576 at 4 tokens 65 us against 110, at 1 token 42
// against 56; SmolLM2's whole decode step (batch_step.py --against) 4 rows 0.82x the time, 1 row 0.95x.
// Each row's sum runs in its own lane, block by block in order, whatever the tile's token count and the row's lane:
// the same bits for a row alone, in a batch, or in any position.
// Not faster everywhere: one token's Q4_0 GEMV at 2048-wide rows from memory took 1.04-1.14x the row tiles' time on
// that Xeon (benchmarks/gemv_ab.py; 5632-wide rows equal), for a reason not found yet (not the prefetch distance).
inline int32_t rd_i32(const uint8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// can N rows' leading dwords be gathered from rows[0] (every row within +-1 GB of it, 32-bit offsets)?
inline bool lead_gathers(const uint8_t* const* rows, int N) {
  for (int r = 1; r < N; ++r) {
    const int64_t o = rows[r] - rows[0];
    if (o > (1 << 30) || o < -(1 << 30)) return false;
  }
  return true;
}

// The leading dwords of 4 rows' blocks (d | m << 16 for Q4_1; d and two bytes not used otherwise), one per i32 lane:
// the lane tiles' scales, 4 rows per 128-bit lane
inline __m128i lead4(const uint8_t* const* blk, int64_t bo) {
  __m128i s = _mm_cvtsi32_si128(rd_i32(blk[0] + bo));
  for (int i = 1; i < 4; ++i) s = _mm_insert_epi32(s, rd_i32(blk[i] + bo), i);
  return s;
}

// The lane tiles are written once against two register widths: L8 (ymm, 8 rows; every AVX2 build) and L16 (zmm,
// 16 rows, rows r, r + 4, r + 8, r + 12 in the four 128-bit lanes of one register; AVX-512 builds with VNNI). A row's
// lane computes the same operations in the same order in both, so the two give the same bits and mix freely (a call's
// last rows take the 8-row tile when 8 or fewer remain: a sparse FFN group's last neurons). Measured (same Xeon,
// SmolLM2's decode step, batch_step.py --against, 11 paired rounds): 16 rows against 8, 1 row 0.837x the time,
// 4 rows 0.889x.
struct L8 {
  static constexpr int N = 8;
  static constexpr bool GATHER = false;  // not measured on an AVX2-only CPU: lead's loads and inserts there
  typedef __m256i vi;
  typedef __m256 vf;
  static vi load_rows(const uint8_t* const* blk, int i, int64_t off) {  // rows i (low lane) and i + 4 (high lane)
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(blk[i] + off))),
                                   _mm_loadu_si128((const __m128i*)(blk[i + 4] + off)), 1);
  }
  static vi unpacklo32(vi a, vi b) { return _mm256_unpacklo_epi32(a, b); }
  static vi unpackhi32(vi a, vi b) { return _mm256_unpackhi_epi32(a, b); }
  static vi unpacklo64(vi a, vi b) { return _mm256_unpacklo_epi64(a, b); }
  static vi unpackhi64(vi a, vi b) { return _mm256_unpackhi_epi64(a, b); }
  static vi and_(vi a, vi b) { return _mm256_and_si256(a, b); }
  static vi xor_(vi a, vi b) { return _mm256_xor_si256(a, b); }
  static vi srli16(vi a, int k) { return _mm256_srli_epi16(a, k); }
  static vi set1_8(char v) { return _mm256_set1_epi8(v); }
  static vi set1_32(int32_t v) { return _mm256_set1_epi32(v); }
  static vi zero_i() { return _mm256_setzero_si256(); }
  static vi add32(vi a, vi b) { return _mm256_add_epi32(a, b); }
  static vf zero_f() { return _mm256_setzero_ps(); }
  static vf bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static vf cvt(vi a) { return _mm256_cvtepi32_ps(a); }
  static vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
  static vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
  static vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
  static void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
  // acc + per lane the 4 products of w's bytes (unsigned) with x's (one token's 4 int8 values, broadcast)
  template <int TY>
  static vi dot(vi acc, vi w, vi x) {
#if defined(PINFER_VNNI)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, x);
#else
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#endif
#else
    // Q8_0's signed w: vpmaddubsw takes its first operand unsigned, so w goes in as |w| with x * sign(w) (|w| <= 128,
    // |x| <= 127: a pair <= 32512, too large to add two in i16). abs(w) is the same for every token (the compiler
    // computes it once per block, out of the unrolled token loop). Unsigned levels take dot_levels (below).
    static_assert(TY == Q8_0, "without VNNI, unsigned levels go through dot_levels");
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)),
                                                   _mm256_set1_epi16(1)));
#endif
  }
  // the rows' leading dwords (lead4), rows in lane order: 4 per 128-bit lane
  static vi lead(const uint8_t* const* blk, int64_t bo) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lead4(blk, bo)), lead4(blk + 4, bo), 1);
  }
  // lead's low halves (d) and high halves (m) as N floats each, rows in order
  static void halves(vi v, vf& d, vf& m, bool want_m) {
    const __m256i sel = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, sel), 0xD8);
    d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    if (want_m) m = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
  }
};

#if defined(PINFER_AVX512) && defined(__AVX512VNNI__)
struct L16 {
  static constexpr int N = 16;
  static constexpr bool GATHER = true;
  typedef __m512i vi;
  typedef __m512 vf;
  static vi load_rows(const uint8_t* const* blk, int i, int64_t off) {  // rows i, i + 4, i + 8, i + 12
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(blk[i] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(blk[i + 4] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(blk[i + 8] + off)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(blk[i + 12] + off)), 3);
  }
  static vi unpacklo32(vi a, vi b) { return _mm512_unpacklo_epi32(a, b); }
  static vi unpackhi32(vi a, vi b) { return _mm512_unpackhi_epi32(a, b); }
  static vi unpacklo64(vi a, vi b) { return _mm512_unpacklo_epi64(a, b); }
  static vi unpackhi64(vi a, vi b) { return _mm512_unpackhi_epi64(a, b); }
  static vi and_(vi a, vi b) { return _mm512_and_si512(a, b); }
  static vi xor_(vi a, vi b) { return _mm512_xor_si512(a, b); }
  static vi srli16(vi a, int k) { return _mm512_srli_epi16(a, k); }
  static vi set1_8(char v) { return _mm512_set1_epi8(v); }
  static vi set1_32(int32_t v) { return _mm512_set1_epi32(v); }
  static vi zero_i() { return _mm512_setzero_si512(); }
  static vi add32(vi a, vi b) { return _mm512_add_epi32(a, b); }
  static vf zero_f() { return _mm512_setzero_ps(); }
  static vf bcast(const float* p) { return _mm512_set1_ps(*p); }
  static vf cvt(vi a) { return _mm512_cvtepi32_ps(a); }
  static vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
  static vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
  static vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
  static void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
  template <int TY>
  static vi dot(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static vi lead(const uint8_t* const* blk, int64_t bo) {
    __m512i v = _mm512_castsi128_si512(lead4(blk, bo));
    v = _mm512_inserti32x4(v, lead4(blk + 4, bo), 1);
    v = _mm512_inserti32x4(v, lead4(blk + 8, bo), 2);
    return _mm512_inserti32x4(v, lead4(blk + 12, bo), 3);
  }
  // lead by one gather: row r's dword at base + off[r] + bo (off: the rows' offsets from base, lane r)
  static vi lead_at(const uint8_t* base, vi off, int64_t bo) {
    return _mm512_i32gather_epi32(off, (const int*)(base + bo), 1);
  }
  static vi offsets(const uint8_t* const* blk) {
    alignas(64) int32_t o[16];
    for (int r = 0; r < 16; ++r) o[r] = (int32_t)(blk[r] - blk[0]);
    return _mm512_load_si512((const void*)o);
  }
  static void halves(vi v, vf& d, vf& m, bool want_m) {
    const __m512i sel = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m512i dm = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), _mm512_shuffle_epi8(v, sel));
    d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    if (want_m) m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
  }
};
constexpr int QLANES = 16;
#else
constexpr int QLANES = 8;
#endif
constexpr int QLANES_MIN = 8;  // the narrow tile, for a call's last rows

// The N rows' blk pointers as registers: w[k], k = 0..7, lane j = row j's weights for values 4k..4k+3, vpdpbusd's
// unsigned operand. Within 128-bit lanes the 4 rows' 16 bytes are transposed by dwords (4 x 4: 8 shuffles). Q4: the
// nibbles 0..15 (the low nibbles of bytes 4k..4k+3 are values 4k.., their high nibbles 16 + 4k..). Q8_0: with VNNI,
// w + 128 (w ^ 0x80; the sum's start value -128 sum(x) restores w); without VNNI the raw int8 (V::dot's sign trick).
// 16 bytes at bo of each of the V::N rows, transposed by dwords into t[0..3] (register k, lane j: row j's bytes
// 4k..4k+3; also the K-quants' tiles, kquant.cpp)
template <class V>
inline void transposed16(const uint8_t* const* rows, int64_t bo, typename V::vi* t) {
  typedef typename V::vi vi;
  vi q[4];
  for (int i = 0; i < 4; ++i) q[i] = V::load_rows(rows, i, bo);
  const vi a0 = V::unpacklo32(q[0], q[1]), a1 = V::unpackhi32(q[0], q[1]);
  const vi a2 = V::unpacklo32(q[2], q[3]), a3 = V::unpackhi32(q[2], q[3]);
  t[0] = V::unpacklo64(a0, a2), t[1] = V::unpackhi64(a0, a2);
  t[2] = V::unpacklo64(a1, a3), t[3] = V::unpackhi64(a1, a3);
}

template <class V, int TY>
inline void lane_weights(const uint8_t* const* blk, int64_t bo, typename V::vi* w) {
  typedef typename V::vi vi;
  auto transposed = [&](int64_t off, vi* t) { transposed16<V>(blk, bo + off, t); };
  vi t[4];
  if constexpr (TY == Q8_0) {
    for (int h = 0; h < 2; ++h) {  // values 0..15, then 16..31
      transposed(2 + 16 * h, t);
      for (int k = 0; k < 4; ++k) {
#if defined(PINFER_VNNI)
        w[4 * h + k] = V::xor_(t[k], V::set1_8((char)0x80));
#else
        w[4 * h + k] = t[k];
#endif
      }
    }
  } else {
    transposed(TY == Q4_1 ? 4 : 2, t);
    for (int k = 0; k < 4; ++k) {
      w[k] = V::and_(t[k], V::set1_8(0x0F));
      w[4 + k] = V::and_(V::srli16(t[k], 4), V::set1_8(0x0F));
    }
  }
}

// A block's i32 sum starts at the integer offset of its encoding, in every lane: Q4_0 stores q + 8 (-8 sum(x)); Q8_0
// under VNNI multiplies w + 128 (-128 sum(x)). Exact. Zero otherwise.
template <class V, int TY>
inline typename V::vi lane_bias(int32_t bsum) {
  if (TY == Q4_0) return V::set1_32(-8 * bsum);
#if defined(PINFER_VNNI)
  if (TY == Q8_0) return V::set1_32(-128 * bsum);
#endif
  (void)bsum;
  return V::zero_i();
}

// The rows' leading dwords of each block (V::lead): by one gather where V has one and the rows' offsets from the first
// fit 32 bits (rows of one matrix: every call of pinfer's), else by loads and lane inserts, which compete with the
// transposition for the shuffle port (the gather: SmolLM2's decode step 0.97x the time at 1 row, 0.86x at 4)
template <class V>
struct Leads {
  typename V::vi off = V::zero_i();
  bool gather = false;
  explicit Leads(const uint8_t* const* rows) {
    if constexpr (V::GATHER) {
      gather = lead_gathers(rows, V::N);
      if (gather) off = V::offsets(rows);
    }
  }
  typename V::vi at(const uint8_t* const* rows, int64_t bo) const {
    if constexpr (V::GATHER)
      if (gather) return V::lead_at(rows[0], off, bo);
    return V::lead(rows, bo);
  }
};

#if defined(PINFER_AVX2) && !defined(PINFER_VNNI)
// Without VNNI a product is vpmaddubsw (byte pairs into i16) then vpmaddwd (i16 pairs into i32). Levels of at most L
// (unsigned) against int8 activations (|x| <= 127; 128 would do) make pairs of at most 256 L, so G products add in i16
// before one vpmaddwd while G 256 L <= 32767: G = 4 for levels up to 31 (Q4, Q5), 2 up to 63 (Q6_K). Per 8 products
// 18 (G 4) or 20 (G 2) integer instructions instead of 24, and the same i32 sums (integers: exact in any grouping).
// acc + the products of w[k0 .. k1) (lane j: row j's 4 levels) with one token's values xq[4k .. 4k + 3].
template <int G>
inline __m256i dot_levels(__m256i acc, const __m256i* w, const uint8_t* xq, int k0, int k1) {
  for (int g = k0; g < k1; g += G) {
    __m256i h = _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(rd_i32(xq + 4 * g)));
    for (int k = g + 1; k < g + G; ++k)
      h = _mm256_add_epi16(h, _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(rd_i32(xq + 4 * k))));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(h, _mm256_set1_epi16(1)));
  }
  return acc;
}
#endif

// One block of V::N rows (their lane registers w, scales dw and Q4_1's mins mw) against C tokens, into each token's
// accumulators. Q4_1's offset term sum_b m_b s_b (weights q * d + m, the tokens' s = d_x sum(q_x)) runs in a second
// accumulator per token, added last. The streaming tile and the packed one below both go through here: the same
// operations in the same order, so the same bits.
template <class V, int TY, int C>
inline void lane_block(const typename V::vi* w, typename V::vf dw, typename V::vf mw, const Q8* xs, int64_t b,
                       typename V::vf* facc, typename V::vf* macc) {
  typedef typename V::vi vi;
  // one token's 8 products per block in two dependent chains (vpdpbusd's latency is 5 cycles); 3 or more tokens are
  // chains enough. Integer sums: the split changes no bit.
  constexpr int NCH = C <= 2 ? 2 : 1;
  for (int c = 0; c < C; ++c) {
    const uint8_t* xq = (const uint8_t*)(xs[c].qs + b * QK);
    vi s = lane_bias<V, TY>(xs[c].bsum[b]);
#if !defined(PINFER_VNNI)
    if constexpr (TY != Q8_0)  // levels <= 31 (Q4's nibbles; Q5_0, Q5_1 and Q5_K come through Q4_1's chain)
      s = dot_levels<4>(s, w, xq, 0, 8);
    else
#endif
    {
      vi ch[NCH];
      ch[0] = s;
      if constexpr (NCH == 2) ch[1] = V::zero_i();
      for (int k = 0; k < 8; ++k) ch[k % NCH] = V::template dot<TY>(ch[k % NCH], w[k], V::set1_32(rd_i32(xq + 4 * k)));
      s = ch[0];
      if constexpr (NCH == 2) s = V::add32(s, ch[1]);
    }
    facc[c] = V::fma(V::cvt(s), V::mul(dw, V::bcast(xs[c].d + b)), facc[c]);
    if constexpr (TY == Q4_1) macc[c] = V::fma(mw, V::bcast(xs[c].s + b), macc[c]);
  }
}

// V::N rows (each PF_EVERY-th block prefetches the rows ahead and the caller's next rows) x C tokens
template <class V, int TY, int C>
inline void qtile_lanes(const uint8_t* const* rows, const Q8* xs, int64_t nb, float* out, int64_t ostride,
                        const uint8_t* const* nxt) {
  static_assert(C >= 1 && C <= 4, "up to 4 tokens");
  typedef typename V::vi vi;
  typedef typename V::vf vf;
  vf facc[C], macc[C];
  constexpr int64_t BB = unit_bytes(TY), PF_EVERY = 64 / BB;
  for (int c = 0; c < C; ++c) facc[c] = macc[c] = V::zero_f();
  const Leads<V> leads(rows);
  for (int64_t b = 0; b < nb; ++b) {
    // the rows as rows[r] + bo (an addressing mode), not as N pointers advanced a block at a time: N = 16 pointers
    // did not fit the registers, and their stores and reloads were a third of the loop's instructions
    const int64_t bo = b * BB;
    if (b % PF_EVERY == 0) prefetch_rows<V::N>(rows, bo, nxt);
    vi w[8];
    lane_weights<V, TY>(rows, bo, w);
    vf dw, mw = V::zero_f();
    V::halves(leads.at(rows, bo), dw, mw, TY == Q4_1);  // the rows' scales d (and Q4_1's mins m), exact as f16_table
    lane_block<V, TY, C>(w, dw, mw, xs, b, facc, macc);
  }
  for (int c = 0; c < C; ++c) V::store(out + c * ostride, TY == Q4_1 ? V::add(facc[c], macc[c]) : facc[c]);
}

// The lane registers of V::N rows' blocks, made once for a call of many tokens (a prompt's chunk): its token tiles
// then read them from cache, where the streaming tile unpacks and transposes the rows again for every 4 tokens
// (~40% of a 16-row, 4-token block's instructions at SmolLM2's shapes). 10 vectors a block: 40 KB for 16 rows of a
// 2048-wide Q4_0 matrix, in L1 / L2.
template <class V>
struct LanePack {
  typename V::vi w[8];
  typename V::vf dw, mw;
};

template <class V, int TY>
inline void lane_pack(const uint8_t* const* rows, int64_t nb, LanePack<V>* pk, const uint8_t* const* nxt) {
  constexpr int64_t BB = unit_bytes(TY), PF_EVERY = 64 / BB;
  const Leads<V> leads(rows);
  for (int64_t b = 0; b < nb; ++b) {  // qtile_lanes' prefetches
    const int64_t bo = b * BB;
    if (b % PF_EVERY == 0) prefetch_rows<V::N>(rows, bo, nxt);
    lane_weights<V, TY>(rows, bo, pk[b].w);
    pk[b].mw = V::zero_f();
    V::halves(leads.at(rows, bo), pk[b].dw, pk[b].mw, TY == Q4_1);
  }
}

// qtile_lanes over packed rows (lane_pack): the same bits
template <class V, int TY, int C>
inline void qtile_packed(const LanePack<V>* pk, const Q8* xs, int64_t nb, float* out, int64_t ostride) {
  static_assert(C >= 1 && C <= 4, "up to 4 tokens");
  typedef typename V::vf vf;
  vf facc[C], macc[C];
  for (int c = 0; c < C; ++c) facc[c] = macc[c] = V::zero_f();
  for (int64_t b = 0; b < nb; ++b) lane_block<V, TY, C>(pk[b].w, pk[b].dw, pk[b].mw, xs, b, facc, macc);
  for (int c = 0; c < C; ++c) V::store(out + c * ostride, TY == Q4_1 ? V::add(facc[c], macc[c]) : facc[c]);
}

template <int TY, int R, int C>
inline void qtile(const uint8_t* const* rows, const Q8* xs, int64_t nb, float* out, int64_t ostride,
                  const uint8_t* const* nxt = nullptr) {
#if defined(PINFER_AVX512) && defined(__AVX512VNNI__)
  static_assert(R == 16 || R == 8, "one row per i32 lane of a zmm or ymm register");
  if constexpr (R == 16) {
    qtile_lanes<L16, TY, C>(rows, xs, nb, out, ostride, nxt);
    return;
  }
#else
  static_assert(R == 8, "one row per i32 lane of a ymm register");
#endif
  qtile_lanes<L8, TY, C>(rows, xs, nb, out, ostride, nxt);
}
#else
template <int TY, int R, int C>
inline void qtile(const uint8_t* const* rows, const Q8* xs, int64_t nb, float* out, int64_t ostride,
                  const uint8_t* const* nxt = nullptr) {
  constexpr int64_t BB = unit_bytes(TY), PF_EVERY = 64 / BB;  // one prefetch per cache line of each row
  float acc[R][C] = {};
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = rows[r] + b * BB;
      if (b % PF_EVERY == 0) {
        prefetch(blk + PF_AHEAD);
        if (nxt) prefetch_l2(nxt[r] + b * BB);
      }
      const float dw = f16_scale(blk);
      int8_t w[QK];  // signed values: q - 8 (Q4_0), q (Q4_1), raw (Q8_0)
      if (TY == Q8_0) {
        std::memcpy(w, blk + 2, QK);
      } else {
        const uint8_t* qs = blk + (TY == Q4_1 ? 4 : 2);
        const int off = TY == Q4_0 ? 8 : 0;
        for (int j = 0; j < 16; ++j) {
          w[j] = (int8_t)((qs[j] & 15) - off);
          w[j + 16] = (int8_t)((qs[j] >> 4) - off);
        }
      }
      for (int c = 0; c < C; ++c) {
        const int8_t* x = xs[c].qs + b * QK;
        int32_t sum = 0;
        for (int j = 0; j < QK; ++j) sum += (int32_t)w[j] * (int32_t)x[j];
        acc[r][c] += dw * (xs[c].d[b] * (float)sum);
        if (TY == Q4_1) acc[r][c] += f16_scale(blk + 2) * xs[c].s[b];
      }
    }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[c * ostride + r] = acc[r][c];
}
#endif

// --- float-weight tiles: F32 / F16 / BF16 rows x fp32 tokens ---------------------------------------------------------

// VW weights starting at value i, as floats
template <int TY>
inline vf wload(const uint8_t* row, int64_t i) {
#if defined(PINFER_AVX512)
  if (TY == F32) return _mm512_loadu_ps((const float*)(row + 4 * i));
  const __m256i h = _mm256_loadu_si256((const __m256i*)(row + 2 * i));
  if (TY == F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(PINFER_AVX2)
  if (TY == F32) return _mm256_loadu_ps((const float*)(row + 4 * i));
  const __m128i h = _mm_loadu_si128((const __m128i*)(row + 2 * i));
  if (TY == F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  // GCC vectors: 8 lanes of integer bit manipulation, the same exact conversions as f16_to_f32 / bf16_to_f32
  typedef uint16_t vh __attribute__((vector_size(16)));
  typedef uint32_t vu __attribute__((vector_size(32)));
  if (TY == F32) return vload(reinterpret_cast<const float*>(row + 4 * i));  // vload copies bytewise (memcpy)
  vh h;
  std::memcpy(&h, row + 2 * i, sizeof h);
  const vu u = __builtin_convertvector(h, vu);
  vu bits;
  if (TY == BF16) {
    bits = u << 16;
  } else {
    const vu em = u & 0x7fff, sign = (u & 0x8000) << 16;
    vf scaled;
    const vu shifted = em << 13;
    std::memcpy(&scaled, &shifted, sizeof scaled);
    scaled = scaled * 0x1p112f;  // rebias normals, normalise subnormals (see f16_to_f32)
    vu fin;
    std::memcpy(&fin, &scaled, sizeof fin);
    const vu infnan = 0x7f800000u | ((em & 0x3ffu) << 13);
    bits = (em >= 0x7c00u ? infnan : fin) | sign;
  }
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}

// out[c * ostride + r] = row r . x_c over n values; xs[c] points at token c's fp32 activations.
template <int TY, int R, int C>
inline void ftile(const uint8_t* const* rows, const float* const* xs, int64_t n, float* out, int64_t ostride,
                  const uint8_t* const* nxt = nullptr) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  constexpr int64_t ES = unit_bytes(TY), PF_EVERY = 64 / (ES * VW) > 0 ? 64 / (ES * VW) : 1;
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    vf w[R];
    for (int r = 0; r < R; ++r) {
      if ((i / VW) % PF_EVERY == 0) {
        prefetch(rows[r] + i * ES + PF_AHEAD);
        if (nxt) prefetch_l2(nxt[r] + i * ES);
      }
      w[r] = wload<TY>(rows[r], i);
    }
    for (int c = 0; c < C; ++c) {
      const vf xv = vload(xs[c] + i);
      for (int r = 0; r < R; ++r) acc[r][c] = vfma(w[r], xv, acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float s = vsum(acc[r][c]);
      for (int64_t j = i; j < n; ++j) s += welem(TY, rows[r], j) * xs[c][j];
      out[c * ostride + r] = s;
    }
}

// --- dequantisation: one block (32 values) of a block type into 32 / VW float vectors --------------------------------

template <int TY>
inline void qblock(const uint8_t* blk, vf* v) {
  const float d = f16_scale(blk);
  const float m = TY == Q4_0 ? -8.f * d : TY == Q4_1 ? f16_scale(blk + 2) : 0.f;
  // value = q * d + m in one rounding: for Q4_0, d * (q - 8) exactly as the reference rounds it
#if defined(PINFER_AVX512)
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  if (TY == Q8_0) {
    for (int k = 0; k < 2; ++k)
      v[k] = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2 + 16 * k)))), dv);
    return;
  }
  const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + (TY == Q4_1 ? 4 : 2))));
  v[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(z, _mm512_set1_epi32(15))), dv, mv);
  v[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(z, 4)), dv, mv);
#elif defined(PINFER_AVX2)
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  if (TY == Q8_0) {
    for (int k = 0; k < 4; ++k)
      v[k] = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * k)))), dv);
    return;
  }
  const __m128i b = _mm_loadu_si128((const __m128i*)(blk + (TY == Q4_1 ? 4 : 2)));
  const __m256i z0 = _mm256_cvtepu8_epi32(b), z1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  const __m256i lo = _mm256_set1_epi32(15);
  v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(z0, lo)), dv, mv);
  v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(z1, lo)), dv, mv);
  v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(z0, 4)), dv, mv);
  v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(z1, 4)), dv, mv);
#else
  float q[QK];
  if (TY == Q8_0) {
    for (int j = 0; j < QK; ++j) q[j] = (float)(int8_t)blk[2 + j] * d;
  } else {
    const uint8_t* qs = blk + (TY == Q4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      q[j] = (float)(qs[j] & 15) * d + m;
      q[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
  }
  for (int k = 0; k < QK / VW; ++k) v[k] = vload(q + k * VW);
#endif
}

// A whole row (n values) as floats.
template <int TY>
inline void dequant_row(const uint8_t* row, int64_t n, float* out) {
  if (is_block(TY)) {
    for (int64_t b = 0; b < n / QK; ++b) {
      vf v[QK / VW];
      qblock<TY>(row + b * unit_bytes(TY), v);
      for (int k = 0; k < QK / VW; ++k) vstore(out + b * QK + k * VW, v[k]);
    }
    return;
  }
  int64_t i = 0;
  for (; i + VW <= n; i += VW) vstore(out + i, wload<TY>(row, i));
  for (; i < n; ++i) out[i] = welem(TY, row, i);
}

// --- axpy: y_t += sum_r h[t, r] * row_r over values [o0, o1), for T tokens -------------------------------------------
// Each chunk of each row is converted once and applied to every token (the rows of the sparse FFN's down projection).
// For block types o0 and o1 must be multiples of 32.
#if defined(PINFER_AVX512)
constexpr int AXPY_R = 8;  // rows per pass: 8 x 2 zmm of converted values stay in registers
#else
constexpr int AXPY_R = 4;  // 16 ymm registers: 4 rows x 4 vectors per block
#endif

// One block's values without their scale, as 32 / VW float vectors, for the one-token axpy below: Q4_0 as q - 8
// (SUBTRACTED8) or q, Q4_1 as q, Q8_0 as q. On AVX-512, Q4 nibbles become floats through a 16-entry table: vpermps
// reads only the low 4 bits of each index, so one permute replaces the mask and the int->float convert (and the table
// holds q - 8 for Q4_0).
#if defined(PINFER_AVX512)
template <int TY>
constexpr bool SUBTRACTED8 = TY == Q4_0;
template <int TY>
inline void qraw(const uint8_t* blk, vf* v) {
  if (TY == Q8_0) {
    for (int k = 0; k < 2; ++k)
      v[k] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2 + 16 * k))));
    return;
  }
  const __m512 lut = TY == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + (TY == Q4_1 ? 4 : 2))));
  v[0] = _mm512_permutexvar_ps(z, lut);
  v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), lut);
}
#else
template <int TY>
constexpr bool SUBTRACTED8 = false;
template <int TY>
inline void qraw(const uint8_t* blk, vf* v) {
#if defined(PINFER_AVX2)
  if (TY == Q8_0) {
    for (int k = 0; k < 4; ++k)
      v[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * k))));
    return;
  }
  const __m128i b = _mm_loadu_si128((const __m128i*)(blk + (TY == Q4_1 ? 4 : 2)));
  const __m256i z0 = _mm256_cvtepu8_epi32(b), z1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  const __m256i lo = _mm256_set1_epi32(15);
  v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(z0, lo));
  v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(z1, lo));
  v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(z0, 4));
  v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(z1, 4));
#else
  float q[QK];
  if (TY == Q8_0) {
    for (int j = 0; j < QK; ++j) q[j] = (float)(int8_t)blk[2 + j];
  } else {
    const uint8_t* qs = blk + (TY == Q4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      q[j] = (float)(qs[j] & 15);
      q[j + 16] = (float)(qs[j] >> 4);
    }
  }
  for (int k = 0; k < QK / VW; ++k) v[k] = vload(q + k * VW);
#endif
}
#endif

// Block types: y_t += sum_r (h_tr d_r) q_r per block, each row's scale folded into its coefficient so that a value
// costs one multiply-add (measured: Q4_0 ~25% fewer cycles than dequantising first), a block's raw values converted
// once and applied to every token. A row's offset term (Q4_1's min, Q4_0's -8 where the nibbles are not unpacked as
// q - 8) is one scalar per block, sum_r h_tr m_r: with mb (a [T, (o1 - o0) / 32] buffer from o0, row stride mbs) it is
// chained into mb and the caller adds mb to y once at the end; without, it is added to y at the end of this pass.
// Why mb: every value of y and of mb is then a chain of fused multiply-adds in row order, and a row whose coefficient
// is 0 for token t leaves token t's chain unchanged. So token t's sums do not depend on how the rows were cut into
// passes, nor on which rows (zero for t) other tokens brought in: the sparse FFN's batch invariance (sparse_ffn.cpp).
template <int TY, int N>
inline void axpy_blocks(const uint8_t* const* rows, const float* h, int64_t hs, int64_t T, float* y, int64_t ys,
                        int64_t o0, int64_t o1, const uint8_t* const* nxt, float* mb, int64_t mbs) {
  constexpr int NV = QK / VW;
  constexpr int64_t BB = unit_bytes(TY), PF_EVERY = 64 / BB;
  constexpr bool OFFSET = !(TY == Q8_0 || SUBTRACTED8<TY>);
  for (int64_t o = o0; o < o1; o += QK) {
    const int64_t bo = o / QK * BB, b = (o - o0) / QK;
    const bool pf = (o / QK) % PF_EVERY == 0;
    float sc[N], mn[N];
    for (int r = 0; r < N; ++r) {
      sc[r] = f16_scale(rows[r] + bo);
      mn[r] = TY == Q4_1 ? f16_scale(rows[r] + bo + 2) : -8.f;
      if (pf) {
        prefetch(rows[r] + bo + PF_AHEAD);
        if (nxt) prefetch_l2(nxt[r] + bo);
      }
    }
    if (T == 1) {  // one token: each row converted and applied in turn (few registers live)
      vf acc[NV];
      for (int k = 0; k < NV; ++k) acc[k] = vload(y + o + k * VW);
      float ms = mb ? mb[b] : 0.f;
      for (int r = 0; r < N; ++r) {
        const float hd = h[r] * sc[r];
        vf q[NV];
        qraw<TY>(rows[r] + bo, q);
        for (int k = 0; k < NV; ++k) acc[k] = vfma(q[k], vset1(hd), acc[k]);
        if (OFFSET) ms = std::fma(TY == Q4_1 ? h[r] : hd, mn[r], ms);
      }
      if (OFFSET && mb) mb[b] = ms;
      for (int k = 0; k < NV; ++k) vstore(y + o + k * VW, OFFSET && !mb ? vadd(acc[k], vset1(ms)) : acc[k]);
      continue;
    }
    vf q[N][NV];
    for (int r = 0; r < N; ++r) qraw<TY>(rows[r] + bo, q[r]);
    for (int64_t t = 0; t < T; ++t) {
      float* yt = y + t * ys + o;
      const float* ht = h + t * hs;
      vf acc[NV];
      for (int k = 0; k < NV; ++k) acc[k] = vload(yt + k * VW);
      float ms = mb ? mb[t * mbs + b] : 0.f;
      for (int r = 0; r < N; ++r) {
        const float hd = ht[r] * sc[r];
        for (int k = 0; k < NV; ++k) acc[k] = vfma(q[r][k], vset1(hd), acc[k]);
        if (OFFSET) ms = std::fma(TY == Q4_1 ? ht[r] : hd, mn[r], ms);
      }
      if (OFFSET && mb) mb[t * mbs + b] = ms;
      for (int k = 0; k < NV; ++k) vstore(yt + k * VW, OFFSET && !mb ? vadd(acc[k], vset1(ms)) : acc[k]);
    }
  }
}

// Float types: y_t = fma(row_r, h_tr, y_t), row after row: a chain in row order, as for the block types' mb above
template <int TY, int N>
inline void axpy_tile(const uint8_t* const* rows, const float* h, int64_t hs, int64_t T, float* y, int64_t ys,
                      int64_t o0, int64_t o1, const uint8_t* const* nxt = nullptr, float* mb = nullptr,
                      int64_t mbs = 0) {
  if constexpr (is_block(TY)) {
    axpy_blocks<TY, N>(rows, h, hs, T, y, ys, o0, o1, nxt, mb, mbs);
    return;
  }
  constexpr int64_t ES = unit_bytes(TY), PF_EVERY = 64 / (ES * VW) > 0 ? 64 / (ES * VW) : 1;
  int64_t o = o0;
  for (; o + VW <= o1; o += VW) {
    vf w[N];
    const bool pf = (o / VW) % PF_EVERY == 0;
    for (int r = 0; r < N; ++r) {
      if (pf) {
        prefetch(rows[r] + o * ES + PF_AHEAD);
        if (nxt) prefetch_l2(nxt[r] + o * ES);
      }
      w[r] = wload<TY>(rows[r], o);
    }
    for (int64_t t = 0; t < T; ++t) {
      vf acc = vload(y + t * ys + o);
      for (int r = 0; r < N; ++r) acc = vfma(w[r], vset1(h[t * hs + r]), acc);
      vstore(y + t * ys + o, acc);
    }
  }
  for (; o < o1; ++o)
    for (int64_t t = 0; t < T; ++t)
      for (int r = 0; r < N; ++r) y[t * ys + o] = std::fma(h[t * hs + r], welem(TY, rows[r], o), y[t * ys + o]);
}

}  // namespace pinfer
