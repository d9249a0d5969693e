// Native twin of the post-normalisation part of data_pipeline/wordpiece.py::WordPieceEncoder
// (no torch: Beam workers load it).
//
// encode(normalized_text, sentence_mark) does what encode_document does after normalize():
// split on whitespace (Python's str.split(): the whitespace code points come from Python's
// str.isspace), treat each sentence mark as a sentence boundary, look each chunk up in a cache
// (chunk bytes -> span of piece ids; reset when over max_cached_words, like the Python dict),
// and for chunks not seen yet split off the "single" characters (punctuation + CJK: the code
// point ranges come from Python's unicodedata) and run greedy longest-match-first WordPiece
// exactly as HF tokenizers' WordPiece::tokenize does. Sentences without tokens are dropped.
// The Python path stays the readable reference and the test oracle: ids must be identical.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// A set of code points as a bitmap (136 KiB), with a byte table for ASCII.
class CodePointSet {
 public:
  CodePointSet() : bits_((kMaxCodePoint + 64) / 64, 0) {}
  void add(uint32_t cp) {
    bits_[cp >> 6] |= uint64_t{1} << (cp & 63);
    if (cp < 128) ascii_[cp] = 1;
  }
  bool ascii(unsigned char c) const { return ascii_[c]; }
  bool contains(uint32_t cp) const { return (bits_[cp >> 6] >> (cp & 63)) & 1; }

 private:
  std::vector<uint64_t> bits_;
  unsigned char ascii_[128] = {};
};

