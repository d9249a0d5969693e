// CUDA LayerNorm and fused bias + dropout + residual + LayerNorm, forward and backward.
//
// One block per row; each thread owns NV vectors of VEC elements (16-byte accesses when the
// hidden size and pointers allow), keeps them in registers between the statistics and the
// output, and never re-reads global memory. Statistics are fp32. The backward walks a
// grid-stride set of rows per block, so each thread also accumulates its columns' gamma,
// beta and dense-bias gradients in registers; a second kernel sums the per-block partials
// (deterministic, no atomics). Dropout masks come from Philox counters (philox.h), so the
// backward regenerates the forward's mask (from the (seed, offset) the forward recorded) and
// matches the CPU kernel bit for bit.
//
// Rows the register-resident kernels cannot hold (more than 8 vectors per thread, as an odd
// hidden size above 8192 needs, or a layout whose registers exceed what the GPU can give a
// block of that many threads) go to the streaming kernels instead, which re-read the row from
// global memory rather than keep it in registers.
//
// The parameters (gamma, beta, the dense bias) and their gradients are fp32 (W = float), or in
// x's dtype (W = T) when the model's weights are bf16/fp16: read and written as they are, with no
// cast kernel per call; every sum is still fp32.
#include <algorithm>

#include "cuda_common.cuh"
#include "philox.h"

namespace bertdist {
namespace {

constexpr int kMaxThreads = 1024;

template <int VEC>
struct DropDraws {
  // keep[e] for elements e0 .. e0 + VEC - 1 of the flattened [rows, hidden] tensor.
  __device__ __forceinline__ static void fill(const uint64_t seed, const uint32_t offset, const uint32_t threshold,
                                              uint64_t e0, bool* keep) {
    uint64_t last = ~0ull;
    Philox4 r{};
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const uint64_t e = e0 + k;
      if ((e >> 2) != last) {
        last = e >> 2;
        r = hidden_draws(seed, offset, last);
      }
      keep[k] = r.v[e & 3] < threshold;
    }
  }
};

template <typename T, typename W, int VEC, int NV>
__global__ void ln_fwd_kernel(LnFwdParams p, uint32_t threshold, float inv_keep) {
  BD_SHARED(float, red, 66);
  const DropoutKey key = p.dropout ? forward_dropout_key(p.rng) : DropoutKey{0, 0};
  const int64_t row = blockIdx.x;
  const int nvec = static_cast<int>(p.hidden / VEC);
  const int64_t base = row * p.hidden;
  const W* gamma = static_cast<const W*>(p.gamma);
  const W* beta = static_cast<const W*>(p.beta);
  const W* bias = static_cast<const W*>(p.bias);
  float v[NV][VEC];
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    const int vi = threadIdx.x + n * blockDim.x;
    if (vi >= nvec) continue;
    const int64_t off = base + static_cast<int64_t>(vi) * VEC;
    Vec<T, VEC> xv = *reinterpret_cast<const Vec<T, VEC>*>(static_cast<const T*>(p.x) + off);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[n][k] = to_f(xv.v[k]) + (bias ? to_f(bias[vi * VEC + k]) : 0.f);
    if (p.dropout) {
      bool keep[VEC];
      DropDraws<VEC>::fill(key.seed, key.offset, threshold, static_cast<uint64_t>(off), keep);
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[n][k] = keep[k] ? v[n][k] * inv_keep : 0.f;
    }
    if (p.residual) {
      Vec<T, VEC> rv = *reinterpret_cast<const Vec<T, VEC>*>(static_cast<const T*>(p.residual) + off);
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[n][k] += to_f(rv.v[k]);
    }
    if (p.h) {
      // The backward recomputes from the stored h, so the statistics use its rounded value.
      Vec<T, VEC> hv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        hv.v[k] = from_f<T>(v[n][k]);
        v[n][k] = to_f(hv.v[k]);
      }
      *reinterpret_cast<Vec<T, VEC>*>(static_cast<T*>(p.h) + off) = hv;
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) sum += v[n][k];
  }
  const float mean = block_sum2(sum, 0.f, red).x / static_cast<float>(p.hidden);
  float sq = 0.f;
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    const int vi = threadIdx.x + n * blockDim.x;
    if (vi >= nvec) continue;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float d = v[n][k] - mean;
      sq += d * d;
    }
  }
  const float var = block_sum2(sq, 0.f, red).x / static_cast<float>(p.hidden);
  const float rstd = 1.f / sqrtf(var + p.eps);
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    const int vi = threadIdx.x + n * blockDim.x;
    if (vi >= nvec) continue;
    Vec<T, VEC> yv;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const int c = vi * VEC + k;
      yv.v[k] = from_f<T>((v[n][k] - mean) * rstd * to_f(gamma[c]) + to_f(beta[c]));
    }
    *reinterpret_cast<Vec<T, VEC>*>(static_cast<T*>(p.y) + base + static_cast<int64_t>(vi) * VEC) = yv;
  }
  if (threadIdx.x == 0) {
    static_cast<float*>(p.mean)[row] = mean;
    static_cast<float*>(p.rstd)[row] = rstd;
  }
}

