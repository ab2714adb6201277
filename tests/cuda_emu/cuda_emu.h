// cuda_emu.h: run pinfer's CUDA kernels on the CPU, for tests, with a race detector. Force-included (g++ -include)
// before a .cu that is compiled as C++; tests/cuda_emu/emu.py builds it and launches kernels through ctypes.
//
// Model: a block's threads are fibers (ucontext) on one OS thread, switched only at synchronisation points; blocks
// run one after another, in a shuffled order. A fiber runs until it waits at a barrier (__syncthreads, or any warp
// operation, which is a barrier of its 32 lanes) and the scheduler then resumes, in a fresh random order, every
// fiber whose barrier has completed.
//
// Running blocks one at a time hides what a GPU does to racy code (blocks run at once; warps of a block interleave
// at any instruction), so the emulation does not rely on the schedule to expose races: it checks every access.
// The kernels are compiled with -fsanitize=thread for its instrumentation only: every load and store calls
// __tsan_readN/__tsan_writeN, which are defined below (libtsan is not linked) and feed a shadow memory. Per 2-byte
// granule it records the last writer and the readers since, each with its block, its warp and how many block
// barriers and warp operations it had passed. Two accesses by different threads, one of them a write and not both
// atomic, are a race unless they are in the same block with a __syncthreads between them, or in the same warp with a
// warp operation (shuffle, ballot, __syncwarp) between them; accesses of different blocks are never ordered within a
// launch, which is what a GPU gives. This finds a race whatever order the fibers happened to run in, which an
// interleaving test cannot (ThreadSanitizer itself would need every fiber switch annotated as "no sync" and would
// still order blocks run one after another; its runtime also slows every access far more than this one does).
// Consequences, all deliberate:
// - shared memory is a `static` (one copy: only one block runs at a time); its shadow is cleared at every block;
// - atomics are read-modify-writes marked atomic in the shadow: atomics never race with atomics, a plain access to
//   what another thread (or block) updates atomically does;
// - a warp operation that not all 32 lanes reach (divergence, early exit) or a __syncthreads skipped by some
//   threads never completes: the launch reports a deadlock instead of hanging; threads waiting at different
//   __syncthreads (a divergent barrier) are reported as such;
// - every warp operation must name the full mask (the kernels use no partial masks);
// - EMU_ARCH (emu.py's `arch`) selects an architecture's branch of a kernel (PINFER_ARCH below), e.g. Hopper's.
// What it cannot see: library calls (memcpy of unknown size is not instrumented), memory-model reorderings within
// one thread, and races between launches (a launch is ordered after the previous one, as on one stream).
#pragma once

#ifndef __cplusplus
#error "cuda_emu.h is C++"
#endif

#include <link.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define PINFER_CUDA_EMU 1
#ifdef EMU_ARCH
#define PINFER_ARCH EMU_ARCH
#endif
// The emulation's own code is not instrumented: only the kernels' accesses reach the detector.
#define EMU_NOSAN __attribute__((no_sanitize_thread))
#define EMU_HOOK __attribute__((no_sanitize_thread, visibility("hidden")))
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

