// Dot products of weight rows with a few tokens, axpy over rows, and row dequantisation, for every weight type: the
// drivers that cut any number of rows and tokens into the register tiles of quant.h. Used by qmatmul's streaming path,
// the sparse FFN, the predictor and qembed/qdequant.
//
// Tile shapes (rows x tokens): block types, one row per i32 lane x up to 4 tokens (quant.h's lane tiles): 16 rows on
// AVX-512 with VNNI, 8 on AVX2; float types, from the register files: one token 8 rows side by side (8 accumulators +
// 8 weight vectors), several 4 x 4 on AVX-512 and 4 x 2 on AVX2; the portable build 4 x 1 and 2 x 4. A tile's rows
// are read from memory on its first token tile and from cache for the following ones (16 rows of a 4096-wide Q4_0
// matrix are 36 KB: L1 or L2), so a weight byte crosses DRAM once per call.
// Several rows in flight also make several DRAM streams per core: the sparse FFN's rows are scattered, and one row at
// a time per thread reads them at half the bandwidth (measured on the fp32 kernel: 4 streams 18 GB/s, 8 streams
// 23 GB/s, 16 no better than 8; Q4_0 GEMV, one core: 4 rows 7.5 GB/s, 8 rows 8.9, 12 rows 9.6 with spills, and once
// the next rows are prefetched (quant.h) 8 rows 12.4, 12 rows 11.4).
#include "kernels.h"

