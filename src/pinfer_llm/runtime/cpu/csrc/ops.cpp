// pinfer's CPU operators: torch.ops.<ns>.*, ns = "pinfer" for the runtime's build (runtime/cpu/kernels.py; the tests
// also load builds for other -march values under other namespaces). This file validates tensors and calls the kernels
// (kernels.h); all of them run on torch's thread pool (at::parallel_for), honouring torch.set_num_threads.
//
// Weights are passed as stored in the GGUF file: a 2-d tensor [rows, row_bytes] of uint8 (zero-copy views of a
// read-only memory map; never written; any address alignment; each row contiguous, any row stride, so interleaved
// layouts work too) plus the ggml type code: F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30 (quant.h has
// the encodings). A float32 / float16 / bfloat16 tensor [rows, cols] is accepted for F32 / F16 / BF16. Block types
// need cols % 32 == 0. Activations are contiguous float32.
//
// q8: where a block-type (Q4_0, Q4_1, Q8_0) weight multiplies activations in a dot product (qmatmul below its GEMM
// threshold, qffn_sparse's gate and up rows, qpredict_active), the activations are first quantised to q8 blocks of 32
// (d = max|x| / 127, q = round-half-even(x / d)) and the result is exact for that quantised x (up to fp32 summation):
// what llama.cpp does. Float weight types, qmatmul's GEMM path, and every axpy (down rows) use x as it is.
//
// qmatmul(Tensor x, Tensor[] weights, int[] types, int gemm_min_t=-1) -> Tensor
//     x [T, in]; weights[i] [out_i, row_bytes_i] with `in` columns each -> y [T, sum out_i], the outputs side by
//     side (Q, K, V as one call). T < gemm_min_t (-1: this build's measured crossover, gemm_min_t() below):
//     streaming tiles on the stored bytes (q8 activations for block types); otherwise tiles of <= 256 rows
//     dequantised to fp32 + torch's single-threaded sgemm per thread (exact fp32).
// qffn_sparse(Tensor x, Tensor? gate, int gate_type, Tensor up, int up_type, Tensor down_t, int down_type,
//             Tensor? idx, Tensor? row_mask, int act, Tensor? up_bias, float cats_threshold) -> (Tensor, int)
//     The FFN of x [T, d] (T <= ~24) over the neurons idx (int64 [k], any order, no duplicates; None = all):
//     gate, up [n_ff, rb] and down_t [n_ff, rb_d] (row i = neuron i's output column), each row read once, in place.
//     act: 0 SwiGLU silu(g) u; 1 ReGLU relu(g) u; 2 dReLU relu(g) relu(u); 3 relu(u) and 4 gelu(u) (exact erf),
//     gate-less (gate None). u includes up_bias (f32 [n_ff]) when given. cats_threshold > 0 (SwiGLU): h = 0 where
//     |silu(g)| <= t. row_mask bool [T, k]: token t uses neuron idx[j] only where row_mask[t, j]. For 1, 2, 3 and
//     CATS the first row (gate; up for 3) decides: a neuron whose activation is 0 for every token has no other row
//     read. Returns (y [T, d], number of (token, neuron) pairs with a nonzero activation).
// qpredict_active(Tensor x, Tensor fc1, int fc1_type, Tensor fc2, int fc2_type, float threshold, Tensor? always,
//                 bool fc2_transposed=False) -> Tensor
//     PowerInfer's predictor for one token x [d] or [1, d]: fc1 [r, d], fc2 [n_ff, r] as stored (or fc2_transposed:
//     [r, n_ff], a converted copy: the second layer reads only the rows of hidden units that ReLU keeps). Returns the
//     ascending int64 indices i with fc2(relu(fc1 x))[i] >= threshold, merged with `always` (deduplicated).
// qembed(Tensor w, int type, Tensor ids) -> Tensor       rows ids (int64, any shape) as float32 [*ids.shape, cols]
// qdequant(Tensor w, int type) -> Tensor                 the whole matrix as float32 [rows, cols]
// ffn_sparse_rows(Tensor x, Tensor gate_up, Tensor down_t, Tensor idx, Tensor? row_mask, int act) -> (Tensor, int)
//     The fp32 layout of runtime/ffn/ops.py: gate_up [n_ff, 2, d], down_t [n_ff, d]; act 0-2; = qffn_sparse.
// predict_active(Tensor x, Tensor fc1, Tensor fc2_t, float threshold, Tensor? always) -> Tensor
//     fp32 fc1 [r, d] and fc2_t [r, n_ff]: qpredict_active with fc2_transposed.
// rms_norm(Tensor x, Tensor w, float eps) -> Tensor              x [T, d], w [d]
// ffn_act(Tensor? g, Tensor u, int act, Tensor? up_bias=None) -> Tensor
//     The FFN's hidden activation h = act(g, u + up_bias) as the C++ FFNs compute it (step.cpp ffn_act_rows), any
//     shape [..., n]; act as qffn_sparse's (0-2 with a gate g, 3-4 without).
// layer_norm(Tensor x, Tensor w, Tensor? b, float eps) -> Tensor x [T, d], w, b [d]
// attend_decode(Tensor qkv, Tensor rope, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, int n_head,
//               int n_head_kv, float scale, bool neox=False) -> Tensor
//     One token's RoPE + cache write + attention (attention.cpp); caches [n_head_kv, ctx, head_dim], float32 or
//     float16 (both the same). neox: rotary pairs (i, i + D/2) instead of (2i, 2i+1).
// attend_prompt(Tensor qkv, Tensor rope, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, int n_head,
//               int n_head_kv, float scale, bool neox=False) -> Tensor
//     attend_decode for T rows [T, (H + 2 Hkv) D] of one sequence at positions pos..pos+T-1, in one call (every row's
//     key and value written, then the rows' heads shared out: attention.cpp attend_rows); each row's bits are its
//     attend_decode's. rope: the whole table [>= pos + T, head_dim / 2, 2].
// device_layout(Tensor rows, int type, int cols, Tensor? q0, Tensor? q1, Tensor? so, int stride) -> Tensor
//     uint8 [n, stride]: file rows uint8 [n, row_bytes] in the GPU kernels' layout (device_layout.cpp), with the
//     int32 tile tables of runtime/gpu/layout.py (q0: 1024 entries, 512 for Q4; q1: Q4 only; so: block types).
// requant_q8_0(Tensor rows, int type, int cols) -> Tensor
//     uint8 [n, cols / 32 * 34]: rows [n, row_bytes] (row stride any) of Q5_0, Q5_1, Q4_K, Q5_K or Q6_K re-encoded as
//     ggml's Q8_0 (requant.cpp), the bytes gguf.quants' dequantise + Q8_0 quantise give.
// requant_q4_1(Tensor rows, int cols) -> Tensor
//     uint8 [n, cols / 32 * 20]: Q4_K rows [n, cols / 256 * 144] as Q4_1 blocks (requant.cpp: each sub-block's scale
//     and min rounded to f16, the nibbles repacked).
// ffn_mm(Tensor x, Tensor? gate, int gate_type, Tensor up, int up_type, Tensor down, int down_type, int act,
//        Tensor? up_bias) -> Tensor
//     The dense FFN of x [T, d] over a file's gate, up [n_ff, *] and ffn_down [d, n_ff]: qmatmul(x, [gate, up]), the
//     activation (act as qffn_sparse's; up_bias added to u), qmatmul(h, [down]). What DenseFFN and the step run.
// class DecodeStep (torch.classes.<ns>.DecodeStep): one token through every layer and the output head in one call;
//     runtime/cpu/step.py builds it (its docstring has the methods) and holds the tensors it points into.
// guard_map(addr, length, line) -> bool  a SIGBUS inside [addr, addr + length) prints line, exits 1 (on_sigbus)
// unguard_map(addr)   the map at addr is gone: forget it
// isa() -> str        the instruction-set path this build compiled ("avx512+vnni", "avx2", "portable", ...)
// gemm_min_t() -> int  qmatmul's default crossover: 64 (AVX-512), 48 (AVX2), 4 (portable)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "kernels.h"

