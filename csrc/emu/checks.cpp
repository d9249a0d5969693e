// The emulated CUDA kernels against the C++ CPU twins (see checks.h).
//
// Every case runs three implementations on the same inputs: the CUDA kernel through the
// emulator (dtype T), the CPU twin in T, and the CPU twin in float64 on the same (rounded)
// values, the exact reference. Each runs its own forward, then its own backward.
// - fp32: the emulated kernel is within 1e-5 of float64 (max error over the scale of the
//   expected tensor, as tests/ops measures).
// - bf16/fp16: its error against float64 is at most twice the CPU twin's in the same dtype,
//   plus a small floor (the low-precision bound of tests/ops).
// - Statistics, dropout records and masks: equal to the CPU twin's (masks bit for bit).
#include "checks.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "../ops.h"
#include "../philox.h"
#include "emu_api.h"

namespace bdemu {
namespace {

using bertdist::AttnParams;
using bertdist::DType;
using bertdist::HeadTensor;
using bertdist::LnBwdParams;
using bertdist::LnFwdParams;

constexpr double kTolF32 = 1e-5;
constexpr double kScaleFloor = 1e-2;  // as tests/ops: exactly-zero results judged by absolute error
constexpr double kLowPrecisionFloor = 1e-6;

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::F64: return "f64";
  }
  return "?";
}

size_t elem_size(DType t) { return t == DType::F64 ? 8 : (t == DType::F32 ? 4 : 2); }

// A buffer of n elements of one dtype, exactly sized (so AddressSanitizer sees overruns),
// optionally starting one element past a 16-byte boundary.
class Array {
 public:
  Array() = default;
  Array(DType t, int64_t n, bool misaligned = false) : t_(t), n_(n), skip_(misaligned ? 1 : 0) {
    const size_t bytes = static_cast<size_t>(n + skip_) * elem_size(t);
    mem_.reset(new unsigned char[std::max<size_t>(bytes, 1)]);
    std::memset(mem_.get(), 0xFF, std::max<size_t>(bytes, 1));  // NaN: unwritten outputs show up
  }
  DType dtype() const { return t_; }
  int64_t size() const { return n_; }
  void* data() const { return mem_.get() + skip_ * elem_size(t_); }
  template <typename U>
  U* as() const { return static_cast<U*>(data()); }

  double get(int64_t i) const {
    switch (t_) {
      case DType::F32: return as<float>()[i];
      case DType::F64: return as<double>()[i];
      case DType::F16: return static_cast<float>(as<c10::Half>()[i]);
      case DType::BF16: return static_cast<float>(as<c10::BFloat16>()[i]);
    }
    return 0;
  }
  void set(int64_t i, double v) {
    switch (t_) {
      case DType::F32: as<float>()[i] = static_cast<float>(v); break;
      case DType::F64: as<double>()[i] = v; break;
      case DType::F16: as<c10::Half>()[i] = c10::Half(static_cast<float>(v)); break;
      case DType::BF16: as<c10::BFloat16>()[i] = c10::BFloat16(static_cast<float>(v)); break;
    }
  }
  // This array's values in another dtype (exact when widening).
  Array to(DType t, bool misaligned = false) const {
    Array out(t, n_, misaligned);
    for (int64_t i = 0; i < n_; ++i) out.set(i, get(i));
    return out;
  }

 private:
  DType t_ = DType::F32;
  int64_t n_ = 0;
  int64_t skip_ = 0;
  std::unique_ptr<unsigned char[]> mem_;
};

// Deterministic normal values (splitmix64 + Box-Muller), the same on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  double normal() {
    const double u1 = std::max(uniform(), 1e-300), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t s_;
};

Array random_array(DType t, int64_t n, uint64_t seed, double scale = 1.0, double shift = 0.0) {
  Array a(t, n);
  Rng r(seed);
  for (int64_t i = 0; i < n; ++i) a.set(i, shift + scale * r.normal());
  return a;
}

std::string fmt(const char* f, double a) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, a);
  return buf;
}

// max |a - e| over max(max |e|, kScaleFloor); NaN anywhere in `a` counts as infinite.
double rel_err(const Array& a, const Array& e, int64_t n = -1) {
  if (n < 0) n = e.size();
  double err = 0, scale = kScaleFloor;
  for (int64_t i = 0; i < n; ++i) {
    const double x = a.get(i), y = e.get(i);
    if (std::isnan(x) != std::isnan(y)) return INFINITY;
    if (!std::isnan(x)) err = std::max(err, std::fabs(x - y));
    scale = std::max(scale, std::fabs(y));
  }
  return err / scale;
}

