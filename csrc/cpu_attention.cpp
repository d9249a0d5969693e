// CPU attention core: softmax(Q K^T * scale + key padding mask) -> dropout -> @ V, forward
// and backward, padded [B, H, S, D] (any strides with unit head_dim stride) or varlen.
//
// Same algorithm as the CUDA kernels, one (sequence, head) per OpenMP task: the forward keeps
// only one row of scores at a time and saves the row max and 1/rowsum; the backward
// recomputes each probability row from them (no S x S matrix is stored anywhere) and
// regenerates the dropout mask from the Philox counters.
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "philox.h"

namespace bertdist {
namespace {

struct SeqView {
  int64_t len;       // valid rows of this sequence
  int64_t tok0;      // varlen: first token; padded: 0
  int64_t stat0;     // first stats row
};

inline SeqView seq_view(const AttnParams& p, int b, int h) {
  if (p.cu_seqlens) {
    const int64_t s0 = p.cu_seqlens[b], s1 = p.cu_seqlens[b + 1];
    return {s1 - s0, s0, static_cast<int64_t>(h) * p.total_tokens + s0};
  }
  return {p.seq, 0, (static_cast<int64_t>(b) * p.heads + h) * p.seq};
}

template <typename T>
inline const T* row_ptr(const HeadTensor& t, const AttnParams& p, int b, int h, const SeqView& sv, int64_t i) {
  const int64_t base = p.cu_seqlens ? (sv.tok0 + i) * t.stride_s
                                    : b * t.stride_b + i * t.stride_s;
  return static_cast<const T*>(t.ptr) + base + h * t.stride_h;
}

template <typename T>
inline T* row_ptr_mut(const HeadTensor& t, const AttnParams& p, int b, int h, const SeqView& sv, int64_t i) {
  return const_cast<T*>(row_ptr<T>(t, p, b, h, sv, i));
}

// Copies len rows of a head into a dense [len, D] buffer in the accumulation type.
template <typename T, typename A>
void load_rows(const HeadTensor& t, const AttnParams& p, int b, int h, const SeqView& sv, A* out) {
  const int D = p.head_dim;
  for (int64_t i = 0; i < sv.len; ++i) {
    const T* src = row_ptr<T>(t, p, b, h, sv, i);
    for (int d = 0; d < D; ++d) out[i * D + d] = static_cast<A>(src[d]);
  }
}

template <typename A>
inline A dot(const A* a, const A* b, int n) {
  A s = 0;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Scores of query row i against all keys, masked keys at the dtype's lowest value (as the
// reference's additive mask does in fp32); returns the row max.
template <typename A>
A score_row(const AttnParams& p, int b, const A* qi, const A* K, int64_t len, A* s) {
  const int D = p.head_dim;
  const uint8_t* mask = p.key_mask ? p.key_mask + b * p.mask_stride_b : nullptr;
  const A lowest = std::numeric_limits<A>::lowest();
  A m = -std::numeric_limits<A>::infinity();
  for (int64_t j = 0; j < len; ++j) {
    A v = dot(qi, K + j * D, D) * A(p.scale);
    if (mask && !mask[j]) v = lowest;
    s[j] = v;
    m = v > m ? v : m;
  }
  return m;
}

template <typename T, typename A>
void attn_fwd_impl(const AttnParams& p) {
  const int D = p.head_dim;
  const uint32_t threshold = keep_threshold(p.p);
  const A inv_keep = p.p < 1.f ? A(1) / (A(1) - A(p.p)) : A(0);
  A* stats = static_cast<A*>(p.stats);
  const int64_t nstat = p.cu_seqlens ? static_cast<int64_t>(p.heads) * p.total_tokens
                                     : static_cast<int64_t>(p.batch) * p.heads * p.seq;
#pragma omp parallel
  {
    std::vector<A> Q, K, V, s, acc(D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < static_cast<int64_t>(p.batch) * p.heads; ++bh) {
      const int b = static_cast<int>(bh / p.heads), h = static_cast<int>(bh % p.heads);
      const SeqView sv = seq_view(p, b, h);
      if (sv.len <= 0) continue;
      Q.resize(sv.len * D); K.resize(sv.len * D); V.resize(sv.len * D); s.resize(sv.len);
      load_rows<T, A>(p.q, p, b, h, sv, Q.data());
      load_rows<T, A>(p.k, p, b, h, sv, K.data());
      load_rows<T, A>(p.v, p, b, h, sv, V.data());
      for (int64_t i = 0; i < sv.len; ++i) {
        const A m = score_row(p, b, Q.data() + i * D, K.data(), sv.len, s.data());
        A l = 0;
        for (int64_t j = 0; j < sv.len; ++j) {
          s[j] = std::exp(s[j] - m);
          l += s[j];
        }
        const A inv_l = A(1) / l;
        std::fill(acc.begin(), acc.end(), A(0));
        for (int64_t j = 0; j < sv.len; ++j) {
          A pj = s[j] * inv_l;
          if (p.dropout)
            pj = attn_keep(p.rng.seed, p.rng.offset, static_cast<uint32_t>(bh), static_cast<uint32_t>(i),
                           static_cast<uint32_t>(j), threshold) ? pj * inv_keep : A(0);
          const A* vj = V.data() + j * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) acc[d] += pj * vj[d];
        }
        T* o = row_ptr_mut<T>(p.o, p, b, h, sv, i);
        for (int d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d]);
        stats[sv.stat0 + i] = m;
        stats[nstat + sv.stat0 + i] = inv_l;
      }
    }
  }
}

template <typename T, typename A>
void attn_bwd_impl(const AttnParams& p) {
  const int D = p.head_dim;
  const uint32_t threshold = keep_threshold(p.p);
  const A inv_keep = p.p < 1.f ? A(1) / (A(1) - A(p.p)) : A(0);
  const A* stats = static_cast<const A*>(p.stats);
  const int64_t nstat = p.cu_seqlens ? static_cast<int64_t>(p.heads) * p.total_tokens
                                     : static_cast<int64_t>(p.batch) * p.heads * p.seq;
  const A scale = A(p.scale);
#pragma omp parallel
  {
    std::vector<A> Q, K, V, dO, dK, dV, s, dq(D), orow(D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < static_cast<int64_t>(p.batch) * p.heads; ++bh) {
      const int b = static_cast<int>(bh / p.heads), h = static_cast<int>(bh % p.heads);
      const SeqView sv = seq_view(p, b, h);
      if (sv.len <= 0) continue;
      const int64_t n = sv.len * D;
      Q.resize(n); K.resize(n); V.resize(n); dO.resize(n); s.resize(sv.len);
      dK.assign(n, A(0));
      dV.assign(n, A(0));
      load_rows<T, A>(p.q, p, b, h, sv, Q.data());
      load_rows<T, A>(p.k, p, b, h, sv, K.data());
      load_rows<T, A>(p.v, p, b, h, sv, V.data());
      load_rows<T, A>(p.dout, p, b, h, sv, dO.data());
      for (int64_t i = 0; i < sv.len; ++i) {
        const A* qi = Q.data() + i * D;
        const A* doi = dO.data() + i * D;
        // delta_i = rowsum(dO_i * O_i) = sum_j P_drop_ij (dO_i . v_j).
        // Same summation order as dp below, so a row whose probability mass sits on one key
        // gets dp - delta == 0 exactly, as the reference's softmax backward does.
        const T* oi = row_ptr<T>(p.o, p, b, h, sv, i);
        for (int d = 0; d < D; ++d) orow[d] = static_cast<A>(oi[d]);
        const A delta = dot(doi, orow.data(), D);
        score_row(p, b, qi, K.data(), sv.len, s.data());
        const A m = stats[sv.stat0 + i], inv_l = stats[nstat + sv.stat0 + i];
        std::fill(dq.begin(), dq.end(), A(0));
        for (int64_t j = 0; j < sv.len; ++j) {
          const A pj = std::exp(s[j] - m) * inv_l;
          const bool keep = !p.dropout ||
              attn_keep(p.rng.seed, p.rng.offset, static_cast<uint32_t>(bh), static_cast<uint32_t>(i),
                        static_cast<uint32_t>(j), threshold);
          const A zs = p.dropout ? (keep ? inv_keep : A(0)) : A(1);
          const A* vj = V.data() + j * D;
          const A dp = dot(doi, vj, D) * zs;
          const A ds = pj * (dp - delta) * scale;
          const A pd = pj * zs;
          A* dvj = dV.data() + j * D;
          A* dkj = dK.data() + j * D;
          const A* kj = K.data() + j * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) {
            dvj[d] += pd * doi[d];
            dkj[d] += ds * qi[d];
            dq[d] += ds * kj[d];
          }
        }
        T* dqi = row_ptr_mut<T>(p.dq, p, b, h, sv, i);
        for (int d = 0; d < D; ++d) dqi[d] = static_cast<T>(dq[d]);
      }
      for (int64_t j = 0; j < sv.len; ++j) {
        T* dkj = row_ptr_mut<T>(p.dk, p, b, h, sv, j);
        T* dvj = row_ptr_mut<T>(p.dv, p, b, h, sv, j);
        for (int d = 0; d < D; ++d) {
          dkj[d] = static_cast<T>(dK[j * D + d]);
          dvj[d] = static_cast<T>(dV[j * D + d]);
        }
      }
    }
  }
}

}  // namespace

void attn_fwd_cpu(const AttnParams& p, DType t) {
  dispatch_cpu_dtype(t, "attn_fwd_cpu", [&](auto tv, auto av) {
    attn_fwd_impl<decltype(tv), decltype(av)>(p);
  });
}

void attn_bwd_cpu(const AttnParams& p, DType t) {
  dispatch_cpu_dtype(t, "attn_bwd_cpu", [&](auto tv, auto av) {
    attn_bwd_impl<decltype(tv), decltype(av)>(p);
  });
}

}  // namespace bertdist
