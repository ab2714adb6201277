// The kernels' only contact with torch (kernels.h): its thread pool and its GEMM. Everything else is plain C++, so
// the kernel files compile without torch's headers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <omp.h>

#include "kernels.h"

namespace pinfer {

int num_threads() { return at::get_num_threads(); }
int thread_num() { return at::get_thread_num(); }

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  at::parallel_for(begin, end, grain, f);
}

void run_team(const std::function<void(int, int)>& f) {
  const int nt = at::get_num_threads();
  if (nt <= 1 || at::in_parallel_region()) return f(0, 1);
#pragma omp parallel num_threads(nt)
  f(omp_get_thread_num(), omp_get_num_threads());
}

void sgemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
              int64_t ldc) {
  const auto opt = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor a = at::from_blob(const_cast<float*>(A), {M, K}, {lda, 1}, opt);
  const at::Tensor b = at::from_blob(const_cast<float*>(B), {N, K}, {ldb, 1}, opt);
  at::Tensor c = at::from_blob(C, {M, N}, {ldc, 1}, opt);
  at::mm_out(c, a, b.t());  // BLAS writes C in place: row stride ldc is a valid leading dimension
}

}  // namespace pinfer
