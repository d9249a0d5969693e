// CUDA LAMB and AdamW over flat fp32 buffers (FlatSegments, ops.h): every launch covers every
// parameter tensor, so a step costs a fixed number of launches whatever the tensor count.
//
// One block per chunk (a chunk never spans two segments). Sums are block reductions written as
// one partial per chunk, then added over the chunks in index order by a later kernel: fixed
// order, no atomics, the same result on every run. Nothing is read back on the host.
//
//   gradient norm: flat_sumsq_kernel (partials) + flat_norm_finalize_kernel (one block: the
//                  per-segment sums, the global norm and the clip coefficient)
//   LAMB:          flat_lamb_moments_kernel (m, v; per-chunk ||p||^2 and ||u||^2) +
//                  flat_lamb_apply_kernel (per-segment trust ratio; p -= lr * r * u, u recomputed
//                  from the new m, v and the old p instead of kept in a scratch buffer)
//   AdamW:         flat_adamw_kernel
#include "cuda_common.cuh"
#include "flat_segments.h"

namespace bertdist {
namespace {

constexpr int kThreads = 256;

// LAMB's update direction for one element: bias-corrected Adam plus decoupled weight decay.
__device__ __forceinline__ float lamb_direction(float m, float v, float w, float wd, const FlatStepParams& p) {
  return (m / p.bc1) / (sqrtf(v / p.bc2) + p.eps) + wd * w;
}

// The updated parameter, and its bf16 copy where one is kept.
__device__ __forceinline__ void store_param(const FlatStepParams& p, int64_t i, float w) {
  p.p[i] = w;
  if (p.p_bf16) static_cast<__nv_bfloat16*>(p.p_bf16)[i] = from_f<__nv_bfloat16>(w);
}

template <typename G>
__global__ void __launch_bounds__(kThreads) flat_sumsq_kernel(FlatNormParams p) {
  BD_SHARED(float, red, 66);
  const ChunkRange r = chunk_range(p.seg, blockIdx.x);
  const G* g = static_cast<const G*>(p.g);
  float s = 0.f;
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const float x = to_f(g[i]);
    s += x * x;
  }
  s = block_sum2(s, 0.f, red).x;
  if (threadIdx.x == 0) p.partial[blockIdx.x] = s;
}

// One block: each thread adds its segments' chunk partials in chunk order.
__global__ void __launch_bounds__(kThreads) flat_norm_finalize_kernel(FlatNormParams p) {
  BD_SHARED(float, red, 66);
  float total = 0.f;
  for (int64_t s = threadIdx.x; s < p.seg.segments; s += blockDim.x) {
    float a = 0.f;
    for (int64_t c = p.seg.chunk_offsets[s]; c < p.seg.chunk_offsets[s + 1]; ++c) a += p.partial[c];
    p.seg_norm2[s] = a;
    total += a;
  }
  total = block_sum2(total, 0.f, red).x;
  if (threadIdx.x == 0) {
    const float norm = sqrtf(total);
    p.stats[0] = norm;
    p.stats[1] = clip_coefficient(norm, p.max_norm);
  }
}

template <typename G>
__global__ void __launch_bounds__(kThreads) flat_lamb_moments_kernel(FlatStepParams p) {
  BD_SHARED(float, red, 66);
  const ChunkRange r = chunk_range(p.seg, blockIdx.x);
  const G* g = static_cast<const G*>(p.g);
  const float wd = p.weight_decay[r.seg], clip = p.stats[1];
  float pp = 0.f, uu = 0.f;
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const float gi = to_f(g[i]) * clip, w = p.p[i];
    const float m = p.beta1 * p.m[i] + p.one_minus_beta1 * gi;
    const float v = p.beta2 * p.v[i] + p.one_minus_beta2 * gi * gi;
    p.m[i] = m;
    p.v[i] = v;
    const float u = lamb_direction(m, v, w, wd, p);
    pp += w * w;
    uu += u * u;
  }
  const float2 s = block_sum2(pp, uu, red);
  if (threadIdx.x == 0) {
    p.partial[blockIdx.x] = s.x;
    p.partial[p.seg.chunks + blockIdx.x] = s.y;
  }
}

