// CUDA attention core, flash-style: softmax(Q K^T * scale + key padding mask) -> dropout -> @ V.
//
// Forward: one block per (query tile, head, sequence); K/V tiles stream through shared memory
// with an online softmax, so no S x S matrix is ever written. It saves the row max m and
// 1 / rowsum (not log-sum-exp: a fully padded row then still gives the reference's uniform
// distribution in the backward). Backward recomputes probabilities from Q, K and those stats:
// a dK/dV kernel (one block per key tile, looping over query tiles) and a dQ kernel (one block
// per query tile, looping over key tiles), no atomics. Dropout decisions come from Philox
// counters (bh, row, col) regenerated in every kernel; they equal the CPU kernel's. The forward
// records its (seed, offset) (possibly drawn from the CUDA generator on the device, see
// DropoutRng in ops.h) and the backward kernels read that record.
//
// These are fp32-accumulating SIMT kernels for head_dim 32/64/128, any sequence length, padded
// [B, H, S, D] views with any strides (unit head_dim stride) or varlen packed tokens.
#include <cfloat>

#include "cuda_common.cuh"
#include "philox.h"

namespace bertdist {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

struct SeqInfo {
  int len;
  int64_t tok0;
  int64_t stat0;
};

__device__ __forceinline__ SeqInfo seq_info(const AttnParams& p, int b, int h) {
  if (p.cu_seqlens) {
    const int64_t s0 = p.cu_seqlens[b], s1 = p.cu_seqlens[b + 1];
    return {static_cast<int>(s1 - s0), s0, static_cast<int64_t>(h) * p.total_tokens + s0};
  }
  return {p.seq, 0, (static_cast<int64_t>(b) * p.heads + h) * p.seq};
}

template <typename T>
__device__ __forceinline__ T* row_ptr(const HeadTensor& t, const AttnParams& p, int b, int h, const SeqInfo& s,
                                      int64_t i) {
  const int64_t base = p.cu_seqlens ? (s.tok0 + i) * t.stride_s : b * t.stride_b + i * t.stride_s;
  return static_cast<T*>(t.ptr) + base + h * t.stride_h;
}

// Key kinds in a tile: 0 = beyond the sequence (ignored), 1 = padding (score = -FLT_MAX, as the
// reference's fp32 additive mask gives), 2 = real.
__device__ __forceinline__ float key_kind(const AttnParams& p, int b, int j, int len) {
  if (j >= len) return 0.f;
  if (p.key_mask && !p.key_mask[b * p.mask_stride_b + j]) return 1.f;
  return 2.f;
}

// Loads rows [r0, r0 + R) of a head into smem as fp32 with row pitch `pitch`, zeros past len.
template <typename T, int D, int R>
__device__ __forceinline__ void load_tile(float* dst, int pitch, const HeadTensor& t, const AttnParams& p, int b,
                                          int h, const SeqInfo& s, int r0) {
  for (int idx = threadIdx.x; idx < R * D; idx += kThreads) {
    const int r = idx / D, d = idx % D, i = r0 + r;
    dst[r * pitch + d] = i < s.len ? to_f(row_ptr<const T>(t, p, b, h, s, i)[d]) : 0.f;
  }
}

template <int D>
__device__ __forceinline__ float dot_smem(const float* a, const float* b) {
  float s = 0.f;
#pragma unroll 16
  for (int d = 0; d < D; ++d) s = fmaf(a[d], b[d], s);
  return s;
}

template <int D, int BQ, int BK>
constexpr int fwd_smem_floats() { return BQ * D + BK * (D + 1) + BK * D + kWarps * BK + BK; }

template <typename T, int D, int BQ, int BK>
__global__ void __launch_bounds__(kThreads) attn_fwd_kernel(AttnParams p, uint32_t threshold, float inv_keep) {
  constexpr int RPW = BQ / kWarps, DPL = D / 32, KPL = BK / 32;
  BD_EXTERN_SHARED(float, smem);
  float* Qs = smem;
  float* Ks = Qs + BQ * D;
  float* Vs = Ks + BK * (D + 1);
  float* Ps = Vs + BK * D;
  float* Kind = Ps + kWarps * BK;
  const DropoutKey key = p.dropout ? forward_dropout_key(p.rng) : DropoutKey{0, 0};
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * BQ;
  const SeqInfo s = seq_info(p, b, h);
  if (q0 >= s.len) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t bh = static_cast<uint32_t>(b * p.heads + h);
  load_tile<T, D, BQ>(Qs, D, p.q, p, b, h, s, q0);

  float m[RPW], l[RPW], acc[RPW][DPL];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.f;
#pragma unroll
    for (int c = 0; c < DPL; ++c) acc[rr][c] = 0.f;
  }
  for (int k0 = 0; k0 < s.len; k0 += BK) {
    __syncthreads();  // the previous tile is consumed
    load_tile<T, D, BK>(Ks, D + 1, p.k, p, b, h, s, k0);
    load_tile<T, D, BK>(Vs, D, p.v, p, b, h, s, k0);
    for (int j = threadIdx.x; j < BK; j += kThreads) Kind[j] = key_kind(p, b, k0 + j, s.len);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      const int r = warp * RPW + rr, i = q0 + r;
      if (i >= s.len) continue;  // warp-uniform
      float sc[KPL];
      float tmax = -INFINITY;
#pragma unroll
      for (int t = 0; t < KPL; ++t) {
        const int j = lane + 32 * t;
        const float kind = Kind[j];
        const float dot = dot_smem<D>(Qs + r * D, Ks + j * (D + 1));
        sc[t] = kind == 0.f ? -INFINITY : (kind == 1.f ? -FLT_MAX : dot * p.scale);
        tmax = fmaxf(tmax, sc[t]);
      }
      tmax = warp_max(tmax);
      const float mnew = fmaxf(m[rr], tmax);  // finite: every tile has a key in range
      const float corr = expf(m[rr] - mnew);
      float psum = 0.f;
#pragma unroll
      for (int t = 0; t < KPL; ++t) {
        const int j = lane + 32 * t;
        const float e = expf(sc[t] - mnew);
        psum += e;
        float pd = e;
        if (p.dropout && e != 0.f)
          pd = attn_keep(key.seed, key.offset, bh, static_cast<uint32_t>(i), static_cast<uint32_t>(k0 + j), threshold)
                   ? e * inv_keep : 0.f;
        Ps[warp * BK + j] = pd;
      }
      l[rr] = l[rr] * corr + warp_sum(psum);
      m[rr] = mnew;
      __syncwarp();
      const int jmax = min(BK, s.len - k0);
#pragma unroll
      for (int c = 0; c < DPL; ++c) acc[rr][c] *= corr;
      for (int j = 0; j < jmax; ++j) {
        const float pj = Ps[warp * BK + j];
#pragma unroll
        for (int c = 0; c < DPL; ++c) acc[rr][c] = fmaf(pj, Vs[j * D + lane + 32 * c], acc[rr][c]);
      }
      __syncwarp();
    }
  }
  const int64_t nstat = p.cu_seqlens ? static_cast<int64_t>(p.heads) * p.total_tokens
                                     : static_cast<int64_t>(p.batch) * p.heads * p.seq;
  float* stats = static_cast<float*>(p.stats);
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int i = q0 + warp * RPW + rr;
    if (i >= s.len) continue;
    const float inv_l = 1.f / l[rr];
    T* o = row_ptr<T>(p.o, p, b, h, s, i);
