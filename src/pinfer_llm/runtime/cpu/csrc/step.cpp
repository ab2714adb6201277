// One token's decode step through a model's layers in one call (runtime/cpu/step.py builds it): norm, fused QKV,
// RoPE + KV write + attention, output projection, residual, norm, the FFN (dense, exact masks or predicted-sparse),
// residual. The Python forward (runtime/model.py) makes the same kernel calls one at a time, through the dispatcher,
// with a torch tensor per intermediate; for SmolLM2's 30 layers of 576 that was ~100 us of Python per layer and
// token (issue #26). Here the intermediates live in buffers sized once, and every op is the kernel the forward
// calls, in its order and with its arguments, so the two give the same bits (tests/test_decode_step.py holds them
// to it).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <thread>

#include "kernels.h"

namespace pinfer {

void silu_rows(const float* g, int64_t n, float* s) {
  // one call site of silu_v for every value, a last partial vector padded: a value's bits do not depend on its
  // position or on n (the sparse FFN takes its values one at a time)
  for (int64_t i = 0; i < n; i += VW) {
    const int64_t k = std::min<int64_t>(VW, n - i);
    float in[VW] = {}, out[VW];
    const float* src = g + i;
    if (k < VW) {
      std::copy(g + i, g + n, in);
      src = in;
    }
    vstore(k < VW ? out : s + i, silu_v(vload(src)));
    if (k < VW) std::copy(out, out + k, s + i);
  }
}

namespace {

float silu(float g) {
  float s;
  silu_rows(&g, 1, &s);
  return s;
}

}  // namespace

float ffn_act(int act, float g, float u) {
  switch (act) {
    case REGLU: return g > 0.f ? g * u : 0.f;
    case DRELU: return (g > 0.f && u > 0.f) ? g * u : 0.f;
    case RELU_NOGATE: return u > 0.f ? u : 0.f;
    case GELU_NOGATE: return 0.5f * u * std::erfc(u * -0.70710678118654752f);  // erfc: no cancellation below -5.5
    default: return silu(g) * u;  // SwiGLU
  }
}

void ffn_act_rows(int act, const float* g, const float* u, const float* up_bias, int64_t n, float* h) {
  if (act == SWIGLU) {  // ffn_act's bits, the silu of the whole row at once
    silu_rows(g, n, h);
    for (int64_t i = 0; i < n; ++i) h[i] *= up_bias ? u[i] + up_bias[i] : u[i];
    return;
  }
  // the ReLU family a loop each, which the compiler vectorises (ffn_act's bits: a compare, a select, a multiply); a
  // call of ffn_act per value was ~4% of a 1B ReGLU llama's prefill
  if (!up_bias && g && act == REGLU) {
    for (int64_t i = 0; i < n; ++i) h[i] = g[i] > 0.f ? g[i] * u[i] : 0.f;
  } else if (!up_bias && g && act == DRELU) {
    for (int64_t i = 0; i < n; ++i) h[i] = (g[i] > 0.f && u[i] > 0.f) ? g[i] * u[i] : 0.f;
  } else if (act == RELU_NOGATE) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = up_bias ? u[i] + up_bias[i] : u[i];
      h[i] = v > 0.f ? v : 0.f;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) h[i] = ffn_act(act, g ? g[i] : 0.f, up_bias ? u[i] + up_bias[i] : u[i]);
  }
}

void ffn_mm(const float* x, int64_t T, int64_t d, const Mat& gate, const Mat& up, const Mat& down, int act,
            const float* up_bias, float* y) {
  const int64_t n_ff = up.rows;
  const bool gated = gate.p != nullptr;
  // decode reuses its buffers across calls (no page faults per token); a prompt's, up to 3 n_ff floats per token, are
  // not kept
  thread_local std::vector<float> gu_keep, h_keep;
  std::vector<float> gu_own, h_own;
  std::vector<float>& gu = T <= 8 ? gu_keep : gu_own;
  std::vector<float>& h = T <= 8 ? h_keep : h_own;
  gu.resize(T * n_ff * (gated ? 2 : 1));
  h.resize(T * n_ff);
  std::vector<Mat> ws;
  if (gated) ws.push_back(gate);
  ws.push_back(up);
  qmatmul(x, T, d, ws, gu.data(), GEMM_MIN_T);
  const int64_t row = n_ff * (int64_t)ws.size();
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gu.data() + t * row;
    ffn_act_rows(act, gated ? g : nullptr, g + (gated ? n_ff : 0), up_bias, n_ff, h.data() + t * n_ff);
  }
  qmatmul(h.data(), T, n_ff, {down}, y, GEMM_MIN_T);
}

