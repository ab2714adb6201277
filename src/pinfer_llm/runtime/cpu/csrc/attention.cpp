// One token's attention at position pos, GQA included, in one call: rotate q and k (RoPE) by rope [D/2, 2] =
// (cos, sin) of each rotary pair, store k and v into the layer's cache rows pos, then for each query head h (kv head
// h / (H / Hkv)): softmax(q . k_0..pos * scale) . v_0..pos. qkv [(H + 2 Hkv) D] is the fused projection's output;
// k_cache, v_cache [Hkv, ctx, D] in float or IEEE half (llama.cpp's default KV type: half the cache bytes, which
// the memory budget counts; keys and values are rounded to half once, when written, and read back exactly).
//
// Rotary pairs: adjacent (2i, 2i+1), GGUF's Llama layout (llama.cpp's converter permutes Q/K rows for it); or with
// neox, the halves (i, i + D/2) (GPT-NeoX / Falcon). Pair i uses rope row i either way.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>

#include "kernels.h"

namespace pinfer {

namespace {

template <typename KV>
constexpr int kv_type() { return std::is_same<KV, float>::value ? F32 : F16; }

template <typename KV>
inline KV to_kv(float v) {
  if constexpr (std::is_same<KV, float>::value) return v;
  else return f32_to_f16(v);
}

// rotate src (D values) into dst: dst[a] = src[a] c - src[b] s, dst[b] = src[b] c + src[a] s for each pair (a, b),
// each as one fused multiply-add of a rounded product: fma(src[a], c, -(src[b] s)), fma(src[b], c, src[a] s). Written
// as fma here and in the vector path so that both give these bits, whatever the compiler would contract a * c - b * s
// into (GCC fused it one way in the scalar loop and another in vector code).
template <typename KV>
void rotate_scalar(const float* src, KV* dst, const float* cs, int64_t D, bool neox) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    const float a = src[ia], b = src[ib], c = cs[2 * i], s = cs[2 * i + 1];
    const float bs = b * s, as = a * s;
    dst[ia] = to_kv<KV>(std::fma(a, c, -bs));
    dst[ib] = to_kv<KV>(std::fma(b, c, as));
  }
}

#if defined(PINFER_AVX2)
// VW floats into dst as they are or rounded to half (vcvtps2ph, round to nearest even: f32_to_f16's bits)
template <typename KV>
inline void store_vec(KV* dst, vf v) {
  if constexpr (std::is_same<KV, float>::value) vstore(dst, v);
#if defined(PINFER_AVX512)
  else _mm256_storeu_si256((__m256i*)dst, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  else _mm_storeu_si128((__m128i*)dst, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
}

// rotate_scalar's bits, VW values at a time (a row of a 4-row SmolLM2 step spent ~2 us per layer in the scalar loop
// and its one-at-a-time half conversions: work each row pays alone). Adjacent pairs: the row times (c, c) minus /
// plus the pair-swapped row times (s, s), in the even / odd lanes (fmaddsub). Halves: c and s split out of the
// (cos, sin) pairs.
template <typename KV>
inline void rotate_vec(const float* src, KV* dst, const float* cs, int64_t D, bool neox) {
#if defined(PINFER_AVX512)
  auto dup_even = [](vf v) { return _mm512_moveldup_ps(v); };
  auto dup_odd = [](vf v) { return _mm512_movehdup_ps(v); };
  auto swap_pairs = [](vf v) { return _mm512_permute_ps(v, 0xB1); };
  auto fmaddsub = [](vf a, vf b, vf c) { return _mm512_fmaddsub_ps(a, b, c); };
  auto fmsub = [](vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); };
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  auto split = [&](const float* p, vf& c, vf& s) {
    const vf lo = vload(p), hi = vload(p + VW);
    c = _mm512_permutex2var_ps(lo, evens, hi);
    s = _mm512_permutex2var_ps(lo, odds, hi);
  };
#else
  auto dup_even = [](vf v) { return _mm256_moveldup_ps(v); };
  auto dup_odd = [](vf v) { return _mm256_movehdup_ps(v); };
  auto swap_pairs = [](vf v) { return _mm256_permute_ps(v, 0xB1); };
  auto fmaddsub = [](vf a, vf b, vf c) { return _mm256_fmaddsub_ps(a, b, c); };
  auto fmsub = [](vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); };
  auto split = [&](const float* p, vf& c, vf& s) {  // in-lane even / odd picks, then the 64-bit quarters in order
    const vf lo = vload(p), hi = vload(p + VW);
    c = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xD8));
    s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xDD)), 0xD8));
  };
