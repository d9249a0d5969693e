// pybind11 host functions of the bertdist._C extension.
//
// Every entry point checks its arguments (device, dtype, shape, contiguity/strides) with a
// message naming the expected and the actual value, allocates outputs, and hands raw
// pointers to the CPU kernels or, for CUDA tensors, to the CUDA kernels (when built with
// BERTDIST_WITH_CUDA). The layer-norm family is registered with the dispatcher at the end of this
// file (schemas, backend, Meta, autocast and autograd kernels); the other ops are pybind11 entry
// points that bertdist/ops/fused.py wraps as Python custom ops.
//
// Built with BERTDIST_EMU instead, this file is bertdist._C_emu: the same entry points hand
// CPU tensors to the CUDA kernels, run by the SIMT emulator (csrc/emu), as a GPU would get them.
#include <torch/extension.h>

#include <cmath>
#include <initializer_list>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "ops.h"
#include "philox.h"

#ifdef BERTDIST_WITH_CUDA
#include <ATen/core/Generator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

// Written by the build (bertdist/ops/_build_config.py: write_build_info).
#if __has_include("bertdist_build_info.h")
#include "bertdist_build_info.h"
#endif
#ifndef BERTDIST_CUDA_ARCHS
#define BERTDIST_CUDA_ARCHS ""
#endif
#ifndef BERTDIST_BUILD_NOTE
#define BERTDIST_BUILD_NOTE ""
#endif

// The dispatcher namespace of the ops registered from C++: _C_emu's must not collide with _C's,
// since both modules load into one process.
#ifdef BERTDIST_EMU
#define BERTDIST_OP_NS bertdist_emu
#else
#define BERTDIST_OP_NS bertdist
#endif
#define BERTDIST_STRINGIFY_(x) #x
#define BERTDIST_STRINGIFY(x) BERTDIST_STRINGIFY_(x)
#define BERTDIST_OP_NS_STR BERTDIST_STRINGIFY(BERTDIST_OP_NS)

// The CUDA kernels are called from this module: compiled by nvcc, or by the host compiler for the emulator.
#if defined(BERTDIST_WITH_CUDA) || defined(BERTDIST_EMU)
#define BERTDIST_CUDA_KERNELS 1
#endif
#ifdef BERTDIST_EMU
#include "emu/checks.h"
#include "emu/emu_api.h"
#endif

namespace bertdist {
namespace {

#ifdef BERTDIST_EMU
constexpr bool kEmulated = true;  // CPU tensors go to the emulated CUDA kernels
#else
constexpr bool kEmulated = false;
#endif

std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

DType dtype_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kDouble:
      TORCH_CHECK(t.device().is_cpu() && !kEmulated, op, ": float64 is supported by the C++ CPU kernels only (got a ",
                  "float64 tensor on ", t.device(), kEmulated ? ", for the emulated CUDA kernels" : "", ")");
      return DType::F64;
    default:
      TORCH_CHECK(false, op, ": expected dtype float32, float16 or bfloat16 (float64 on CPU), got ",
                  t.scalar_type());
  }
  return DType::F32;
}

at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* op, const char* ref_name,
                       const char* name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref_name, "'s device ",
              ref.device(), ", got ", t.device());
}

void check_dtype(const at::Tensor& t, at::ScalarType want, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must have dtype ", want, ", got ", t.scalar_type());
}

void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides(),
              " for shape ", t.sizes());
}

void check_vector(const at::Tensor& t, int64_t n, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, op, ": ", name, " must have shape [", n, "], got ", shape_str(t));
}

// Small per-feature vectors (weights, biases) go to the kernels in the accumulation type.
at::Tensor as_acc(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

uint32_t checked_offset(int64_t offset, const char* op) {
  TORCH_CHECK(offset >= 0 && offset <= 0xFFFFFFFFLL, op, ": offset must be in [0, 2^32), got ", offset);
  return static_cast<uint32_t>(offset);
}

void check_p(double p, const char* op) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, op, ": dropout probability must be in [0, 1), got ", p);
}

// ---------------------------------------------------------------- dropout (seed, offset)

// How far one op call advances the CUDA generator's Philox offset: the least it accepts (a
// multiple of 4). Our streams index elements by counter words, so a call needs one offset.
constexpr uint64_t kGeneratorIncrement = 4;

// Sets a forward's dropout source and returns its record, the int64 [2] (seed, offset) the
// backward reads (empty without dropout). A given seed is used as is (every CPU call; on CUDA
// for tests and reproducibility); without one, a CUDA call takes the device's default CUDA
// generator's Philox state, which stays valid under CUDA-graph capture: the kernel unpacks it
// on the device and writes the record, so each replay draws, and records, a fresh pair. (On
// CUDA the record stays unwritten when there is no element to drop; no backward reads it then.)
at::Tensor forward_rng(DropoutRng& r, const at::Tensor& ref, double p_drop, const c10::optional<int64_t>& seed,
                       int64_t offset, const char* op) {
  const auto opts = ref.options().dtype(at::kLong);
  if (p_drop <= 0.0) return at::empty({0}, opts);
  auto record = at::empty({2}, opts);
  if (seed.has_value()) {
    r.seed = static_cast<uint64_t>(*seed);
    r.offset = checked_offset(offset, op);
    if (ref.device().is_cpu() && !kEmulated) {
      record.data_ptr<int64_t>()[0] = *seed;
      record.data_ptr<int64_t>()[1] = offset;
    } else {
      r.save_to = record.data_ptr<int64_t>();
    }
    return record;
  }
  TORCH_CHECK(ref.device().is_cuda(), op, ": dropout on ", ref.device(),
              " needs an explicit seed (only CUDA tensors draw one from the CUDA generator)");
#ifdef BERTDIST_WITH_CUDA
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(ref.device().index()));
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);  // the generator is shared by all threads
    r.generator = gen->philox_cuda_state(kGeneratorIncrement);
  }
  r.from_generator = true;
  r.save_to = record.data_ptr<int64_t>();
#endif
  return record;
}

// Sets a backward's dropout source to the record its forward returned.
void backward_rng(DropoutRng& r, const at::Tensor& ref, double p_drop, const at::Tensor& record, const char* op) {
  if (p_drop <= 0.0) return;
  check_same_device(ref, record, op, "the inputs", "rng_state");
  check_dtype(record, at::kLong, op, "rng_state");
  TORCH_CHECK(record.dim() == 1 && record.size(0) == 2 && record.is_contiguous(), op,
              ": rng_state must be the forward's contiguous [2] (seed, offset) record, got shape ",
              shape_str(record));
  if (ref.device().is_cpu() && !kEmulated) {
    r.seed = static_cast<uint64_t>(record.data_ptr<int64_t>()[0]);
    r.offset = checked_offset(record.data_ptr<int64_t>()[1], op);
  } else {
    r.saved = record.data_ptr<int64_t>();
  }
}

#ifdef BERTDIST_WITH_CUDA
void* current_stream() { return static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()); }
#endif

