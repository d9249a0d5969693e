// The SIMT emulator's runtime: grid and block scheduling, barriers, warp collectives, shared
// memory, launch limits and errors. What it emulates and what it cannot: emu.h.
#include "emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "fiber.h"

namespace bdemu {

thread_local const ThreadIds* tls_ids = nullptr;

namespace {

constexpr int kWarp = 32;

// Where a thread synchronises: the source line for messages, the instruction address
// (after inlining) to tell two call sites of one inline helper apart, as the GPU's PC does.
struct Site {
  const char* file = "";
  int line = 0;
  const void* pc = nullptr;
};

enum class Collective { kShfl, kSyncwarp };

// Two arrivals are at the same place when both the instruction and the source line match: the
// line tells apart calls the host compiler merged into one instruction.
bool same_site(const Site& a, const Site& b) { return a.pc == b.pc && a.line == b.line && a.file == b.file; }

const char* collective_name(Collective c) { return c == Collective::kShfl ? "__shfl_xor_sync" : "__syncwarp"; }

struct WarpOp {  // a warp collective some lanes of `mask` have reached
  Collective kind;
  Site site;
  unsigned mask = 0;
  unsigned arrived = 0;
};

struct Warp {
  unsigned exists = 0;      // lanes this block has (the last warp may be partial)
  unsigned runnable = 0;    // lanes not waiting and not exited
  unsigned at_barrier = 0;  // lanes waiting at __syncthreads
  unsigned exited = 0;
  std::vector<WarpOp> pending;
};

struct Thread {
  Context ctx;
  ThreadIds ids;
  int linear = 0, warp = 0, lane = 0;
  uint64_t shfl_in = 0, shfl_out = 0;  // this lane's value and what it receives
  int lane_mask = 0, width = kWarp;
};

struct Counts {
  std::mutex mu;
  std::map<std::string, KernelCount> kernels;
  Counters totals;
};

Counts& counts() {
  static Counts c;
  return c;
}

struct FuncAttrs {
  std::mutex mu;
  std::unordered_map<const void*, size_t> max_dynamic_smem;  // set by cudaFuncSetAttribute
};

FuncAttrs& func_attrs() {
  static FuncAttrs a;
  return a;
}

// CUDA's error state, per host thread: a pending code for cudaGetLastError, and the message
// of the last error for cudaGetErrorString.
struct ErrorState {
  cudaError_t pending = cudaSuccess;
  cudaError_t last_code = cudaSuccess;
  std::string last_message;
};
thread_local ErrorState tls_error;

void record_error(cudaError_t code, std::string message) {
  tls_error.pending = code;
  tls_error.last_code = code;
  tls_error.last_message = std::move(message);
}

std::string vformat(const char* fmt, va_list ap) {
  va_list ap2;
  va_copy(ap2, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap2);
  va_end(ap2);
  std::string s(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(s.data(), s.size() + 1, fmt, ap);
  return s;
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}

// A short piece of a message in a fixed buffer: a fiber that faults is never unwound, so the
// parts of its message must not own heap memory.
struct Text {
  char s[112];
  const char* c_str() const { return s; }
};

Text dim_str(const dim3& d) {
  Text t;
  std::snprintf(t.s, sizeof t.s, "(%u, %u, %u)", d.x, d.y, d.z);
  return t;
}

const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

Text site_str(const Site& s) {
  Text t;
  std::snprintf(t.s, sizeof t.s, "%s:%d", base_name(s.file), s.line);
  return t;
}

// Dynamic shared memory for one launch: the block's bytes end where a PROT_NONE page begins.
class DynamicSmem {
 public:
  explicit DynamicSmem(size_t bytes) : bytes_(bytes) {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t rounded = (bytes + 15) / 16 * 16;
    const size_t data_pages = (rounded + page_ - 1) / page_;
    map_bytes_ = (data_pages + 1) * page_;
    map_ = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map_ == MAP_FAILED) throw std::runtime_error("bdemu: mmap of dynamic shared memory failed");
    char* guard = static_cast<char*>(map_) + data_pages * page_;
    if (mprotect(guard, page_, PROT_NONE) != 0) {
      munmap(map_, map_bytes_);
      throw std::runtime_error("bdemu: mprotect of the shared-memory guard page failed");
    }
    base_ = guard - rounded;
  }
  ~DynamicSmem() { munmap(map_, map_bytes_); }
  DynamicSmem(const DynamicSmem&) = delete;
  DynamicSmem& operator=(const DynamicSmem&) = delete;
  void* data() const { return base_; }
  void fill_nan() const { std::memset(base_, 0xFF, bytes_); }

 private:
  size_t bytes_, page_ = 0, map_bytes_ = 0;
  void* map_ = nullptr;
  char* base_ = nullptr;
};

// The state of one launch while its blocks run on this host thread.
struct Launch {
  const LaunchConfig& cfg;
  Body body;
  DeviceProps dev;
  size_t smem_limit = 0;  // static + dynamic bytes: 48 KB, or the opt-in ceiling once opted in
  int nthreads = 0, nwarps = 0;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  Context host;
  StackPool* stacks = nullptr;
  DynamicSmem* dyn = nullptr;
  // Static __shared__ arrays of the running block, keyed by their declaration.
  std::vector<unsigned char> static_arena;
  size_t static_used = 0;
  std::vector<std::pair<const void*, void*>> static_vars;
  // The running block.
  uint3 block_idx{};
  bool descending = false;
  int live = 0;
  int barrier_arrived = 0;
  Site barrier_site;
  // A fault ends the launch.
  bool faulted = false;
  cudaError_t fault_code = cudaSuccess;
  std::string fault_message;
  Counters counters;

