// The FFN of a few tokens over an index set of neurons, each selected row read once, in place, in any stored type.
//
// Layout (as stored): gate [n_ff, d] and up [n_ff, d] neuron-major, down_t [n_ff, d] (row i = neuron i's output
// column, PowerInfer's ffn_down_t), so one index addresses a row in each. y_t = sum_j h_tj down_t[idx_j] with
// h_tj = act(x_t . gate[idx_j], x_t . up[idx_j] (+ up_bias)).
//
// The index list is cut into parts by neuron id (below), the threads take parts in turn, and a part is one pass over
// its run of the list in groups of NB neurons, 16 on AVX-512 + VNNI (one 16-row lane tile; against 8, paired: the
// planted model's step 0.97-1.0x the time at 1 and 4 rows in three runs, the 1B Q4_0 sparse decode 1.018x), else 8:
// 1. gate rows (for gate-less activations, up rows) as one dot_rows call: the rows stream side by side, which is what
//    makes scattered rows read at the speed of a dense GEMV (a DRAM stream per row in flight; see dot.cpp). For ReLU
//    and dReLU, a neuron whose gate is <= 0 for every token (or that every token masks out) has activation exactly 0,
//    and with a CATS threshold a SwiGLU neuron whose |silu(gate)| <= t for every token too: its up and down rows are
//    never read. Predicted index sets hold false positives (recall-0.99 predictors on the planted 1.1B model predict
//    1.7x the true active set): each costs a third of a neuron's bytes.
// 2. the neurons that remain are queued; each full queue of NB reads its up rows, computes the activations, and adds
//    its down rows, converted once per block and applied to every token whose activation is not zero.
// Each part sums into its own [T, d] buffer (the first into y); the buffers are added at the end, in part order.
// A batch of rows each masked to its own few neurons of the union takes, per part, one such pass per row over its own
// neurons instead (by_rows), the rows' passes in step so that rows read by one are in cache for the next.
//
// Exactness: for every neuron of idx the result equals the dense FFN with all other neurons zeroed, up to float
// summation order (and, for block-type gate/up rows, the q8 rounding of x: see quant.h). Skipping a row whose
// activation is exactly zero changes nothing.
//
// Batch invariance: token t's result is the same bits whatever other tokens share the call and whatever neurons they
// bring into idx (their union), for an ascending idx (every caller's: predictors, unions, all neurons), so a batch of
// several requests, or a prompt's chunk, computed over the union of its rows' neurons gives each row what its decode
// step alone gives it. Three things make it so: each row's dot products are the same bits in any tile (dot.cpp); the
// down rows are added by a chain of fused multiply-adds in index order, into which a neuron whose activation is 0 for
// t adds nothing (quant.h axpy_blocks, the block offsets in mb); and the parts are fixed ranges of neuron ids,
// [c n_ff / P, (c + 1) n_ff / P) for part c of P (PARTS_PER_THREAD x num_threads()), not positions in idx, their sums
// added in part order. An idx that is not ascending is cut by positions (correct, not invariant).
#include <algorithm>
#include <atomic>
#include <climits>
#include <memory>
#include <vector>

#include "kernels.h"

namespace pinfer {

namespace {

#if defined(PINFER_AVX512) && defined(__AVX512VNNI__)
constexpr int NB = 16;  // the 16-row lane tile's (quant.h L16)
#else
constexpr int NB = 8;  // the 8-row tile's; 16 not measured on an AVX2-only CPU
#endif
constexpr int PARTS_PER_THREAD = 4;

struct Walk {
  const FFN& f;
  const Acts& a;
  float* acc;  // this part's [T, d] partial sums
  const bool gated, gate_first;
  // in the caller's arena (reused from part to part: no allocation per walk): [T, NB] each, sg / sv SwiGLU's silu of
  // gb (group) and of pend_v (flush), else null; mb for block-type down rows, [T, d / 32] per-block offset sums
  // (zeroed here), added to acc at the end, else null
  float *gb, *pend_v, *uv, *hv, *sg = nullptr, *sv = nullptr, *mb = nullptr;
  int64_t pend[NB];
  int n_pend = 0;
  const uint8_t* upcoming[NB];  // the first rows of the next group: prefetched while the down rows are added
  int n_upcoming = 0;
  int64_t nonzero = 0;

