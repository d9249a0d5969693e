// Raw-pointer interface between the pybind11 host functions (bindings.cpp, which own all
// tensor checks and allocation) and the kernels (cpu_*.cpp, cuda_*.cu). Keeping torch
// headers out of the kernel files makes them quick to compile, which matters most for nvcc.
#pragma once
#include <cstdint>

#ifdef BERTDIST_WITH_CUDA
// A plain struct (no other torch headers): the CUDA generator's graph-safe Philox state.
#include <ATen/cuda/PhiloxCudaState.h>
#endif

namespace bertdist {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, F64 = 3 };

// "acc" below is the accumulation type: double for F64 tensors, float for every other dtype.
// Weights, statistics and column sums are passed in it (the host casts the small weight
// vectors), so statistics stay fp32 for fp16/bf16 and gradcheck in float64 is exact.

// Dropout's Philox key and counter word (philox.h), and where a kernel takes them from.
// CPU kernels use seed/offset. A CUDA kernel uses, first match: `saved` (a device int64 [2]
// (seed, offset) that a forward recorded: the backward's source, so it regenerates the same
// mask), the CUDA generator's state when `from_generator` (unpacked on the device, so a
// captured CUDA graph draws a fresh pair at every replay), else seed/offset. A CUDA forward
// records the pair it used at `save_to`.
struct DropoutRng {
  uint64_t seed = 0;
  uint32_t offset = 0;
  const int64_t* saved = nullptr;
  int64_t* save_to = nullptr;
#ifdef BERTDIST_WITH_CUDA
  bool from_generator = false;
  at::PhiloxCudaState generator;
#endif
};

// LN(residual + dropout(x + bias)); bias, residual and h may be null (plain LayerNorm).
// x, residual, y and h share x's dtype; mean and rstd are acc; bias, gamma and beta are acc, or
// x's dtype when params_lp (bf16/fp16 x with parameters of the same dtype: no cast per call).
struct LnFwdParams {
  const void* x = nullptr;
  const void* bias = nullptr;
  const void* residual = nullptr;
  const void* gamma = nullptr;
  const void* beta = nullptr;
  void* y = nullptr;
  void* h = nullptr;       // pre-norm sum, saved for the backward; null for plain LN
  void* mean = nullptr;    // [rows]
  void* rstd = nullptr;    // [rows]
  int64_t rows = 0;
  int64_t hidden = 0;
  float eps = 1e-12f;
  bool dropout = false;    // false: p and rng are ignored
  float p = 0.f;
  DropoutRng rng;
  bool params_lp = false;  // bias, gamma, beta in x's dtype (else acc)
};

// Backward of the above. h is the saved pre-norm input (x itself for plain LN).
// dx (gradient of x + bias before dropout) is only written when dropout is on; otherwise
// it equals dh. The column sums (acc) are final results.
struct LnBwdParams {
  const void* dy = nullptr;
  const void* h = nullptr;
  const void* mean = nullptr;
  const void* rstd = nullptr;
  const void* gamma = nullptr;
  void* dh = nullptr;
  void* dx = nullptr;          // null unless dropout
  void* dgamma = nullptr;     // [hidden]
  void* dbeta = nullptr;      // [hidden]
  void* dbias = nullptr;      // [hidden] sum over rows of dx; null when there is no bias
  int64_t rows = 0;
  int64_t hidden = 0;
  bool dropout = false;
  float p = 0.f;
  DropoutRng rng;
  bool params_lp = false;     // gamma read, and dgamma/dbeta/dbias written, in h's dtype (else acc)
};

// A [batch, heads, seq, head_dim] view with unit stride on head_dim. For the varlen layout
// [tokens, heads, head_dim] stride_b is unused and stride_s is the token stride.
struct HeadTensor {
  void* ptr = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_s = 0;
};

// Row statistics of the softmax, saved by the forward for the backward's recomputation:
// stats[0][r] = row max m, stats[1][r] = 1 / sum_j exp(s_j - m), r = stat_row(b, h, i):
// padded (b * heads + h) * seq + i; varlen h * total_tokens + cu_seqlens[b] + i.
struct AttnParams {
  HeadTensor q, k, v, o;
  HeadTensor dout, dq, dk, dv;      // backward only
  void* stats = nullptr;            // acc [2, rows]
  void* delta = nullptr;            // acc backward workspace [rows]: rowsum(dO * O)
  const uint8_t* key_mask = nullptr;  // padded only: [batch, seq] (1 = real token), may be null
  int64_t mask_stride_b = 0;
  const int32_t* cu_seqlens = nullptr;  // varlen: [batch + 1]
  int64_t total_tokens = 0;             // varlen
  int batch = 0, heads = 0, seq = 0, head_dim = 0;  // seq: padded length or max_seqlen
  float scale = 1.f;
  bool dropout = false;
  float p = 0.f;
  DropoutRng rng;
};

