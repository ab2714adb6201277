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
  parallel_for(0, r, grain, [&](int64_t b, int64_t e) { predict_hidden(x, fc1, b, e, hidden.data()); });
  // the neurons in runs of columns, a multiple of 64 values each (block types stay whole), one run per thread
  const int64_t nt = num_threads();
  const int64_t cols = std::max<int64_t>(((n_ff + nt - 1) / nt + 63) / 64 * 64, 256);
  const int64_t runs = (n_ff + cols - 1) / cols;
  std::vector<std::vector<int64_t>> part(runs);
  parallel_for(0, runs, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c)
      predict_range(hidden.data(), fc1, fc2, fc2_transposed, threshold, always, n_always, c * cols,
                    std::min((c + 1) * cols, n_ff), part[c]);
  });
  std::vector<int64_t> out;
  for (const auto& p : part) out.insert(out.end(), p.begin(), p.end());
  return out;
}

void predict_hidden(const float* x, const Mat& fc1, int64_t b, int64_t e, float* hidden) {
  if (e <= b) return;
  thread_local Acts a;
  thread_local std::vector<const uint8_t*> rows;
  a.prepare(x, 1, fc1.cols, fc1.cols, is_block(fc1.type));
  rows.resize(e - b);
  for (int64_t i = b; i < e; ++i) rows[i - b] = fc1.row(i);
  dot_rows(fc1.type, rows.data(), e - b, a, hidden + b, 1);
  for (int64_t i = b; i < e; ++i) hidden[i] = hidden[i] > 0.f ? hidden[i] : 0.f;
}

void predict_range(const float* hidden, const Mat& fc1, const Mat& fc2, bool fc2_transposed, float threshold,
                   const int64_t* always, int64_t n_always, int64_t c0, int64_t c1, std::vector<int64_t>& out) {
  out.clear();
  if (c1 <= c0) return;
  const int64_t r = fc1.rows, n_ff = fc2_transposed ? fc2.cols : fc2.rows;
  thread_local std::vector<float> scores;
  scores.resize(n_ff);
  std::fill(scores.begin() + c0, scores.begin() + c1, 0.f);
  if (!fc2_transposed) {
    thread_local Acts a;
    thread_local std::vector<const uint8_t*> rows;
    a.prepare(hidden, 1, r, r, is_block(fc2.type));
    rows.resize(c1 - c0);
    for (int64_t i = c0; i < c1; ++i) rows[i - c0] = fc2.row(i);
    dot_rows(fc2.type, rows.data(), c1 - c0, a, scores.data() + c0, 1);
  } else {
    thread_local std::vector<const uint8_t*> rows;
    thread_local std::vector<float> h;
    rows.clear(), h.clear();
    for (int64_t j = 0; j < r; ++j)
      if (hidden[j] > 0.f) {
        rows.push_back(fc2.row(j));
        h.push_back(hidden[j]);
      }
    axpy_rows(fc2.type, rows.data(), (int64_t)rows.size(), h.data(), 0, 1, scores.data(), 0, c0, c1);
  }
  for (int64_t q = 0; q < n_always; ++q)
    if (always[q] >= c0 && always[q] < c1) scores[always[q]] = INFINITY;
  for (int64_t i = c0; i < c1; ++i)
    if (scores[i] >= threshold) out.push_back(i);
}

}  // namespace pinfer