#endif
  if (!neox) {
    for (int64_t i = 0; i < D; i += VW) {
      const vf v = vload(src + i), p = vload(cs + i);
      store_vec(dst + i, fmaddsub(v, dup_even(p), vmul(swap_pairs(v), dup_odd(p))));
    }
    return;
  }
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += VW) {
    vf c, s;
    split(cs + 2 * i, c, s);
    const vf a = vload(src + i), b = vload(src + half + i);
    store_vec(dst + i, fmsub(a, c, vmul(b, s)));
    store_vec(dst + half + i, vfma(b, c, vmul(a, s)));
  }
}
#endif

template <typename KV>
void rotate(const float* src, KV* dst, const float* cs, int64_t D, bool neox) {
#if defined(PINFER_AVX2)
  if ((neox ? D / 2 : D) % VW == 0) return rotate_vec(src, dst, cs, D, neox);
#endif
  rotate_scalar(src, dst, cs, D, neox);
}

// q rotated into q [H, D]; k rotated and v stored into the cache rows pos
template <typename KV>
void store_row(const float* qkv, const float* rope, KV* kc, KV* vc, int64_t ctx, int64_t D, int64_t pos, int64_t H,
               int64_t Hkv, bool neox, float* q) {
  for (int64_t h = 0; h < H; ++h) rotate(qkv + h * D, q + h * D, rope, D, neox);
  for (int64_t g = 0; g < Hkv; ++g) {
    rotate(qkv + (H + g) * D, kc + (g * ctx + pos) * D, rope, D, neox);
    const float* v = qkv + (H + Hkv + g) * D;
    KV* vdst = vc + (g * ctx + pos) * D;
    int64_t i = 0;
#if defined(PINFER_AVX2)
    for (; i + VW <= D; i += VW) store_vec(vdst + i, vload(v + i));
#endif
    for (; i < D; ++i) vdst[i] = to_kv<KV>(v[i]);
  }
}

