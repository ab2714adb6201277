// The types only dot products read (Q5_0, Q5_1, the K-quants Q4_K, Q5_K, Q6_K of llama.cpp's Q4_K_M / Q5_K_M / Q6_K
// files, IQ4_NL, IQ4_XS; kquant.cpp), re-encoded once, at load, where axpy or a GPU reads them (runtime/weights.py
// rows_runnable):
//   Q4_K as Q4_1 (requant_q4k_q4_1: each sub-block's scale and min rounded to f16, nothing else);
//   Q5_0 as Q8_0 exactly (q5_0_as_q8_0: the same d, int8 q - 16);
//   the others as ggml's Q8_0: decoded to floats as ggml's reference dequantisers do (the same operations in the
//   same order, so the same floats), then ggml's quantize_row_q8_0_ref (to_q8_0). gguf.quants, whose numpy path
//   this replaces (~60 M weights/s: ~2 minutes for a 7B Q4_K_M), is the reference the tests compare with byte for
//   byte.
//
// Encodings (ggml-common.h; QK_K = 256 values per super-block, f16 scales little-endian):
//   Q5_0  22 bytes {f16 d; u8 qh[4]; u8 qs[16]}         v = d * (q - 16), q = nibble | high bit << 4
//   Q5_1  24 bytes {f16 d; f16 m; u8 qh[4]; u8 qs[16]}  v = d * q + m
//         nibble of value j < 16: qs[j] & 15, of value j + 16: qs[j] >> 4; high bit of value j: bit j of qh
//   Q4_K  144 bytes {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}          8 sub-blocks of 32, 6-bit scale and min
//   Q5_K  176 bytes {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}
//   Q6_K  210 bytes {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}         16 sub-blocks of 16
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace pinfer {

namespace {


void q5_1_row(const uint8_t* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, b += 24, y += 32) {
    const float d = f16_to_f32(rd_u16(b)), m = f16_to_f32(rd_u16(b + 2));
    const uint32_t qh = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
    const uint8_t* qs = b + 8;
    for (int j = 0; j < 16; ++j) {
      const int x0 = (qs[j] & 0xF) | (((qh >> j) << 4) & 0x10), x1 = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
      y[j] = x0 * d + m;
      y[j + 16] = x1 * d + m;
    }
  }
}

void q45k_row(const uint8_t* b, int64_t nb, bool five, float* y) {
  const int64_t BB = five ? 176 : 144;
  for (int64_t i = 0; i < nb; ++i, b += BB) {
    const float d = f16_to_f32(rd_u16(b)), dmin = f16_to_f32(rd_u16(b + 2));
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + (five ? 48 : 16);
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
      uint8_t sc, m;
      k4_scale_min(is, scales, sc, m);
      const float d1 = d * sc, m1 = dmin * m;
      k4_scale_min(is + 1, scales, sc, m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * ((q[l] & 0xF) + (five && (qh[l] & u1) ? 16 : 0)) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * ((q[l] >> 4) + (five && (qh[l] & u2) ? 16 : 0)) - m2;
      u1 <<= 2;
      u2 <<= 2;
    }
  }
}

}  // namespace

// (also the kernels' Q4_K / Q5_K dequantisation: kernels.h)
void q45k_to_f32(const uint8_t* b, int64_t nb, bool five, float* y) { q45k_row(b, nb, five, y); }

// (also the kernels' Q6_K dequantisation: kernels.h)
void q6k_to_f32(const uint8_t* b, int64_t nb, float* y) {
  for (int64_t i = 0; i < nb; ++i, b += 210) {
    const float d = f16_to_f32(rd_u16(b + 208));
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int is = 0; is < 2; ++is) {  // sub-blocks of 16 values: one scale each over l in [16 is, 16 is + 16)
        const float s1 = d * sc[is + 0], s2 = d * sc[is + 2], s3 = d * sc[is + 4], s4 = d * sc[is + 6];
        for (int l = 16 * is; l < 16 * is + 16; ++l) {
          y[l] = s1 * (float)((int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
          y[l + 32] = s2 * (float)((int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
          y[l + 64] = s3 * (float)((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          y[l + 96] = s4 * (float)((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
    }
  }
}

namespace {

// ggml's quantize_row_q8_0_ref: per block of 32, d = max|x| / 127 (stored as f16), q = roundf(x * (1 / d)). The AVX2
// path gives the same bytes: roundf (halves away from zero) is trunc(v) plus sign(v) where |v - trunc(v)| >= 0.5, a
// difference computed exactly (v + 0.5 then trunc would round 0.49999997 up). (quant.h's quantize_block rounds
// halves to even, as the activation blocks' kernels expect; ggml's weights round away from zero.)
void to_q8_0(const float* x, int64_t cols, uint8_t* o) {
  for (int64_t b = 0; b < cols / 32; ++b, x += 32, o += 34) {
    const float d = absmax_block(x) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t h = f32_to_f16(d);
    std::memcpy(o, &h, 2);
#if defined(PINFER_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.0f), vid = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f),
                 one = _mm256_set1_ps(1.0f);
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), vid);
      const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), half, _CMP_GE_OQ);
      q[k] = _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(away, _mm256_or_ps(one, _mm256_and_ps(sign, v)))));
    }
    // packs work within 128-bit lanes: the 4-byte groups come out as 0, 2, 4, 6, 1, 3, 5, 7
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 2),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int j = 0; j < 32; ++j) o[2 + j] = (uint8_t)(int8_t)std::roundf(x[j] * id);
#endif
  }
}