// Checks of one case, collected: each failing comparison adds a line.
class Verdict {
 public:
  explicit Verdict(DType t) : t_(t) {}
  // fp32: emulated within kTolF32 of float64; low precision: within 2x the CPU twin's error.
  void close(const char* what, const Array& emu, const Array& cpu, const Array& ref) {
    const double e = rel_err(emu, ref);
    if (t_ == DType::F32) {
      if (!(e <= kTolF32))
        add(std::string(what) + ": error " + fmt("%.3e", e) + " against float64 > " + fmt("%.0e", kTolF32));
    } else {
      const double c = rel_err(cpu, ref);
      if (!(e <= 2 * c + kLowPrecisionFloor))
        add(std::string(what) + ": error " + fmt("%.3e", e) + " against float64 > 2 x the CPU twin's " +
            fmt("%.3e", c));
    }
  }
  // Results computed in fp32 whatever T (statistics): close to the CPU twin's.
  void close_f32(const char* what, const Array& emu, const Array& cpu, double tol = 1e-5) {
    for (int64_t i = 0; i < cpu.size(); ++i) {
      const double a = emu.get(i), b = cpu.get(i);
      if (!(std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b)))) {
        add(std::string(what) + "[" + std::to_string(i) + "] = " + fmt("%.9g", a) + ", CPU twin " + fmt("%.9g", b));
        return;
      }
    }
  }
  void equal(const char* what, const Array& emu, const Array& cpu) {
    for (int64_t i = 0; i < cpu.size(); ++i) {
      const double a = emu.get(i), b = cpu.get(i);
      if (!(a == b || (std::isnan(a) && std::isnan(b)))) {
        add(std::string(what) + "[" + std::to_string(i) + "] = " + fmt("%.9g", a) + ", CPU twin " + fmt("%.9g", b) +
            " (must be equal)");
        return;
      }
    }
  }
  void add(const std::string& s) { why_ += (why_.empty() ? "" : "; ") + s; }
  bool ok(std::string* why) const {
    if (!why_.empty()) *why = why_;
    return why_.empty();
  }

 private:
  DType t_;
  std::string why_;
};

// Runs an emulated launcher; its errors (launch failures, emulator faults) become failures.
template <typename F>
bool run_emulated(F&& f, const char* what, std::string* why) {
  try {
    f();
    return true;
  } catch (const std::exception& e) {
    *why = std::string(what) + " failed: " + e.what();
    return false;
  }
}

// ---------------------------------------------------------------- layer norm

struct LnCase {
  DType t;
  int64_t rows, hidden;
  bool fused;       // bias + dropout + residual + LN, saving h
  bool has_bias;
  float p;          // dropout probability (fused only)
  bool misaligned;  // inputs and outputs one element past a 16-byte boundary
  int kernel_max_threads = 0;  // emulate a GPU that launches no more threads of a kernel (0: the default)
};

// Sets the emulated device's per-kernel thread limit for one check.
class KernelMaxThreads {
 public:
  explicit KernelMaxThreads(int n) : saved_(device().kernel_max_threads) {
    if (n > 0) device().kernel_max_threads = n;
  }
  ~KernelMaxThreads() { device().kernel_max_threads = saved_; }

 private:
  int saved_;
};

std::string ln_name(const LnCase& c) {
  std::ostringstream s;
  s << "kernels/" << (c.fused ? "bias_dropout_add_ln" : "layer_norm") << "/" << dtype_name(c.t) << "/rows" << c.rows
    << "_hidden" << c.hidden;
  if (c.fused) s << (c.has_bias ? "_bias" : "_nobias") << "_p" << c.p;
  if (c.misaligned) s << "_misaligned";
  if (c.kernel_max_threads) s << "_max" << c.kernel_max_threads << "threads";
  return s.str();
}

struct LnRun {
  Array y, h, mean, rstd, dh, dx, dgamma, dbeta, dbias, record;
};

constexpr uint64_t kSeed = 0x5EEDull;
constexpr uint32_t kOffset = 12;