#ifndef PINFER_NS
#define PINFER_NS pinfer
#endif

namespace {

using namespace pinfer;

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              ": a contiguous float32 CPU tensor");
}

// A stored matrix: uint8 [rows, row_bytes] (or the float dtype of a float type), rows contiguous, any row stride.
// cols: expected values per row (-1: any).
Mat as_mat(const at::Tensor& w, int64_t type, int64_t cols, const char* name) {
  TORCH_CHECK(type_known((int)type), name, ": unsupported weight type code ", type,
              " (F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14, IQ4_NL 20,"
              " IQ4_XS 23, BF16 30)");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2, name, ": a 2-d CPU tensor [rows, row_bytes]");
  const auto st = w.scalar_type();
  const bool dtype_ok = st == at::kByte || (type == F32 && st == at::kFloat) || (type == F16 && st == at::kHalf) ||
                        (type == BF16 && st == at::kBFloat16);
  TORCH_CHECK(dtype_ok, name, ": uint8 bytes (or the matching float dtype) for type ", type_name((int)type),
              ", got ", st);
  TORCH_CHECK(w.size(1) <= 1 || w.stride(1) == 1, name, ": each row must be contiguous");
  const int64_t es = w.element_size(), rb = w.size(1) * es, unit = unit_bytes((int)type);
  TORCH_CHECK(rb % unit == 0, name, ": ", rb, " bytes per row is not a whole number of ", type_name((int)type),
              " units (", unit, " bytes)");
  Mat m;
  m.p = static_cast<const uint8_t*>(w.data_ptr());
  m.rows = w.size(0);
  m.cols = rb / unit * unit_values((int)type);
  m.stride = w.size(0) > 1 ? w.stride(0) * es : rb;
  m.type = (int)type;
  TORCH_CHECK(cols < 0 || m.cols == cols, name, ": ", m.cols, " values per row, expected ", cols);
  return m;
}

// neuron rows that axpy reads (ffn_down_t, a transposed fc2): not the types only dot products read (quant.h dot_only)
void check_axpy(const Mat& m, const char* name) {
  TORCH_CHECK(!dot_only(m.type), name, ": ", type_name(m.type), " rows are read by dot products only; neuron rows "
              "(axpy) must be re-encoded (runtime/weights.py rows_runnable)");
}

void check_ids(const int64_t* p, int64_t n, int64_t hi, const char* name) {
  for (int64_t j = 0; j < n; ++j)  // an index out of range would read outside the weights
    TORCH_CHECK(p[j] >= 0 && p[j] < hi, name, ": index ", p[j], " out of range [0, ", hi, ")");
}

at::Tensor qmatmul_op(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types, int64_t gemm_min_t) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x: [T, in]");
  TORCH_CHECK(!weights.empty() && weights.size() == types.size(), "weights and types: one type per matrix");
  const int64_t T = x.size(0), K = x.size(1);
  std::vector<Mat> ws;
  int64_t N = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    ws.push_back(as_mat(weights[i], types[i], K, "weights"));
    N += ws.back().rows;
  }
  at::Tensor y = at::empty({T, N}, x.options());
  qmatmul(x.data_ptr<float>(), T, K, ws, y.data_ptr<float>(), gemm_min_t < 0 ? GEMM_MIN_T : gemm_min_t);
  return y;
}

std::tuple<at::Tensor, int64_t> qffn_sparse_op(const at::Tensor& x, const std::optional<at::Tensor>& gate,
                                               int64_t gate_type, const at::Tensor& up, int64_t up_type,
                                               const at::Tensor& down_t, int64_t down_type,
                                               const std::optional<at::Tensor>& idx,
                                               const std::optional<at::Tensor>& row_mask, int64_t act,
                                               const std::optional<at::Tensor>& up_bias, double cats) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x: [T, d]");
  TORCH_CHECK(act >= SWIGLU && act <= GELU_NOGATE,
              "act: 0 SwiGLU, 1 ReGLU, 2 dReLU, 3 ReLU (no gate), 4 GELU (no gate)");
  const bool gated = act <= DRELU;
  TORCH_CHECK(gated == gate.has_value(), gated ? "act 0-2 need a gate matrix" : "act 3-4 are gate-less: gate=None");
  TORCH_CHECK(cats >= 0 && (cats == 0 || act == SWIGLU), "cats_threshold: >= 0, and only for SwiGLU (act 0)");
  FFN f;
  f.x = x.data_ptr<float>();
  f.T = x.size(0);
  f.d = x.size(1);
  f.up = as_mat(up, up_type, f.d, "up");
  const int64_t n_ff = f.up.rows;
  if (gated) {
    f.gate = as_mat(*gate, gate_type, f.d, "gate");
    TORCH_CHECK(f.gate.rows == n_ff, "gate and up: the same number of rows (n_ff)");
  }
  f.down_t = as_mat(down_t, down_type, f.d, "down_t");
  check_axpy(f.down_t, "down_t");
  TORCH_CHECK(f.down_t.rows == n_ff, "down_t: [n_ff, d] (row i = neuron i's output column)");
  f.k = n_ff;
  if (idx.has_value()) {
    TORCH_CHECK(idx->scalar_type() == at::kLong && idx->dim() == 1 && idx->is_contiguous(),
                "idx: contiguous int64 [k]");
    f.idx = idx->data_ptr<int64_t>();
    f.k = idx->numel();
    check_ids(f.idx, f.k, n_ff, "idx");
  }
  if (row_mask.has_value()) {
    TORCH_CHECK(row_mask->scalar_type() == at::kBool && row_mask->dim() == 2 && row_mask->size(0) == f.T &&
                    row_mask->size(1) == f.k && (f.k <= 1 || row_mask->stride(1) == 1),
                "row_mask: bool [T, k] with unit column stride");
    f.mask = row_mask->data_ptr<bool>();
    f.mask_stride = row_mask->stride(0);
  }
  if (up_bias.has_value()) {
    check_f32(*up_bias, "up_bias");
    TORCH_CHECK(up_bias->numel() == n_ff, "up_bias: float32 [n_ff]");
    f.up_bias = up_bias->data_ptr<float>();
  }
  f.act = (int)act;
  f.cats = (float)cats;
  at::Tensor y = at::empty({f.T, f.d}, x.options());
  const int64_t nonzero = ffn_sparse(f, y.data_ptr<float>());
  return {y, nonzero};
}

