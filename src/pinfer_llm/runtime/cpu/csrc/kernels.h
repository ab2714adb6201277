// The kernels' C++ interface: plain pointers and sizes, no torch types. ops.cpp validates torch tensors and calls
// these; the kernel translation units include no torch headers (they compile in ~2 s each instead of ~20 s), and reach
// torch's thread pool and GEMM only through the three functions of torch_bridge.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "quant.h"

namespace pinfer {

// --- torch_bridge.cpp ------------------------------------------------------------------------------------------------
int num_threads();  // torch.get_num_threads()
int thread_num();   // this thread's index inside parallel_for, 0..num_threads()-1
// at::parallel_for: [begin, end) cut into at most num_threads() contiguous chunks of at least `grain`
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
// f(thread, threads) on each of num_threads() threads of torch's pool at once (one OpenMP region): for work that
// meets at barriers of its own instead of forking per operation. parallel_for inside f runs inline.
void run_team(const std::function<void(int, int)>& f);
// C [M, N] (row stride ldc) = A [M, K] (row stride lda) . B [N, K]^T (row stride ldb), fp32, by torch's GEMM (MKL
// on x86 wheels), single-threaded when called inside parallel_for
void sgemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
              int64_t ldc);

// --- dot products of weight rows with T tokens (dot.cpp) -------------------------------------------------------------
// The activations of one call: fp32 rows for float weight types, and their q8 blocks for block types (made once).
struct Acts {
  const float* x = nullptr;  // [T, n], row stride ldx
  int64_t T = 0, n = 0, ldx = 0;
  Q8Acts q8;          // filled by prepare() when a block type will read these activations
  std::vector<Q8> q;  // per token views into q8
  std::vector<const float*> f;  // per token pointers into x
  void prepare(const float* x_, int64_t T_, int64_t n_, int64_t ldx_, bool need_q8);
  // prepare's views over blocks someone else quantised: shared (shape()d for T tokens, its first n / 32 blocks of
  // each filled), or none
  void attach(const float* x_, int64_t T_, int64_t n_, int64_t ldx_, const Q8Acts* shared);
};
// out[t * ostride + i] = rows[i] . token t, for n rows of one type (any count; T any), on the calling thread.
// Rows are streamed several side by side (see dot.cpp); next[0..n_next) are rows the caller reads after these (any
// type): prefetched into L2 while the last groups compute (past the end of a shorter row is harmless: prefetches never
// fault).
void dot_rows(int type, const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t ostride,
              const uint8_t* const* next = nullptr, int64_t n_next = 0);
// y[t * ys + o] += sum_i h[t * hs + i] * rows[i][o] for o in [o0, o1), n rows, T tokens (block types: o0, o1 % 32 == 0),
// row after row in index order; next: as for dot_rows. mb (block types): a [T, (o1 - o0) / 32] buffer, row stride mbs,
// that takes the rows' per-block offset terms (Q4_1's mins, AVX2's Q4_0 -8) instead of y; the caller adds it to y
// once after its last call. With it, token t's sums do not depend on how the rows were split into calls, nor on rows
// whose h is 0 for t (quant.h axpy_blocks).
void axpy_rows(int type, const uint8_t* const* rows, int64_t n, const float* h, int64_t hs, int64_t T, float* y,
               int64_t ys, int64_t o0, int64_t o1, const uint8_t* const* next = nullptr, int64_t n_next = 0,
               float* mb = nullptr, int64_t mbs = 0);
// dot_rows for Q4_K / Q5_K (type) and Q6_K rows (kquant.cpp): the same contract
void k45_dot_rows(int type, const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t ostride,
                  const uint8_t* const* next, int64_t n_next);
void q6k_dot_rows(const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t ostride,
                  const uint8_t* const* next, int64_t n_next);
// and for IQ4_NL / IQ4_XS rows (type)
void iq4_dot_rows(int type, const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t ostride,
                  const uint8_t* const* next, int64_t n_next);
// n values of an IQ4_NL / IQ4_XS row as floats, as gguf-py's dequantiser computes them (kquant.cpp)
void iq4_to_f32(int type, const uint8_t* row, int64_t n, float* out);
// and for Q5_0 / Q5_1 rows (type)
void q5_dot_rows(int type, const uint8_t* const* rows, int64_t n, const Acts& a, float* out, int64_t ostride,
                 const uint8_t* const* next, int64_t n_next);
