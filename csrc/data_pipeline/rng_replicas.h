// CPython's and numpy's random number generators, replicated draw for draw.
//
// The native instance builder (instances.cpp) must give bitwise the output of
// data_pipeline/instance_algorithm.py, so it replays that code's random draws exactly: CPython's
// random.Random (MT19937, as Modules/_randommodule.c seeds and runs it) for the segment
// choices, numpy's PCG64 Generator (seeded through SeedSequence) for the masking. Each piece
// names the Python it mirrors; tests/data_pipeline/test_instance_native.py checks them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace bertdist_replicas {

// ------------------------------------------------------------------ CPython random.Random

// MT19937 exactly as CPython's Modules/_randommodule.c seeds and runs it.
class PyRandom {
 public:
  // random.Random(seed) for an int seed: init_by_array over the 32-bit little-endian words
  // of abs(seed), at least one word (seed 0 -> one zero word). Our seeds are 64-bit.
  explicit PyRandom(uint64_t seed) {
    uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
    init_by_array(key, (seed >> 32) ? 2 : 1);
  }

  uint32_t genrand() {
    static const uint32_t mag01[2] = {0x0U, 0x9908b0dfU};
    uint32_t y;
    if (index_ >= N) {  // generate N words at one time
      int kk;
      for (kk = 0; kk < N - M; kk++) {
        y = (mt_[kk] & 0x80000000U) | (mt_[kk + 1] & 0x7fffffffU);
        mt_[kk] = mt_[kk + M] ^ (y >> 1) ^ mag01[y & 0x1U];
      }
      for (; kk < N - 1; kk++) {
        y = (mt_[kk] & 0x80000000U) | (mt_[kk + 1] & 0x7fffffffU);
        mt_[kk] = mt_[kk + (M - N)] ^ (y >> 1) ^ mag01[y & 0x1U];
      }
      y = (mt_[N - 1] & 0x80000000U) | (mt_[0] & 0x7fffffffU);
      mt_[N - 1] = mt_[M - 1] ^ (y >> 1) ^ mag01[y & 0x1U];
      index_ = 0;
    }
    y = mt_[index_++];
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= (y >> 18);
    return y;
  }

  // random.random(): 53 bits from two draws, a*2**26 + b over 2**53.
  double random() {
    uint32_t a = genrand() >> 5, b = genrand() >> 6;
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
  }

  // popcount(getrandbits(k)), k >= 1: the reference only counts the ones (Binomial(k, 1/2)).
  // k <= 32 is one draw, top k bits; otherwise 32-bit words, the last one keeps its top k % 32.
  int64_t getrandbits_popcount(int64_t k) {
    if (k <= 32) return __builtin_popcount(genrand() >> (32 - k));
    int64_t ones = 0;
    for (; k > 0; k -= 32) {
      uint32_t r = genrand();
      if (k < 32) r >>= (32 - k);
      ones += __builtin_popcount(r);
    }
    return ones;
  }

  // instances.py::_below: int(rng.random() * n) (truncation toward zero, as int() does).
  int64_t below(int64_t n) { return static_cast<int64_t>(random() * static_cast<double>(n)); }

 private:
  static constexpr int N = 624, M = 397;
  uint32_t mt_[N];
  int index_ = N;

  void init_genrand(uint32_t s) {
    mt_[0] = s;
    for (int i = 1; i < N; i++) mt_[i] = 1812433253U * (mt_[i - 1] ^ (mt_[i - 1] >> 30)) + static_cast<uint32_t>(i);
    index_ = N;
  }

  void init_by_array(const uint32_t* key, size_t key_length) {
    init_genrand(19650218U);
    size_t i = 1, j = 0;
    for (size_t k = std::max<size_t>(N, key_length); k; k--) {
      mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525U)) + key[j] + static_cast<uint32_t>(j);
      i++, j++;
      if (i >= N) mt_[0] = mt_[N - 1], i = 1;
      if (j >= key_length) j = 0;
    }
    for (size_t k = N - 1; k; k--) {
      mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941U)) - static_cast<uint32_t>(i);
      i++;
      if (i >= N) mt_[0] = mt_[N - 1], i = 1;
    }
    mt_[0] = 0x80000000U;  // MSB is 1: a non-zero initial array
  }
};

// ------------------------------------------------------------------ numpy PCG64 Generator

