// pinfer's CPU kernels, loaded as torch.ops.pinfer.* and run on torch's own thread pool (at::parallel_for, the same
// OpenMP runtime), built by runtime/cpu_kernels.py with the host compiler (-O3 -march=native -fopenmp):
//   ffn_sparse_rows  the FFN of a few tokens on an index set of neurons, each selected row read once, in place
//   predict_active   PowerInfer's predictor for one token, straight to the active neurons' indices
//   rms_norm, attend_decode   the small ops of a decode step, one call each instead of a dozen torch dispatches
//
// FFN layout (runtime/sparse_ops.py, pack_ffn): gate_up [n_ff, 2, d] (neuron i's gate row, then its up row) and
// down_t [n_ff, d] (row i = neuron i's output column). One index list addresses all three matrices.
//
// Why kernels of our own: torch's row-gather kernels (sampled_addmm, embedding_bag) read one row at a time per
// thread and reach 12-16 GB/s on this access pattern against 21-26 GB/s for a dense GEMV (benchmarks/sparse_ops.py).
// A DRAM stream needs several rows in flight per core: here each thread walks NB neurons at once, so NB rows stream
// side by side, which the hardware prefetchers follow like a dense GEMV's rows (measured: 23-25 GB/s).
//
// Exactness: for every neuron of idx the result equals the dense FFN with all other neurons zeroed, up to float
// summation order. Skipping a row whose activation is exactly zero (ReLU gate <= 0, or masked) changes nothing.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));  // GCC vector type: AVX-512 zmm, or lowered to 2x AVX2 / 4x SSE