// One implementation's forward and backward. `impl`: 0 emulated CUDA, 1 CPU twin (in the
// inputs' dtype, or float64 when given float64 inputs).
bool ln_run(const LnCase& c, bool emulated, const Array& x, const Array& res, const Array& dy, const Array& gamma,
            const Array& beta, const Array& bias, LnRun* out, std::string* why) {
  const DType t = x.dtype();
  const int64_t n = c.rows * c.hidden;
  const DType acc = t == DType::F64 ? DType::F64 : DType::F32;
  out->y = Array(t, n, c.misaligned);
  out->mean = Array(acc, c.rows);
  out->rstd = Array(acc, c.rows);
  out->record = Array(DType::F64, 2);  // int64 storage reinterpreted below
  LnFwdParams f;
  f.x = x.data();
  f.gamma = gamma.data();
  f.beta = beta.data();
  f.y = out->y.data();
  f.mean = out->mean.data();
  f.rstd = out->rstd.data();
  f.rows = c.rows;
  f.hidden = c.hidden;
  f.eps = 1e-12f;
  if (c.fused) {
    out->h = Array(t, n, c.misaligned);
    f.residual = res.data();
    f.bias = c.has_bias ? bias.data() : nullptr;
    f.h = out->h.data();
    f.dropout = c.p > 0;
    f.p = c.p;
    f.rng.seed = kSeed;
    f.rng.offset = kOffset;
    if (emulated) f.rng.save_to = reinterpret_cast<int64_t*>(out->record.data());
  }
  if (emulated) {
    if (!run_emulated([&] { bertdist::ln_fwd_cuda(f, t, nullptr); }, "ln_fwd_cuda", why)) return false;
  } else {
    bertdist::ln_fwd_cpu(f, t);
  }
  out->dh = Array(t, n, c.misaligned);
  out->dgamma = Array(acc, c.hidden);
  out->dbeta = Array(acc, c.hidden);
  LnBwdParams b;
  b.dy = dy.data();
  b.h = c.fused ? out->h.data() : x.data();
  b.mean = out->mean.data();
  b.rstd = out->rstd.data();
  b.gamma = gamma.data();
  b.dh = out->dh.data();
  b.dgamma = out->dgamma.data();
  b.dbeta = out->dbeta.data();
  b.rows = c.rows;
  b.hidden = c.hidden;
  if (c.fused) {
    b.dropout = c.p > 0;
    b.p = c.p;
    if (b.dropout) {
      out->dx = Array(t, n, c.misaligned);
      b.dx = out->dx.data();
    }
    if (c.has_bias) {
      out->dbias = Array(acc, c.hidden);
      b.dbias = out->dbias.data();
    }
    b.rng.seed = kSeed;
    b.rng.offset = kOffset;
    if (emulated && b.dropout) b.rng.saved = reinterpret_cast<const int64_t*>(out->record.data());
  }
  if (emulated) {
    const int parts = bertdist::ln_bwd_cuda_parts(c.rows, 0);
    Array ws(DType::F32, 3 * static_cast<int64_t>(parts) * c.hidden);
    return run_emulated([&] { bertdist::ln_bwd_cuda(b, t, ws.as<float>(), parts, nullptr); }, "ln_bwd_cuda", why);
  }
  bertdist::ln_bwd_cpu(b, t);
  return true;
}

bool check_ln(const LnCase& c, std::string* why) {
  const KernelMaxThreads limit(c.kernel_max_threads);
  const int64_t n = c.rows * c.hidden;
  const uint64_t s = static_cast<uint64_t>(c.rows * 131 + c.hidden);
  const Array x = random_array(c.t, n, s).to(c.t, c.misaligned);
  const Array res = random_array(c.t, n, s + 1).to(c.t, c.misaligned);
  const Array dy = random_array(c.t, n, s + 2).to(c.t, c.misaligned);
  const Array g32 = random_array(DType::F32, c.hidden, s + 3, 0.2, 1.0);
  const Array b32 = random_array(DType::F32, c.hidden, s + 4, 0.2);
  const Array bias32 = random_array(DType::F32, c.hidden, s + 5, 0.5);
  LnRun emu, cpu, ref;
  if (!ln_run(c, true, x, res, dy, g32, b32, bias32, &emu, why)) return false;
  ln_run(c, false, x, res, dy, g32, b32, bias32, &cpu, why);
  ln_run(c, false, x.to(DType::F64), res.to(DType::F64), dy.to(DType::F64), g32.to(DType::F64), b32.to(DType::F64),
         bias32.to(DType::F64), &ref, why);
  Verdict v(c.t);
  v.close("y", emu.y, cpu.y, ref.y);
  v.close_f32("mean", emu.mean, cpu.mean);
  v.close_f32("rstd", emu.rstd, cpu.rstd);
  v.close("dh", emu.dh, cpu.dh, ref.dh);
  v.close("dgamma", emu.dgamma, cpu.dgamma, ref.dgamma);
  v.close("dbeta", emu.dbeta, cpu.dbeta, ref.dbeta);
  if (c.fused) {
    v.equal("h", emu.h, cpu.h);  // same arithmetic, same dropout mask: bit for bit
    v.close("h", emu.h, cpu.h, ref.h);
    if (c.p > 0) {
      v.close("dx", emu.dx, cpu.dx, ref.dx);
      const auto* rec = reinterpret_cast<const int64_t*>(emu.record.data());
      if (rec[0] != static_cast<int64_t>(kSeed) || rec[1] != kOffset)
        v.add("dropout record (" + std::to_string(rec[0]) + ", " + std::to_string(rec[1]) + ") != (seed, offset)");
    }
    if (c.has_bias) v.close("dbias", emu.dbias, cpu.dbias, ref.dbias);
  }
  return v.ok(why);
}