// numpy's SeedSequence(seed).generate_state(4, np.uint64) for a 64-bit int seed, the words
// np.random.PCG64(seed) seeds itself from: the seed's 32-bit little-endian words (at least one)
// hashed into a pool of four uint32, then four uint64 drawn from the pool.
inline void seed_sequence_state(uint64_t seed, uint64_t out[4]) {
  const uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875, kInitB = 0x8b51f9dd, kMultB = 0x58f38ded;
  const uint32_t kMixL = 0xca01f9dd, kMixR = 0x4973f715;
  const uint32_t entropy[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  const int n_entropy = (seed >> 32) ? 2 : 1;
  uint32_t hash_const = kInitA;
  auto hashmix = [&hash_const, kMultA](uint32_t value) {
    value ^= hash_const;
    hash_const *= kMultA;
    value *= hash_const;
    return value ^ (value >> 16);
  };
  auto mix = [kMixL, kMixR](uint32_t x, uint32_t y) {
    uint32_t r = kMixL * x - kMixR * y;
    return r ^ (r >> 16);
  };
  uint32_t pool[4];
  for (int i = 0; i < 4; i++) pool[i] = hashmix(i < n_entropy ? entropy[i] : 0);
  for (int src = 0; src < 4; src++)  // every word affects every other (at most 2 entropy words: no tail)
    for (int dst = 0; dst < 4; dst++)
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
  hash_const = kInitB;
  uint32_t words[8];
  for (int i = 0; i < 8; i++) {
    uint32_t v = pool[i % 4] ^ hash_const;
    hash_const *= kMultB;
    v *= hash_const;
    words[i] = v ^ (v >> 16);
  }
  for (int i = 0; i < 4; i++) out[i] = words[2 * i] | (static_cast<uint64_t>(words[2 * i + 1]) << 32);
}

// numpy's PCG64 (pcg_setseq_128_xsl_rr_64) with the bit generator's uint32 buffer. The 128-bit
// state is a GCC/Clang unsigned __int128, as in numpy's own build on x86-64.
class Pcg64 {
 public:
  using u128 = unsigned __int128;

  // np.random.PCG64(seed): pcg64_set_seed with the SeedSequence words (state, increment), i.e.
  // inc = (initseq << 1) | 1, state = 0, step, state += initstate, step.
  explicit Pcg64(uint64_t seed) {
    uint64_t w[4];
    seed_sequence_state(seed, w);
    const u128 initstate = (static_cast<u128>(w[0]) << 64) | w[1];
    const u128 initseq = (static_cast<u128>(w[2]) << 64) | w[3];
    inc_ = (initseq << 1) | 1;
    state_ = 0;
    next64();
    state_ += initstate;
    next64();
  }

  u128 state() const { return state_; }
  u128 inc() const { return inc_; }

  // Step the LCG, then XSL-RR output of the new state.
  uint64_t next64() {
    state_ = state_ * kMult + inc_;
    return output(state_);
  }

  // Generator.random(): 53 high bits of a 64-bit draw.
  double next_double() { return to_double(next64()); }

  // Generator.random(n) into out: the same n values as n next_double() calls. The LCG is one
  // long dependency chain of 128-bit multiplies; two interleaved chains (even and odd steps,
  // each jumping two steps: s' = s * mult^2 + inc * (mult + 1)) run about twice as fast.
  void fill_doubles(double* out, int64_t n) {
    if (n <= 0) return;
    const u128 mult2 = kMult * kMult, inc2 = inc_ * (kMult + 1);
    u128 even = state_ * kMult + inc_;  // state after step 1
    u128 odd = even * kMult + inc_;     // after step 2
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
      out[j] = to_double(output(even));
      out[j + 1] = to_double(output(odd));
      state_ = odd;
      even = even * mult2 + inc2;
      odd = odd * mult2 + inc2;
    }
    if (j < n) {
      out[j] = to_double(output(even));
      state_ = even;
    }
  }

  // PCG64's next_uint32: the low half of a 64-bit draw first, the high half buffered for the next call.
  uint32_t next32() {
    if (has_uint32_) {
      has_uint32_ = false;
      return buffered_;
    }
    uint64_t next = next64();
    has_uint32_ = true;
    buffered_ = static_cast<uint32_t>(next >> 32);
    return static_cast<uint32_t>(next);
  }

  // One value of Generator.integers(0, high) (int64 default dtype), rng = high - 1 as numpy's
  // random_bounded_uint64_fill names it: ranges up to 32 bits use 32-bit draws, with Lemire's
  // multiply-and-reject (buffered_bounded_lemire_uint32); rng == 2**32 - 1 takes the draw as is.
  uint64_t bounded(uint64_t rng) {
    if (rng == 0) return 0;
    if (rng == 0xFFFFFFFFULL) return next32();
    const uint32_t rng_excl = static_cast<uint32_t>(rng) + 1;
    uint64_t m = static_cast<uint64_t>(next32()) * rng_excl;
    uint32_t leftover = static_cast<uint32_t>(m);
    if (leftover < rng_excl) {
      const uint32_t threshold = (UINT32_MAX - static_cast<uint32_t>(rng)) % rng_excl;
      while (leftover < threshold) {
        m = static_cast<uint64_t>(next32()) * rng_excl;
        leftover = static_cast<uint32_t>(m);
      }
    }
    return m >> 32;
  }

 private:
  static constexpr u128 kMult = (static_cast<u128>(0x2360ED051FC65DA4ULL) << 64) | 0x4385DF649FCCF645ULL;

  static uint64_t output(u128 state) {  // XSL-RR
    uint64_t x = static_cast<uint64_t>(state >> 64) ^ static_cast<uint64_t>(state);
    unsigned rot = static_cast<unsigned>(state >> 122);
    return (x >> rot) | (x << ((64 - rot) & 63));
  }
  static double to_double(uint64_t x) { return static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0); }

  u128 state_, inc_;
  bool has_uint32_ = false;  // a fresh np.random.PCG64 has an empty buffer
  uint32_t buffered_ = 0;
};

// numpy's random_interval(bitgen, max): a uniform value in [0, max] by masked rejection, with
// 32-bit draws (PCG64's buffered next_uint32) when max fits in 32 bits. Generator.permutation(n)
// is arange(n) shuffled by Fisher-Yates with j = random_interval(i) for i = n - 1 down to 1.
inline uint64_t random_interval(Pcg64& rng, uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  for (int s = 1; s <= 32; s <<= 1) mask |= mask >> s;  // smallest all-ones mask >= max
  uint64_t value;
  if (max <= 0xFFFFFFFFULL) {
    while ((value = (rng.next32() & mask)) > max) {
    }
  } else {
    while ((value = (rng.next64() & mask)) > max) {
    }
  }
  return value;
}

}  // namespace bertdist_replicas
