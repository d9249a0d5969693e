// Host-side interface of the SIMT emulator (csrc/emu): the emulated device's properties and
// what the emulator has run. Free of CUDA and torch headers, so bindings.cpp and the check
// driver include it without pulling in the CUDA toolkit's host headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace bdemu {

// Order in which one block's warps (and the lanes inside a warp) are run between
// synchronisation points. Alternate runs even-numbered blocks in ascending order and odd ones
// in descending order, so a missing barrier is exposed whichever side of it reads first.
enum class Order { kAlternate, kAscending, kDescending };

// The emulated GPU. The defaults are an A100-class (sm_80) device, the strictest of the
// architectures the extension is built for (its opt-in shared memory is 163 KB where sm_90
// allows 227 KB), with only 2 multiprocessors so that kernels sizing their grid by the SM
// count (the layer-norm backward) take their grid-stride paths on small inputs.
struct DeviceProps {
  int multiprocessors = 2;
  int max_threads_per_block = 1024;
  int max_block_dim[3] = {1024, 1024, 64};
  int64_t max_grid_dim[3] = {2147483647, 65535, 65535};
  size_t shared_per_block = 48 * 1024;           // static + dynamic without opt-in
  size_t shared_per_block_optin = 163 * 1024;    // cudaFuncAttributeMaxDynamicSharedMemorySize limit
  // The most threads any kernel may be launched with, as cudaFuncGetAttributes reports it: on a
  // GPU it is lower for kernels with many registers (65536 per block), and a larger launch fails
  // with cudaErrorLaunchOutOfResources. The emulator cannot count registers: lower this to make
  // launchers take the paths they take on such a GPU.
  int kernel_max_threads = 1024;
  Order order = Order::kAlternate;
};

// The process-wide emulated device; change it only while no kernel runs.
DeviceProps& device();
std::string describe_device();

// Counts since the last reset, per kernel name (the name given at the launch site).
struct KernelCount {
  std::string name;
  int64_t launches = 0, blocks = 0, threads = 0;
};
struct Counters {
  int64_t context_switches = 0, barriers = 0, warp_collectives = 0;
  int64_t attribute_calls = 0;  // cudaFuncGetAttributes and cudaFuncSetAttribute calls
};
std::vector<KernelCount> kernel_counts();
Counters counters();
void reset_counts();

// Leaves an error pending on this thread, as an earlier asynchronous failure would (for checks
// of the launchers); take_pending_error returns it and clears it, as cudaGetLastError does (0: none).
void inject_pending_error();
int take_pending_error();

}  // namespace bdemu
