// PowerInfer's activation predictor for one token, straight to the indices of the predicted-active neurons:
// scores = fc2 relu(fc1 x), neuron i active iff scores[i] >= threshold. Both layers are GEMVs over the stored rows
// (the streaming tiles of dot.cpp, as qmatmul reads; F16 as pi-profile writes them, any type works).
//
// fc2 can also come transposed, fc2_t [r, n_ff] (a converted copy the runtime may keep): the second layer is then an
// axpy over the rows of the hidden units that ReLU keeps, about half of them, so it reads about half of fc2's bytes.
// Each thread takes a run of columns (a multiple of 64 values, so block types stay whole) across all live rows.
// The two layers are predict_hidden and predict_range, which decode_team (step.cpp) shares out among its own threads.
#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace pinfer {

std::vector<int64_t> predict_active(const float* x, const Mat& fc1, const Mat& fc2, bool fc2_transposed,
                                    float threshold, const int64_t* always, int64_t n_always) {
  const int64_t r = fc1.rows, n_ff = fc2_transposed ? fc2.cols : fc2.rows;
  std::vector<float> hidden(r);
  // fc1's rows in runs of at least 64 KB (below that a fork costs more than the stream), whole 8-row groups
  const int64_t grain = std::max<int64_t>(8, 65536 / std::max<int64_t>(1, row_bytes(fc1.type, fc1.cols)) / 8 * 8);
  parallel_for(0, r, grain, [&](int64_t b, int64_t e) { predict_hidden(x, 1, 0, fc1, b, e, hidden.data(), 0); });
  // the neurons in runs of columns, a multiple of 64 values each (block types stay whole), one run per thread
  const int64_t nt = num_threads();
  const int64_t cols = std::max<int64_t>(((n_ff + nt - 1) / nt + 63) / 64 * 64, 256);
  const int64_t runs = (n_ff + cols - 1) / cols;
  std::vector<std::vector<int64_t>> part(runs);
  parallel_for(0, runs, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c)
      predict_range(hidden.data(), 1, 0, fc1, fc2, fc2_transposed, threshold, always, n_always, c * cols,
                    std::min((c + 1) * cols, n_ff), &part[c]);
  });
  std::vector<int64_t> out;
  for (const auto& p : part) out.insert(out.end(), p.begin(), p.end());
  return out;
}

void predict_hidden(const float* x, int64_t T, int64_t xs, const Mat& fc1, int64_t b, int64_t e, float* hidden,
                    int64_t hs) {
  if (e <= b || T <= 0) return;
  thread_local Acts a;
  thread_local std::vector<const uint8_t*> rows;
  a.prepare(x, T, fc1.cols, xs, needs_q8(fc1.type));
  rows.resize(e - b);
  for (int64_t i = b; i < e; ++i) rows[i - b] = fc1.row(i);
  dot_rows(fc1.type, rows.data(), e - b, a, hidden + b, hs);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = b; i < e; ++i) hidden[t * hs + i] = hidden[t * hs + i] > 0.f ? hidden[t * hs + i] : 0.f;
}

void predict_range(const float* hidden, int64_t T, int64_t hs, const Mat& fc1, const Mat& fc2, bool fc2_transposed,
                   float threshold, const int64_t* always, int64_t n_always, int64_t c0, int64_t c1,
                   std::vector<int64_t>* out) {
  for (int64_t t = 0; t < T; ++t) out[t].clear();
  if (c1 <= c0 || T <= 0) return;
  const int64_t r = fc1.rows, n_ff = fc2_transposed ? fc2.cols : fc2.rows;
  thread_local std::vector<float> scores;  // [T, n_ff]
  scores.resize(T * n_ff);
  for (int64_t t = 0; t < T; ++t) std::fill(scores.begin() + t * n_ff + c0, scores.begin() + t * n_ff + c1, 0.f);
  thread_local std::vector<const uint8_t*> rows;
  if (!fc2_transposed) {  // all tokens in one pass over fc2's rows
    thread_local Acts a;
    a.prepare(hidden, T, r, hs, needs_q8(fc2.type));
    rows.resize(c1 - c0);
    for (int64_t i = c0; i < c1; ++i) rows[i - c0] = fc2.row(i);
    dot_rows(fc2.type, rows.data(), c1 - c0, a, scores.data() + c0, n_ff);
  } else {  // token by token, each over the rows of its own live hidden units (about half of them): one pass over
    // the union for all tokens (about 90% of the rows at 4 tokens, each token's h 0 where its unit is not live) read
    // fewer bytes but made 1.8x the multiply-adds, and measured slower (planted 1024 x 4096, 4 rows, Zen 4)
    thread_local std::vector<float> h;
    for (int64_t t = 0; t < T; ++t) {
      const float* ht = hidden + t * hs;
      rows.clear(), h.clear();
      for (int64_t j = 0; j < r; ++j)
        if (ht[j] > 0.f) {
          rows.push_back(fc2.row(j));
          h.push_back(ht[j]);
        }
      axpy_rows(fc2.type, rows.data(), (int64_t)rows.size(), h.data(), 0, 1, scores.data() + t * n_ff, 0, c0, c1);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    float* st = scores.data() + t * n_ff;
    for (int64_t q = 0; q < n_always; ++q)
      if (always[q] >= c0 && always[q] < c1) st[always[q]] = INFINITY;
    for (int64_t i = c0; i < c1; ++i)
      if (st[i] >= threshold) out[t].push_back(i);
  }
}

}  // namespace pinfer