namespace pinfer {

namespace {

struct F16Table {
  float v[65536];
  F16Table() {
    for (uint32_t h = 0; h < 65536; ++h) v[h] = f16_to_f32((uint16_t)h);
  }
};
const F16Table table;  // built when the library loads

}  // namespace

const float* const f16_table = table.v;

namespace {

#if defined(PINFER_AVX2)
// block types: the lane tiles (quant.h), 16 rows (AVX-512 + VNNI) or 8 x up to 4 tokens, for one token as for several
constexpr int Q_R1 = QLANES, Q_R = QLANES, Q_C = 4;
#else
constexpr int Q_R1 = 4, Q_R = 2, Q_C = 4;
#endif
#if defined(PINFER_AVX512)
constexpr int F_R1 = 8, F_R = 4, F_C = 4;  // float types
#elif defined(PINFER_AVX2)
constexpr int F_R1 = 8, F_R = 4, F_C = 2;
#else
constexpr int F_R1 = 4, F_R = 2, F_C = 4;
#endif

template <int TY, int R, int C>
inline void tile(const uint8_t* const* rows, const Acts& a, int64_t t0, float* out, int64_t os,
                 const uint8_t* const* nxt) {
  if constexpr (is_block(TY))
    qtile<TY, R, C>(rows, a.q.data() + t0, a.n / QK, out, os, nxt);
  else
    ftile<TY, R, C>(rows, a.f.data() + t0, a.n, out, os, nxt);
}

#if defined(PINFER_AVX2)
// A block type's row group against two token tiles or more (a prompt's chunk): the rows' lane registers made once
// (quant.h lane_pack), then every token tile over them (qtile_packed: the streaming tile's bits)
template <class V, int TY, int CMAX>
void packed_group(const uint8_t* const* rows, const Acts& a, float* out, int64_t os, const uint8_t* const* nxt) {
  const int64_t nb = a.n / QK;
  thread_local std::vector<LanePack<V>> pk;  // an over-aligned type: std::allocator aligns it (C++17)
  if ((int64_t)pk.size() < nb) pk.resize(nb);
  lane_pack<V, TY>(rows, nb, pk.data(), nxt);
  const Q8* xs = a.q.data();
  int64_t t0 = 0;
  for (; t0 + CMAX <= a.T; t0 += CMAX) qtile_packed<V, TY, CMAX>(pk.data(), xs + t0, nb, out + t0 * os, os);
  switch (a.T - t0) {
    case 1: qtile_packed<V, TY, 1>(pk.data(), xs + t0, nb, out + t0 * os, os); break;
    case 2: if constexpr (CMAX > 2) qtile_packed<V, TY, 2>(pk.data(), xs + t0, nb, out + t0 * os, os); break;
    case 3: if constexpr (CMAX > 3) qtile_packed<V, TY, 3>(pk.data(), xs + t0, nb, out + t0 * os, os); break;
    default: break;
  }
}
#endif

// R rows against every token, CMAX tokens per tile (CMAX <= 4); the first token tile also prefetches the next R
// rows (nxt, into L2) in step with its own, so scattered rows start streaming one group early
template <int TY, int R, int CMAX>
void row_group(const uint8_t* const* rows, const Acts& a, float* out, int64_t os, const uint8_t* const* nxt) {
#if defined(PINFER_AVX2)
  if constexpr (is_block(TY)) {
    if (a.T >= 2 * CMAX) {
#if defined(PINFER_AVX512) && defined(__AVX512VNNI__)
      if constexpr (R == 16) return packed_group<L16, TY, CMAX>(rows, a, out, os, nxt);
#endif
      if constexpr (R == 8) return packed_group<L8, TY, CMAX>(rows, a, out, os, nxt);
    }
  }
#endif
  int64_t t0 = 0;
  for (; t0 + CMAX <= a.T; t0 += CMAX) tile<TY, R, CMAX>(rows, a, t0, out + t0 * os, os, t0 == 0 ? nxt : nullptr);
  const uint8_t* const* nx = t0 == 0 ? nxt : nullptr;
  switch (a.T - t0) {
    case 1: tile<TY, R, 1>(rows, a, t0, out + t0 * os, os, nx); break;
    case 2: if constexpr (CMAX > 2) tile<TY, R, 2>(rows, a, t0, out + t0 * os, os, nx); break;
    case 3: if constexpr (CMAX > 3) tile<TY, R, 3>(rows, a, t0, out + t0 * os, os, nx); break;
    default: break;
  }
}

template <int TY, int R, int CMAX>
void rows_by(const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t os, const uint8_t* const* next,
             int64_t n_next) {
  // the R rows after group i, from rows and then from next (the caller's next rows), repeating the last one
  auto after = [&](int64_t i, const uint8_t** nx) {
    for (int r = 0; r < R; ++r) {
      const int64_t j = i + R + r;
      nx[r] = j < n ? rows[j] : (j - n < n_next ? next[j - n] : (n_next ? next[n_next - 1] : rows[n - 1]));
    }
  };
  const uint8_t* nx[R];
  int64_t i = 0;
  for (; i + R <= n; i += R) {
    after(i, nx);
    row_group<TY, R, CMAX>(rows + i, a, out + i, os, nx);
  }
  if (i == n) return;
#if defined(PINFER_AVX2)
  if constexpr (is_block(TY) && R > QLANES_MIN) {  // 8 or fewer left: the narrow lane tile (the same bits per row)
    if (n - i <= QLANES_MIN) {
      rows_by<TY, QLANES_MIN, CMAX>(rows + i, n - i, a, out + i, os, next, n_next);
      return;
    }
  }
#endif
  // the last rows: padded with copies of the last one (read from cache), their results dropped
  const uint8_t* pad[R];
  for (int r = 0; r < R; ++r) pad[r] = rows[std::min<int64_t>(i + r, n - 1)];
  thread_local std::vector<float> tmp;
  tmp.resize(R * a.T);
  after(i, nx);
  row_group<TY, R, CMAX>(pad, a, tmp.data(), R, nx);
  for (int64_t t = 0; t < a.T; ++t)
    for (int64_t r = 0; r < n - i; ++r) out[t * os + i + r] = tmp[t * R + r];
}

template <int TY>
void dot_rows_t(const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t os,
                const uint8_t* const* next, int64_t n_next) {
  if constexpr (is_block(TY)) {
    if (a.T == 1)
      rows_by<TY, Q_R1, 1>(rows, n, a, out, os, next, n_next);
    else
      rows_by<TY, Q_R, Q_C>(rows, n, a, out, os, next, n_next);
  } else {
    if (a.T == 1)
      rows_by<TY, F_R1, 1>(rows, n, a, out, os, next, n_next);
    else
      rows_by<TY, F_R, F_C>(rows, n, a, out, os, next, n_next);
  }
}

template <int TY>
void axpy_rows_t(const uint8_t* const* rows, int64_t n, const float* h, int64_t hs, int64_t T, float* y, int64_t ys,
                 int64_t o0, int64_t o1, const uint8_t* const* next, int64_t n_next, float* mb, int64_t mbs) {
  // each pass prefetches the rows of the following pass (or the caller's next rows) in step with its own
  const uint8_t* nx[AXPY_R];
  auto after = [&](int64_t i) -> const uint8_t* const* {
    if (i + AXPY_R >= n && n_next == 0) return nullptr;
    for (int r = 0; r < AXPY_R; ++r) {
      const int64_t j = i + AXPY_R + r;
      nx[r] = j < n ? rows[j] : n_next > 0 ? next[std::min(j - n, n_next - 1)] : rows[n - 1];
    }
    return nx;
  };
  int64_t i = 0;
  for (; i + AXPY_R <= n; i += AXPY_R) axpy_tile<TY, AXPY_R>(rows + i, h + i, hs, T, y, ys, o0, o1, after(i), mb, mbs);
  const uint8_t* const* tail = n - i > 0 ? after(i) : nullptr;
  switch (n - i) {
    case 1: axpy_tile<TY, 1>(rows + i, h + i, hs, T, y, ys, o0, o1, tail, mb, mbs); break;
    case 2: axpy_tile<TY, 2>(rows + i, h + i, hs, T, y, ys, o0, o1, tail, mb, mbs); break;
    case 3: axpy_tile<TY, 3>(rows + i, h + i, hs, T, y, ys, o0, o1, tail, mb, mbs); break;
    case 4: if constexpr (AXPY_R > 4) axpy_tile<TY, 4>(rows + i, h + i, hs, T, y, ys, o0, o1, tail, mb, mbs); break;
    case 5: if constexpr (AXPY_R > 5) axpy_tile<TY, 5>(rows + i, h + i, hs, T, y, ys, o0, o1, tail, mb, mbs); break;
    case 6: if constexpr (AXPY_R > 6) axpy_tile<TY, 6>(rows + i, h + i, hs, T, y, ys, o0, o1, tail, mb, mbs); break;
    case 7: if constexpr (AXPY_R > 7) axpy_tile<TY, 7>(rows + i, h + i, hs, T, y, ys, o0, o1, tail, mb, mbs); break;
    default: break;
  }
}

template <int TY>
void dequant_rows_t(const Mat& w, const int64_t* ids, int64_t n, float* out) {
  // a few rows per chunk: qembed asks for a handful of token rows, qdequant for all of them
  parallel_for(0, n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, w.cols)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dequant_row<TY>(w.row(ids ? ids[i] : i), w.cols, out + i * w.cols);
  });
}

}  // namespace

