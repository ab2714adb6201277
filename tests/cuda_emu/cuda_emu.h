// cuda_emu.h: run pinfer's CUDA kernels on the CPU, for tests. Force-included (g++ -include) before a .cu that is
// compiled as C++; tests/cuda_emu/emu.py builds it and launches kernels through ctypes.
//
// Model: a block's threads are fibers (ucontext) on one OS thread, switched only at synchronisation points; blocks
// run one after another, in a shuffled order. A fiber runs until it waits at a barrier (__syncthreads, or any warp
// operation, which is a barrier of its 32 lanes) and the scheduler then resumes, in a fresh random order, every
// fiber whose barrier has completed. Consequences, all deliberate:
// - shared memory is a `static` (one copy, and only one block runs at a time);
// - atomics are plain read-modify-writes (nothing runs concurrently);
// - a missing barrier shows up: another thread's write is seen late or early depending on the random order;
// - a warp operation that not all 32 lanes reach (divergence, early exit) or a __syncthreads skipped by some
//   threads never completes: the launch reports a deadlock instead of hanging;
// - every warp operation must name the full mask (the kernels use no partial masks).
#pragma once

#ifndef __cplusplus
#error "cuda_emu.h is C++"
#endif

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define PINFER_CUDA_EMU 1
#ifdef EMU_SCAN  // emu.py preprocesses with this to find the kernels: the marker survives preprocessing
#define __global__ __emu_kernel__
#else
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(8) uint2 { unsigned x, y; };
struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

// cuda_fp16.h's names, as far as the kernels use them: IEEE conversions by the compiler's _Float16.
struct __half { unsigned short bits; };
inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.bits, 2); return (float)f; }
inline __half __float2half_rn(float x) { _Float16 f = (_Float16)x; __half h; std::memcpy(&h.bits, &f, 2); return h; }

