// The types only dot products read, in place: the K-quants of llama.cpp's Q4_K_M / Q5_K_M files, Q5_0 / Q5_1 (which
// those files keep for rows whose width is not a multiple of 256) and IQ4_NL / IQ4_XS: dot products with q8
// activations (dot_rows' paths for these types; Q5_0 / Q5_1 and IQ4 further below). Q4_K or Q5_K holds most of a
// K-quant file's matrices; Q6_K its attn_v and half its ffn_down, and the output head of llama.cpp's Q4_0 files.
// Re-encoded (Q4_K as Q4_1, the others as Q8_0) they cost 20 bytes per 32 values against 18, 34 against 17 to 26.25,
// as a copy in memory (a 1B Q4_K_M file: 0.77 GB of copies besides the mapped file).
//
//   Q4_K  144 bytes per 256 values {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}: sub-block j (32 values) has a
//         6-bit scale sc and min m (ggml's get_scale_min_k4); value l of sub-block 2p + h: d sc q - dmin m with
//         q = nibble h of qs[32 p + l]
//   Q5_K  176 bytes per 256 values {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: Q4_K's, with bit j of
//         qh[l] the fifth bit (16) of value l of sub-block j
//   Q6_K  210 bytes per 256 values {u8 ql[128]; u8 qh[64]; i8 sc[16]; f16 d}: in half h (128 values), chunk c (32
//         values), value l: q = nibble c >> 1 of ql[64 h + 32 (c & 1) + l] | ((qh[32 h + l] >> 2 c) & 3) << 4, in
//         0..63; value = d * sc[8 h + 2 c + l / 16] * (q - 32)
//
// Both go through the lane tiles of quant.h, one row per i32 lane, the rows' bytes transposed by dwords (register k,
// lane j: row j's bytes 4k..4k+3), a 32-value sub-block or chunk being one q8 activation block (32 int8 x, scale dx).
// Q4_K / Q5_K: each sub-block is a Q4_1 block with d sc and -dmin m as its scale and min (exact in f32), the scales
// decoded per lane from the transposed scale bytes, and goes through Q4_1's lane block. Q6_K: the 6-bit q assembled in
// place, and per token 8 vpdpbusd (or vpmaddubsw + vpmaddwd: pairs <= 2 * 63 * 128, no saturation) into two sums,
// one per 16-value sub-block. Then per lane, exactly in integers, (sumA - 32 xA) scA + (sumB - 32 xB) scB (xA, xB:
// the token's sums of x over the two halves; sc: the rows' int8 scales, transposed once per super-block), and one
// float multiply-add, acc += float(that) * (d * dx). A row's chain is the same in any lane, in the 16-row (AVX-512)
// and 8-row (AVX2) tiles and in the portable loop, whatever the token count: a row alone, batched or in a prompt's
// chunk gets the same bits.
//
// Measured (Xeon with AVX-512 + VNNI, 2 threads, qmatmul from DRAM, rounds alternated; docs/results.md). Q6_K
// against its Q8_0 re-encoding, a 32000 x 2048 head: 0.77-0.82x the time at 1 token, 0.77-0.92x at 2, 0.92-1.05x at
// 4; a 2048 x 5632 matrix at 16 and 32 tokens (a prompt's chunk below the GEMM crossover) 1.26-1.28x (the 6-bit
// unpacking and the per-sub-block scales cost more per token than Q8_0's one scale), at 512 (the GEMM path)
// 1.00-1.02x; a first version, one row at a time with its 8 lanes summed at the end, took 1.095x at 1 token and
// 1.81x at 4. Q4_K against its Q4_1 re-encoding (benchmarks/kquant.py --kernels): 11264 x 2048 0.91x the time at 1
// token, 0.95x at 4; 2048 x 5632 1.00x at 1, 1.11x at 4, 1.06x at 16, 1.02x at 63. Against Q8_0, 11264 x 2048 at
// 1 / 4 / 63 tokens: Q5_K 0.83x / 0.92x / -, Q5_0 0.78x / 0.87x / 1.22x, Q5_1 0.83x / 0.83x / 1.25x, IQ4_NL 0.62x /
// 0.68x / 0.87x, IQ4_XS 0.57x / 0.65x / 0.89x.
#include <algorithm>
#include <cstring>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace pinfer {