void q5_to_f32(int type, const uint8_t* row, int64_t n, float* out);
// nb Q4_K / Q5_K / Q6_K super-blocks as 256 nb floats, as ggml's reference dequantisers compute them (requant.cpp)
void q45k_to_f32(const uint8_t* b, int64_t nb, bool five, float* y);
void q6k_to_f32(const uint8_t* b, int64_t nb, float* y);
// rows [n] of a matrix as floats: out [n, cols]; ids == nullptr: rows 0..n-1
void dequant_rows(const Mat& w, const int64_t* ids, int64_t n, float* out);
// one row as floats, on the calling thread
void row_to_f32(int type, const uint8_t* row, int64_t n, float* out);

// --- device_layout.cpp -----------------------------------------------------------------------------------------------
// The GPU's row layout of n file rows (runtime/gpu/layout.py to_device): out [n, stride], tables from layout.py
void device_layout(const uint8_t* in, int64_t n, int64_t row_bytes, int ty, int64_t cols, const int32_t* q0,
                   const int32_t* q1, const int32_t* so, uint8_t* out, int64_t stride);

// --- requant.cpp -----------------------------------------------------------------------------------------------------
// Q5_0 (6), Q5_1 (7), Q4_K (12), Q5_K (13), Q6_K (14): rows re-encoded as ggml's Q8_0, out [n, cols / 32 * 34]
bool requant_type_known(int ty);
int64_t requant_row_bytes(int ty, int64_t cols);  // -1 for other types
void requant_q8_0(const uint8_t* in, int64_t n, int64_t in_stride, int ty, int64_t cols, uint8_t* out);
// Q4_K rows as Q4_1, out [n, cols / 32 * 20]: each 32-value sub-block's scale and min rounded to f16, nothing else
void requant_q4k_q4_1(const uint8_t* in, int64_t n, int64_t in_stride, int64_t cols, uint8_t* out);

// --- matmul.cpp ------------------------------------------------------------------------------------------------------
// y [T, sum of rows] = x [T, K] . W_i^T for each matrix, outputs side by side. T < gemm_min_t: streaming GEMV tiles on
// the stored bytes (q8 activations for block types); otherwise tiles of rows dequantised to fp32 and torch's GEMM.
void qmatmul(const float* x, int64_t T, int64_t K, const std::vector<Mat>& ws, float* y, int64_t gemm_min_t);
// Tokens from which qmatmul dequantises tiles for torch's sgemm instead of streaming tiles on the stored bytes.
// Measured (one core, CPU time, a 1024 x 4096 matrix; benchmarks/kernels.py --crossover for 2 threads): the
// AVX-512+VNNI tiles run Q4_0/Q8_0 at ~82 GFLOP/s and F16 at ~99 for any T; sgemm on dequantised tiles 63 at T=32, 77
// at 48, 95 at 64, 110 at 96 (Q4_0; F16 catches up at ~80). The AVX2 tiles run at ~61; sgemm restricted to AVX2
// (MKL_ENABLE_INSTRUCTIONS=AVX2, as on an AVX2-only CPU) 53 at T=32, 61 at 48, 62 at 64, 70 at 128. Portable tiles
// are scalar (10 GFLOP/s): sgemm wins from 4. At equal speed the GEMM is preferred: it is exact in fp32, the tiles
// use q8 activations.
#if defined(PINFER_AVX512)
constexpr int64_t GEMM_MIN_T = 64;
#elif defined(PINFER_AVX2)
constexpr int64_t GEMM_MIN_T = 48;
#else
constexpr int64_t GEMM_MIN_T = 4;
#endif

// --- sparse_ffn.cpp --------------------------------------------------------------------------------------------------
enum Act : int { SWIGLU = 0, REGLU = 1, DRELU = 2, RELU_NOGATE = 3, GELU_NOGATE = 4 };
struct FFN {
  const float* x = nullptr;  // [T, d]
  int64_t T = 0, d = 0;
  Mat gate, up, down_t;       // gate.p == nullptr for gate-less activations; rows = n_ff
  const int64_t* idx = nullptr;  // [k]; nullptr: every neuron (k = n_ff)
  int64_t k = 0;
  const bool* mask = nullptr;  // [T, k] with row stride mask_stride, or nullptr
  int64_t mask_stride = 0;
  // with a mask, optionally: [T] each row's ascending neuron ids, exactly those its mask row selects (a batch's parts
  // then find a row's neurons by binary search instead of a pass over the mask)
  const std::vector<int64_t>* rows = nullptr;
  int act = SWIGLU;
  const float* up_bias = nullptr;  // [n_ff] or nullptr
  float cats = 0.f;  // SwiGLU: h = 0 where |silu(g)| <= cats (when > 0)
};
// y [T, d] (overwritten) = the FFN over the neurons idx; returns the number of (token, neuron) pairs whose
// activation is not zero
int64_t ffn_sparse(const FFN& f, float* y);