at::Tensor indices_tensor(const std::vector<int64_t>& v) {
  at::Tensor out = at::empty({(int64_t)v.size()}, at::TensorOptions().dtype(at::kLong));
  std::copy(v.begin(), v.end(), out.data_ptr<int64_t>());
  return out;
}

at::Tensor qpredict_active_op(const at::Tensor& x, const at::Tensor& fc1, int64_t fc1_type, const at::Tensor& fc2,
                              int64_t fc2_type, double threshold, const std::optional<at::Tensor>& always,
                              bool fc2_transposed) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 1 || (x.dim() == 2 && x.size(0) == 1), "x: one token, [d] or [1, d]");
  const Mat m1 = as_mat(fc1, fc1_type, x.numel(), "fc1");
  const Mat m2 = as_mat(fc2, fc2_type, fc2_transposed ? -1 : m1.rows, "fc2");
  if (fc2_transposed) check_axpy(m2, "fc2");
  TORCH_CHECK(!fc2_transposed || m2.rows == m1.rows, "fc2 (transposed): [r, n_ff] with r = fc1's rows");
  const int64_t n_ff = fc2_transposed ? m2.cols : m2.rows;
  const int64_t* ap = nullptr;
  int64_t na = 0;
  if (always.has_value()) {
    TORCH_CHECK(always->scalar_type() == at::kLong && always->is_contiguous(), "always: contiguous int64");
    ap = always->data_ptr<int64_t>();
    na = always->numel();
    check_ids(ap, na, n_ff, "always");
  }
  return indices_tensor(predict_active(x.data_ptr<float>(), m1, m2, fc2_transposed, (float)threshold, ap, na));
}

at::Tensor qembed_op(const at::Tensor& w, int64_t type, const at::Tensor& ids) {
  const Mat m = as_mat(w, type, -1, "w");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids: int64");
  const at::Tensor idc = ids.contiguous();
  check_ids(idc.data_ptr<int64_t>(), idc.numel(), m.rows, "ids");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(m.cols);
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  dequant_rows(m, idc.data_ptr<int64_t>(), idc.numel(), out.data_ptr<float>());
  return out;
}

at::Tensor qdequant_op(const at::Tensor& w, int64_t type) {
  const Mat m = as_mat(w, type, -1, "w");
  at::Tensor out = at::empty({m.rows, m.cols}, at::TensorOptions().dtype(at::kFloat));
  dequant_rows(m, nullptr, m.rows, out.data_ptr<float>());
  return out;
}

std::tuple<at::Tensor, int64_t> ffn_sparse_rows_op(const at::Tensor& x, const at::Tensor& gate_up,
                                                   const at::Tensor& down_t, const at::Tensor& idx,
                                                   const std::optional<at::Tensor>& row_mask, int64_t act) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x: [T, d]");
  const int64_t d = x.size(1);
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) == 2 && gate_up.size(2) == d, "gate_up: float32 [n_ff, 2, d]");
  TORCH_CHECK(act >= SWIGLU && act <= DRELU, "act: 0 (silu), 1 (relu) or 2 (drelu)");
  // gate and up rows interleaved: strided views of one buffer, row stride 2 d
  const at::Tensor g = gate_up.select(1, 0), u = gate_up.select(1, 1);
  return qffn_sparse_op(x, g, F32, u, F32, down_t, F32, idx, row_mask, act, std::nullopt, 0.0);
}

at::Tensor predict_active_op(const at::Tensor& x, const at::Tensor& fc1, const at::Tensor& fc2_t, double threshold,
                             const std::optional<at::Tensor>& always) {
  check_f32(fc1, "fc1");
  check_f32(fc2_t, "fc2_t");
  return qpredict_active_op(x, fc1, F32, fc2_t, F32, threshold, always, true);
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "x [T, d], w [d]");
  at::Tensor y = at::empty_like(x);
  rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), x.size(0), x.size(1), (float)eps, y.data_ptr<float>());
  return y;
}

at::Tensor ffn_act_op(const std::optional<at::Tensor>& g, const at::Tensor& u, int64_t act,
                      const std::optional<at::Tensor>& up_bias) {
  check_f32(u, "u");
  TORCH_CHECK(act >= SWIGLU && act <= GELU_NOGATE, "act: 0..4");
  const int64_t n = u.dim() ? u.size(-1) : 1, rows = n ? u.numel() / n : 0;
  if (g.has_value()) {
    check_f32(*g, "g");
    TORCH_CHECK(g->sizes() == u.sizes(), "g and u: the same shape");
  }
  TORCH_CHECK(g.has_value() == (act <= DRELU), "a gate for acts 0-2 (SwiGLU, ReGLU, dReLU), none for 3-4");
  if (up_bias.has_value()) {
    check_f32(*up_bias, "up_bias");
    TORCH_CHECK(up_bias->dim() == 1 && up_bias->size(0) == n, "up_bias [n]");
  }
  at::Tensor h = at::empty_like(u);
  for (int64_t r = 0; r < rows; ++r)
    ffn_act_rows((int)act, g.has_value() ? g->data_ptr<float>() + r * n : nullptr, u.data_ptr<float>() + r * n,
                 up_bias.has_value() ? up_bias->data_ptr<float>() : nullptr, n, h.data_ptr<float>() + r * n);
  return h;
}

at::Tensor layer_norm_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "x [T, d], w [d]");
  if (b.has_value()) {
    check_f32(*b, "b");
    TORCH_CHECK(b->numel() == x.size(1), "b [d]");
  }
  at::Tensor y = at::empty_like(x);
  layer_norm(x.data_ptr<float>(), w.data_ptr<float>(), b ? b->data_ptr<float>() : nullptr, x.size(0), x.size(1),
             (float)eps, y.data_ptr<float>());
  return y;
}

// attend_decode's and attend_prompt's heads and caches: n_head a multiple of n_head_kv, caches [n_head_kv, ctx, D]
// contiguous, float32 or float16 alike, D even
void check_heads_and_caches(int64_t H, int64_t Hkv, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0, "n_head must be a multiple of n_head_kv");
  const auto kt = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(0) == Hkv && (kt == at::kFloat || kt == at::kHalf) &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == kt &&
                  v_cache.is_contiguous(),
              "k_cache, v_cache: contiguous float32 or float16 [n_head_kv, max_ctx, head_dim], the same dtype");
  TORCH_CHECK(k_cache.size(2) % 2 == 0, "head_dim must be even");
}