// The flat-buffer optimizers (cpu_flat_optim.cpp, cuda_flat_optim.cu). Every parameter tensor
// lives back to back in one fp32 buffer per quantity (params, exp_avg, exp_avg_sq; the gradient
// fp32 or bf16). Segment s (one original tensor) is elements offsets[s] .. offsets[s + 1]; it is
// cut into chunks of at most chunk_size elements, numbered chunk_offsets[s] .. chunk_offsets[s + 1]
// (an empty segment has none). One CUDA block works on one chunk, so a chunk never spans two
// segments, and every sum is taken per chunk, then over the chunks in index order: the result
// does not depend on scheduling (no atomics).
struct FlatSegments {
  const int64_t* offsets = nullptr;        // [segments + 1]
  const int64_t* chunk_offsets = nullptr;  // [segments + 1]
  int64_t segments = 0;
  int64_t chunks = 0;
  int64_t chunk_size = 0;
};

// The gradient's norms: seg_norm2[s] = sum of g^2 over segment s, stats[0] = the global norm
// sqrt(sum over all), stats[1] = the clip coefficient min(1, max_norm / (norm + 1e-6)), 1 when
// max_norm <= 0. The updates read stats[1] on the device: no host sync.
struct FlatNormParams {
  FlatSegments seg;
  const void* g = nullptr;     // fp32 or bf16
  float* partial = nullptr;    // [chunks] workspace
  float* seg_norm2 = nullptr;  // [segments]
  float* stats = nullptr;      // [2]
  float max_norm = 0.f;
};

// One LAMB or AdamW step over the flat buffers, the gradient scaled by stats[1] first.
// bc1, bc2: the bias corrections 1 - beta^step (1 without bias correction).
struct FlatStepParams {
  FlatSegments seg;
  float* p = nullptr;
  const void* g = nullptr;              // fp32 or bf16
  float* m = nullptr;                   // exp_avg
  float* v = nullptr;                   // exp_avg_sq
  const float* weight_decay = nullptr;  // [segments]
  const float* stats = nullptr;         // [2], the norm pass's
  float* partial = nullptr;             // LAMB: [2][chunks] workspace (||p||^2, ||u||^2 per chunk)
  void* p_bf16 = nullptr;               // optional: receives the updated params rounded to bf16
  float lr = 0.f, beta1 = 0.f, beta2 = 0.f, eps = 0.f, bc1 = 1.f, bc2 = 1.f;
  // 1 - beta, rounded from double on the host: 1.f - 0.999f is 4.7e-5 away from 0.001f, as torch's is not
  float one_minus_beta1 = 1.f, one_minus_beta2 = 1.f;
  float max_coeff = 10.f, min_coeff = 0.01f;  // LAMB's trust-ratio clamp
};

// CPU kernels (always built).
void ln_fwd_cpu(const LnFwdParams& p, DType t);
void ln_bwd_cpu(const LnBwdParams& p, DType t);
void attn_fwd_cpu(const AttnParams& p, DType t);
void attn_bwd_cpu(const AttnParams& p, DType t);
// `g` is the gradient's dtype (F32 or BF16).
void flat_norm_cpu(const FlatNormParams& p, DType g);
void flat_lamb_cpu(const FlatStepParams& p, DType g);
void flat_adamw_cpu(const FlatStepParams& p, DType g);

// CUDA kernels (built when BERTDIST_WITH_CUDA); `stream` is a cudaStream_t.
// Each throws std::runtime_error on an unsupported shape or a launch error.
void ln_fwd_cuda(const LnFwdParams& p, DType t, void* stream);
int ln_bwd_cuda_parts(int64_t rows, int device);
void ln_bwd_cuda(const LnBwdParams& p, DType t, float* workspace, int parts, void* stream);
void attn_fwd_cuda(const AttnParams& p, DType t, void* stream);
void attn_bwd_cuda(const AttnParams& p, DType t, void* stream);
void flat_norm_cuda(const FlatNormParams& p, DType g, void* stream);
void flat_lamb_cuda(const FlatStepParams& p, DType g, void* stream);
void flat_adamw_cuda(const FlatStepParams& p, DType g, void* stream);

}  // namespace bertdist