// Everything here has internal linkage (an anonymous namespace, static functions, hidden hooks): each kernel library
// keeps its own state. Vague-linkage inline definitions would be unified across the libraries a process loads, and
// one library's hooks would then check another's shared memory.
namespace emu {
namespace {

struct Barrier { unsigned gen = 0; int arrived = 0; int size = 0; const void* site = nullptr; int any[2] = {0, 0}; };

struct Fiber {
  ucontext_t ctx;
  uint3 tid;
  int warp = 0, lane = 0;
  bool done = false;
  const Barrier* waiting = nullptr;
  unsigned wait_gen = 0;
  unsigned warp_ops = 0;  // warp operations so far: picks the exchange buffer; the warp's epoch for the detector
  unsigned barriers = 0;  // __syncthreads passed: the block's epoch for the detector
  uint32_t thr = 0;       // 1 + the block's launch index * 1024 + the thread's index in the block
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
inline std::vector<char> stack_mem;
inline std::vector<uint3> block_order;  // launch index -> blockIdx, for messages

EMU_NOSAN inline void fail(const std::string& why) {
  if (error.empty()) error = why;
  cur->done = true;  // abandon this fiber; the scheduler notices the error
  swapcontext(&cur->ctx, &sched);
}

// ---- the race detector (see the top of the file)

struct Cell { uint32_t w_thr, w_bep, w_wep, r_thr, r_bep, r_wep; };
constexpr uint32_t kAtomic = 0x80000000u;  // in w_thr: the last write was atomic
constexpr uint32_t kMany = 0x80000000u;    // in r_thr: several readers; the low bits say which (below)
constexpr uint32_t kWarps = 0x7fffffffu;   // ... of several warps of one block (r_wep holds the block)
constexpr uint32_t kBlocks = 0x7ffffffeu;  // ... of several blocks; in w_thr: atomics of several blocks
constexpr int kPage = 4096, kCells = kPage / 2;
struct Page { Cell cell[kCells]; };

// Page number -> shadow page, open addressing. No STL here: its templates would be instrumented in this translation
// unit and call back into the detector.
struct Slot { uintptr_t key; Page* page; };
inline Slot* table = nullptr;
inline size_t table_cap = 0, table_used = 0;
inline uintptr_t last_key = ~(uintptr_t)0;
inline Page* last_page = nullptr;
inline bool checking = false;  // true while a kernel's fibers run
inline bool in_detector = false;  // what the detector's own calls touch is not the kernel's
inline uintptr_t stack_lo = 0, stack_hi = 0, static_lo = 0, static_hi = 0;

EMU_NOSAN inline size_t slot_of(Slot* t, size_t cap, uintptr_t key) {
  size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
  while (t[i].key && t[i].key != key) i = (i + 1) & (cap - 1);
  return i;
}

EMU_NOSAN inline Page* find_page(uintptr_t key) {  // key: page number + 1 (0 marks an empty slot)
  if (!table_cap) return nullptr;
  const Slot& sl = table[slot_of(table, table_cap, key)];
  return sl.key ? sl.page : nullptr;
}

EMU_NOSAN inline Page* get_page(uintptr_t key) {
  if (2 * (table_used + 1) > table_cap) {  // grow: at most half full
    const size_t cap = table_cap ? 2 * table_cap : 1024;
    Slot* t = new Slot[cap]();
    for (size_t i = 0; i < table_cap; ++i)
      if (table[i].key) t[slot_of(t, cap, table[i].key)] = table[i];
    delete[] table;
    table = t;
    table_cap = cap;
  }
  Slot& sl = table[slot_of(table, table_cap, key)];
  if (!sl.key) {
    sl.key = key;
    sl.page = new Page();  // value-initialised: all zero
    ++table_used;
  }
  return sl.page;
}

EMU_NOSAN inline void shadow_clear() {
  for (size_t i = 0; i < table_cap; ++i)
    if (table[i].key) delete table[i].page;
  delete[] table;
  table = nullptr;
  table_cap = table_used = 0;
  last_key = ~(uintptr_t)0;
}

// Static storage is where __shared__ arrays live: the writable segment of this library.
EMU_NOSAN inline int find_static(dl_phdr_info* info, size_t, void*) {
  const uintptr_t me = (uintptr_t)&fibers;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_W)) continue;
    const uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
    if (me >= lo && me < hi) {
      static_lo = lo;
      static_hi = hi;
      return 1;
    }
  }
  return 0;
}

// A new block: its shared memory is not the previous block's, so what the previous block did there is forgotten.
EMU_NOSAN inline void shadow_new_block() {
  if (!static_hi) dl_iterate_phdr(find_static, nullptr);
  for (uintptr_t k = static_lo / kPage; k <= (static_hi - 1) / kPage; ++k)
    if (Page* p = find_page(k + 1)) std::memset(p->cell, 0, sizeof p->cell);
}

EMU_NOSAN inline Cell& cell(uintptr_t a) {
  const uintptr_t k = a / kPage;
  if (k != last_key) {
    last_page = get_page(k + 1);
    last_key = k;
  }
  return last_page->cell[(a % kPage) / 2];
}

struct Who { uint32_t block; uint32_t warp; };  // warp: the launch-wide warp index, or ~0 for "several"
EMU_NOSAN inline Who who(uint32_t thr) { return {(thr - 1) / 1024, (thr - 1) / 32}; }

EMU_NOSAN inline std::string describe(uint32_t thr) {
  const uint32_t b = (thr - 1) / 1024, t = (thr - 1) % 1024;
  const uint3 bi = b < block_order.size() ? block_order[b] : uint3{0, 0, 0};
  char buf[96];
  std::snprintf(buf, sizeof buf, "thread %u of block (%u,%u,%u)", t, bi.x, bi.y, bi.z);
  return buf;
}