at::Tensor attend_decode_op(const at::Tensor& qkv, const at::Tensor& rope, at::Tensor k_cache, at::Tensor v_cache,
                            int64_t pos, int64_t n_head, int64_t n_head_kv, double scale, bool neox) {
  const int64_t H = n_head, Hkv = n_head_kv;
  check_heads_and_caches(H, Hkv, k_cache, v_cache);
  const auto kt = k_cache.scalar_type();
  const int64_t ctx = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(pos >= 0 && pos < ctx, "position ", pos, " outside the cache [0, ", ctx, ")");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.numel() == (H + 2 * Hkv) * D && qkv.stride(-1) == 1 &&
                  (qkv.dim() == 1 || qkv.size(0) == 1),
              "qkv: float32 [1, (n_head + 2 n_head_kv) head_dim]");
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.is_contiguous() && rope.numel() == D,
              "rope: contiguous float32 [head_dim / 2, 2]");
  at::Tensor out = at::empty({1, H * D}, qkv.options());
  if (kt == at::kFloat)
    attend_decode<float>(qkv.data_ptr<float>(), rope.data_ptr<float>(), k_cache.data_ptr<float>(),
                         v_cache.data_ptr<float>(), ctx, D, pos, H, Hkv, (float)scale, neox, out.data_ptr<float>());
  else
    attend_decode<uint16_t>(qkv.data_ptr<float>(), rope.data_ptr<float>(),
                            reinterpret_cast<uint16_t*>(k_cache.data_ptr()),
                            reinterpret_cast<uint16_t*>(v_cache.data_ptr()), ctx, D, pos, H, Hkv, (float)scale, neox,
                            out.data_ptr<float>());
  return out;
}

at::Tensor attend_prompt_op(const at::Tensor& qkv, const at::Tensor& rope, at::Tensor k_cache, at::Tensor v_cache,
                            int64_t pos, int64_t n_head, int64_t n_head_kv, double scale, bool neox) {
  const int64_t H = n_head, Hkv = n_head_kv;
  check_heads_and_caches(H, Hkv, k_cache, v_cache);
  const auto kt = k_cache.scalar_type();
  const int64_t ctx = k_cache.size(1), D = k_cache.size(2), nq = (H + 2 * Hkv) * D;
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.size(1) == nq && qkv.stride(1) == 1,
              "qkv: float32 [T, (n_head + 2 n_head_kv) head_dim], rows contiguous");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(pos >= 0 && pos + T <= ctx, "positions [", pos, ", ", pos + T, ") outside the cache [0, ", ctx, ")");
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.is_contiguous() && rope.dim() == 3 && rope.size(1) * 2 == D &&
                  rope.size(2) == 2 && rope.size(0) >= pos + T,
              "rope: the contiguous float32 table [>= pos + T, head_dim / 2, 2]");
  at::Tensor out = at::empty({T, H * D}, qkv.options());
  std::vector<int64_t> ps(T);
  for (int64_t t = 0; t < T; ++t) ps[t] = pos + t;
  if (kt == at::kFloat) {
    std::vector<float*> kp(T, k_cache.data_ptr<float>()), vp(T, v_cache.data_ptr<float>());
    attend_rows<float>(T, qkv.data_ptr<float>(), qkv.stride(0), rope.data_ptr<float>(), kp.data(), vp.data(), ctx, D,
                       ps.data(), H, Hkv, (float)scale, neox, out.data_ptr<float>());
  } else {
    std::vector<uint16_t*> kp(T, reinterpret_cast<uint16_t*>(k_cache.data_ptr())),
        vp(T, reinterpret_cast<uint16_t*>(v_cache.data_ptr()));
    attend_rows<uint16_t>(T, qkv.data_ptr<float>(), qkv.stride(0), rope.data_ptr<float>(), kp.data(), vp.data(), ctx,
                          D, ps.data(), H, Hkv, (float)scale, neox, out.data_ptr<float>());
  }
  return out;
}

at::Tensor int32_table(const std::optional<at::Tensor>& t, int64_t n, int64_t bound, const char* name) {
  TORCH_CHECK(t.has_value(), name, ": required for this type");
  TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->numel() == n, name, ": ", n,
              " contiguous int32 values");
  const int32_t* p = t->data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(p[i] >= 0 && p[i] < bound, name, "[", i, "] out of range");
  return *t;
}

at::Tensor device_layout_op(const at::Tensor& rows, int64_t type, int64_t cols, const std::optional<at::Tensor>& q0,
                            const std::optional<at::Tensor>& q1, const std::optional<at::Tensor>& so, int64_t stride) {
  TORCH_CHECK(type == F32 || type == F16 || type == BF16 || type == Q4_0 || type == Q4_1 || type == Q8_0,
              "device_layout: unsupported type ", type);
  TORCH_CHECK(cols > 0 && cols % 32 == 0, "device_layout: cols must be a positive multiple of 32");
  const int64_t rb = row_bytes((int)type, cols);
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.size(1) == rb &&
                  rows.is_contiguous(),
              "rows: contiguous uint8 [n, ", rb, "]");
  TORCH_CHECK(stride >= rb, "stride ", stride, " is shorter than a row (", rb, " bytes)");
  const bool q4 = type == Q4_0 || type == Q4_1, halves = type == F16 || type == BF16;
  at::Tensor t0, t1, ts;
  if (type != F32) t0 = int32_table(q0, q4 ? 512 : 1024, 1024, "q0");
  if (q4) t1 = int32_table(q1, 512, 1024, "q1");
  if (type != F32 && !halves) ts = int32_table(so, 32, 32, "so");
  at::Tensor out = at::empty({rows.size(0), stride}, at::TensorOptions().dtype(at::kByte));
  device_layout(rows.data_ptr<uint8_t>(), rows.size(0), rb, (int)type, cols,
                t0.defined() ? t0.data_ptr<int32_t>() : nullptr, t1.defined() ? t1.data_ptr<int32_t>() : nullptr,
                ts.defined() ? ts.data_ptr<int32_t>() : nullptr, out.data_ptr<uint8_t>(), stride);
  return out;
}

at::Tensor requant_q8_0_op(const at::Tensor& rows, int64_t type, int64_t cols) {
  TORCH_CHECK(requant_type_known((int)type), "requant_q8_0: unsupported type ", type,
              " (Q5_0 6, Q5_1 7, Q4_K 12, Q5_K 13, Q6_K 14, IQ4_NL 20, IQ4_XS 23)");
  const int64_t rb = requant_row_bytes((int)type, cols);
  TORCH_CHECK(cols > 0 && cols % unit_values((int)type) == 0,
              "requant_q8_0: cols must be a positive multiple of the type's block");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.size(1) == rb &&
                  rows.stride(1) == 1,
              "rows: uint8 [n, ", rb, "], each row contiguous");
  at::Tensor out = at::empty({rows.size(0), cols / 32 * 34}, at::TensorOptions().dtype(at::kByte));
  requant_q8_0(rows.data_ptr<uint8_t>(), rows.size(0), rows.stride(0), (int)type, cols, out.data_ptr<uint8_t>());
  return out;
}

at::Tensor requant_q4_1_op(const at::Tensor& rows, int64_t cols) {
  TORCH_CHECK(cols > 0 && cols % 256 == 0, "requant_q4_1: cols must be a positive multiple of 256");
  const int64_t rb = cols / 256 * 144;
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.size(1) == rb &&
                  rows.stride(1) == 1,
              "rows: uint8 Q4_K [n, ", rb, "], each row contiguous");
  at::Tensor out = at::empty({rows.size(0), cols / 32 * 20}, at::TensorOptions().dtype(at::kByte));
  requant_q4k_q4_1(rows.data_ptr<uint8_t>(), rows.size(0), rows.stride(0), cols, out.data_ptr<uint8_t>());
  return out;
}