void apply_norm(const NormW& n, const float* x, int64_t T, int64_t d, float* y) {
  if (n.layer)
    layer_norm(x, n.w, n.b, T, d, n.eps, y);
  else
    rms_norm(x, n.w, T, d, n.eps, y);
}

namespace {

void add(float* y, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += b[i];
}

// ffn_sparse's arguments for layer L's neuron-major FFN over every neuron, T rows of normed input x
FFN sparse_args(const LayerStep& L, int64_t d, int64_t T, const float* x) {
  FFN q;
  q.x = x, q.T = T, q.d = d, q.gate = L.gate, q.up = L.up, q.down_t = L.down, q.k = L.up.rows, q.act = L.act,
  q.up_bias = L.up_bias, q.cats = L.cats;
  return q;
}

// A batch's predicted neurons: uni the ascending union of the rows' lists own[t], mask [T, |uni|] each row's own.
// A bit per row and neuron id (W words per id), then one pass over the ids, compacting without a branch. A sort and
// a binary search per entry mispredicted a branch per neuron: 60 us of a planted 1024 x 4096 layer's 4-row step (one
// thread working while the others wait).
void union_mask(const std::vector<std::vector<int64_t>>& own, std::vector<int64_t>& uni,
                std::unique_ptr<bool[]>& mask) {
  const int64_t T = (int64_t)own.size(), W = (T + 63) / 64;
  int64_t n = 0;  // 1 + the largest id
  for (const auto& o : own)
    for (int64_t i : o) n = std::max(n, i + 1);
  thread_local std::vector<uint64_t> bits;  // [n, W]
  bits.assign(n * W, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i : own[t]) bits[i * W + t / 64] |= uint64_t(1) << (t % 64);
  uni.resize(n);
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t any = 0;
    for (int64_t w = 0; w < W; ++w) any |= bits[i * W + w];
    uni[k] = i;
    k += any != 0;
  }
  uni.resize(k);
  mask.reset(new bool[T * k]);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) mask[t * k + j] = (bits[uni[j] * W + t / 64] >> (t % 64)) & 1;
}

// The FFN of one token: xf its normed input, resid the pre-norm residual the predictor reads; f [d] overwritten.
// *read (predictors): the neurons whose rows it read.
int64_t ffn_one(const LayerStep& L, int64_t d, const float* xf, const float* resid, float* f, int64_t* read) {
  if (L.kind == FFN_MM) {
    ffn_mm(xf, 1, d, L.gate, L.up, L.down, L.act, L.up_bias, f);
    return L.up.rows;
  }
  FFN q = sparse_args(L, d, 1, xf);
  std::vector<int64_t> idx;
  if (L.kind == FFN_PRED) {
    idx = predict_active(resid, L.fc1, L.fc2, L.fc2_transposed, L.threshold, L.always.data(),
                         (int64_t)L.always.size());
    *read = (int64_t)idx.size();
    if (idx.empty()) {  // as ffn_sparse: no neuron, no kernel
      std::fill(f, f + d, 0.f);
      return 0;
    }
    q.idx = idx.data(), q.k = (int64_t)idx.size();
    ffn_sparse(q, f);
    return q.k;  // the predictor's count, as SparseFFN counts it
  }
  return ffn_sparse(q, f);
}