// ws layout: [3][parts][hidden] partial column sums of (dgamma, dbeta, dbias).
template <typename T, typename W, int VEC, int NV>
__global__ void ln_bwd_kernel(LnBwdParams p, float* ws, int parts, uint32_t threshold, float inv_keep) {
  BD_SHARED(float, red, 66);
  const DropoutKey key = p.dropout ? dropout_key(p.rng) : DropoutKey{0, 0};
  const int nvec = static_cast<int>(p.hidden / VEC);
  const W* gamma = static_cast<const W*>(p.gamma);
  const float inv_h = 1.f / static_cast<float>(p.hidden);
  float dg[NV][VEC], db[NV][VEC], dbias[NV][VEC];
#pragma unroll
  for (int n = 0; n < NV; ++n)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dg[n][k] = db[n][k] = dbias[n][k] = 0.f;

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t base = row * p.hidden;
    const float mean = static_cast<const float*>(p.mean)[row];
    const float rstd = static_cast<const float*>(p.rstd)[row];
    float xh[NV][VEC], g[NV][VEC];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int vi = threadIdx.x + n * blockDim.x;
      if (vi >= nvec) continue;
      const int64_t off = base + static_cast<int64_t>(vi) * VEC;
      Vec<T, VEC> dyv = *reinterpret_cast<const Vec<T, VEC>*>(static_cast<const T*>(p.dy) + off);
      Vec<T, VEC> hv = *reinterpret_cast<const Vec<T, VEC>*>(static_cast<const T*>(p.h) + off);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float dy = to_f(dyv.v[k]);
        xh[n][k] = (to_f(hv.v[k]) - mean) * rstd;
        g[n][k] = dy * to_f(gamma[vi * VEC + k]);
        s1 += g[n][k];
        s2 += g[n][k] * xh[n][k];
        dg[n][k] += dy * xh[n][k];
        db[n][k] += dy;
      }
    }
    const float2 s = block_sum2(s1, s2, red);
    const float m1 = s.x * inv_h, m2 = s.y * inv_h;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int vi = threadIdx.x + n * blockDim.x;
      if (vi >= nvec) continue;
      const int64_t off = base + static_cast<int64_t>(vi) * VEC;
      Vec<T, VEC> dhv;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        g[n][k] = rstd * (g[n][k] - m1 - xh[n][k] * m2);
        dhv.v[k] = from_f<T>(g[n][k]);
      }
      *reinterpret_cast<Vec<T, VEC>*>(static_cast<T*>(p.dh) + off) = dhv;
      if (p.dropout) {
        bool keep[VEC];
        DropDraws<VEC>::fill(key.seed, key.offset, threshold, static_cast<uint64_t>(off), keep);
        Vec<T, VEC> dxv;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          g[n][k] = keep[k] ? g[n][k] * inv_keep : 0.f;
          dxv.v[k] = from_f<T>(g[n][k]);
        }
        *reinterpret_cast<Vec<T, VEC>*>(static_cast<T*>(p.dx) + off) = dxv;
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) dbias[n][k] += g[n][k];
    }
  }
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    const int vi = threadIdx.x + n * blockDim.x;
    if (vi >= nvec) continue;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const int64_t c = static_cast<int64_t>(vi) * VEC + k;
      ws[(0 * static_cast<int64_t>(parts) + blockIdx.x) * p.hidden + c] = dg[n][k];
      ws[(1 * static_cast<int64_t>(parts) + blockIdx.x) * p.hidden + c] = db[n][k];
      ws[(2 * static_cast<int64_t>(parts) + blockIdx.x) * p.hidden + c] = dbias[n][k];
    }
  }
}