// ffn_sparse in phases, for a caller that runs them on threads of its own (step.cpp decode_team): sparse_begin (one
// thread: y zeroed, activations, the parts for nt threads), sparse_parts (every thread: claims parts until none is
// left), sparse_reduce (y's values [o0, o1) of [T * d]: the parts' sums added in part order, any split), sparse_end
// (the nonzero count). In that order, with every thread done with a phase before the next starts: ffn_sparse's bits.
struct SparseRun {
  const FFN* f = nullptr;
  float* y = nullptr;
  Acts a;
  std::vector<Acts> one;
  std::vector<int64_t> cut;
  std::vector<int> busy;
  std::unique_ptr<float[]> partial;  // not zeroed here: each part zeroes its own
  size_t partial_n = 0;
  std::vector<int64_t> nonzero;
  std::atomic<int> next{0};
};
void sparse_begin(SparseRun& s, const FFN& f, float* y, int nt);
void sparse_parts(SparseRun& s);
void sparse_reduce(SparseRun& s, int64_t o0, int64_t o1);
int64_t sparse_end(const SparseRun& s);

// --- predictor.cpp ---------------------------------------------------------------------------------------------------
// PowerInfer's predictor for one token x [d]: the ascending indices i with (fc2 relu(fc1 x))[i] >= threshold, merged
// with always[0..n_always). fc2 is [n_ff, r] as stored, or (fc2_transposed) [r, n_ff], in which case the second layer
// is an axpy over the rows of the hidden units that ReLU keeps.
std::vector<int64_t> predict_active(const float* x, const Mat& fc1, const Mat& fc2, bool fc2_transposed,
                                    float threshold, const int64_t* always, int64_t n_always);
// predict_active's two halves for T tokens, for a caller whose threads share them out (step.cpp decode_team): fc1's
// rows [b, e) into hidden (token t's at hidden + t * hs, ReLU applied); then, with all of hidden in place, the neurons
// of [c0, c1) (multiples of 64, or up to n_ff) whose score reaches the threshold, ascending, into out[t]. The ranges'
// lists in order: predict_active's. Each token's lists are the ones it gets alone (its dot products are the same bits
// in any tile; fc2_t's axpy runs token by token).
void predict_hidden(const float* x, int64_t T, int64_t xs, const Mat& fc1, int64_t b, int64_t e, float* hidden,
                    int64_t hs);
void predict_range(const float* hidden, int64_t T, int64_t hs, const Mat& fc1, const Mat& fc2, bool fc2_transposed,
                   float threshold, const int64_t* always, int64_t n_always, int64_t c0, int64_t c1,
                   std::vector<int64_t>* out);

// --- attention.cpp ---------------------------------------------------------------------------------------------------
// One token's RoPE + KV-cache write + attention (see attention.cpp). Cache element type: float or uint16_t (IEEE half).
template <typename KV>
void attend_decode(const float* qkv, const float* rope, KV* k_cache, KV* v_cache, int64_t ctx, int64_t D, int64_t pos,
                   int64_t H, int64_t Hkv, float scale, bool neox, float* out);
// T rows at once, row t at position pos[t] of its own cache kc[t], vc[t] ([Hkv, ctx, D] each): qkv [T, qkv_stride],
// rope the whole table [ctx, D/2, 2], out [T, H * D]. A slot's rows in position order. Each row's result is the
// bits attend_decode gives it (the rows' (row, kv head) pairs claimed by the threads, the last rows first: one fork
// per call, not per row).
template <typename KV>
void attend_rows(int64_t T, const float* qkv, int64_t qkv_stride, const float* rope, KV* const* kc, KV* const* vc,
                 int64_t ctx, int64_t D, const int64_t* pos, int64_t H, int64_t Hkv, float scale, bool neox,
                 float* out);