// Runs the CPU or CUDA variant of a kernel for tensors on `ref`'s device.
template <typename CpuFn, typename CudaFn>
void run_on_device(const at::Tensor& ref, const char* op, CpuFn&& cpu, CudaFn&& cuda) {
#ifdef BERTDIST_EMU
  (void)cpu;
  TORCH_CHECK(ref.device().is_cpu(), op, ": bertdist._C_emu runs the emulated CUDA kernels on CPU tensors, got device ",
              ref.device());
  try {
    cuda(nullptr);  // the emulator runs each launch to completion: no stream
  } catch (const std::exception& e) {
    TORCH_CHECK(false, op, ": ", e.what());
  }
  return;
#endif
  if (ref.device().is_cpu()) {
    cpu();
    return;
  }
#ifdef BERTDIST_WITH_CUDA
  if (ref.device().is_cuda()) {
    c10::cuda::CUDAGuard guard(ref.device());
    try {
      cuda(current_stream());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, op, ": ", e.what());
    }
    return;
  }
  TORCH_CHECK(false, op, ": expected a CPU or CUDA tensor, got device ", ref.device());
#else
  (void)cuda;
  TORCH_CHECK(false, op, ": expected a CPU tensor (this build of bertdist._C has no CUDA kernels: ",
              BERTDIST_BUILD_NOTE, "), got device ", ref.device());
#endif
}

// ---------------------------------------------------------------- layer norm

constexpr int64_t kMaxHidden = 16384;

struct LnInputs {
  int64_t rows, hidden;
  at::Tensor gamma, beta;
  bool params_lp;  // gamma, beta (and the dense bias) in x's bf16/fp16 dtype, passed as they are
};

// bf16/fp16 x whose per-feature parameters all have its dtype (a model with bf16 weights): the
// kernels read them as they are. Otherwise they go to the kernels in the accumulation type.
bool params_in_x_dtype(const at::Tensor& x, std::initializer_list<const at::Tensor*> params) {
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf) return false;
  for (const auto* t : params)
    if (t != nullptr && t->scalar_type() != x.scalar_type()) return false;
  return true;
}

LnInputs check_ln_inputs(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta, const char* op,
                         const at::Tensor* dense_bias = nullptr) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension, got shape ", shape_str(x));
  dtype_of(x, op);
  check_contiguous(x, op, "x");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(hidden >= 1 && hidden <= kMaxHidden, op, ": hidden size (x.shape[-1]) must be in [1, ", kMaxHidden,
              "], got ", hidden);
  check_same_device(x, gamma, op, "x", "weight");
  check_same_device(x, beta, op, "x", "bias");
  check_vector(gamma, hidden, op, "weight");
  check_vector(beta, hidden, op, "bias");
  if (params_in_x_dtype(x, {&gamma, &beta, dense_bias}))
    return {x.numel() / hidden, hidden, gamma.contiguous(), beta.contiguous(), true};
  const auto acc = acc_type(x);
  return {x.numel() / hidden, hidden, as_acc(gamma, acc), as_acc(beta, acc), false};
}

// The forward both entry points share, once `p` holds the fused op's bias, residual, h and
// dropout fields (all unset for plain LN): returns (y, mean, rstd).
std::vector<at::Tensor> run_ln_fwd(LnFwdParams& p, const at::Tensor& x, const LnInputs& in, double eps,
                                   const char* op) {
  auto y = at::empty_like(x);
  auto stat_opts = x.options().dtype(acc_type(x));
  auto mean = at::empty({in.rows}, stat_opts), rstd = at::empty({in.rows}, stat_opts);
  p.x = x.data_ptr();
  p.gamma = in.gamma.data_ptr();
  p.beta = in.beta.data_ptr();
  p.y = y.data_ptr();
  p.mean = mean.data_ptr();
  p.rstd = rstd.data_ptr();
  p.rows = in.rows;
  p.hidden = in.hidden;
  p.eps = static_cast<float>(eps);
  p.params_lp = in.params_lp;
  const DType t = dtype_of(x, op);
  if (in.rows > 0)
    run_on_device(x, op, [&] { ln_fwd_cpu(p, t); }, [&](void* s) {
#ifdef BERTDIST_CUDA_KERNELS
      ln_fwd_cuda(p, t, s);
#endif
    });
  return {y, mean, rstd};
}

void check_ln_bwd_inputs(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& mean,
                         const at::Tensor& rstd, const char* op, const char* h_name) {
  check_same_device(h, dy, op, h_name, "grad_out");
  check_dtype(dy, h.scalar_type(), op, "grad_out");
  TORCH_CHECK(dy.sizes() == h.sizes(), op, ": grad_out must have ", h_name, "'s shape ", shape_str(h), ", got ",
              shape_str(dy));
  check_contiguous(dy, op, "grad_out");
  const int64_t rows = h.numel() / h.size(-1);
  for (auto* t : {&mean, &rstd}) {
    check_same_device(h, *t, op, h_name, "mean/rstd");
    check_dtype(*t, acc_type(h), op, "mean/rstd");
    check_vector(*t, rows, op, "mean/rstd");
  }
}

// The backward both entry points share, once `p` holds the fused op's dx, dbias and dropout
// fields: returns (dh, dgamma, dbeta), the column sums in gamma's dtype (written so by the kernels
// when it is h's bf16/fp16, else summed in the accumulation type and cast). On CUDA the column
// sums need a partial-sum workspace.
std::vector<at::Tensor> run_ln_bwd(LnBwdParams& p, const at::Tensor& dy, const at::Tensor& h, const at::Tensor& mean,
                                   const at::Tensor& rstd, const at::Tensor& gamma, const LnInputs& in,
                                   const char* op) {
  auto dh = at::empty_like(h);
  auto acc_opts = h.options().dtype(in.params_lp ? h.scalar_type() : acc_type(h));
  // Every kernel writes each column of its sums when there are rows; zeros only for none.
  auto column_sums = [&] { return in.rows > 0 ? at::empty({in.hidden}, acc_opts) : at::zeros({in.hidden}, acc_opts); };
  auto dgamma = column_sums(), dbeta = column_sums();
  p.dy = dy.data_ptr();
  p.h = h.data_ptr();
  p.mean = mean.data_ptr();
  p.rstd = rstd.data_ptr();
  p.gamma = in.gamma.data_ptr();
  p.dh = dh.data_ptr();
  p.dgamma = dgamma.data_ptr();
  p.dbeta = dbeta.data_ptr();
  p.rows = in.rows;
  p.hidden = in.hidden;
  p.params_lp = in.params_lp;
  const DType t = dtype_of(h, op);
  if (in.rows > 0)
    run_on_device(h, op, [&] { ln_bwd_cpu(p, t); }, [&](void* s) {
#ifdef BERTDIST_CUDA_KERNELS
      const int parts = ln_bwd_cuda_parts(p.rows, h.device().index());
      auto ws = at::empty({3 * static_cast<int64_t>(parts) * p.hidden}, h.options().dtype(at::kFloat));
      ln_bwd_cuda(p, t, ws.data_ptr<float>(), parts, s);
#endif
    });
  return {dh, dgamma.to(gamma.scalar_type()), dbeta.to(gamma.scalar_type())};
}

std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                                       double eps) {
  const char* op = "bertdist.layer_norm_fwd";
  auto in = check_ln_inputs(x, gamma, beta, op);
  LnFwdParams p;
  return run_ln_fwd(p, x, in, eps, op);
}

std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                       const at::Tensor& rstd, const at::Tensor& gamma) {
  const char* op = "bertdist.layer_norm_bwd";
  auto in = check_ln_inputs(x, gamma, gamma, op);
  check_ln_bwd_inputs(dy, x, mean, rstd, op, "x");
  LnBwdParams p;
  return run_ln_bwd(p, dy, x, mean, rstd, gamma, in, op);
}