Mat opt_mat(const std::optional<at::Tensor>& w, int64_t type, int64_t cols, const char* name) {
  return w.has_value() ? as_mat(*w, type, cols, name) : Mat{};
}

const float* opt_vec(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return nullptr;
  check_f32(*t, name);
  TORCH_CHECK(t->numel() == n, name, ": float32 [", n, "]");
  return t->data_ptr<float>();
}

at::Tensor ffn_mm_op(const at::Tensor& x, const std::optional<at::Tensor>& gate, int64_t gate_type,
                     const at::Tensor& up, int64_t up_type, const at::Tensor& down, int64_t down_type, int64_t act,
                     const std::optional<at::Tensor>& up_bias) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x: [T, d]");
  TORCH_CHECK(act >= SWIGLU && act <= GELU_NOGATE && (act <= DRELU) == gate.has_value(),
              "act: 0-2 with a gate, 3-4 without");
  const int64_t d = x.size(1);
  const Mat u = as_mat(up, up_type, d, "up"), g = opt_mat(gate, gate_type, d, "gate");
  TORCH_CHECK(!g.p || g.rows == u.rows, "gate and up: the same number of rows");
  const Mat dn = as_mat(down, down_type, u.rows, "down");
  TORCH_CHECK(dn.rows == d, "down: [d, n_ff]");
  at::Tensor y = at::empty({x.size(0), d}, x.options());
  ffn_mm(x.data_ptr<float>(), x.size(0), d, g, u, dn, (int)act, opt_vec(up_bias, u.rows, "up_bias"),
         y.data_ptr<float>());
  return y;
}

// The step over tensors that Python keeps alive too (the model's weights and caches); `keep` holds a reference to
// every one anyway, so a step never points into freed memory.
struct DecodeStep : torch::CustomClassHolder {
  StepShape shape;
  at::Tensor rope;  // [max_pos, D/2, 2]
  std::vector<LayerStep> layers;
  std::vector<at::Tensor> keep;
  NormW out_norm;
  std::vector<Mat> out_w;
  int64_t vocab = 0;
  std::vector<int64_t> active;
  StepScratch sc;
  std::vector<float> xbuf, xo, xn;
  std::vector<LogitFacts> facts, facts_parts;  // head_facts(): the last call's rows; the team's threads' parts
  std::vector<SlotCache> slots{1};  // slot 0: the caches add_attention was given; add_cache appends others
  bool team = true;  // run, run_rows: decode_team where it applies (set_team(false): decode_layers/rows, to compare)

  DecodeStep(int64_t d, int64_t n_head, int64_t n_head_kv, double scale, bool neox, const at::Tensor& rope_cs) {
    TORCH_CHECK(d > 0 && n_head > 0 && n_head_kv > 0 && n_head % n_head_kv == 0, "DecodeStep: bad head counts");
    check_f32(rope_cs, "rope");
    TORCH_CHECK(rope_cs.dim() == 3 && rope_cs.size(2) == 2, "rope: [max_pos, head_dim / 2, 2]");
    shape.d = d, shape.H = n_head, shape.Hkv = n_head_kv, shape.D = 2 * rope_cs.size(1);
    shape.scale = (float)scale, shape.neox = neox;
    rope = rope_cs;
  }

  const float* vec(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
    if (t.has_value()) keep.push_back(*t);
    return opt_vec(t, n, name);
  }
  Mat mat(const at::Tensor& w, int64_t type, int64_t cols, const char* name) {
    keep.push_back(w);
    return as_mat(w, type, cols, name);
  }
  std::vector<Mat> mats(const std::vector<at::Tensor>& ws, const std::vector<int64_t>& types, int64_t cols,
                        const char* name) {
    TORCH_CHECK(!ws.empty() && ws.size() == types.size(), name, ": one type per matrix");
    std::vector<Mat> out;
    for (size_t i = 0; i < ws.size(); ++i) out.push_back(mat(ws[i], types[i], cols, name));
    return out;
  }
  NormW norm(const at::Tensor& w, const std::optional<at::Tensor>& b, double eps, bool layer) {
    NormW n;
    n.w = vec(w, shape.d, "norm w");
    n.b = vec(b, shape.d, "norm b");
    n.eps = (float)eps, n.layer = layer;
    return n;
  }
  LayerStep& last() {
    TORCH_CHECK(!layers.empty(), "DecodeStep: add_attention first");
    return layers.back();
  }