// The FFN of T rows in one call over the union of their neurons, each row masked to its own (the predictor's for
// FFN_PRED, its own exact activations for FFN_ROWS): by sparse_ffn.cpp's batch invariance each row gets the bits
// ffn_one gives it alone, and every selected row of weights is read once for all of them.
int64_t ffn_rows(const LayerStep& L, int64_t d, int64_t T, const float* xf, const float* resid, float* f,
                 int64_t* read) {
  if (T == 1) return ffn_one(L, d, xf, resid, f, read);
  FFN q = sparse_args(L, d, T, xf);
  if (L.kind != FFN_PRED) return ffn_sparse(q, f);
  std::vector<std::vector<int64_t>> own(T);
  int64_t count = 0;
  for (int64_t t = 0; t < T; ++t) {
    own[t] = predict_active(resid + t * d, L.fc1, L.fc2, L.fc2_transposed, L.threshold, L.always.data(),
                            (int64_t)L.always.size());
    count += (int64_t)own[t].size();
  }
  std::vector<int64_t> uni;
  std::unique_ptr<bool[]> mask;
  union_mask(own, uni, mask);
  const int64_t k = (int64_t)uni.size();
  *read = k;
  if (k == 0) {
    std::fill(f, f + T * d, 0.f);
    return 0;
  }
  q.idx = uni.data(), q.k = k, q.mask = mask.get(), q.mask_stride = k, q.rows = own.data();
  ffn_sparse(q, f);
  return count;  // the predictors' counts, as ffn_one's
}

}  // namespace

void decode_layers(const StepShape& s, const std::vector<LayerStep>& layers, int64_t l0, int64_t l1, const float* rope,
                   int64_t pos, float* x, int64_t* active, StepScratch& sc) {
  const int64_t d = s.d, D = s.D, nq = (s.H + 2 * s.Hkv) * D;
  sc.xa.resize(d), sc.xf.resize(d), sc.qkv.resize(nq), sc.heads.resize(s.H * D), sc.y.resize(d), sc.f.resize(d);
  for (int64_t l = l0; l < l1; ++l) {
    const LayerStep& L = layers[l];
    apply_norm(L.attn_norm, x, 1, d, sc.xa.data());
    qmatmul(sc.xa.data(), 1, d, L.qkv, sc.qkv.data(), GEMM_MIN_T);
    if (L.bqkv) add(sc.qkv.data(), L.bqkv, nq);
    if (L.kv_half)
      attend_decode<uint16_t>(sc.qkv.data(), rope, (uint16_t*)L.k_cache, (uint16_t*)L.v_cache, L.ctx, D, pos, s.H,
                              s.Hkv, s.scale, s.neox, sc.heads.data());
    else
      attend_decode<float>(sc.qkv.data(), rope, (float*)L.k_cache, (float*)L.v_cache, L.ctx, D, pos, s.H, s.Hkv,
                           s.scale, s.neox, sc.heads.data());
    qmatmul(sc.heads.data(), 1, s.H * D, L.wo, sc.y.data(), GEMM_MIN_T);
    if (L.bo) add(sc.y.data(), L.bo, d);
    // y = x + attention; the FFN reads y (sequential) or the layer input x (parallel)
    for (int64_t i = 0; i < d; ++i) sc.y[i] = x[i] + sc.y[i];
    const float* resid = L.parallel ? x : sc.y.data();
    const float* xf = sc.xf.data();
    if (L.parallel && L.ffn_norm_shared)
      xf = sc.xa.data();
    else
      apply_norm(L.ffn_norm, resid, 1, d, sc.xf.data());
    int64_t read = -1;
    active[l] += ffn_one(L, d, xf, resid, sc.f.data(), &read);
    if (read >= 0) sc.count_read(l, read);
    if (L.ffn_bias) add(sc.f.data(), L.ffn_bias, d);
    for (int64_t i = 0; i < d; ++i) x[i] = sc.y[i] + sc.f[i];
  }
}

