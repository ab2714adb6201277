// The FFN of a few tokens over an index set of neurons, each selected row read once, in place, in any stored type.
//
// Layout (as stored): gate [n_ff, d] and up [n_ff, d] neuron-major, down_t [n_ff, d] (row i = neuron i's output
// column, PowerInfer's ffn_down_t), so one index addresses a row in each. y_t = sum_j h_tj down_t[idx_j] with
// h_tj = act(x_t . gate[idx_j], x_t . up[idx_j] (+ up_bias)).
//
// One pass per thread over its contiguous share of the index list, in groups of NB = 8 neurons:
// 1. gate rows (for gate-less activations, up rows) as one dot_rows call: 8 rows stream side by side, which is what
//    makes scattered rows read at the speed of a dense GEMV (a DRAM stream per row in flight; see dot.cpp). For ReLU
//    and dReLU, a neuron whose gate is <= 0 for every token (or that every token masks out) has activation exactly 0,
//    and with a CATS threshold a SwiGLU neuron whose |silu(gate)| <= t for every token too: its up and down rows are
//    never read. Predicted index sets hold false positives (recall-0.99 predictors on the planted 1.1B model predict
//    1.7x the true active set): each costs a third of a neuron's bytes.
// 2. the neurons that remain are queued; each full queue of 8 reads its up rows, computes the activations, and adds
//    its down rows, converted once per block and applied to every token whose activation is not zero.
// Each thread sums into its own [T, d] buffer (thread 0 into y); the buffers are added at the end.
//
// Exactness: for every neuron of idx the result equals the dense FFN with all other neurons zeroed, up to float
// summation order (and, for block-type gate/up rows, the q8 rounding of x: see quant.h). Skipping a row whose
// activation is exactly zero changes nothing.
#include <memory>

#include "kernels.h"

namespace pinfer {

namespace {

constexpr int NB = 8;

inline float silu(float g) { return g / (1.f + std::exp(-g)); }
// gelu(v) = v Phi(v), written with erfc: 1 + erf(v / sqrt 2) cancels to 0 in fp32 for v < -5.5, erfc does not
inline float gelu(float v) { return 0.5f * v * std::erfc(v * -0.70710678118654752f); }

struct Walk {
  const FFN& f;
  const Acts& a;
  float* acc;  // this thread's [T, d] partial sums
  const bool gated, gate_first;
  std::vector<float> gb, pend_v, uv, hv;  // [T, NB] each
  int64_t pend[NB];
  int n_pend = 0;
  const uint8_t* upcoming[NB];  // the first rows of the next group: prefetched while the down rows are added
  int n_upcoming = 0;
  int64_t nonzero = 0;

  Walk(const FFN& f_, const Acts& a_, float* acc_)
      : f(f_), a(a_), acc(acc_), gated(f_.act <= DRELU),
        gate_first(f_.act == REGLU || f_.act == DRELU || (f_.act == SWIGLU && f_.cats > 0.f)),
        gb(f_.T * NB), pend_v(f_.T * NB), uv(f_.T * NB), hv(f_.T * NB) {}

  int64_t id(int64_t j) const { return f.idx ? f.idx[j] : j; }
  bool on(int64_t t, int64_t j) const { return f.mask == nullptr || f.mask[t * f.mask_stride + j]; }
  float bias(int64_t j) const { return f.up_bias ? f.up_bias[id(j)] : 0.f; }

  // can this gate value give a nonzero activation (the up value unknown yet)?
  bool gate_passes(float g) const {
    if (f.act == REGLU || f.act == DRELU) return g > 0.f;
    if (f.act == SWIGLU && f.cats > 0.f) return std::fabs(silu(g)) > f.cats;
    return true;
  }
  float activate(float g, float u) const {
    switch (f.act) {
      case REGLU: return g > 0.f ? g * u : 0.f;
      case DRELU: return (g > 0.f && u > 0.f) ? g * u : 0.f;
      case RELU_NOGATE: return u > 0.f ? u : 0.f;
      case GELU_NOGATE: return gelu(u);
      default: {
        const float s = silu(g);
        return (f.cats > 0.f && std::fabs(s) <= f.cats) ? 0.f : s * u;
      }
    }
  }