// Every block of a segment sums the segment's chunk partials in the same order, so all of them
// get the same trust ratio without another launch.
__global__ void __launch_bounds__(kThreads) flat_lamb_apply_kernel(FlatStepParams p) {
  BD_SHARED(float, red, 66);
  const ChunkRange r = chunk_range(p.seg, blockIdx.x);
  float pp = 0.f, uu = 0.f;
  for (int64_t c = p.seg.chunk_offsets[r.seg] + threadIdx.x; c < p.seg.chunk_offsets[r.seg + 1]; c += blockDim.x) {
    pp += p.partial[c];
    uu += p.partial[p.seg.chunks + c];
  }
  const float2 s = block_sum2(pp, uu, red);
  const float w_norm = sqrtf(s.x), u_norm = sqrtf(s.y);
  const float trust = (w_norm > 0.f && u_norm > 0.f) ? fminf(fmaxf(w_norm / u_norm, p.min_coeff), p.max_coeff) : 1.f;
  const float wd = p.weight_decay[r.seg];
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const float w = p.p[i];
    store_param(p, i, w - p.lr * (trust * lamb_direction(p.m[i], p.v[i], w, wd, p)));
  }
}

// torch.optim.AdamW's arithmetic, element by element (decay first, then the Adam step).
template <typename G>
__global__ void __launch_bounds__(kThreads) flat_adamw_kernel(FlatStepParams p) {
  const ChunkRange r = chunk_range(p.seg, blockIdx.x);
  const G* g = static_cast<const G*>(p.g);
  const float decay = 1.f - p.lr * p.weight_decay[r.seg], clip = p.stats[1];
  const float step_size = p.lr / p.bc1, bc2_sqrt = sqrtf(p.bc2);
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const float gi = to_f(g[i]) * clip;
    float m = p.m[i];
    m += p.one_minus_beta1 * (gi - m);
    const float v = p.beta2 * p.v[i] + p.one_minus_beta2 * gi * gi;
    p.m[i] = m;
    p.v[i] = v;
    store_param(p, i, p.p[i] * decay - step_size * (m / (sqrtf(v) / bc2_sqrt + p.eps)));
  }
}

// The kernel instance for the gradient's dtype: pick(G{}) returns it.
template <typename F>
auto for_grad_dtype(DType t, const char* op, F&& pick) -> decltype(pick(float{})) {
  switch (t) {
    case DType::F32: return pick(float{});
    case DType::BF16: return pick(__nv_bfloat16{});
    default: throw std::runtime_error(std::string(op) + ": the gradient must be float32 or bfloat16");
  }
}

unsigned grid_of(const FlatSegments& s, const char* op) {
  if (s.chunks > 0x7FFFFFFFLL)
    throw std::runtime_error(std::string(op) + ": " + std::to_string(s.chunks) +
                             " chunks exceed the grid limit 2^31 - 1; use a larger chunk_size");
  return static_cast<unsigned>(s.chunks);
}

// One block per chunk.
template <typename P>
void launch_chunks(void (*kernel)(P), const char* name, const P& p, cudaStream_t s) {
  BD_LAUNCH(kernel, name, grid_of(p.seg, name), kThreads, 0, s)(p);
  check_launch(name);
}

}  // namespace

void flat_norm_cuda(const FlatNormParams& p, DType g, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  check_before_launch("flat_norm_cuda");
  if (p.seg.chunks > 0)
    launch_chunks(for_grad_dtype(g, "flat_norm_cuda", [](auto gv) { return flat_sumsq_kernel<decltype(gv)>; }),
                  "flat_sumsq_kernel", p, s);
  BD_LAUNCH(flat_norm_finalize_kernel, "flat_norm_finalize_kernel", 1, kThreads, 0, s)(p);
  check_launch("flat_norm_finalize_kernel");
}

void flat_lamb_cuda(const FlatStepParams& p, DType g, void* stream) {
  if (p.seg.chunks == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  check_before_launch("flat_lamb_cuda");
  launch_chunks(for_grad_dtype(g, "flat_lamb_cuda", [](auto gv) { return flat_lamb_moments_kernel<decltype(gv)>; }),
                "flat_lamb_moments_kernel", p, s);
  launch_chunks(flat_lamb_apply_kernel, "flat_lamb_apply_kernel", p, s);
}

void flat_adamw_cuda(const FlatStepParams& p, DType g, void* stream) {
  if (p.seg.chunks == 0) return;
  check_before_launch("flat_adamw_cuda");
  launch_chunks(for_grad_dtype(g, "flat_adamw_cuda", [](auto gv) { return flat_adamw_kernel<decltype(gv)>; }),
                "flat_adamw_kernel", p, static_cast<cudaStream_t>(stream));
}

}  // namespace bertdist