#pragma unroll
    for (int c = 0; c < DPL; ++c) o[lane + 32 * c] = from_f<T>(acc[rr][c] * inv_l);
    if (lane == 0) {
      stats[s.stat0 + i] = m[rr];
      stats[nstat + s.stat0 + i] = inv_l;
    }
  }
}

// delta_i = rowsum(dO_i * O_i), one thread per row, summed in the same sequential fmaf order
// as the dP' = dO . V dot products of the dQ and dK/dV kernels: a row whose probability sits
// on one key (O_i = V_j exactly) then gets dP' - delta == 0 exactly, as the reference does.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attn_delta_kernel(AttnParams p) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int i = blockIdx.x * kThreads + threadIdx.x;
  const SeqInfo s = seq_info(p, b, h);
  if (i >= s.len) return;
  const T* o = row_ptr<const T>(p.o, p, b, h, s, i);
  const T* dout = row_ptr<const T>(p.dout, p, b, h, s, i);
  float acc = 0.f;
#pragma unroll 16
  for (int d = 0; d < D; ++d) acc = fmaf(to_f(dout[d]), to_f(o[d]), acc);
  static_cast<float*>(p.delta)[s.stat0 + i] = acc;
}

template <int D, int BQ, int BK>
constexpr int dq_smem_floats() { return 2 * BQ * D + 2 * BK * (D + 1) + kWarps * BK + BK; }