// y = LN(residual + dropout(x + bias)); returns (y, h = residual + dropout(x + bias), mean, rstd,
// rng_state: the dropout's (seed, offset) record, see forward_rng).
std::vector<at::Tensor> bdaln_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                  const at::Tensor& residual, const at::Tensor& gamma, const at::Tensor& beta,
                                  double p_drop, double eps, const c10::optional<int64_t>& seed, int64_t offset) {
  const char* op = "bertdist.bias_dropout_add_layer_norm_fwd";
  auto in = check_ln_inputs(x, gamma, beta, op, bias.has_value() ? &*bias : nullptr);
  check_p(p_drop, op);
  check_same_device(x, residual, op, "x", "residual");
  check_dtype(residual, x.scalar_type(), op, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual must have x's shape ", shape_str(x), ", got ",
              shape_str(residual));
  check_contiguous(residual, op, "residual");
  at::Tensor bias_acc;
  if (bias.has_value()) {
    check_same_device(x, *bias, op, "x", "dense bias");
    check_vector(*bias, in.hidden, op, "dense bias");
    bias_acc = in.params_lp ? bias->contiguous() : as_acc(*bias, acc_type(x));
  }
  auto h = at::empty_like(x);
  LnFwdParams p;
  p.bias = bias_acc.defined() ? bias_acc.data_ptr() : nullptr;
  p.residual = residual.data_ptr();
  p.h = h.data_ptr();
  p.dropout = p_drop > 0.0;
  p.p = static_cast<float>(p_drop);
  auto record = forward_rng(p.rng, x, p_drop, seed, offset, op);
  auto out = run_ln_fwd(p, x, in, eps, op);
  return {out[0], h, out[1], out[2], record};
}

// Returns (d_h, d_x, d_weight, d_bias_ln, d_dense_bias). d_h is the residual's gradient;
// d_x (x's gradient) is an empty tensor when p == 0, since it then equals d_h; d_dense_bias (in
// gamma's dtype when that is h's bf16/fp16, else the accumulation type; the caller casts it to the
// bias's dtype) is empty unless has_bias.
std::vector<at::Tensor> bdaln_bwd(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& mean,
                                  const at::Tensor& rstd, const at::Tensor& gamma, bool has_bias,
                                  double p_drop, const at::Tensor& rng_state) {
  const char* op = "bertdist.bias_dropout_add_layer_norm_bwd";
  auto in = check_ln_inputs(h, gamma, gamma, op);
  check_ln_bwd_inputs(dy, h, mean, rstd, op, "h");
  check_p(p_drop, op);
  auto dx = p_drop > 0.0 ? at::empty_like(h) : at::empty({0}, h.options());
  auto acc_opts = h.options().dtype(in.params_lp ? h.scalar_type() : acc_type(h));
  // Written in full by the backward's column sums when there are rows (run_ln_bwd).
  auto dbias = !has_bias ? at::empty({0}, acc_opts)
                         : (in.rows > 0 ? at::empty({in.hidden}, acc_opts) : at::zeros({in.hidden}, acc_opts));
  LnBwdParams p;
  p.dx = p_drop > 0.0 ? dx.data_ptr() : nullptr;
  p.dbias = has_bias ? dbias.data_ptr() : nullptr;
  p.dropout = p_drop > 0.0;
  p.p = static_cast<float>(p_drop);
  backward_rng(p.rng, h, p_drop, rng_state, op);
  auto g = run_ln_bwd(p, dy, h, mean, rstd, gamma, in, op);
  return {g[0], dx, g[1], g[2], dbias};
}

// ---------------------------------------------------------------- attention

HeadTensor head_view(const at::Tensor& t) {
  HeadTensor h;
  h.ptr = t.data_ptr();
  if (t.dim() == 4) {  // [B, H, S, D]
    h.stride_b = t.stride(0);
    h.stride_h = t.stride(1);
    h.stride_s = t.stride(2);
  } else {  // [T, H, D]
    h.stride_h = t.stride(1);
    h.stride_s = t.stride(0);
  }
  return h;
}

void check_head_tensor(const at::Tensor& ref, const at::Tensor& t, const char* op, const char* name) {
  check_same_device(ref, t, op, "q", name);
  check_dtype(t, ref.scalar_type(), op, name);
  TORCH_CHECK(t.sizes() == ref.sizes(), op, ": ", name, " must have q's shape ", shape_str(ref), ", got ",
              shape_str(t));
  TORCH_CHECK(t.stride(-1) == 1, op, ": ", name, " must have unit stride on head_dim, got strides ", t.strides());
}

void check_head_dim(const at::Tensor& q, const char* op) {
  const int64_t d = q.size(-1);
  if (q.device().is_cuda() || kEmulated) {
    TORCH_CHECK(d == 32 || d == 64 || d == 128, op, ": head_dim must be 32, 64 or 128 on CUDA, got ", d);
  } else {
    TORCH_CHECK(d >= 1 && d <= 1024, op, ": head_dim must be in [1, 1024], got ", d);
  }
}

void fill_mask(AttnParams& p, const c10::optional<at::Tensor>& mask, const at::Tensor& q, const char* op) {
  if (!mask.has_value()) return;
  const auto& m = *mask;
  check_same_device(q, m, op, "q", "key_padding_mask");
  check_dtype(m, at::kBool, op, "key_padding_mask");
  TORCH_CHECK(m.dim() == 2 && m.size(0) == q.size(0) && m.size(1) == q.size(2), op,
              ": key_padding_mask must have shape [batch, seq] = [", q.size(0), ", ", q.size(2), "], got ",
              shape_str(m));
  TORCH_CHECK(m.stride(1) == 1 || m.size(1) == 1, op, ": key_padding_mask must have unit stride on seq, got strides ",
              m.strides());
  p.key_mask = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
  p.mask_stride_b = m.stride(0);
}

void fill_common(AttnParams& p, const at::Tensor& q, double scale, double p_drop, const char* op) {
  check_p(p_drop, op);
  p.head_dim = static_cast<int>(q.size(-1));
  p.scale = static_cast<float>(scale);
  p.dropout = p_drop > 0.0;
  p.p = static_cast<float>(p_drop);
}

// q, k and v of one layout: `dims` dimensions named by `layout`, head_dim dense.
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t dims, const char* layout,
               const char* op) {
  TORCH_CHECK(q.dim() == dims, op, ": q must be ", layout, ", got shape ", shape_str(q));
  dtype_of(q, op);
  TORCH_CHECK(q.stride(-1) == 1, op, ": q must have unit stride on head_dim, got strides ", q.strides());
  check_head_tensor(q, k, op, "k");
  check_head_tensor(q, v, op, "v");
  check_head_dim(q, op);
}

void check_padded_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* op) {
  check_qkv(q, k, v, 4, "[batch, heads, seq, head_dim]", op);
}

// Checked parameters of the padded layout: q [B, H, S, D] with an optional key padding mask.
AttnParams padded_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale, double p_drop, const char* op) {
  check_padded_qkv(q, k, v, op);
  AttnParams p;
  fill_common(p, q, scale, p_drop, op);
  fill_mask(p, mask, q, op);
  p.batch = static_cast<int>(q.size(0));
  p.heads = static_cast<int>(q.size(1));
  p.seq = static_cast<int>(q.size(2));
  return p;
}

