// The emulated flat-buffer optimizer kernels (cuda_flat_optim.cu) against the C++ CPU twin
// (cpu_flat_optim.cpp): LAMB and AdamW for three steps with global-norm clipping, fp32 and bf16
// gradients, segments of mixed sizes and scales (size 1, empty, all zeros, many chunks, and
// parameters large and small enough that the trust ratio hits max_coeff and min_coeff). Both
// compute in fp32 with the same formulas; their sums differ in order only, so parameters,
// moments and norms agree to 1e-5 of their scale.
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "../ops.h"
#include "checks.h"

namespace bdemu {
namespace {

using bertdist::DType;
using bertdist::FlatNormParams;
using bertdist::FlatSegments;
using bertdist::FlatStepParams;

constexpr double kTol = 1e-5;
// Segment sizes and the scale of their initial values (0: all zeros, so ||p|| = 0 and r = 1).
const int64_t kSizes[] = {30, 1, 0, 16, 300, 37, 20, 20};
const float kScales[] = {1.f, 1.f, 1.f, 0.f, 1.f, 1.f, 100.f, 1e-4f};
const float kWeightDecay[] = {0.01f, 0.f, 0.01f, 0.01f, 0.f, 0.01f, 0.f, 0.f};
constexpr int kSegments = 8;

struct OptimCase {
  bool lamb;
  bool bf16;
  int64_t chunk;
  float max_norm;  // 0: no clipping
};

std::string optim_name(const OptimCase& c) {
  return std::string("kernels/flat_") + (c.lamb ? "lamb" : "adamw") + "/" + (c.bf16 ? "bf16" : "f32") +
         "_grads/chunk" + std::to_string(c.chunk) + (c.max_norm > 0 ? "_clipped" : "");
}

// Deterministic values in [-1, 1) (splitmix64), the same on every platform.
float uniform(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

struct State {
  std::vector<float> p, m, v, stats, seg_norm2;
};

struct Table {
  std::vector<int64_t> offsets{0}, chunk_offsets{0};
  FlatSegments seg(int64_t chunk) const {
    FlatSegments s;
    s.offsets = offsets.data();
    s.chunk_offsets = chunk_offsets.data();
    s.segments = kSegments;
    s.chunks = chunk_offsets.back();
    s.chunk_size = chunk;
    return s;
  }
};

// Three steps of one implementation; false with the reason when an emulated launch fails.
bool optim_run(const OptimCase& c, bool emulated, State* out, std::string* why) {
  Table t;
  for (int64_t n : kSizes) {
    t.offsets.push_back(t.offsets.back() + n);
    t.chunk_offsets.push_back(t.chunk_offsets.back() + (n + c.chunk - 1) / c.chunk);
  }
  const FlatSegments seg = t.seg(c.chunk);
  const int64_t n = t.offsets.back();
  State& s = *out;
  s.p.assign(n, 0.f);
  s.m.assign(n, 0.f);
  s.v.assign(n, 0.f);
  s.stats.assign(2, 0.f);
  s.seg_norm2.assign(kSegments, 0.f);
  uint64_t rng = 17;
  for (int k = 0; k < kSegments; ++k)
    for (int64_t i = t.offsets[k]; i < t.offsets[k + 1]; ++i) s.p[i] = kScales[k] * uniform(&rng);
  std::vector<float> partial(2 * seg.chunks + 1), g32(n);
  std::vector<c10::BFloat16> g16(n);
  for (int step = 1; step <= 3; ++step) {
    for (int64_t i = 0; i < n; ++i) {
      g32[i] = 0.3f * uniform(&rng);
      g16[i] = c10::BFloat16(g32[i]);
    }
    const DType gt = c.bf16 ? DType::BF16 : DType::F32;
    const void* g = c.bf16 ? static_cast<const void*>(g16.data()) : static_cast<const void*>(g32.data());
    FlatNormParams np;
    np.seg = seg;
    np.g = g;
    np.partial = partial.data();
    np.seg_norm2 = s.seg_norm2.data();
    np.stats = s.stats.data();
    np.max_norm = c.max_norm;
    FlatStepParams sp;
    sp.seg = seg;
    sp.p = s.p.data();
    sp.g = g;
    sp.m = s.m.data();
    sp.v = s.v.data();
    sp.weight_decay = kWeightDecay;
    sp.stats = s.stats.data();
    sp.partial = partial.data();
    sp.lr = 0.02f;
    sp.beta1 = 0.9f;
    sp.beta2 = 0.999f;
    sp.one_minus_beta1 = static_cast<float>(1.0 - 0.9);
    sp.one_minus_beta2 = static_cast<float>(1.0 - 0.999);
    sp.eps = c.lamb ? 1e-6f : 1e-8f;
    sp.bc1 = static_cast<float>(1.0 - std::pow(0.9, step));
    sp.bc2 = static_cast<float>(1.0 - std::pow(0.999, step));
    try {
      if (emulated) {
        bertdist::flat_norm_cuda(np, gt, nullptr);
        c.lamb ? bertdist::flat_lamb_cuda(sp, gt, nullptr) : bertdist::flat_adamw_cuda(sp, gt, nullptr);
      } else {
        bertdist::flat_norm_cpu(np, gt);
        c.lamb ? bertdist::flat_lamb_cpu(sp, gt) : bertdist::flat_adamw_cpu(sp, gt);
      }
    } catch (const std::exception& e) {
      *why = std::string(emulated ? "emulated" : "CPU twin") + " step " + std::to_string(step) + " failed: " + e.what();
      return false;
    }
  }
  return true;
}

// max |a - e| over max(max |e|, 1e-2), or the first index where one is NaN and the other not.
std::string compare(const char* what, const std::vector<float>& a, const std::vector<float>& e) {
  double err = 0, scale = 1e-2;
  for (size_t i = 0; i < e.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(e[i]))
      return std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(a[i]) + ", CPU twin " +
             std::to_string(e[i]);
    err = std::max(err, std::fabs(static_cast<double>(a[i]) - e[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(e[i])));
  }
  if (err / scale <= kTol) return "";
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s: error %.3e of the scale %.3e against the CPU twin > %.0e", what, err / scale,
                scale, kTol);
  return buf;
}

bool check_optim(const OptimCase& c, std::string* why) {
  State emu, cpu;
  if (!optim_run(c, true, &emu, why) || !optim_run(c, false, &cpu, why)) return false;
  std::string out;
  for (const auto& [what, a, e] : {std::tuple{"params", &emu.p, &cpu.p}, std::tuple{"exp_avg", &emu.m, &cpu.m},
                                   std::tuple{"exp_avg_sq", &emu.v, &cpu.v},
                                   std::tuple{"stats (norm, clip)", &emu.stats, &cpu.stats},
                                   std::tuple{"per-segment g^2", &emu.seg_norm2, &cpu.seg_norm2}}) {
    const std::string r = compare(what, *a, *e);
    if (!r.empty()) out += (out.empty() ? "" : "; ") + r;
  }
  if (out.empty()) return true;
  *why = out;
  return false;
}

}  // namespace

std::vector<NamedCheck> optim_checks(bool quick) {
  std::vector<NamedCheck> out;
  const auto add = [&](OptimCase c) {
    out.push_back({optim_name(c), [c](std::string* why) { return check_optim(c, why); }});
  };
  for (bool lamb : {true, false}) {
    add({lamb, false, 7, 1.f});
    add({lamb, true, 7, 0.f});
    if (!quick) add({lamb, false, 65536, 0.f});
  }
  return out;
}

}  // namespace bdemu
