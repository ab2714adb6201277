// Q6_K rows read in place: dot products with q8 activations (dot_rows' Q6_K path). llama.cpp keeps the output head of
// its Q4_0 files and attn_v / ffn_down of half the layers of its Q4_K_M files in Q6_K; re-encoded as Q8_0 they cost
// 34 bytes per 32 values against 26.25 read in place (the 1B Q4_0 file's head: 69.6 MB a token against 53.8).
//
//   Q6_K  210 bytes per 256 values {u8 ql[128]; u8 qh[64]; i8 sc[16]; f16 d}: in half h (128 values), chunk c (32
//         values), value l: q = nibble c >> 1 of ql[64 h + 32 (c & 1) + l] | ((qh[32 h + l] >> 2 c) & 3) << 4, in
//         0..63; value = d * sc[8 h + 2 c + l / 16] * (q - 32)
//
// A chunk is one q8 activation block (32 int8 x, scale dx). The lane tiles of quant.h, one row per i32 lane: the
// rows' ql and qh bytes transposed by dwords (register k, lane j: row j's bytes 4k..4k+3), the 6-bit q assembled in
// place, and per token 8 vpdpbusd (or vpmaddubsw + vpmaddwd: pairs <= 2 * 63 * 128, no saturation) into two sums,
// one per 16-value sub-block. Then per lane, exactly in integers, (sumA - 32 xA) scA + (sumB - 32 xB) scB (xA, xB:
// the token's sums of x over the two halves; sc: the rows' int8 scales, transposed once per super-block), and one
// float multiply-add, acc += float(that) * (d * dx). A row's chain is the same in any lane, in the 16-row (AVX-512)
// and 8-row (AVX2) tiles and in the portable loop, whatever the token count: a row alone, batched or in a prompt's
// chunk gets the same bits.
//
// Measured against the Q8_0 re-encoding it replaces (Sapphire Rapids Xeon, 2 threads, qmatmul on a 32000 x 2048
// head from DRAM, rounds alternated; docs/results.md): 0.77-0.82x the time at 1 token, 0.77-0.92x at 2, 0.92-1.05x at
// 4; a 2048 x 5632 matrix at 16 and 32 tokens (a prompt's chunk below the GEMM crossover) 1.26-1.28x (the 6-bit
// unpacking and the per-sub-block scales cost more per token than Q8_0's one scale), at 512 (the GEMM path) 1.00-1.02x.
// A first version, one row at a time with its 8 lanes summed at the end, took 1.095x at 1 token and 1.81x at 4.
#include <cmath>

#include "kernels.h"