namespace {

constexpr int64_t SB = 256, SB_BYTES = 210;  // values per super-block, Q6_K's bytes
// Q4_K's and Q5_K's super-block bytes, and where their quants start (Q5_K: after its 32 bytes of high bits)
constexpr int64_t k45_bytes(int ty) { return ty == Q5_K ? 176 : 144; }
constexpr int64_t k45_qs(int ty) { return ty == Q5_K ? 48 : 16; }
// the chunks of a half in the order their sums are added (by every build): 0 and 2 take the low and high nibbles of
// the same ql bytes, 1 and 3 of the next 32, so the tile keeps one transposed set in registers at a time
constexpr int CHUNK_ORDER[4] = {0, 2, 1, 3};

// IQ4_NL's and IQ4_XS's levels: value = scale * IQ4_LEVELS[nibble] (ggml's kvalues_iq4nl)
constexpr int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// block b (32 values) of an IQ4_NL / IQ4_XS row: its 16 quant bytes, and its scale in dw (IQ4_XS: d (ls - 32), ls
// the sub-block's 6-bit scale: 4 bits of scales_l, 2 of scales_h)
inline const uint8_t* iq4_block(int ty, const uint8_t* row, int64_t b, float& dw) {
  if (ty == IQ4_NL) {
    dw = f16_scale(row + b * 18);
    return row + b * 18 + 2;
  }
  const uint8_t* sb = row + b / 8 * 136;
  const int ib = (int)(b % 8);
  const int ls = ((sb[4 + ib / 2] >> (4 * (ib % 2))) & 15) | ((rd_u16(sb + 2) >> (2 * ib)) & 3) << 4;
  dw = f16_scale(sb) * (float)(ls - 32);
  return sb + 8 + 16 * ib;
}

// per token and block b: 32 x the sums of x over values 0-15 and 16-31 (the -32 of q - 32, for each sub-block)
void half_sums(const Q8& x, int64_t nb, int32_t* off) {
  for (int64_t b = 0; b < nb; ++b) {
    int32_t s[2] = {0, 0};
    for (int j = 0; j < QK; ++j) s[j / 16] += x.qs[b * QK + j];
    off[2 * b] = 32 * s[0], off[2 * b + 1] = 32 * s[1];
  }
}

// Share `part` of 8 of a super-block of bb bytes at so: those rows' super-block two on into L1, the caller's next
// rows' at so into L2. A walk calls it at each of its 8 chunks or sub-blocks, so that the requests come a few rows
// at a time rather than all N rows' lines at the top of each super-block (4 to 5 lines a row, 64-80 misses to DRAM in
// flight at once, ahead of the walk's own loads): one-token GEMVs from memory (Xeon, 2 threads, paired rounds,
// benchmarks/gemv_ab.py) 0.87-0.96x the time for Q6_K, 0.89-1.0x for Q4_K. Always inlined (simd.h PINFER_INLINE).
template <int N>
PINFER_INLINE void prefetch_superblock(const uint8_t* const* rows, int64_t so, int64_t bb, const uint8_t* const* nxt,
                                       int part) {
  for (int r = part * N / 8, e = (part + 1) * N / 8; r < e; ++r)
    for (int64_t a = 0; a < bb; a += 64) {
      prefetch(rows[r] + so + 2 * bb + a);
      if (nxt) prefetch_l2(nxt[r] + so + a);
    }
}

// value l (0..31) of a Q5_0 / Q5_1 block whose qh starts at byte QH (quants after it): nibble | fifth bit << 4
inline int32_t q5_quant(const uint8_t* blk, int64_t QH, uint32_t qh, int l) {
  return ((blk[QH + 4 + l % 16] >> (4 * (l / 16))) & 15) | ((qh >> l) & 1) << 4;
}

#if defined(PINFER_AVX2)
inline __m256i slli32(__m256i a, int k) { return _mm256_slli_epi32(a, k); }
inline __m256i srai32(__m256i a, int k) { return _mm256_srai_epi32(a, k); }
inline __m256i srli32(__m256i a, int k) { return _mm256_srli_epi32(a, k); }
inline __m256i slli16(__m256i a, int k) { return _mm256_slli_epi16(a, k); }
inline __m256i or_(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i sub32(__m256i a, __m256i b) { return _mm256_sub_epi32(a, b); }
inline __m256i mul32(__m256i a, __m256i b) { return _mm256_mullo_epi32(a, b); }
#if defined(PINFER_AVX512) && defined(__AVX512VNNI__)
inline __m512i slli32(__m512i a, int k) { return _mm512_slli_epi32(a, k); }
inline __m512i srai32(__m512i a, int k) { return _mm512_srai_epi32(a, k); }
inline __m512i srli32(__m512i a, int k) { return _mm512_srli_epi32(a, k); }
inline __m512i slli16(__m512i a, int k) { return _mm512_slli_epi16(a, k); }
inline __m512i or_(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i sub32(__m512i a, __m512i b) { return _mm512_sub_epi32(a, b); }
inline __m512i mul32(__m512i a, __m512i b) { return _mm512_mullo_epi32(a, b); }
#endif

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
#if !defined(PINFER_VNNI)
    sA = dot_levels<2>(sA, q, xq, 0, 4), sB = dot_levels<2>(sB, q, xq, 4, 8);  // levels <= 63
#else
    for (int k = 0; k < 4; ++k) sA = V::template dot<Q4_0>(sA, q[k], V::set1_32(rd_i32(xq + 4 * k)));
    for (int k = 4; k < 8; ++k) sB = V::template dot<Q4_0>(sB, q[k], V::set1_32(rd_i32(xq + 4 * k)));
#endif
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
        prefetch_superblock<V::N>(rows, so, SB_BYTES, nxt, 4 * h + ci);
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

// N rows (n <= N: the last ones repeated, their results dropped) x T tokens, C <= 4 at a time:
// tile(std::integral_constant<int, C>, rp, t0, tmp) writes rows rp's [C, N] results for tokens t0.. into tmp
template <int N, class Tile>
inline void by_tokens(const uint8_t* const* rows, int64_t n, int64_t T, float* out, int64_t os, Tile&& tile) {
  const uint8_t* rp[N];
  for (int r = 0; r < N; ++r) rp[r] = rows[std::min<int64_t>(r, n - 1)];
  float tmp[4 * N];
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const int64_t c = std::min<int64_t>(4, T - t0);
    switch (c) {
      case 1: tile(std::integral_constant<int, 1>(), rp, t0, tmp); break;
      case 2: tile(std::integral_constant<int, 2>(), rp, t0, tmp); break;
      case 3: tile(std::integral_constant<int, 3>(), rp, t0, tmp); break;
      default: tile(std::integral_constant<int, 4>(), rp, t0, tmp); break;
    }
    for (int64_t t = 0; t < c; ++t)
      for (int64_t r = 0; r < n; ++r) out[(t0 + t) * os + r] = tmp[t * N + r];
  }
}

template <class V>
void q6k_group(const uint8_t* const* rows, int64_t n, int64_t nsb, const Acts& a, const int32_t* const* offs,
               float* out, int64_t os, const uint8_t* const* nxt) {
  const bool packed = a.T > 4;
  thread_local std::vector<Q6Chunk<V>> ck;  // an over-aligned type: std::allocator aligns it (C++17)
  by_tokens<V::N>(rows, n, a.T, out, os, [&](auto cc, const uint8_t* const* rp, int64_t t0, float* tmp) {
    constexpr int C = decltype(cc)::value;
    if (packed && t0 == 0) {
      ck.resize(nsb * 8);
      int64_t i = 0;
      q6k_walk<V>(rp, nsb, nxt, [&](const typename V::vi* q, typename V::vi scA, typename V::vi scB,
                                    typename V::vf dw, int64_t b) {
        Q6Chunk<V>& k = ck[i++];
        for (int j = 0; j < 8; ++j) k.q[j] = q[j];
        k.scA = scA, k.scB = scB, k.dw = dw, k.b = b;
      });
    }
    if (packed)
      q6k_tile_packed<V, C>(ck.data(), nsb * 8, a.q.data() + t0, offs + t0, tmp, V::N);
    else
      q6k_tile<V, C>(rp, nsb, a.q.data() + t0, offs + t0, tmp, V::N, t0 == 0 ? nxt : nullptr);
  });
}

// --- Q4_K and Q5_K ------------------------------------------------------------------------------------------------
// Each 32-value sub-block of a Q4_K super-block is a Q4_1 block with d = d_sb sc and m = -dmin_sb m (both exact in
// f32: an f16 times a 6-bit integer), its nibbles those of 32 bytes shared with the next sub-block (low nibbles: the
// even sub-block, high: the odd). Q5_K is the same with a fifth bit per value (sub-block j: bit j of qh[l]), q in
// 0..31 (vpmaddubsw pairs <= 2 * 31 * 128: no saturation). So the rows' bytes are transposed as Q4_1's are, the
// scales decoded per lane from the transposed scale bytes, and each sub-block goes through Q4_1's lane block
// (quant.h lane_block): the same chain per row as a Q4_1 row's, in any lane, tile and token count.

// Walks V::N rows' super-blocks, handing each sub-block (activation block b, in order) to f(w, dw, mw, b): w the
// quants (register k, lane j: row j's values 4k..4k+3), dw = d sc and mw = -dmin m per lane
template <class V, int TY, class F>
inline void k45_walk(const uint8_t* const* rows, int64_t nsb, const uint8_t* const* nxt, F&& f) {
  typedef typename V::vi vi;
  typedef typename V::vf vf;
  constexpr int64_t BB = k45_bytes(TY), QS = k45_qs(TY);
  const Leads<V> leads(rows);
  const vi m0F = V::set1_8(0x0F), m10 = V::set1_8(0x10), m63 = V::set1_32(63), m15 = V::set1_32(15),
           m3 = V::set1_32(3);
  static const float minus1 = -1.f;
  for (int64_t s = 0; s < nsb; ++s) {
    const int64_t so = s * BB;
    vf d, dmin;
    V::halves(leads.at(rows, so), d, dmin, true);  // the super-block's leading dword: d | dmin << 16
    const vf ndmin = V::mul(dmin, V::bcast(&minus1));
    vi sc[4];  // lane j: row j's scale bytes 4k .. 4k + 3 in register k (k = 3: the first qs bytes, not used)
    transposed16<V>(rows, so + 4, sc);
    // sub-block j's 6-bit scale and min (ggml's get_scale_min_k4, per lane), as dw and mw
    auto scales = [&](int j, vf& dw, vf& mw) {
      vi u, m;
      if (j < 4) {
        u = V::and_(srli32(sc[0], 8 * j), m63), m = V::and_(srli32(sc[1], 8 * j), m63);
      } else {
        const int i = j - 4;
        u = or_(V::and_(srli32(sc[2], 8 * i), m15), slli32(V::and_(srli32(sc[0], 8 * i + 6), m3), 4));
        m = or_(V::and_(srli32(sc[2], 8 * i + 4), m15), slli32(V::and_(srli32(sc[1], 8 * i + 6), m3), 4));
      }
      dw = V::mul(d, V::cvt(u)), mw = V::mul(ndmin, V::cvt(m));
    };
    vi qh[8];  // Q5_K: the 32 bytes of fifth bits, transposed as the quants are
    if constexpr (TY == Q5_K) transposed16<V>(rows, so + 16, qh), transposed16<V>(rows, so + 32, qh + 4);
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p and 2p + 1: the low and high nibbles of qs[32p .. 32p + 31]
      vi t[8], w[8];
      transposed16<V>(rows, so + QS + 32 * p, t), transposed16<V>(rows, so + QS + 16 + 32 * p, t + 4);
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        prefetch_superblock<V::N>(rows, so, BB, nxt, j);
        vf dw, mw;
        scales(j, dw, mw);
        for (int k = 0; k < 8; ++k) {
          w[k] = V::and_(h ? V::srli16(t[k], 4) : t[k], m0F);
          // bit j of each qh byte to bit 4 (16-bit shifts: what crosses a byte is masked off)
          if constexpr (TY == Q5_K)
            w[k] = or_(w[k], V::and_(j <= 4 ? slli16(qh[k], 4 - j) : V::srli16(qh[k], j - 4), m10));
        }
        f(w, dw, mw, s * 8 + j);
      }
    }
  }
}