  // the queued neurons: (gated) up rows and activations, then the down rows of those with a nonzero activation
  void flush() {
    if (n_pend == 0) return;
    const int64_t T = f.T;
    const uint8_t* rows[NB];
    if (gated) {
      const uint8_t* down[NB];
      for (int r = 0; r < n_pend; ++r) {
        rows[r] = f.up.row(id(pend[r]));
        down[r] = f.down_t.row(id(pend[r]));
      }
      dot_rows(f.up.type, rows, n_pend, a, uv.data(), NB, down, n_pend);
      for (int64_t t = 0; t < T; ++t)
        for (int r = 0; r < n_pend; ++r)
          hv[t * NB + r] = on(t, pend[r]) ? activate(pend_v[t * NB + r], uv[t * NB + r] + bias(pend[r])) : 0.f;
    } else {
      for (int64_t t = 0; t < T; ++t)
        for (int r = 0; r < n_pend; ++r) hv[t * NB + r] = pend_v[t * NB + r];
    }
    // keep the rows with a nonzero activation for some token, columns compacted in place
    int n = 0;
    for (int r = 0; r < n_pend; ++r) {
      int64_t nz = 0;
      for (int64_t t = 0; t < T; ++t) nz += hv[t * NB + r] != 0.f;
      if (nz == 0) continue;
      nonzero += nz;
      for (int64_t t = 0; t < T; ++t) hv[t * NB + n] = hv[t * NB + r];
      rows[n++] = f.down_t.row(id(pend[r]));
    }
    axpy_rows(f.down_t.type, rows, n, hv.data(), NB, T, acc, f.d, 0, f.d, upcoming, n_upcoming);
    n_pend = 0;
  }

  void queue(int64_t j, int r) {  // neuron at index position j, its values in column r of gb
    for (int64_t t = 0; t < f.T; ++t) pend_v[t * NB + n_pend] = gb[t * NB + r];
    pend[n_pend++] = j;
    if (n_pend == NB) flush();
  }

  void run(int64_t b, int64_t e) {
    const int64_t T = f.T;
    const Mat& first = gated ? f.gate : f.up;
    for (int64_t j0 = b; j0 < e; j0 += NB) {
      const int n = (int)std::min<int64_t>(NB, e - j0);
      const uint8_t* rows[NB];
      for (int r = 0; r < n; ++r) rows[r] = first.row(id(j0 + r));
      // Prefetched into L2 in step with these rows: for SwiGLU without CATS (every neuron live) the same neurons' up
      // rows, read next; otherwise the next group's first rows. The down rows are prefetched while the up rows are read
      // (flush), and the next group's first rows while the down rows are added.
      n_upcoming = (int)std::max<int64_t>(0, std::min<int64_t>(NB, e - j0 - NB));
      for (int r = 0; r < n_upcoming; ++r) upcoming[r] = first.row(id(j0 + NB + r));
      const uint8_t* ups[NB];
      const bool all_live = gated && !gate_first;
      if (all_live)
        for (int r = 0; r < n; ++r) ups[r] = f.up.row(id(j0 + r));
      dot_rows(first.type, rows, n, a, gb.data(), NB, all_live ? ups : upcoming, all_live ? n : n_upcoming);
      for (int r = 0; r < n; ++r) {
        const int64_t j = j0 + r;
        bool live = false;
        if (gated) {
          for (int64_t t = 0; t < T; ++t) live |= on(t, j) && (!gate_first || gate_passes(gb[t * NB + r]));
        } else {  // gate-less: the activation itself, masked; ReLU's zeros never read the down row
          const float bj = bias(j);
          for (int64_t t = 0; t < T; ++t) {
            float& v = gb[t * NB + r];
            v = on(t, j) ? activate(0.f, v + bj) : 0.f;
            live |= v != 0.f;
          }
        }
        if (live) queue(j, r);
      }
    }
    flush();
  }
};

}  // namespace

int64_t ffn_sparse(const FFN& f, float* y) {
  const int64_t T = f.T, d = f.d, k = f.k;
  std::fill(y, y + T * d, 0.f);
  if (T == 0 || k == 0) return 0;
  Acts a;
  a.prepare(f.x, T, d, d, is_block(f.up.type) || (f.gate.p && is_block(f.gate.type)));
  const int nt = num_threads();
  std::unique_ptr<float[]> partial(new float[(size_t)(nt - 1) * T * d]);  // zeroed by the threads that use them
  std::vector<int64_t> nonzero(nt, 0);
  std::vector<char> used(nt, 0);
  // one contiguous run of the index list per thread; tiny index sets stay on one thread (a fork costs more)
  const int64_t grain = std::max<int64_t>((k + nt - 1) / nt, 4 * NB);
  parallel_for(0, k, grain, [&](int64_t b, int64_t e) {
    const int tid = thread_num();
    float* acc = tid == 0 ? y : partial.get() + (size_t)(tid - 1) * T * d;
    if (tid != 0) std::fill(acc, acc + T * d, 0.f);
    Walk w(f, a, acc);
    w.run(b, e);
    nonzero[tid] += w.nonzero;
    used[tid] = 1;
  });
  int64_t total = nonzero[0];
  for (int t = 1; t < nt; ++t) {
    if (!used[t]) continue;
    total += nonzero[t];
    const float* p = partial.get() + (size_t)(t - 1) * T * d;
    for (int64_t i = 0; i < T * d; ++i) y[i] += p[i];
  }
  return total;
}

}  // namespace pinfer
