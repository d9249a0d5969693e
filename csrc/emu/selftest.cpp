// The emulator's own checks: small kernels whose right behaviour (or right error) is known.
// Compiled like the project's kernels (-DBERTDIST_EMU, through cuda_common.cuh).
#include <cmath>
#include <string>
#include <vector>

#include "../cuda_common.cuh"
#include "checks.h"

namespace bdemu {
namespace {

constexpr unsigned kFull = 0xffffffffu;

// The launch's error message, "" when it succeeded.
std::string launch_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

bool expect_error(const std::string& err, const char* needle, std::string* why) {
  if (err.find(needle) != std::string::npos) return true;
  *why = std::string("expected an error containing \"") + needle + "\", got " +
         (err.empty() ? std::string("none") : "\"" + err + "\"");
  return false;
}

bool expect_ok(const std::string& err, std::string* why) {
  if (err.empty()) return true;
  *why = "unexpected error: " + err;
  return false;
}

// ---------------------------------------------------------------- kernels

__global__ void ids_kernel(int* out) {
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int n = blockDim.x * blockDim.y * blockDim.z;
  out[b * n + t] = static_cast<int>(blockIdx.x * 1000000 + blockIdx.y * 100000 + blockIdx.z * 10000 +
                                    threadIdx.x * 100 + threadIdx.y * 10 + threadIdx.z);
}

// Threads >= live exit at once; the others exchange values through shared memory twice.
__global__ void early_exit_kernel(int live, float* out) {
  BD_SHARED(float, s, 128);
  const int t = threadIdx.x;
  if (t >= live) return;
  s[t] = static_cast<float>(t);
  __syncthreads();
  const float a = s[(t + 1) % live];
  __syncthreads();
  s[t] = a * 2.f;
  __syncthreads();
  out[t] = s[(t + 1) % live];
}

// Reads another warp's slot with no barrier in between (a bug on purpose).
__global__ void missing_barrier_kernel(float* out) {
  BD_SHARED(float, s, 64);
  const int t = threadIdx.x;
  s[t] = static_cast<float>(t);
  out[blockIdx.x * 64 + t] = s[(t + 33) % 64];
}

__global__ void two_barriers_kernel() {
  if (threadIdx.x < 64) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}

__global__ void shfl_kernel(unsigned mask, int lane_mask, int width, int active, float* out) {
  const int lane = threadIdx.x & 31;
  float v = static_cast<float>(threadIdx.x);
  if (lane < active) v = __shfl_xor_sync(mask, v, lane_mask, width);
  out[threadIdx.x] = v;
}

__device__ __forceinline__ float exchange(float v, int o) { return __shfl_xor_sync(kFull, v, o); }

// Two call sites of one inline helper (one source line): different instructions, hence
// different collectives. Lanes 16-31 skip the first and reach the second.
__global__ void two_sites_kernel(float* out) {
  const int lane = threadIdx.x & 31;
  float v = static_cast<float>(lane);
  if (lane < 16) v = exchange(v, 1);
  v = exchange(v, 2);
  out[threadIdx.x] = v;
}

__global__ void syncwarp_then_barrier_kernel() {
  if ((threadIdx.x & 31) == 0) __syncwarp(0x3u);
  __syncthreads();
}

__global__ void syncwarp_exited_kernel() {
  if ((threadIdx.x & 31) == 1) return;
  __syncthreads();  // lane 1 has exited by the time lane 0 goes on
  if ((threadIdx.x & 31) == 0) __syncwarp(0x3u);
}

// Both arrays are read before being written: every block must see NaN.
__global__ void smem_fill_kernel(float* out) {
  BD_SHARED(float, st, 32);
  BD_EXTERN_SHARED(float, dyn);
  const int t = threadIdx.x;
  out[blockIdx.x * 64 + t] = st[t];
  out[blockIdx.x * 64 + 32 + t] = dyn[t];
  __syncthreads();
  st[t] = 1.f;
  dyn[t] = 2.f;
}

__global__ void noop_kernel(float*) {}

__global__ void vector_load_kernel(const float* p, float* out) {
  const bertdist::Vec<float, 4> v = *reinterpret_cast<const bertdist::Vec<float, 4>*>(p);
  out[threadIdx.x] = v.v[0];
}

// ---------------------------------------------------------------- checks

bool check_ids(std::string* why) {
  const dim3 grid(3, 2, 2), block(5, 3, 2);
  const int n = 3 * 2 * 2 * 5 * 3 * 2;
  std::vector<int> out(n, -1);
  BD_LAUNCH(ids_kernel, "ids_kernel", grid, block, 0, nullptr)(out.data());
  if (!expect_ok(launch_error(), why)) return false;
  int i = 0;
  for (unsigned bz = 0; bz < 2; ++bz)
    for (unsigned by = 0; by < 2; ++by)
      for (unsigned bx = 0; bx < 3; ++bx)
        for (unsigned tz = 0; tz < 2; ++tz)
          for (unsigned ty = 0; ty < 3; ++ty)
            for (unsigned tx = 0; tx < 5; ++tx, ++i) {
              const int want = static_cast<int>(bx * 1000000 + by * 100000 + bz * 10000 + tx * 100 + ty * 10 + tz);
              if (out[i] != want) {
                *why = "thread/block ids: element " + std::to_string(i) + " is " + std::to_string(out[i]) +
                       ", expected " + std::to_string(want);
                return false;
              }
            }
  return true;
}

bool check_early_exit(std::string* why) {
  const int live = 70;
  std::vector<float> out(96, -1.f);
  BD_LAUNCH(early_exit_kernel, "early_exit_kernel", 1, 96, 0, nullptr)(live, out.data());
  if (!expect_ok(launch_error(), why)) return false;
  for (int t = 0; t < live; ++t) {
    const float want = 2.f * static_cast<float>((t + 2) % live);
    if (out[t] != want) {
      *why = "out[" + std::to_string(t) + "] = " + std::to_string(out[t]) + ", expected " + std::to_string(want);
      return false;
    }
  }
  return true;
}

bool check_missing_barrier_reads_nan(std::string* why) {
  // Warp-greedy scheduling runs one warp up to its next synchronisation point before the
  // next: the read of the other warp's slot sees the block-start NaN, in either order.
  std::vector<float> out(128, 0.f);
  BD_LAUNCH(missing_barrier_kernel, "missing_barrier_kernel", 2, 64, 0, nullptr)(out.data());
  if (!expect_ok(launch_error(), why)) return false;
  for (int b = 0; b < 2; ++b) {
    const int reader = b == 0 ? 0 : 32;  // ascending block: warp 0 first; descending: warp 1 first
    if (!std::isnan(out[b * 64 + reader])) {
      *why = "block " + std::to_string(b) + ": thread " + std::to_string(reader) +
             " read another warp's slot before it was written, yet got " + std::to_string(out[b * 64 + reader]);
      return false;
    }
  }
  return true;
}

bool check_two_barriers(std::string* why) {
  BD_LAUNCH(two_barriers_kernel, "two_barriers_kernel", 1, 128, 0, nullptr)();
  return expect_error(launch_error(), "while 64 threads wait at another __syncthreads", why);
}

bool check_shfl_values(std::string* why) {
  std::vector<float> out(64);
  BD_LAUNCH(shfl_kernel, "shfl_kernel", 1, 64, 0, nullptr)(kFull, 5, 32, 32, out.data());
  if (!expect_ok(launch_error(), why)) return false;
  for (int t = 0; t < 64; ++t)
    if (out[t] != static_cast<float>((t & ~31) | ((t & 31) ^ 5))) {
      *why = "xor 5: lane " + std::to_string(t) + " got " + std::to_string(out[t]);
      return false;
    }
  // width 16, xor 16 (PTX shfl.bfly): lanes 0-15 would read a later segment and keep their
  // own value; lanes 16-31 read the earlier one.
  BD_LAUNCH(shfl_kernel, "shfl_kernel", 1, 32, 0, nullptr)(kFull, 16, 16, 32, out.data());
  if (!expect_ok(launch_error(), why)) return false;
  for (int t = 0; t < 32; ++t)
    if (out[t] != static_cast<float>(t < 16 ? t : t - 16)) {
      *why = "width 16, xor 16: lane " + std::to_string(t) + " got " + std::to_string(out[t]);
      return false;
    }
  // A legal partial warp: lanes 0-15 exchange among themselves with mask 0xffff.
  BD_LAUNCH(shfl_kernel, "shfl_kernel", 1, 32, 0, nullptr)(0x0000ffffu, 8, 32, 16, out.data());
  if (!expect_ok(launch_error(), why)) return false;
  for (int t = 0; t < 32; ++t) {
    const float want = static_cast<float>(t < 16 ? t ^ 8 : t);
    if (out[t] != want) {
      *why = "mask 0xffff, xor 8: lane " + std::to_string(t) + " got " + std::to_string(out[t]);
      return false;
    }
  }
  return true;
}

bool check_shfl_mask_without_caller(std::string* why) {
  std::vector<float> out(32);
  BD_LAUNCH(shfl_kernel, "shfl_kernel", 1, 32, 0, nullptr)(0x0000ffffu, 1, 32, 32, out.data());
  return expect_error(launch_error(), "does not include the calling lane 16", why);
}

bool check_shfl_in_divergent_branch(std::string* why) {
  std::vector<float> out(32);
  BD_LAUNCH(shfl_kernel, "shfl_kernel", 1, 32, 0, nullptr)(kFull, 1, 32, 16, out.data());
  return expect_error(launch_error(), "exited while lanes 0x0000ffff wait for it at __shfl_xor_sync", why);
}

bool check_shfl_reads_outside_mask(std::string* why) {
  std::vector<float> out(32);
  BD_LAUNCH(shfl_kernel, "shfl_kernel", 1, 32, 0, nullptr)(0x0000ffffu, 16, 32, 16, out.data());
  return expect_error(launch_error(), "lane 0 reads lane 16, which is not in mask 0x0000ffff", why);
}

bool check_shfl_two_call_sites(std::string* why) {
  std::vector<float> out(32);
  BD_LAUNCH(two_sites_kernel, "two_sites_kernel", 1, 32, 0, nullptr)(out.data());
  return expect_error(launch_error(), "divergent warp", why);
}

bool check_syncwarp_then_barrier(std::string* why) {
  BD_LAUNCH(syncwarp_then_barrier_kernel, "syncwarp_then_barrier_kernel", 1, 32, 0, nullptr)();
  return expect_error(launch_error(), "reached __syncthreads (selftest.cpp", why);
}

bool check_syncwarp_exited(std::string* why) {
  BD_LAUNCH(syncwarp_exited_kernel, "syncwarp_exited_kernel", 1, 32, 0, nullptr)();
  return expect_error(launch_error(), "have exited", why);
}

bool check_shared_memory_starts_nan(std::string* why) {
  std::vector<float> out(128, 0.f);
  BD_LAUNCH(smem_fill_kernel, "smem_fill_kernel", 2, 32, 32 * sizeof(float), nullptr)(out.data());
  if (!expect_ok(launch_error(), why)) return false;
  for (int i = 0; i < 128; ++i)
    if (!std::isnan(out[i])) {
      *why = "shared memory element " + std::to_string(i % 64) + " of block " + std::to_string(i / 64) +
             " was not NaN at block start";
      return false;
    }
  return true;
}

bool check_launch_limits(std::string* why) {
  std::vector<float> out(32);
  BD_LAUNCH(noop_kernel, "noop_kernel", 1, dim3(512, 3), 0, nullptr)(out.data());
  if (!expect_error(launch_error(), "1536 threads per block > 1024", why)) return false;
  BD_LAUNCH(noop_kernel, "noop_kernel", 1, 1025, 0, nullptr)(out.data());
  if (!expect_error(launch_error(), "block dimension 0 is 1025", why)) return false;
  BD_LAUNCH(noop_kernel, "noop_kernel", dim3(1, 65536), 32, 0, nullptr)(out.data());
  if (!expect_error(launch_error(), "grid dimension 1 is 65536", why)) return false;
  BD_LAUNCH(noop_kernel, "noop_kernel", 0, 32, 0, nullptr)(out.data());
  if (!expect_error(launch_error(), "grid dimension 0 is 0", why)) return false;
  BD_LAUNCH(noop_kernel, "noop_kernel", 1, 32, 48 * 1024 + 4, nullptr)(out.data());
  if (!expect_error(launch_error(), "49156 bytes of dynamic shared memory > this kernel's limit of 49152", why))
    return false;
  // Opting in, as attention's launcher does, allows more, up to the device's ceiling.
  if (cudaFuncSetAttribute(vector_load_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100000) != cudaSuccess) {
    *why = "cudaFuncSetAttribute(100000) failed: " + launch_error();
    return false;
  }
  std::vector<float> in(4, 1.f);
  BD_LAUNCH(vector_load_kernel, "vector_load_kernel", 1, 32, 100000, nullptr)(in.data(), out.data());
  if (!expect_ok(launch_error(), why)) return false;
  const int too_much = static_cast<int>(device().shared_per_block_optin) + 4;
  if (cudaFuncSetAttribute(vector_load_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, too_much) !=
      cudaErrorInvalidValue) {
    *why = "cudaFuncSetAttribute beyond the opt-in ceiling was accepted";
    return false;
  }
  if (!expect_error(launch_error(), "the emulated device allows at most", why)) return false;
  // A kernel the GPU can launch with fewer threads (registers) fails beyond that, as on a GPU.
  const int saved = device().kernel_max_threads;
  device().kernel_max_threads = 256;
  cudaFuncAttributes attr;
  const cudaError_t got = cudaFuncGetAttributes(&attr, noop_kernel);
  BD_LAUNCH(noop_kernel, "noop_kernel", 1, 512, 0, nullptr)(out.data());
  device().kernel_max_threads = saved;
  if (got != cudaSuccess || attr.maxThreadsPerBlock != 256) {
    *why = "cudaFuncGetAttributes did not report the emulated maxThreadsPerBlock 256";
    return false;
  }
  return expect_error(launch_error(), "too many resources requested for launch: 512 threads", why);
}

bool check_misaligned_vector(std::string* why) {
  alignas(16) float buf[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<float> out(32);
  BD_LAUNCH(vector_load_kernel, "vector_load_kernel", 1, 32, 0, nullptr)(buf, out.data());
  if (!expect_ok(launch_error(), why)) return false;
  BD_LAUNCH(vector_load_kernel, "vector_load_kernel", 1, 32, 0, nullptr)(buf + 1, out.data());
  return expect_error(launch_error(), "misaligned 16-byte vector load", why);
}

bool check_error_names_kernel_and_thread(std::string* why) {
  std::vector<float> out(64);
  BD_LAUNCH(shfl_kernel, "shfl_kernel", 2, 64, 0, nullptr)(0x0000ffffu, 1, 32, 32, out.data());
  // Block 0 runs first, warp 0 first, lanes in ascending order: lane 16 is the first caller
  // whose lane is outside the mask.
  return expect_error(launch_error(), "shfl_kernel (launched at selftest.cpp:", why);
}

}  // namespace

std::vector<NamedCheck> selftests() {
  return {
      {"selftest/thread_and_block_ids", check_ids},
      {"selftest/barrier_counts_exited_threads", check_early_exit},
      {"selftest/missing_barrier_reads_nan", check_missing_barrier_reads_nan},
      {"selftest/barrier_at_two_places", check_two_barriers},
      {"selftest/shuffle_values_width_partial_mask", check_shfl_values},
      {"selftest/shuffle_mask_without_caller", check_shfl_mask_without_caller},
      {"selftest/shuffle_in_divergent_branch", check_shfl_in_divergent_branch},
      {"selftest/shuffle_reads_outside_mask", check_shfl_reads_outside_mask},
      {"selftest/shuffle_two_call_sites_of_one_helper", check_shfl_two_call_sites},
      {"selftest/syncwarp_partner_at_barrier", check_syncwarp_then_barrier},
      {"selftest/syncwarp_mask_names_exited_lane", check_syncwarp_exited},
      {"selftest/shared_memory_nan_at_block_start", check_shared_memory_starts_nan},
      {"selftest/launch_limits", check_launch_limits},
#ifndef __SANITIZE_ADDRESS__  // the sanitized driver: UndefinedBehaviorSanitizer stops at this very access
      {"selftest/misaligned_vector_access", check_misaligned_vector},
#endif
      {"selftest/error_names_kernel_and_site", check_error_names_kernel_and_thread},
  };
}

}  // namespace bdemu