// N rows' sub-blocks as lane registers (walk(rp, nxt, f) hands f(w, dw, mw, b) each 32-value block b in order)
// through the lane block of LT (quant.h lane_block: Q4_1's unsigned quants with a min, or Q8_0's signed ones) against
// every token, C at a time: streaming (the rows unpacked in step with the tile) for up to 4 tokens, else the blocks
// unpacked once (LanePack) and read from cache by each tile of 4 (see Q6Chunk). The same operations in the same order
// either way, so the same bits.
template <class V, int LT, class Walk>
void lane_group(const uint8_t* const* rows, int64_t n, int64_t nb, const Acts& a, float* out, int64_t os,
                const uint8_t* const* nxt, Walk&& walk) {
  typedef typename V::vi vi;
  typedef typename V::vf vf;
  const bool packed = a.T > 4;
  thread_local std::vector<LanePack<V>> pk;
  by_tokens<V::N>(rows, n, a.T, out, os, [&](auto cc, const uint8_t* const* rp, int64_t t0, float* tmp) {
    constexpr int C = decltype(cc)::value;
    const Q8* xs = a.q.data() + t0;
    if (packed) {
      if (t0 == 0) {
        pk.resize(nb);
        walk(rp, nxt, [&](const vi* w, vf dw, vf mw, int64_t b) {
          for (int k = 0; k < 8; ++k) pk[b].w[k] = w[k];
          pk[b].dw = dw, pk[b].mw = mw;
        });
      }
      qtile_packed<V, LT, C>(pk.data(), xs, nb, tmp, V::N);
      return;
    }
    vf facc[C], macc[C];
    for (int c = 0; c < C; ++c) facc[c] = macc[c] = V::zero_f();
    walk(rp, t0 == 0 ? nxt : nullptr, [&](const vi* w, vf dw, vf mw, int64_t b) {
      lane_block<V, LT, C>(w, dw, mw, xs, b, facc, macc);
    });
    for (int c = 0; c < C; ++c)  // qtile_packed's ending
      V::store(tmp + c * V::N, LT == Q4_1 ? V::add(facc[c], macc[c]) : facc[c]);
  });
}

