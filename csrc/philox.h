// Philox4x32-10 counter-based RNG (Salmon et al., SC'11), shared by the CPU and CUDA kernels.
//
// Both sides derive every dropout decision from (seed, counter) alone, so a fixed seed
// reproduces a mask, the backward pass regenerates the forward's mask instead of storing it,
// and the CPU and CUDA kernels drop exactly the same elements for the same seed and offset.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define BD_HD __host__ __device__ __forceinline__
#else
#define BD_HD inline
#endif

namespace bertdist {

struct Philox4 {
  uint32_t v[4];
};

BD_HD uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  return a * b;
#else
  uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
#endif
}

// Ten rounds of Philox4x32 on counter (c0..c3) with the 64-bit key `seed`.
BD_HD Philox4 philox4x32_10(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    uint32_t lo0 = mulhilo32(M0, c0, &hi0);
    uint32_t lo1 = mulhilo32(M1, c2, &hi1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += W0; k1 += W1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Keep threshold: an element is kept when its 32-bit draw is below it, i.e. with
// probability (1 - p) up to 2^-32. Integer comparison keeps CPU and GPU decisions identical.
BD_HD uint32_t keep_threshold(float p) {
  double keep = 1.0 - static_cast<double>(p);
  if (keep >= 1.0) return 0xFFFFFFFFu;
  if (keep <= 0.0) return 0u;
  return static_cast<uint32_t>(keep * 4294967296.0);
}

// Counter layouts. Word 3 is always the caller's offset, so one seed serves many calls.
// Attention probabilities: element (bh, row, col) -> counter (col/4, row, bh, offset), lane col%4.
BD_HD bool attn_keep(uint64_t seed, uint32_t offset, uint32_t bh, uint32_t row, uint32_t col,
                     uint32_t threshold) {
  Philox4 r = philox4x32_10(seed, col >> 2, row, bh, offset);
  return r.v[col & 3] < threshold;
}

// Hidden-state dropout: flat element index e -> counter (e/4 low, e/4 high, 0x5EED0D0D, offset).
// The constant word keeps these streams disjoint from the attention ones under the same seed.
BD_HD Philox4 hidden_draws(uint64_t seed, uint32_t offset, uint64_t group) {
  return philox4x32_10(seed, static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
                       0x5EED0D0Du, offset);
}

// The CUDA generator hands each call a 64-bit (seed, offset), the offset advancing by a
// multiple of 4 per call; the streams above take a 64-bit key and a 32-bit counter word. The
// low 32 offset bits become the word and the higher bits are mixed into the key (an odd
// multiplier makes this one-to-one for a given seed), so distinct generator states never share
// a stream. The (seed, offset) it yields is what the ops record: the CPU helpers reproduce a
// CUDA mask from it.
BD_HD void dropout_key_from_generator(uint64_t gen_seed, uint64_t gen_offset, uint64_t* seed, uint32_t* offset) {
  *offset = static_cast<uint32_t>(gen_offset);
  *seed = gen_seed ^ ((gen_offset >> 32) * 0x9E3779B97F4A7C15ull);
}

}  // namespace bertdist
