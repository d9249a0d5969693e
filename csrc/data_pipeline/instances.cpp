// Native twin of data_pipeline/instance_algorithm.py::create_instances (no torch: Beam workers load it).
//
// One call builds every dupe of one tokenized document and returns the columns of
// InstanceBatch.concat([create_instances(..., d) for d in range(dupe_factor)]) plus the
// InstanceStats counts. The Python code stays the readable reference and the test oracle; this
// file must give BITWISE the same output, so it replays the reference's random draws one for
// one: CPython's random.Random (MT19937) for the segment choices, numpy's PCG64 Generator (seeded
// through SeedSequence, as np.random.PCG64(seed) does) for the masking, splitmix64 for the row
// keys. The generator replicas are in rng_replicas.h; every helper names the Python it mirrors;
// the seeds themselves (blake2b of the seed, document and dupe) come from Python. The ragged
// gather behind InstanceBatch.take, bound in this module too, is in instance_batch.h.
//
// Supported: objectives nsp | sop | none, short_seq_prob, static masking (token-level, whole
// words or spans of whole words, given the vocab's continuation mask; any [MASK] / random / keep
// split), dynamic masking.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "instance_batch.h"
#include "numpy_arrays.h"
#include "rng_replicas.h"

namespace py = pybind11;

namespace {

using namespace bertdist_numpy;  // NOLINT: the checks and conversions every entry point uses
using bertdist_instance_batch::gather_ragged;
using bertdist_replicas::Pcg64;
using bertdist_replicas::PyRandom;
using bertdist_replicas::random_interval;

// bisect.bisect_left(a, x, lo, hi).
inline int64_t bisect_left(const int64_t* a, int64_t x, int64_t lo, int64_t hi) {
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// instances.py::row_keys: splitmix64 of base + j * golden, j = 1..m (uint64 wrap-around).
inline uint64_t row_key(uint64_t base, uint64_t j) {
  uint64_t z = base + j * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// _mask_rows' per-row budget: min(max_pred, max(1, rint(len * prob))) capped by the candidates.
// np.rint rounds half to even, which nearbyint does in the default rounding mode.
inline int64_t mask_budget(int64_t length, double prob, int64_t max_predictions, int64_t candidates) {
  int64_t want = std::max<int64_t>(1, static_cast<int64_t>(std::nearbyint(static_cast<double>(length) * prob)));
  return std::min(std::min(max_predictions, want), candidates);
}

// bertdist/data/masking.py::span_length_cdf: P(length <= k), k = 1..max_words, of the geometric
// distribution p (1 - p)^(k - 1) truncated at max_words and renormalised, with the same sums and
// products in the same order, so the doubles are the same (and the last is exactly 1.0).
inline std::vector<double> span_length_cdf(double p, int64_t max_words) {
  std::vector<double> weights;
  double w = p;
  for (int64_t k = 0; k < max_words; k++) {
    weights.push_back(w);
    w *= 1.0 - p;
  }
  double total = 0.0;
  for (double x : weights) total += x;
  std::vector<double> cdf;
  double acc = 0.0;
  for (double x : weights) {
    acc += x;
    cdf.push_back(acc / total);
  }
  return cdf;
}

// SpanBERT's span lengths, as bertdist/data/masking.py (SPAN_GEOMETRIC_P, SPAN_MAX_WORDS).
constexpr double kSpanGeometricP = 0.2;
constexpr int64_t kSpanMaxWords = 10;

// ------------------------------------------------------------------ inputs

enum class Objective { nsp, sop, none };

struct Params {
  int64_t max_seq_length;
  double short_seq_prob;
  Objective objective;
  double nsp_random_prob;
  bool static_masking;
  double masked_lm_prob;
  int64_t max_predictions_per_seq;
  uint32_t cls_id, sep_id, mask_id;
  uint64_t vocab_size;
  const bool* continuation = nullptr;  // whole-word and span masking: per vocab id, "is a '##' piece"
  uint64_t continuation_size = 0;
  bool span = false;               // span masking (needs the continuation mask)
  std::vector<double> span_cdf;    // span_length_cdf(kSpanGeometricP, kSpanMaxWords)
  double mask_replace_prob = 0.8;  // a chosen position becomes [MASK] if u < this,
  double random_from = 0.9;        // a random id if u >= this (1 - random_replace_prob), else stays
};

// negatives.py::NegativeSource: one bucket's documents in canonical order, packed once per bucket
// and checked once (not once per document). Document e holds ids[id_offsets[e]:id_offsets[e+1]]
// and sentence bounds bounds[bound_offsets[e]:bound_offsets[e+1]] (from 0); its windows are its
// sentences, numbered from offset(e) = the sentences of the documents before it; perm is the
// bucket's shuffle of the window numbers [0, W).
class NegativeSource {
 public:
  NegativeSource(py::array ids_in, py::array id_offsets_in, py::array bounds_in, py::array bound_offsets_in,
                 py::array perm_in)
      : ids_(std::move(ids_in)), id_offsets_(std::move(id_offsets_in)), bounds_(std::move(bounds_in)),
        bound_offsets_(std::move(bound_offsets_in)), perm_(std::move(perm_in)) {
    check_array(ids_, "negatives ids", 1);
    for (auto* a : {&id_offsets_, &bounds_, &bound_offsets_, &perm_}) {
      const char* what = a == &id_offsets_ ? "negatives id_offsets" : a == &bounds_ ? "negatives bounds"
                         : a == &bound_offsets_ ? "negatives bound_offsets" : "negatives perm";
      check_array(*a, what, 1);
      if (!has_dtype<int64_t>(*a))
        throw py::value_error(std::string(what) + ": expected dtype int64, got " + dtype_name(*a));
    }
    if (!has_dtype<uint16_t>(ids_) && !has_dtype<uint32_t>(ids_))
      throw py::value_error("negatives ids: expected dtype uint16 or uint32, got " + dtype_name(ids_));
    size_ = static_cast<int64_t>(id_offsets_.shape(0)) - 1;
    if (size_ < 0) throw py::value_error("negatives id_offsets: expected at least one entry (0), got an empty array");
    if (bound_offsets_.shape(0) != id_offsets_.shape(0))
      throw py::value_error("negatives bound_offsets: expected " + std::to_string(size_ + 1) +
                            " entries (documents + 1), got " + std::to_string(bound_offsets_.shape(0)));
    const int64_t* io = id_offsets();
    const int64_t* bo = bound_offsets();
    const int64_t* b = bounds_data();
    if (io[0] != 0 || io[size_] != ids_.shape(0))
      throw py::value_error("negatives id_offsets: expected to run from 0 to len(ids) = " +
                            std::to_string(ids_.shape(0)) + ", got " + std::to_string(io[0]) + " .. " +
                            std::to_string(io[size_]));
    if (bo[0] != 0 || bo[size_] != bounds_.shape(0))
      throw py::value_error("negatives bound_offsets: expected to run from 0 to len(bounds) = " +
                            std::to_string(bounds_.shape(0)) + ", got " + std::to_string(bo[0]) + " .. " +
                            std::to_string(bo[size_]));
    offsets_.assign(1, 0);
    for (int64_t e = 0; e < size_; e++) {
      if (io[e + 1] < io[e] || bo[e + 1] < bo[e])
        throw py::value_error("negatives offsets: not non-decreasing at document " + std::to_string(e));
      int64_t nb = bo[e + 1] - bo[e];
      const int64_t* eb = b + bo[e];
      // a document is whole sentences: bounds 0 < ... < len(document ids), at least one sentence
      bool ok = nb >= 2 && eb[0] == 0 && eb[nb - 1] == io[e + 1] - io[e];
      for (int64_t j = 1; ok && j < nb; j++) ok = eb[j] > eb[j - 1];
      if (!ok)
        throw py::value_error("negatives document " + std::to_string(e) +
                              ": expected sentence bounds 0 < ... < len(document ids) = " +
                              std::to_string(io[e + 1] - io[e]) + " (strictly increasing, >= 2 entries)");
      offsets_.push_back(offsets_.back() + nb - 1);
    }
    const int64_t windows = offsets_.back();
    if (perm_.shape(0) != windows)
      throw py::value_error("negatives perm: expected a permutation of the " + std::to_string(windows) +
                            " windows (one per sentence), got " + std::to_string(perm_.shape(0)) + " entries");
    std::vector<bool> seen(static_cast<size_t>(windows), false);
    const int64_t* pm = perm();
    for (int64_t j = 0; j < windows; j++) {
      if (pm[j] < 0 || pm[j] >= windows || seen[pm[j]])
        throw py::value_error("negatives perm: not a permutation of [0, " + std::to_string(windows) + "): entry " +
                              std::to_string(j) + " is " + std::to_string(pm[j]));
      seen[pm[j]] = true;
    }
  }

  int64_t size() const { return size_; }
  py::dtype dtype() const { return ids_.dtype(); }
  bool wide() const { return has_dtype<uint32_t>(ids_); }  // uint32 ids, else uint16
  template <typename T>
  const T* ids() const { return static_cast<const T*>(ids_.data()); }
  const int64_t* id_offsets() const { return static_cast<const int64_t*>(id_offsets_.data()); }
  const int64_t* bounds_data() const { return static_cast<const int64_t*>(bounds_.data()); }
  const int64_t* bound_offsets() const { return static_cast<const int64_t*>(bound_offsets_.data()); }
  const int64_t* perm() const { return static_cast<const int64_t*>(perm_.data()); }
  int64_t sentences(int64_t e) const { return offsets_[e + 1] - offsets_[e]; }
  int64_t offset(int64_t e) const { return offsets_[e]; }
  // the document that holds window g: bisect_right(offsets, g) - 1
  int64_t doc_of(int64_t g) const {
    return static_cast<int64_t>(std::upper_bound(offsets_.begin(), offsets_.end(), g) - offsets_.begin()) - 1;
  }


 private:
  py::array ids_, id_offsets_, bounds_, bound_offsets_, perm_;  // kept alive for the raw pointers
  int64_t size_ = 0;
  std::vector<int64_t> offsets_;  // window number of each document's first sentence, W at the end
};

// ------------------------------------------------------------------ the builder

struct Stats {
  int64_t instances = 0, random_next = 0, same_document_fallbacks = 0, skipped_short_sentence = 0;
  int64_t distinct_windows = 0, max_window_reuse = 0;
};

template <typename T>
struct Span {  // a segment: a slice of the document's or of a negative document's ids
  const T* data = nullptr;
  int64_t size = 0;
};

template <typename T>
struct Columns {  // InstanceBatch's columns, all dupes concatenated
  std::vector<uint64_t> keys;
  std::vector<T> ids;
  std::vector<int64_t> ids_offsets{0};
  std::vector<uint16_t> num_a;
  std::vector<int8_t> nsp;
  std::vector<uint16_t> mpos;
  std::vector<T> mids;
  std::vector<int64_t> m_offsets{0};
  Stats stats;
};

// instances.py::_trim: drop `remove` tokens, a coin per token for front or back.
template <typename T>
Span<T> trim(Span<T> s, int64_t remove, PyRandom& rng) {
  if (remove <= 0) return s;
  int64_t front = rng.getrandbits_popcount(remove);
  return {s.data + front, s.size - remove};
}

// instances.py::_truncation_counts.
std::pair<int64_t, int64_t> truncation_counts(int64_t la, int64_t lb, int64_t max_tokens) {
  int64_t ex = la + lb - max_tokens, ra = 0, rb = 0;
  if (ex <= 0) return {0, 0};
  if (la > lb) {
    int64_t d = std::min(ex, la - lb);
    ra = d, ex -= d;
  } else if (lb > la) {
    int64_t d = std::min(ex, lb - la);
    rb = d, ex -= d;
  }
  rb += (ex + 1) / 2;
  ra += ex / 2;
  return {ra, rb};
}

// _mask_rows' selection for one row (see DocumentBuilder::mask_rows), with its scratch space.
class SmallestKeys {
 public:
  // Appends to `chosen` start + the positions of a row's `budget` smallest keys among its
  // candidates (positions 1..end-1 but sep_a), ascending. A plain nth_element over random
  // doubles is bound by branch mispredictions, so this narrows down first, branch-free:
  // (1) The keys are uniform, so the budget-th smallest lies near budget / ncand: the candidates
  //     with keys below a cut a few standard deviations above that are kept, in position order
  //     (about budget + 4 sqrt(budget) of them), or all candidates when fewer than `budget` pass
  //     (rare). The cut only filters: the `budget` smallest are always among the kept.
  // (2) A histogram of the kept keys over [0, cut) finds the bucket that holds the budget-th
  //     smallest (a key's bucket is monotone in the key); nth_element on that bucket's few keys
  //     gives the threshold, the budget-th smallest key.
  // (3) The kept positions with keys <= threshold are the answer, unless keys equal to the
  //     threshold make more than `budget` (ties; see mask_rows): then those below it and the
  //     first equal ones.
  void take(const double* key, int64_t sep_a, int64_t end, int64_t start, int64_t budget, int64_t ncand,
            std::vector<int64_t>& chosen) {
    double cut = (budget + 4.0 * std::sqrt(static_cast<double>(budget)) + 4.0) / static_cast<double>(ncand);
    kept_key_.resize(end - 1);  // room for positions 1..end-1: [SEP] of A is written, then skipped
    kept_pos_.resize(end - 1);
    int64_t kept = 0;
    for (int64_t c = 1; c < end; c++) {  // branch-free append: write always, advance on a pass
      kept_key_[kept] = key[c];
      kept_pos_[kept] = c;
      kept += (c != sep_a) & (key[c] < cut);
    }
    if (kept < budget) {
      kept = 0;
      for (int64_t c = 1; c < end; c++) {
        kept_key_[kept] = key[c];
        kept_pos_[kept] = c;
        kept += c != sep_a;
      }
      cut = 1.0;  // every key is below 1
    }
    constexpr int64_t buckets = 64;
    const double scale = buckets / cut;
    auto bucket = [scale](double v) { return std::min<int64_t>(buckets - 1, static_cast<int64_t>(v * scale)); };
    int64_t hist[buckets] = {0};
    for (int64_t j = 0; j < kept; j++) hist[bucket(kept_key_[j])]++;
    int64_t hit = 0, below = 0;  // keys in the buckets before `hit`
    while (below + hist[hit] < budget) below += hist[hit++];
    bucket_key_.resize(kept);
    int64_t n = 0;
    for (int64_t j = 0; j < kept; j++) {
      bucket_key_[n] = kept_key_[j];
      n += bucket(kept_key_[j]) == hit;
    }
    const int64_t rank = budget - below - 1;
    std::nth_element(bucket_key_.begin(), bucket_key_.begin() + rank, bucket_key_.begin() + n);
    const double threshold = bucket_key_[rank];

    const size_t first = chosen.size();
    chosen.resize(first + kept);
    int64_t* out = chosen.data() + first;
    int64_t k = 0;
    for (int64_t j = 0; j < kept; j++) {
      out[k] = start + kept_pos_[j];
      k += kept_key_[j] <= threshold;
    }
    if (k != budget) {
      int64_t ties = budget;  // keys equal to the threshold to take: those below it come first
      for (int64_t j = 0; j < kept; j++) ties -= kept_key_[j] < threshold;
      k = 0;
      for (int64_t j = 0; j < kept; j++) {
        const double v = kept_key_[j];
        if (v < threshold || (v == threshold && ties-- > 0)) out[k++] = start + kept_pos_[j];
      }
    }
    chosen.resize(first + k);
  }

 private:
  std::vector<double> kept_key_, bucket_key_;
  std::vector<int64_t> kept_pos_;
};

template <typename T>
class DocumentBuilder {
 public:
  DocumentBuilder(const T* ids, const int64_t* bounds, int64_t n_sentences, const Params& p, const NegativeSource* src,
                  int64_t doc_index, Columns<T>& out)
      : ids_(ids), b_(bounds), n_(n_sentences), p_(p), src_(src), doc_index_(doc_index), out_(out) {
    if (src_ != nullptr) uses_.assign(static_cast<size_t>(src_->sentences(doc_index_)), 0);
  }

  // create_instances(..., dupe) followed by _assemble, appended to `out`.
  // The dupes share one run through the deal (DocumentDeal), so call them in order 0, 1, ...
  void dupe(uint64_t mt_seed, uint64_t row_base, uint64_t mask_seed) {
    PyRandom rng(mt_seed);
    segs_a_.clear(), segs_b_.clear(), labels_.clear();
    if (p_.objective == Objective::none) single_segments(rng);
    else pair_segments(rng);
    Stats& st = out_.stats;
    st.instances += static_cast<int64_t>(labels_.size());
    for (int8_t l : labels_) st.random_next += l == 1;
    assemble(row_base, mask_seed);
  }

 private:
  const T* ids_;
  const int64_t* b_;
  int64_t n_;
  const Params& p_;
  const NegativeSource* src_;
  int64_t doc_index_;
  Columns<T>& out_;
  int64_t cursor_ = 0;         // DocumentDeal.cursor: the next of this document's positions
  std::vector<int64_t> uses_;  // DocumentDeal.uses: windows taken per position (all dupes)
  std::vector<Span<T>> segs_a_, segs_b_;  // segs_b_[r].size == 0: no second segment
  std::vector<int8_t> labels_;
  std::vector<double> keys_;  // scratch for the masking
  SmallestKeys smallest_;
  std::vector<int64_t> chosen_;

  Span<T> slice(int64_t s, int64_t e) const { return {ids_ + b_[s], b_[e] - b_[s]}; }

  int64_t draw_target(PyRandom& rng, int64_t max_tokens) {
    int64_t target = max_tokens;
    if (rng.random() < p_.short_seq_prob) target = 2 + rng.below(max_tokens - 1);
    return target;
  }

  void single_segments(PyRandom& rng) {  // objective "none"
    const int64_t max_tokens = p_.max_seq_length - 2;
    const int64_t target = draw_target(rng, max_tokens);
    for (int64_t i = 0; i < n_;) {
      int64_t e = bisect_left(b_, b_[i] + target, i + 1, n_);
      Span<T> seg = slice(i, e);
      if (seg.size > max_tokens) seg = trim(seg, seg.size - max_tokens, rng);
      segs_a_.push_back(seg), segs_b_.push_back({}), labels_.push_back(-1);
      i = e;
    }
  }

  // DocumentDeal.next_window: the next window (source document, start sentence) from this
  // document's positions of the bucket's shuffled windows, skipping its own; false after 10 own
  // windows in a row (or without a source).
  bool deal(int64_t& source, int64_t& start) {
    if (src_ == nullptr) return false;
    const int64_t s = src_->sentences(doc_index_), base = src_->offset(doc_index_);
    const int64_t* perm = src_->perm();
    for (int t = 0; t < 10; t++) {
      const int64_t local = cursor_ % s;
      cursor_++;
      const int64_t g = perm[base + local];
      const int64_t e = src_->doc_of(g);
      if (e != doc_index_) {
        uses_[local]++;
        source = e, start = g - src_->offset(e);
        return true;
      }
    }
    return false;
  }

 public:
  // InstanceStats.count_windows after the last dupe: distinct windows and the largest reuse.
  void end_document() {
    Stats& st = out_.stats;
    for (int64_t u : uses_) {
      st.distinct_windows += u > 0;
      st.max_window_reuse = std::max(st.max_window_reuse, u);
    }
  }

 private:
  void pair_segments(PyRandom& rng) {  // objectives "nsp" and "sop"
    const int64_t max_tokens = p_.max_seq_length - 3;
    const int64_t target = draw_target(rng, max_tokens);
    for (int64_t i = 0; i < n_;) {
      int64_t e = bisect_left(b_, b_[i] + target, i + 1, n_);  // chunk = sentences [i, e), e <= n
      if (e - i == 1 && e < n_) e += 1;  // the reference's fairness fix for over-long sentences
      const int64_t k = e - i;
      const int64_t a_end = k < 2 ? 1 : 1 + rng.below(k - 1);
      Span<T> seg_a = slice(i, i + a_end), seg_b;
      int8_t label = 0;
      int64_t next_i = e;
      if (p_.objective == Objective::nsp) {
        if (k == 1 || rng.random() < p_.nsp_random_prob) {  // k == 1 draws no coin (short-circuit)
          int64_t source = -1, start = 0;
          if (!deal(source, start)) {
            out_.stats.same_document_fallbacks++;
            if (k == 1) {
              i = e;
              continue;
            }
            seg_b = slice(i + a_end, e);
          } else {  // NegativeSource.window
            const int64_t* sb = src_->bounds_data() + src_->bound_offsets()[source];
            const int64_t nb = src_->bound_offsets()[source + 1] - src_->bound_offsets()[source];
            const int64_t end = bisect_left(sb, sb[start] + (target - seg_a.size), start + 1, nb - 1);
            seg_b = {src_->template ids<T>() + src_->id_offsets()[source] + sb[start], sb[end] - sb[start]};
            label = 1;
            next_i = i + a_end;  // the unused segments go back
          }
        } else {
          seg_b = slice(i + a_end, e);
        }
      } else {  // sop
        if (k == 1) {
          if (seg_a.size < 2) {
            out_.stats.skipped_short_sentence++;
            i = e;
            continue;
          }
          const int64_t cut = 1 + rng.below(seg_a.size - 1);
          seg_b = {seg_a.data + cut, seg_a.size - cut};
          seg_a.size = cut;
        } else {
          seg_b = slice(i + a_end, e);
        }
        if (rng.random() < 0.5) {
          std::swap(seg_a, seg_b);
          label = 1;
        }
      }
      if (seg_a.size + seg_b.size > max_tokens) {
        auto [ra, rb] = truncation_counts(seg_a.size, seg_b.size, max_tokens);
        seg_a = trim(seg_a, ra, rng);  // A's coins first, as the reference's tuple evaluates
        seg_b = trim(seg_b, rb, rng);
      }
      segs_a_.push_back(seg_a), segs_b_.push_back(seg_b), labels_.push_back(label);
      i = next_i;
    }
  }

  // instances.py::_assemble (+ _mask_rows for static masking) for this dupe's rows.
  void assemble(uint64_t row_base, uint64_t mask_seed) {
    const size_t m = labels_.size();
    if (m == 0) return;  // the reference returns an empty batch without drawing anything
    const int64_t flat0 = static_cast<int64_t>(out_.ids.size());  // this dupe's first token
    const size_t row0 = out_.num_a.size();                          // and first row
    for (size_t r = 0; r < m; r++) {
      const Span<T>& a = segs_a_[r];
      const Span<T>& b = segs_b_[r];
      out_.ids.push_back(static_cast<T>(p_.cls_id));
      out_.ids.insert(out_.ids.end(), a.data, a.data + a.size);
      out_.ids.push_back(static_cast<T>(p_.sep_id));
      if (b.size > 0) {  // has_b = lb > 0 (segments are never empty with strictly increasing bounds)
        out_.ids.insert(out_.ids.end(), b.data, b.data + b.size);
        out_.ids.push_back(static_cast<T>(p_.sep_id));
      }
      out_.ids_offsets.push_back(static_cast<int64_t>(out_.ids.size()));
      out_.num_a.push_back(static_cast<uint16_t>(a.size + 2));
      out_.nsp.push_back(labels_[r]);
      out_.keys.push_back(row_key(row_base, r + 1));
    }
    if (!p_.static_masking) {  // dynamic: no masks, empty mask lists
      const int64_t last = out_.m_offsets.back();  // a copy: insert may reallocate
      out_.m_offsets.insert(out_.m_offsets.end(), m, last);
      return;
    }
    if (p_.continuation != nullptr) mask_rows_words(flat0, row0, m, mask_seed);
    else mask_rows(flat0, row0, m, mask_seed);
  }

  // instances.py::_mask_rows_words: bertdist.data.masking.mask_sequence row by row, with one
  // Generator for all rows. Per row: the candidates are the non-special positions; a word is a
  // candidate that is not a '##' piece (or follows a special token) plus the '##' pieces right
  // after it; words are visited in the order of rng.permutation(words). Whole words: each is taken
  // greedily while it fits the budget (a word that would overshoot is skipped). Spans: one
  // uniform per word (its span length) follows the permutation, and each visited word starts a
  // span as choose_span_positions grows it. Then u = random(k) and k random ids for the k chosen
  // positions (ascending), as the token-level path does.
  void mask_rows_words(int64_t flat0, size_t row0, size_t m, uint64_t mask_seed) {
    Pcg64 rng(mask_seed);  // np.random.Generator(np.random.PCG64(mask_seed))
    T* flat = out_.ids.data() + flat0;
    const uint64_t high = p_.vocab_size - 1;
    std::vector<int64_t> cand, starts, order, positions;
    std::vector<double> u, span_u;
    std::vector<char> taken;
    for (size_t r = 0; r < m; r++) {
      const int64_t start = out_.ids_offsets[row0 + r] - flat0;
      const int64_t length = out_.ids_offsets[row0 + r + 1] - flat0 - start;
      const int64_t sep_a = static_cast<int64_t>(out_.num_a[row0 + r]) - 1;
      const int64_t end = segs_b_[r].size > 0 ? length - 1 : length;  // [SEP] at length - 1 with B
      T* row = flat + start;
      cand.clear();
      for (int64_t c = 1; c < end; c++)
        if (c != sep_a) cand.push_back(c);
      // mask_sequence does not cap the budget by the candidates; capping changes nothing, since
      // the greedy choice can never take more than all of them
      const int64_t budget =
          mask_budget(length, p_.masked_lm_prob, p_.max_predictions_per_seq, static_cast<int64_t>(cand.size()));
      positions.clear();
      if (!cand.empty()) {  // the reference returns before drawing anything otherwise
        starts.clear();
        for (size_t i = 0; i < cand.size(); i++) {
          const uint64_t id = row[cand[i]];
          if (id >= p_.continuation_size)
            throw py::value_error("word masking: id " + std::to_string(id) + " is outside the continuation mask (" +
                                  std::to_string(p_.continuation_size) + " vocab ids)");
          const bool cont = i > 0 && p_.continuation[id] && cand[i] - cand[i - 1] == 1;
          if (!cont) starts.push_back(static_cast<int64_t>(i));
        }
        const int64_t words = static_cast<int64_t>(starts.size());
        order.resize(words);
        for (int64_t w = 0; w < words; w++) order[w] = w;
        for (int64_t i = words - 1; i >= 1; i--) std::swap(order[i], order[random_interval(rng, i)]);
        // word w is cand[starts[w] .. word_end(w)), cand indices
        auto word_end = [&](int64_t w) { return w + 1 < words ? starts[w + 1] : static_cast<int64_t>(cand.size()); };
        int64_t total = 0;
        if (!p_.span) {
          for (int64_t w : order) {
            if (total >= budget) break;
            const int64_t first = starts[w];
            const int64_t last = word_end(w);
            if (total + (last - first) > budget) continue;
            for (int64_t i = first; i < last; i++) positions.push_back(cand[i]);
            total += last - first;
          }
        } else {  // masking.py::choose_span_positions, lengths from span_lengths(rng.random(words))
          span_u.resize(words);
          rng.fill_doubles(span_u.data(), words);
          taken.assign(words, 0);
          for (int64_t w : order) {
            if (total >= budget) break;
            int64_t size = word_end(w) - starts[w];
            if (taken[w] || total + size > budget) continue;
            int64_t want = 1;  // 1 + #{k : cdf[k] <= u}
            for (double c : p_.span_cdf) want += c <= span_u[w];
            int64_t end = w + 1;
            while (end < words && end - w < want && !taken[end] &&
                   cand[starts[end]] == cand[starts[end] - 1] + 1 &&  // no special token between the words
                   total + size + (word_end(end) - starts[end]) <= budget) {
              size += word_end(end) - starts[end];
              end++;
            }
            for (int64_t x = w; x < end; x++) {
              taken[x] = 1;
              for (int64_t i = starts[x]; i < word_end(x); i++) positions.push_back(cand[i]);
            }
            total += size;
          }
        }
        std::sort(positions.begin(), positions.end());
      }
      const size_t k = positions.size();
      u.resize(k);
      rng.fill_doubles(u.data(), static_cast<int64_t>(k));
      for (int64_t pos : positions) {
        out_.mpos.push_back(static_cast<uint16_t>(pos));
        out_.mids.push_back(row[pos]);  // labels: the original ids
      }
      for (size_t j = 0; j < k; j++) {
        const T rand_id = static_cast<T>(rng.bounded(high));  // every random id is drawn, whatever u says
        if (u[j] < p_.mask_replace_prob) row[positions[j]] = static_cast<T>(p_.mask_id);
        else if (u[j] >= p_.random_from) row[positions[j]] = rand_id;
      }
      out_.m_offsets.push_back(out_.m_offsets.back() + static_cast<int64_t>(k));
    }
  }

  // instances.py::_mask_rows. numpy argsorts a [rows, width] matrix of uniform keys (specials and
  // padding 2.0) and keeps the first `budget` per row, i.e. the `budget` smallest keys among the
  // non-special positions. Here: the budget-th smallest key of the row is the threshold, and
  // the positions at or below it are taken in ascending order, the order np.nonzero emits them
  // (SmallestKeys). The two agree unless two keys of a row are equal doubles at the threshold
  // (numpy's unstable argsort may then pick either; about L^2 / 2^54 per row, so it does not
  // occur in practice, and the parity tests would show it); even then exactly `budget`
  // positions are taken. The draws keep the reference's order: a key for every flat position
  // (specials included), then u for the chosen positions (row-major, ascending), then the
  // random ids.
  void mask_rows(int64_t flat0, size_t row0, size_t m, uint64_t mask_seed) {
    Pcg64 rng(mask_seed);  // np.random.Generator(np.random.PCG64(mask_seed))
    const int64_t total = static_cast<int64_t>(out_.ids.size()) - flat0;
    keys_.resize(total);
    rng.fill_doubles(keys_.data(), total);
    chosen_.clear();
    std::vector<int64_t> counts(m);
    for (size_t r = 0; r < m; r++) {
      const int64_t start = out_.ids_offsets[row0 + r] - flat0;
      const int64_t length = out_.ids_offsets[row0 + r + 1] - flat0 - start;
      const double* key = keys_.data() + start;
      const int64_t sep_a = static_cast<int64_t>(out_.num_a[row0 + r]) - 1;  // [CLS] at 0, [SEP] at num_a - 1
      const int64_t end = segs_b_[r].size > 0 ? length - 1 : length;       // and at length - 1 with B
      const int64_t ncand = end - 2;
      const int64_t budget = mask_budget(length, p_.masked_lm_prob, p_.max_predictions_per_seq, ncand);
      if (budget <= 0) continue;  // numpy keeps no position when the budget is not positive
      smallest_.take(key, sep_a, end, start, budget, ncand, chosen_);
      counts[r] = budget;
    }
    const size_t nc = chosen_.size();
    std::vector<double> u(nc);
    rng.fill_doubles(u.data(), static_cast<int64_t>(nc));
    T* flat = out_.ids.data() + flat0;
    for (size_t j = 0; j < nc; j++) out_.mids.push_back(flat[chosen_[j]]);  // labels: the original ids
    const uint64_t high = p_.vocab_size - 1;
    for (size_t j = 0; j < nc; j++) {
      // every random id is drawn, whatever u says, and cast to the id dtype as .astype() does
      const T rand_id = static_cast<T>(rng.bounded(high));
      if (u[j] < p_.mask_replace_prob) flat[chosen_[j]] = static_cast<T>(p_.mask_id);
      else if (u[j] >= p_.random_from) flat[chosen_[j]] = rand_id;
    }
    size_t j = 0;
    for (size_t r = 0; r < m; r++) {
      const int64_t start = out_.ids_offsets[row0 + r] - flat0;
      for (int64_t c = 0; c < counts[r]; c++, j++) out_.mpos.push_back(static_cast<uint16_t>(chosen_[j] - start));
      out_.m_offsets.push_back(out_.m_offsets.back() + counts[r]);
    }
  }
};

// ------------------------------------------------------------------ Python interface

template <typename T>
py::tuple build_typed(const py::array& ids, const py::array& bounds, const uint64_t* mt_seeds, const uint64_t* row_bases,
                      const uint64_t* mask_seeds, int64_t dupes, const Params& p, const NegativeSource* src,
                      int64_t doc_index) {
  const int64_t max_id = std::numeric_limits<T>::max();
  for (auto [name, v] : {std::pair{"cls_id", p.cls_id}, std::pair{"sep_id", p.sep_id}, std::pair{"mask_id", p.mask_id}})
    if (v > max_id)
      throw py::value_error(std::string(name) + " " + std::to_string(v) + " does not fit the ids' dtype " +
                            dtype_name(ids));
  Columns<T> out;
  {
    py::gil_scoped_release no_gil;  // the inputs stay alive (the caller holds them); no Python inside
    const int64_t n = static_cast<int64_t>(bounds.shape(0)) - 1;
    const int64_t tokens = static_cast<int64_t>(ids.shape(0));
    const size_t expect = static_cast<size_t>(dupes) * static_cast<size_t>(tokens + tokens / 8 + 16);
    out.ids.reserve(expect);  // every token about once per dupe, plus the specials
    DocumentBuilder<T> builder(static_cast<const T*>(ids.data()), static_cast<const int64_t*>(bounds.data()), n, p, src,
                               doc_index, out);
    for (int64_t d = 0; d < dupes; d++) builder.dupe(mt_seeds[d], row_bases[d], mask_seeds[d]);
    builder.end_document();
  }
  const Stats st = out.stats;
  return py::make_tuple(to_numpy(std::move(out.keys)), to_numpy(std::move(out.ids)), to_numpy(std::move(out.ids_offsets)),
                        to_numpy(std::move(out.num_a)), to_numpy(std::move(out.nsp)), to_numpy(std::move(out.mpos)),
                        to_numpy(std::move(out.mids)), to_numpy(std::move(out.m_offsets)),
                        py::make_tuple(st.instances, st.random_next, st.same_document_fallbacks, st.skipped_short_sentence,
                                       st.distinct_windows, st.max_window_reuse));
}

py::tuple build_document(py::array ids, py::array bounds, py::array mt_seeds, py::array row_bases, py::array mask_seeds,
                         int64_t max_seq_length, double short_seq_prob, const std::string& objective,
                         double nsp_random_prob, const std::string& masking, double masked_lm_prob,
                         int64_t max_predictions_per_seq, bool whole_word_mask, int64_t cls_id, int64_t sep_id,
                         int64_t mask_id, int64_t vocab_size, const NegativeSource* negatives, int64_t doc_index,
                         py::object continuation, const std::string& masking_mode, double mask_replace_prob,
                         double random_replace_prob) {
  check_array(ids, "ids", 1);
  const bool u16 = has_dtype<uint16_t>(ids);
  if (!u16 && !has_dtype<uint32_t>(ids))
    throw py::value_error("ids: expected dtype uint16 or uint32, got " + dtype_name(ids));
  check_array(bounds, "bounds", 1);
  check_dtype<int64_t>(bounds, "bounds");
  const int64_t nb = bounds.shape(0);
  if (nb < 1) throw py::value_error("bounds: expected at least one entry (0), got an empty array");
  const int64_t* b = static_cast<const int64_t*>(bounds.data());
  if (b[0] != 0 || b[nb - 1] != ids.shape(0))
    throw py::value_error("bounds: expected to run from 0 to len(ids) = " + std::to_string(ids.shape(0)) + ", got " +
                          std::to_string(b[0]) + " .. " + std::to_string(b[nb - 1]));
  for (int64_t i = 1; i < nb; i++)
    if (b[i] <= b[i - 1])  // empty sentences would make empty segments, which the reference mis-assembles
      throw py::value_error("bounds: expected strictly increasing (no empty sentence), got bounds[" +
                            std::to_string(i - 1) + "] = " + std::to_string(b[i - 1]) + " >= bounds[" +
                            std::to_string(i) + "] = " + std::to_string(b[i]));
  check_array(mt_seeds, "mt_seeds", 1);
  check_dtype<uint64_t>(mt_seeds, "mt_seeds");
  const int64_t dupes = mt_seeds.shape(0);
  check_array(row_bases, "row_bases", 1);
  check_dtype<uint64_t>(row_bases, "row_bases");
  check_array(mask_seeds, "mask_seeds", 1);
  check_dtype<uint64_t>(mask_seeds, "mask_seeds");
  if (row_bases.shape(0) != dupes || mask_seeds.shape(0) != dupes)
    throw py::value_error("seeds: expected mt_seeds, row_bases, mask_seeds of one length (the dupe factor), got " +
                          std::to_string(dupes) + ", " + std::to_string(row_bases.shape(0)) + ", " +
                          std::to_string(mask_seeds.shape(0)));
  Params p{};
  if (max_seq_length < 8 || max_seq_length > 65535)
    throw py::value_error("max_seq_length: expected 8 <= max_seq_length <= 65535, got " + std::to_string(max_seq_length));
  p.max_seq_length = max_seq_length;
  p.short_seq_prob = short_seq_prob;
  if (objective == "nsp") p.objective = Objective::nsp;
  else if (objective == "sop") p.objective = Objective::sop;
  else if (objective == "none") p.objective = Objective::none;
  else throw py::value_error("objective: expected one of nsp, sop, none, got '" + objective + "'");
  p.nsp_random_prob = nsp_random_prob;
  if (masking != "static" && masking != "dynamic")
    throw py::value_error("masking: expected static or dynamic, got '" + masking + "'");
  p.static_masking = masking == "static";
  // masking_mode "" follows whole_word_mask; given, it must agree with it (InstanceParams resolves
  // both the same way, so the bridge always passes a pair that agrees)
  std::string mode = masking_mode.empty() ? (whole_word_mask ? "whole_word" : "token") : masking_mode;
  if (mode != "token" && mode != "whole_word" && mode != "span")
    throw py::value_error("masking_mode: expected token, whole_word or span, got '" + masking_mode + "'");
  if (whole_word_mask != (mode == "whole_word"))
    throw py::value_error("masking_mode: '" + mode + "' disagrees with whole_word_mask=" +
                          (whole_word_mask ? "True" : "False") + " (True is whole_word, False token or span)");
  p.span = mode == "span";
  if (p.span) p.span_cdf = span_length_cdf(kSpanGeometricP, kSpanMaxWords);
  if (!(mask_replace_prob >= 0.0 && mask_replace_prob <= 1.0 && random_replace_prob >= 0.0 &&
        random_replace_prob <= 1.0 && mask_replace_prob + random_replace_prob <= 1.0))
    throw py::value_error("mask_replace_prob " + std::to_string(mask_replace_prob) + " and random_replace_prob " +
                          std::to_string(random_replace_prob) + ": expected each in [0, 1], adding up to at most 1");
  p.mask_replace_prob = mask_replace_prob;
  p.random_from = 1.0 - random_replace_prob;  // as the reference computes its threshold
  py::array cont_array;  // kept alive until the build is done
  if (p.static_masking && mode != "token") {
    if (continuation.is_none())
      throw py::value_error("continuation: " + std::string(p.span ? "span" : "whole-word") +
                            " masking needs the vocab's continuation mask, got None");
    cont_array = continuation.cast<py::array>();
    check_array(cont_array, "continuation", 1);
    check_dtype<bool>(cont_array, "continuation");
    if (cont_array.shape(0) != vocab_size)
      throw py::value_error("continuation: expected one entry per vocab id (" + std::to_string(vocab_size) + "), got " +
                            std::to_string(cont_array.shape(0)));
    p.continuation = static_cast<const bool*>(cont_array.data());
    p.continuation_size = static_cast<uint64_t>(cont_array.shape(0));
  }
  if (!(masked_lm_prob >= 0.0 && masked_lm_prob <= 1.0))
    throw py::value_error("masked_lm_prob: expected a value in [0, 1], got " + std::to_string(masked_lm_prob));
  p.masked_lm_prob = masked_lm_prob;
  p.max_predictions_per_seq = max_predictions_per_seq;
  // ids are checked against the dtype in build_typed; negative ids never fit
  for (auto [name, v] : {std::pair{"cls_id", cls_id}, std::pair{"sep_id", sep_id}, std::pair{"mask_id", mask_id}})
    if (v < 0 || v > 0xFFFFFFFFLL) throw py::value_error(std::string(name) + ": expected a uint32 id, got " + std::to_string(v));
  p.cls_id = static_cast<uint32_t>(cls_id), p.sep_id = static_cast<uint32_t>(sep_id), p.mask_id = static_cast<uint32_t>(mask_id);
  if (vocab_size < 1 || vocab_size > (1LL << 32))  // larger would take numpy's 64-bit integers path
    throw py::value_error("vocab_size: expected 1 <= vocab_size <= 2**32, got " + std::to_string(vocab_size));
  p.vocab_size = static_cast<uint64_t>(vocab_size);
  if (negatives != nullptr) {
    if (negatives->size() > 0 && negatives->wide() == u16)
      throw py::value_error("negatives ids: expected the document's dtype " + dtype_name(ids) + ", got " +
                            py::str(negatives->dtype()).cast<std::string>() + " (one vocab, one dtype)");
    if (doc_index < 0 || doc_index >= negatives->size())
      throw py::value_error("doc_index: expected the document's place in the negative source, 0 <= doc_index < " +
                            std::to_string(negatives->size()) + ", got " + std::to_string(doc_index));
    if (negatives->sentences(doc_index) != nb - 1)
      throw py::value_error("doc_index " + std::to_string(doc_index) + ": the negative source's document there has " +
                            std::to_string(negatives->sentences(doc_index)) + " sentences, this one " +
                            std::to_string(nb - 1) + " (not the same document)");
  }
  const auto* seeds = static_cast<const uint64_t*>(mt_seeds.data());
  const auto* rows = static_cast<const uint64_t*>(row_bases.data());
  const auto* masks = static_cast<const uint64_t*>(mask_seeds.data());
  if (u16) return build_typed<uint16_t>(ids, bounds, seeds, rows, masks, dupes, p, negatives, doc_index);
  return build_typed<uint32_t>(ids, bounds, seeds, rows, masks, dupes, p, negatives, doc_index);
}

}  // namespace

PYBIND11_MODULE(_native_instances, m) {
  m.doc() = "Native twin of data_pipeline.instance_algorithm.create_instances (see data_pipeline/instance_native.py).";

  py::class_<NegativeSource>(m, "NegativeSource",
                             "One bucket's documents and window shuffle, packed into flat arrays (checked once).")
      .def(py::init<py::array, py::array, py::array, py::array, py::array>(), py::arg("ids"), py::arg("id_offsets"),
           py::arg("bounds"), py::arg("bound_offsets"), py::arg("perm"))
      .def("__len__", &NegativeSource::size);

  m.def("build_document", &build_document,
        "All dupes of one document: (keys, ids, ids_offsets, num_a, nsp, mpos, mids, m_offsets, "
        "(instances, random_next, same_document_fallbacks, skipped_short_sentence, distinct_windows, "
        "max_window_reuse)).",
        py::arg("ids"), py::arg("bounds"), py::arg("mt_seeds"), py::arg("row_bases"), py::arg("mask_seeds"), py::kw_only(),
        py::arg("max_seq_length"), py::arg("short_seq_prob"), py::arg("objective"), py::arg("nsp_random_prob"),
        py::arg("masking"), py::arg("masked_lm_prob"), py::arg("max_predictions_per_seq"), py::arg("whole_word_mask"),
        py::arg("cls_id"), py::arg("sep_id"), py::arg("mask_id"), py::arg("vocab_size"), py::arg("negatives").none(true),
        py::arg("doc_index"), py::arg("continuation") = py::none(), py::arg("masking_mode") = "",
        py::arg("mask_replace_prob") = 0.8, py::arg("random_replace_prob") = 0.1);

  m.def("gather_ragged", &gather_ragged,
        "Rows `rows` (int64) of the ragged column (values: uint16/uint32/int64, offsets: int64, n_rows + 1): "
        "(values, offsets) of the result, offsets from 0.",
        py::arg("values"), py::arg("offsets"), py::arg("rows"));

  // The random-number replicas on their own, for the tests that hold them to CPython and numpy.
  py::module_ t = m.def_submodule("testing", "RNG replicas, exposed for tests only.");
  t.def("mt_draws", [](uint64_t seed, const std::vector<int64_t>& ops) {
    // op 0: random(); op k > 0: popcount(getrandbits(k)); op -n: _below(rng, n)
    PyRandom rng(seed);
    std::vector<double> out;
    for (int64_t op : ops)
      out.push_back(op == 0 ? rng.random() : op > 0 ? static_cast<double>(rng.getrandbits_popcount(op))
                                                    : static_cast<double>(rng.below(-op)));
    return out;
  }, py::arg("seed"), py::arg("ops"));
  t.def("bisect_left", [](const std::vector<int64_t>& a, int64_t x, int64_t lo, int64_t hi) {
    if (lo < 0 || hi > static_cast<int64_t>(a.size()) || lo > hi) throw py::value_error("bisect_left: bad lo/hi");
    return bisect_left(a.data(), x, lo, hi);
  });
  t.def("pcg64_state", [](uint64_t seed) {
    // np.random.PCG64(seed).state["state"] as (state, inc), 128-bit Python ints
    Pcg64 rng(seed);
    auto to_int = [](Pcg64::u128 v) {
      return py::int_(static_cast<uint64_t>(v >> 64)).attr("__lshift__")(64).attr("__or__")(
          py::int_(static_cast<uint64_t>(v)));
    };
    return py::make_tuple(to_int(rng.state()), to_int(rng.inc()));
  });
  t.def("pcg_draws", [](uint64_t seed, int64_t n_doubles, uint64_t high, int64_t n_ints) {
    // Generator(PCG64(seed)).random(n_doubles), then .integers(0, high, size=n_ints)
    if (high < 1 || high > (1ULL << 32)) throw py::value_error("pcg_draws: high must be in [1, 2**32]");
    Pcg64 rng(seed);
    std::vector<double> d;
    std::vector<int64_t> ints;
    // the first half one at a time, the rest in one fill: both paths against numpy
    for (int64_t j = 0; j < n_doubles / 2; j++) d.push_back(rng.next_double());
    d.resize(n_doubles);
    rng.fill_doubles(d.data() + n_doubles / 2, n_doubles - n_doubles / 2);
    for (int64_t j = 0; j < n_ints; j++) ints.push_back(static_cast<int64_t>(rng.bounded(high - 1)));
    return py::make_tuple(d, ints);
  });
  t.def("take_smallest", [](const std::vector<double>& key, int64_t sep_a, int64_t end, int64_t budget) {
    // one row's selection: positions 1..end-1 but sep_a are the candidates, keys in [0, 1)
    if (end < 3 || end > static_cast<int64_t>(key.size()) || sep_a < 1 || sep_a >= end || budget < 1 ||
        budget > end - 2)
      throw py::value_error("take_smallest: need 1 <= sep_a < end <= len(key), 1 <= budget <= end - 2");
    for (double v : key)
      if (!(v >= 0.0 && v < 1.0)) throw py::value_error("take_smallest: keys must be in [0, 1) (uniform draws)");
    SmallestKeys s;
    std::vector<int64_t> chosen;
    s.take(key.data(), sep_a, end, 0, budget, end - 2, chosen);
    return chosen;
  }, py::arg("key"), py::arg("sep_a"), py::arg("end"), py::arg("budget"));
  t.def("row_keys", [](uint64_t base, int64_t m) {
    std::vector<uint64_t> out;
    for (int64_t j = 1; j <= m; j++) out.push_back(row_key(base, static_cast<uint64_t>(j)));
    return to_numpy(std::move(out));
  });
  t.def("span_length_cdf", &span_length_cdf, py::arg("p"), py::arg("max_words"));
  t.def("mask_budget", &mask_budget, py::arg("length"), py::arg("prob"), py::arg("max_predictions"),
        py::arg("candidates"));
}