// --- IQ4_NL and IQ4_XS ----------------------------------------------------------------------------------------------
// A 32-value IQ4_NL block is Q4_0's {f16 d; u8 qs[16]} with value d * KV[nibble] (a fixed non-uniform table of int8
// levels) instead of d (nibble - 8). IQ4_XS keeps 8 such sub-blocks in a 256-value super-block, each with a 6-bit
// scale: value d (ls - 32) KV[nibble]. The nibbles become the table's int8 levels by one byte shuffle, and each block
// goes through Q8_0's lane block (signed quants: with VNNI the levels + 128, the sum starting at -128 sum(x)).
// the levels as the lane tiles multiply them: Q8_0's quants (quant.h lane_weights: with VNNI + 128, as bytes)
struct Levels {
  alignas(16) int8_t v[16];
};
constexpr Levels lane_levels() {
  Levels t{};
  for (int i = 0; i < 16; ++i)
#if defined(PINFER_VNNI)
    t.v[i] = (int8_t)(IQ4_LEVELS[i] ^ 0x80);
#else
    t.v[i] = IQ4_LEVELS[i];
#endif
  return t;
}
constexpr Levels IQ4_LANE = lane_levels();

inline __m256i table16(__m256i*) { return _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)IQ4_LANE.v)); }
inline __m256i shuffle8(__m256i t, __m256i i) { return _mm256_shuffle_epi8(t, i); }
#if defined(PINFER_AVX512) && defined(__AVX512VNNI__)
inline __m512i table16(__m512i*) { return _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)IQ4_LANE.v)); }
inline __m512i shuffle8(__m512i t, __m512i i) { return _mm512_shuffle_epi8(t, i); }
#endif