// dQ_i = scale * sum_j dS_ij K_j, dS_ij = P_ij (Z_ij dP'_ij - delta_i), dP'_ij = dO_i . V_j.
template <typename T, int D, int BQ, int BK>
__global__ void __launch_bounds__(kThreads) attn_dq_kernel(AttnParams p, uint32_t threshold, float inv_keep) {
  constexpr int RPW = BQ / kWarps, DPL = D / 32, KPL = BK / 32;
  BD_EXTERN_SHARED(float, smem);
  float* Qs = smem;
  float* dOs = Qs + BQ * D;
  float* Ks = dOs + BQ * D;
  float* Vs = Ks + BK * (D + 1);
  float* Ss = Vs + BK * (D + 1);
  float* Kind = Ss + kWarps * BK;
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * BQ;
  const SeqInfo s = seq_info(p, b, h);
  if (q0 >= s.len) return;
  const DropoutKey key = p.dropout ? dropout_key(p.rng) : DropoutKey{0, 0};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t bh = static_cast<uint32_t>(b * p.heads + h);
  const int64_t nstat = p.cu_seqlens ? static_cast<int64_t>(p.heads) * p.total_tokens
                                     : static_cast<int64_t>(p.batch) * p.heads * p.seq;
  const float* stats = static_cast<const float*>(p.stats);
  const float* delta = static_cast<const float*>(p.delta);
  load_tile<T, D, BQ>(Qs, D, p.q, p, b, h, s, q0);
  load_tile<T, D, BQ>(dOs, D, p.dout, p, b, h, s, q0);
  float rm[RPW], ril[RPW], rd[RPW], dq[RPW][DPL];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int i = q0 + warp * RPW + rr;
    const bool ok = i < s.len;
    rm[rr] = ok ? stats[s.stat0 + i] : 0.f;
    ril[rr] = ok ? stats[nstat + s.stat0 + i] : 0.f;
    rd[rr] = ok ? delta[s.stat0 + i] : 0.f;
#pragma unroll
    for (int c = 0; c < DPL; ++c) dq[rr][c] = 0.f;
  }
  for (int k0 = 0; k0 < s.len; k0 += BK) {
    __syncthreads();
    load_tile<T, D, BK>(Ks, D + 1, p.k, p, b, h, s, k0);
    load_tile<T, D, BK>(Vs, D + 1, p.v, p, b, h, s, k0);
    for (int j = threadIdx.x; j < BK; j += kThreads) Kind[j] = key_kind(p, b, k0 + j, s.len);
    __syncthreads();
    const int jmax = min(BK, s.len - k0);
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      const int r = warp * RPW + rr, i = q0 + r;
      if (i >= s.len) continue;
#pragma unroll
      for (int t = 0; t < KPL; ++t) {
        const int j = lane + 32 * t;
        const float kind = Kind[j];
        float ds = 0.f;
        if (kind != 0.f) {
          const float sc = kind == 1.f ? -FLT_MAX : dot_smem<D>(Qs + r * D, Ks + j * (D + 1)) * p.scale;
          const float pr = expf(sc - rm[rr]) * ril[rr];
          float dp = dot_smem<D>(dOs + r * D, Vs + j * (D + 1));
          if (p.dropout)
            dp = attn_keep(key.seed, key.offset, bh, static_cast<uint32_t>(i), static_cast<uint32_t>(k0 + j), threshold)
                     ? dp * inv_keep : 0.f;
          ds = pr * (dp - rd[rr]);
        }
        Ss[warp * BK + j] = ds;
      }
      __syncwarp();
      for (int j = 0; j < jmax; ++j) {
        const float dsj = Ss[warp * BK + j];
#pragma unroll
        for (int c = 0; c < DPL; ++c) dq[rr][c] = fmaf(dsj, Ks[j * (D + 1) + lane + 32 * c], dq[rr][c]);
      }
      __syncwarp();
    }
  }
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int i = q0 + warp * RPW + rr;
    if (i >= s.len) continue;
    T* out = row_ptr<T>(p.dq, p, b, h, s, i);
#pragma unroll
    for (int c = 0; c < DPL; ++c) out[lane + 32 * c] = from_f<T>(dq[rr][c] * p.scale);
  }
}

constexpr int kBQ2 = 32;  // query rows per step of the dK/dV kernel: one per lane