  void add_attention(const at::Tensor& nw, const std::optional<at::Tensor>& nb, double eps, bool layer_norm_,
                     std::vector<at::Tensor> qkv, std::vector<int64_t> qkv_types,
                     const std::optional<at::Tensor>& bqkv, std::vector<at::Tensor> wo, std::vector<int64_t> wo_types,
                     const std::optional<at::Tensor>& bo, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     bool parallel) {
    const int64_t d = shape.d, D = shape.D, H = shape.H, Hkv = shape.Hkv;
    LayerStep L;
    L.attn_norm = norm(nw, nb, eps, layer_norm_);
    L.qkv = mats(qkv, qkv_types, d, "qkv");
    TORCH_CHECK(rows_of(L.qkv) == (H + 2 * Hkv) * D, "qkv: (n_head + 2 n_head_kv) head_dim rows");
    L.bqkv = vec(bqkv, (H + 2 * Hkv) * D, "bqkv");
    L.wo = mats(wo, wo_types, H * D, "wo");
    TORCH_CHECK(rows_of(L.wo) == d, "wo: d rows");
    L.bo = vec(bo, d, "bo");
    const auto kt = k_cache.scalar_type();
    TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(0) == Hkv && k_cache.size(2) == D &&
                    (kt == at::kFloat || kt == at::kHalf) && k_cache.is_contiguous() &&
                    v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == kt && v_cache.is_contiguous(),
                "k_cache, v_cache: contiguous float32 or float16 [n_head_kv, ctx, head_dim], the same dtype");
    TORCH_CHECK(k_cache.size(1) <= rope.size(0), "the cache is longer than the rope table");
    keep.push_back(k_cache), keep.push_back(v_cache);
    L.k_cache = k_cache.data_ptr(), L.v_cache = v_cache.data_ptr(), L.kv_half = kt == at::kHalf;
    slots[0].k.push_back(L.k_cache), slots[0].v.push_back(L.v_cache);
    L.ctx = k_cache.size(1);
    L.parallel = parallel;
    L.ffn_norm_shared = true;  // until set_ffn_norm
    layers.push_back(std::move(L));
    active.push_back(0);
  }

  void set_ffn_norm(const at::Tensor& w, const std::optional<at::Tensor>& b, double eps, bool layer_norm_) {
    LayerStep& L = last();
    L.ffn_norm = norm(w, b, eps, layer_norm_);
    L.ffn_norm_shared = false;
  }

  void set_ffn(int64_t kind, const std::optional<at::Tensor>& gate, int64_t gate_type, const at::Tensor& up,
               int64_t up_type, const at::Tensor& down, int64_t down_type, int64_t act,
               const std::optional<at::Tensor>& up_bias, double cats, const std::optional<at::Tensor>& ffn_bias) {
    LayerStep& L = last();
    const int64_t d = shape.d;
    TORCH_CHECK(kind >= FFN_MM && kind <= FFN_PRED, "kind: 0 (ffn_down), 1 (rows), 2 (predicted rows)");
    TORCH_CHECK(act >= SWIGLU && act <= GELU_NOGATE && (act <= DRELU) == gate.has_value(),
                "act: 0-2 with a gate, 3-4 without");
    TORCH_CHECK(cats >= 0 && (cats == 0 || act == SWIGLU), "cats: only for SwiGLU");
    TORCH_CHECK(L.parallel || !L.ffn_norm_shared, "a sequential layer needs set_ffn_norm");
    L.kind = (int)kind;
    L.up = mat(up, up_type, d, "up");
    if (gate.has_value()) L.gate = mat(*gate, gate_type, d, "gate");
    TORCH_CHECK(!L.gate.p || L.gate.rows == L.up.rows, "gate and up: the same number of rows");
    const int64_t n_ff = L.up.rows;
    L.down = mat(down, down_type, kind == FFN_MM ? n_ff : d, "down");
    if (kind != FFN_MM) check_axpy(L.down, "down");
    TORCH_CHECK(L.down.rows == (kind == FFN_MM ? d : n_ff),
                kind == FFN_MM ? "down: ffn_down [d, n_ff]" : "down: ffn_down_t [n_ff, d]");
    L.act = (int)act;
    L.up_bias = vec(up_bias, n_ff, "up_bias");
    L.cats = (float)cats;
    L.ffn_bias = vec(ffn_bias, d, "ffn_bias");
  }

  void set_predictor(const at::Tensor& fc1, int64_t fc1_type, const at::Tensor& fc2, int64_t fc2_type,
                     bool fc2_transposed, double threshold, const std::optional<at::Tensor>& always) {
    LayerStep& L = last();
    TORCH_CHECK(L.kind == FFN_PRED, "set_predictor: for a layer of kind 2, after set_ffn");
    L.fc1 = mat(fc1, fc1_type, shape.d, "fc1");
    L.fc2 = mat(fc2, fc2_type, fc2_transposed ? L.up.rows : L.fc1.rows, "fc2");
    if (fc2_transposed) check_axpy(L.fc2, "fc2");
    TORCH_CHECK(fc2_transposed ? L.fc2.rows == L.fc1.rows : L.fc2.rows == L.up.rows, "fc2: [n_ff, r] or [r, n_ff]");
    L.fc2_transposed = fc2_transposed, L.threshold = (float)threshold;
    L.always.clear();
    if (always.has_value()) {
      TORCH_CHECK(always->scalar_type() == at::kLong && always->is_contiguous(), "always: contiguous int64");
      check_ids(always->data_ptr<int64_t>(), always->numel(), L.up.rows, "always");
      L.always.assign(always->data_ptr<int64_t>(), always->data_ptr<int64_t>() + always->numel());
    }
  }

  void set_output(const at::Tensor& nw, const std::optional<at::Tensor>& nb, double eps, bool layer_norm_,
                  std::vector<at::Tensor> ws, std::vector<int64_t> types) {
    out_norm = norm(nw, nb, eps, layer_norm_);
    out_w = mats(ws, types, shape.d, "output");
    vocab = rows_of(out_w);
  }

  void check_ready() const {
    TORCH_CHECK(vocab > 0, "DecodeStep: set_output first");
    for (const LayerStep& L : layers)
      TORCH_CHECK(L.up.p && (L.kind != FFN_PRED || L.fc1.p), "DecodeStep: a layer without its FFN");
  }

  // Another KV cache, one [Hkv, ctx, D] tensor per layer shaped and typed as the layers' own -> its slot number for
  // run_rows (the caches are kept alive here)
  int64_t add_cache(std::vector<at::Tensor> k, std::vector<at::Tensor> v) {
    TORCH_CHECK(k.size() == layers.size() && v.size() == layers.size(), "add_cache: one k and one v per layer");
    SlotCache c;
    for (size_t l = 0; l < layers.size(); ++l) {
      const LayerStep& L = layers[l];
      for (const at::Tensor* t : {&k[l], &v[l]}) {
        TORCH_CHECK(t->is_contiguous() && t->dim() == 3 && t->size(0) == shape.Hkv && t->size(1) == L.ctx &&
                        t->size(2) == shape.D && t->scalar_type() == (L.kv_half ? at::kHalf : at::kFloat),
                    "add_cache: layer ", l, "'s cache must be shaped and typed as the step's own");
        keep.push_back(*t);
      }
      c.k.push_back(k[l].data_ptr()), c.v.push_back(v[l].data_ptr());
    }
    slots.push_back(std::move(c));
    return (int64_t)slots.size() - 1;
  }

  // x [T, d]: T rows' embeddings, row t at position pos[t] of cache slot[t] (a slot's rows in position order) ->
  // logits [k, vocab] of the rows out_rows [k]. Each row's logits and cache rows are the bits `run` gives it alone
  // (step.cpp decode_rows), so which rows share a call never changes an answer.
  at::Tensor run_rows(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& slot, const at::Tensor& out_rows) {
    check_ready();
    check_f32(x, "x");
    const int64_t d = shape.d, T = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == d && T >= 1, "x: [T, d]");
    TORCH_CHECK(T < GEMM_MIN_T, "run_rows: at most ", GEMM_MIN_T - 1, " rows (the kernels' rows stay independent)");
    for (const at::Tensor* t : {&pos, &slot, &out_rows})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), "pos, slot, out_rows: int64");
    TORCH_CHECK(pos.numel() == T && slot.numel() == T, "pos, slot: one per row");
    const int64_t *p = pos.data_ptr<int64_t>(), *sl = slot.data_ptr<int64_t>(), *o = out_rows.data_ptr<int64_t>();
    const int64_t ctx = layers.empty() ? 0 : layers[0].ctx;
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(sl[t] >= 0 && sl[t] < (int64_t)slots.size(), "row ", t, ": no cache slot ", sl[t]);
      TORCH_CHECK(p[t] >= 0 && p[t] < ctx, "row ", t, ": position ", p[t], " outside the cache");
      for (int64_t u = 0; u < t; ++u)
        TORCH_CHECK(sl[u] != sl[t] || p[u] < p[t], "rows ", u, " and ", t, ": a slot's rows in position order");
    }
    for (int64_t i = 0; i < out_rows.numel(); ++i) TORCH_CHECK(o[i] >= 0 && o[i] < T, "out_rows: row out of range");
    xbuf.assign(x.data_ptr<float>(), x.data_ptr<float>() + T * d);
    if (team && num_threads() > 1 && team_step_applies(layers)) return team_logits(T, p, sl, o, out_rows.numel());
    decode_rows(shape, layers, slots, rope.data_ptr<float>(), T, p, sl, xbuf.data(), active.data(), sc);
    const int64_t k = out_rows.numel();
    xo.resize(k * d);
    for (int64_t i = 0; i < k; ++i) std::copy_n(xbuf.data() + o[i] * d, d, xo.data() + i * d);
    at::Tensor logits = at::empty({k, vocab}, x.options());
    if (k) {
      xn.resize(k * d);
      apply_norm(out_norm, xo.data(), k, d, xn.data());
      qmatmul(xn.data(), k, d, out_w, logits.data_ptr<float>(), GEMM_MIN_T);
    }
    take_facts(logits);
    return logits;
  }

  // x [1, d]: the token's embedding at position pos -> logits [1, vocab]
  at::Tensor run(const at::Tensor& x, int64_t pos) {
    check_ready();
    check_f32(x, "x");
    TORCH_CHECK(x.numel() == shape.d, "x: [1, d]");
    for (const LayerStep& L : layers) TORCH_CHECK(pos >= 0 && pos < L.ctx, "position ", pos, " outside the cache");
    xbuf.assign(x.data_ptr<float>(), x.data_ptr<float>() + shape.d);
    const float* rp = rope.data_ptr<float>() + pos * shape.D;
    if (team && num_threads() > 1 && team_step_applies(layers)) {
      const int64_t zero = 0;
      return team_logits(1, &pos, &zero, &zero, 1);
    }
    decode_layers(shape, layers, 0, (int64_t)layers.size(), rp, pos, xbuf.data(), active.data(), sc);
    xo.resize(shape.d);
    apply_norm(out_norm, xbuf.data(), 1, shape.d, xo.data());
    at::Tensor logits = at::empty({1, vocab}, x.options());
    qmatmul(xo.data(), 1, shape.d, out_w, logits.data_ptr<float>(), GEMM_MIN_T);
    take_facts(logits);
    return logits;
  }

  // [k, 2] int64 of the last run's or run_rows' logits rows: (1 if every value is finite else 0, the index of the
  // first largest value, -1 where not finite): what finite() and a greedy sampler read (model.py head_facts)
  at::Tensor head_facts() {
    const int64_t k = (int64_t)facts.size();
    at::Tensor out = at::empty({k, 2}, at::TensorOptions().dtype(at::kLong));
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t i = 0; i < k; ++i) o[2 * i] = facts[i].finite, o[2 * i + 1] = facts[i].best;
    return out;
  }

  // x [1, d], the residual entering layer l0 -> the residual leaving layer l1 - 1, no head: the layers an executor
  // runs on the CPU between parts it runs elsewhere
  at::Tensor run_layers(const at::Tensor& x, int64_t pos, int64_t l0, int64_t l1) {
    check_f32(x, "x");
    TORCH_CHECK(x.numel() == shape.d, "x: [1, d]");
    TORCH_CHECK(0 <= l0 && l0 <= l1 && l1 <= (int64_t)layers.size(), "layers [", l0, ", ", l1, ") out of range");
    for (int64_t l = l0; l < l1; ++l) TORCH_CHECK(pos >= 0 && pos < layers[l].ctx, "position outside the cache");
    at::Tensor out = x.clone().view({1, shape.d});
    decode_layers(shape, layers, l0, l1, rope.data_ptr<float>() + pos * shape.D, pos, out.data_ptr<float>(),
                  active.data(), sc);
    return out;
  }

  // Layer l's FFN for one token's normed input xf [1, d] over the neurons idx only (int64, any order, no duplicates):
  // the part of a layer an executor leaves the CPU (the hybrid's CPU rows). The layer's FFN must be neuron-major
  // (kinds 1 and 2). -> (y [1, d] without the down bias, nonzero activations)
  std::tuple<at::Tensor, int64_t> ffn_subset(int64_t l, const at::Tensor& xf, const at::Tensor& idx) {
    TORCH_CHECK(0 <= l && l < (int64_t)layers.size(), "layer ", l, " out of range");
    const LayerStep& L = layers[l];
    TORCH_CHECK(L.kind != FFN_MM, "ffn_subset: layer ", l, " has no neuron-major rows (ffn_down_t)");
    check_f32(xf, "xf");
    TORCH_CHECK(xf.numel() == shape.d, "xf: [1, d]");
    TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1 && idx.is_contiguous(), "idx: contiguous int64 [k]");
    check_ids(idx.data_ptr<int64_t>(), idx.numel(), L.up.rows, "idx");
    FFN q;
    q.x = xf.data_ptr<float>(), q.T = 1, q.d = shape.d, q.gate = L.gate, q.up = L.up, q.down_t = L.down;
    q.idx = idx.data_ptr<int64_t>(), q.k = idx.numel(), q.act = L.act, q.up_bias = L.up_bias, q.cats = L.cats;
    at::Tensor y = at::empty({1, shape.d}, xf.options());
    const int64_t nz = ffn_sparse(q, y.data_ptr<float>());
    return {y, nz};
  }

  // decode_team over xbuf's T rows (at positions p, in slots sl) -> the logits of the rows o [k]; facts: those of
  // the team's threads' shares, joined
  at::Tensor team_logits(int64_t T, const int64_t* p, const int64_t* sl, const int64_t* o, int64_t k) {
    at::Tensor logits = at::empty({k, vocab}, at::TensorOptions().dtype(at::kFloat));
    const int64_t nt = num_threads();
    facts_parts.assign(k * nt, LogitFacts{});
    const TeamHead head{&out_norm, &out_w, o, k, logits.data_ptr<float>(), facts_parts.data(), nt};
    decode_team(shape, layers, slots, rope.data_ptr<float>(), T, p, sl, xbuf.data(), active.data(), sc, &head);
    facts.resize(k);
    for (int64_t i = 0; i < k; ++i) facts[i] = join_facts(facts_parts.data() + i * nt, nt);
    return logits;
  }
  void take_facts(const at::Tensor& logits) {  // the head's logits [k, vocab], computed off the team
    const int64_t k = logits.size(0);
    facts.resize(k);
    for (int64_t i = 0; i < k; ++i) facts[i] = logit_facts(logits.data_ptr<float>() + i * vocab, 0, vocab);
  }

  // the nonzero (token, neuron) pairs per layer since the last call (and resets them)
  at::Tensor take_active() {
    at::Tensor out = at::empty({(int64_t)active.size()}, at::TensorOptions().dtype(at::kLong));
    std::copy(active.begin(), active.end(), out.data_ptr<int64_t>());
    std::fill(active.begin(), active.end(), 0);
    return out;
  }

  // [2, n_layer]: per layer with predictors, the neurons whose rows the calls since the last take read (a batch's
  // rows: the union of their predicted neurons, each row computed over its own) and the calls; 0 elsewhere (resets)
  at::Tensor take_read() {
    const int64_t n = (int64_t)layers.size();
    at::Tensor out = at::empty({2, n}, at::TensorOptions().dtype(at::kLong));
    int64_t* o = out.data_ptr<int64_t>();
    std::fill(o, o + 2 * n, 0);
    for (int64_t l = 0; l < std::min(n, (int64_t)sc.read.size()); ++l) o[l] = sc.read[l], o[n + l] = sc.read_calls[l];
    std::fill(sc.read.begin(), sc.read.end(), 0);
    std::fill(sc.read_calls.begin(), sc.read_calls.end(), 0);
    return out;
  }
};