// the 16 quant bytes at bo of each row (32 values) as Q8_0's lane registers w[0..7]
template <class V>
inline void iq4_levels(const uint8_t* const* rows, int64_t bo, typename V::vi tbl, typename V::vi* w) {
  typename V::vi t[4];
  transposed16<V>(rows, bo, t);
  const typename V::vi m0F = V::set1_8(0x0F);
  for (int k = 0; k < 4; ++k) {
    w[k] = shuffle8(tbl, V::and_(t[k], m0F));
    w[4 + k] = shuffle8(tbl, V::and_(V::srli16(t[k], 4), m0F));
  }
}

// Walks V::N rows of nb blocks (IQ4_NL: 18 bytes each; IQ4_XS: 8 per 136-byte super-block), f(w, dw, mw = 0, b)
template <class V, int TY, class F>
inline void iq4_walk(const uint8_t* const* rows, int64_t nb, const uint8_t* const* nxt, F&& f) {
  typedef typename V::vi vi;
  typedef typename V::vf vf;
  const vi tbl = table16((vi*)nullptr), m15 = V::set1_32(15), m3 = V::set1_32(3), c32 = V::set1_32(32);
  vi w[8];
  vf d, unused;
  if constexpr (TY == IQ4_NL) {
    const Leads<V> leads(rows);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t bo = b * 18;
      if (b % 3 == 0) prefetch_rows<V::N>(rows, bo, nxt);  // once per cache line of each row (64 / 18)
      V::halves(leads.at(rows, bo), d, unused, false);
      iq4_levels<V>(rows, bo + 2, tbl, w);
      f(w, d, V::zero_f(), b);
    }
  } else {
    for (int64_t s = 0; s < nb / 8; ++s) {
      const int64_t so = s * 136;
      vi h[4];  // lane j: row j's d | scales_h << 16 in h[0], scales_l[0..3] in h[1]
      transposed16<V>(rows, so, h);
      V::halves(h[0], d, unused, false);
      const vi sh = srli32(h[0], 16);
      for (int ib = 0; ib < 8; ++ib) {
        prefetch_superblock<V::N>(rows, so, 136, nxt, ib);
        const vi ls = or_(V::and_(srli32(h[1], 8 * (ib / 2) + 4 * (ib % 2)), m15),
                          slli32(V::and_(srli32(sh, 2 * ib), m3), 4));
        iq4_levels<V>(rows, so + 8 + 16 * ib, tbl, w);
        f(w, V::mul(d, V::cvt(sub32(ls, c32))), V::zero_f(), s * 8 + ib);
      }
    }
  }
}