template <int D, int BK>
constexpr int dkdv_smem_floats() { return 2 * BK * D + 2 * kBQ2 * (D + 1) + 3 * kBQ2 + 2 * kWarps * kBQ2 + BK; }

// dV_j = sum_i Z_ij P_ij dO_i, dK_j = scale * sum_i dS_ij Q_i, for the block's BK keys.
template <typename T, int D, int BK>
__global__ void __launch_bounds__(kThreads) attn_dkdv_kernel(AttnParams p, uint32_t threshold, float inv_keep) {
  constexpr int KPW = BK / kWarps, DPL = D / 32, QP = D + 1;
  BD_EXTERN_SHARED(float, smem);
  float* Ks = smem;
  float* Vs = Ks + BK * D;
  float* Qs = Vs + BK * D;
  float* dOs = Qs + kBQ2 * QP;
  float* Mi = dOs + kBQ2 * QP;
  float* Li = Mi + kBQ2;
  float* Di = Li + kBQ2;
  float* Pw = Di + kBQ2;
  float* Sw = Pw + kWarps * kBQ2;
  float* Kind = Sw + kWarps * kBQ2;
  const int b = blockIdx.z, h = blockIdx.y, k0 = blockIdx.x * BK;
  const SeqInfo s = seq_info(p, b, h);
  if (k0 >= s.len) return;
  const DropoutKey key = p.dropout ? dropout_key(p.rng) : DropoutKey{0, 0};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t bh = static_cast<uint32_t>(b * p.heads + h);
  const int64_t nstat = p.cu_seqlens ? static_cast<int64_t>(p.heads) * p.total_tokens
                                     : static_cast<int64_t>(p.batch) * p.heads * p.seq;
  const float* stats = static_cast<const float*>(p.stats);
  const float* delta = static_cast<const float*>(p.delta);
  load_tile<T, D, BK>(Ks, D, p.k, p, b, h, s, k0);
  load_tile<T, D, BK>(Vs, D, p.v, p, b, h, s, k0);
  for (int j = threadIdx.x; j < BK; j += kThreads) Kind[j] = key_kind(p, b, k0 + j, s.len);
  float dk[KPW][DPL], dv[KPW][DPL];
#pragma unroll
  for (int kk = 0; kk < KPW; ++kk)
#pragma unroll
    for (int c = 0; c < DPL; ++c) dk[kk][c] = dv[kk][c] = 0.f;

  for (int q0 = 0; q0 < s.len; q0 += kBQ2) {
    __syncthreads();
    load_tile<T, D, kBQ2>(Qs, QP, p.q, p, b, h, s, q0);
    load_tile<T, D, kBQ2>(dOs, QP, p.dout, p, b, h, s, q0);
    for (int r = threadIdx.x; r < kBQ2; r += kThreads) {
      const int i = q0 + r;
      const bool ok = i < s.len;
      Mi[r] = ok ? stats[s.stat0 + i] : 0.f;
      Li[r] = ok ? stats[nstat + s.stat0 + i] : 0.f;
      Di[r] = ok ? delta[s.stat0 + i] : 0.f;
    }
    __syncthreads();
    const int i = q0 + lane;
    const bool row_ok = i < s.len;
    const int imax = min(kBQ2, s.len - q0);
#pragma unroll
    for (int kk = 0; kk < KPW; ++kk) {
      const int jl = warp * KPW + kk;
      const float kind = Kind[jl];
      if (kind == 0.f) continue;  // warp-uniform
      float pd = 0.f, ds = 0.f;
      if (row_ok) {
        const float sc = kind == 1.f ? -FLT_MAX : dot_smem<D>(Qs + lane * QP, Ks + jl * D) * p.scale;
        const float pr = expf(sc - Mi[lane]) * Li[lane];
        float dp = dot_smem<D>(dOs + lane * QP, Vs + jl * D);
        float z = 1.f;
        if (p.dropout)
          z = attn_keep(key.seed, key.offset, bh, static_cast<uint32_t>(i), static_cast<uint32_t>(k0 + jl), threshold)
                  ? inv_keep : 0.f;
        pd = pr * z;
        ds = pr * (dp * z - Di[lane]);
      }
      Pw[warp * kBQ2 + lane] = pd;
      Sw[warp * kBQ2 + lane] = ds;
      __syncwarp();
      for (int ii = 0; ii < imax; ++ii) {
        const float pw = Pw[warp * kBQ2 + ii], sw = Sw[warp * kBQ2 + ii];
#pragma unroll
        for (int c = 0; c < DPL; ++c) {
          dv[kk][c] = fmaf(pw, dOs[ii * QP + lane + 32 * c], dv[kk][c]);
          dk[kk][c] = fmaf(sw, Qs[ii * QP + lane + 32 * c], dk[kk][c]);
        }
      }
      __syncwarp();
    }
  }
#pragma unroll
  for (int kk = 0; kk < KPW; ++kk) {
    const int j = k0 + warp * KPW + kk;
    if (j >= s.len) continue;
    T* dko = row_ptr<T>(p.dk, p, b, h, s, j);
    T* dvo = row_ptr<T>(p.dv, p, b, h, s, j);
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      dko[lane + 32 * c] = from_f<T>(dk[kk][c] * p.scale);
      dvo[lane + 32 * c] = from_f<T>(dv[kk][c]);
    }
  }
}

