// CPU twin of cuda_flat_optim.cu: the same chunks (flat_segments.h), the same per-element
// arithmetic in fp32, the same order of the sums that cross chunks (per-chunk partials, then
// over the chunks in index order). Within a chunk the sum is sequential in double where the GPU
// takes a tree in fp32: the two agree to fp32 rounding, not bit for bit. Chunks are split across
// OpenMP threads; each writes only its own chunk, so the result does not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_common.h"
#include "flat_segments.h"

namespace bertdist {
namespace {

inline float lamb_direction(float m, float v, float w, float wd, const FlatStepParams& p) {
  return (m / p.bc1) / (std::sqrt(v / p.bc2) + p.eps) + wd * w;
}

// The updated parameter, and its bf16 copy (round to nearest even, as the GPU's) where one is kept.
inline void store_param(const FlatStepParams& p, int64_t i, float w) {
  p.p[i] = w;
  if (p.p_bf16) static_cast<c10::BFloat16*>(p.p_bf16)[i] = c10::BFloat16(w);
}

template <typename F>
void dispatch_grad_dtype(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::BF16: f(c10::BFloat16{}); break;
    default: throw std::runtime_error(std::string(op) + ": the gradient must be float32 or bfloat16");
  }
}

template <typename G>
void norm_impl(const FlatNormParams& p) {
  const G* g = static_cast<const G*>(p.g);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < p.seg.chunks; ++c) {
    const ChunkRange r = chunk_range(p.seg, c);
    double s = 0;
    for (int64_t i = r.begin; i < r.end; ++i) {
      const float x = static_cast<float>(g[i]);
      s += static_cast<double>(x) * x;
    }
    p.partial[c] = static_cast<float>(s);
  }
  float total = 0.f;
  for (int64_t s = 0; s < p.seg.segments; ++s) {
    float a = 0.f;
    for (int64_t c = p.seg.chunk_offsets[s]; c < p.seg.chunk_offsets[s + 1]; ++c) a += p.partial[c];
    p.seg_norm2[s] = a;
    total += a;
  }
  const float norm = std::sqrt(total);
  p.stats[0] = norm;
  p.stats[1] = clip_coefficient(norm, p.max_norm);
}

template <typename G>
void lamb_impl(const FlatStepParams& p) {
  const G* g = static_cast<const G*>(p.g);
  const float clip = p.stats[1];
  float* pp_part = p.partial;
  float* uu_part = p.partial + p.seg.chunks;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < p.seg.chunks; ++c) {
    const ChunkRange r = chunk_range(p.seg, c);
    const float wd = p.weight_decay[r.seg];
    double pp = 0, uu = 0;
    for (int64_t i = r.begin; i < r.end; ++i) {
      const float gi = static_cast<float>(g[i]) * clip, w = p.p[i];
      const float m = p.beta1 * p.m[i] + p.one_minus_beta1 * gi;
      const float v = p.beta2 * p.v[i] + p.one_minus_beta2 * gi * gi;
      p.m[i] = m;
      p.v[i] = v;
      const float u = lamb_direction(m, v, w, wd, p);
      pp += static_cast<double>(w) * w;
      uu += static_cast<double>(u) * u;
    }
    pp_part[c] = static_cast<float>(pp);
    uu_part[c] = static_cast<float>(uu);
  }
  // The trust ratio of each segment, from its chunks' partials in chunk order.
  std::vector<float> trust(static_cast<size_t>(p.seg.segments));
  for (int64_t s = 0; s < p.seg.segments; ++s) {
    float pp = 0.f, uu = 0.f;
    for (int64_t c = p.seg.chunk_offsets[s]; c < p.seg.chunk_offsets[s + 1]; ++c) {
      pp += pp_part[c];
      uu += uu_part[c];
    }
    const float w_norm = std::sqrt(pp), u_norm = std::sqrt(uu);
    trust[s] = (w_norm > 0.f && u_norm > 0.f) ? std::min(std::max(w_norm / u_norm, p.min_coeff), p.max_coeff) : 1.f;
  }
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < p.seg.chunks; ++c) {
    const ChunkRange r = chunk_range(p.seg, c);
    const float wd = p.weight_decay[r.seg], t = trust[r.seg];
    for (int64_t i = r.begin; i < r.end; ++i) {
      const float w = p.p[i];
      store_param(p, i, w - p.lr * (t * lamb_direction(p.m[i], p.v[i], w, wd, p)));
    }
  }
}

template <typename G>
void adamw_impl(const FlatStepParams& p) {
  const G* g = static_cast<const G*>(p.g);
  const float clip = p.stats[1];
  const float step_size = p.lr / p.bc1, bc2_sqrt = std::sqrt(p.bc2);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < p.seg.chunks; ++c) {
    const ChunkRange r = chunk_range(p.seg, c);
    const float decay = 1.f - p.lr * p.weight_decay[r.seg];
    for (int64_t i = r.begin; i < r.end; ++i) {
      const float gi = static_cast<float>(g[i]) * clip;
      float m = p.m[i];
      m += p.one_minus_beta1 * (gi - m);
      const float v = p.beta2 * p.v[i] + p.one_minus_beta2 * gi * gi;
      p.m[i] = m;
      p.v[i] = v;
      store_param(p, i, p.p[i] * decay - step_size * (m / (std::sqrt(v) / bc2_sqrt + p.eps)));
    }
  }
}

}  // namespace

void flat_norm_cpu(const FlatNormParams& p, DType g) {
  dispatch_grad_dtype(g, "flat_norm_cpu", [&](auto gv) { norm_impl<decltype(gv)>(p); });
}

void flat_lamb_cpu(const FlatStepParams& p, DType g) {
  dispatch_grad_dtype(g, "flat_lamb_cpu", [&](auto gv) { lamb_impl<decltype(gv)>(p); });
}

void flat_adamw_cpu(const FlatStepParams& p, DType g) {
  dispatch_grad_dtype(g, "flat_adamw_cpu", [&](auto gv) { adamw_impl<decltype(gv)>(p); });
}

}  // namespace bertdist