inline v16 load(const float* p) { v16 v; __builtin_memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int vi16 __attribute__((vector_size(64)));
inline float hsum(v16 v) {  // a shuffle tree: 16 scalar adds cost as much as a short dot product
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// e^x for 16 values x <= 0 (softmax after subtracting the max): x = n ln2 + r, |r| <= ln2/2 + eps, e^r by its
// degree-6 Taylor polynomial (relative error < 2e-7), 2^n by building the float's exponent bits.
inline v16 exp_nonpos(v16 x) {
  x = x < -87.f ? v16{} - 87.f : x;  // e^-87 ~ 1.6e-38, the smallest normal float's neighbourhood
  const vi16 n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi16);  // truncation toward 0 of a value <= 0
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;  // ln2 in two parts
  v16 p = v16{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi16 bits = (n + 127) << 23;
  v16 scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Rows streamed side by side per thread: 8 (gate rows of 8 neurons, then up rows of 8, then down rows of 8).
// Measured (Llama-7B layer, 2 threads, 10% active): 4 streams 18 GB/s, 8 streams 23 GB/s, 16 no better than 8
// (more streams than the hardware prefetchers track).
constexpr int NB = 8;

enum Act : int64_t { SILU = 0, RELU = 1, DRELU = 2 };

inline float activate(int64_t act, float g, float u) {
  switch (act) {
    case RELU: return g > 0.f ? g * u : 0.f;
    case DRELU: return (g > 0.f && u > 0.f) ? g * u : 0.f;
    default: return g / (1.f + std::exp(-g)) * u;
  }
}

// out[r] = x . rows[r] for N rows of length d
template <int N>
inline void dots(const float* x, const float* const* rows, int64_t d, float* out) {
  v16 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = v16{};
  int64_t o = 0;
  for (; o + 16 <= d; o += 16) {
    const v16 xv = load(x + o);
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) acc[r] += xv * load(rows[r] + o);
  }
  for (int r = 0; r < N; ++r) {
    float s = hsum(acc[r]);
    for (int64_t t = o; t < d; ++t) s += x[t] * rows[r][t];
    out[r] = s;
  }
}

// y += sum_r h[r] * rows[r] for N rows of length d
template <int N>
inline void axpys(float* y, const float* h, const float* const* rows, int64_t d) {
  int64_t o = 0;
  for (; o + 16 <= d; o += 16) {
    v16 s = load(y + o);
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) s += h[r] * load(rows[r] + o);
    store(y + o, s);
  }
  for (; o < d; ++o)
    for (int r = 0; r < N; ++r) y[o] += h[r] * rows[r][o];
}

template <template <int> class F, typename... A>
inline void dispatch(int n, A... args) {  // F<n>::run(args...) for a runtime n in 1..NB
  switch (n) {
    case 8: F<8>::run(args...); break;
    case 7: F<7>::run(args...); break;
    case 6: F<6>::run(args...); break;
    case 5: F<5>::run(args...); break;
    case 4: F<4>::run(args...); break;
    case 3: F<3>::run(args...); break;
    case 2: F<2>::run(args...); break;
    case 1: F<1>::run(args...); break;
    default: break;
  }
}
template <int N>
struct Dots {
  static void run(const float* x, const float* const* r, int64_t d, float* o) { dots<N>(x, r, d, o); }
};
template <int N>
struct Axpys {
  static void run(float* y, const float* h, const float* const* r, int64_t d) { axpys<N>(y, h, r, d); }
};

// One thread's walk over its share of the index list. Two stages per group of NB neurons:
// 1. gate rows: g = x . gate_i for every token. With ReLU and dReLU a neuron whose gate is <= 0 for every token (or
//    that every token masks out) has activation exactly 0: its up and down rows are never read. Predicted index sets
//    hold false positives (recall-0.99 predictors on the planted 1.1B model predict 1.7x the true active set): for them
//    this reads a third of the bytes.
// 2. the neurons that remain, NB at a time: up rows, activation, then an axpy over the down rows of the neurons whose
//    activation is not zero.
struct Walk {
  const float* x; int64_t T, d; const float* gu; const float* dt; const int64_t* ids;
  const bool* mask; int64_t mask_stride; int64_t act; float* acc;  // acc: this thread's [T, d] partial sums
  std::vector<float> g, u;  // [T, NB] gate / up values of the pending neurons
  int64_t pend[NB]; int n_pend = 0;
  int64_t nonzero = 0;  // (token, neuron) pairs whose activation is not zero

  bool on(int64_t t, int64_t j) const { return mask == nullptr || mask[t * mask_stride + j]; }

  void flush() {
    if (n_pend == 0) return;
    const float* rows[NB];
    for (int r = 0; r < n_pend; ++r) rows[r] = gu + (ids[pend[r]] * 2 + 1) * d;  // up rows
    for (int64_t t = 0; t < T; ++t) dispatch<Dots>(n_pend, x + t * d, (const float* const*)rows, d, &u[t * NB]);
    for (int64_t t = 0; t < T; ++t) {
      float h[NB]; const float* down[NB]; int n = 0;
      for (int r = 0; r < n_pend; ++r) {
        const float a = on(t, pend[r]) ? activate(act, g[t * NB + r], u[t * NB + r]) : 0.f;
        if (a != 0.f) { h[n] = a; down[n++] = dt + ids[pend[r]] * d; }
      }
      nonzero += n;
      dispatch<Axpys>(n, acc + t * d, (const float*)h, (const float* const*)down, d);
    }
    n_pend = 0;
  }

  void run(int64_t b, int64_t e) {
    g.assign(T * NB, 0.f); u.assign(T * NB, 0.f);
    std::vector<float> gb(T * NB);
    for (int64_t j0 = b; j0 < e; j0 += NB) {
      const int n = (int)std::min<int64_t>(NB, e - j0);
      const float* rows[NB];
      for (int r = 0; r < n; ++r) rows[r] = gu + ids[j0 + r] * 2 * d;  // gate rows
      for (int64_t t = 0; t < T; ++t) dispatch<Dots>(n, x + t * d, (const float* const*)rows, d, &gb[t * NB]);
      for (int r = 0; r < n; ++r) {
        bool live = false;
        for (int64_t t = 0; t < T; ++t) live |= on(t, j0 + r) && (act == SILU || gb[t * NB + r] > 0.f);
        if (!live) continue;
        for (int64_t t = 0; t < T; ++t) g[t * NB + n_pend] = gb[t * NB + r];
        pend[n_pend++] = j0 + r;
        if (n_pend == NB) flush();
      }
    }
    flush();
  }
};

// y [T, d] = sum over j of act(x . gate[idx_j], x . up[idx_j]) * down_t[idx_j] (times row_mask[t, j] if given), and
// the number of (token, neuron) pairs whose activation was not zero: for ReLU/dReLU over every neuron, the exact
// active count (pi-run --oracle-masks reports it)
std::tuple<at::Tensor, int64_t> ffn_sparse_rows(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down_t,
                           const at::Tensor& idx, const std::optional<at::Tensor>& row_mask, int64_t act) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [T, d]");
  const int64_t T = x.size(0), d = x.size(1), n_ff = gate_up.size(0), k = idx.numel();
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) == 2 && gate_up.size(2) == d &&
                  gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous(),
              "gate_up: contiguous float32 [n_ff, 2, d]");
  TORCH_CHECK(down_t.dim() == 2 && down_t.size(0) == n_ff && down_t.size(1) == d &&
                  down_t.scalar_type() == at::kFloat && down_t.is_contiguous(),
              "down_t: contiguous float32 [n_ff, d]");
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong && idx.is_contiguous(), "idx: contiguous int64 [k]");
  TORCH_CHECK(act >= SILU && act <= DRELU, "act: 0 (silu), 1 (relu) or 2 (drelu)");
  const bool* mask = nullptr;
  if (row_mask.has_value()) {
    TORCH_CHECK(row_mask->scalar_type() == at::kBool && row_mask->dim() == 2 && row_mask->size(0) == T &&
                    row_mask->size(1) == k && row_mask->stride(1) == 1,
                "row_mask: bool [T, k] with unit column stride");
    mask = row_mask->data_ptr<bool>();
  }
  const int64_t mask_stride = mask ? row_mask->stride(0) : 0;
  const int64_t* ids = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j)  // an index out of range would read outside the weights
    TORCH_CHECK(ids[j] >= 0 && ids[j] < n_ff, "neuron index ", ids[j], " out of range [0, ", n_ff, ")");

  const int nt = at::get_num_threads();
  at::Tensor acc = at::zeros({nt, T, d}, x.options());  // one partial sum per thread, added at the end
  float* accp = acc.data_ptr<float>();
  // One contiguous run of the index list per thread; tiny index sets stay on one thread (a fork costs more).
  const int64_t grain = std::max<int64_t>((k + nt - 1) / nt, 4 * NB);
  std::vector<int64_t> nonzero(nt, 0);
  at::parallel_for(0, k, grain, [&](int64_t b, int64_t e) {
    const int tid = at::get_thread_num();
    Walk w{x.data_ptr<float>(), T, d, gate_up.data_ptr<float>(), down_t.data_ptr<float>(), ids, mask, mask_stride,
           act, accp + tid * T * d};
    w.run(b, e);
    nonzero[tid] += w.nonzero;
  });
  at::Tensor y = acc[0].clone();
  float* yp = y.data_ptr<float>();
  for (int t = 1; t < nt; ++t) {
    const float* p = accp + t * T * d;
    for (int64_t i = 0; i < T * d; ++i) yp[i] += p[i];
  }
  int64_t total = 0;
  for (int64_t c : nonzero) total += c;
  return {y, total};
}

