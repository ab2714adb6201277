// The GPU kernels' row layout (runtime/gpu/layout.py: to_device, kernels/quant.cuh), made from the file's rows on the
// CPU at memory speed. layout.py's numpy version is the reference (tests/test_gpu_kernels.py compares the two byte for
// byte) and the fallback without these kernels; it runs at 0.05-0.25 GB/s, ~50 s for a plan with 12 GB on the GPU
// (the H200 run's loads took 50-67 s).
//
// Per row: whole tiles of 1024 values, each a permutation of its values (the tables q0/q1/so come from layout.py's
// _tile_order, so the permutation is defined there once), then the remaining values in the file's order, then zeros
// up to the device stride.
//   F32            the file's row
//   F16, BF16      tile: out[k] = in[q0[k]] (16-bit values)
//   Q8_0           tile: 1024 quant bytes, out[k] = quant q0[k]; then 32 scales, slot j = block so[j]'s d
//   Q4_0, Q4_1     tile: 512 bytes, out[k] = nibble q0[k] | nibble q1[k] << 4; then the 32 d's as above, then (Q4_1)
//                  the 32 m's; value p of a tile is quant p % 32 of block p / 32: low nibble of byte p % 32 for
//                  p % 32 < 16, high nibble of byte p % 32 - 16 otherwise
// The tail (blocks past the last whole tile): each block's quant bytes in the file's order, then their d's, then
// (Q4_1) their m's.
#include <cstring>

#include "kernels.h"

namespace pinfer {

namespace {

constexpr int64_t TILE_VALUES = 1024;

int block_bytes(int ty) { return ty == Q4_0 ? 18 : ty == Q4_1 ? 20 : 34; }

void row_blocks(const uint8_t* src, int ty, int64_t cols, const int32_t* q0, const int32_t* q1, const int32_t* so,
                uint8_t* o) {
  const int64_t BB = block_bytes(ty), hdr = ty == Q4_1 ? 4 : 2, nb = cols / 32, ntile = cols / TILE_VALUES;
  auto value = [&](const uint8_t* tile, int32_t p) -> uint8_t {
    const uint8_t* q = tile + (p / 32) * BB + hdr;
    const int j = p % 32;
    if (ty == Q8_0) return q[j];
    return j < 16 ? q[j] & 15 : q[j - 16] >> 4;
  };
  for (int64_t t = 0; t < ntile; ++t) {
    const uint8_t* ts = src + t * 32 * BB;
    if (ty == Q8_0) {
      for (int k = 0; k < 1024; ++k) *o++ = value(ts, q0[k]);
    } else {
      for (int k = 0; k < 512; ++k) *o++ = (uint8_t)(value(ts, q0[k]) | (value(ts, q1[k]) << 4));
    }
    for (int off = 0; off < (ty == Q4_1 ? 4 : 2); off += 2)  // the d's, then (Q4_1) the m's
      for (int j = 0; j < 32; ++j, o += 2) std::memcpy(o, ts + so[j] * BB + off, 2);
  }
  for (int64_t b = ntile * 32; b < nb; ++b, o += BB - hdr) std::memcpy(o, src + b * BB + hdr, BB - hdr);
  for (int off = 0; off < (ty == Q4_1 ? 4 : 2); off += 2)
    for (int64_t b = ntile * 32; b < nb; ++b, o += 2) std::memcpy(o, src + b * BB + off, 2);
}

void row_halves(const uint16_t* src, int64_t cols, const int32_t* q0, uint16_t* o) {
  const int64_t ntile = cols / TILE_VALUES;
  for (int64_t t = 0; t < ntile; ++t, src += TILE_VALUES, o += TILE_VALUES)
    for (int k = 0; k < TILE_VALUES; ++k) o[k] = src[q0[k]];
  std::memcpy(o, src, (cols - ntile * TILE_VALUES) * 2);
}

}  // namespace

void device_layout(const uint8_t* in, int64_t n, int64_t row_bytes, int ty, int64_t cols, const int32_t* q0,
                   const int32_t* q1, const int32_t* so, uint8_t* out, int64_t stride) {
  parallel_for(0, n, std::max<int64_t>(1, (1 << 18) / stride), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const uint8_t* src = in + r * row_bytes;
      uint8_t* dst = out + r * stride;
      if (ty == F32)
        std::memcpy(dst, src, row_bytes);
      else if (ty == F16 || ty == BF16)
        row_halves(reinterpret_cast<const uint16_t*>(src), cols, q0, reinterpret_cast<uint16_t*>(dst));
      else
        row_blocks(src, ty, cols, q0, q1, so, dst);
      std::memset(dst + row_bytes, 0, stride - row_bytes);  // every layout keeps the row's size
    }
  });
}

}  // namespace pinfer