  Walk(const FFN& f_, const Acts& a_, float* acc_, std::vector<float>& arena)
      : f(f_), a(a_), acc(acc_), gated(f_.act <= DRELU),
        gate_first(f_.act == REGLU || f_.act == DRELU || (f_.act == SWIGLU && f_.cats > 0.f)) {
    const int64_t tn = f.T * NB, nmb = is_block(f.down_t.type) ? f.T * (f.d / QK) : 0;
    const bool swiglu = f.act == SWIGLU;
    arena.resize(4 * tn + (swiglu ? 2 * tn : 0) + nmb);
    float* p = arena.data();
    gb = p, pend_v = p + tn, uv = p + 2 * tn, hv = p + 3 * tn, p += 4 * tn;
    if (swiglu) sg = p, sv = p + tn, p += 2 * tn;
    if (nmb) mb = p, std::fill(mb, mb + nmb, 0.f);
  }

  int64_t id(int64_t j) const { return f.idx ? f.idx[j] : j; }
  bool on(int64_t t, int64_t j) const { return f.mask == nullptr || f.mask[t * f.mask_stride + j]; }
  float bias(int64_t j) const { return f.up_bias ? f.up_bias[id(j)] : 0.f; }

  // can this gate value give a nonzero activation (the up value unknown yet)? s: SwiGLU's silu(g)
  bool gate_passes(float g, float s) const {
    if (f.act == REGLU || f.act == DRELU) return g > 0.f;
    if (f.act == SWIGLU && f.cats > 0.f) return std::fabs(s) > f.cats;
    return true;
  }
  // SwiGLU's silu of T rows of n gate values (stride NB) into out, a row at a time (one vector pass: silu_rows)
  void silu_of(const float* g, int n, float* out) const {
    for (int64_t t = 0; t < f.T; ++t) silu_rows(g + t * NB, n, out + t * NB);
  }
  // act(g, u), the dense FFN's (ffn_act); s: SwiGLU's silu(g), computed a row at a time (silu_of), and its CATS cut
  float activate(float g, float u, float s = 0.f) const {
    if (f.act != SWIGLU) return ffn_act(f.act, g, u);
    return (f.cats > 0.f && std::fabs(s) <= f.cats) ? 0.f : s * u;
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
      dot_rows(f.up.type, rows, n_pend, a, uv, NB, down, n_pend);
      if (f.act == SWIGLU) silu_of(pend_v, n_pend, sv);
      for (int64_t t = 0; t < T; ++t)
        for (int r = 0; r < n_pend; ++r)
          hv[t * NB + r] = on(t, pend[r]) ? activate(pend_v[t * NB + r], uv[t * NB + r] + bias(pend[r]),
                                                     sv ? sv[t * NB + r] : 0.f)
                                          : 0.f;
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
    axpy_rows(f.down_t.type, rows, n, hv, NB, T, acc, f.d, 0, f.d, upcoming, n_upcoming, mb, f.d / QK);
    n_pend = 0;
  }

  void queue(int64_t j, int r) {  // neuron at index position j, its values in column r of gb
    for (int64_t t = 0; t < f.T; ++t) pend_v[t * NB + n_pend] = gb[t * NB + r];
    pend[n_pend++] = j;
    if (n_pend == NB) flush();
  }

