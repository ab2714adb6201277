// Q6_K rows read in place: dot products with q8 activations (dot_rows' Q6_K path). llama.cpp keeps the output head of
// its Q4_0 files and attn_v / ffn_down of half the layers of its Q4_K_M files in Q6_K; re-encoded as Q8_0 they cost
// 34 bytes per 32 values against 26.25 read in place (the 1B Q4_0 file's head: 69.6 MB a token against 53.8).
//
//   Q6_K  210 bytes per 256 values {u8 ql[128]; u8 qh[64]; i8 sc[16]; f16 d}: in half h (128 values), chunk c (32
//         values), value l: q = nibble c >> 1 of ql[64 h + 32 (c & 1) + l] | ((qh[32 h + l] >> 2 c) & 3) << 4, in
//         0..63; value = d * sc[8 h + 2 c + l / 16] * (q - 32)
//
// A chunk is one q8 activation block (32 int8 x, scale dx). Its 32 q as unsigned bytes times x by vpdpbusd (or
// vpmaddubsw + vpmaddwd: pairs <= 2 * 63 * 128, no saturation) give 8 i32 lanes, lane i the products of values
// 4i..4i+3, lanes 0-3 one sub-block of 16 and lanes 4-7 the other. Per lane, exactly in integers: (sum q x - 32 sum x)
// * sc, the -32 taken from the token's lane sums of x (made once per call); then one float multiply-add per lane,
// acc += float(lane) * (d * dx), and the 8 lanes summed at the end of the row in a fixed tree. Each row's value is
// that chain whatever the token count, the rows beside it or the build (AVX-512, AVX2, with or without VNNI, and the
// portable loop, which computes the same lanes): a row alone, in a batch or in a prompt's chunk gets the same bits.
#include <cmath>

#include "kernels.h"

