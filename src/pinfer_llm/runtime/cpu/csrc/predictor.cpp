// PowerInfer's activation predictor for one token, straight to the indices of the predicted-active neurons:
// scores = fc2 relu(fc1 x), neuron i active iff scores[i] >= threshold. Both layers are GEMVs over the stored rows
// (qmatmul's streaming path; F16 as pi-profile writes them, any type works).
//
// fc2 can also come transposed, fc2_t [r, n_ff] (a converted copy the runtime may keep): the second layer is then an
// axpy over the rows of the hidden units that ReLU keeps, about half of them, so it reads about half of fc2's bytes.
// Each thread takes a run of columns (a multiple of 64 values, so block types stay whole) across all live rows.
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

}  // namespace pinfer
