// check_kernels: the emulator's checks as a standalone program, without Python or torch's
// libraries (only their headers), so that it builds in seconds, runs under AddressSanitizer
// and UndefinedBehaviorSanitizer as is, and fails fast for the mutation tests.
//
//   check_kernels [--suite all|selftest|kernels] [--filter TEXT] [--keep-going] [--quick]
//                 [--order alternate|ascending|descending] [--quiet]
//
// Exit status 0 when every check passed, 1 when one failed, 2 on bad arguments.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "checks.h"
#include "emu_api.h"

int main(int argc, char** argv) {
  bdemu::CheckOptions o;
  o.verbose = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "check_kernels: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--suite") {
      o.suite = value();
    } else if (a == "--filter") {
      o.filter = value();
    } else if (a == "--keep-going") {
      o.keep_going = true;
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--quiet") {
      o.verbose = false;
    } else if (a == "--order") {
      const std::string v = value();
      if (v == "alternate") bdemu::device().order = bdemu::Order::kAlternate;
      else if (v == "ascending") bdemu::device().order = bdemu::Order::kAscending;
      else if (v == "descending") bdemu::device().order = bdemu::Order::kDescending;
      else {
        std::fprintf(stderr, "check_kernels: --order must be alternate, ascending or descending, got %s\n", v.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "check_kernels: unknown argument %s (see the top of csrc/emu/driver.cpp)\n", a.c_str());
      return 2;
    }
  }
  std::printf("%s\n", bdemu::describe_device().c_str());
  const auto t0 = std::chrono::steady_clock::now();
  bdemu::CheckReport r;
  try {
    r = bdemu::run_checks(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "check_kernels: %s\n", e.what());
    return 2;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bdemu::Counters c = bdemu::counters();
  std::printf("%d passed, %d failed in %.1f s (%lld context switches, %lld barriers, %lld warp collectives)\n",
              r.passed, r.failed, s, static_cast<long long>(c.context_switches), static_cast<long long>(c.barriers),
              static_cast<long long>(c.warp_collectives));
  for (const std::string& f : r.failures) std::printf("FAILED %s\n", f.c_str());
  if (r.passed + r.failed == 0) {
    std::printf("no check matched\n");
    return 1;
  }
  return r.failed ? 1 : 0;
}