void check_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu,
                  int64_t max_seqlen, const char* op) {
  check_qkv(q, k, v, 3, "[total_tokens, heads, head_dim]", op);
  check_same_device(q, cu, op, "q", "cu_seqlens");
  check_dtype(cu, at::kInt, op, "cu_seqlens");
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, op, ": cu_seqlens must be [batch + 1], got shape ", shape_str(cu));
  check_contiguous(cu, op, "cu_seqlens");
  TORCH_CHECK(max_seqlen >= 0, op, ": max_seqlen must be >= 0, got ", max_seqlen);
  if (cu.device().is_cpu()) {  // on CUDA this would cost a device sync; the caller vouches
    const int32_t* c = cu.data_ptr<int32_t>();
    const int64_t n = cu.size(0);
    TORCH_CHECK(c[0] == 0, op, ": cu_seqlens[0] must be 0, got ", c[0]);
    TORCH_CHECK(c[n - 1] == q.size(0), op, ": cu_seqlens[-1] must equal total_tokens ", q.size(0), ", got ",
                c[n - 1]);
    for (int64_t i = 1; i < n; ++i) {
      TORCH_CHECK(c[i] >= c[i - 1], op, ": cu_seqlens must be non-decreasing, got ", c[i - 1], " then ", c[i],
                  " at index ", i);
      TORCH_CHECK(c[i] - c[i - 1] <= max_seqlen, op, ": sequence ", i - 1, " has length ", c[i] - c[i - 1],
                  " > max_seqlen ", max_seqlen);
    }
  }
}

// Checked parameters of the varlen layout: q [T, H, D] packed, sequence b is tokens cu[b] .. cu[b + 1].
AttnParams varlen_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu,
                         int64_t max_seqlen, double scale, double p_drop, const char* op) {
  check_varlen(q, k, v, cu, max_seqlen, op);
  AttnParams p;
  fill_common(p, q, scale, p_drop, op);
  p.cu_seqlens = cu.data_ptr<int32_t>();
  p.batch = static_cast<int>(cu.size(0) - 1);
  p.heads = static_cast<int>(q.size(1));
  p.seq = static_cast<int>(max_seqlen);
  p.total_tokens = q.size(0);
  return p;
}

// An output shaped like q: padded ones in [B, S, H, D] memory seen as [B, H, S, D] (the
// model's transpose(1, 2).reshape back to [B, S, H * D] is then free), varlen ones contiguous.
at::Tensor empty_attn_out(const at::Tensor& q) {
  if (q.dim() == 4) return at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).permute({0, 2, 1, 3});
  return at::empty(q.sizes(), q.options());
}

// One softmax row per (query token, head) in either layout.
int64_t stat_rows(const at::Tensor& q) { return q.numel() / q.size(-1); }

void run_attn(const at::Tensor& ref, const AttnParams& p, DType t, bool backward, const char* op) {
  if (ref.numel() == 0 || p.batch == 0) return;
  run_on_device(ref, op, [&] { backward ? attn_bwd_cpu(p, t) : attn_fwd_cpu(p, t); }, [&](void* s) {
#ifdef BERTDIST_CUDA_KERNELS
    backward ? attn_bwd_cuda(p, t, s) : attn_fwd_cuda(p, t, s);
#endif
  });
}

// Points `p` at the tensors the forward and the backward both hand the kernels.
void set_forward_tensors(AttnParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& o, const at::Tensor& stats) {
  p.q = head_view(q);
  p.k = head_view(k);
  p.v = head_view(v);
  p.o = head_view(o);
  p.stats = stats.data_ptr();
}

// The forward both layouts share once `p` holds the checked layout: returns (out, stats [2, rows],
// rng_state).
std::vector<at::Tensor> run_attention_fwd(AttnParams& p, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const c10::optional<int64_t>& seed, int64_t offset,
                                          const char* op) {
  auto record = forward_rng(p.rng, q, p.p, seed, offset, op);
  auto o = empty_attn_out(q);
  auto stats = at::empty({2, stat_rows(q)}, q.options().dtype(acc_type(q)));
  set_forward_tensors(p, q, k, v, o, stats);
  run_attn(q, p, dtype_of(q, op), false, op);
  return {o, stats, record};
}

// The backward both layouts share once `p` holds the checked layout: returns (dq, dk, dv).
std::vector<at::Tensor> run_attention_bwd(AttnParams& p, const at::Tensor& dout, const at::Tensor& q,
                                          const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                                          const at::Tensor& stats, const at::Tensor& rng_state, const char* op) {
  check_head_tensor(q, o, op, "out");
  check_head_tensor(q, dout, op, "grad_out");
  const int64_t rows = stat_rows(q);
  check_same_device(q, stats, op, "q", "stats");
  check_dtype(stats, acc_type(q), op, "stats");
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 2 && stats.size(1) == rows && stats.is_contiguous(), op,
              ": stats must be a contiguous [2, ", rows, "] tensor, got shape ", shape_str(stats));
  backward_rng(p.rng, q, p.p, rng_state, op);
  auto dq = empty_attn_out(q), dk = empty_attn_out(q), dv = empty_attn_out(q);
  auto delta = at::empty({rows}, stats.options());
  set_forward_tensors(p, q, k, v, o, stats);
  p.dout = head_view(dout);
  p.dq = head_view(dq);
  p.dk = head_view(dk);
  p.dv = head_view(dv);
  p.delta = delta.data_ptr();
  run_attn(q, p, dtype_of(q, op), true, op);
  return {dq, dk, dv};
}

// Returns (out [B, H, S, D], stats [2, B * H * S], rng_state).
std::vector<at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const c10::optional<at::Tensor>& key_padding_mask, double scale,
                                      double p_drop, const c10::optional<int64_t>& seed, int64_t offset) {
  const char* op = "bertdist.attention_fwd";
  auto p = padded_params(q, k, v, key_padding_mask, scale, p_drop, op);
  return run_attention_fwd(p, q, k, v, seed, offset, op);
}

std::vector<at::Tensor> attention_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& o, const at::Tensor& stats,
                                      const c10::optional<at::Tensor>& key_padding_mask, double scale,
                                      double p_drop, const at::Tensor& rng_state) {
  const char* op = "bertdist.attention_bwd";
  auto p = padded_params(q, k, v, key_padding_mask, scale, p_drop, op);
  return run_attention_bwd(p, dout, q, k, v, o, stats, rng_state, op);
}

// Returns (out [T, H, D], stats [2, H * T], rng_state).
std::vector<at::Tensor> varlen_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& cu_seqlens, int64_t max_seqlen, double scale,
                                             double p_drop, const c10::optional<int64_t>& seed, int64_t offset) {
  const char* op = "bertdist.varlen_attention_fwd";
  auto p = varlen_params(q, k, v, cu_seqlens, max_seqlen, scale, p_drop, op);
  return run_attention_fwd(p, q, k, v, seed, offset, op);
}

std::vector<at::Tensor> varlen_attention_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& o, const at::Tensor& stats,
                                             const at::Tensor& cu_seqlens, int64_t max_seqlen, double scale,
                                             double p_drop, const at::Tensor& rng_state) {
  const char* op = "bertdist.varlen_attention_bwd";
  auto p = varlen_params(q, k, v, cu_seqlens, max_seqlen, scale, p_drop, op);
  return run_attention_bwd(p, dout, q, k, v, o, stats, rng_state, op);
}

// ---------------------------------------------------------------- flat-buffer optimizers

