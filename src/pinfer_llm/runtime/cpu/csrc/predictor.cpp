// PowerInfer's activation predictor for one token, straight to the indices of the predicted-active neurons:
// scores = fc2 relu(fc1 x), neuron i active iff scores[i] >= threshold. Both layers are GEMVs over the stored rows
// (qmatmul's streaming path; F16 as pi-profile writes them, any type works).
//
// fc2 can also come transposed, fc2_t [r, n_ff] (a converted copy the runtime may keep): the second layer is then an
// axpy over the rows of the hidden units that ReLU keeps, about half of them, so it reads about half of fc2's bytes.
// Each thread takes a run of columns (a multiple of 64 values, so block types stay whole) across all live rows.
#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace pinfer {

std::vector<int64_t> predict_active(const float* x, const Mat& fc1, const Mat& fc2, bool fc2_transposed,
                                    float threshold, const int64_t* always, int64_t n_always) {
  const int64_t d = fc1.cols, r = fc1.rows, n_ff = fc2_transposed ? fc2.cols : fc2.rows;
  std::vector<float> hidden(r), scores(n_ff, 0.f);
  qmatmul(x, 1, d, {fc1}, hidden.data(), INT64_MAX);
  for (float& h : hidden) h = h > 0.f ? h : 0.f;
  if (!fc2_transposed) {
    qmatmul(hidden.data(), 1, r, {fc2}, scores.data(), INT64_MAX);
  } else {
    std::vector<const uint8_t*> rows;
    std::vector<float> h;
    for (int64_t j = 0; j < r; ++j)
      if (hidden[j] > 0.f) {
        rows.push_back(fc2.row(j));
        h.push_back(hidden[j]);
      }
    const int64_t nt = num_threads();
    const int64_t cols = std::max<int64_t>(((n_ff + nt - 1) / nt + 63) / 64 * 64, 256);
    parallel_for(0, (n_ff + 63) / 64, cols / 64, [&](int64_t b, int64_t e) {
      axpy_rows(fc2.type, rows.data(), (int64_t)rows.size(), h.data(), 0, 1, scores.data(), 0, b * 64,
                std::min(e * 64, n_ff));
    });
  }
  for (int64_t q = 0; q < n_always; ++q) scores[always[q]] = INFINITY;
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n_ff; ++i)
    if (scores[i] >= threshold) out.push_back(i);
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