template <class To, class From> inline To emu_bits(From v) { static_assert(sizeof(To) == sizeof(From)); To t; std::memcpy(&t, &v, sizeof t); return t; }
inline float __uint_as_float(unsigned v) { return emu_bits<float>(v); }
inline float __int_as_float(int v) { return emu_bits<float>(v); }
inline unsigned __float_as_uint(float v) { return emu_bits<unsigned>(v); }
inline int __float_as_int(float v) { return emu_bits<int>(v); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
// PTX prmt (default mode): byte i of the result is byte (s >> 4i) & 7 of the 8 bytes {y:x}.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline float atomicAdd(float* p, float v) { const float o = *p; *p = o + v; return o; }
inline int atomicAdd(int* p, int v) { const int o = *p; *p = o + v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned o = *p; *p = o + v; return o; }

namespace emu {

struct Barrier { unsigned gen = 0; int arrived = 0; int size = 0; };

struct Fiber {
  ucontext_t ctx;
  uint3 tid;
  int warp = 0, lane = 0;
  bool done = false;
  const Barrier* waiting = nullptr;
  unsigned wait_gen = 0;
  unsigned warp_ops = 0;  // warp operations so far: picks the exchange buffer
};

struct Warp {
  Barrier bar;
  uint64_t slot[2][32];  // double-buffered: operation n writes slot[n & 1] (see exchange)
};

inline dim3 grid_dim, block_dim;
inline uint3 block_idx;
inline Fiber* cur = nullptr;
inline ucontext_t sched;
inline std::vector<Fiber> fibers;
inline std::vector<Warp> warps;
inline Barrier block_bar;
inline std::function<void()> body;
inline std::string error;
inline std::vector<std::vector<char>> stacks;

inline void fail(const std::string& why) {
  if (error.empty()) error = why;
  cur->done = true;  // abandon this fiber; the scheduler notices the error
  swapcontext(&cur->ctx, &sched);
}

inline void wait(Barrier& b) {
  const unsigned g = b.gen;
  if (++b.arrived == b.size) {  // the last arrival completes the barrier and runs on
    b.arrived = 0;
    ++b.gen;
    return;
  }
  cur->waiting = &b;
  cur->wait_gen = g;
  swapcontext(&cur->ctx, &sched);
}

// Every lane publishes v, the warp meets at a barrier, and each lane reads the slot it names. Two buffers make one
// barrier per operation enough: a lane writes buffer (n & 1) for operation n only after passing barrier n-1, which
// every lane reaches only after reading its value of operation n-2, the last user of that buffer.
template <class T>
inline T exchange(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 8);
  if (mask != 0xffffffffu) fail("warp operation with a partial mask");
  Warp& w = warps[cur->warp];
  uint64_t* s = w.slot[cur->warp_ops++ & 1];
  std::memcpy(&s[cur->lane], &v, sizeof v);
  wait(w.bar);
  T r;
  std::memcpy(&r, &s[src], sizeof r);
  return r;
}

// Every lane publishes v and reads all 32 values (ballot); same buffering as exchange.
inline void exchange_all(unsigned mask, uint64_t v, uint64_t (&out)[32]) {
  if (mask != 0xffffffffu) fail("warp operation with a partial mask");
  Warp& w = warps[cur->warp];
  uint64_t* s = w.slot[cur->warp_ops++ & 1];
  s[cur->lane] = v;
  wait(w.bar);
  std::memcpy(out, s, sizeof out);
}

inline void entry() {
  body();
  cur->done = true;
}

// Runs the whole grid. Returns 0, or 1 with emu::error set (deadlock, bad launch).
inline int launch(dim3 grid, dim3 block, unsigned seed, std::function<void()> kernel) {
  error.clear();
  const int nt = (int)(block.x * block.y * block.z);
  if (nt <= 0 || nt > 1024 || nt % 32) {
    error = "block size must be a multiple of 32 up to 1024 (the emulation runs whole warps)";
    return 1;
  }
  grid_dim = grid;
  block_dim = block;
  body = std::move(kernel);
  std::mt19937 rng(seed);
  std::vector<uint3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back({x, y, z});
  std::shuffle(blocks.begin(), blocks.end(), rng);  // no kernel may depend on the order of blocks
  constexpr size_t kStack = 256 * 1024;
  if ((int)stacks.size() < nt) stacks.resize(nt, std::vector<char>(kStack));
  fibers.assign(nt, Fiber{});
  warps.assign(nt / 32, Warp{});
  for (auto& w : warps) w.bar.size = 32;
  std::vector<int> order(nt);
  for (int i = 0; i < nt; ++i) order[i] = i;
  for (const uint3& b : blocks) {
    block_idx = b;
    block_bar = Barrier{};
    block_bar.size = nt;
    for (auto& w : warps) w.bar = Barrier{0, 0, 32};
    for (int i = 0; i < nt; ++i) {
      Fiber& f = fibers[i];
      f = Fiber{};
      f.tid = {(unsigned)i % block.x, ((unsigned)i / block.x) % block.y, (unsigned)i / (block.x * block.y)};
      f.warp = i / 32;
      f.lane = i % 32;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = stacks[i].data();
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = &sched;
      makecontext(&f.ctx, entry, 0);
    }
    for (;;) {
      bool ran = false, all_done = true;
      std::shuffle(order.begin(), order.end(), rng);
      for (int i : order) {
        Fiber& f = fibers[i];
        if (f.done) continue;
        all_done = false;
        if (f.waiting && f.waiting->gen == f.wait_gen) continue;
        f.waiting = nullptr;
        cur = &f;
        swapcontext(&sched, &f.ctx);
        ran = true;
        if (!error.empty()) return 1;
      }
      if (all_done) break;
      if (!ran) {
        int at_block = 0, at_warp = 0, exited = 0;
        for (auto& f : fibers) {
          if (f.done) ++exited;
          else if (f.waiting == &block_bar) ++at_block;
          else ++at_warp;
        }
        char buf[256];
        std::snprintf(buf, sizeof buf,
                      "deadlock in block (%u,%u,%u): %d threads wait at __syncthreads, %d at a warp operation, "
                      "%d exited (a barrier or warp operation not reached by all threads)",
                      b.x, b.y, b.z, at_block, at_warp, exited);
        error = buf;
        return 1;
      }
    }
  }
  return 0;
}

}  // namespace emu

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define warpSize 32

inline void __syncthreads() { emu::wait(emu::block_bar); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::exchange(mask, 0, 0); }
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = emu::cur->lane;
  return emu::exchange(mask, v, (lane & ~(width - 1)) | (src & (width - 1)));
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  const int lane = emu::cur->lane, src = lane ^ m;
  return emu::exchange(mask, v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  const int lane = emu::cur->lane;
  return emu::exchange(mask, v, (lane & (width - 1)) + (int)d < width ? lane + (int)d : lane);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  const int lane = emu::cur->lane;
  return emu::exchange(mask, v, (lane & (width - 1)) >= (int)d ? lane - (int)d : lane);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  uint64_t all[32];
  emu::exchange_all(mask, pred ? 1 : 0, all);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= (unsigned)all[l] << l;
  return r;
}
