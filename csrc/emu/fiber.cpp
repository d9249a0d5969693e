// Fiber context switching and stacks for the SIMT emulator (see fiber.h).
#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define BDEMU_ASAN 1
#endif

namespace bdemu {

#ifdef BDEMU_ASM_SWITCH
// bdemu_switch(void** save_sp, void* new_sp): push the System V callee-saved registers,
// store the stack pointer, load the other one, pop its registers and return into it.
// bdemu_start: a new fiber's first "return" lands here with entry in r13 and arg in r12.
extern "C" void bdemu_switch(void** save_sp, void* new_sp);
extern "C" void bdemu_start();
asm(R"(
  .text
  .p2align 4
  .globl bdemu_switch
  .hidden bdemu_switch
  .type bdemu_switch, @function
bdemu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size bdemu_switch, .-bdemu_switch

  .p2align 4
  .globl bdemu_start
  .hidden bdemu_start
  .type bdemu_start, @function
bdemu_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size bdemu_start, .-bdemu_start
)");

void make_context(Context* ctx, void* stack, size_t size, void (*entry)(void*), void* arg) {
  // Frame read by bdemu_switch: r15 r14 r13 r12 rbx rbp, then the return address. bdemu_start
  // is entered with rsp 16-byte aligned, so its call gives entry the ABI's alignment.
  auto top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t{15};
  auto* frame = reinterpret_cast<uint64_t*>(top - 72);
  std::memset(frame, 0, 72);
  frame[2] = reinterpret_cast<uint64_t>(entry);                  // r13
  frame[3] = reinterpret_cast<uint64_t>(arg);                    // r12
  frame[6] = reinterpret_cast<uint64_t>(&bdemu_start);           // return address
  ctx->sp = frame;
  ctx->stack_lo = stack;
  ctx->stack_size = size;
  ctx->asan_fake_stack = nullptr;
}

static inline void raw_switch(Context* from, Context* to) { bdemu_switch(&from->sp, to->sp); }

#else  // ucontext fallback

static void ucontext_entry(unsigned eh, unsigned el, unsigned ah, unsigned al) {
  auto entry = reinterpret_cast<void (*)(void*)>((static_cast<uintptr_t>(eh) << 32) | el);
  entry(reinterpret_cast<void*>((static_cast<uintptr_t>(ah) << 32) | al));
  std::abort();
}

void make_context(Context* ctx, void* stack, size_t size, void (*entry)(void*), void* arg) {
  if (getcontext(&ctx->uc) != 0) {
    std::perror("bdemu: getcontext");
    std::abort();
  }
  ctx->uc.uc_stack.ss_sp = stack;
  ctx->uc.uc_stack.ss_size = size;
  ctx->uc.uc_link = nullptr;
  // makecontext passes int arguments: split the pointer in two halves.
  const auto a = reinterpret_cast<uintptr_t>(arg), e = reinterpret_cast<uintptr_t>(entry);
  makecontext(&ctx->uc, reinterpret_cast<void (*)()>(&ucontext_entry), 4, static_cast<unsigned>(e >> 32),
              static_cast<unsigned>(e), static_cast<unsigned>(a >> 32), static_cast<unsigned>(a));
  ctx->stack_lo = stack;
  ctx->stack_size = size;
  ctx->asan_fake_stack = nullptr;
}

static inline void raw_switch(Context* from, Context* to) {
  if (swapcontext(&from->uc, &to->uc) != 0) {
    std::perror("bdemu: swapcontext");
    std::abort();
  }
}
#endif

void switch_to(Context* from, Context* to, bool from_done) {
#ifdef BDEMU_ASAN
  __sanitizer_start_switch_fiber(from_done ? nullptr : &from->asan_fake_stack, to->stack_lo, to->stack_size);
#else
  (void)from_done;
#endif
  raw_switch(from, to);
#ifdef BDEMU_ASAN
  __sanitizer_finish_switch_fiber(from->asan_fake_stack, nullptr, nullptr);
#endif
}

void fiber_started(Context* host) {
#ifdef BDEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &host->stack_lo, &host->stack_size);
#else
  (void)host;
#endif
}

StackPool::~StackPool() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (void* m : maps_) munmap(m, page + kStackBytes);
}

void StackPool::mark_used_dirty(size_t n) {
  for (size_t i = 0; i < n && i < dirty_.size(); ++i) dirty_[i] = true;
}

void* StackPool::acquire(size_t i) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  while (maps_.size() <= i) {
    void* m = mmap(nullptr, page + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED) {
      std::perror("bdemu: mmap of a fiber stack");
      std::abort();
    }
    if (mprotect(m, page, PROT_NONE) != 0) {  // guard page: an overflow faults at once
      std::perror("bdemu: mprotect of a guard page");
      std::abort();
    }
    maps_.push_back(m);
    dirty_.push_back(false);
  }
  void* lo = static_cast<char*>(maps_[i]) + page;
#ifdef BDEMU_ASAN
  if (dirty_[i]) ASAN_UNPOISON_MEMORY_REGION(lo, kStackBytes);
#endif
  dirty_[i] = false;
  return lo;
}

}  // namespace bdemu
