// bdemu: a SIMT emulator that runs this project's CUDA kernels (csrc/cuda_*.cu) on the CPU.
//
// The .cu files are compiled by the host C++ compiler with -DBERTDIST_EMU; cuda_common.cuh
// then includes this header instead of <cuda_runtime.h>. The kernels need no rewrite: their
// launches go through BD_LAUNCH and their shared arrays through BD_SHARED / BD_EXTERN_SHARED
// (cuda_common.cuh), which are the CUDA syntax itself under nvcc.
//
// What is emulated:
// - A launch runs its blocks one after another. A block is one fiber (own stack, own
//   registers) per CUDA thread, with threadIdx/blockIdx/blockDim/gridDim per fiber, warps of
//   32 consecutive linear thread ids, and a cooperative scheduler that switches fibers only at
//   synchronisation points.
// - __syncthreads is a barrier that counts arrivals; exited threads count as arrived. Threads
//   arriving at two different __syncthreads (two call sites) stop the launch with an error.
// - __syncwarp and __shfl_xor_sync are warp collectives keyed by call site (the instruction
//   address after inlining, like the GPU's program counter, and the source line) and mask.
//   (So the host compiler must not copy a collective into lane-dependent paths, as -O3's
//   loop unswitching may: the emulated builds use -O2, see _build_config.emu_cxx_flags.)
//   The launch stops with a message naming lanes, masks and source lines when: the mask omits
//   the calling lane or names exited or absent lanes; a lane named in the mask reaches a
//   different collective, a __syncthreads or its end instead (divergence); a shuffle reads a
//   lane outside the mask; or nothing can run (deadlock).
// - Shared memory (static and dynamic) is per block, filled with NaN (all bits set) at block
//   start; dynamic shared memory ends at a guard page. Launch limits are enforced: threads and
//   grid dimensions, 48 KB of shared memory without opt-in, the opt-in ceiling of the emulated
//   device (DeviceProps), set through cudaFuncSetAttribute as on a GPU; a block larger than
//   cudaFuncGetAttributes' maxThreadsPerBlock fails as a register-starved launch does.
// - Vectorised accesses (the kernels' Vec<T, N>) must be aligned to their size, as on a GPU
//   where a misaligned vector load faults.
// - Errors surface as CUDA does: the launch records an error that cudaGetLastError returns,
//   and cudaGetErrorString gives the emulator's message.
//
// What it cannot do (see docs/kernels-and-gpus.md, "The CUDA kernels without a GPU"):
// - performance, occupancy, bank conflicts; register counts (DeviceProps::kernel_max_threads
//   stands in for them, one value for every kernel);
// - concurrency between blocks (they run one at a time) and between streams;
// - CUDA's weak memory ordering: every write is at once visible to every thread, so a
//   missing __syncwarp between a shared-memory write and read is invisible when a shuffle
//   (which every lane must reach) already orders them;
// - __CUDA_ARCH__-only code and device intrinsics are compiled for the host, not the GPU:
//   their GPU versions are checked only by the nvcc compile-and-link test;
// - host math (expf, sqrtf) differs from the GPU's in the last bits.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>  // host mode; via cuda_runtime_api.h also dim3, float2, cudaError_t

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#include "emu_api.h"

namespace bdemu {

struct ThreadIds {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
// The running fiber's ids (set by the scheduler before it resumes a fiber).
extern thread_local const ThreadIds* tls_ids;

// Out of line on purpose: each takes its call site's address as the warp's program counter.
void syncthreads(const char* file, int line);
void syncwarp(const char* file, int line, unsigned mask = 0xffffffffu);
uint64_t shfl_xor_bits(const char* file, int line, unsigned mask, uint64_t bits, int lane_mask, int width);

// Ends the launch with a message (from kernel code); never returns.
[[noreturn]] void fault(cudaError_t code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void check_vector_access(const void* p, size_t bytes, bool store);

void* dynamic_shared();
void* static_shared(const void* key, size_t bytes, size_t align);

template <typename T>
__attribute__((always_inline)) inline T shfl_xor(const char* file, int line, unsigned mask, T v, int lane_mask,
                                                 int width = 32) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = shfl_xor_bits(file, line, mask, bits, lane_mask, width);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// ---------------------------------------------------------------- launches

struct LaunchConfig {
  dim3 grid, block;
  size_t dynamic_smem;
  const void* func;  // identifies the kernel for cudaFuncSetAttribute
  const char* name;
  const char* file;
  int line;
};

// The kernel body each fiber runs, type-erased.
struct Body {
  void (*call)(const void*);
  const void* self;
};

// Runs every block of the grid; errors go to the last-error state (cudaGetLastError).
void run_grid(const LaunchConfig& cfg, Body body);

template <typename... P>
class Launcher {
 public:
  Launcher(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t, const char* name,
           const char* file, int line)
      : kernel_(kernel), cfg_{grid, block, smem, reinterpret_cast<const void*>(kernel), name, file, line} {}

  template <typename... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "kernel launched with the wrong number of arguments");
    // Arguments are converted to the parameter types once, as a CUDA launch does; every
    // thread then receives its own by-value copies.
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    const auto run = [&] { std::apply(kernel_, params); };
    using Run = decltype(run);
    run_grid(cfg_, Body{[](const void* self) { (*static_cast<const Run*>(self))(); }, &run});
  }

 private:
  void (*kernel_)(P...);
  LaunchConfig cfg_;
};

// ---------------------------------------------------------------- runtime API replacements

cudaError_t get_last_error();
cudaError_t peek_at_last_error();
const char* error_string(cudaError_t e);
cudaError_t set_func_attribute(const void* func, cudaFuncAttribute attr, int value);
cudaError_t get_func_attributes(cudaFuncAttributes* attr, const void* func);
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int device);
// The current device: each distinct DeviceProps the process has used is a device of its own, so
// that what launchers cache per device is queried again when a check emulates another GPU.
cudaError_t get_device(int* device);

template <typename F>
cudaError_t func_set_attribute(F* func, cudaFuncAttribute attr, int value) {
  return set_func_attribute(reinterpret_cast<const void*>(func), attr, value);
}

template <typename F>
cudaError_t func_get_attributes(cudaFuncAttributes* attr, F* func) {
  return get_func_attributes(attr, reinterpret_cast<const void*>(func));
}

}  // namespace bdemu

// Device built-ins, as kernel code spells them.
#define threadIdx (::bdemu::tls_ids->thread_idx)
#define blockIdx (::bdemu::tls_ids->block_idx)
#define blockDim (::bdemu::tls_ids->block_dim)
#define gridDim (::bdemu::tls_ids->grid_dim)
#define warpSize 32
#define __syncthreads() ::bdemu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::bdemu::syncwarp(__FILE__, __LINE__ __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_xor_sync(mask, ...) ::bdemu::shfl_xor(__FILE__, __LINE__, mask, __VA_ARGS__)
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

#define cudaGetLastError ::bdemu::get_last_error
#define cudaPeekAtLastError ::bdemu::peek_at_last_error
#define cudaGetErrorString ::bdemu::error_string
#define cudaFuncSetAttribute ::bdemu::func_set_attribute
#define cudaFuncGetAttributes ::bdemu::func_get_attributes
#define cudaDeviceGetAttribute ::bdemu::device_get_attribute
#define cudaGetDevice ::bdemu::get_device

// Integer min/max, which device code gets from CUDA's math headers.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