EMU_NOSAN inline void race(const char* kind, uintptr_t a, const std::string& other, const char* fix) {
  checking = in_detector = false;  // the message's own code may be instrumented; this fiber does not come back
  const bool shared = a >= static_lo && a < static_hi;
  fail(std::string("data race on ") + (shared ? "shared" : "global") + " memory (" + kind + "): " +
       describe(cur->thr) + " and " + other + " " + fix +
       // EMU_DEBUG=1: the address, to find the array (numpy's .ctypes.data) when debugging a kernel
       (std::getenv("EMU_DEBUG") ? " at address " + std::to_string(a) : std::string()));
}

// Is an access (block, warp, barrier epoch, warp epoch) ordered before the current thread's?
EMU_NOSAN inline bool before(uint32_t block, uint32_t warp, uint32_t bep, uint32_t wep) {
  const Who me = who(cur->thr);
  return block == me.block && (bep < cur->barriers || (warp == me.warp && wep < cur->warp_ops));
}

EMU_NOSAN inline uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

EMU_NOSAN inline void check(const void* p, size_t n, bool write, bool atomic) {
  const uintptr_t a = (uintptr_t)p;
  if (a >= stack_lo && a < stack_hi) return;  // a thread's own locals
  const uint32_t thr = cur->thr;
  const Who me = who(thr);
  for (uintptr_t g = a & ~(uintptr_t)1; g < a + n; g += 2) {
    Cell& c = cell(g);
    const uint32_t w = c.w_thr & ~kAtomic;
    if (w && w != thr) {  // against the last write
      const bool both_atomic = atomic && (c.w_thr & kAtomic);
      if (w == kBlocks && !both_atomic)
        return race(write ? "a write after atomics" : "a read of atomics' result", a, "atomic updates of several "
                    "blocks", "(a launch orders nothing between blocks)");
      if (w != kBlocks && !both_atomic) {
        const Who o = who(w);
        if (!before(o.block, o.warp, c.w_bep, c.w_wep))
          return race(write ? "write after write" : "read after write", a, describe(w),
                      o.block == me.block ? "with no __syncthreads between"
                                          : "(another block: only atomics may share)");
      }
    }
    if (write) {
      if (c.r_thr && c.r_thr != thr) {  // against the reads since the last write
        bool ok;
        std::string other;
        if (!(c.r_thr & kMany)) {
          const Who o = who(c.r_thr);
          ok = before(o.block, o.warp, c.r_bep, c.r_wep);
          other = describe(c.r_thr);
        } else if ((c.r_thr & ~kMany) == kBlocks) {
          ok = false;
          other = "readers in several blocks";
        } else if ((c.r_thr & ~kMany) == kWarps) {
          ok = before(c.r_wep, ~0u, c.r_bep, 0);
          other = "readers in several warps";
        } else {
          const uint32_t wg = c.r_thr & ~kMany;
          ok = before(wg / 32, wg, c.r_bep, c.r_wep);
          other = "readers in one warp";
        }
        if (!ok) return race("write after read", a, other, "with no barrier between");
      }
      uint32_t nw = thr | (atomic ? kAtomic : 0);
      if (atomic && (c.w_thr & kAtomic) && w && (w == kBlocks || who(w).block != me.block)) nw = kBlocks | kAtomic;
      c.w_thr = nw;
      c.w_bep = cur->barriers;
      c.w_wep = cur->warp_ops;
      c.r_thr = 0;
      continue;
    }
    // a read: remember it beside the others that are not ordered before it
    const uint32_t r = c.r_thr;
    if (!r || r == thr) {
      c.r_thr = thr, c.r_bep = cur->barriers, c.r_wep = cur->warp_ops;
    } else if (!(r & kMany)) {
      const Who o = who(r);
      if (before(o.block, o.warp, c.r_bep, c.r_wep)) {
        c.r_thr = thr, c.r_bep = cur->barriers, c.r_wep = cur->warp_ops;
      } else if (o.block != me.block) {
        c.r_thr = kMany | kBlocks;
      } else if (o.warp == me.warp) {
        c.r_thr = kMany | me.warp, c.r_bep = umax(c.r_bep, cur->barriers),
        c.r_wep = umax(c.r_wep, cur->warp_ops);
      } else {
        c.r_thr = kMany | kWarps, c.r_bep = umax(c.r_bep, cur->barriers), c.r_wep = me.block;
      }
    } else if ((r & ~kMany) == kWarps) {
      if (c.r_wep != me.block) c.r_thr = kMany | kBlocks;
      else c.r_bep = umax(c.r_bep, cur->barriers);
    } else if ((r & ~kMany) != kBlocks) {
      const uint32_t wg = r & ~kMany;
      if (wg / 32 != me.block) c.r_thr = kMany | kBlocks;
      else if (wg != me.warp) c.r_thr = kMany | kWarps, c.r_bep = umax(c.r_bep, cur->barriers), c.r_wep = me.block;
      else c.r_bep = umax(c.r_bep, cur->barriers), c.r_wep = umax(c.r_wep, cur->warp_ops);
    }
  }
}