// PowerInfer's predictor for one token, fused: the indices (ascending) of the neurons i with
// (fc2 relu(fc1 x))[i] >= threshold, plus every index in `always`. fc2 comes transposed, fc2_t [r, n_ff], so that the
// second layer is an axpy over the rows of the hidden units that ReLU left nonzero (about half of them): their rows
// are the only ones read.
at::Tensor predict_active(const at::Tensor& x, const at::Tensor& fc1, const at::Tensor& fc2_t, double threshold,
                          const std::optional<at::Tensor>& always) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [d] or [1, d]");
  TORCH_CHECK(fc1.dim() == 2 && fc1.scalar_type() == at::kFloat && fc1.is_contiguous() && fc1.size(1) == x.numel(),
              "fc1: contiguous float32 [r, d]");
  TORCH_CHECK(fc2_t.dim() == 2 && fc2_t.scalar_type() == at::kFloat && fc2_t.is_contiguous() &&
                  fc2_t.size(0) == fc1.size(0),
              "fc2_t: contiguous float32 [r, n_ff]");
  const int64_t d = fc1.size(1), r = fc1.size(0), n_ff = fc2_t.size(1);
  const float* xp = x.data_ptr<float>();
  const float* w1 = fc1.data_ptr<float>();
  const float* w2 = fc2_t.data_ptr<float>();
  const int nt = at::get_num_threads();

  std::vector<float> hidden(r);
  at::parallel_for(0, r, std::max<int64_t>((r + nt - 1) / nt, 2 * NB), [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; j += NB) {
      const int n = (int)std::min<int64_t>(NB, e - j);
      const float* rows[NB];
      for (int q = 0; q < n; ++q) rows[q] = w1 + (j + q) * d;
      dispatch<Dots>(n, xp, (const float* const*)rows, d, hidden.data() + j);
    }
  });
  std::vector<int64_t> live;  // hidden units that ReLU keeps
  for (int64_t j = 0; j < r; ++j)
    if (hidden[j] > 0.f) live.push_back(j);

  std::vector<float> scores(n_ff, 0.f);
  const int64_t cols = (n_ff + nt - 1) / nt;
  at::parallel_for(0, n_ff, std::max<int64_t>((cols + 15) / 16 * 16, 256), [&](int64_t c0, int64_t c1) {
    for (size_t q0 = 0; q0 < live.size(); q0 += NB) {  // each thread: its columns of NB rows at a time
      const int n = (int)std::min<size_t>(NB, live.size() - q0);
      float h[NB];
      const float* rows[NB];
      for (int q = 0; q < n; ++q) {
        h[q] = hidden[live[q0 + q]];
        rows[q] = w2 + live[q0 + q] * n_ff + c0;
      }
      dispatch<Axpys>(n, scores.data() + c0, (const float*)h, (const float* const*)rows, c1 - c0);
    }
  });
  if (always.has_value()) {
    TORCH_CHECK(always->scalar_type() == at::kLong && always->is_contiguous(), "always: contiguous int64");
    const int64_t* a = always->data_ptr<int64_t>();
    for (int64_t q = 0; q < always->numel(); ++q) {
      TORCH_CHECK(a[q] >= 0 && a[q] < n_ff, "always: index ", a[q], " out of range [0, ", n_ff, ")");
      scores[a[q]] = INFINITY;
    }
  }
  const float thr = (float)threshold;
  int64_t count = 0;
  for (int64_t i = 0; i < n_ff; ++i) count += scores[i] >= thr;
  at::Tensor out = at::empty({count}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n_ff; ++i)
    if (scores[i] >= thr) *op++ = i;
  return out;
}

