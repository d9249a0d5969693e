// CPU LayerNorm and fused bias + dropout + residual + LayerNorm, forward and backward.
// Rows are split across OpenMP threads; the per-row loops are plain unit-stride loops over
// fp32 (or fp64) buffers that the compiler vectorises (-O3). Dropout uses the same Philox
// counters as the CUDA kernel, so both drop the same elements for a given seed and offset.
#include <omp.h>

#include <cmath>
#include <vector>

#include "cpu_common.h"
#include "philox.h"

namespace bertdist {
namespace {

// Fills keep[c] (1/0) for the row's hidden-state dropout mask.
inline void hidden_keep_row(uint64_t seed, uint32_t offset, uint32_t threshold, int64_t row,
                            int64_t hidden, uint8_t* keep) {
  const uint64_t e0 = static_cast<uint64_t>(row) * static_cast<uint64_t>(hidden);
  int64_t c = 0;
  while (c < hidden) {
    const uint64_t e = e0 + c;
    Philox4 r = hidden_draws(seed, offset, e >> 2);
    for (uint32_t lane = static_cast<uint32_t>(e & 3); lane < 4 && c < hidden; ++lane, ++c)
      keep[c] = r.v[lane] < threshold;
  }
}

// W: the parameters' dtype (gamma, beta, dense bias): A, or T for low-precision parameters.
template <typename T, typename A, typename W>
void ln_fwd_impl(const LnFwdParams& p) {
  const int64_t H = p.hidden;
  const uint32_t threshold = keep_threshold(p.p);
  const A inv_keep = p.p < 1.f ? A(1) / (A(1) - A(p.p)) : A(0);
  const W* bias = static_cast<const W*>(p.bias);
  const W* gamma = static_cast<const W*>(p.gamma);
  const W* beta = static_cast<const W*>(p.beta);
#pragma omp parallel
  {
    std::vector<A> v(H);
    std::vector<uint8_t> keep(p.dropout ? H : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      const T* x = static_cast<const T*>(p.x) + r * H;
      for (int64_t c = 0; c < H; ++c) v[c] = static_cast<A>(x[c]);
      if (bias)
        for (int64_t c = 0; c < H; ++c) v[c] += static_cast<A>(bias[c]);
      if (p.dropout) {
        hidden_keep_row(p.rng.seed, p.rng.offset, threshold, r, H, keep.data());
        for (int64_t c = 0; c < H; ++c) v[c] = keep[c] ? v[c] * inv_keep : A(0);
      }
      if (p.residual) {
        const T* res = static_cast<const T*>(p.residual) + r * H;
        for (int64_t c = 0; c < H; ++c) v[c] += static_cast<A>(res[c]);
      }
      if (p.h) {
        // The backward recomputes from the stored h, so the statistics use its rounded value.
        T* h = static_cast<T*>(p.h) + r * H;
        for (int64_t c = 0; c < H; ++c) {
          h[c] = static_cast<T>(v[c]);
          v[c] = static_cast<A>(h[c]);
        }
      }
      A sum = 0;
      for (int64_t c = 0; c < H; ++c) sum += v[c];
      const A mean = sum / A(H);
      A sq = 0;
      for (int64_t c = 0; c < H; ++c) sq += (v[c] - mean) * (v[c] - mean);
      const A rstd = A(1) / std::sqrt(sq / A(H) + A(p.eps));
      T* y = static_cast<T*>(p.y) + r * H;
      for (int64_t c = 0; c < H; ++c)
        y[c] = static_cast<T>((v[c] - mean) * rstd * static_cast<A>(gamma[c]) + static_cast<A>(beta[c]));
      static_cast<A*>(p.mean)[r] = mean;
      static_cast<A*>(p.rstd)[r] = rstd;
    }
  }
}

template <typename T, typename A, typename W>
void ln_bwd_impl(const LnBwdParams& p) {
  const int64_t H = p.hidden;
  const uint32_t threshold = keep_threshold(p.p);
  const A inv_keep = p.p < 1.f ? A(1) / (A(1) - A(p.p)) : A(0);
  const W* gamma = static_cast<const W*>(p.gamma);
  const int nthreads = omp_get_max_threads();
  // Per-thread column partial sums, reduced at the end: [thread][3][H].
  std::vector<A> partial(static_cast<size_t>(nthreads) * 3 * H, A(0));
#pragma omp parallel num_threads(nthreads)
  {
    A* dg = partial.data() + static_cast<size_t>(omp_get_thread_num()) * 3 * H;
    A* db = dg + H;
    A* dbias = db + H;
    std::vector<A> xhat(H), g(H);
    std::vector<uint8_t> keep(p.dropout ? H : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      const T* dy = static_cast<const T*>(p.dy) + r * H;
      const T* h = static_cast<const T*>(p.h) + r * H;
      const A mean = static_cast<const A*>(p.mean)[r];
      const A rstd = static_cast<const A*>(p.rstd)[r];
      A s1 = 0, s2 = 0;
      for (int64_t c = 0; c < H; ++c) {
        const A d = static_cast<A>(dy[c]);
        xhat[c] = (static_cast<A>(h[c]) - mean) * rstd;
        g[c] = d * static_cast<A>(gamma[c]);
        s1 += g[c];
        s2 += g[c] * xhat[c];
        dg[c] += d * xhat[c];
        db[c] += d;
      }
      s1 /= A(H);
      s2 /= A(H);
      T* dh = static_cast<T*>(p.dh) + r * H;
      for (int64_t c = 0; c < H; ++c) g[c] = rstd * (g[c] - s1 - xhat[c] * s2);  // g := dh
      for (int64_t c = 0; c < H; ++c) dh[c] = static_cast<T>(g[c]);
      if (p.dropout) {
        hidden_keep_row(p.rng.seed, p.rng.offset, threshold, r, H, keep.data());
        T* dx = static_cast<T*>(p.dx) + r * H;
        for (int64_t c = 0; c < H; ++c) g[c] = keep[c] ? g[c] * inv_keep : A(0);
        for (int64_t c = 0; c < H; ++c) dx[c] = static_cast<T>(g[c]);
      }
      for (int64_t c = 0; c < H; ++c) dbias[c] += g[c];
    }
  }
  W* out[3] = {static_cast<W*>(p.dgamma), static_cast<W*>(p.dbeta), static_cast<W*>(p.dbias)};
  for (int k = 0; k < 3; ++k) {
    if (!out[k]) continue;
    for (int64_t c = 0; c < H; ++c) {
      A s = 0;
      for (int t = 0; t < nthreads; ++t) s += partial[(static_cast<size_t>(t) * 3 + k) * H + c];
      out[k][c] = static_cast<W>(s);  // summed in A, rounded once
    }
  }
}

}  // namespace

void ln_fwd_cpu(const LnFwdParams& p, DType t) {
  dispatch_cpu_dtype(t, "ln_fwd_cpu", [&](auto tv, auto av) {
    using T = decltype(tv);
    using A = decltype(av);
    if (p.params_lp)
      ln_fwd_impl<T, A, T>(p);
    else
      ln_fwd_impl<T, A, A>(p);
  });
}

void ln_bwd_cpu(const LnBwdParams& p, DType t) {
  dispatch_cpu_dtype(t, "ln_bwd_cpu", [&](auto tv, auto av) {
    using T = decltype(tv);
    using A = decltype(av);
    if (p.params_lp)
      ln_bwd_impl<T, A, T>(p);
    else
      ln_bwd_impl<T, A, A>(p);
  });
}

}  // namespace bertdist