// The segment table [2, segments + 1] (element offsets, chunk offsets) of buffers of n elements.
// Its contents are checked where they are on the CPU; on CUDA that would cost a device sync, and
// the caller (bertdist.ops.flat_layout, which built it on the CPU) vouches.
FlatSegments check_flat_table(const at::Tensor& ref, const char* ref_name, const at::Tensor& table, int64_t chunks,
                              int64_t chunk_size, const char* op) {
  check_same_device(ref, table, op, ref_name, "table");
  check_dtype(table, at::kLong, op, "table");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == 2 && table.size(1) >= 1, op,
              ": table must be [2, segments + 1] (element offsets, chunk offsets), got shape ", shape_str(table));
  check_contiguous(table, op, "table");
  TORCH_CHECK(chunk_size >= 1, op, ": chunk_size must be >= 1, got ", chunk_size);
  TORCH_CHECK(chunks >= 0, op, ": num_chunks must be >= 0, got ", chunks);
  FlatSegments s;
  s.segments = table.size(1) - 1;
  s.offsets = table.data_ptr<int64_t>();
  s.chunk_offsets = s.offsets + table.size(1);
  s.chunks = chunks;
  s.chunk_size = chunk_size;
  if (table.device().is_cpu()) {
    TORCH_CHECK(s.offsets[0] == 0 && s.chunk_offsets[0] == 0, op, ": the table must start at 0, got offsets[0] = ",
                s.offsets[0], ", chunk_offsets[0] = ", s.chunk_offsets[0]);
    for (int64_t i = 0; i < s.segments; ++i) {
      const int64_t len = s.offsets[i + 1] - s.offsets[i], got = s.chunk_offsets[i + 1] - s.chunk_offsets[i];
      TORCH_CHECK(len >= 0, op, ": segment ", i, " ends before it starts: offsets ", s.offsets[i], " then ",
                  s.offsets[i + 1]);
      const int64_t want = (len + chunk_size - 1) / chunk_size;
      TORCH_CHECK(got == want, op, ": segment ", i, " of ", len, " elements needs ", want, " chunks of ", chunk_size,
                  ", the table gives it ", got);
    }
    TORCH_CHECK(s.offsets[s.segments] == ref.numel(), op, ": the segments cover ", s.offsets[s.segments],
                " elements, the buffers have ", ref.numel());
    TORCH_CHECK(s.chunk_offsets[s.segments] == chunks, op, ": the table has ", s.chunk_offsets[s.segments],
                " chunks, num_chunks is ", chunks);
  }
  return s;
}

void check_flat(const at::Tensor& ref, const at::Tensor& t, const char* op, const char* name) {
  check_same_device(ref, t, op, "params", name);
  TORCH_CHECK(t.dim() == 1 && t.numel() == ref.numel(), op, ": ", name, " must be a flat [", ref.numel(),
              "] buffer, got shape ", shape_str(t));
  check_contiguous(t, op, name);
}

DType flat_grad_dtype(const at::Tensor& g, const char* op) {
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16, op,
              ": grads must be float32 or bfloat16, got ", g.scalar_type());
  return g.scalar_type() == at::kFloat ? DType::F32 : DType::BF16;
}

// Returns (seg_norm2 [segments], stats [2] = (global norm, clip coefficient)), fp32.
std::vector<at::Tensor> flat_grad_norm(const at::Tensor& g, const at::Tensor& table, int64_t num_chunks,
                                       int64_t chunk_size, double max_norm) {
  const char* op = "bertdist.flat_grad_norm";
  TORCH_CHECK(g.dim() == 1, op, ": grads must be a flat buffer, got shape ", shape_str(g));
  check_contiguous(g, op, "grads");
  const DType gt = flat_grad_dtype(g, op);
  FlatNormParams p;
  p.seg = check_flat_table(g, "grads", table, num_chunks, chunk_size, op);
  const auto opts = g.options().dtype(at::kFloat);
  auto partial = at::empty({num_chunks}, opts), seg_norm2 = at::empty({p.seg.segments}, opts);
  auto stats = at::empty({2}, opts);
  p.g = g.data_ptr();
  p.partial = partial.data_ptr<float>();
  p.seg_norm2 = seg_norm2.data_ptr<float>();
  p.stats = stats.data_ptr<float>();
  p.max_norm = static_cast<float>(max_norm);
  run_on_device(g, op, [&] { flat_norm_cpu(p, gt); }, [&](void* s) {
#ifdef BERTDIST_CUDA_KERNELS
    flat_norm_cuda(p, gt, s);
#endif
  });
  return {seg_norm2, stats};
}

// The checked arguments both steps share; returns the gradient's dtype in *gt.
FlatStepParams flat_step_params(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                                const at::Tensor& table, int64_t num_chunks, int64_t chunk_size,
                                const at::Tensor& weight_decay, const at::Tensor& stats, int64_t step, double lr,
                                double beta1, double beta2, double eps, bool bias_correction,
                                const at::Tensor& params_bf16, const char* op, DType* gt) {
  TORCH_CHECK(p.dim() == 1, op, ": params must be a flat buffer, got shape ", shape_str(p));
  check_dtype(p, at::kFloat, op, "params");
  check_contiguous(p, op, "params");
  check_flat(p, g, op, "grads");
  *gt = flat_grad_dtype(g, op);
  for (const auto& [t, name] : {std::pair{&m, "exp_avg"}, std::pair{&v, "exp_avg_sq"}}) {
    check_flat(p, *t, op, name);
    check_dtype(*t, at::kFloat, op, name);
  }
  FlatStepParams f;
  f.seg = check_flat_table(p, "params", table, num_chunks, chunk_size, op);
  check_same_device(p, weight_decay, op, "params", "weight_decay");
  check_dtype(weight_decay, at::kFloat, op, "weight_decay");
  check_vector(weight_decay, f.seg.segments, op, "weight_decay");
  check_contiguous(weight_decay, op, "weight_decay");
  check_same_device(p, stats, op, "params", "stats");
  check_dtype(stats, at::kFloat, op, "stats");
  check_vector(stats, 2, op, "stats");
  TORCH_CHECK(step >= 1, op, ": step must be >= 1 (the count including this step), got ", step);
  TORCH_CHECK(lr >= 0.0, op, ": lr must be >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, op, ": betas must be in [0, 1), got (",
              beta1, ", ", beta2, ")");
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  f.p = p.data_ptr<float>();
  f.g = g.data_ptr();
  f.m = m.data_ptr<float>();
  f.v = v.data_ptr<float>();
  f.weight_decay = weight_decay.data_ptr<float>();
  if (params_bf16.numel() > 0) {  // empty: no bf16 copy
    check_flat(p, params_bf16, op, "params_bf16");
    check_dtype(params_bf16, at::kBFloat16, op, "params_bf16");
    f.p_bf16 = params_bf16.data_ptr();
  }
  f.stats = stats.data_ptr<float>();
  f.lr = static_cast<float>(lr);
  f.beta1 = static_cast<float>(beta1);
  f.beta2 = static_cast<float>(beta2);
  f.eps = static_cast<float>(eps);
  f.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  f.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  // In double on the host, as torch's optimizers compute them.
  f.bc1 = bias_correction ? static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(step))) : 1.f;
  f.bc2 = bias_correction ? static_cast<float>(1.0 - std::pow(beta2, static_cast<double>(step))) : 1.f;
  return f;
}