#define PINFER_BY_TYPE(type, FN, ...)                 \
  switch (type) {                                     \
    case F32: FN<F32>(__VA_ARGS__); break;            \
    case F16: FN<F16>(__VA_ARGS__); break;            \
    case BF16: FN<BF16>(__VA_ARGS__); break;          \
    case Q4_0: FN<Q4_0>(__VA_ARGS__); break;          \
    case Q4_1: FN<Q4_1>(__VA_ARGS__); break;          \
    case Q8_0: FN<Q8_0>(__VA_ARGS__); break;          \
    default: break;                                   \
  }

void Acts::prepare(const float* x_, int64_t T_, int64_t n_, int64_t ldx_, bool need_q8) {
  if (need_q8) q8.quantize(x_, T_, n_, ldx_);
  attach(x_, T_, n_, ldx_, need_q8 ? &q8 : nullptr);
}

void Acts::attach(const float* x_, int64_t T_, int64_t n_, int64_t ldx_, const Q8Acts* shared) {
  x = x_, T = T_, n = n_, ldx = ldx_;
  f.resize(T);
  for (int64_t t = 0; t < T; ++t) f[t] = x + t * ldx;
  q.clear();
  if (shared)
    for (int64_t t = 0; t < T; ++t) q.push_back(shared->tok(t));
}

void dot_rows(int type, const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t ostride,
              const uint8_t* const* next, int64_t n_next) {
  if (n > 0 && a.T > 0 && (type == Q4_K || type == Q5_K))
    return k45_dot_rows(type, rows, n, a, out, ostride, next, n_next);
  if (n > 0 && a.T > 0 && (type == Q5_0 || type == Q5_1))
    return q5_dot_rows(type, rows, n, a, out, ostride, next, n_next);
  if (n > 0 && a.T > 0 && (type == IQ4_NL || type == IQ4_XS))
    return iq4_dot_rows(type, rows, n, a, out, ostride, next, n_next);
  if (n > 0 && a.T > 0 && type == Q6_K) return q6k_dot_rows(rows, n, a, out, ostride, next, n_next);
  if (n > 0 && a.T > 0) PINFER_BY_TYPE(type, dot_rows_t, rows, n, a, out, ostride, next, n_next)
}

void axpy_rows(int type, const uint8_t* const* rows, int64_t n, const float* h, int64_t hs, int64_t T, float* y,
               int64_t ys, int64_t o0, int64_t o1, const uint8_t* const* next, int64_t n_next, float* mb, int64_t mbs) {
  if (n > 0 && T > 0 && o1 > o0)
    PINFER_BY_TYPE(type, axpy_rows_t, rows, n, h, hs, T, y, ys, o0, o1, next, n_next, mb, mbs)
}

void dequant_rows(const Mat& w, const int64_t* ids, int64_t n, float* out) {
  if (dot_only(w.type)) {
    parallel_for(0, n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, w.cols)), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) row_to_f32(w.type, w.row(ids ? ids[i] : i), w.cols, out + i * w.cols);
    });
    return;
  }
  PINFER_BY_TYPE(w.type, dequant_rows_t, w, ids, n, out)
}

void row_to_f32(int type, const uint8_t* row, int64_t n, float* out) {
  if (type == Q4_K || type == Q5_K) return q45k_to_f32(row, n / 256, type == Q5_K, out);
  if (type == IQ4_NL || type == IQ4_XS) return iq4_to_f32(type, row, n, out);
  if (type == Q5_0 || type == Q5_1) return q5_to_f32(type, row, n, out);
  if (type == Q6_K) return q6k_to_f32(row, n / 256, out);
  PINFER_BY_TYPE(type, dequant_row, row, n, out)
}

}  // namespace pinfer