EMU_NOSAN inline void access(const void* p, size_t n, bool write, bool atomic = false) {
  if (!checking || in_detector || !n) return;
  in_detector = true;
  check(p, n, write, atomic);
  in_detector = false;
}

// ---- barriers and warp operations

EMU_NOSAN inline void wait(Barrier& b, const void* site = nullptr) {
  const unsigned g = b.gen;
  if (site) {
    if (b.arrived == 0) b.site = site;
    else if (b.site != site) fail("divergent __syncthreads: threads of one block wait at different barriers");
  }
  if (++b.arrived == b.size) {  // the last arrival completes the barrier and runs on
    b.arrived = 0;
    b.any[(g + 1) & 1] = 0;  // the next generation's __syncthreads_or starts empty (see sync_or)
    ++b.gen;
    return;
  }
  cur->waiting = &b;
  cur->wait_gen = g;
  swapcontext(&cur->ctx, &sched);
}

// __syncthreads: the call site tells barriers apart (noinline, so that each textual barrier has one address).
EMU_NOSAN __attribute__((noinline)) inline void block_barrier() {
  wait(block_bar, __builtin_return_address(0));
  ++cur->barriers;
}

// __syncthreads_or: generation g's votes go into any[g & 1], which the completion of generation g - 1 cleared;
// every thread reads its generation's sum before it can arrive at the next barrier, the last user of that slot.
EMU_NOSAN __attribute__((noinline)) inline int block_barrier_or(int pred) {
  const unsigned g = block_bar.gen;
  block_bar.any[g & 1] |= pred != 0;
  wait(block_bar, __builtin_return_address(0));
  ++cur->barriers;
  return block_bar.any[g & 1];
}