template <typename K>
void launch(K kernel, dim3 grid, int smem_floats, cudaStream_t stream, const char* name, const AttnParams& p,
            uint32_t threshold, float inv_keep) {
  const size_t bytes = static_cast<size_t>(smem_floats) * sizeof(float);
  check_before_launch(name);
  opt_in_shared_memory(kernel, bytes, name);
  BD_LAUNCH(kernel, name, grid, kThreads, bytes, stream)(p, threshold, inv_keep);
  check_launch(name);
}

// Calls f(integral_constant<D>) for the supported head dims.
template <typename F>
void dispatch_head_dim(int d, const char* op, F&& f) {
  switch (d) {
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    default: throw std::runtime_error(std::string(op) + ": head_dim must be 32, 64 or 128, got " + std::to_string(d));
  }
}

}  // namespace

void attn_fwd_cuda(const AttnParams& p, DType t, void* stream) {
  const uint32_t threshold = keep_threshold(p.p);
  const float inv_keep = p.p < 1.f ? 1.f / (1.f - p.p) : 0.f;
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_cuda_dtype(t, "attn_fwd_cuda", [&](auto tv) {
    using T = decltype(tv);
    dispatch_head_dim(p.head_dim, "attn_fwd_cuda", [&](auto dc) {
      constexpr int D = decltype(dc)::value;
      constexpr int BQ = D == 128 ? 32 : 64, BK = BQ;
      dim3 grid((p.seq + BQ - 1) / BQ, p.heads, p.batch);
      if (grid.x == 0) return;
      launch(attn_fwd_kernel<T, D, BQ, BK>, grid, fwd_smem_floats<D, BQ, BK>(), s, "attn_fwd_kernel", p, threshold,
             inv_keep);
    });
  });
}

void attn_bwd_cuda(const AttnParams& p, DType t, void* stream) {
  const uint32_t threshold = keep_threshold(p.p);
  const float inv_keep = p.p < 1.f ? 1.f / (1.f - p.p) : 0.f;
  auto s = static_cast<cudaStream_t>(stream);
  if (p.seq == 0) return;
  dispatch_cuda_dtype(t, "attn_bwd_cuda", [&](auto tv) {
    using T = decltype(tv);
    dispatch_head_dim(p.head_dim, "attn_bwd_cuda", [&](auto dc) {
      constexpr int D = decltype(dc)::value;
      const auto delta_kernel = attn_delta_kernel<T, D>;
      check_before_launch("attn_delta_kernel");
      BD_LAUNCH(delta_kernel, "attn_delta_kernel", dim3((p.seq + kThreads - 1) / kThreads, p.heads, p.batch),
                kThreads, 0, s)(p);
      check_launch("attn_delta_kernel");
      constexpr int BQ = D == 128 ? 32 : 64, BK = D == 128 ? 32 : 64;
      launch(attn_dq_kernel<T, D, BQ, BK>, dim3((p.seq + BQ - 1) / BQ, p.heads, p.batch), dq_smem_floats<D, BQ, BK>(),
             s, "attn_dq_kernel", p, threshold, inv_keep);
      launch(attn_dkdv_kernel<T, D, BK>, dim3((p.seq + BK - 1) / BK, p.heads, p.batch), dkdv_smem_floats<D, BK>(), s,
             "attn_dkdv_kernel", p, threshold, inv_keep);
    });
  });
}

}  // namespace bertdist