// With a zero residual and inputs that are never zero, h is zero exactly where an element was
// dropped, and so is the backward's dx: both must be the Philox mask the CPU twin uses.
bool check_ln_mask(DType t, int64_t rows, int64_t hidden, float p, std::string* why) {
  const int64_t n = rows * hidden;
  Array x(t, n), res(t, n), dy(t, n), g(DType::F32, hidden), b(DType::F32, hidden);
  Rng r(7);
  for (int64_t i = 0; i < n; ++i) {
    x.set(i, 1.0 + r.uniform());
    res.set(i, 0.0);
    dy.set(i, 1.0 + r.uniform());
  }
  for (int64_t i = 0; i < hidden; ++i) {
    g.set(i, 1.0 + 0.1 * r.uniform());
    b.set(i, 0.0);
  }
  const LnCase c{t, rows, hidden, true, false, p, false};
  LnRun emu;
  if (!ln_run(c, true, x, res, dy, g, b, b, &emu, why)) return false;
  const uint32_t thr = bertdist::keep_threshold(p);
  int64_t kept = 0;
  for (int64_t e = 0; e < n; ++e) {
    const bool keep = bertdist::hidden_draws(kSeed, kOffset, static_cast<uint64_t>(e) >> 2).v[e & 3] < thr;
    kept += keep;
    if ((emu.h.get(e) != 0.0) != keep || (emu.dx.get(e) != 0.0) != keep) {
      *why = "element " + std::to_string(e) + ": mask says " + (keep ? "keep" : "drop") + ", h = " +
             fmt("%g", emu.h.get(e)) + ", dx = " + fmt("%g", emu.dx.get(e));
      return false;
    }
  }
  if (kept == 0 || kept == n) {
    *why = "degenerate mask (kept " + std::to_string(kept) + " of " + std::to_string(n) + ")";
    return false;
  }
  return true;
}

// ---------------------------------------------------------------- attention

struct AttnCase {
  DType t;
  int batch, heads, seq, dim;
  std::vector<int> lengths;  // padded: real keys per sequence (mask); varlen: sequence lengths
  bool varlen;
  float p;
  bool contiguous = false;   // padded only: q/k/v [B, H, S, D] instead of the model's packed views
};

std::string attn_name(const AttnCase& c) {
  std::ostringstream s;
  s << "kernels/" << (c.varlen ? "varlen_attention" : "attention") << "/" << dtype_name(c.t) << "/";
  if (c.varlen) {
    s << "lens";
    for (size_t i = 0; i < c.lengths.size(); ++i) s << (i ? "-" : "") << c.lengths[i];
  } else {
    s << "B" << c.batch << "_S" << c.seq << "_keys";
    for (size_t i = 0; i < c.lengths.size(); ++i) s << (i ? "-" : "") << c.lengths[i];
  }
  s << "_H" << c.heads << "_D" << c.dim << "_p" << c.p << (c.contiguous ? "_contiguous" : "");
  return s.str();
}

struct AttnLayout {
  int64_t tokens;      // padded: B * S; varlen: total tokens
  int64_t rows;        // softmax rows: heads * tokens
  HeadTensor q, k, v;  // offsets into the qkv buffer (ptr = element offset)
  HeadTensor out;      // offsets into an output buffer of tokens * H * D elements
};

