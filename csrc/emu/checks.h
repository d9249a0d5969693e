// Checks of the emulated CUDA kernels and of the emulator itself.
//
// - "selftest": small kernels of its own that pin down the emulator's semantics (barriers
//   that count arrivals, warp collectives that stop on divergence, NaN-filled shared memory,
//   launch limits, alignment of vector accesses).
// - "kernels": every CUDA kernel and launcher of csrc/cuda_*.cu, run by the emulator, against
//   the C++ CPU twins (csrc/cpu_*.cpp) in the same dtype and in float64 (the exact
//   reference): layer norm and bias + dropout + residual + layer norm, attention padded and
//   varlen, forward and backward, fp32/bf16/fp16, dropout masks bit for bit; the flat-buffer
//   LAMB and AdamW steps.
//
// Run by the standalone driver (check_kernels: `make emu-test`, the sanitizer run, the
// mutation tests) and by bertdist._C_emu.run_checks (pytest).
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace bdemu {

struct CheckOptions {
  std::string suite = "all";  // all | selftest | kernels
  std::string filter;         // run only checks whose name contains this
  bool keep_going = false;    // run every check instead of stopping at the first failure
  bool quick = false;         // the cheaper half of the kernel cases (sanitizer runs in CI)
  bool verbose = false;       // one line per check on stdout as it finishes
};

struct CheckReport {
  int passed = 0;
  int failed = 0;
  std::vector<std::string> failures;  // "name: what went wrong"
  std::string log;                    // one line per check
};

CheckReport run_checks(const CheckOptions& options);

// One check: true when it passes, else false with the reason in *why.
struct NamedCheck {
  std::string name;
  std::function<bool(std::string* why)> fn;
};
std::vector<NamedCheck> selftests();       // selftest.cpp
std::vector<NamedCheck> kernel_checks(bool quick);  // checks.cpp
std::vector<NamedCheck> optim_checks(bool quick);   // optim_checks.cpp (part of kernel_checks)

}  // namespace bdemu
