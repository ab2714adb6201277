// Attention for T new tokens at positions pos0 .. pos0+T-1 (decode: T = 1), against an f16 KV cache
// [n_kv, max_ctx, head_dim] per layer. Three launches:
//
// rope_kv_store: RoPE on q [T, n_head, hd] and k [T, n_kv, hd] in place, then k and v (fp32) into the cache at
//   their positions (f16, round to nearest). Pair i of the first n_rot dims (partial rotary: the rest pass) is
//   (2i, 2i+1) in llama GGUF order or (i, i + n_rot/2) in NeoX order, rotated by pos * freq_scale *
//   base^(-2i/n_rot). In fp32, exactly enough: a plain float angle at position 1e6 is off by ~0.06 rad, and FP64
//   (as before) runs at 1/64 rate on consumer GPUs. inv_freq holds each pair's base^(-2i/n_rot) as two floats
//   (hi + lo, from the double the CPU side uses; runtime/gpu/cuda.py); pos * freq_scale is split exactly with an
//   fma, their product kept as two floats, reduced by 2 pi in three parts (Cody-Waite, each step an fma), then
//   sincosf of |r| <= pi. Rotated values are within ~5e-7 of the float64 rotation at positions up to 2^24 and any
//   base (tests/test_hybrid_graph.py). Grid (n_head + n_kv, T), 64 threads; a block is one head of one token.
// attn_partial: flash-decoding. The positions 0..pos of a query are cut into chunks of `chunk`; block (c, h, t)
//   computes, for query head h of token t, the softmax statistics of chunk c: m = max score, l = sum e^(s - m),
//   acc = sum e^(s - m) v, with GQA kv head h / (n_head / n_kv). Within a block, each key is read by a group of
//   L lanes (L = hd / 8 rounded up to a power of two: one 16-byte load of 8 halves per lane, a warp reads 32 / L
//   keys at once), the dot product reduced in the group with log2(L) shuffles, and each group keeps an online
//   softmax over its keys; the 4 warps' groups merge through shared memory at the end. Many chunks x heads x
//   tokens blocks keep a long cache read at full bandwidth. part: [T, n_head, n_chunks, hd + 2] = (m, l, acc).
//   Causal: token t sees positions <= pos0 + t; a chunk past that writes m = -inf, l = 0.
// attn_combine: out[t, h, :] = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c. Grid (n_head, T), 128 threads.
// Limits: hd % 8 == 0, hd <= 256 (every llama/falcon/opt head size), n_head % n_kv == 0.
//
// pos_at: null, or a device int holding pos0 (read instead of the argument). A captured decode step (a CUDA graph,
// runtime/gpu/graph.py) replays its launches with the arguments they were captured with, so the position, which
// changes every step, is read from device memory, and attn_partial's grid is sized for the whole cache: its blocks
// past the live context exit at once (m = -inf, l = 0, which attn_combine skips).

#include "quant.cuh"

// cos and sin of (ph + pl) * (ih + il), each a two-float number (module comment).
__device__ __forceinline__ void rope_angle(float ph, float pl, float ih, float il, float& c, float& s) {
  const float ah = ph * ih;
  const float al = fmaf(ph, ih, -ah) + fmaf(ph, il, pl * ih);  // the product's rest: ~2^-46 of it
  // 2 pi = C1 + C2 + C3 (float parts); ah - k * C1 is exact in the fma, and small, so each step rounds by
  // <= ulp(pi) / 2
  constexpr float INV_2PI = 0.15915494f, C1 = 6.2831854820251465f, C2 = -1.7484555314695172e-07f,
                  C3 = -6.8604980400235275e-15f;
  const float k = rintf(ah * INV_2PI);
  float r = fmaf(-k, C1, ah);
  r = fmaf(-k, C2, r);
  r = fmaf(-k, C3, r) + al;
  sincosf(r, &s, &c);
}

extern "C" __global__ void __launch_bounds__(64) rope_kv_store(float* __restrict__ q, float* __restrict__ k,
                                                               const float* __restrict__ v, u16* __restrict__ kc,
                                                               u16* __restrict__ vc, int pos0,
                                                               const int* __restrict__ pos_at, int n_head, int n_kv,
                                                               int hd, int n_rot, int neox,
                                                               const float* __restrict__ inv_freq, float freq_scale,
                                                               int max_ctx) {
  if (pos_at) pos0 = *pos_at;
  const int head = blockIdx.x, t = blockIdx.y, pos = pos0 + t;
  const bool is_q = head < n_head;
  const int kvh = head - n_head;
  float* vec = is_q ? q + ((i64)t * n_head + head) * hd : k + ((i64)t * n_kv + kvh) * hd;
  const int half = n_rot / 2;
  const float p = (float)pos;  // exact below 2^24
  const float ph = p * freq_scale, pl = fmaf(p, freq_scale, -ph);  // pos * freq_scale = ph + pl exactly
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float c, s;
    rope_angle(ph, pl, inv_freq[2 * i], inv_freq[2 * i + 1], c, s);
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float xa = vec[a], xb = vec[b];
    vec[a] = xa * c - xb * s;
    vec[b] = xa * s + xb * c;
  }
  if (is_q) return;  // block-uniform: a q block has nothing to store
  __syncthreads();   // the k row is complete before it is converted
  const i64 at = ((i64)kvh * max_ctx + pos) * hd;
  const float* vs = v + ((i64)t * n_kv + kvh) * hd;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    kc[at + i] = f32_to_f16(vec[i]);
    vc[at + i] = f32_to_f16(vs[i]);
  }
}