namespace pinfer {

namespace {

constexpr int64_t SB = 256, SB_BYTES = 210;
// the chunks of a half in the order their sums are added (by every build): 0 and 2 take the low and high nibbles of
// the same ql bytes, 1 and 3 of the next 32, so the tile keeps one transposed set in registers at a time
constexpr int CHUNK_ORDER[4] = {0, 2, 1, 3};

// per token and block b: 32 x the sums of x over values 0-15 and 16-31 (the -32 of q - 32, for each sub-block)
void half_sums(const Q8& x, int64_t nb, int32_t* off) {
  for (int64_t b = 0; b < nb; ++b) {
    int32_t s[2] = {0, 0};
    for (int j = 0; j < QK; ++j) s[j / 16] += x.qs[b * QK + j];
    off[2 * b] = 32 * s[0], off[2 * b + 1] = 32 * s[1];
  }
}

#if defined(PINFER_AVX2)
inline __m256i slli32(__m256i a, int k) { return _mm256_slli_epi32(a, k); }
inline __m256i srai32(__m256i a, int k) { return _mm256_srai_epi32(a, k); }
inline __m256i slli16(__m256i a, int k) { return _mm256_slli_epi16(a, k); }
inline __m256i or_(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i sub32(__m256i a, __m256i b) { return _mm256_sub_epi32(a, b); }
inline __m256i mul32(__m256i a, __m256i b) { return _mm256_mullo_epi32(a, b); }
#if defined(PINFER_AVX512) && defined(__AVX512VNNI__)
inline __m512i slli32(__m512i a, int k) { return _mm512_slli_epi32(a, k); }
inline __m512i srai32(__m512i a, int k) { return _mm512_srai_epi32(a, k); }
inline __m512i slli16(__m512i a, int k) { return _mm512_slli_epi16(a, k); }
inline __m512i or_(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i sub32(__m512i a, __m512i b) { return _mm512_sub_epi32(a, b); }
inline __m512i mul32(__m512i a, __m512i b) { return _mm512_mullo_epi32(a, b); }
#endif

// 16 bytes at bo of each of the V::N rows, transposed by dwords into t[0..3] (quant.h lane_weights' transposition)
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

// One chunk (activation block b) of V::N rows: their 6-bit q (register k, lane j: row j's values 4k..4k+3), the two
// sub-blocks' scales and d, against C tokens, into each token's accumulator. The streaming tile and the packed one
// both go through here: the same operations in the same order, so the same bits.
template <class V, int C>
inline void q6k_block(const typename V::vi* q, typename V::vi scA, typename V::vi scB, typename V::vf dw,
                      const Q8* xs, const int32_t* const* offs, int64_t b, typename V::vf* acc) {
  typedef typename V::vi vi;
  for (int t = 0; t < C; ++t) {
    const uint8_t* xq = (const uint8_t*)(xs[t].qs + b * QK);
    vi sA = V::zero_i(), sB = V::zero_i();
    for (int k = 0; k < 4; ++k) sA = V::template dot<Q4_0>(sA, q[k], V::set1_32(rd_i32(xq + 4 * k)));
    for (int k = 4; k < 8; ++k) sB = V::template dot<Q4_0>(sB, q[k], V::set1_32(rd_i32(xq + 4 * k)));
    const vi v = V::add32(mul32(sub32(sA, V::set1_32(offs[t][2 * b])), scA),
                          mul32(sub32(sB, V::set1_32(offs[t][2 * b + 1])), scB));
    acc[t] = V::fma(V::cvt(v), V::mul(dw, V::bcast(xs[t].d + b)), acc[t]);
  }
}

// Walks V::N rows' super-blocks, unpacking each chunk and handing it to f(q, scA, scB, dw, b): the chunks in the
// order of CHUNK_ORDER within each half
template <class V, class F>
inline void q6k_walk(const uint8_t* const* rows, int64_t nsb, const uint8_t* const* nxt, F&& f) {
  typedef typename V::vi vi;
  typedef typename V::vf vf;
  const Leads<V> leads(rows);
  const vi m0F = V::set1_8(0x0F), m30 = V::set1_8(0x30);
  for (int64_t s = 0; s < nsb; ++s) {
    const int64_t so = s * SB_BYTES;
    for (int r = 0; r < V::N; ++r)
      for (int64_t a = 0; a < SB_BYTES; a += 64) {
        prefetch(rows[r] + so + 2 * SB_BYTES + a);
        if (nxt) prefetch_l2(nxt[r] + so + a);
      }
    vf dw, unused;
    V::halves(leads.at(rows, so + 206), unused, dw, true);  // the dword at 206: sc[14], sc[15] and d, within the block
    vi sc[4];  // lane j: row j's scales 4k .. 4k + 3 (int8) in register k
    transposed16<V>(rows, so + 192, sc);
    for (int h = 0; h < 2; ++h) {
      vi qh[8];
      transposed16<V>(rows, so + 128 + 32 * h, qh), transposed16<V>(rows, so + 128 + 32 * h + 16, qh + 4);
      vi l[8];  // chunks 0 and 2 share their ql bytes, as do 1 and 3: one set of 8 registers live at a time
      for (int ci = 0; ci < 4; ++ci) {
        const int c = CHUNK_ORDER[ci];
        if (ci % 2 == 0) {
          transposed16<V>(rows, so + 64 * h + 32 * (c & 1), l);
          transposed16<V>(rows, so + 64 * h + 32 * (c & 1) + 16, l + 4);
        }
        vi q[8];
        for (int k = 0; k < 8; ++k) {
          const vi nib = V::and_(c >> 1 ? V::srli16(l[k], 4) : l[k], m0F);
          // bits 2c, 2c + 1 of each qh byte to bits 4, 5 (16-bit shifts: what crosses a byte is masked off)
          const vi hb = V::and_(c == 0 ? slli16(qh[k], 4) : c == 1 ? slli16(qh[k], 2) : c == 2 ? qh[k]
                                : V::srli16(qh[k], 2), m30);
          q[k] = or_(nib, hb);
        }
        // the sub-blocks' scales u = 8h + 2c and u + 1, sign-extended from their bytes
        const int u = 8 * h + 2 * c;
        const vi scA = srai32(slli32(sc[u / 4], 8 * (3 - u % 4)), 24);
        const vi scB = srai32(slli32(sc[(u + 1) / 4], 8 * (3 - (u + 1) % 4)), 24);
        f(q, scA, scB, dw, s * 8 + 4 * h + c);
      }
    }
  }
}

// V::N rows x C tokens (C <= 4) over nsb super-blocks: out[t * os + r]
template <class V, int C>
void q6k_tile(const uint8_t* const* rows, int64_t nsb, const Q8* xs, const int32_t* const* offs, float* out,
              int64_t os, const uint8_t* const* nxt) {
  typename V::vf acc[C];
  for (int t = 0; t < C; ++t) acc[t] = V::zero_f();
  q6k_walk<V>(rows, nsb, nxt, [&](const typename V::vi* q, typename V::vi scA, typename V::vi scB, typename V::vf dw,
                                  int64_t b) { q6k_block<V, C>(q, scA, scB, dw, xs, offs, b, acc); });
  for (int t = 0; t < C; ++t) V::store(out + t * os, acc[t]);
}

// A row group's chunks unpacked once, for a call of many tokens (a prompt's chunk): its token tiles then read them
// from cache (40 KB for 16 rows of 2048), where the streaming tile unpacks the rows again for every 4 tokens (1.5x
// the Q8_0 re-encoding's time at 16 tokens, 2.1x at 32, before this)
template <class V>
struct Q6Chunk {
  typename V::vi q[8], scA, scB;
  typename V::vf dw;
  int64_t b;
};

template <class V, int C>
void q6k_tile_packed(const Q6Chunk<V>* ck, int64_t n, const Q8* xs, const int32_t* const* offs, float* out,
                     int64_t os) {
  typename V::vf acc[C];
  for (int t = 0; t < C; ++t) acc[t] = V::zero_f();
  for (int64_t i = 0; i < n; ++i) q6k_block<V, C>(ck[i].q, ck[i].scA, ck[i].scB, ck[i].dw, xs, offs, ck[i].b, acc);
  for (int t = 0; t < C; ++t) V::store(out + t * os, acc[t]);
}

// N rows (n <= N: the last ones repeated, their results dropped) x every token, C at a time
template <class V>
void q6k_group(const uint8_t* const* rows, int64_t n, int64_t nsb, const Acts& a, const int32_t* const* offs,
               float* out, int64_t os, const uint8_t* const* nxt) {
  constexpr int N = V::N;
  const uint8_t* rp[N];
  for (int r = 0; r < N; ++r) rp[r] = rows[std::min<int64_t>(r, n - 1)];
  float tmp[4 * N];
  const bool packed = a.T > 4;
  thread_local std::vector<Q6Chunk<V>> ck;  // an over-aligned type: std::allocator aligns it (C++17)
  if (packed) {
    ck.resize(nsb * 8);
    int64_t i = 0;
    q6k_walk<V>(rp, nsb, nxt, [&](const typename V::vi* q, typename V::vi scA, typename V::vi scB,
                                  typename V::vf dw, int64_t b) {
      Q6Chunk<V>& c = ck[i++];
      for (int k = 0; k < 8; ++k) c.q[k] = q[k];
      c.scA = scA, c.scB = scB, c.dw = dw, c.b = b;
    });
  }
  for (int64_t t0 = 0; t0 < a.T; t0 += 4) {
    const int64_t c = std::min<int64_t>(4, a.T - t0);
    const Q8* xs = a.q.data() + t0;
    const int32_t* const* of = offs + t0;
    const uint8_t* const* nx = t0 == 0 ? nxt : nullptr;
    if (packed) {
      switch (c) {
        case 1: q6k_tile_packed<V, 1>(ck.data(), nsb * 8, xs, of, tmp, N); break;
        case 2: q6k_tile_packed<V, 2>(ck.data(), nsb * 8, xs, of, tmp, N); break;
        case 3: q6k_tile_packed<V, 3>(ck.data(), nsb * 8, xs, of, tmp, N); break;
        default: q6k_tile_packed<V, 4>(ck.data(), nsb * 8, xs, of, tmp, N); break;
      }
    } else {
      switch (c) {
        case 1: q6k_tile<V, 1>(rp, nsb, xs, of, tmp, N, nx); break;
        case 2: q6k_tile<V, 2>(rp, nsb, xs, of, tmp, N, nx); break;
        case 3: q6k_tile<V, 3>(rp, nsb, xs, of, tmp, N, nx); break;
        default: q6k_tile<V, 4>(rp, nsb, xs, of, tmp, N, nx); break;
      }
    }
    for (int64_t t = 0; t < c; ++t)
      for (int64_t r = 0; r < n; ++r) out[(t0 + t) * os + r] = tmp[t * N + r];
  }
}
#else
// the portable build: the lane tiles' chain, one row at a time
void q6k_row(const uint8_t* row, int64_t nsb, const Acts& a, const int32_t* const* offs, float* out, int64_t os) {
  for (int64_t t = 0; t < a.T; ++t) {
    const Q8& x = a.q[t];
    float acc = 0.f;
    for (int64_t s = 0; s < nsb; ++s) {
      const uint8_t* blk = row + s * SB_BYTES;
      const float dw = f16_scale(blk + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      for (int h = 0; h < 2; ++h)
        for (int ci = 0; ci < 4; ++ci) {
          const int c = CHUNK_ORDER[ci];
          const int64_t b = s * 8 + 4 * h + c;
          int32_t sum[2] = {0, 0};
          for (int l = 0; l < 32; ++l) {
            const uint8_t lo = blk[64 * h + 32 * (c & 1) + l], hi = blk[128 + 32 * h + l];
            const int32_t q = ((c >> 1 ? lo >> 4 : lo) & 15) | ((hi >> (2 * c)) & 3) << 4;
            sum[l / 16] += q * (int32_t)x.qs[b * QK + l];
          }
          const int u = 8 * h + 2 * c;
          const int32_t v = (sum[0] - offs[t][2 * b]) * sc[u] + (sum[1] - offs[t][2 * b + 1]) * sc[u + 1];
          acc = std::fma((float)v, dw * x.d[b], acc);
        }
    }
    out[t * os] = acc;
  }
}
#endif

}  // namespace

void q6k_dot_rows(const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t os,
                  const uint8_t* const* next, int64_t n_next) {
  const int64_t nb = a.n / QK, nsb = a.n / SB;
  thread_local std::vector<int32_t> off;
  off.resize(a.T * nb * 2);
  std::vector<const int32_t*> offs(a.T);
  for (int64_t t = 0; t < a.T; ++t) {
    half_sums(a.q[t], nb, off.data() + t * nb * 2);
    offs[t] = off.data() + t * nb * 2;
  }
#if defined(PINFER_AVX2)
  // the rows after group i (from rows, then the caller's next), for the L2 prefetches
  auto after = [&](int64_t i, int N, const uint8_t** nx) {
    for (int r = 0; r < N; ++r) {
      const int64_t j = i + N + r;
      nx[r] = j < n ? rows[j] : (j - n < n_next ? next[j - n] : (n_next ? next[n_next - 1] : rows[n - 1]));
    }
  };
  constexpr int N = QLANES;
  const uint8_t* nx[N];
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    after(i, N, nx);
#if defined(PINFER_AVX512) && defined(__AVX512VNNI__)
    q6k_group<L16>(rows + i, N, nsb, a, offs.data(), out + i, os, nx);
#else
    q6k_group<L8>(rows + i, N, nsb, a, offs.data(), out + i, os, nx);
#endif
  }
  for (; i < n; i += QLANES_MIN) {  // the last rows 8 at a time (the same bits per row in either tile)
    after(i, QLANES_MIN, nx);
    q6k_group<L8>(rows + i, std::min<int64_t>(QLANES_MIN, n - i), nsb, a, offs.data(), out + i, os, nx);
  }
#else
  (void)next, (void)n_next;
  for (int64_t r = 0; r < n; ++r) q6k_row(rows[r], nsb, a, offs.data(), out + r, os);
#endif
}

}  // namespace pinfer