// --- a mapped model file's pages gone: one line, not a bus error -------------------------------------------------
// Reading a memory map is a SIGBUS when the page behind it is gone: the file was truncated while mapped, or it lives
// on a tmpfs that filled up after a hole in it was mapped. No Python code can catch that (the access re-executes
// after a Python-level handler), so a handler here turns a fault inside a registered map into the registered one-line
// message and exit status 1. A fault anywhere else restores the previous action and returns, so the access faults
// again under it (the default bus error, or faulthandler's report).
struct GuardedMap {
  uintptr_t lo, hi;
  char msg[1024];
  size_t len;
};
constexpr int MAX_GUARDED = 64;
GuardedMap guarded[MAX_GUARDED];
std::atomic<int> n_guarded{0};
std::mutex guard_mutex;
struct sigaction previous_bus;

void on_sigbus(int sig, siginfo_t* si, void* ctx) {
  const uintptr_t a = (uintptr_t)si->si_addr;
  const int n = n_guarded.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i)
    if (a >= guarded[i].lo && a < guarded[i].hi) {
      ssize_t w = ::write(2, guarded[i].msg, guarded[i].len);
      (void)w;
      ::_exit(1);
    }
  sigaction(SIGBUS, &previous_bus, nullptr);
}

// Register [addr, addr + length) with the line to print when a read there faults; the first call installs the
// handler. The same address registered again gets the new line; unguard_map frees a slot (the file closed). False
// when every slot is taken (64 files mapped at once): that map stays unguarded, never an error.
bool guard_map_op(int64_t addr, int64_t length, const std::string& line) {
  TORCH_CHECK(addr > 0 && length > 0, "guard_map: an empty range");
  std::lock_guard<std::mutex> lock(guard_mutex);
  const int n = n_guarded.load(std::memory_order_relaxed);
  int i = 0;
  while (i < n && guarded[i].lo != (uintptr_t)addr) ++i;
  if (i == n)
    for (i = 0; i < n && guarded[i].hi != 0; ++i) {
    }
  if (i == MAX_GUARDED) return false;
  GuardedMap& g = guarded[i];
  g.hi = 0;  // the handler matches nothing here while the slot changes
  const std::string text = line.substr(0, sizeof g.msg - 2) + "\n";
  std::memcpy(g.msg, text.data(), text.size());
  g.len = text.size();
  g.lo = (uintptr_t)addr;
  std::atomic_thread_fence(std::memory_order_release);
  g.hi = (uintptr_t)addr + (uintptr_t)length;
  if (n == 0) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    TORCH_CHECK(sigaction(SIGBUS, &sa, &previous_bus) == 0, "guard_map: sigaction failed");
  }
  if (i == n) n_guarded.store(n + 1, std::memory_order_release);
  return true;
}

