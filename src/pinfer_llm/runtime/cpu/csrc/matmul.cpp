// qmatmul: x [T, K] times one or more stored weight matrices, read in place. Two regimes:
//
// Decode (T < gemm_min_t): memory-bound GEMV. Each thread takes one contiguous run of output rows (a DRAM stream the
// hardware prefetchers follow) and walks it with the register tiles of dot.cpp: for one token 8 rows side by side
// (AVX-512), for several a 4-row x 4-token tile whose rows stay in L1 across the token tiles, so every weight byte
// crosses DRAM once per call. Block types use q8 activations (quant.h says why), quantised once per call.
//
// Prefill (T >= gemm_min_t): compute-bound. Per thread, tiles of up to GEMM_TILE rows are dequantised to fp32 into a
// per-thread buffer and multiplied by torch's single-threaded sgemm (MKL): the whole matrix is never dequantised, and
// the result is exact in fp32 (no q8 rounding of the activations). Measured on this machine (Xeon, AVX-512 + VNNI,
// CPU time): MKL sgemm reaches ~130 GFLOP/s per core at T = 512 for every type (the dequantisation is ~1% of it),
// while the int8 tiles reach ~80 (Q4_0, Q8_0) and the F16 tiles ~95 at any T; on the AVX2 build the tiles reach ~60.
// The crossover is GEMM_MIN_T (kernels.h).
#include "kernels.h"

namespace pinfer {

namespace {

// Rows per dequantised tile, at most: each sgemm call packs x again, so tiles should be large; 256 rows of 4096 are a
// 4 MB buffer per thread. Measured (4096 x 11008, T = 512, 2 threads): tiles of 64 rows 200 GFLOP/s, 128 234, 256
// 245-259, 512 256, torch's mm on a dequantised copy 250-275. Small matrices get smaller tiles, two per thread at
// least.
constexpr int64_t GEMM_TILE = 256;

// Rows per parallel chunk: an even share per thread, in whole 8-row groups, and at least 64 KB of weights (below
// that a fork/join of the thread pool costs more than the stream).
int64_t row_grain(int64_t N, int64_t bytes_per_row) {
  const int64_t nt = num_threads();
  const int64_t share = ((N + nt - 1) / nt + 7) / 8 * 8;
  return std::max(share, (int64_t)(65536 / std::max<int64_t>(1, bytes_per_row)));
}

void gemm_tiles(const float* x, int64_t T, int64_t K, const std::vector<Mat>& ws, const std::vector<int64_t>& off,
                float* y, int64_t N) {
  struct Tile { int64_t m, r0, nr; };
  const int64_t nt = num_threads();
  const int64_t tile = std::min<int64_t>(GEMM_TILE, std::max<int64_t>(16, (N + 2 * nt - 1) / (2 * nt) + 15) / 16 * 16);
  std::vector<Tile> tiles;
  for (size_t m = 0; m < ws.size(); ++m)
    for (int64_t r0 = 0; r0 < ws[m].rows; r0 += tile)
      tiles.push_back({(int64_t)m, r0, std::min(tile, ws[m].rows - r0)});
  const int64_t n = (int64_t)tiles.size();
  parallel_for(0, n, (n + nt - 1) / nt, [&](int64_t b, int64_t e) {
    thread_local std::vector<float> buf;
    buf.resize(tile * K);
    for (int64_t i = b; i < e; ++i) {
      const Tile& t = tiles[i];
      const Mat& w = ws[t.m];
      for (int64_t r = 0; r < t.nr; ++r) row_to_f32(w.type, w.row(t.r0 + r), K, buf.data() + r * K);
      sgemm_nt(T, t.nr, K, x, K, buf.data(), K, y + off[t.m] + t.r0, N);
    }
  });
}

}  // namespace

void qmatmul(const float* x, int64_t T, int64_t K, const std::vector<Mat>& ws, float* y, int64_t gemm_min_t) {
  std::vector<int64_t> off(ws.size() + 1, 0);
  int64_t bytes = 0;
  bool need_q8 = false;
  for (size_t m = 0; m < ws.size(); ++m) {
    off[m + 1] = off[m] + ws[m].rows;
    bytes += ws[m].rows * row_bytes(ws[m].type, K);
    need_q8 |= needs_q8(ws[m].type);
  }
  const int64_t N = off.back();
  if (N == 0 || T == 0) return;
  if (T >= gemm_min_t) return gemm_tiles(x, T, K, ws, off, y, N);

  Acts a;
  a.prepare(x, T, K, K, need_q8);
  parallel_for(0, N, row_grain(N, bytes / N), [&](int64_t b, int64_t e) {
    thread_local std::vector<const uint8_t*> rows;
    for (size_t m = 0; m < ws.size(); ++m) {
      const int64_t lo = std::max(b, off[m]), hi = std::min(e, off[m + 1]);
      if (lo >= hi) continue;
      rows.resize(hi - lo);
      for (int64_t r = lo; r < hi; ++r) rows[r - lo] = ws[m].row(r - off[m]);
      dot_rows(ws[m].type, rows.data(), hi - lo, a, y + lo, N);
    }
  });
}

}  // namespace pinfer