// attend_decode's two halves, for a step whose threads split the heads themselves (step.cpp decode_team): q rotated
// into q [H, D] and the position's key and value written (one thread), then the query heads [h0, h1) against the cache
// rows 0..pos (any thread, once every row is written). Together: attend_decode's bits.
template <typename KV>
void attend_store(const float* qkv, const float* rope, KV* k_cache, KV* v_cache, int64_t ctx, int64_t D, int64_t pos,
                  int64_t H, int64_t Hkv, bool neox, float* q);
template <typename KV>
void attend_heads(const float* q, const KV* k_cache, const KV* v_cache, int64_t ctx, int64_t D, int64_t pos, int64_t H,
                  int64_t Hkv, float scale, int64_t h0, int64_t h1, float* out);

// --- norm.cpp --------------------------------------------------------------------------------------------------------
void rms_norm(const float* x, const float* w, int64_t T, int64_t d, float eps, float* y);
void layer_norm(const float* x, const float* w, const float* b, int64_t T, int64_t d, float eps, float* y);

// --- step.cpp --------------------------------------------------------------------------------------------------------
// The FFN's hidden activation from a neuron's pre-activations (gate g, up u with its bias): the one definition the
// dense FFN (ffn_mm), the decode step and the sparse FFN use.
float ffn_act(int act, float g, float u);
// ffn_act over a row of n neurons: h[i] = ffn_act(act, g[i], u[i] + up_bias[i]) (g, up_bias may be null)
void ffn_act_rows(int act, const float* g, const float* u, const float* up_bias, int64_t n, float* h);
// silu(g) = g / (1 + e^-g) of n values (simd.h silu_v): a value's bits do not depend on n or its position (SwiGLU's
// ffn_act takes one value at a time, ffn_act_rows a row)
void silu_rows(const float* g, int64_t n, float* s);
// The dense FFN over a file's gate/up and ffn_down [d, n_ff]: qmatmul(x, [gate, up]), act, qmatmul(h, [down]).
// x [T, d], y [T, d] (overwritten). gate.p == nullptr for gate-less activations; up_bias [n_ff] or nullptr.
void ffn_mm(const float* x, int64_t T, int64_t d, const Mat& gate, const Mat& up, const Mat& down, int act,
            const float* up_bias, float* y);

struct NormW {
  const float* w = nullptr;
  const float* b = nullptr;  // LayerNorm's bias or nullptr
  float eps = 0.f;
  bool layer = false;  // LayerNorm (else RMSNorm)
};
void apply_norm(const NormW& n, const float* x, int64_t T, int64_t d, float* y);

// How a layer's FFN runs in the step, as the Python forward runs it (runtime/ffn/*.py):
// FFN_MM: DenseFFN over ffn_down (ffn_mm); FFN_ROWS: qffn_sparse over every neuron (DenseFFN on PowerInfer's
// ffn_down_t, and the exact masks: ReLU-family by their gates, SwiGLU by cats); FFN_PRED: the predictor's indices, then
// qffn_sparse over them.
enum FfnKind : int { FFN_MM = 0, FFN_ROWS = 1, FFN_PRED = 2 };
struct LayerStep {
  NormW attn_norm, ffn_norm;
  bool ffn_norm_shared = false;  // falcon 7B: the FFN reads attention's normed input
  bool parallel = false;         // falcon: x + attn(norm_a x) + ffn(norm_f x)
  std::vector<Mat> qkv, wo;
  const float* bqkv = nullptr;
  const float* bo = nullptr;
  void* k_cache = nullptr;  // [Hkv, ctx, D], float or IEEE half
  void* v_cache = nullptr;
  bool kv_half = true;
  int64_t ctx = 0;
  int kind = FFN_MM;
  Mat gate, up, down;  // down: ffn_down [d, n_ff] for FFN_MM, ffn_down_t [n_ff, d] otherwise
  int act = 0;
  const float* up_bias = nullptr;
  float cats = 0.f;
  Mat fc1, fc2;  // FFN_PRED
  bool fc2_transposed = false;
  float threshold = 0.f;
  std::vector<int64_t> always;
  const float* ffn_bias = nullptr;  // [d], opt's down bias
};
struct StepShape {
  int64_t d = 0, H = 0, Hkv = 0, D = 0;
  float scale = 1.f;
  bool neox = false;
};
// Scratch of one step, sized once per model (grown on first use).
struct StepScratch {
  std::vector<float> xa, xf, qkv, heads, y, f;
  // per layer with predictors: the neurons whose rows the calls read (a batch's: the union of its rows' predicted
  // neurons) and the calls, since the caller last took them (ops.cpp DecodeStep take_read)
  std::vector<int64_t> read, read_calls;
  void count_read(int64_t l, int64_t k) {
    if ((int64_t)read.size() <= l) read.resize(l + 1), read_calls.resize(l + 1);
    read[l] += k, read_calls[l] += 1;
  }
};
// One token through the layers [l0, l1): x [d] is the residual stream, updated in place; rope [D/2, 2] this position's
// (cos, sin); active[l] = the layer's nonzero (token, neuron) pairs (FFN_MM: n_ff). Each op is the kernel the Python
// forward calls for one token, in its order, so the result is the same bits.
void decode_layers(const StepShape& s, const std::vector<LayerStep>& layers, int64_t l0, int64_t l1, const float* rope,
                   int64_t pos, float* x, int64_t* active, StepScratch& sc);