AttnLayout attn_layout(const AttnCase& c) {
  AttnLayout l;
  const int64_t H = c.heads, D = c.dim;
  if (c.varlen) {
    l.tokens = 0;
    for (int len : c.lengths) l.tokens += len;
  } else {
    l.tokens = static_cast<int64_t>(c.batch) * c.seq;
  }
  l.rows = H * l.tokens;
  const auto off = [](int64_t e) { return reinterpret_cast<void*>(static_cast<intptr_t>(e)); };
  if (!c.varlen && c.contiguous) {  // [3][B, H, S, D]
    const int64_t sz = l.tokens * H * D;
    for (int i = 0; i < 3; ++i) {
      HeadTensor& t = i == 0 ? l.q : (i == 1 ? l.k : l.v);
      t.ptr = off(i * sz);
      t.stride_b = H * c.seq * D;
      t.stride_h = c.seq * D;
      t.stride_s = D;
    }
  } else {  // the model's packed projection: [tokens, 3, H, D]
    for (int i = 0; i < 3; ++i) {
      HeadTensor& t = i == 0 ? l.q : (i == 1 ? l.k : l.v);
      t.ptr = off(i * H * D);
      t.stride_b = static_cast<int64_t>(c.seq) * 3 * H * D;
      t.stride_h = D;
      t.stride_s = 3 * H * D;
    }
  }
  // Outputs as the bindings allocate them: [tokens, H, D] memory.
  l.out.ptr = nullptr;
  l.out.stride_b = static_cast<int64_t>(c.seq) * H * D;
  l.out.stride_h = D;
  l.out.stride_s = H * D;
  return l;
}

HeadTensor at(HeadTensor t, const Array& a) {
  const auto offset = reinterpret_cast<intptr_t>(t.ptr);
  t.ptr = static_cast<char*>(a.data()) + offset * static_cast<intptr_t>(elem_size(a.dtype()));
  return t;
}

struct AttnRun {
  Array o, stats, dq, dk, dv, record;
};

bool attn_run(const AttnCase& c, bool emulated, const Array& qkv, const Array& dout, AttnRun* out,
              std::string* why) {
  const DType t = qkv.dtype();
  const DType acc = t == DType::F64 ? DType::F64 : DType::F32;
  const AttnLayout l = attn_layout(c);
  const int64_t n = l.tokens * c.heads * c.dim;
  std::vector<uint8_t> mask;
  std::vector<int32_t> cu;
  AttnParams p;
  if (c.varlen) {
    cu.push_back(0);
    for (int len : c.lengths) cu.push_back(cu.back() + len);
    p.cu_seqlens = cu.data();
    p.total_tokens = l.tokens;
    p.batch = static_cast<int>(c.lengths.size());
    p.seq = *std::max_element(c.lengths.begin(), c.lengths.end());
  } else {
    p.batch = c.batch;
    p.seq = c.seq;
    if (!c.lengths.empty()) {
      mask.assign(static_cast<size_t>(c.batch) * c.seq, 0);
      for (int b = 0; b < c.batch; ++b)
        for (int j = 0; j < c.lengths[b]; ++j) mask[static_cast<size_t>(b) * c.seq + j] = 1;
      p.key_mask = mask.data();
      p.mask_stride_b = c.seq;
    }
  }
  p.heads = c.heads;
  p.head_dim = c.dim;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dim)));
  p.dropout = c.p > 0;
  p.p = c.p;
  p.rng.seed = kSeed;
  p.rng.offset = kOffset;
  out->o = Array(t, n);
  out->stats = Array(acc, 2 * l.rows);
  out->record = Array(DType::F64, 2);
  if (emulated && p.dropout) p.rng.save_to = reinterpret_cast<int64_t*>(out->record.data());
  p.q = at(l.q, qkv);
  p.k = at(l.k, qkv);
  p.v = at(l.v, qkv);
  p.o = at(l.out, out->o);
  p.stats = out->stats.data();
  if (emulated) {
    if (!run_emulated([&] { bertdist::attn_fwd_cuda(p, t, nullptr); }, "attn_fwd_cuda", why)) return false;
  } else {
    bertdist::attn_fwd_cpu(p, t);
  }
  out->dq = Array(t, n);
  out->dk = Array(t, n);
  out->dv = Array(t, n);
  Array delta(acc, l.rows);
  p.dout = at(l.out, dout);
  p.dq = at(l.out, out->dq);
  p.dk = at(l.out, out->dk);
  p.dv = at(l.out, out->dv);
  p.delta = delta.data();
  p.rng.save_to = nullptr;
  if (emulated && p.dropout) p.rng.saved = reinterpret_cast<const int64_t*>(out->record.data());
  if (emulated) return run_emulated([&] { bertdist::attn_bwd_cuda(p, t, nullptr); }, "attn_bwd_cuda", why);
  bertdist::attn_bwd_cpu(p, t);
  return true;
}