// Every lane publishes v, the warp meets at a barrier, and each lane reads the slot it names. Two buffers make one
// barrier per operation enough: a lane writes buffer (n & 1) for operation n only after passing barrier n-1, which
// every lane reaches only after reading its value of operation n-2, the last user of that buffer.
template <class T>
EMU_NOSAN inline T exchange(unsigned mask, T v, int src) {
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
EMU_NOSAN inline void exchange_all(unsigned mask, uint64_t v, uint64_t (&out)[32]) {
  if (mask != 0xffffffffu) fail("warp operation with a partial mask");
  Warp& w = warps[cur->warp];
  uint64_t* s = w.slot[cur->warp_ops++ & 1];
  s[cur->lane] = v;
  wait(w.bar);
  std::memcpy(out, s, sizeof out);
}

EMU_NOSAN inline void entry() {
  body();
  cur->done = true;
}

// Runs the whole grid. Returns 0, or 1 with emu::error set (deadlock, race, bad launch).
EMU_NOSAN inline int launch(dim3 grid, dim3 block, unsigned seed, std::function<void()> kernel) {
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
  std::vector<uint3>& blocks = block_order;
  blocks.clear();
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back({x, y, z});
  std::shuffle(blocks.begin(), blocks.end(), rng);  // no kernel may depend on the order of blocks
  if (blocks.size() > 2000000) {
    error = "grid too large for the emulation";
    return 1;
  }
  constexpr size_t kStack = 256 * 1024;
  if (stack_mem.size() < nt * kStack) stack_mem.resize(nt * kStack);
  stack_lo = (uintptr_t)stack_mem.data();
  stack_hi = stack_lo + stack_mem.size();
  fibers.assign(nt, Fiber{});
  warps.assign(nt / 32, Warp{});
  std::vector<int> order(nt);
  for (int i = 0; i < nt; ++i) order[i] = i;
  shadow_clear();  // a launch is ordered after the last one (one stream)
  in_detector = false;
  struct Done { ~Done() { checking = false; cur = nullptr; shadow_clear(); } } done;
  for (size_t bi = 0; bi < blocks.size(); ++bi) {
    const uint3& b = blocks[bi];
    block_idx = b;
    block_bar = Barrier{};
    block_bar.size = nt;
    for (auto& w : warps) w.bar = Barrier{0, 0, 32};
    shadow_new_block();
    for (int i = 0; i < nt; ++i) {
      Fiber& f = fibers[i];
      f = Fiber{};
      f.tid = {(unsigned)i % block.x, ((unsigned)i / block.x) % block.y, (unsigned)i / (block.x * block.y)};
      f.warp = i / 32;
      f.lane = i % 32;
      f.thr = 1 + (uint32_t)bi * 1024 + (uint32_t)i;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = stack_mem.data() + i * kStack;
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
        checking = true;
        swapcontext(&sched, &f.ctx);
        checking = false;
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

}  // namespace
}  // namespace emu

// The instrumentation's entry points (gcc -fsanitize=thread emits calls to them; libtsan is not linked).
#define EMU_TSAN_RW(n)                                                                                   \
  extern "C" EMU_HOOK void __tsan_read##n(void* p) { emu::access(p, n, false); }                        \
  extern "C" EMU_HOOK void __tsan_write##n(void* p) { emu::access(p, n, true); }                        \
  extern "C" EMU_HOOK void __tsan_unaligned_read##n(void* p) { emu::access(p, n, false); }              \
  extern "C" EMU_HOOK void __tsan_unaligned_write##n(void* p) { emu::access(p, n, true); }              \
  extern "C" EMU_HOOK void __tsan_volatile_read##n(void* p) { emu::access(p, n, false); }               \
  extern "C" EMU_HOOK void __tsan_volatile_write##n(void* p) { emu::access(p, n, true); }
EMU_TSAN_RW(1)
EMU_TSAN_RW(2)
EMU_TSAN_RW(4)
EMU_TSAN_RW(8)
EMU_TSAN_RW(16)
extern "C" EMU_HOOK void __tsan_read_range(void* p, unsigned long n) { emu::access(p, n, false); }
extern "C" EMU_HOOK void __tsan_write_range(void* p, unsigned long n) { emu::access(p, n, true); }
extern "C" EMU_HOOK void __tsan_func_entry(void*) {}
extern "C" EMU_HOOK void __tsan_func_exit() {}
extern "C" EMU_HOOK void __tsan_init() {}

// Atomics: read-modify-writes marked atomic for the detector (nothing runs concurrently, so the update is plain).
template <class T>
EMU_NOSAN static inline T emu_atomic_add(T* p, T v) {
  emu::access(p, sizeof(T), true, true);
  const T o = *p;
  *p = o + v;
  return o;
}
EMU_NOSAN static inline float atomicAdd(float* p, float v) { return emu_atomic_add(p, v); }
EMU_NOSAN static inline int atomicAdd(int* p, int v) { return emu_atomic_add(p, v); }
EMU_NOSAN static inline unsigned atomicAdd(unsigned* p, unsigned v) { return emu_atomic_add(p, v); }
// sm_90's vector atomic: one 16-byte atomic update.
EMU_NOSAN static inline float4 atomicAdd(float4* p, float4 v) {
  emu::access(p, sizeof(float4), true, true);
  const float4 o = *p;
  *p = float4{o.x + v.x, o.y + v.y, o.z + v.z, o.w + v.w};
  return o;
}

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define warpSize 32

// Macros, so that block_barrier() is called from the kernel itself and its return address names the barrier.
#define __syncthreads() emu::block_barrier()
#define __syncthreads_or(pred) emu::block_barrier_or(pred)
EMU_NOSAN static inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::exchange(mask, 0, 0); }
template <class T> EMU_NOSAN static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = emu::cur->lane;
  return emu::exchange(mask, v, (lane & ~(width - 1)) | (src & (width - 1)));
}
template <class T> EMU_NOSAN static inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
  const int lane = emu::cur->lane, src = lane ^ m;
  return emu::exchange(mask, v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <class T> EMU_NOSAN static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
  const int lane = emu::cur->lane;
  return emu::exchange(mask, v, (lane & (width - 1)) + (int)d < width ? lane + (int)d : lane);
}
template <class T> EMU_NOSAN static inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
  const int lane = emu::cur->lane;
  return emu::exchange(mask, v, (lane & (width - 1)) >= (int)d ? lane - (int)d : lane);
}
EMU_NOSAN static inline unsigned __ballot_sync(unsigned mask, int pred) {
  uint64_t all[32];
  emu::exchange_all(mask, pred ? 1 : 0, all);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= (unsigned)all[l] << l;
  return r;
}