// Q5_0's values d (q - 16) are a Q8_0 block's with the same d and int8 q - 16: repacked, nothing rounds
void q5_0_as_q8_0(const uint8_t* b, int64_t nb, uint8_t* o) {
  for (int64_t i = 0; i < nb; ++i, b += 22, o += 34) {
    std::memcpy(o, b, 2);
    const uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
    const uint8_t* qs = b + 6;
    for (int j = 0; j < 16; ++j) {
      o[2 + j] = (uint8_t)(int8_t)(((qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)) - 16);
      o[2 + j + 16] = (uint8_t)(int8_t)(((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16);
    }
  }
}

}  // namespace

// Q4_K as Q4_1: a Q4_K sub-block (32 values v = d1 q - m1, d1 = d * sc, m1 = dmin * m in f32) is a Q4_1 block with
// d = f16(d1) and m = f16(-m1), the only rounding; its nibbles are repacked (Q4_K keeps sub-blocks 2p and 2p + 1 in
// the low and high nibbles of the same 32 bytes, Q4_1 values j and j + 16 in the low and high nibble of byte j).
void requant_q4k_q4_1(const uint8_t* in, int64_t n, int64_t in_stride, int64_t cols, uint8_t* out) {
  const int64_t ob = cols / 32 * 20;
  parallel_for(0, n, std::max<int64_t>(1, (1 << 16) / cols), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const uint8_t* blk = in + r * in_stride;
      uint8_t* o = out + r * ob;
      for (int64_t sb = 0; sb < cols / 256; ++sb, blk += 144) {
        const float d = f16_to_f32(rd_u16(blk)), dmin = f16_to_f32(rd_u16(blk + 2));
        for (int p = 0; p < 4; ++p) {
          const uint8_t* q = blk + 16 + 32 * p;
          for (int half = 0; half < 2; ++half, o += 20) {
            uint8_t sc, m;
            k4_scale_min(2 * p + half, blk + 4, sc, m);
            const uint16_t dh = f32_to_f16(d * sc), mh = f32_to_f16(-(dmin * m));
            std::memcpy(o, &dh, 2);
            std::memcpy(o + 2, &mh, 2);
            const int shift = 4 * half;
            for (int j = 0; j < 16; ++j)
              o[4 + j] = (uint8_t)(((q[j] >> shift) & 0xF) | (((q[j + 16] >> shift) & 0xF) << 4));
          }
        }
      }
    }
  });
}

bool requant_type_known(int ty) {
  return ty == Q5_0 || ty == Q5_1 || ty == Q4_K || ty == Q5_K || ty == Q6_K || ty == IQ4_NL || ty == IQ4_XS;
}

int64_t requant_row_bytes(int ty, int64_t cols) {
  switch (ty) {
    case Q5_0: return cols / 32 * 22;
    case Q5_1: return cols / 32 * 24;
    case Q4_K: return cols / 256 * 144;
    case Q5_K: return cols / 256 * 176;
    case Q6_K: return cols / 256 * 210;
    case IQ4_NL: return cols / 32 * 18;
    case IQ4_XS: return cols / 256 * 136;
    default: return -1;
  }
}

void requant_q8_0(const uint8_t* in, int64_t n, int64_t in_stride, int ty, int64_t cols, uint8_t* out) {
  const int64_t ob = cols / 32 * 34;
  parallel_for(0, n, std::max<int64_t>(1, (1 << 16) / cols), [&](int64_t b, int64_t e) {
    std::vector<float> y(cols);
    for (int64_t r = b; r < e; ++r) {
      const uint8_t* src = in + r * in_stride;
      if (ty == Q5_0) {
        q5_0_as_q8_0(src, cols / 32, out + r * ob);
        continue;
      }
      if (ty == Q5_1)
        q5_1_row(src, cols / 32, y.data());
      else if (ty == Q6_K)
        q6k_to_f32(src, cols / 256, y.data());
      else if (ty == IQ4_NL || ty == IQ4_XS)
        iq4_to_f32(ty, src, cols, y.data());
      else
        q45k_row(src, cols / 256, ty == Q5_K, y.data());
      to_q8_0(y.data(), cols, out + r * ob);
    }
  });
}

}  // namespace pinfer