void unguard_map_op(int64_t addr) {
  std::lock_guard<std::mutex> lock(guard_mutex);
  const int n = n_guarded.load(std::memory_order_relaxed);
  for (int i = 0; i < n; ++i)
    if (guarded[i].lo == (uintptr_t)addr) guarded[i].hi = 0, guarded[i].lo = 0;
}

std::string isa_op() { return isa_name(); }
int64_t gemm_min_t_op() { return GEMM_MIN_T; }

}  // namespace

TORCH_LIBRARY(PINFER_NS, m) {
  m.def("qmatmul(Tensor x, Tensor[] weights, int[] types, int gemm_min_t=-1) -> Tensor", &qmatmul_op);
  m.def("qffn_sparse(Tensor x, Tensor? gate, int gate_type, Tensor up, int up_type, Tensor down_t, int down_type, "
        "Tensor? idx, Tensor? row_mask, int act, Tensor? up_bias, float cats_threshold) -> (Tensor, int)",
        &qffn_sparse_op);
  m.def("qpredict_active(Tensor x, Tensor fc1, int fc1_type, Tensor fc2, int fc2_type, float threshold, "
        "Tensor? always, bool fc2_transposed=False) -> Tensor",
        &qpredict_active_op);
  m.def("qembed(Tensor w, int type, Tensor ids) -> Tensor", &qembed_op);
  m.def("qdequant(Tensor w, int type) -> Tensor", &qdequant_op);
  m.def("ffn_sparse_rows(Tensor x, Tensor gate_up, Tensor down_t, Tensor idx, Tensor? row_mask, int act) -> "
        "(Tensor, int)",
        &ffn_sparse_rows_op);
  m.def("predict_active(Tensor x, Tensor fc1, Tensor fc2_t, float threshold, Tensor? always) -> Tensor",
        &predict_active_op);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm_op);
  m.def("ffn_act(Tensor? g, Tensor u, int act, Tensor? up_bias=None) -> Tensor", &ffn_act_op);
  m.def("layer_norm(Tensor x, Tensor w, Tensor? b, float eps) -> Tensor", &layer_norm_op);
  m.def("attend_decode(Tensor qkv, Tensor rope, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, int n_head, "
        "int n_head_kv, float scale, bool neox=False) -> Tensor",
        &attend_decode_op);
  m.def("attend_prompt(Tensor qkv, Tensor rope, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, int n_head, "
        "int n_head_kv, float scale, bool neox=False) -> Tensor",
        &attend_prompt_op);
  m.def("device_layout(Tensor rows, int type, int cols, Tensor? q0, Tensor? q1, Tensor? so, int stride) -> Tensor",
        &device_layout_op);
  m.def("requant_q8_0(Tensor rows, int type, int cols) -> Tensor", &requant_q8_0_op);
  m.def("requant_q4_1(Tensor rows, int cols) -> Tensor", &requant_q4_1_op);
  m.def("ffn_mm(Tensor x, Tensor? gate, int gate_type, Tensor up, int up_type, Tensor down, int down_type, int act, "
        "Tensor? up_bias) -> Tensor",
        &ffn_mm_op);
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<int64_t, int64_t, int64_t, double, bool, at::Tensor>())
      .def("add_attention", &DecodeStep::add_attention)
      .def("set_team", [](const c10::intrusive_ptr<DecodeStep>& self, bool on) { self->team = on; })
      .def("set_ffn_norm", &DecodeStep::set_ffn_norm)
      .def("set_ffn", &DecodeStep::set_ffn)
      .def("set_predictor", &DecodeStep::set_predictor)
      .def("set_output", &DecodeStep::set_output)
      .def("run", &DecodeStep::run)
      .def("add_cache", &DecodeStep::add_cache)
      .def("run_rows", &DecodeStep::run_rows)
      .def("run_layers", &DecodeStep::run_layers)
      .def("ffn_subset", &DecodeStep::ffn_subset)
      .def("take_active", &DecodeStep::take_active)
      .def("take_read", &DecodeStep::take_read)
      .def("head_facts", &DecodeStep::head_facts);
  m.def("guard_map(int addr, int length, str line) -> bool", &guard_map_op);
  m.def("unguard_map(int addr) -> ()", &unguard_map_op);
  m.def("isa() -> str", &isa_op);
  m.def("gemm_min_t() -> int", &gemm_min_t_op);
}