// --- Q5_0 and Q5_1 ---------------------------------------------------------------------------------------------------
// A Q5_0 / Q5_1 block is a Q4_0 / Q4_1 block with a fifth bit per value (bit v of its 32-bit qh for value v): q in
// 0..31, value d (q - 16) or d q + m. Both go through Q4_1's lane block, Q5_0 with m = -16 d (exact in f32).

// bytes 0..3 of each lane from bits 4k..4k + 3 of its qh: 0x10 where the bit is set (register k's fifth bits)
inline __m256i rep_byte0(__m256i*) {
  return _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
}
inline __m256i set_bits(__m256i z, __m256i bits, __m256i m10) {
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(z, bits), bits), m10);
}
#if defined(PINFER_AVX512) && defined(__AVX512VNNI__)
inline __m512i rep_byte0(__m512i*) {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
}
inline __m512i set_bits(__m512i z, __m512i bits, __m512i m10) {
  return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(z, bits), m10);
}
#endif

template <class V, int TY, class F>
inline void q5_walk(const uint8_t* const* rows, int64_t nb, const uint8_t* const* nxt, F&& f) {
  typedef typename V::vi vi;
  typedef typename V::vf vf;
  constexpr int64_t BB = TY == Q5_1 ? 24 : 22, QH = TY == Q5_1 ? 4 : 2;  // block bytes, where qh starts
  const Leads<V> leads(rows);
  const vi m0F = V::set1_8(0x0F), m10 = V::set1_8(0x10), rep = rep_byte0((vi*)nullptr),
           bits = V::set1_32(0x08040201);
  static const float minus16 = -16.f;
  vi w[8], t[4];
  vf d, m;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t bo = b * BB;
    if (b % 2 == 0) prefetch_rows<V::N>(rows, bo, nxt);  // once per cache line of each row (64 / 22 or 24)
    V::halves(leads.at(rows, bo), d, m, TY == Q5_1);
    if constexpr (TY == Q5_0) m = V::mul(d, V::bcast(&minus16));
    const vi qh = leads.at(rows, bo + QH);
    transposed16<V>(rows, bo + QH + 4, t);
    for (int k = 0; k < 8; ++k) {
      const vi nib = V::and_(k < 4 ? t[k] : V::srli16(t[k - 4], 4), m0F);
      w[k] = or_(nib, set_bits(shuffle8(srli32(qh, 4 * k), rep), bits, m10));
    }
    f(w, d, m, b);
  }
}

// n rows in groups of the widest tile, the last ones 8 at a time (the same bits per row in either tile), each group
// prefetching the rows after it (from rows, then the caller's next) into L2: group(G, rows, count, out, nx)
template <class Group>
inline void in_groups(const uint8_t* const* rows, int64_t n, float* out, const uint8_t* const* next, int64_t n_next,
                      Group&& group) {
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
    group(L16(), rows + i, N, out + i, nx);
#else
    group(L8(), rows + i, N, out + i, nx);
#endif
  }
  for (; i < n; i += QLANES_MIN) {
    after(i, QLANES_MIN, nx);
    group(L8(), rows + i, std::min<int64_t>(QLANES_MIN, n - i), out + i, nx);
  }
}