void flat_lamb_step(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                    const at::Tensor& table, int64_t num_chunks, int64_t chunk_size, const at::Tensor& weight_decay,
                    const at::Tensor& stats, int64_t step, double lr, double beta1, double beta2, double eps,
                    bool bias_correction, double max_coeff, double min_coeff, const at::Tensor& params_bf16) {
  const char* op = "bertdist.flat_lamb_step";
  DType gt;
  FlatStepParams f = flat_step_params(p, g, m, v, table, num_chunks, chunk_size, weight_decay, stats, step, lr, beta1,
                                      beta2, eps, bias_correction, params_bf16, op, &gt);
  TORCH_CHECK(min_coeff >= 0.0 && min_coeff <= max_coeff, op, ": need 0 <= min_coeff <= max_coeff, got min_coeff ",
              min_coeff, ", max_coeff ", max_coeff);
  f.max_coeff = static_cast<float>(max_coeff);
  f.min_coeff = static_cast<float>(min_coeff);
  auto partial = at::empty({2 * num_chunks}, p.options());
  f.partial = partial.data_ptr<float>();
  run_on_device(p, op, [&] { flat_lamb_cpu(f, gt); }, [&](void* s) {
#ifdef BERTDIST_CUDA_KERNELS
    flat_lamb_cuda(f, gt, s);
#endif
  });
}

void flat_adamw_step(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                     const at::Tensor& table, int64_t num_chunks, int64_t chunk_size, const at::Tensor& weight_decay,
                     const at::Tensor& stats, int64_t step, double lr, double beta1, double beta2, double eps,
                     const at::Tensor& params_bf16) {
  const char* op = "bertdist.flat_adamw_step";
  DType gt;
  const FlatStepParams f = flat_step_params(p, g, m, v, table, num_chunks, chunk_size, weight_decay, stats, step, lr,
                                            beta1, beta2, eps, true, params_bf16, op, &gt);
  run_on_device(p, op, [&] { flat_adamw_cpu(f, gt); }, [&](void* s) {
#ifdef BERTDIST_CUDA_KERNELS
    flat_adamw_cuda(f, gt, s);
#endif
  });
}

// The dropout keep masks the kernels use, materialised on CPU: for tests (an explicit-mask
// reference must match the fused ops with dropout on) and for anyone checking reproducibility.
at::Tensor hidden_keep_mask(int64_t rows, int64_t hidden, double p_drop, int64_t seed, int64_t offset) {
  const char* op = "bertdist.hidden_keep_mask";
  check_p(p_drop, op);
  TORCH_CHECK(rows >= 0 && hidden >= 1, op, ": need rows >= 0 and hidden >= 1, got ", rows, ", ", hidden);
  const uint32_t off = checked_offset(offset, op), thr = keep_threshold(static_cast<float>(p_drop));
  auto keep = at::empty({rows, hidden}, at::kBool);
  bool* k = keep.data_ptr<bool>();
  for (int64_t e = 0; e < rows * hidden; ++e)
    k[e] = hidden_draws(static_cast<uint64_t>(seed), off, static_cast<uint64_t>(e) >> 2).v[e & 3] < thr;
  return keep;
}

at::Tensor attention_keep_mask(int64_t batch_heads, int64_t rows, int64_t cols, double p_drop, int64_t seed,
                               int64_t offset) {
  const char* op = "bertdist.attention_keep_mask";
  check_p(p_drop, op);
  TORCH_CHECK(batch_heads >= 0 && rows >= 0 && cols >= 0, op, ": sizes must be >= 0");
  const uint32_t off = checked_offset(offset, op), thr = keep_threshold(static_cast<float>(p_drop));
  auto keep = at::empty({batch_heads, rows, cols}, at::kBool);
  bool* k = keep.data_ptr<bool>();
  for (int64_t bh = 0; bh < batch_heads; ++bh)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        *k++ = attn_keep(static_cast<uint64_t>(seed), off, static_cast<uint32_t>(bh), static_cast<uint32_t>(i),
                         static_cast<uint32_t>(j), thr);
  return keep;
}

bool with_cuda() {
#ifdef BERTDIST_WITH_CUDA
  return true;
#else
  return false;
#endif
}

pybind11::dict build_info() {
  pybind11::dict d;
  d["with_cuda"] = with_cuda();
  d["emulated"] = kEmulated;
#ifdef BERTDIST_EMU
  d["cuda_archs"] = std::string();
  d["note"] = bdemu::describe_device();
#else
  d["cuda_archs"] = std::string(BERTDIST_CUDA_ARCHS);
  d["note"] = std::string(BERTDIST_BUILD_NOTE);
#endif
#ifdef _OPENMP
  d["openmp"] = true;
#else
  d["openmp"] = false;
#endif
  d["cuda_head_dims"] = std::vector<int>{32, 64, 128};
  d["max_hidden"] = kMaxHidden;
  return d;
}

#ifdef BERTDIST_EMU
// What the emulator has run since the last reset: {kernel name: (launches, blocks, threads)}
// and its totals (context switches, barriers, warp collectives).
pybind11::dict emulator_counts() {
  pybind11::dict kernels;
  for (const auto& k : bdemu::kernel_counts())
    kernels[k.name.c_str()] = pybind11::make_tuple(k.launches, k.blocks, k.threads);
  const bdemu::Counters c = bdemu::counters();
  pybind11::dict d;
  d["kernels"] = kernels;
  d["context_switches"] = c.context_switches;
  d["barriers"] = c.barriers;
  d["warp_collectives"] = c.warp_collectives;
  d["attribute_calls"] = c.attribute_calls;
  return d;
}

// The C++ checks (csrc/emu/checks.h): returns {passed, failed, failures, log}.
pybind11::dict run_checks(const std::string& suite, const std::string& filter, bool keep_going, bool quick) {
  bdemu::CheckOptions o;
  o.suite = suite;
  o.filter = filter;
  o.keep_going = keep_going;
  o.quick = quick;
  bdemu::CheckReport r;
  {
    pybind11::gil_scoped_release no_gil;
    try {
      r = bdemu::run_checks(o);
    } catch (const std::invalid_argument& e) {
      pybind11::gil_scoped_acquire gil;
      TORCH_CHECK(false, "run_checks: ", e.what());
    }
  }
  pybind11::dict d;
  d["passed"] = r.passed;
  d["failed"] = r.failed;
  d["failures"] = r.failures;
  d["log"] = r.log;
  return d;
}
#endif

}  // namespace
}  // namespace bertdist

// ---------------------------------------------------------------- dispatcher registration (layer-norm family)
//
// The layer-norm ops are registered with the dispatcher here rather than as Python custom ops: a
// call then runs no Python past the public function (no custom-op machinery, no Python autograd
// Function), which on a GPU costs more host time than the kernel itself. Each op gets a schema, a
// backend kernel (the host functions above), a Meta kernel (what FakeTensor and torch.compile trace
// with), an autocast kernel and, for the forwards, an Autograd kernel whose forward and backward
// call the ops back through the dispatcher, so that tracing, FakeTensor and autocast still see them.
// The attention and flat optimizer ops stay Python custom ops in the same namespace: every
// registration here is a fragment, which coexists with theirs in either load order.