namespace pinfer {

namespace {

constexpr int64_t SB = 256, SB_BYTES = 210;

// per token and block b, 32 x the sums of x over each lane's 4 values: off[b * 8 + i] (the -32 of q - 32)
void lane_offsets(const Q8& x, int64_t nb, int32_t* off) {
  for (int64_t b = 0; b < nb; ++b)
    for (int i = 0; i < 8; ++i) {
      const int8_t* q = x.qs + b * QK + 4 * i;
      off[b * 8 + i] = 32 * ((int32_t)q[0] + q[1] + q[2] + q[3]);
    }
}

// the 8 lanes' sum: (l0 + l4) + (l2 + l6), (l1 + l5) + (l3 + l7), then those two
inline float lane_tree(const float* l) {
  const float s0 = l[0] + l[4], s1 = l[1] + l[5], s2 = l[2] + l[6], s3 = l[3] + l[7];
  return (s0 + s2) + (s1 + s3);
}

#if defined(PINFER_AVX2)
inline __m256i dot4(__m256i q, __m256i x) {
#if defined(PINFER_VNNI)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, x);
#endif
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

inline float hsum8(__m256 v) {  // lane_tree's order
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l0+l4 .. l3+l7
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// one row against C tokens (C <= 4): out[t * os]
template <int C>
void row_tile(const uint8_t* row, int64_t nsb, const Q8* xs, const int32_t* const* offs, float* out, int64_t os,
              const uint8_t* next) {
  const __m256i m0F = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  __m256 acc[C];
  for (int t = 0; t < C; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * SB_BYTES;
    if (next)
      for (int64_t a = 0; a < SB_BYTES; a += 64) prefetch_l2(next + s * SB_BYTES + a);
    const float dw = f16_scale(blk + 208);
    const __m128i sc16 = _mm_loadu_si128((const __m128i*)(blk + 192));
    for (int h = 0; h < 2; ++h) {
      const __m256i scv = _mm256_cvtepi8_epi32(h ? _mm_unpackhi_epi64(sc16, sc16) : sc16);  // sc[8h .. 8h + 7]
      const __m256i qlA = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
      const __m256i qlB = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
      const __m256i qhv = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
      for (int c = 0; c < 4; ++c) {
        const __m256i lo = (c & 1) ? qlB : qlA;
        const __m256i nib = _mm256_and_si256(c >> 1 ? _mm256_srli_epi16(lo, 4) : lo, m0F);
        // bits 2c, 2c + 1 of each qh byte to bits 4, 5 (16-bit shifts: what crosses a byte is masked off)
        const __m256i hb = _mm256_and_si256(c == 0 ? _mm256_slli_epi16(qhv, 4)
                                            : c == 1 ? _mm256_slli_epi16(qhv, 2)
                                            : c == 2 ? qhv : _mm256_srli_epi16(qhv, 2), m30);
        const __m256i q = _mm256_or_si256(nib, hb);
        const __m256i scc = _mm256_permutevar8x32_epi32(scv, _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c,
                                                                               2 * c + 1, 2 * c + 1, 2 * c + 1,
                                                                               2 * c + 1));
        const int64_t b = s * 8 + 4 * h + c;
        for (int t = 0; t < C; ++t) {
          const __m256i x = _mm256_loadu_si256((const __m256i*)(xs[t].qs + b * QK));
          __m256i v = _mm256_sub_epi32(dot4(q, x), _mm256_loadu_si256((const __m256i*)(offs[t] + b * 8)));
          v = _mm256_mullo_epi32(v, scc);
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(dw * xs[t].d[b]), acc[t]);
        }
      }
    }
  }
  for (int t = 0; t < C; ++t) out[t * os] = hsum8(acc[t]);
}
#else
// the portable build: the same lanes, one value at a time
template <int C>
void row_tile(const uint8_t* row, int64_t nsb, const Q8* xs, const int32_t* const* offs, float* out, int64_t os,
              const uint8_t*) {
  float acc[C][8] = {};
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* blk = row + s * SB_BYTES;
    const float dw = f16_scale(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c) {
        const int64_t b = s * 8 + 4 * h + c;
        int32_t q[32];
        for (int l = 0; l < 32; ++l) {
          const uint8_t lo = blk[64 * h + 32 * (c & 1) + l], hi = blk[128 + 32 * h + l];
          q[l] = ((c >> 1 ? lo >> 4 : lo) & 15) | ((hi >> (2 * c)) & 3) << 4;
        }
        for (int t = 0; t < C; ++t) {
          const float m = dw * xs[t].d[b];
          for (int i = 0; i < 8; ++i) {
            int32_t v = 0;
            for (int j = 4 * i; j < 4 * i + 4; ++j) v += q[j] * (int32_t)xs[t].qs[b * QK + j];
            v = (v - offs[t][b * 8 + i]) * (int32_t)sc[8 * h + 2 * c + (i >= 4)];
            acc[t][i] = std::fma((float)v, m, acc[t][i]);
          }
        }
      }
  }
  for (int t = 0; t < C; ++t) out[t * os] = lane_tree(acc[t]);
}
#endif

}  // namespace

void q6k_dot_rows(const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t os,
                  const uint8_t* const* next, int64_t n_next) {
  const int64_t nb = a.n / QK, nsb = a.n / SB;
  thread_local std::vector<int32_t> off;
  off.resize(a.T * nb * 8);
  std::vector<const int32_t*> offs(a.T);
  for (int64_t t = 0; t < a.T; ++t) {
    lane_offsets(a.q[t], nb, off.data() + t * nb * 8);
    offs[t] = off.data() + t * nb * 8;
  }
  for (int64_t r = 0; r < n; ++r) {
    // the row after this one streams into L2 while this one computes (scattered rows: one DRAM stream each)
    const uint8_t* nx = r + 1 < n ? rows[r + 1] : n_next > 0 ? next[0] : nullptr;
    int64_t t0 = 0;
    for (; t0 + 4 <= a.T; t0 += 4)
      row_tile<4>(rows[r], nsb, a.q.data() + t0, offs.data() + t0, out + t0 * os + r, os, t0 == 0 ? nx : nullptr);
    const uint8_t* nt = t0 == 0 ? nx : nullptr;
    switch (a.T - t0) {
      case 1: row_tile<1>(rows[r], nsb, a.q.data() + t0, offs.data() + t0, out + t0 * os + r, os, nt); break;
      case 2: row_tile<2>(rows[r], nsb, a.q.data() + t0, offs.data() + t0, out + t0 * os + r, os, nt); break;
      case 3: row_tile<3>(rows[r], nsb, a.q.data() + t0, offs.data() + t0, out + t0 * os + r, os, nt); break;
      default: break;
    }
  }
}

}  // namespace pinfer