  // the group of n index positions from j0 (n <= NB); e: the end of this walk's run (what may be prefetched)
  void group(int64_t j0, int n, int64_t e) {
    const int64_t T = f.T;
    const Mat& first = gated ? f.gate : f.up;
    const uint8_t* rows[NB];
    for (int r = 0; r < n; ++r) rows[r] = first.row(id(j0 + r));
    // Prefetched into L2 in step with these rows: for SwiGLU without CATS (every neuron live) the same neurons' up
    // rows, read next; otherwise the next group's first rows. The down rows are prefetched while the up rows are read
    // (flush), and the next group's first rows while the down rows are added.
    n_upcoming = (int)std::max<int64_t>(0, std::min<int64_t>(NB, e - j0 - n));
    for (int r = 0; r < n_upcoming; ++r) upcoming[r] = first.row(id(j0 + n + r));
    const uint8_t* ups[NB];
    const bool all_live = gated && !gate_first;
    if (all_live)
      for (int r = 0; r < n; ++r) ups[r] = f.up.row(id(j0 + r));
    dot_rows(first.type, rows, n, a, gb, NB, all_live ? ups : upcoming, all_live ? n : n_upcoming);
    const bool cats = f.act == SWIGLU && f.cats > 0.f;
    if (cats) silu_of(gb, n, sg);
    for (int r = 0; r < n; ++r) {
      const int64_t j = j0 + r;
      bool live = false;
      if (gated) {
        for (int64_t t = 0; t < T; ++t)
          live |= on(t, j) && (!gate_first || gate_passes(gb[t * NB + r], cats ? sg[t * NB + r] : 0.f));
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

  // after the last group: the queued neurons, then the block offsets into acc
  void finish() {
    flush();
    if (!mb) return;
    const int64_t T = f.T, nb = f.d / QK;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < f.d; ++o) acc[t * f.d + o] += mb[t * nb + o / QK];
  }

  void run(int64_t b, int64_t e) {
    for (int64_t j0 = b; j0 < e; j0 += NB) group(j0, (int)std::min<int64_t>(NB, e - j0), e);
    finish();
  }
};

// one row's neurons in a part's run: n ascending ids from p
struct Span {
  const int64_t* p;
  int64_t n;
};

// A batch whose rows are masked to few of the union's neurons (each row its own, as a batch of requests or a prompt
// chunk under predictors is): the all-token walk would compute every row on every neuron of the union and drop most.
// Instead one one-token walk per row over its own neurons of the run [b, e), which is the walk its decode step takes
// there (the same list, the same groups of NB, the same sums), the rows' walks advanced together WIN index positions
// at a time so that a neuron's rows, read from memory by the first row that needs them, are in cache for the others.
// Returns the nonzero (token, neuron) pairs; acc [T, d] zeroed.
constexpr int64_t WIN = 32;

int64_t by_rows(const FFN& f, const std::vector<Acts>& one, const Span* own, int64_t b, int64_t e, float* acc) {
  const int64_t T = f.T, d = f.d;
  // reused from part to part (a part's walks allocated ~7 vectors each: ~2% of a planted 4-row step in malloc/free)
  thread_local std::vector<FFN> ft;
  thread_local std::vector<std::vector<float>> arenas;
  thread_local std::vector<Walk> walks;
  thread_local std::vector<int64_t> at;  // each row's next position in its own list
  ft.assign(T, f);
  if ((int64_t)arenas.size() < T) arenas.resize(T);
  walks.clear();
  walks.reserve(T);
  for (int64_t t = 0; t < T; ++t) {
    ft[t].x = f.x + t * d, ft[t].T = 1, ft[t].idx = own[t].p, ft[t].k = own[t].n;
    ft[t].mask = nullptr, ft[t].mask_stride = 0, ft[t].rows = nullptr;
    walks.emplace_back(ft[t], one[t], acc + t * d, arenas[t]);
  }
  at.assign(T, 0);
  for (int64_t w = b; w < e; w += WIN) {
    // this window's groups: those whose last neuron comes before the next window's first (at the end: all left)
    const int64_t stop = w + WIN < e ? (f.idx ? f.idx[w + WIN] : w + WIN) : INT64_MAX;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t k = own[t].n;
      while (at[t] < k) {
        const int n = (int)std::min<int64_t>(NB, k - at[t]);
        if (own[t].p[at[t] + n - 1] >= stop) break;
        walks[t].group(at[t], n, k);
        at[t] += n;
      }
    }
  }
  int64_t nonzero = 0;
  for (Walk& w : walks) {
    w.finish();
    nonzero += w.nonzero;
  }
  walks.clear();
  return nonzero;
}

// the run [b, e) as a batch of rows each over its own neurons (by_rows) when its rows' masks hold less than half of
// the (token, neuron) pairs, else one walk for every token; either gives each row the same bits
int64_t run_part(const FFN& f, const Acts& a, const std::vector<Acts>& one, int64_t b, int64_t e, float* acc) {
  if (!one.empty()) {
    thread_local std::vector<Span> own;
    own.resize(f.T);
    int64_t pairs = 0;
    if (f.rows) {  // each row's ids within the run's, by binary search in its list (no pass over the mask)
      const int64_t lo = f.idx ? f.idx[b] : b, hi = f.idx ? f.idx[e - 1] : e - 1;
      for (int64_t t = 0; t < f.T; ++t) {
        const std::vector<int64_t>& r = f.rows[t];
        const auto p0 = std::lower_bound(r.begin(), r.end(), lo), p1 = std::upper_bound(p0, r.end(), hi);
        own[t] = {r.data() + (p0 - r.begin()), (int64_t)(p1 - p0)};
        pairs += own[t].n;
      }
    } else {
      thread_local std::vector<std::vector<int64_t>> ids;
      if ((int64_t)ids.size() < f.T) ids.resize(f.T);
      for (int64_t t = 0; t < f.T; ++t) {
        const bool* m = f.mask + t * f.mask_stride;
        ids[t].clear();
        for (int64_t j = b; j < e; ++j)
          if (m[j]) ids[t].push_back(f.idx ? f.idx[j] : j);
        own[t] = {ids[t].data(), (int64_t)ids[t].size()};
        pairs += own[t].n;
      }
    }
    if (2 * pairs < f.T * (e - b)) return by_rows(f, one, own.data(), b, e, acc);
  }
  thread_local std::vector<float> arena;
  Walk w(f, a, acc, arena);
  w.run(b, e);
  return w.nonzero;
}

}  // namespace

void sparse_begin(SparseRun& s, const FFN& f, float* y, int nt) {
  const int64_t T = f.T, d = f.d, k = f.k, n_ff = f.up.rows;
  s.f = &f, s.y = y;
  std::fill(y, y + T * d, 0.f);
  s.busy.clear(), s.nonzero.clear(), s.one.clear();
  s.next.store(0, std::memory_order_relaxed);
  if (T == 0 || k == 0) return;
  s.a.prepare(f.x, T, d, d, needs_q8(f.up.type) || (f.gate.p && needs_q8(f.gate.type)));
  bool ascending = true;
  for (int64_t j = 1; f.idx && j < k && ascending; ++j) ascending = f.idx[j] > f.idx[j - 1];
  // the tokens one by one, views into a, for by_rows (a batch of rows masked each to its own neurons)
  s.one.resize(T > 1 && f.mask && ascending ? T : 0);
  for (size_t t = 0; t < s.one.size(); ++t) {
    Acts& o = s.one[t];
    o.x = s.a.f[t], o.T = 1, o.n = s.a.n, o.ldx = s.a.ldx;
    o.f = {s.a.f[t]};
    o.q.clear();
    if (!s.a.q.empty()) o.q = {s.a.q[t]};
  }
  // PARTS_PER_THREAD parts per thread, claimed in turn: a part's neurons are those of its id range, so parts differ
  // in work (how many of its neurons idx holds, how many fire); more parts than threads even that out
  const int P = nt * PARTS_PER_THREAD;
  // part c's run of the index list: its neurons' ids in [c n_ff / P, (c + 1) n_ff / P) (see the head of the file)
  s.cut.assign(P + 1, 0);
  for (int c = 0; c <= P; ++c) {
    const int64_t lo = c * n_ff / P;
    if (!ascending)
      s.cut[c] = c * k / P;
    else if (!f.idx)
      s.cut[c] = std::min(lo, k);
    else
      s.cut[c] = std::lower_bound(f.idx, f.idx + k, lo) - f.idx;
  }
  s.cut[P] = k;
  for (int c = 0; c < P; ++c)  // the parts with neurons; part busy[0] sums straight into y
    if (s.cut[c] < s.cut[c + 1]) s.busy.push_back(c);
  const int nb = (int)s.busy.size();
  const size_t need = (size_t)std::max(nb - 1, 0) * T * d;
  if (need > s.partial_n) s.partial.reset(new float[need]), s.partial_n = need;
  s.nonzero.assign(nb, 0);
}

void sparse_parts(SparseRun& s) {
  const FFN& f = *s.f;
  const int nb = (int)s.busy.size();
  const int64_t Td = f.T * f.d;
  for (int i = s.next++; i < nb; i = s.next++) {
    float* acc = i == 0 ? s.y : s.partial.get() + (size_t)(i - 1) * Td;
    if (i != 0) std::fill(acc, acc + Td, 0.f);
    s.nonzero[i] = run_part(f, s.a, s.one, s.cut[s.busy[i]], s.cut[s.busy[i] + 1], acc);
  }
}

void sparse_reduce(SparseRun& s, int64_t o0, int64_t o1) {
  const int nb = (int)s.busy.size();
  const int64_t Td = s.f->T * s.f->d;
  for (int i = 1; i < nb; ++i) {
    const float* p = s.partial.get() + (size_t)(i - 1) * Td;
    for (int64_t o = o0; o < o1; ++o) s.y[o] += p[o];
  }
}

int64_t sparse_end(const SparseRun& s) {
  int64_t total = 0;
  for (int64_t n : s.nonzero) total += n;
  return total;
}

int64_t ffn_sparse(const FFN& f, float* y) {
  SparseRun s;
  const int nt = num_threads();
  sparse_begin(s, f, y, nt);
  const int nb = (int)s.busy.size();
  if (nb == 0) return 0;
  parallel_for(0, std::min(nt, nb), 1, [&](int64_t, int64_t) { sparse_parts(s); });
  // y += the other parts' sums, in part order, each output value on one thread
  if (nb > 1) parallel_for(0, f.T * f.d, 4096, [&](int64_t b, int64_t e) { sparse_reduce(s, b, e); });
  return sparse_end(s);
}

}  // namespace pinfer