// One code point of valid UTF-8 (CPython's UTF-8 of a str is always valid); n = its byte count.
inline uint32_t decode_utf8(const unsigned char* p, size_t& n) {
  const uint32_t c = p[0];
  if (c < 0x80) { n = 1; return c; }
  if (c < 0xE0) { n = 2; return ((c & 0x1F) << 6) | (p[1] & 0x3F); }
  if (c < 0xF0) { n = 3; return ((c & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F); }
  n = 4;
  return ((c & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

inline bool is_continuation_byte(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

uint32_t check_code_point(int64_t cp, const char* what) {
  if (cp < 0 || cp > kMaxCodePoint)
    throw py::value_error(std::string(what) + ": code point " + std::to_string(cp) + " is outside 0..0x10FFFF");
  return static_cast<uint32_t>(cp);
}

// Stable storage for the cached chunks' bytes (the cache's string_view keys point into it).
class Arena {
 public:
  std::string_view store(std::string_view s) {
    if (s.size() > left_) {
      const size_t size = std::max<size_t>(kBlock, s.size());
      blocks_.emplace_back(new char[size]);
      next_ = blocks_.back().get();
      left_ = size;
    }
    std::memcpy(next_, s.data(), s.size());
    std::string_view out(next_, s.size());
    next_ += s.size();
    left_ -= s.size();
    return out;
  }
  void clear() {
    blocks_.clear();
    next_ = nullptr;
    left_ = 0;
  }

 private:
  static constexpr size_t kBlock = 1 << 20;
  std::vector<std::unique_ptr<char[]>> blocks_;
  char* next_ = nullptr;
  size_t left_ = 0;
};

struct Span {
  uint64_t start;  // first piece in pieces_
  uint32_t size;
};

inline uint64_t hash_bytes(const char* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ n;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 31;
  }
  if (n) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * 0x94D049BB133111EBULL;
  }
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ULL;
  return h ^ (h >> 32);
}

// The chunk cache: open addressing (linear probing, at most half full) with the hash and the
// key's location inline, so a hit costs about one cache miss plus the key compare; the keys'
// bytes live in an Arena.
class ChunkCache {
 public:
  ChunkCache() { clear(); }
  size_t size() const { return size_; }
  void clear() {
    slots_.assign(1024, Slot{});
    size_ = 0;
  }
  // The pieces of ``key`` if cached, else nullptr; ``h`` = hash_bytes(key).
  const Span* find(std::string_view key, uint64_t h) const {
    for (size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.key == nullptr) return nullptr;
      if (s.hash == h && s.key_size == key.size() && std::memcmp(s.key, key.data(), key.size()) == 0) return &s.span;
    }
  }
  // Insert a key known to be absent; ``stored`` holds its bytes for the cache's lifetime.
  const Span* insert(std::string_view stored, uint64_t h, Span span) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    ++size_;
    return &place(Slot{h, stored.data(), stored.size(), span})->span;
  }

 private:
  struct Slot {
    uint64_t hash = 0;
    const char* key = nullptr;
    size_t key_size = 0;
    Span span{0, 0};
  };
  Slot* place(const Slot& slot) {
    size_t i = slot.hash & (slots_.size() - 1);
    while (slots_[i].key != nullptr) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = slot;
    return &slots_[i];
  }
  void grow() {
    std::vector<Slot> old(2 * slots_.size());
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.key != nullptr) place(s);
  }
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

class Encoder {
 public:
  Encoder(const py::dict& vocab, int64_t unk_id, int64_t max_input_chars_per_word, const std::string& continuing_prefix,
          const std::vector<std::pair<int64_t, int64_t>>& single_ranges, const std::vector<int64_t>& whitespace,
          int id_bits, int64_t max_cached_words)
      : prefix_(continuing_prefix) {
    if (id_bits != 16 && id_bits != 32) throw py::value_error("id_bits must be 16 or 32, got " + std::to_string(id_bits));
    const int64_t id_limit = int64_t{1} << id_bits;
    if (max_input_chars_per_word < 0)
      throw py::value_error("max_input_chars_per_word must be >= 0, got " + std::to_string(max_input_chars_per_word));
    if (max_cached_words < 0) throw py::value_error("max_cached_words must be >= 0, got " + std::to_string(max_cached_words));
    if (unk_id < 0 || unk_id >= id_limit)
      throw py::value_error("unk_id " + std::to_string(unk_id) + " does not fit " + std::to_string(id_bits) + "-bit ids");
    if (vocab.size() == 0) throw py::value_error("the vocab is empty");
    bits16_ = id_bits == 16;
    max_chars_ = static_cast<uint64_t>(max_input_chars_per_word);
    max_cached_ = static_cast<uint64_t>(max_cached_words);
    unk_ = static_cast<uint32_t>(unk_id);
    // tokens first, then the maps: the maps' string_view keys point into tokens_, which must not move
    tokens_.reserve(vocab.size());
    std::vector<uint32_t> ids;
    ids.reserve(vocab.size());
    for (auto item : vocab) {
      if (!py::isinstance<py::str>(item.first) || !py::isinstance<py::int_>(item.second))
        throw py::value_error("vocab must map token strings to integer ids");
      const int64_t id = item.second.cast<int64_t>();
      tokens_.push_back(item.first.cast<std::string>());
      if (id < 0 || id >= id_limit)
        throw py::value_error("vocab id " + std::to_string(id) + " of token '" + tokens_.back() + "' does not fit " +
                              std::to_string(id_bits) + "-bit ids");
      ids.push_back(static_cast<uint32_t>(id));
    }
    word_start_.reserve(tokens_.size());
    for (size_t i = 0; i < tokens_.size(); ++i) {
      const std::string_view t(tokens_[i]);
      word_start_[t] = ids[i];
      max_start_bytes_ = std::max(max_start_bytes_, t.size());
      // "##abc" is the continuation "abc": HF looks up prefix + substring, the same thing
      if (t.size() >= prefix_.size() && t.compare(0, prefix_.size(), prefix_) == 0) {
        const std::string_view rest = t.substr(prefix_.size());
        continuation_[rest] = ids[i];
        max_continuation_bytes_ = std::max(max_continuation_bytes_, rest.size());
      }
    }
    for (const auto& [lo, hi] : single_ranges) {
      const uint32_t a = check_code_point(lo, "single_ranges"), b = check_code_point(hi, "single_ranges");
      if (a > b) throw py::value_error("single_ranges: range (" + std::to_string(lo) + ", " + std::to_string(hi) + ") is empty");
      for (uint32_t cp = a; cp <= b; ++cp) singles_.add(cp);
    }
    if (whitespace.empty()) throw py::value_error("whitespace is empty (pass the code points where str.isspace() holds)");
    for (int64_t cp : whitespace) space_.add(check_code_point(cp, "whitespace"));
    reset();
  }

  // (ids, bounds) of normalised text whose sentences are separated by ``mark``.
  py::tuple encode(const py::str& text, const py::str& mark) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(text.ptr(), &n);  // cached in the str object: no copy
    if (s == nullptr) throw py::error_already_set();
    if (PyUnicode_GetLength(mark.ptr()) != 1)
      throw py::value_error("sentence_mark must be exactly one character, got " + std::string(py::repr(mark)));
    const uint32_t mark_cp = PyUnicode_ReadChar(mark.ptr(), 0);
    if (!space_.contains(mark_cp))
      throw py::value_error("sentence_mark " + std::string(py::repr(mark)) + " is not whitespace (str.split() would keep it)");
    std::vector<uint32_t> ids;
    std::vector<int64_t> bounds;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mutex_);  // the cache is shared by all callers of this object
      if (cache_.size() > max_cached_) reset();   // bounded memory, checked per document as in Python
      encode_text(reinterpret_cast<const unsigned char*>(s), static_cast<size_t>(n), mark_cp, ids, bounds);
    }
    py::array_t<int64_t> bounds_out(static_cast<py::ssize_t>(bounds.size()));
    std::copy(bounds.begin(), bounds.end(), bounds_out.mutable_data());
    if (bits16_) {
      py::array_t<uint16_t> out(static_cast<py::ssize_t>(ids.size()));
      std::copy(ids.begin(), ids.end(), out.mutable_data());
      return py::make_tuple(std::move(out), std::move(bounds_out));
    }
    py::array_t<uint32_t> out(static_cast<py::ssize_t>(ids.size()));
    std::copy(ids.begin(), ids.end(), out.mutable_data());
    return py::make_tuple(std::move(out), std::move(bounds_out));
  }

  // HF WordPiece of one pre-tokenised word (for tests against tok.model.tokenize).
  std::vector<uint32_t> wordpiece_word(const std::string& word) const {
    std::vector<uint32_t> out;
    size_t chars = 0;
    for (char c : word) chars += !is_continuation_byte(c);
    wordpiece(word, chars, out);
    return out;
  }

  size_t cached_chunks() const { return cache_.size(); }

  void clear_cache() {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mutex_);
    reset();
  }

 private:
  void reset() {
    cache_.clear();
    arena_.clear();
    pieces_.clear();
  }

  bool is_space(const unsigned char* p, size_t& len) const {
    if (*p < 0x80) {
      len = 1;
      return space_.ascii(*p);
    }
    return space_.contains(decode_utf8(p, len));
  }

  void encode_text(const unsigned char* s, size_t n, uint32_t mark_cp, std::vector<uint32_t>& ids,
                   std::vector<int64_t>& bounds) {
    ids.reserve(n / 4 + 16);
    bounds.push_back(0);
    auto close_sentence = [&] {
      if (static_cast<int64_t>(ids.size()) > bounds.back()) bounds.push_back(static_cast<int64_t>(ids.size()));
    };
    size_t i = 0, len = 0;
    while (i < n) {
      if (is_space(s + i, len)) {
        if ((len == 1 ? s[i] : decode_utf8(s + i, len)) == mark_cp) close_sentence();
        i += len;
        continue;
      }
      size_t j = i + len;
      while (j < n) {
        if (s[j] < 0x80) {  // ASCII fast path
          if (space_.ascii(s[j])) break;
          ++j;
        } else if (is_space(s + j, len)) {
          break;
        } else {
          j += len;
        }
      }
      const std::string_view chunk(reinterpret_cast<const char*>(s + i), j - i);
      const uint64_t h = hash_bytes(chunk.data(), chunk.size());
      const Span* span = cache_.find(chunk, h);
      if (span == nullptr) {
        const Span fresh = encode_chunk(chunk);
        span = cache_.insert(arena_.store(chunk), h, fresh);
      }
      const uint32_t* p = pieces_.data() + span->start;
      ids.insert(ids.end(), p, p + span->size);
      i = j;
    }
    close_sentence();
  }

  // Pieces of a whitespace-free chunk, appended to pieces_: each single character is a word, so
  // is each run of other characters (the Python reference's regex findall).
  Span encode_chunk(std::string_view chunk) {
    const size_t first = pieces_.size();
    const auto* s = reinterpret_cast<const unsigned char*>(chunk.data());
    const size_t n = chunk.size();
    size_t i = 0, len = 0, word = 0, word_chars = 0;
    while (i < n) {
      const uint32_t cp = decode_utf8(s + i, len);
      if (singles_.contains(cp)) {
        if (i > word) wordpiece(chunk.substr(word, i - word), word_chars, pieces_);
        wordpiece(chunk.substr(i, len), 1, pieces_);
        word = i + len;
        word_chars = 0;
      } else {
        ++word_chars;
      }
      i += len;
    }
    if (n > word) wordpiece(chunk.substr(word), word_chars, pieces_);
    return Span{first, static_cast<uint32_t>(pieces_.size() - first)};
  }

  // HF tokenizers' WordPiece::tokenize: a word of more than max_input_chars_per_word characters is
  // [UNK]; otherwise greedy longest match from the left (continuations through the prefix), and a
  // position where nothing matches makes the whole word [UNK]. Substrings longer than the longest
  // token cannot match, so the search starts there (same result, fewer lookups).
  void wordpiece(std::string_view w, size_t chars, std::vector<uint32_t>& out) const {
    if (chars > max_chars_) {
      out.push_back(unk_);
      return;
    }
    const size_t mark = out.size();
    size_t start = 0;
    while (start < w.size()) {
      const auto& vocab = start == 0 ? word_start_ : continuation_;
      size_t end = std::min(w.size(), start + (start == 0 ? max_start_bytes_ : max_continuation_bytes_));
      while (end > start && end < w.size() && is_continuation_byte(w[end])) --end;
      bool found = false;
      while (end > start) {
        const auto it = vocab.find(w.substr(start, end - start));
        if (it != vocab.end()) {
          out.push_back(it->second);
          found = true;
          break;
        }
        do --end;
        while (end > start && is_continuation_byte(w[end]));
      }
      if (!found) {
        out.resize(mark);
        out.push_back(unk_);
        return;
      }
      start = end;
    }
  }

  std::string prefix_;
  std::vector<std::string> tokens_;
  std::unordered_map<std::string_view, uint32_t> word_start_, continuation_;
  size_t max_start_bytes_ = 0, max_continuation_bytes_ = 0;
  uint32_t unk_ = 0;
  uint64_t max_chars_ = 100, max_cached_ = 0;
  bool bits16_ = true;
  CodePointSet singles_, space_;
  std::mutex mutex_;
  ChunkCache cache_;  // chunk (bytes in arena_) -> pieces
  Arena arena_;
  std::vector<uint32_t> pieces_;
};

}  // namespace