// One KV cache's rows per layer ([Hkv, ctx, D] each, the layers' type): a batch's row reads and writes its own.
struct SlotCache {
  std::vector<void*> k, v;
};
// What a sampler first asks of a row of logits, over a run of its values: are they all finite, and the first of
// their largest (np.argmax's index) with its value. Taken by the threads that wrote the values, while they are in
// their caches: read by the Python side from another core, a SmolLM2 row (192 KB) cost ~0.11 ms a token (finite()
// and a greedy argmax in pi-run's loop), against ~0.01 ms on a row in cache.
struct LogitFacts {
  bool finite = true;
  int64_t best = -1;
  float top = 0.f;
};
LogitFacts logit_facts(const float* v, int64_t b, int64_t e);
// facts of a whole row from those of consecutive runs, in order (the first of equal maxima: the earlier run's)
LogitFacts join_facts(const LogitFacts* parts, int64_t n);
// The output head for decode_team: logits [n_rows, vocab] of the rows `rows` (normed by `norm`); facts: each thread
// p's facts of its share of row i's logits at facts[i * facts_stride + p] (facts_stride >= the team's threads;
// entries of threads the team did not have are left as they were)
struct TeamHead {
  const NormW* norm;
  const std::vector<Mat>* w;
  const int64_t* rows;
  int64_t n_rows;
  float* logits;
  LogitFacts* facts;
  int64_t facts_stride;
};
// decode_rows (T = 1: decode_layers) and then the output head, on a team of all num_threads() threads in one OpenMP
// region: each thread takes its share of every matrix's rows, of the rows' attention heads, of a dense FFN's neurons
// (ffn_down), of the predictor's hidden units and neurons, and of ffn_sparse's parts (sparse_begin ...), and the
// threads meet at spin barriers, six per layer for a dense FFN, eight for a predicted one (llama.cpp's way: one pool
// for the whole graph), where decode_rows forks the pool for each operation and leaves norms, activations, short
// attention and the index list to one thread. Every value comes from the same kernel call as there, so the logits
// and cache rows are its bits (a batch over predicted FFNs: each row's predictor, the union of their neurons, each row
// masked to its own, as ffn_rows). team_step_applies: a step with layers.
bool team_step_applies(const std::vector<LayerStep>& layers);
void decode_team(const StepShape& s, const std::vector<LayerStep>& layers, const std::vector<SlotCache>& slots,
                 const float* rope, int64_t T, const int64_t* pos, const int64_t* slot, float* x, int64_t* active,
                 StepScratch& sc, const TeamHead* head);
// T rows through every layer at once (a batch: decode steps of several sequences, prompt rows, or both), row t at
// position pos[t] in the cache slots[slot[t]]; x [T, d] updated in place. Each row's result is the bits decode_layers
// gives it alone: the matmuls take T < GEMM_MIN_T rows (rows independent), attention runs row by row in the given
// order (a prompt's rows in position order), a neuron-major FFN once over the union of the rows' neurons, each row
// masked to its own (sparse_ffn.cpp's batch invariance).
void decode_rows(const StepShape& s, const std::vector<LayerStep>& layers, const std::vector<SlotCache>& slots,
                 const float* rope, int64_t T, const int64_t* pos, const int64_t* slot, float* x, int64_t* active,
                 StepScratch& sc);

}  // namespace pinfer