// --- the small ops of a decode step -------------------------------------------------------------------------------
// One token's RMSNorm and attention are microseconds of arithmetic, but through torch they are a dozen dispatches,
// each waking the thread pool with cold caches after a weight stream (measured in situ on the planted 1.1B model:
// 45 F.rms_norm calls 2.5-4 ms per token, SDPA's decode path 2.2-3.6 ms, RoPE 0.7-1.2 ms). Here each is one call.

// y = x / sqrt(mean(x^2) + eps) * w, row by row (x [T, d]); one thread unless there are many rows
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [T, d]");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == x.size(1),
              "w: contiguous float32 [d]");
  const int64_t T = x.size(0), d = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* xr = xp + t * d;
      float* yr = yp + t * d;
      v16 acc = v16{};
      int64_t o = 0;
      for (; o + 16 <= d; o += 16) { const v16 v = load(xr + o); acc += v * v; }
      float ss = hsum(acc);
      for (; o < d; ++o) ss += xr[o] * xr[o];
      const float scale = 1.f / std::sqrt(ss / (float)d + (float)eps);
      for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * scale * wp[i];
    }
  });
  return y;
}

// One token's attention at position pos, GQA included: rotate q and k (RoPE, adjacent pairs (2i, 2i+1) as in GGUF's
// Q/K layout) by rope [D/2, 2] = (cos, sin), store k and v into the layer's cache rows pos, then for each query head
// h (kv head h / (H / Hkv)): softmax(q . k_0..pos * scale) . v_0..pos. qkv [1, (H + 2 Hkv) D] is the fused projection's
// output; k_cache, v_cache [Hkv, max_ctx, D]. Returns [1, H D].
at::Tensor attend_decode(const at::Tensor& qkv, const at::Tensor& rope, at::Tensor k_cache, at::Tensor v_cache,
                         int64_t pos, int64_t n_head, int64_t n_head_kv, double scale) {
  const int64_t H = n_head, Hkv = n_head_kv;
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0, "n_head must be a multiple of n_head_kv");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(0) == Hkv && k_cache.scalar_type() == at::kFloat &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "k_cache, v_cache: contiguous float32 [n_head_kv, max_ctx, head_dim]");
  const int64_t ctx = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(pos >= 0 && pos < ctx, "position ", pos, " outside the cache [0, ", ctx, ")");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.numel() == (H + 2 * Hkv) * D && qkv.stride(-1) == 1 &&
                  (qkv.dim() == 1 || qkv.size(0) == 1),
              "qkv: float32 [1, (n_head + 2 n_head_kv) head_dim]");
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.is_contiguous() && rope.numel() == D,
              "rope: contiguous float32 [head_dim / 2, 2]");
  const float* in = qkv.data_ptr<float>();
  const float* cs = rope.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  std::vector<float> q(H * D);
  auto rotate = [&](const float* src, float* dst) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const float a = src[2 * i], b = src[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
      dst[2 * i] = a * c - b * s;
      dst[2 * i + 1] = a * s + b * c;
    }
  };
  for (int64_t h = 0; h < H; ++h) rotate(in + h * D, q.data() + h * D);
  for (int64_t g = 0; g < Hkv; ++g) {
    rotate(in + (H + g) * D, kc + (g * ctx + pos) * D);
    std::copy(in + (H + Hkv + g) * D, in + (H + Hkv + g + 1) * D, vc + (g * ctx + pos) * D);
  }
  at::Tensor out = at::empty({1, H * D}, qkv.options());
  float* op = out.data_ptr<float>();
  const int64_t n = pos + 1, group = H / Hkv;
  // heads in parallel only when the context makes them worth a fork
  const int64_t grain = n * D * H < (1 << 16) ? H : 1;
  at::parallel_for(0, H, grain, [&](int64_t b, int64_t e) {
    std::vector<float> p(n);
    for (int64_t h = b; h < e; ++h) {
      const float* qh = q.data() + h * D;
      const float* kh = kc + (h / group) * ctx * D;
      const float* vh = vc + (h / group) * ctx * D;
      float mx = -INFINITY;
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = kh + t * D;
        float s;
        dots<1>(qh, &kt, D, &s);
        p[t] = s * (float)scale;
        mx = std::max(mx, p[t]);
      }
      v16 vsum = v16{};
      int64_t t = 0;
      for (; t + 16 <= n; t += 16) {
        const v16 e = exp_nonpos(load(p.data() + t) - mx);
        store(p.data() + t, e);
        vsum += e;
      }
      float sum = hsum(vsum);
      for (; t < n; ++t) sum += (p[t] = std::exp(p[t] - mx));
      float* oh = op + h * D;
      std::fill(oh, oh + D, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const float wt = p[t] / sum;
        const float* vt = vh + t * D;
        axpys<1>(oh, &wt, &vt, D);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pinfer, m) {
  m.def("ffn_sparse_rows(Tensor x, Tensor gate_up, Tensor down_t, Tensor idx, Tensor? row_mask, int act) -> "
        "(Tensor, int)",
        &ffn_sparse_rows);
  m.def("predict_active(Tensor x, Tensor fc1, Tensor fc2_t, float threshold, Tensor? always) -> Tensor",
        &predict_active);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("attend_decode(Tensor qkv, Tensor rope, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, int n_head, "
        "int n_head_kv, float scale) -> Tensor",
        &attend_decode);
}