// h = residual + dropout(x + bias) at flat element e = base + c, in fp32 (x itself for plain LN).
template <typename T, typename W>
__device__ __forceinline__ float pre_norm(const LnFwdParams& p, const DropoutKey& key, uint32_t threshold,
                                          float inv_keep, int64_t base, int64_t c) {
  const W* bias = static_cast<const W*>(p.bias);
  float v = to_f(static_cast<const T*>(p.x)[base + c]) + (bias ? to_f(bias[c]) : 0.f);
  if (p.dropout) {
    const uint64_t e = static_cast<uint64_t>(base + c);
    v = hidden_draws(key.seed, key.offset, e >> 2).v[e & 3] < threshold ? v * inv_keep : 0.f;
  }
  if (p.residual) v += to_f(static_cast<const T*>(p.residual)[base + c]);
  return v;
}

// The forward for rows too wide for ln_fwd_kernel: one block per row, three passes over it (sum,
// squared deviations, output). The first pass stores h; the later ones read it back (the rounded
// values the statistics and the backward use) or, for plain LN, re-read x.
template <typename T, typename W>
__global__ void __launch_bounds__(kMaxThreads) ln_fwd_stream_kernel(LnFwdParams p, uint32_t threshold,
                                                                     float inv_keep) {
  BD_SHARED(float, red, 66);
  const DropoutKey key = p.dropout ? forward_dropout_key(p.rng) : DropoutKey{0, 0};
  const int64_t row = blockIdx.x, base = row * p.hidden;
  T* h = p.h ? static_cast<T*>(p.h) + base : nullptr;
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < p.hidden; c += blockDim.x) {
    float v = pre_norm<T, W>(p, key, threshold, inv_keep, base, c);
    if (h) {
      h[c] = from_f<T>(v);
      v = to_f(h[c]);
    }
    sum += v;
  }
  const auto value = [&](int64_t c) { return h ? to_f(h[c]) : pre_norm<T, W>(p, key, threshold, inv_keep, base, c); };
  const float mean = block_sum2(sum, 0.f, red).x / static_cast<float>(p.hidden);
  float sq = 0.f;
  for (int64_t c = threadIdx.x; c < p.hidden; c += blockDim.x) {
    const float d = value(c) - mean;
    sq += d * d;
  }
  const float var = block_sum2(sq, 0.f, red).x / static_cast<float>(p.hidden);
  const float rstd = 1.f / sqrtf(var + p.eps);
  const W* gamma = static_cast<const W*>(p.gamma);
  const W* beta = static_cast<const W*>(p.beta);
  T* y = static_cast<T*>(p.y) + base;
  for (int64_t c = threadIdx.x; c < p.hidden; c += blockDim.x)
    y[c] = from_f<T>((value(c) - mean) * rstd * to_f(gamma[c]) + to_f(beta[c]));
  if (threadIdx.x == 0) {
    static_cast<float*>(p.mean)[row] = mean;
    static_cast<float*>(p.rstd)[row] = rstd;
  }
}

