// Fibers for the SIMT emulator: one stack and saved register set per emulated CUDA thread,
// switched cooperatively on one OS thread. x86-64 uses a 14-instruction register switch
// (about 100x cheaper than swapcontext, which makes a system call per switch to save the
// signal mask); other targets fall back to ucontext. Stacks come from a per-OS-thread pool,
// each with a guard page below it, so an overflow faults instead of corrupting a neighbour.
// Under AddressSanitizer every switch is announced to it (__sanitizer_*_switch_fiber).
#pragma once
#include <cstddef>
#include <vector>

// BDEMU_UCONTEXT: the portable ucontext switch on x86-64 too (to test it there).
#if defined(__x86_64__) && !defined(BDEMU_UCONTEXT)
#define BDEMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace bdemu {

struct Context {
#ifdef BDEMU_ASM_SWITCH
  void* sp = nullptr;  // saved stack pointer; the callee-saved registers sit on that stack
#else
  ucontext_t uc;
#endif
  // The stack this context runs on (for AddressSanitizer); null for the host (scheduler) side.
  const void* stack_lo = nullptr;
  size_t stack_size = 0;
  void* asan_fake_stack = nullptr;
};

// Prepares `ctx` to run entry(arg) on [stack, stack + size) at its first switch_to. `entry`
// must never return: a finished fiber switches away for good (see switch_to's `from_done`).
void make_context(Context* ctx, void* stack, size_t size, void (*entry)(void*), void* arg);

// Saves the running context in `from` and resumes `to`. `from_done`: `from` will never be
// resumed (lets AddressSanitizer free its fake stack).
void switch_to(Context* from, Context* to, bool from_done = false);

// To be called first thing in a fiber's entry function (pairs the switch that started it).
void fiber_started(Context* host);

// Fixed-size stacks with a PROT_NONE guard page below each, reused for the life of the OS thread.
class StackPool {
 public:
  static constexpr size_t kStackBytes =
#if defined(__SANITIZE_ADDRESS__)
      1 << 20;  // redzones and fake frames need room
#else
      256 << 10;
#endif
  StackPool() = default;
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;
  ~StackPool();
  // The lowest usable address of stack i (allocated on first use), ready for make_context.
  void* acquire(size_t i);
  // Stacks [0, n) hold frames that never returned (a launch stopped with a fault): acquire
  // clears what AddressSanitizer poisoned in them before reuse.
  void mark_used_dirty(size_t n);

 private:
  std::vector<void*> maps_;  // each: guard page + kStackBytes
  std::vector<bool> dirty_;
};

}  // namespace bdemu