#if defined(PINFER_AVX2)
// VW vectors -> one vector whose lane i is the sum of v[i]'s lanes: pairs within 128-bit lanes (unpack), then pairs
// of pairs (shuffle), then across 128-bit lanes. About 3 instructions per vector, against ~8 for a horizontal sum of
// each (on zmm), which a 64-wide key's 4 multiply-adds would otherwise wait on.
#if defined(PINFER_AVX512)
inline vf lane_sums(vf* v) {
  vf s1[8], s2[4];
  for (int i = 0; i < 8; ++i)
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: the lane sums of v[4i .. 4i + 3]
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
  const vf u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x44), _mm512_shuffle_f32x4(s2[0], s2[1], 0xEE));
  const vf u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], 0x44), _mm512_shuffle_f32x4(s2[2], s2[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}
#else
inline vf lane_sums(vf* v) {
  vf s1[4], s2[2];
  for (int i = 0; i < 4; ++i)
    s1[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    s2[i] = _mm256_add_ps(_mm256_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                          _mm256_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(s2[0], s2[1], 0x20), _mm256_permute2f128_ps(s2[0], s2[1], 0x31));
}
#endif

// the scores of keys t .. t + VW - 1 (rows kt, one key per output lane) against q over D values (D % VW == 0)
template <int TY>
inline void key_scores(const uint8_t* const* kt, const float* q, int64_t D, float* out) {
  vf acc[VW];
  for (int r = 0; r < VW; ++r) acc[r] = vzero();
  for (int64_t i = 0; i < D; i += VW) {
    const vf qv = vload(q + i);
    for (int r = 0; r < VW; ++r) acc[r] = vfma(wload<TY>(kt[r], i), qv, acc[r]);
  }
  vstore(out, lane_sums(acc));
}
#endif

// out[c ostride + i] = sum over the value rows t < n of p[c np + t] v_t[i], for the DV x VW values i from vh (row t
// at vh + t stride), the C heads' sums held in registers from the first row to the last: each value is loaded and
// converted once per pass, and neither the sums nor the weights p go through memory per row, where axpy_rows (the
// general path) loads and stores every head's sums each 8 rows and broadcasts each p from memory for every vector.
// The same chain of fused multiply-adds per value as axpy_rows', in row order from +0: the same bits.
template <int TY, int C, int DV>
void values_reg(const uint8_t* vh, int64_t stride, int64_t n, const float* p, int64_t np, float* out,
                int64_t ostride) {
  constexpr int64_t bytes = DV * VW * unit_bytes(TY);  // of a row, per pass
  vf acc[C][DV];
  for (int c = 0; c < C; ++c)
    for (int k = 0; k < DV; ++k) acc[c][k] = vzero();
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* v = vh + t * stride;
    if (t + 4 < n)  // 4 rows ahead, into L1 (attend_group prefetched them into L2)
      for (int64_t a = 0; a < bytes; a += 64) prefetch(v + 4 * stride + a);
    vf h[C];
    for (int c = 0; c < C; ++c) h[c] = vset1(p[c * np + t]);
    for (int k = 0; k < DV; ++k) {
      const vf w = wload<TY>(v, k * VW);
      for (int c = 0; c < C; ++c) acc[c][k] = vfma(w, h[c], acc[c][k]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int k = 0; k < DV; ++k) vstore(out + c * ostride + k * VW, acc[c][k]);
}

// values_reg over a kv group's C heads in passes whose sums fit the registers with room for one value vector and the
// weights: 4 vectors of values (64 on AVX-512, 32 on AVX2) for up to 4 heads on AVX-512 (32 registers), 2 on AVX2
// (16). A head of D values takes D / (4 VW) passes over the value rows, a group of C heads that many times C / 4 (or
// C / 2), each after the first reading the rows from cache. False where D is not a multiple of 4 VW: the caller's
// general path.
template <int TY>
bool values_in_registers(int64_t C, int64_t D, const uint8_t* vh, int64_t n, const float* p, int64_t np,
                         float* out) {
  constexpr int DV = 4, HEADS = VW == 16 ? 4 : 2;
  constexpr int64_t W = DV * VW;  // values per pass
  if (n < 1 || D % W != 0) return false;
  const int64_t stride = D * unit_bytes(TY);
  for (int64_t c = 0; c < C; c += HEADS)
    for (int64_t i = 0; i < D; i += W) {
      const uint8_t* v = vh + i * unit_bytes(TY);
      const float* pc = p + c * np;
      float* oc = out + c * D + i;
      switch (std::min<int64_t>(HEADS, C - c)) {
        case 1: values_reg<TY, 1, DV>(v, stride, n, pc, np, oc, D); break;
        case 2: values_reg<TY, 2, DV>(v, stride, n, pc, np, oc, D); break;
        case 3: if constexpr (HEADS > 2) values_reg<TY, 3, DV>(v, stride, n, pc, np, oc, D); break;
        default: if constexpr (HEADS > 3) values_reg<TY, 4, DV>(v, stride, n, pc, np, oc, D); break;
      }
    }
  return true;
}

// C query heads q [C, D] (consecutive, one kv head) against that head's rows 0..n-1 (kh, vh [n, D]) -> out [C, D];
// p, kb, vrows: scratch. Each head's bits are its own whatever C: the heads share only the reading (and, for a half
// cache, the conversion) of each key and value row, which a 1024-deep head was bound by (4 conversions a row).
template <typename KV>
void attend_group(const float* q, int64_t C, const KV* kh_, const KV* vh_, int64_t n, int64_t D, float scale,
                  float* out, std::vector<float>& p, std::vector<float>& kb, std::vector<const uint8_t*>& vrows) {
  constexpr int TY = kv_type<KV>();
  const int64_t row = D * (int64_t)sizeof(KV);
  const uint8_t *kh = (const uint8_t*)kh_, *vh = (const uint8_t*)vh_;
  const int64_t np = (n + VW - 1) / VW * VW;  // a head's stride in p
  p.resize(C * np);
  int64_t t = 0;
#if defined(PINFER_AVX2)
  if (D % VW == 0) {  // VW keys per tile, one per lane; the last tile repeats key n - 1 in the lanes past n
    kb.resize(TY == F32 || C == 1 ? 0 : VW * D);
    for (; t < n; t += VW) {
      const uint8_t* kt[VW];
      for (int r = 0; r < VW; ++r) kt[r] = kh + std::min<int64_t>(t + r, n - 1) * row;
      // the keys two tiles ahead into L1 and this tile's values into L2: a head's rows are a few KB of a cache that
      // is not in L2 between steps, and the hardware's streams stop at every 4 KB page
      const int64_t ahead = std::min<int64_t>(n, t + 3 * VW);
      for (const uint8_t *a = kh + std::min(t + 2 * VW, ahead) * row, *z = kh + ahead * row; a < z; a += 64)
        prefetch(a);
      for (const uint8_t *a = vh + t * row, *z = vh + std::min<int64_t>(n, t + VW) * row; a < z; a += 64)
        prefetch_l2(a);
      if (TY == F32 || C == 1) {  // (the same values either way: a half converts exactly)
        for (int64_t c = 0; c < C; ++c) key_scores<TY>(kt, q + c * D, D, p.data() + c * np + t);
        continue;
      }
      for (int r = 0; r < VW; ++r) {  // the tile's keys as floats once, for every head of the group
        float* dst = kb.data() + r * D;
        for (int64_t i = 0; i < D; i += VW) vstore(dst + i, wload<TY>(kt[r], i));
        kt[r] = (const uint8_t*)dst;
      }
      for (int64_t c = 0; c < C; ++c) key_scores<F32>(kt, q + c * D, D, p.data() + c * np + t);
    }
  }
#endif
  for (int64_t c = 0; c < C && t < n; ++c) {  // a head size that is not a multiple of VW, or the portable build
    const float* qh = q + c * D;
    float* pc = p.data() + c * np;
    constexpr int KR = 8;
    int64_t k = 0;
    for (; k + KR <= n; k += KR) {
      const uint8_t* kt[KR];
      for (int r = 0; r < KR; ++r) kt[r] = kh + (k + r) * row;
      ftile<TY, KR, 1>(kt, &qh, D, pc + k, 1);
    }
    for (; k < n; ++k) {
      const uint8_t* kt = kh + k * row;
      ftile<TY, 1, 1>(&kt, &qh, D, pc + k, 1);
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    float* pc = p.data() + c * np;
    // scaled, and their maximum: lane-wise, then across the lanes (a maximum is the same in any order). One scalar
    // max chain was a quarter of the head's time 1024 keys deep (4 cycles a key).
    vf vmx = vset1(-INFINITY);
    t = 0;
    for (; t + VW <= n; t += VW) {
      const vf sv = vmul(vload(pc + t), vset1(scale));
      vstore(pc + t, sv);
      vmx = vmax(vmx, sv);
    }
    float mx = vmax_lanes(vmx);
    for (; t < n; ++t) {
      pc[t] *= scale;
      mx = std::max(mx, pc[t]);
    }
    vf vsum_ = vzero();
    t = 0;
    for (; t + VW <= n; t += VW) {
      const vf ev = exp_nonpos(vsub(vload(pc + t), vset1(mx)));
      vstore(pc + t, ev);
      vsum_ = vadd(vsum_, ev);
    }
    float sum = vsum(vsum_);
    for (; t < n; ++t) sum += (pc[t] = std::exp(pc[t] - mx));
    const float inv = 1.f / sum;
    for (t = 0; t < n; ++t) pc[t] *= inv;
  }
  if (values_in_registers<TY>(C, D, vh, n, p.data(), np, out)) return;
  std::fill(out, out + C * D, 0.f);
  vrows.resize(n);  // value rows, several per pass, each read (and converted) once for the C heads (axpy_rows)
  for (t = 0; t < n; ++t) vrows[t] = vh + t * row;
  axpy_rows(TY, vrows.data(), n, p.data(), np, C, out, D, 0, D);
}

// one query head qh [D]: attend_group of one
template <typename KV>
void attend_head(const float* qh, const KV* kh, const KV* vh, int64_t n, int64_t D, float scale, float* oh,
                 std::vector<float>& p, std::vector<const uint8_t*>& vrows) {
  thread_local std::vector<float> kb;
  attend_group(qh, 1, kh, vh, n, D, scale, oh, p, kb, vrows);
}

}  // namespace

template <typename KV>
void attend_decode(const float* qkv, const float* rope, KV* kc, KV* vc, int64_t ctx, int64_t D, int64_t pos,
                   int64_t H, int64_t Hkv, float scale, bool neox, float* out) {
  std::vector<float> q(H * D);
  store_row(qkv, rope, kc, vc, ctx, D, pos, H, Hkv, neox, q.data());
  const int64_t n = pos + 1, group = H / Hkv;
  // heads in parallel only when the context makes them worth a fork
  const int64_t grain = n * D * H < (1 << 16) ? H : 1;
  parallel_for(0, H, grain, [&](int64_t b, int64_t e) {
    std::vector<float> p;
    std::vector<const uint8_t*> vrows;
    for (int64_t h = b; h < e; ++h)
      attend_head(q.data() + h * D, kc + (h / group) * ctx * D, vc + (h / group) * ctx * D, n, D, scale,
                  out + h * D, p, vrows);
  });
}

template <typename KV>
void attend_rows(int64_t T, const float* qkv, int64_t qkv_stride, const float* rope, KV* const* kc, KV* const* vc,
                 int64_t ctx, int64_t D, const int64_t* pos, int64_t H, int64_t Hkv, float scale, bool neox,
                 float* out) {
  // every row's key and value first, in order (row t reads only positions <= pos[t], which rows before it in the
  // same cache wrote), then the rows' kv heads, each with its query heads (attend_heads: attend_decode's bits)
  std::vector<float> q(T * H * D);
  int64_t work = 0;
  for (int64_t t = 0; t < T; ++t) {
    store_row(qkv + t * qkv_stride, rope + pos[t] * D, kc[t], vc[t], ctx, D, pos[t], H, Hkv, neox,
              q.data() + t * H * D);
    work += (pos[t] + 1) * D * H;
  }
  const int64_t group = H / Hkv, items = T * Hkv;
  auto item = [&](int64_t i) {
    const int64_t t = i / Hkv, g = i % Hkv;
    attend_heads<KV>(q.data() + t * H * D, kc[t], vc[t], ctx, D, pos[t], H, Hkv, scale, g * group, (g + 1) * group,
                     out + t * H * D);
  };
  if (work < (1 << 16) || num_threads() == 1) {
    for (int64_t i = 0; i < items; ++i) item(i);
    return;
  }
  // (row, kv head) items claimed one at a time, the last rows first: a prompt's rows attend to ever more positions,
  // and contiguous chunks (at::parallel_for's) gave the last thread ~3/4 of a causal prefill's work
  std::atomic<int64_t> next{0};
  parallel_for(0, num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < items; i = next++) item(items - 1 - i);
  });
}

template <typename KV>
void attend_store(const float* qkv, const float* rope, KV* kc, KV* vc, int64_t ctx, int64_t D, int64_t pos, int64_t H,
                  int64_t Hkv, bool neox, float* q) {
  store_row(qkv, rope, kc, vc, ctx, D, pos, H, Hkv, neox, q);
}

template <typename KV>
void attend_heads(const float* q, const KV* kc, const KV* vc, int64_t ctx, int64_t D, int64_t pos, int64_t H,
                  int64_t Hkv, float scale, int64_t h0, int64_t h1, float* out) {
  thread_local std::vector<float> p, kb;
  thread_local std::vector<const uint8_t*> vrows;
  const int64_t group = H / Hkv;
  const int64_t head_rows = std::min<int64_t>(pos + 1, 2 * VW) * D * (int64_t)sizeof(KV);
  for (int64_t h = h0; h < h1;) {  // the heads of one kv head together (the same bits as one by one)
    const int64_t g = h / group, e = std::min(h1, (g + 1) * group);
    if (e < h1)  // the next kv head's first keys, read while this one's are worked on
      for (int64_t o = 0; o < head_rows; o += 64) prefetch_l2((const uint8_t*)(kc + (g + 1) * ctx * D) + o);
    attend_group(q + h * D, e - h, kc + g * ctx * D, vc + g * ctx * D, pos + 1, D, scale, out + h * D, p, kb, vrows);
    h = e;
  }
}

template void attend_store<float>(const float*, const float*, float*, float*, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, bool, float*);
template void attend_store<uint16_t>(const float*, const float*, uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, bool, float*);
template void attend_heads<float>(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, float, int64_t, int64_t, float*);
template void attend_heads<uint16_t>(const float*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, float, int64_t, int64_t, float*);
template void attend_rows<float>(int64_t, const float*, int64_t, const float*, float* const*, float* const*, int64_t,
                                 int64_t, const int64_t*, int64_t, int64_t, float, bool, float*);
template void attend_rows<uint16_t>(int64_t, const float*, int64_t, const float*, uint16_t* const*, uint16_t* const*,
                                    int64_t, int64_t, const int64_t*, int64_t, int64_t, float, bool, float*);
template void attend_decode<float>(const float*, const float*, float*, float*, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, float, bool, float*);
template void attend_decode<uint16_t>(const float*, const float*, uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                                      int64_t, int64_t, float, bool, float*);

}  // namespace pinfer