// dot_rows for a type walked into lane registers: walk(V(), rp, nxt, f) walks one group's nb blocks through LT's lane
// block (lane_group), the rows in groups of the widest tile (in_groups)
template <int LT, class Walk>
void walked_dot_rows(const uint8_t* const* rows, int64_t n, int64_t nb, const Acts& a, float* out, int64_t os,
                     const uint8_t* const* next, int64_t n_next, Walk&& walk) {
  in_groups(rows, n, out, next, n_next, [&](auto v, const uint8_t* const* g, int64_t m, float* o,
                                            const uint8_t* const* nx) {
    lane_group<decltype(v), LT>(g, m, nb, a, o, os, nx, [&](auto rp, auto nxt, auto&& f) { walk(v, rp, nxt, f); });
  });
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

// Q4_K and Q5_K: Q4_1's lane chain per sub-block (quant.h lane_block), one row at a time
void k45_row(int ty, const uint8_t* row, int64_t nsb, const Acts& a, float* out, int64_t os) {
  for (int64_t t = 0; t < a.T; ++t) {
    const Q8& x = a.q[t];
    float facc = 0.f, macc = 0.f;
    for (int64_t s = 0; s < nsb; ++s) {
      const uint8_t* blk = row + s * k45_bytes(ty);
      const float d = f16_scale(blk), ndmin = f16_scale(blk + 2) * -1.f;
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        k4_scale_min(j, blk + 4, sc, m);
        const int64_t b = s * 8 + j;
        const uint8_t *qs = blk + k45_qs(ty) + 32 * (j / 2), *qh = blk + 16;
        int32_t sum = 0;
        for (int l = 0; l < 32; ++l) {
          const int32_t q = ((qs[l] >> (4 * (j & 1))) & 15) | (ty == Q5_K ? ((qh[l] >> j) & 1) << 4 : 0);
          sum += q * (int32_t)x.qs[b * QK + l];
        }
        facc = std::fma((float)sum, (d * (float)sc) * x.d[b], facc);
        macc = std::fma(ndmin * (float)m, x.s[b], macc);
      }
    }
    out[t * os] = facc + macc;
  }
}

// IQ4_NL and IQ4_XS: Q8_0's lane chain per block (quant.h lane_block), one row at a time
void iq4_row(int ty, const uint8_t* row, int64_t nb, const Acts& a, float* out, int64_t os) {
  for (int64_t t = 0; t < a.T; ++t) {
    const Q8& x = a.q[t];
    float facc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float dw;
      const uint8_t* qs = iq4_block(ty, row, b, dw);
      const int8_t* xq = x.qs + b * QK;
      int32_t sum = 0;
      for (int l = 0; l < 16; ++l) sum += IQ4_LEVELS[qs[l] & 15] * xq[l] + IQ4_LEVELS[qs[l] >> 4] * xq[16 + l];
      facc = std::fma((float)sum, dw * x.d[b], facc);
    }
    out[t * os] = facc;
  }
}

// Q5_0 and Q5_1: Q4_1's lane chain per block (quant.h lane_block), one row at a time
void q5_row(int ty, const uint8_t* row, int64_t nb, const Acts& a, float* out, int64_t os) {
  const int64_t BB = ty == Q5_1 ? 24 : 22, QH = ty == Q5_1 ? 4 : 2;
  for (int64_t t = 0; t < a.T; ++t) {
    const Q8& x = a.q[t];
    float facc = 0.f, macc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * BB;
      const float d = f16_scale(blk), m = ty == Q5_1 ? f16_scale(blk + 2) : d * -16.f;
      uint32_t qh;
      std::memcpy(&qh, blk + QH, 4);
      int32_t sum = 0;
      for (int l = 0; l < 32; ++l) {
        sum += q5_quant(blk, QH, qh, l) * (int32_t)x.qs[b * QK + l];
      }
      facc = std::fma((float)sum, d * x.d[b], facc);
      macc = std::fma(m, x.s[b], macc);
    }
    out[t * os] = facc + macc;
  }
}
#endif

}  // namespace

void k45_dot_rows(int type, const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t os,
                  const uint8_t* const* next, int64_t n_next) {
  const int64_t nsb = a.n / SB;
#if defined(PINFER_AVX2)
  if (type == Q5_K)
    walked_dot_rows<Q4_1>(rows, n, nsb * 8, a, out, os, next, n_next, [&](auto v, auto rp, auto nxt, auto&& f) {
      k45_walk<decltype(v), Q5_K>(rp, nsb, nxt, f);
    });
  else
    walked_dot_rows<Q4_1>(rows, n, nsb * 8, a, out, os, next, n_next, [&](auto v, auto rp, auto nxt, auto&& f) {
      k45_walk<decltype(v), Q4_K>(rp, nsb, nxt, f);
    });
#else
  (void)next, (void)n_next;
  for (int64_t r = 0; r < n; ++r) k45_row(type, rows[r], nsb, a, out + r, os);
#endif
}