PYBIND11_MODULE(_native_wordpiece, m) {
  m.doc() = "Native twin of data_pipeline.wordpiece.WordPieceEncoder after normalize() (see data_pipeline/wordpiece.py).";

  py::class_<Encoder>(m, "Encoder", "Whitespace split + chunk cache + punctuation/CJK split + HF WordPiece.")
      .def(py::init<const py::dict&, int64_t, int64_t, const std::string&, const std::vector<std::pair<int64_t, int64_t>>&,
                    const std::vector<int64_t>&, int, int64_t>(),
           py::arg("vocab"), py::kw_only(), py::arg("unk_id"), py::arg("max_input_chars_per_word"),
           py::arg("continuing_prefix"), py::arg("single_ranges"), py::arg("whitespace"), py::arg("id_bits"),
           py::arg("max_cached_words"))
      .def("encode", &Encoder::encode,
           "(ids uint16|uint32, bounds int64) of normalised text; sentences end at each sentence_mark, empty ones dropped.",
           py::arg("normalized_text"), py::arg("sentence_mark"))
      .def("wordpiece", &Encoder::wordpiece_word, "HF WordPiece ids of one pre-tokenised word.", py::arg("word"))
      .def("clear_cache", &Encoder::clear_cache)
      .def("__len__", &Encoder::cached_chunks, "Chunks in the cache.");
}