  Launch(const LaunchConfig& c, Body b) : cfg(c), body(b) {}
};

thread_local Launch* tls_launch = nullptr;
thread_local Thread* tls_thread = nullptr;
thread_local std::unique_ptr<StackPool> tls_stacks;  // freed when the host thread ends

std::string where(const Launch& L, const Thread& t) {
  const dim3 b(L.block_idx.x, L.block_idx.y, L.block_idx.z);
  const dim3 th(t.ids.thread_idx.x, t.ids.thread_idx.y, t.ids.thread_idx.z);
  return format("%s: block %s thread %s (warp %d lane %d)", L.cfg.name, dim_str(b).c_str(), dim_str(th).c_str(), t.warp,
                t.lane);
}

// From a fiber: record the fault and leave for the host side for good. The fiber's frames are
// abandoned, never unwound, so none may own memory then: the message is emptied here, and the
// pieces it is made of (site_str, dim_str) are fixed-size buffers, not heap strings.
[[noreturn]] void fiber_fault(cudaError_t code, std::string msg) {
  Launch& L = *tls_launch;
  if (!L.faulted) {
    L.faulted = true;
    L.fault_code = code;
    L.fault_message = where(L, *tls_thread) + ": " + msg;
  }
  std::string().swap(msg);  // the caller's temporary: its memory goes now
  switch_to(&tls_thread->ctx, &L.host);
  std::abort();  // never resumed
}

Launch& current(const char* what) {
  if (tls_launch == nullptr || tls_thread == nullptr)
    throw std::logic_error(std::string("bdemu: ") + what + " called outside an emulated kernel");
  return *tls_launch;
}

// Leaves the running fiber blocked; returns when the scheduler resumes it.
void block_current(Launch& L, Thread& t) {
  ++L.counters.context_switches;
  switch_to(&t.ctx, &L.host);
}

// A thread's whole life but the final switch, so that every frame it used has returned (and,
// under AddressSanitizer, left its stack unpoisoned for the next block's fiber).
__attribute__((noinline)) void thread_body(Thread* t) {
  Launch& L = *tls_launch;
  L.body.call(L.body.self);
  // The thread exits. Lanes waiting for it at a warp collective can never complete.
  Warp& w = L.warps[t->warp];
  const unsigned me = 1u << t->lane;
  for (const WarpOp& op : w.pending)
    if (op.mask & me)
      fiber_fault(cudaErrorLaunchFailure, format("exited while lanes 0x%08x wait for it at %s (%s, mask 0x%08x)",
                                                 op.arrived, collective_name(op.kind), site_str(op.site).c_str(),
                                                 op.mask));
  w.exited |= me;
  w.runnable &= ~me;
  --L.live;
  if (L.barrier_arrived > 0 && L.barrier_arrived == L.live) {  // exited threads count as arrived
    for (Warp& x : L.warps) {
      x.runnable |= x.at_barrier;
      x.at_barrier = 0;
    }
    L.barrier_arrived = 0;
  }
}

__attribute__((no_sanitize_address)) void fiber_main(void* arg) {
  auto* t = static_cast<Thread*>(arg);
  fiber_started(&tls_launch->host);
  thread_body(t);
  switch_to(&t->ctx, &tls_launch->host, /*from_done=*/true);
  std::abort();
}

int first_lane(unsigned mask, bool descending) {
  return descending ? 31 - __builtin_clz(mask) : __builtin_ctz(mask);
}

// The next lane of `mask` after `lane`, cyclically, in the block's direction.
int next_lane(unsigned mask, int lane, bool descending) {
  if (descending) {
    const unsigned lo = mask & ((1u << lane) - 1u);
    return lo ? 31 - __builtin_clz(lo) : 31 - __builtin_clz(mask);
  }
  const unsigned hi = lane == 31 ? 0u : mask & ~((2u << lane) - 1u);
  return hi ? __builtin_ctz(hi) : __builtin_ctz(mask);
}

// Warp-greedy choice: another lane of the same warp if one can run, else the next warp that
// can. Warps thus run as far apart as synchronisation allows, which is what exposes a missing
// barrier: one warp overwrites (or reads) shared memory before the others got there.
int pick_next(const Launch& L, int cur) {
  const int w = cur / kWarp;
  if (L.warps[w].runnable) return w * kWarp + next_lane(L.warps[w].runnable, cur % kWarp, L.descending);
  for (int k = 1; k < L.nwarps; ++k) {
    const int w2 = L.descending ? (w - k + L.nwarps) % L.nwarps : (w + k) % L.nwarps;
    if (L.warps[w2].runnable) return w2 * kWarp + first_lane(L.warps[w2].runnable, L.descending);
  }
  return -1;
}

std::string deadlock_report(const Launch& L) {
  std::string s = format("deadlock: %d of %d threads still running, none can proceed", L.live, L.nthreads);
  if (L.barrier_arrived)
    s += format("; %d wait at __syncthreads (%s)", L.barrier_arrived, site_str(L.barrier_site).c_str());
  for (int w = 0; w < L.nwarps; ++w)
    for (const WarpOp& op : L.warps[w].pending)
      s += format("; warp %d lanes 0x%08x wait at %s (%s) for lanes 0x%08x of mask 0x%08x", w, op.arrived,
                  collective_name(op.kind), site_str(op.site).c_str(), op.mask & ~op.arrived, op.mask);
  return s;
}

void run_block(Launch& L, uint3 block_idx, bool descending) {
  L.block_idx = block_idx;
  L.descending = descending;
  L.live = L.nthreads;
  L.barrier_arrived = 0;
  L.static_used = 0;
  L.static_vars.clear();
  L.dyn->fill_nan();
  for (int w = 0; w < L.nwarps; ++w) {
    const int n = std::min(kWarp, L.nthreads - w * kWarp);
    Warp& x = L.warps[w];
    x.exists = n == kWarp ? 0xffffffffu : (1u << n) - 1u;
    x.runnable = x.exists;
    x.at_barrier = x.exited = 0;
    x.pending.clear();
  }
  const dim3 bd = L.cfg.block;
  for (int i = 0; i < L.nthreads; ++i) {
    Thread& t = L.threads[i];
    t.linear = i;
    t.warp = i / kWarp;
    t.lane = i % kWarp;
    t.ids.thread_idx = uint3{static_cast<unsigned>(i) % bd.x, static_cast<unsigned>(i) / bd.x % bd.y,
                             static_cast<unsigned>(i) / (bd.x * bd.y)};
    t.ids.block_idx = block_idx;
    t.ids.block_dim = bd;
    t.ids.grid_dim = L.cfg.grid;
    make_context(&t.ctx, L.stacks->acquire(static_cast<size_t>(i)), StackPool::kStackBytes, &fiber_main, &t);
  }
  int cur = descending ? L.nthreads - 1 : 0;
  while (true) {
    tls_thread = &L.threads[cur];
    tls_ids = &L.threads[cur].ids;
    ++L.counters.context_switches;
    switch_to(&L.host, &L.threads[cur].ctx);
    tls_thread = nullptr;
    tls_ids = nullptr;
    if (L.faulted) return;
    cur = pick_next(L, cur);
    if (cur < 0) {
      if (L.live == 0) return;
      L.faulted = true;
      L.fault_code = cudaErrorLaunchFailure;
      L.fault_message = format("%s: block %s: ", L.cfg.name,
                               dim_str(dim3(block_idx.x, block_idx.y, block_idx.z)).c_str()) + deadlock_report(L);
      return;
    }
  }
}

// Launch-time checks, as the CUDA runtime makes them; "" when the launch may go ahead.
std::string config_error(const LaunchConfig& c, const DeviceProps& d, size_t max_dynamic, bool opted_in,
                         cudaError_t* code) {
  *code = cudaErrorInvalidConfiguration;
  const unsigned b[3] = {c.block.x, c.block.y, c.block.z};
  const unsigned g[3] = {c.grid.x, c.grid.y, c.grid.z};
  const uint64_t threads = uint64_t{b[0]} * b[1] * b[2];
  for (int i = 0; i < 3; ++i) {
    if (b[i] == 0 || b[i] > static_cast<unsigned>(d.max_block_dim[i]))
      return format("block dimension %d is %u (allowed 1..%d)", i, b[i], d.max_block_dim[i]);
    if (g[i] == 0 || g[i] > d.max_grid_dim[i])
      return format("grid dimension %d is %u (allowed 1..%lld)", i, g[i], static_cast<long long>(d.max_grid_dim[i]));
  }
  if (threads > static_cast<uint64_t>(d.max_threads_per_block))
    return format("%llu threads per block > %d", static_cast<unsigned long long>(threads), d.max_threads_per_block);
  if (threads > static_cast<uint64_t>(d.kernel_max_threads)) {
    *code = cudaErrorLaunchOutOfResources;
    return format("too many resources requested for launch: %llu threads > this kernel's maxThreadsPerBlock %d",
                  static_cast<unsigned long long>(threads), d.kernel_max_threads);
  }
  if (c.dynamic_smem > max_dynamic) {
    *code = cudaErrorInvalidValue;
    return format("%zu bytes of dynamic shared memory > this kernel's limit of %zu (%s)", c.dynamic_smem, max_dynamic,
                  opted_in ? "set by cudaFuncSetAttribute"
                           : "the default; cudaFuncSetAttribute(MaxDynamicSharedMemorySize) raises it");
  }
  return "";
}

void add_counts(const Launch& L, int64_t blocks) {
  Counts& c = counts();
  std::lock_guard<std::mutex> lock(c.mu);
  KernelCount& k = c.kernels[L.cfg.name];
  k.name = L.cfg.name;
  k.launches += 1;
  k.blocks += blocks;
  k.threads += blocks * L.nthreads;
  c.totals.context_switches += L.counters.context_switches;
  c.totals.barriers += L.counters.barriers;
  c.totals.warp_collectives += L.counters.warp_collectives;
}

}  // namespace

// ---------------------------------------------------------------- device code entry points

void syncthreads(const char* file, int line) {
  const Site site{file, line, __builtin_return_address(0)};
  Launch& L = current("__syncthreads");
  Thread& t = *tls_thread;
  Warp& w = L.warps[t.warp];
  const unsigned me = 1u << t.lane;
  for (const WarpOp& op : w.pending)
    if (op.mask & me)
      fiber_fault(cudaErrorLaunchFailure,
                  format("reached __syncthreads (%s) while lanes 0x%08x wait for it at %s (%s, mask 0x%08x)",
                         site_str(site).c_str(), op.arrived, collective_name(op.kind), site_str(op.site).c_str(),
                         op.mask));
  if (L.barrier_arrived == 0) {
    L.barrier_site = site;
  } else if (!same_site(L.barrier_site, site)) {
    fiber_fault(cudaErrorLaunchFailure,
                format("reached __syncthreads at %s while %d threads wait at another __syncthreads (%s)",
                       site_str(site).c_str(), L.barrier_arrived, site_str(L.barrier_site).c_str()));
  }
  ++L.counters.barriers;
  if (++L.barrier_arrived == L.live) {
    for (Warp& x : L.warps) {
      x.runnable |= x.at_barrier;
      x.at_barrier = 0;
    }
    L.barrier_arrived = 0;
    return;
  }
  w.runnable &= ~me;
  w.at_barrier |= me;
  block_current(L, t);
}

namespace {

// One lane's arrival at a warp collective; returns what the lane receives (shuffles).
uint64_t warp_collective(Collective kind, const Site& site, unsigned mask, uint64_t value, int lane_mask, int width) {
  Launch& L = current(collective_name(kind));
  Thread& t = *tls_thread;
  Warp& w = L.warps[t.warp];
  const unsigned me = 1u << t.lane;
  const char* name = collective_name(kind);
  const Text at = site_str(site);  // a fixed buffer: a waiting fiber holds no heap object
  if (!(mask & me))
    fiber_fault(cudaErrorLaunchFailure, format("%s (%s) with mask 0x%08x does not include the calling lane %d", name,
                                               at.c_str(), mask, t.lane));
  if (mask & ~w.exists)
    fiber_fault(cudaErrorLaunchFailure, format("%s (%s) mask 0x%08x names lanes 0x%08x this block does not have "
                                               "(blockDim %s)", name, at.c_str(), mask, mask & ~w.exists,
                                               dim_str(L.cfg.block).c_str()));
  if (mask & w.exited)
    fiber_fault(cudaErrorLaunchFailure, format("%s (%s) mask 0x%08x names lanes 0x%08x that have exited", name,
                                               at.c_str(), mask, mask & w.exited));
  if (mask & w.at_barrier)
    fiber_fault(cudaErrorLaunchFailure,
                format("%s (%s) mask 0x%08x names lanes 0x%08x that wait at __syncthreads (%s): divergent warp", name,
                       at.c_str(), mask, mask & w.at_barrier, site_str(L.barrier_site).c_str()));
  if (kind == Collective::kShfl && (width < 1 || width > kWarp || (width & (width - 1))))
    fiber_fault(cudaErrorLaunchFailure, format("%s (%s) width %d is not a power of 2 in [1, 32]", name, at.c_str(),
                                               width));
  WarpOp* op = nullptr;
  for (WarpOp& p : w.pending) {
    if (p.mask & me) {
      op = &p;
      break;
    }
  }
  if (op == nullptr) {
    for (const WarpOp& p : w.pending)
      if (p.mask & mask)
        fiber_fault(cudaErrorLaunchFailure,
                    format("%s (%s) mask 0x%08x overlaps lanes 0x%08x waiting at %s (%s) with mask 0x%08x: "
                           "divergent warp", name, at.c_str(), mask, p.arrived, collective_name(p.kind),
                           site_str(p.site).c_str(), p.mask));
    w.pending.push_back(WarpOp{kind, site, mask, 0});
    op = &w.pending.back();
  } else if (op->kind != kind || !same_site(op->site, site) || op->mask != mask) {
    fiber_fault(cudaErrorLaunchFailure,
                format("divergent warp: lane %d reached %s (%s) with mask 0x%08x while lanes 0x%08x wait for it at "
                       "%s (%s) with mask 0x%08x", t.lane, name, at.c_str(), mask, op->arrived,
                       collective_name(op->kind), site_str(op->site).c_str(), op->mask));
  }
  t.shfl_in = value;
  t.lane_mask = lane_mask;
  t.width = width;
  op->arrived |= me;
  if (op->arrived != op->mask) {
    w.runnable &= ~me;
    block_current(L, t);
    return t.shfl_out;
  }
  // The last lane arrived: exchange and release everyone.
  ++L.counters.warp_collectives;
  const int base = t.warp * kWarp;
  if (kind == Collective::kShfl) {
    for (unsigned m = mask; m; m &= m - 1) {
      const int lane = __builtin_ctz(m);
      Thread& r = L.threads[base + lane];
      // PTX shfl.sync.bfly with c = ((32 - width) << 8) | 31: a source past the lane's
      // segment gives the lane its own value.
      const int seg = kWarp - r.width;
      const int max_lane = (lane & seg) | (31 & ~seg);
      int src = lane ^ (r.lane_mask & 31);
      if (src > max_lane) src = lane;
      if (!(mask & (1u << src)))
        fiber_fault(cudaErrorLaunchFailure, format("%s (%s): lane %d reads lane %d, which is not in mask 0x%08x",
                                                   name, at.c_str(), lane, src, mask));
      r.shfl_out = L.threads[base + src].shfl_in;
    }
  }
  w.runnable |= mask;
  for (size_t i = 0; i < w.pending.size(); ++i) {
    if (&w.pending[i] == op) {
      w.pending.erase(w.pending.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  }
  return t.shfl_out;
}

}  // namespace

void syncwarp(const char* file, int line, unsigned mask) {
  const Site site{file, line, __builtin_return_address(0)};
  warp_collective(Collective::kSyncwarp, site, mask, 0, 0, kWarp);
}

uint64_t shfl_xor_bits(const char* file, int line, unsigned mask, uint64_t bits, int lane_mask, int width) {
  const Site site{file, line, __builtin_return_address(0)};
  return warp_collective(Collective::kShfl, site, mask, bits, lane_mask, width);
}

void fault(cudaError_t code, const char* fmt, ...) {
  current("a device-side check");
  va_list ap;
  va_start(ap, fmt);
  std::string msg = vformat(fmt, ap);
  va_end(ap);
  fiber_fault(code, std::move(msg));  // leaves msg empty
}

void check_vector_access(const void* p, size_t bytes, bool store) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a % bytes)
    fault(cudaErrorMisalignedAddress, "misaligned %zu-byte vector %s at %p (address %% %zu = %zu); a GPU faults here",
          bytes, store ? "store" : "load", p, bytes, static_cast<size_t>(a % bytes));
}

void* dynamic_shared() { return current("dynamic shared memory").dyn->data(); }

void* static_shared(const void* key, size_t bytes, size_t align) {
  Launch& L = current("a __shared__ array");
  for (const auto& kv : L.static_vars)
    if (kv.first == key) return kv.second;
  const size_t off = (L.static_used + align - 1) / align * align;
  if (off + bytes > L.dev.shared_per_block || off + bytes + L.cfg.dynamic_smem > L.smem_limit)
    fault(cudaErrorInvalidValue,
          "%zu bytes of static shared memory (at most %zu) plus %zu dynamic exceed the block's %zu bytes", off + bytes,
          L.dev.shared_per_block, L.cfg.dynamic_smem, L.smem_limit);
  void* ptr = L.static_arena.data() + off;
  std::memset(ptr, 0xFF, bytes);  // NaN for floats: reads before writes show up in results
  L.static_used = off + bytes;
  L.static_vars.emplace_back(key, ptr);
  return ptr;
}

// ---------------------------------------------------------------- host side

void run_grid(const LaunchConfig& cfg, Body body) {
  if (tls_launch != nullptr) {
    record_error(cudaErrorNotSupported, std::string(cfg.name) + ": launch from inside an emulated kernel");
    return;
  }
  Launch L(cfg, body);
  L.dev = device();
  size_t max_dynamic = L.dev.shared_per_block;
  bool opted_in = false;
  {
    FuncAttrs& a = func_attrs();
    std::lock_guard<std::mutex> lock(a.mu);
    auto it = a.max_dynamic_smem.find(cfg.func);
    if (it != a.max_dynamic_smem.end()) {
      max_dynamic = it->second;
      opted_in = true;
    }
  }
  cudaError_t code = cudaSuccess;
  const std::string err = config_error(cfg, L.dev, max_dynamic, opted_in, &code);
  if (!err.empty()) {
    record_error(code, format("%s (launched at %s:%d with grid %s, block %s): %s", cfg.name, base_name(cfg.file),
                              cfg.line, dim_str(cfg.grid).c_str(), dim_str(cfg.block).c_str(), err.c_str()));
    return;
  }
  L.smem_limit = opted_in ? L.dev.shared_per_block_optin : L.dev.shared_per_block;
  L.nthreads = static_cast<int>(cfg.block.x * cfg.block.y * cfg.block.z);
  L.nwarps = (L.nthreads + kWarp - 1) / kWarp;
  L.threads.resize(static_cast<size_t>(L.nthreads));
  L.warps.resize(static_cast<size_t>(L.nwarps));
  L.static_arena.assign(L.dev.shared_per_block, 0);
  if (!tls_stacks) tls_stacks = std::make_unique<StackPool>();
  L.stacks = tls_stacks.get();
  DynamicSmem dyn(cfg.dynamic_smem);
  L.dyn = &dyn;
  tls_launch = &L;
  int64_t blocks = 0;
  for (unsigned z = 0; z < cfg.grid.z && !L.faulted; ++z)
    for (unsigned y = 0; y < cfg.grid.y && !L.faulted; ++y)
      for (unsigned x = 0; x < cfg.grid.x && !L.faulted; ++x) {
        const uint64_t linear = x + uint64_t{cfg.grid.x} * (y + uint64_t{cfg.grid.y} * z);
        const bool desc = L.dev.order == Order::kDescending || (L.dev.order == Order::kAlternate && (linear & 1));
        run_block(L, uint3{x, y, z}, desc);
        ++blocks;
      }
  tls_launch = nullptr;
  if (L.faulted) L.stacks->mark_used_dirty(static_cast<size_t>(L.nthreads));  // frames were abandoned
  add_counts(L, blocks);
  if (L.faulted)
    record_error(L.fault_code, format("%s (launched at %s:%d with grid %s, block %s): %s", cfg.name,
                                      base_name(cfg.file), cfg.line, dim_str(cfg.grid).c_str(),
                                      dim_str(cfg.block).c_str(), L.fault_message.c_str()));
}

cudaError_t get_last_error() {
  const cudaError_t e = tls_error.pending;
  tls_error.pending = cudaSuccess;
  return e;
}

cudaError_t peek_at_last_error() { return tls_error.pending; }

void inject_pending_error() {
  record_error(cudaErrorLaunchFailure, "an error injected by a check, standing for an earlier asynchronous failure");
}

int take_pending_error() { return static_cast<int>(get_last_error()); }

namespace {
void count_attribute_call() {
  Counts& c = counts();
  std::lock_guard<std::mutex> lock(c.mu);
  ++c.totals.attribute_calls;
}
}  // namespace

const char* error_string(cudaError_t e) {
  if (e == cudaSuccess) return "no error";
  if (e == tls_error.last_code && !tls_error.last_message.empty()) return tls_error.last_message.c_str();
  switch (e) {
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    default: return "emulated CUDA error";
  }
}

cudaError_t set_func_attribute(const void* func, cudaFuncAttribute attr, int value) {
  count_attribute_call();
  const DeviceProps d = device();
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > d.shared_per_block_optin) {
      record_error(cudaErrorInvalidValue,
                   format("cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize, %d): the emulated device "
                          "allows at most %zu bytes", value, d.shared_per_block_optin));
      return cudaErrorInvalidValue;
    }
    FuncAttrs& a = func_attrs();
    std::lock_guard<std::mutex> lock(a.mu);
    a.max_dynamic_smem[func] = static_cast<size_t>(value);
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;  // a hint
  record_error(cudaErrorInvalidValue,
               format("cudaFuncSetAttribute: attribute %d is not emulated", static_cast<int>(attr)));
  return cudaErrorInvalidValue;
}