namespace bertdist {
namespace {

using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensors5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using LnFwdSig = Tensors3(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using LnBwdSig = Tensors3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&);
using BdalnFwdSig = Tensors5(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, double, std::optional<int64_t>, int64_t);
using BdalnBwdSig = Tensors5(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, bool, double, const at::Tensor&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Looked up once, on first use (the registrations below run when the module loads).
const c10::TypedOperatorHandle<LnFwdSig>& ln_fwd_op() {
  static const auto op = typed_op<LnFwdSig>(BERTDIST_OP_NS_STR "::layer_norm_fwd");
  return op;
}
const c10::TypedOperatorHandle<LnBwdSig>& ln_bwd_op() {
  static const auto op = typed_op<LnBwdSig>(BERTDIST_OP_NS_STR "::layer_norm_bwd");
  return op;
}
const c10::TypedOperatorHandle<BdalnFwdSig>& bdaln_fwd_op() {
  static const auto op = typed_op<BdalnFwdSig>(BERTDIST_OP_NS_STR "::bias_dropout_add_layer_norm_fwd");
  return op;
}
const c10::TypedOperatorHandle<BdalnBwdSig>& bdaln_bwd_op() {
  static const auto op = typed_op<BdalnBwdSig>(BERTDIST_OP_NS_STR "::bias_dropout_add_layer_norm_bwd");
  return op;
}

// -------- backend kernels: the host functions, which check their inputs and pick CPU or CUDA

Tensors3 to_tuple3(std::vector<at::Tensor>&& v) { return {std::move(v[0]), std::move(v[1]), std::move(v[2])}; }
Tensors5 to_tuple5(std::vector<at::Tensor>&& v) {
  return {std::move(v[0]), std::move(v[1]), std::move(v[2]), std::move(v[3]), std::move(v[4])};
}

Tensors3 ln_fwd_kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  return to_tuple3(layer_norm_fwd(x, weight, bias, eps));
}
Tensors3 ln_bwd_kernel(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                          const at::Tensor& weight) {
  return to_tuple3(layer_norm_bwd(dy, x, mean, rstd, weight));
}
Tensors5 bdaln_fwd_kernel(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& residual,
                             const at::Tensor& weight, const at::Tensor& ln_bias, double p, double eps,
                             std::optional<int64_t> seed, int64_t offset) {
  return to_tuple5(bdaln_fwd(x, bias, residual, weight, ln_bias, p, eps, seed, offset));
}
Tensors5 bdaln_bwd_kernel(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& mean, const at::Tensor& rstd,
                             const at::Tensor& weight, bool has_bias, double p, const at::Tensor& rng_state) {
  return to_tuple5(bdaln_bwd(dy, h, mean, rstd, weight, has_bias, p, rng_state));
}

// -------- Meta kernels: the outputs' shapes and dtypes, in symbolic sizes (dynamic-shape tracing)

Tensors3 ln_fwd_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, double) {
  const c10::SymInt rows = x.sym_numel() / x.sym_size(-1);
  const auto stat = x.options().dtype(acc_type(x));
  return {at::empty_like(x), at::empty_symint({rows}, stat), at::empty_symint({rows}, stat)};
}
Tensors3 ln_bwd_meta(const at::Tensor&, const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                        const at::Tensor& weight) {
  return {at::empty_like(x), at::empty_like(weight), at::empty_like(weight)};
}
Tensors5 bdaln_fwd_meta(const at::Tensor& x, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, double p, double, std::optional<int64_t>, int64_t) {
  const c10::SymInt rows = x.sym_numel() / x.sym_size(-1);
  const auto stat = x.options().dtype(acc_type(x));
  return {at::empty_like(x), at::empty_like(x), at::empty_symint({rows}, stat), at::empty_symint({rows}, stat),
          at::empty({p > 0.0 ? 2 : 0}, x.options().dtype(at::kLong))};
}
Tensors5 bdaln_bwd_meta(const at::Tensor&, const at::Tensor& h, const at::Tensor&, const at::Tensor&,
                           const at::Tensor& weight, bool has_bias, double p, const at::Tensor&) {
  // the dense bias's gradient: in the weights' dtype when they are h's bf16/fp16 (bf16 weights)
  const bool lp = weight.scalar_type() == h.scalar_type() &&
                  (h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kHalf);
  const auto acc = h.options().dtype(lp ? h.scalar_type() : acc_type(h));
  auto dx = p > 0.0 ? at::empty_like(h) : at::empty({0}, h.options());
  auto dbias = has_bias ? at::empty_symint({h.sym_size(-1)}, acc) : at::empty({0}, acc);
  return {at::empty_like(h), dx, at::empty_like(weight), at::empty_like(weight), dbias};
}

// -------- autograd

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the op's backend kernel, not this one again
    auto [y, mean, rstd] = ln_fwd_op().call(x, weight, bias, eps);
    ctx->save_for_backward({x, weight, mean, rstd});
    ctx->mark_non_differentiable({mean, rstd});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw, db] = ln_bwd_op().call(grads[0].contiguous(), saved[0], saved[2], saved[3], saved[1]);
    return {dx, dw, db, at::Tensor()};
  }
};

class BiasDropoutAddLayerNormFunction : public torch::autograd::Function<BiasDropoutAddLayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                               const at::Tensor& residual, const at::Tensor& weight, const at::Tensor& ln_bias,
                               double p, double eps, std::optional<int64_t> seed, int64_t offset) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, h, mean, rstd, rng_state] = bdaln_fwd_op().call(x, bias, residual, weight, ln_bias, p, eps, seed, offset);
    ctx->save_for_backward({h, weight, mean, rstd, rng_state});
    ctx->mark_non_differentiable({h, mean, rstd, rng_state});
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(has_bias ? bias->scalar_type() : at::kFloat);
    ctx->saved_data["p"] = p;
    return {y, h, mean, rstd, rng_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const double p = ctx->saved_data["p"].toDouble();
    auto [dh, dx, dw, dlnb, dbias] =
        bdaln_bwd_op().call(grads[0].contiguous(), saved[0], saved[2], saved[3], saved[1], has_bias, p, saved[4]);
    if (p == 0.0) dx = dh;  // no dropout: x and the residual get the same gradient
    at::Tensor dbias_out;
    if (has_bias) dbias_out = dbias.to(static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
    return {dx, dbias_out, dh, dw, dlnb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

Tensors3 ln_fwd_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  auto out = LayerNormFunction::apply(x, weight, bias, eps);
  return {out[0], out[1], out[2]};
}

Tensors5 bdaln_fwd_autograd(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& residual,
                               const at::Tensor& weight, const at::Tensor& ln_bias, double p, double eps,
                               std::optional<int64_t> seed, int64_t offset) {
  auto out = BiasDropoutAddLayerNormFunction::apply(x, bias, residual, weight, ln_bias, p, eps, seed, offset);
  return {out[0], out[1], out[2], out[3], out[4]};
}

// -------- autocast: the layer norms run in fp32, as torch's own layer_norm does on CUDA (the inputs
// arrive in mixed dtypes there, a bf16 GEMM output beside an fp32 residual, which the kernels reject).
// torch.library.register_autocast's rule: floating tensors of the autocast device, but float64, go to fp32.

const c10::DispatchKeySet kAutocastKeys({c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA});

at::Tensor to_fp32(const at::Tensor& t, c10::DeviceType device) {
  const bool eligible = t.defined() && t.is_floating_point() && t.device().type() == device &&
                        t.scalar_type() != at::kDouble;
  return eligible ? t.to(at::kFloat) : t;
}

template <c10::DeviceType device>
Tensors3 ln_fwd_autocast(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKeys);
  return ln_fwd_op().call(to_fp32(x, device), to_fp32(weight, device), to_fp32(bias, device), eps);
}

template <c10::DeviceType device>
Tensors5 bdaln_fwd_autocast(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& residual,
                               const at::Tensor& weight, const at::Tensor& ln_bias, double p, double eps,
                               std::optional<int64_t> seed, int64_t offset) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKeys);
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) bias32 = to_fp32(*bias, device);
  return bdaln_fwd_op().call(to_fp32(x, device), bias32, to_fp32(residual, device), to_fp32(weight, device),
                             to_fp32(ln_bias, device), p, eps, seed, offset);
}

}  // namespace
}  // namespace bertdist