namespace {

// The barrier of decode_team's team: the last thread to arrive opens the next generation. Spins (the waits are
// microseconds: one matrix's share of rows), then yields, so a thread the OS took away does not stall the others'
// cores.
struct SpinBarrier {
  std::atomic<int> arrived{0}, gen{0}, n{1};
  void wait() {
    const int P = n.load(std::memory_order_relaxed);
    if (P == 1) return;
    const int g = gen.load(std::memory_order_relaxed);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == P - 1) {
      arrived.store(0, std::memory_order_relaxed);
      gen.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spin = 0; gen.load(std::memory_order_acquire) == g; ++spin) {
      if (spin < 20000) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }
};

// Thread p's share [b, e) of n items, in whole units where it can
void share(int64_t n, int p, int P, int64_t unit, int64_t& b, int64_t& e) {
  const int64_t units = (n + unit - 1) / unit;
  b = std::min(n, units * p / P * unit);
  e = std::min(n, units * (p + 1) / P * unit);
}

bool need_q8(const std::vector<Mat>& ws) {
  for (const Mat& m : ws)
    if (needs_q8(m.type)) return true;
  return false;
}

// y[t * ys + r] = row r of the matrices ws (stacked) . token t of a, for the stacked rows [b, e): qmatmul's streaming
// path on this thread (a row's sums do not depend on which rows or how many tokens share its call)
void rows_part(const Acts& a, const std::vector<Mat>& ws, int64_t b, int64_t e, float* y, int64_t ys) {
  thread_local std::vector<const uint8_t*> rows;
  int64_t off = 0;
  for (const Mat& m : ws) {
    const int64_t lo = std::max(b, off), hi = std::min(e, off + m.rows);
    if (lo < hi) {
      rows.resize(hi - lo);
      for (int64_t r = lo; r < hi; ++r) rows[r - lo] = m.row(r - off);
      dot_rows(m.type, rows.data(), hi - lo, a, y + lo, ys);
    }
    off += m.rows;
  }
}

}  // namespace

bool team_step_applies(const std::vector<LayerStep>& layers) { return !layers.empty(); }