bool check_attn(const AttnCase& c, std::string* why) {
  const AttnLayout l = attn_layout(c);
  const int64_t n = l.tokens * c.heads * c.dim;
  const uint64_t s = static_cast<uint64_t>(c.seq * 977 + c.dim * 31 + c.heads + static_cast<int>(c.t));
  const Array qkv = random_array(c.t, 3 * n, s);
  const Array dout = random_array(c.t, n, s + 1);
  AttnRun emu, cpu, ref;
  if (!attn_run(c, true, qkv, dout, &emu, why)) return false;
  attn_run(c, false, qkv, dout, &cpu, why);
  attn_run(c, false, qkv.to(DType::F64), dout.to(DType::F64), &ref, why);
  Verdict v(c.t);
  v.close("out", emu.o, cpu.o, ref.o);
  v.close_f32("stats (row max, 1/rowsum)", emu.stats, cpu.stats, 1e-4);
  v.close("dq", emu.dq, cpu.dq, ref.dq);
  v.close("dk", emu.dk, cpu.dk, ref.dk);
  v.close("dv", emu.dv, cpu.dv, ref.dv);
  if (c.p > 0) {
    const auto* rec = reinterpret_cast<const int64_t*>(emu.record.data());
    if (rec[0] != static_cast<int64_t>(kSeed) || rec[1] != kOffset)
      v.add("dropout record (" + std::to_string(rec[0]) + ", " + std::to_string(rec[1]) + ") != (seed, offset)");
  }
  return v.ok(why);
}

// q = k = 0 gives every key probability 1/S; with V = I (per head) output row i is the row's
// keep mask times 1 / (S (1 - p)), so the kernel's own mask can be read off and compared with
// the Philox mask the CPU twin uses, bit for bit.
bool check_attn_mask(DType t, float p, std::string* why) {
  const int B = 1, H = 2, S = 64, D = 64;
  const AttnCase c{t, B, H, S, D, {}, false, p, true};
  const AttnLayout l = attn_layout(c);
  const int64_t n = l.tokens * H * D;
  Array qkv(t, 3 * n), dout(t, n);
  for (int64_t i = 0; i < 3 * n; ++i) qkv.set(i, 0.0);
  for (int64_t i = 0; i < n; ++i) dout.set(i, 0.0);
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < S; ++j) qkv.set(2 * n + (static_cast<int64_t>(h) * S + j) * D + j, 1.0);  // V = I
  AttnRun emu;
  if (!attn_run(c, true, qkv, dout, &emu, why)) return false;
  const uint32_t thr = bertdist::keep_threshold(p);
  int64_t kept = 0;
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < S; ++i)
      for (int j = 0; j < D; ++j) {
        const double o = emu.o.get((static_cast<int64_t>(i) * H + h) * D + j) * S * (1.0 - p);
        const bool got = std::lround(o) == 1;
        const bool want = bertdist::attn_keep(kSeed, kOffset, static_cast<uint32_t>(h), static_cast<uint32_t>(i),
                                              static_cast<uint32_t>(j), thr);
        kept += want;
        if (got != want || std::fabs(o - std::lround(o)) > 0.02) {
          *why = "head " + std::to_string(h) + " row " + std::to_string(i) + " key " + std::to_string(j) +
                 ": output says " + fmt("%.4f", o) + ", the Philox mask says " + (want ? "keep" : "drop");
          return false;
        }
      }
  if (kept == 0 || kept == static_cast<int64_t>(H) * S * D) {
    *why = "degenerate mask";
    return false;
  }
  return true;
}

// Keys lengths: full, about two thirds (at least 1).
std::vector<int> two_lengths(int s) { return {s, std::max(1, 2 * s / 3)}; }

// ---------------------------------------------------------------- launchers