void q6k_dot_rows(const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t os,
                  const uint8_t* const* next, int64_t n_next) {
  const int64_t nb = a.n / QK, nsb = a.n / SB;
  thread_local std::vector<int32_t> off;
  off.resize(a.T * nb * 2);
  thread_local std::vector<const int32_t*> offs;  // reused: no allocation per call (the sparse FFN calls per group)
  offs.resize(a.T);
  for (int64_t t = 0; t < a.T; ++t) {
    half_sums(a.q[t], nb, off.data() + t * nb * 2);
    offs[t] = off.data() + t * nb * 2;
  }
#if defined(PINFER_AVX2)
  in_groups(rows, n, out, next, n_next, [&](auto v, const uint8_t* const* g, int64_t m, float* o,
                                            const uint8_t* const* nx) {
    q6k_group<decltype(v)>(g, m, nsb, a, offs.data(), o, os, nx);
  });
#else
  (void)next, (void)n_next;
  for (int64_t r = 0; r < n; ++r) q6k_row(rows[r], nsb, a, offs.data(), out + r, os);
#endif
}

void iq4_dot_rows(int type, const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t os,
                  const uint8_t* const* next, int64_t n_next) {
  const int64_t nb = a.n / QK;
#if defined(PINFER_AVX2)
  if (type == IQ4_XS)
    walked_dot_rows<Q8_0>(rows, n, nb, a, out, os, next, n_next, [&](auto v, auto rp, auto nxt, auto&& f) {
      iq4_walk<decltype(v), IQ4_XS>(rp, nb, nxt, f);
    });
  else
    walked_dot_rows<Q8_0>(rows, n, nb, a, out, os, next, n_next, [&](auto v, auto rp, auto nxt, auto&& f) {
      iq4_walk<decltype(v), IQ4_NL>(rp, nb, nxt, f);
    });
#else
  (void)next, (void)n_next;
  for (int64_t r = 0; r < n; ++r) iq4_row(type, rows[r], nb, a, out + r, os);
#endif
}

void iq4_to_f32(int type, const uint8_t* row, int64_t n, float* out) {
  for (int64_t b = 0; b < n / QK; ++b) {
    float dw;
    const uint8_t* qs = iq4_block(type, row, b, dw);
    for (int l = 0; l < 16; ++l) {
      out[b * QK + l] = dw * (float)IQ4_LEVELS[qs[l] & 15];
      out[b * QK + 16 + l] = dw * (float)IQ4_LEVELS[qs[l] >> 4];
    }
  }
}

void q5_dot_rows(int type, const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t os,
                 const uint8_t* const* next, int64_t n_next) {
  const int64_t nb = a.n / QK;
#if defined(PINFER_AVX2)
  if (type == Q5_1)
    walked_dot_rows<Q4_1>(rows, n, nb, a, out, os, next, n_next, [&](auto v, auto rp, auto nxt, auto&& f) {
      q5_walk<decltype(v), Q5_1>(rp, nb, nxt, f);
    });
  else
    walked_dot_rows<Q4_1>(rows, n, nb, a, out, os, next, n_next, [&](auto v, auto rp, auto nxt, auto&& f) {
      q5_walk<decltype(v), Q5_0>(rp, nb, nxt, f);
    });
#else
  (void)next, (void)n_next;
  for (int64_t r = 0; r < n; ++r) q5_row(type, rows[r], nb, a, out + r, os);
#endif
}

void q5_to_f32(int type, const uint8_t* row, int64_t n, float* out) {
  const int64_t BB = type == Q5_1 ? 24 : 22, QH = type == Q5_1 ? 4 : 2;
  for (int64_t b = 0; b < n / QK; ++b) {
    const uint8_t* blk = row + b * BB;
    const float d = f16_scale(blk);
    uint32_t qh;
    std::memcpy(&qh, blk + QH, 4);
    for (int l = 0; l < 32; ++l) {
      const int32_t q = q5_quant(blk, QH, qh, l);
      // as gguf-py: Q5_0 d (q - 16), Q5_1 d q + m (the products exact in f32: an f16 times 5 bits)
      out[b * QK + l] = type == Q5_1 ? d * (float)q + f16_scale(blk + 2) : d * (float)(q - 16);
    }
  }
}

}  // namespace pinfer