TORCH_LIBRARY_FRAGMENT(BERTDIST_OP_NS, m) {
  m.def("layer_norm_fwd(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_bwd(Tensor grad_out, Tensor x, Tensor mean, Tensor rstd, Tensor weight) -> "
        "(Tensor, Tensor, Tensor)");
  // Without a seed its dropout may draw from the CUDA generator: the compiler must neither merge
  // nor recompute it (a recomputation would draw another mask).
  m.def("bias_dropout_add_layer_norm_fwd(Tensor x, Tensor? bias, Tensor residual, Tensor weight, Tensor ln_bias, "
        "float p, float eps, int? seed, int offset) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        {at::Tag::nondeterministic_seeded});
  m.def("bias_dropout_add_layer_norm_bwd(Tensor grad_out, Tensor h, Tensor mean, Tensor rstd, Tensor weight, "
        "bool has_bias, float p, Tensor rng_state) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

// The host functions pick the CPU or CUDA kernels by device (for _C_emu: the emulated CUDA kernels,
// on CPU tensors), so the one function serves each backend key.
TORCH_LIBRARY_IMPL(BERTDIST_OP_NS, CPU, m) {
  m.impl("layer_norm_fwd", &bertdist::ln_fwd_kernel);
  m.impl("layer_norm_bwd", &bertdist::ln_bwd_kernel);
  m.impl("bias_dropout_add_layer_norm_fwd", &bertdist::bdaln_fwd_kernel);
  m.impl("bias_dropout_add_layer_norm_bwd", &bertdist::bdaln_bwd_kernel);
}

#ifdef BERTDIST_WITH_CUDA
TORCH_LIBRARY_IMPL(BERTDIST_OP_NS, CUDA, m) {
  m.impl("layer_norm_fwd", &bertdist::ln_fwd_kernel);
  m.impl("layer_norm_bwd", &bertdist::ln_bwd_kernel);
  m.impl("bias_dropout_add_layer_norm_fwd", &bertdist::bdaln_fwd_kernel);
  m.impl("bias_dropout_add_layer_norm_bwd", &bertdist::bdaln_bwd_kernel);
}
#endif

TORCH_LIBRARY_IMPL(BERTDIST_OP_NS, Meta, m) {
  m.impl("layer_norm_fwd", &bertdist::ln_fwd_meta);
  m.impl("layer_norm_bwd", &bertdist::ln_bwd_meta);
  m.impl("bias_dropout_add_layer_norm_fwd", &bertdist::bdaln_fwd_meta);
  m.impl("bias_dropout_add_layer_norm_bwd", &bertdist::bdaln_bwd_meta);
}

TORCH_LIBRARY_IMPL(BERTDIST_OP_NS, Autograd, m) {
  m.impl("layer_norm_fwd", &bertdist::ln_fwd_autograd);
  m.impl("bias_dropout_add_layer_norm_fwd", &bertdist::bdaln_fwd_autograd);
}

TORCH_LIBRARY_IMPL(BERTDIST_OP_NS, AutocastCPU, m) {
  m.impl("layer_norm_fwd", &bertdist::ln_fwd_autocast<c10::DeviceType::CPU>);
  m.impl("bias_dropout_add_layer_norm_fwd", &bertdist::bdaln_fwd_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(BERTDIST_OP_NS, AutocastCUDA, m) {
  m.impl("layer_norm_fwd", &bertdist::ln_fwd_autocast<c10::DeviceType::CUDA>);
  m.impl("bias_dropout_add_layer_norm_fwd", &bertdist::bdaln_fwd_autocast<c10::DeviceType::CUDA>);
}


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace bertdist;
  namespace py = pybind11;
#ifdef BERTDIST_EMU
  m.doc() = "bertdist's CUDA kernels run on CPU tensors by the SIMT emulator (csrc/emu): same entry points as _C";
  m.def("emulator_counts", &emulator_counts, "What the emulator has run since the last reset");
  m.def("reset_emulator_counts", &bdemu::reset_counts);
  m.def("run_checks", &run_checks, py::arg("suite") = "all", py::arg("filter") = "", py::arg("keep_going") = false,
        py::arg("quick") = false, "The emulator's C++ checks (csrc/emu/checks.h)");
#else
  m.doc() = "bertdist fused kernels: layer norm, bias+dropout+residual+layer norm, attention, flat LAMB/AdamW (CPU and CUDA)";
#endif
  // The layer-norm family is registered with the dispatcher above (torch.ops.<namespace>.*), not here.
  m.def("attention_fwd", &attention_fwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("key_padding_mask"),
        py::arg("scale"), py::arg("p"), py::arg("seed"), py::arg("offset"));
  m.def("attention_bwd", &attention_bwd, py::arg("grad_out"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("stats"), py::arg("key_padding_mask"), py::arg("scale"), py::arg("p"),
        py::arg("rng_state"));
  m.def("varlen_attention_fwd", &varlen_attention_fwd, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("scale"), py::arg("p"), py::arg("seed"),
        py::arg("offset"));
  m.def("varlen_attention_bwd", &varlen_attention_bwd, py::arg("grad_out"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("stats"), py::arg("cu_seqlens"), py::arg("max_seqlen"),
        py::arg("scale"), py::arg("p"), py::arg("rng_state"));
  m.def("hidden_keep_mask", &hidden_keep_mask, py::arg("rows"), py::arg("hidden"), py::arg("p"), py::arg("seed"),
        py::arg("offset"), "Keep mask [rows, hidden] of the fused layer-norm dropout (CPU)");
  m.def("attention_keep_mask", &attention_keep_mask, py::arg("batch_heads"), py::arg("rows"), py::arg("cols"),
        py::arg("p"), py::arg("seed"), py::arg("offset"),
        "Keep mask [batch*heads, rows, cols] of the fused attention dropout (CPU); varlen uses per-sequence rows/cols");
  m.def("flat_grad_norm", &flat_grad_norm, py::arg("grads"), py::arg("table"), py::arg("num_chunks"),
        py::arg("chunk_size"), py::arg("max_norm"),
        "(per-segment sums of g^2, [global norm, clip coefficient]) of a flat gradient buffer");
  m.def("flat_lamb_step", &flat_lamb_step, py::arg("params"), py::arg("grads"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("table"), py::arg("num_chunks"), py::arg("chunk_size"),
        py::arg("weight_decay"), py::arg("stats"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("bias_correction"), py::arg("max_coeff"), py::arg("min_coeff"), py::arg("params_bf16"),
        "One LAMB step over flat buffers, in place; grads scaled by stats[1]; params_bf16 (empty: none) gets a bf16 copy");
  m.def("flat_adamw_step", &flat_adamw_step, py::arg("params"), py::arg("grads"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("table"), py::arg("num_chunks"), py::arg("chunk_size"),
        py::arg("weight_decay"), py::arg("stats"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("params_bf16"),
        "One AdamW step (torch.optim.AdamW's) over flat buffers, in place; grads scaled by stats[1]; params_bf16 as LAMB's");
  m.def("with_cuda", &with_cuda, "True when this build contains the CUDA kernels");
  m.def("build_info", &build_info, "How this module was built (CUDA archs, OpenMP, notes)");
}