// Kernel attributes are queried once per kernel and device, not at every launch; another
// emulated GPU (a lower per-kernel thread limit) is another device, queried again.
bool check_attributes_cached_per_device(std::string* why) {
  const LnCase ln{DType::F32, 7, 768, false, false, 0.f, false};
  const AttnCase at{DType::F32, 2, 2, 37, 64, two_lengths(37), false, 0.f};  // 50 KB: opts in to shared memory
  if (!check_ln(ln, why) || !check_attn(at, why)) return false;
  const int64_t before = counters().attribute_calls;
  if (!check_ln(ln, why) || !check_attn(at, why)) return false;
  if (counters().attribute_calls != before) {
    *why = std::to_string(counters().attribute_calls - before) +
           " cudaFuncGetAttributes/cudaFuncSetAttribute calls on a second run of the same kernels (must be 0)";
    return false;
  }
  {
    const KernelMaxThreads limit(512);
    if (!check_ln(ln, why)) return false;
  }
  if (counters().attribute_calls == before) {
    *why = "no cudaFuncGetAttributes call on another device: a cached answer was reused across devices";
    return false;
  }
  return true;
}

// An error pending before a launch is reported as an earlier one, not as the kernel's.
bool check_pending_error_is_not_ours(std::string* why) {
  const LnCase ln{DType::F32, 7, 768, false, false, 0.f, false};
  const AttnCase at{DType::F32, 2, 2, 37, 64, two_lengths(37), false, 0.f};
  for (int op = 0; op < 2; ++op) {
    inject_pending_error();
    std::string got;
    const bool passed = op == 0 ? check_ln(ln, &got) : check_attn(at, &got);
    const int left = take_pending_error();
    const char* what = op == 0 ? "layer norm" : "attention";
    if (passed || got.find("CUDA error pending before") == std::string::npos ||
        got.find("from an earlier operation") == std::string::npos) {
      *why = std::string(what) + " with an error pending: " + (passed ? "ran as if none" : got);
      return false;
    }
    if (left == 0) {
      *why = std::string(what) + ": the earlier error was cleared by the launcher; it is not the launcher's to clear";
      return false;
    }
  }
  return check_ln(ln, why) && check_attn(at, why);  // cleared: both run again
}

}  // namespace