__device__ __forceinline__ void halves8(const uint4& u, float (&f)[8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u32 w = word(u, j);
    f[2 * j] = f16_to_f32(w & 0xffffu);
    f[2 * j + 1] = f16_to_f32(w >> 16);
  }
}

extern "C" __global__ void __launch_bounds__(128) attn_partial(const float* __restrict__ q, const u16* __restrict__ kc,
                                                              const u16* __restrict__ vc, float* __restrict__ part,
                                                              int pos0, const int* __restrict__ pos_at, int n_head,
                                                              int n_kv, int hd, int max_ctx, float scale, int chunk,
                                                              int n_chunks) {
  __shared__ float sm_m[128], sm_l[128];
  __shared__ __align__(16) float sm_acc[1024];  // groups x hd <= 4 warps x 32 lanes x 8 dims
  const int c = blockIdx.x, h = blockIdx.y, t = blockIdx.z;
  if (pos_at) pos0 = *pos_at;
  float* dst = part + (((i64)t * n_head + h) * n_chunks + c) * (hd + 2);
  if (c * chunk > pos0 + t) {  // block-uniform: a chunk past the live context (a fixed grid) has nothing to add
    if (threadIdx.x == 0) {
      dst[0] = NEG_INF;
      dst[1] = 0.f;
    }
    return;
  }
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, nwb = blockDim.x >> 5;
  const int npiece = hd >> 3;  // 16-byte pieces of a head
  int L = 1;
  while (L < npiece) L <<= 1;
  const int kpw = 32 / L, grp = lane / L, gl = lane % L;
  const int ngroups = nwb * kpw, gid = wib * kpw + grp;
  const bool has = gl < npiece;
  const int kvh = h / (n_head / n_kv);
  const int start = c * chunk, end = imin(start + chunk, pos0 + t + 1);
  float qv[8];
  {
    const float* qp = q + ((i64)t * n_head + h) * hd + 8 * gl;
    const float4 a = has ? ldf4(qp) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 b = has ? ldf4(qp + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    qv[0] = a.x * scale; qv[1] = a.y * scale; qv[2] = a.z * scale; qv[3] = a.w * scale;
    qv[4] = b.x * scale; qv[5] = b.y * scale; qv[6] = b.z * scale; qv[7] = b.w * scale;
  }
  const u8* kb = reinterpret_cast<const u8*>(kc + (i64)kvh * max_ctx * hd + 8 * gl);
  const u8* vb = reinterpret_cast<const u8*>(vc + (i64)kvh * max_ctx * hd + 8 * gl);
  float m = NEG_INF, l = 0.f, acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.f;
  for (int p0 = start + wib * kpw; p0 < end; p0 += ngroups) {  // warp-uniform; each group takes key p0 + grp
    const int p = p0 + grp;
    const bool ok = p < end;
    float kf[8];
    halves8((ok && has) ? ld16(kb + (i64)p * hd * 2) : make_uint4(0, 0, 0, 0), kf);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s = fmaf(qv[j], kf[j], s);
    for (int o = L >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
    if (ok) {
      const float mn = fmaxf(m, s), corr = expf(m - mn), pw = expf(s - mn);
      float vf[8];
      halves8(has ? ld16(vb + (i64)p * hd * 2) : make_uint4(0, 0, 0, 0), vf);
      l = fmaf(l, corr, pw);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = fmaf(acc[j], corr, pw * vf[j]);
      m = mn;
    }
  }
  if (gl == 0) {
    sm_m[gid] = m;
    sm_l[gid] = l;
  }
  if (has) {
    float4* d = reinterpret_cast<float4*>(sm_acc + gid * hd + 8 * gl);
    d[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    d[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
  __syncthreads();
  float M = NEG_INF;
  for (int g = 0; g < ngroups; ++g) M = fmaxf(M, sm_m[g]);
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    float a = 0.f;
    for (int g = 0; g < ngroups; ++g)
      if (sm_m[g] > NEG_INF) a = fmaf(sm_acc[g * hd + i], expf(sm_m[g] - M), a);
    dst[2 + i] = a;
  }
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int g = 0; g < ngroups; ++g)
      if (sm_m[g] > NEG_INF) s = fmaf(sm_l[g], expf(sm_m[g] - M), s);
    dst[0] = M;
    dst[1] = s;
  }
}

extern "C" __global__ void __launch_bounds__(128) attn_combine(const float* __restrict__ part, float* __restrict__ out,
                                                              int n_head, int hd, int n_chunks) {
  const int h = blockIdx.x, t = blockIdx.y;
  const float* src = part + ((i64)t * n_head + h) * n_chunks * (hd + 2);
  float M = NEG_INF;
  for (int c = 0; c < n_chunks; ++c) M = fmaxf(M, src[(i64)c * (hd + 2)]);
  float s = 0.f;
  for (int c = 0; c < n_chunks; ++c) {
    const float mc = src[(i64)c * (hd + 2)];
    if (mc > NEG_INF) s = fmaf(src[(i64)c * (hd + 2) + 1], expf(mc - M), s);
  }
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    float a = 0.f;
    for (int c = 0; c < n_chunks; ++c) {
      const float mc = src[(i64)c * (hd + 2)];
      if (mc > NEG_INF) a = fmaf(src[(i64)c * (hd + 2) + 2 + i], expf(mc - M), a);
    }
    out[((i64)t * n_head + h) * hd + i] = a / s;
  }
}