// The backward for rows too wide for ln_bwd_kernel: the same grid-stride rows, two passes over
// each; the block's column partial sums accumulate in its slice of ws (each thread always owns
// the same columns, so no two threads touch one word).
template <typename T, typename W>
__global__ void __launch_bounds__(kMaxThreads) ln_bwd_stream_kernel(LnBwdParams p, float* ws, int parts,
                                                                     uint32_t threshold, float inv_keep) {
  BD_SHARED(float, red, 66);
  const DropoutKey key = p.dropout ? dropout_key(p.rng) : DropoutKey{0, 0};
  const int64_t H = p.hidden;
  const W* gamma = static_cast<const W*>(p.gamma);
  const float inv_h = 1.f / static_cast<float>(H);
  float* dg = ws + (0 * static_cast<int64_t>(parts) + blockIdx.x) * H;
  float* db = ws + (1 * static_cast<int64_t>(parts) + blockIdx.x) * H;
  float* dbias = ws + (2 * static_cast<int64_t>(parts) + blockIdx.x) * H;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) dg[c] = db[c] = dbias[c] = 0.f;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t base = row * H;
    const T* dy = static_cast<const T*>(p.dy) + base;
    const T* h = static_cast<const T*>(p.h) + base;
    const float mean = static_cast<const float*>(p.mean)[row];
    const float rstd = static_cast<const float*>(p.rstd)[row];
    float s1 = 0.f, s2 = 0.f;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float d = to_f(dy[c]), xh = (to_f(h[c]) - mean) * rstd, g = d * to_f(gamma[c]);
      s1 += g;
      s2 += g * xh;
      dg[c] += d * xh;
      db[c] += d;
    }
    const float2 s = block_sum2(s1, s2, red);
    const float m1 = s.x * inv_h, m2 = s.y * inv_h;
    for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float xh = (to_f(h[c]) - mean) * rstd;
      float g = rstd * (to_f(dy[c]) * to_f(gamma[c]) - m1 - xh * m2);
      static_cast<T*>(p.dh)[base + c] = from_f<T>(g);
      if (p.dropout) {
        const uint64_t e = static_cast<uint64_t>(base + c);
        g = hidden_draws(key.seed, key.offset, e >> 2).v[e & 3] < threshold ? g * inv_keep : 0.f;
        static_cast<T*>(p.dx)[base + c] = from_f<T>(g);
      }
      dbias[c] += g;
    }
  }
}

// out_k[c] = sum over parts of ws[k][part][c], for k = blockIdx.y (0: gamma, 1: beta, 2: bias),
// summed in fp32 and rounded once to the parameters' dtype W.
template <typename W>
__global__ void column_sum_kernel(const float* ws, int parts, int64_t hidden, W* dgamma, W* dbeta, W* dbias) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  W* out = blockIdx.y == 0 ? dgamma : (blockIdx.y == 1 ? dbeta : dbias);
  if (c >= hidden || out == nullptr) return;
  const float* src = ws + static_cast<int64_t>(blockIdx.y) * parts * hidden + c;
  float s = 0.f;
  for (int i = 0; i < parts; ++i) s += src[static_cast<int64_t>(i) * hidden];
  out[c] = from_f<W>(s);
}

bool aligned16(const void* ptr) { return ptr == nullptr || (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// The most threads (whole warps, at most kMaxThreads) this GPU launches `kernel` with: fewer
// when its registers do not fit (ptxas gives ln_bwd_kernel up to 130 registers at the wider
// layouts, and a block has 64K).
// Queried once per kernel and device.
template <typename K>
int max_threads(K kernel) {
  static PerKernelDevice cache;
  return cache.get(kernel, [&] {
    cudaFuncAttributes a;
    check_cuda(cudaFuncGetAttributes(&a, kernel), "cudaFuncGetAttributes");
    return std::min(kMaxThreads, a.maxThreadsPerBlock / 32 * 32);
  });
}

// Picks the vector width and vectors per thread, then calls f(VEC, NV, threads) as types and
// returns true; false when the row needs more than 8 vectors per thread (the streaming kernels' job).
template <typename T, typename F>
bool dispatch_layout(int64_t hidden, bool can_vectorize, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = can_vectorize && hidden % kVec == 0;
  const int64_t nvec = vec ? hidden / kVec : hidden;
  int nv = 1;
  while (nvec > static_cast<int64_t>(kMaxThreads) * nv) nv *= 2;
  if (nv > 8) return false;
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, ((nvec + nv - 1) / nv + 31) / 32 * 32));
  auto go = [&](auto vec_c) {
    constexpr int V = decltype(vec_c)::value;
    switch (nv) {
      case 1: f(std::integral_constant<int, V>{}, std::integral_constant<int, 1>{}, threads); break;
      case 2: f(std::integral_constant<int, V>{}, std::integral_constant<int, 2>{}, threads); break;
      case 4: f(std::integral_constant<int, V>{}, std::integral_constant<int, 4>{}, threads); break;
      default: f(std::integral_constant<int, V>{}, std::integral_constant<int, 8>{}, threads); break;
    }
  };
  if (vec)
    go(std::integral_constant<int, kVec>{});
  else
    go(std::integral_constant<int, 1>{});
  return true;
}

}  // namespace