std::vector<NamedCheck> kernel_checks(bool quick) {
  std::vector<NamedCheck> out;
  const auto ln = [&](LnCase c) { out.push_back({ln_name(c), [c](std::string* why) { return check_ln(c, why); }}); };
  const auto attn = [&](AttnCase c) {
    out.push_back({attn_name(c), [c](std::string* why) { return check_attn(c, why); }});
  };
  const DType all[] = {DType::F32, DType::BF16, DType::F16};
  // Layer norm: vectorised (hidden % (16 / sizeof(T)) == 0) and scalar paths, 1 to 8 vectors
  // per thread, row counts below and above the backward's grid (4 x multiprocessors blocks).
  for (DType t : all) {
    ln({t, 7, 768, false, false, 0.f, false});
    ln({t, 5, 770, false, false, 0.f, false});
    ln({t, 9, 128, true, true, 0.1f, false});
    ln({t, 37, 1024, true, true, 0.1f, false});
    ln({t, 5, 768, true, true, 0.1f, true});
    ln({t, 3, 4100, true, false, 0.f, false});
    if (!quick) {
      ln({t, 2, 4096, false, false, 0.f, true});
      ln({t, 11, 770, true, true, 0.25f, false});
      ln({t, 1, 16384, true, true, 0.1f, false});
    }
  }
  // Rows the register-resident kernels cannot take go to the streaming kernels: more than 8
  // vectors per thread (odd or unaligned rows above 8192; these failed with "hidden size too
  // large" before), or, on a GPU with fewer threads for a register-heavy kernel, any width.
  ln({DType::F32, 3, 12289, true, true, 0.1f, false});
  ln({DType::F32, 2, 16384, false, false, 0.f, true});
  ln({DType::BF16, 11, 9001, true, true, 0.1f, false});
  ln({DType::F32, 13, 4096, true, true, 0.1f, false, 256});
  ln({DType::BF16, 9, 4096, false, false, 0.f, false, 256});
  ln({DType::F16, 5, 2050, true, false, 0.25f, true, 256});
  for (DType t : all) {
    out.push_back({std::string("kernels/bias_dropout_add_ln/") + dtype_name(t) + "/mask_bit_identical_768",
                   [t](std::string* why) { return check_ln_mask(t, 6, 768, 0.3f, why); }});
    out.push_back({std::string("kernels/bias_dropout_add_ln/") + dtype_name(t) + "/mask_bit_identical_770",
                   [t](std::string* why) { return check_ln_mask(t, 5, 770, 0.3f, why); }});
  }
  // Attention, padded (the model's packed q/k/v views, key padding mask) and varlen.
  for (int s : {1, 7, 37, 64, 65, 128, 129}) attn({DType::F32, 2, 2, s, 64, two_lengths(s), false, 0.f});
  attn({DType::F32, 2, 2, 37, 64, two_lengths(37), false, 0.1f});
  attn({DType::F32, 2, 2, 129, 64, two_lengths(129), false, 0.1f});
  attn({DType::F32, 3, 2, 129, 64, {1, 0, 77}, false, 0.f});  // one real key; a fully padded sequence
  attn({DType::F32, 2, 2, 37, 64, {}, false, 0.1f, true});   // no mask, contiguous [B, H, S, D]
  attn({DType::F32, 2, 2, 37, 32, two_lengths(37), false, 0.1f});
  attn({DType::F32, 2, 2, 130, 128, two_lengths(130), false, 0.f});
  attn({DType::BF16, 2, 2, 37, 32, two_lengths(37), false, 0.f});
  attn({DType::BF16, 2, 2, 129, 64, two_lengths(129), false, 0.1f});
  attn({DType::F16, 2, 2, 65, 128, two_lengths(65), false, 0.1f});
  attn({DType::F16, 2, 2, 37, 64, two_lengths(37), false, 0.f});
  attn({DType::F32, 0, 3, 0, 64, {5, 1, 0, 17, 9}, true, 0.f});
  attn({DType::F32, 0, 3, 0, 64, {5, 1, 0, 17, 9}, true, 0.25f});
  attn({DType::BF16, 0, 2, 0, 32, {37, 64, 65}, true, 0.1f});
  attn({DType::F16, 0, 2, 0, 128, {1, 129}, true, 0.f});
  if (!quick) {
    attn({DType::F32, 1, 2, 512, 64, {512}, false, 0.1f});
    attn({DType::F32, 2, 2, 130, 128, two_lengths(130), false, 0.1f});
    attn({DType::F32, 2, 2, 65, 32, two_lengths(65), false, 0.f});
    attn({DType::BF16, 2, 2, 130, 128, two_lengths(130), false, 0.f});
    attn({DType::F16, 2, 2, 129, 32, two_lengths(129), false, 0.1f});
    attn({DType::BF16, 0, 2, 0, 64, {7, 128, 1}, true, 0.f});
  }
  for (DType t : {DType::F32, DType::BF16})
    out.push_back({std::string("kernels/attention/") + dtype_name(t) + "/mask_bit_identical",
                   [t](std::string* why) { return check_attn_mask(t, 0.2f, why); }});
  out.push_back({"kernels/launcher/attributes_cached_per_device", check_attributes_cached_per_device});
  out.push_back({"kernels/launcher/pending_error_is_not_ours", check_pending_error_is_not_ours});
  for (auto& c : optim_checks(quick)) out.push_back(std::move(c));
  return out;
}

CheckReport run_checks(const CheckOptions& o) {
  if (o.suite != "all" && o.suite != "selftest" && o.suite != "kernels")
    throw std::invalid_argument("suite must be all, selftest or kernels, got " + o.suite);
  std::vector<NamedCheck> checks;
  if (o.suite != "kernels") checks = selftests();
  if (o.suite != "selftest")
    for (auto& c : kernel_checks(o.quick)) checks.push_back(std::move(c));
  CheckReport r;
  for (const NamedCheck& c : checks) {
    if (!o.filter.empty() && c.name.find(o.filter) == std::string::npos) continue;
    const auto t0 = std::chrono::steady_clock::now();
    std::string why;
    bool ok = false;
    try {
      ok = c.fn(&why);
    } catch (const std::exception& e) {
      why = std::string("exception: ") + e.what();
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const std::string line = (ok ? "ok   " : "FAIL ") + c.name + fmt(" (%.0f ms)", ms) + (ok ? "" : ": " + why);
    r.log += line + "\n";
    if (o.verbose) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    if (ok) {
      ++r.passed;
    } else {
      ++r.failed;
      r.failures.push_back(c.name + ": " + why);
      if (!o.keep_going) break;
    }
  }
  return r;
}

}  // namespace bdemu