void decode_team(const StepShape& s, const std::vector<LayerStep>& layers, const std::vector<SlotCache>& slots,
                 const float* rope, int64_t T, const int64_t* pos, const int64_t* slot, float* x, int64_t* active,
                 StepScratch& sc, const TeamHead* head) {
  const int64_t d = s.d, D = s.D, H = s.H, Hkv = s.Hkv, nq = (H + 2 * Hkv) * D, hd = H * D;
  int64_t n_ff = 0;
  for (const LayerStep& L : layers) n_ff = std::max(n_ff, L.up.rows);
  // shared between the threads: each element written by one thread, read by others after a barrier
  sc.qkv.resize(T * nq), sc.heads.resize(2 * T * hd), sc.y.resize(T * d), sc.f.resize(T * n_ff);
  float *qkv = sc.qkv.data(), *q = sc.heads.data(), *heads = q + T * hd, *y = sc.y.data(), *hbuf = sc.f.data();
  // a neuron-major FFN's shared state: the predictor's hidden units and each thread's neurons, the index list,
  // ffn_sparse's phases and their output
  int64_t r_max = 0;
  for (const LayerStep& L : layers) r_max = std::max(r_max, L.fc1.rows);
  sc.xa.resize(T * r_max), sc.xf.resize(T * d);
  float *hidden = sc.xa.data(), *fs = sc.xf.data();
  std::vector<std::vector<int64_t>> own(num_threads() * T);  // [thread][row]: the neurons of its range
  std::vector<std::vector<int64_t>> row_own(T);  // each row's list: the threads' ranges in order (predict_active's)
  std::vector<int64_t> idx;
  std::unique_ptr<bool[]> mask;
  int64_t predicted = 0;
  FFN sf;
  SparseRun run;
  SpinBarrier bar;
  // the q8 blocks of the output projection's input (the heads) and of ffn_down's (the activations), shared: each
  // thread quantises the blocks of the heads or neurons it computed, before the barrier that every thread passes
  // before reading them (each thread quantised all of them for itself: ~3% of a 4-row SmolLM2 step, perf)
  Q8Acts heads_q8, h_q8;
  const bool share_heads_q8 = D % QK == 0;
  heads_q8.shape(T, hd / QK);
  h_q8.shape(T, n_ff / QK);
  run_team([&](int p, int P) {
    bar.n.store(P, std::memory_order_relaxed);  // every thread stores the same P before its first wait
    // this thread's own: normed inputs, q8 activations, its neurons' gate and up sums, its rows of ffn_down
    thread_local std::vector<float> xa, xf, gu, fo;
    thread_local Acts acts;
    xa.resize(T * d), xf.resize(T * d), fo.resize(T * d);
    int64_t b, e;
    for (size_t l = 0; l < layers.size(); ++l) {
      const LayerStep& L = layers[l];
      // attention: the norm (every thread, the same bits), this thread's share of the QKV rows
      apply_norm(L.attn_norm, x, T, d, xa.data());
      acts.prepare(xa.data(), T, d, d, need_q8(L.qkv));
      share(nq, p, P, 8, b, e);
      rows_part(acts, L.qkv, b, e, qkv, nq);
      if (L.bqkv)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i = b; i < e; ++i) qkv[t * nq + i] += L.bqkv[i];
      bar.wait();
      // each row's key and value written (a slot's rows by one thread, in order: a row reads the rows before it in
      // its slot), then the T x H heads shared out
      for (int64_t t = 0; t < T; ++t)
        if (slot[t] % P == p) {
          const SlotCache& c = slots[slot[t]];
          if (L.kv_half)
            attend_store<uint16_t>(qkv + t * nq, rope + pos[t] * D, (uint16_t*)c.k[l], (uint16_t*)c.v[l], L.ctx, D,
                                   pos[t], H, Hkv, s.neox, q + t * hd);
          else
            attend_store<float>(qkv + t * nq, rope + pos[t] * D, (float*)c.k[l], (float*)c.v[l], L.ctx, D, pos[t], H,
                                Hkv, s.neox, q + t * hd);
        }
      bar.wait();
      share(T * H, p, P, 1, b, e);
      for (int64_t t = b / H; t < T && t * H < e; ++t) {
        const SlotCache& c = slots[slot[t]];
        const int64_t h0 = std::max(b - t * H, (int64_t)0), h1 = std::min(e - t * H, H);
        if (L.kv_half)
          attend_heads<uint16_t>(q + t * hd, (const uint16_t*)c.k[l], (const uint16_t*)c.v[l], L.ctx, D, pos[t], H,
                                 Hkv, s.scale, h0, h1, heads + t * hd);
        else
          attend_heads<float>(q + t * hd, (const float*)c.k[l], (const float*)c.v[l], L.ctx, D, pos[t], H, Hkv,
                              s.scale, h0, h1, heads + t * hd);
        if (share_heads_q8 && need_q8(L.wo)) heads_q8.quantize_blocks(heads + t * hd, t, h0 * D / QK, h1 * D / QK);
      }
      bar.wait();
      // output projection and residual, y = x + attention, for this thread's rows
      if (share_heads_q8)
        acts.attach(heads, T, hd, hd, need_q8(L.wo) ? &heads_q8 : nullptr);
      else
        acts.prepare(heads, T, hd, hd, need_q8(L.wo));
      share(d, p, P, 8, b, e);
      rows_part(acts, L.wo, b, e, y, d);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = b; i < e; ++i) {
          float& yi = y[t * d + i];
          yi = x[t * d + i] + (L.bo ? yi + L.bo[i] : yi);
        }
      bar.wait();
      // the FFN's normed input (every thread)
      const float* resid = L.parallel ? x : y;
      const float* xin = xa.data();
      if (!(L.parallel && L.ffn_norm_shared)) {
        apply_norm(L.ffn_norm, resid, T, d, xf.data());
        xin = xf.data();
      }
      const bool gated = L.gate.p != nullptr;
      const int64_t nf = L.up.rows;
      if (L.kind != FFN_MM) {  // ffn_down_t: the predictor, then ffn_sparse, each phase shared out
        if (L.kind == FFN_PRED) {  // each row's predictor: fc1's rows shared out, then the neurons' scores
          share(L.fc1.rows, p, P, 8, b, e);
          predict_hidden(resid, T, d, L.fc1, b, e, hidden, r_max);
          bar.wait();
          share(nf, p, P, 64, b, e);
          predict_range(hidden, T, r_max, L.fc1, L.fc2, L.fc2_transposed, L.threshold, L.always.data(),
                        (int64_t)L.always.size(), b, e, &own[p * T]);
          bar.wait();
        }
        if (p == 0) {
          sf = sparse_args(L, d, T, xin);
          if (L.kind == FFN_PRED) {  // one row: its list; a batch, as ffn_rows: the union, each row masked to its own
            predicted = 0;
            for (int64_t t = 0; t < T; ++t) {
              row_own[t].clear();
              for (int i = 0; i < P; ++i)
                row_own[t].insert(row_own[t].end(), own[i * T + t].begin(), own[i * T + t].end());
              predicted += (int64_t)row_own[t].size();
            }
            if (T > 1) {
              union_mask(row_own, idx, mask);
              sf.mask = mask.get(), sf.mask_stride = (int64_t)idx.size(), sf.rows = row_own.data();
            } else {
              idx.swap(row_own[0]);
            }
            sf.idx = idx.data(), sf.k = (int64_t)idx.size();
            sc.count_read(l, sf.k);
          }
          sparse_begin(run, sf, fs, P);
        }
        bar.wait();
        sparse_parts(run);
        bar.wait();
        share(d, p, P, 8, b, e);
        for (int64_t t = 0; t < T; ++t) sparse_reduce(run, t * d + b, t * d + e);
        if (p == 0) active[l] += L.kind == FFN_PRED ? predicted : sparse_end(run);
      } else {  // ffn_down: this thread's neurons' gate and up rows and activations, then its rows of ffn_down
        acts.prepare(xin, T, d, d, needs_q8(L.up.type) || (gated && needs_q8(L.gate.type)));
        share(nf, p, P, QK, b, e);  // whole q8 blocks of the activations
        const int64_t k = e - b;
        const bool q8_down = needs_q8(L.down.type) && nf % QK == 0;
        gu.resize(2 * T * k);
        float *g = gu.data(), *u = g + T * k;
        if (k > 0) {
          thread_local std::vector<const uint8_t*> rows;
          rows.resize(k);
          if (gated) {
            for (int64_t i = b; i < e; ++i) rows[i - b] = L.gate.row(i);
            dot_rows(L.gate.type, rows.data(), k, acts, g, k);
          }
          for (int64_t i = b; i < e; ++i) rows[i - b] = L.up.row(i);
          dot_rows(L.up.type, rows.data(), k, acts, u, k);
        }
        for (int64_t t = 0; t < T; ++t) {
          ffn_act_rows(L.act, gated ? g + t * k : nullptr, u + t * k, L.up_bias ? L.up_bias + b : nullptr, k,
                       hbuf + t * nf + b);
          if (q8_down) h_q8.quantize_blocks(hbuf + t * nf, t, b / QK, e / QK);
        }
        bar.wait();
        if (q8_down || !needs_q8(L.down.type))
          acts.attach(hbuf, T, nf, nf, q8_down ? &h_q8 : nullptr);
        else
          acts.prepare(hbuf, T, nf, nf, true);
        share(d, p, P, 8, b, e);
        rows_part(acts, {L.down}, b, e, fo.data(), d);
        if (p == 0) active[l] += nf * T;
      }
      // x = y + the FFN (+ its bias), for this thread's rows [b, e) of d
      const float* f = L.kind == FFN_MM ? fo.data() : fs;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = b; i < e; ++i) {
          const float fi = f[t * d + i];
          x[t * d + i] = y[t * d + i] + (L.ffn_bias ? fi + L.ffn_bias[i] : fi);
        }
      bar.wait();
    }
    if (!head) return;
    // the output head over the rows asked for: norm, this thread's share of the vocabulary
    const int64_t k = head->n_rows, vocab = rows_of(*head->w);
    xa.resize(std::max(T, k) * d);
    for (int64_t i = 0; i < k; ++i) apply_norm(*head->norm, x + head->rows[i] * d, 1, d, xa.data() + i * d);
    acts.prepare(xa.data(), k, d, d, need_q8(*head->w));
    share(vocab, p, P, 8, b, e);
    rows_part(acts, *head->w, b, e, head->logits, vocab);
    for (int64_t i = 0; i < k; ++i)
      head->facts[i * head->facts_stride + p] = logit_facts(head->logits + i * vocab, b, e);
  });
}

