// Device helpers shared by the CUDA kernels: dtype conversion, warp/block reductions,
// launch checks, dtype dispatch and the dropout key. No torch headers (see ops.h) beyond
// ATen's two small raw Philox-state headers.
//
// The same sources also build for the SIMT emulator (csrc/emu, -DBERTDIST_EMU), which runs
// them on the CPU in CI. The only spellings that differ are the three macros below.
#pragma once
#ifdef BERTDIST_EMU
#include "emu/emu.h"  // stands in for the CUDA runtime and the device built-ins
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// Before PhiloxUtils: torch 2.11's ATen/cuda/detail/UnpackRaw.cuh uses std::tuple without
// including <tuple>, and then fails to compile under nvcc 13.
#include <tuple>

#include <ATen/cuda/PhiloxUtils.cuh>
#endif

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "ops.h"
#include "philox.h"

// BD_LAUNCH(kernel, "name", grid, block, smem_bytes, stream)(args...) is
// kernel<<<grid, block, smem_bytes, stream>>>(args...); the emulator also reports the name.
// BD_SHARED(float, red, 66) is `__shared__ float red[66]`; BD_EXTERN_SHARED(float, smem) is
// `extern __shared__ float smem[]` (the launch's dynamic shared memory).
#ifdef BERTDIST_EMU
#define BD_LAUNCH(kernel, name, grid, block, smem_bytes, stream) \
  ::bdemu::Launcher(kernel, grid, block, smem_bytes, stream, name, __FILE__, __LINE__)
#define BD_SHARED(type, var, count)                                                       \
  static char var##_bd_key; /* one key per declaration: all threads get the same array */ \
  type* const var = static_cast<type*>(::bdemu::static_shared(&var##_bd_key, sizeof(type) * (count), alignof(type)))
#define BD_EXTERN_SHARED(type, var) type* const var = static_cast<type*>(::bdemu::dynamic_shared())
#else
#define BD_LAUNCH(kernel, name, grid, block, smem_bytes, stream) kernel<<<grid, block, smem_bytes, stream>>>
#define BD_SHARED(type, var, count) __shared__ type var[count]
#define BD_EXTERN_SHARED(type, var) extern __shared__ type var[]
#endif

namespace bertdist {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// N elements moved as one aligned load/store.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
#ifdef BERTDIST_EMU
  // The emulator checks what a GPU faults on: a vector load or store not aligned to its size.
  Vec() = default;
  Vec(const Vec& o) {
    ::bdemu::check_vector_access(&o, sizeof(Vec), false);
    std::memcpy(v, o.v, sizeof(v));
  }
  Vec& operator=(const Vec& o) {
    ::bdemu::check_vector_access(this, sizeof(Vec), true);
    std::memcpy(v, o.v, sizeof(v));
    return *this;
  }
#endif
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum of a and b over the block (blockDim.x a multiple of 32); every thread gets the result.
// smem needs 2 * 33 floats.
__device__ __forceinline__ float2 block_sum2(float a, float b, float* smem) {
  a = warp_sum(a);
  b = warp_sum(b);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();  // smem may still be read from the previous call
  if (lane == 0) {
    smem[w] = a;
    smem[33 + w] = b;
  }
  __syncthreads();
  if (w == 0) {
    float ta = lane < nw ? smem[lane] : 0.f, tb = lane < nw ? smem[33 + lane] : 0.f;
    ta = warp_sum(ta);
    tb = warp_sum(tb);
    if (lane == 0) {
      smem[32] = ta;
      smem[65] = tb;
    }
  }
  __syncthreads();
  return make_float2(smem[32], smem[65]);
}

// The (seed, offset) of this launch's dropout, chosen as DropoutRng (ops.h) says. Every
// thread calls it: the generator's captured state and a saved pair are single broadcast loads.
struct DropoutKey {
  uint64_t seed;
  uint32_t offset;
};

__device__ __forceinline__ DropoutKey dropout_key(const DropoutRng& r) {
  if (r.saved) return {static_cast<uint64_t>(r.saved[0]), static_cast<uint32_t>(r.saved[1])};
  DropoutKey k{r.seed, r.offset};
#ifdef BERTDIST_WITH_CUDA  // the CUDA generator exists only there; the emulated build takes explicit seeds
  if (r.from_generator) {
    const auto gen = at::cuda::philox::unpack(r.generator);
    dropout_key_from_generator(std::get<0>(gen), std::get<1>(gen), &k.seed, &k.offset);
  }
#endif
  return k;
}

// A forward's dropout key, recorded by one thread for the backward; called before any early exit.
__device__ __forceinline__ DropoutKey forward_dropout_key(const DropoutRng& r) {
  const DropoutKey k = dropout_key(r);
  if (r.save_to && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    r.save_to[0] = static_cast<int64_t>(k.seed);
    r.save_to[1] = static_cast<int64_t>(k.offset);
  }
  return k;
}

// Before a launch: an error already pending comes from an earlier asynchronous operation, not
// from this kernel; report it as such instead of letting check_launch name our kernel.
inline void check_before_launch(const char* what) {
  const cudaError_t e = cudaPeekAtLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error pending before ") + what +
                             " was launched (from an earlier operation): " + cudaGetErrorString(e));
}

inline void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

inline int current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

// A value per (kernel, device), computed once: cudaFuncGetAttributes and cudaFuncSetAttribute
// cost a driver call each, and their answers do not change while the process runs.
class PerKernelDevice {
 public:
  template <typename K, typename Make>
  int get(K kernel, Make&& make) {
    const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), current_device());
    std::lock_guard<std::mutex> lock(mu_);
    auto it = values_.find(key);
    if (it == values_.end()) it = values_.emplace(key, make()).first;  // make() throws: nothing cached
    return it->second;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<const void*, int>, int> values_;
};

// Lets `kernel` use `bytes` of dynamic shared memory (above 48 KB a kernel must opt in), once
// per kernel and device: the attribute persists. Each kernel is launched with one size.
template <typename K>
void opt_in_shared_memory(K kernel, size_t bytes, const char* name) {
  if (bytes <= 48 * 1024) return;
  static PerKernelDevice set;
  set.get(kernel, [&] {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
               name);
    return static_cast<int>(bytes);
  });
}

template <typename F>
void dispatch_cuda_dtype(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F16: f(__half{}); break;
    case DType::BF16: f(__nv_bfloat16{}); break;
    default: throw std::runtime_error(std::string(op) + ": dtype not supported by the CUDA kernels");
  }
}

}  // namespace bertdist
