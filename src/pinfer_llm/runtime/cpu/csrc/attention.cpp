// One token's attention at position pos, GQA included, in one call: rotate q and k (RoPE) by rope [D/2, 2] =
// (cos, sin) of each rotary pair, store k and v into the layer's cache rows pos, then for each query head h (kv head
// h / (H / Hkv)): softmax(q . k_0..pos * scale) . v_0..pos. qkv [(H + 2 Hkv) D] is the fused projection's output;
// k_cache, v_cache [Hkv, ctx, D] in float or IEEE half (llama.cpp's default KV type: half the cache bytes, which
// the memory budget counts; keys and values are rounded to half once, when written, and read back exactly).
//
// Rotary pairs: adjacent (2i, 2i+1), GGUF's Llama layout (llama.cpp's converter permutes Q/K rows for it); or with
// neox, the halves (i, i + D/2) (GPT-NeoX / Falcon). Pair i uses rope row i either way.
#include <type_traits>

#include "kernels.h"

namespace pinfer {

namespace {

template <typename KV>
constexpr int kv_type() { return std::is_same<KV, float>::value ? F32 : F16; }

template <typename KV>
inline KV to_kv(float v) {
  if constexpr (std::is_same<KV, float>::value) return v;
  else return f32_to_f16(v);
}

// rotate src (D values) into dst: dst[a] = src[a] c - src[b] s, dst[b] = src[a] s + src[b] c for each pair (a, b)
template <typename KV>
void rotate(const float* src, KV* dst, const float* cs, int64_t D, bool neox) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    const float a = src[ia], b = src[ib], c = cs[2 * i], s = cs[2 * i + 1];
    dst[ia] = to_kv<KV>(a * c - b * s);
    dst[ib] = to_kv<KV>(a * s + b * c);
  }
}

}  // namespace

template <typename KV>
void attend_decode(const float* qkv, const float* rope, KV* kc, KV* vc, int64_t ctx, int64_t D, int64_t pos,
                   int64_t H, int64_t Hkv, float scale, bool neox, float* out) {
  constexpr int TY = kv_type<KV>();
  std::vector<float> q(H * D);
  for (int64_t h = 0; h < H; ++h) rotate(qkv + h * D, q.data() + h * D, rope, D, neox);
  for (int64_t g = 0; g < Hkv; ++g) {
    rotate(qkv + (H + g) * D, kc + (g * ctx + pos) * D, rope, D, neox);
    const float* v = qkv + (H + Hkv + g) * D;
    KV* vdst = vc + (g * ctx + pos) * D;
    for (int64_t i = 0; i < D; ++i) vdst[i] = to_kv<KV>(v[i]);
  }
  const int64_t n = pos + 1, group = H / Hkv;
  const int64_t row = D * (int64_t)sizeof(KV);
  // heads in parallel only when the context makes them worth a fork
  const int64_t grain = n * D * H < (1 << 16) ? H : 1;
  parallel_for(0, H, grain, [&](int64_t b, int64_t e) {
    std::vector<float> p(n);
    for (int64_t h = b; h < e; ++h) {
      const float* qh = q.data() + h * D;
      const uint8_t* kh = (const uint8_t*)(kc + (h / group) * ctx * D);
      const uint8_t* vh = (const uint8_t*)(vc + (h / group) * ctx * D);
      float mx = -INFINITY;
      for (int64_t t = 0; t < n; ++t) {
        const uint8_t* kt = kh + t * row;
        float s;
        ftile<TY, 1, 1>(&kt, &qh, D, &s, 1);
        p[t] = s * scale;
        mx = std::max(mx, p[t]);
      }
      vf vsum_ = vzero();
      int64_t t = 0;
      for (; t + VW <= n; t += VW) {
        const vf ev = exp_nonpos(vsub(vload(p.data() + t), vset1(mx)));
        vstore(p.data() + t, ev);
        vsum_ = vadd(vsum_, ev);
      }
      float sum = vsum(vsum_);
      for (; t < n; ++t) sum += (p[t] = std::exp(p[t] - mx));
      const float inv = 1.f / sum;
      for (t = 0; t < n; ++t) p[t] *= inv;
      float* oh = out + h * D;
      std::fill(oh, oh + D, 0.f);
      std::vector<const uint8_t*> vrows(n);  // value rows, several per pass (axpy_rows)
      for (t = 0; t < n; ++t) vrows[t] = vh + t * row;
      axpy_rows(TY, vrows.data(), n, p.data(), 0, 1, oh, 0, 0, D);
    }
  });
}

template void attend_decode<float>(const float*, const float*, float*, float*, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, float, bool, float*);
template void attend_decode<uint16_t>(const float*, const float*, uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                                      int64_t, int64_t, float, bool, float*);

}  // namespace pinfer