LogitFacts logit_facts(const float* v, int64_t b, int64_t e) {
  LogitFacts f;
  if (e <= b) return f;
  // one pass for the largest value and finiteness (x - x is 0 for a finite x, NaN otherwise), then the first index
  // that holds it
  vf m = vset1(-INFINITY), z = vzero();
  int64_t i = b;
  for (; i + VW <= e; i += VW) {
    const vf x = vload(v + i);
    m = vmax(m, x), z = vadd(z, vsub(x, x));
  }
  float top = vmax_lanes(m), zs = vsum(z);
  for (; i < e; ++i) top = std::max(top, v[i]), zs += v[i] - v[i];
  f.finite = zs == 0.f;
  if (!f.finite) return f;
  for (i = b; v[i] != top; ++i) {
  }
  f.best = i, f.top = top;
  return f;
}

LogitFacts join_facts(const LogitFacts* parts, int64_t n) {
  LogitFacts f;
  for (int64_t p = 0; p < n; ++p) {
    const LogitFacts& q = parts[p];
    f.finite = f.finite && q.finite;
    if (q.best >= 0 && (f.best < 0 || q.top > f.top)) f.best = q.best, f.top = q.top;
  }
  if (!f.finite) f.best = -1;
  return f;
}

void decode_rows(const StepShape& s, const std::vector<LayerStep>& layers, const std::vector<SlotCache>& slots,
                 const float* rope, int64_t T, const int64_t* pos, const int64_t* slot, float* x, int64_t* active,
                 StepScratch& sc) {
  const int64_t d = s.d, D = s.D, nq = (s.H + 2 * s.Hkv) * D, hd = s.H * D;
  sc.xa.resize(T * d), sc.xf.resize(T * d), sc.qkv.resize(T * nq), sc.heads.resize(T * hd), sc.y.resize(T * d);
  sc.f.resize(T * d);
  std::vector<void*> kp, vp;
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerStep& L = layers[l];
    apply_norm(L.attn_norm, x, T, d, sc.xa.data());
    qmatmul(sc.xa.data(), T, d, L.qkv, sc.qkv.data(), GEMM_MIN_T);
    if (L.bqkv)
      for (int64_t t = 0; t < T; ++t) add(sc.qkv.data() + t * nq, L.bqkv, nq);
    // each row in its own slot's cache; a prompt's rows in position order (csrc/attention.cpp attend_rows)
    kp.resize(T), vp.resize(T);
    for (int64_t t = 0; t < T; ++t) kp[t] = slots[slot[t]].k[l], vp[t] = slots[slot[t]].v[l];
    if (L.kv_half)
      attend_rows<uint16_t>(T, sc.qkv.data(), nq, rope, (uint16_t* const*)kp.data(), (uint16_t* const*)vp.data(),
                            L.ctx, D, pos, s.H, s.Hkv, s.scale, s.neox, sc.heads.data());
    else
      attend_rows<float>(T, sc.qkv.data(), nq, rope, (float* const*)kp.data(), (float* const*)vp.data(), L.ctx, D,
                         pos, s.H, s.Hkv, s.scale, s.neox, sc.heads.data());
    qmatmul(sc.heads.data(), T, hd, L.wo, sc.y.data(), GEMM_MIN_T);
    for (int64_t t = 0; t < T; ++t) {
      float* yt = sc.y.data() + t * d;
      const float* xt = x + t * d;
      if (L.bo) add(yt, L.bo, d);
      for (int64_t i = 0; i < d; ++i) yt[i] = xt[i] + yt[i];
    }
    const float* resid = L.parallel ? x : sc.y.data();
    const float* xf = sc.xf.data();
    if (L.parallel && L.ffn_norm_shared)
      xf = sc.xa.data();
    else
      apply_norm(L.ffn_norm, resid, T, d, sc.xf.data());
    if (L.kind == FFN_MM) {  // one pass over the weights for every row: ffn_mm's rows are independent below GEMM_MIN_T
      ffn_mm(xf, T, d, L.gate, L.up, L.down, L.act, L.up_bias, sc.f.data());
      active[l] += L.up.rows * T;
    } else {  // every row at once, each over its own neurons (ffn_rows)
      int64_t read = -1;
      active[l] += ffn_rows(L, d, T, xf, resid, sc.f.data(), &read);
      if (read >= 0) sc.count_read(l, read);
    }
    for (int64_t t = 0; t < T; ++t) {
      float* ft = sc.f.data() + t * d;
      if (L.ffn_bias) add(ft, L.ffn_bias, d);
      float* xt = x + t * d;
      const float* yt = sc.y.data() + t * d;
      for (int64_t i = 0; i < d; ++i) xt[i] = yt[i] + ft[i];
    }
  }
}

}  // namespace pinfer
