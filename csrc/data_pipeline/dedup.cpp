// Native twin of the signing functions of data_pipeline/dedup.py (no torch: Beam workers load it).
//
// word_hashes(lowered_utf8) is dedup.word_hashes after its lower().encode(): the uint32 hash of
// every maximal run of word bytes, sum over the run's bytes of (byte + 1) * P^offset mod 2^32.
// bin_minima(words, ngram_multipliers, a, b, num_perm) is the part of
// minhash(ngram_hashes(words)) before densification: each word n-gram's uint64 hash, mixed,
// picks a bin with its high half and offers its low half as the bin's minimum. One pass, with no
// n-gram array in memory. The numpy functions stay the readable reference and the test oracle:
// the results must be identical.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "numpy_arrays.h"

namespace py = pybind11;
using bertdist_numpy::check_array;
using bertdist_numpy::check_dtype;
using bertdist_numpy::to_numpy;

namespace {

constexpr uint32_t kWordPrime = 0x01000193u;  // dedup._P

// dedup._WORD_BYTES: ASCII lower-case letters, digits, "_" and every byte >= 0x80
std::array<bool, 256> word_byte_table() {
  std::array<bool, 256> t{};
  for (int c = 'a'; c <= 'z'; ++c) t[c] = true;
  for (int c = '0'; c <= '9'; ++c) t[c] = true;
  t['_'] = true;
  for (int c = 0x80; c < 0x100; ++c) t[c] = true;
  return t;
}

py::array word_hashes(const py::bytes& lowered_utf8) {
  static const std::array<bool, 256> is_word = word_byte_table();
  char* data = nullptr;
  py::ssize_t n = 0;
  if (PyBytes_AsStringAndSize(lowered_utf8.ptr(), &data, &n) != 0) throw py::error_already_set();
  const auto* s = reinterpret_cast<const unsigned char*>(data);
  std::vector<uint32_t> out;
  out.reserve(static_cast<size_t>(n / 6 + 1));
  {
    py::gil_scoped_release release;
    py::ssize_t i = 0;
    while (i < n) {
      if (!is_word[s[i]]) {
        ++i;
        continue;
      }
      uint32_t h = 0, power = 1;
      for (; i < n && is_word[s[i]]; ++i) {
        h += (static_cast<uint32_t>(s[i]) + 1u) * power;
        power *= kWordPrime;
      }
      out.push_back(h);
    }
  }
  return to_numpy(std::move(out));
}

std::pair<py::array, py::array> bin_minima(const py::array& words, const py::array& ngram_multipliers, uint64_t a,
                                           uint64_t b, int64_t num_perm) {
  check_array(words, "words", 1);
  check_dtype<uint32_t>(words, "words");
  check_array(ngram_multipliers, "ngram_multipliers", 1);
  check_dtype<uint64_t>(ngram_multipliers, "ngram_multipliers");
  if (num_perm < 1 || num_perm > (int64_t{1} << 31))
    throw py::value_error("num_perm must be in [1, 2^31], got " + std::to_string(num_perm));
  const py::ssize_t len = words.shape(0), ngram = ngram_multipliers.shape(0);
  if (len < 1) throw py::value_error("words: at least one word is needed (an empty document has no signature)");
  if (ngram < 1) throw py::value_error("ngram_multipliers: at least one is needed");
  const auto* w = static_cast<const uint32_t*>(words.data());
  const auto* mult = static_cast<const uint64_t*>(ngram_multipliers.data());
  std::vector<uint32_t> mins(static_cast<size_t>(num_perm), 0xFFFFFFFFu);
  std::vector<uint8_t> filled(static_cast<size_t>(num_perm), 0);
  {
    py::gil_scoped_release release;
    // dedup.ngram_hashes: a document shorter than ngram words is one n-gram of all its words
    const py::ssize_t count = std::max<py::ssize_t>(1, len - ngram + 1);
    const py::ssize_t width = std::min(ngram, len);
    for (py::ssize_t i = 0; i < count; ++i) {
      uint64_t h = 0;
      for (py::ssize_t j = 0; j < width; ++j) h += static_cast<uint64_t>(w[i + j]) * mult[j];
      h ^= h >> 31;
      h *= 0xBF58476D1CE4E5B9ull;
      h ^= h >> 29;
      // dedup.minhash: one permutation, then the bin from the high half
      uint64_t x = h * a + b;
      x ^= x >> 29;
      x *= 0x94D049BB133111EBull;
      x ^= x >> 32;
      const auto bin = static_cast<size_t>(((x >> 32) * static_cast<uint64_t>(num_perm)) >> 32);
      mins[bin] = std::min(mins[bin], static_cast<uint32_t>(x));
      filled[bin] = 1;
    }
  }
  py::array filled_np = py::array_t<bool>(static_cast<py::ssize_t>(num_perm));
  std::copy(filled.begin(), filled.end(), static_cast<uint8_t*>(filled_np.mutable_data()));
  return {to_numpy(std::move(mins)), filled_np};
}

}  // namespace

PYBIND11_MODULE(_native_dedup, m) {
  m.doc() = "Native twin of data_pipeline.dedup's word hashes and MinHash binning (see data_pipeline/dedup.py).";
  m.def("word_hashes", &word_hashes, "uint32 hash of every run of word bytes of lower-cased UTF-8 text.",
        py::arg("lowered_utf8"));
  m.def("bin_minima", &bin_minima,
        "(uint32 minimum per bin, bool filled per bin) of the word n-grams' one-permutation MinHash, before "
        "densification.",
        py::arg("words"), py::arg("ngram_multipliers"), py::arg("a"), py::arg("b"), py::arg("num_perm"));
}