cudaError_t get_func_attributes(cudaFuncAttributes* attr, const void* func) {
  count_attribute_call();
  const DeviceProps d = device();
  std::memset(attr, 0, sizeof(*attr));
  attr->maxThreadsPerBlock = d.kernel_max_threads;
  attr->maxDynamicSharedSizeBytes = static_cast<int>(d.shared_per_block);
  FuncAttrs& a = func_attrs();
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.max_dynamic_smem.find(func);
  if (it != a.max_dynamic_smem.end()) attr->maxDynamicSharedSizeBytes = static_cast<int>(it->second);
  attr->ptxVersion = attr->binaryVersion = 80;
  return cudaSuccess;
}

cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int) {
  const DeviceProps d = device();
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = d.multiprocessors; return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock: *value = d.max_threads_per_block; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = kWarp; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(d.shared_per_block); return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(d.shared_per_block_optin);
      return cudaSuccess;
    default:
      record_error(cudaErrorInvalidValue,
                   format("cudaDeviceGetAttribute: attribute %d is not emulated", static_cast<int>(attr)));
      return cudaErrorInvalidValue;
  }
}

DeviceProps& device() {
  static DeviceProps d;
  return d;
}

namespace {
auto props_key(const DeviceProps& d) {
  return std::make_tuple(d.multiprocessors, d.max_threads_per_block, d.max_block_dim[0], d.max_block_dim[1],
                         d.max_block_dim[2], d.max_grid_dim[0], d.max_grid_dim[1], d.max_grid_dim[2],
                         d.shared_per_block, d.shared_per_block_optin, d.kernel_max_threads, static_cast<int>(d.order));
}
}  // namespace