// Calls f(W{}) with W the parameters' dtype: T when they are in x's dtype, else float.
template <typename T, typename F>
void dispatch_params(bool params_lp, F&& f) {
  if (params_lp)
    f(T{});
  else
    f(float{});
}

void ln_fwd_cuda(const LnFwdParams& p, DType t, void* stream) {
  const uint32_t threshold = keep_threshold(p.p);
  const float inv_keep = p.p < 1.f ? 1.f / (1.f - p.p) : 0.f;
  const bool can_vec = aligned16(p.x) && aligned16(p.residual) && aligned16(p.y) && aligned16(p.h);
  const auto s = static_cast<cudaStream_t>(stream);
  check_before_launch("ln_fwd_cuda");
  dispatch_cuda_dtype(t, "ln_fwd_cuda", [&](auto tv) {
    using T = decltype(tv);
    dispatch_params<T>(p.params_lp, [&](auto wv) {
      using W = decltype(wv);
      bool done = false;
      dispatch_layout<T>(p.hidden, can_vec, [&](auto vec_c, auto nv_c, int threads) {
        const auto kernel = ln_fwd_kernel<T, W, decltype(vec_c)::value, decltype(nv_c)::value>;
        if (threads > max_threads(kernel)) return;
        BD_LAUNCH(kernel, "ln_fwd_kernel", static_cast<unsigned>(p.rows), threads, 0, s)(p, threshold, inv_keep);
        check_launch("ln_fwd_kernel");
        done = true;
      });
      if (done) return;
      const auto kernel = ln_fwd_stream_kernel<T, W>;
      BD_LAUNCH(kernel, "ln_fwd_stream_kernel", static_cast<unsigned>(p.rows), max_threads(kernel), 0, s)(
          p, threshold, inv_keep);
      check_launch("ln_fwd_stream_kernel");
    });
  });
}

int ln_bwd_cuda_parts(int64_t rows, int device) {
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, 4 * static_cast<int64_t>(sms))));
}

void ln_bwd_cuda(const LnBwdParams& p, DType t, float* workspace, int parts, void* stream) {
  const uint32_t threshold = keep_threshold(p.p);
  const float inv_keep = p.p < 1.f ? 1.f / (1.f - p.p) : 0.f;
  const bool can_vec = aligned16(p.dy) && aligned16(p.h) && aligned16(p.dh) && aligned16(p.dx);
  auto s = static_cast<cudaStream_t>(stream);
  check_before_launch("ln_bwd_cuda");
  dispatch_cuda_dtype(t, "ln_bwd_cuda", [&](auto tv) {
    using T = decltype(tv);
    dispatch_params<T>(p.params_lp, [&](auto wv) {
      using W = decltype(wv);
      bool done = false;
      dispatch_layout<T>(p.hidden, can_vec, [&](auto vec_c, auto nv_c, int threads) {
        const auto kernel = ln_bwd_kernel<T, W, decltype(vec_c)::value, decltype(nv_c)::value>;
        if (threads > max_threads(kernel)) return;
        BD_LAUNCH(kernel, "ln_bwd_kernel", parts, threads, 0, s)(p, workspace, parts, threshold, inv_keep);
        check_launch("ln_bwd_kernel");
        done = true;
      });
      if (!done) {
        const auto kernel = ln_bwd_stream_kernel<T, W>;
        BD_LAUNCH(kernel, "ln_bwd_stream_kernel", parts, max_threads(kernel), 0, s)(p, workspace, parts, threshold,
                                                                                      inv_keep);
        check_launch("ln_bwd_stream_kernel");
      }
      dim3 grid(static_cast<unsigned>((p.hidden + 255) / 256), 3);
      const auto sums = column_sum_kernel<W>;
      BD_LAUNCH(sums, "column_sum_kernel", grid, 256, 0, s)(
          workspace, parts, p.hidden, static_cast<W*>(p.dgamma), static_cast<W*>(p.dbeta), static_cast<W*>(p.dbias));
      check_launch("column_sum_kernel");
    });
  });
}

}  // namespace bertdist