cudaError_t get_device(int* id) {
  static std::mutex mu;
  static std::vector<decltype(props_key(DeviceProps{}))> seen;
  const auto key = props_key(device());
  std::lock_guard<std::mutex> lock(mu);
  auto it = std::find(seen.begin(), seen.end(), key);
  if (it == seen.end()) it = seen.insert(seen.end(), key);
  *id = static_cast<int>(it - seen.begin());
  return cudaSuccess;
}

std::string describe_device() {
  const DeviceProps& d = device();
  return format("emulated CUDA device (bdemu, csrc/emu): %d multiprocessors, %d threads per block, %zu KB shared "
                "memory per block (%zu KB opt-in), warps of 32, blocks run one at a time in %s order",
                d.multiprocessors, d.max_threads_per_block, d.shared_per_block / 1024, d.shared_per_block_optin / 1024,
                d.order == Order::kAlternate ? "alternating"
                                             : (d.order == Order::kAscending ? "ascending" : "descending"));
}

std::vector<KernelCount> kernel_counts() {
  Counts& c = counts();
  std::lock_guard<std::mutex> lock(c.mu);
  std::vector<KernelCount> out;
  for (const auto& kv : c.kernels) out.push_back(kv.second);
  return out;
}

Counters counters() {
  Counts& c = counts();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.totals;
}

void reset_counts() {
  Counts& c = counts();
  std::lock_guard<std::mutex> lock(c.mu);
  c.kernels.clear();
  c.totals = Counters{};
}

}  // namespace bdemu
