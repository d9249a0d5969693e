"""The instance algorithm as pure functions: tokenized documents to MLM/NSP training instances.

google-research/bert create_pretraining_data.py semantics, made deterministic per document and
vectorised where the reference loops. The Beam transform that runs it is
:mod:`data_pipeline.beam.instance_transform`; its C++ twin is reached through
:mod:`data_pipeline.instance_native`.

A tokenized document is ``(doc_id, ids, bounds)``: all its token ids concatenated and the
sentence boundaries (``ids[bounds[i]:bounds[i+1]]`` is sentence i), so segments are slices.

Determinism: every random choice for (document, dupe) comes from RNGs seeded by
``derive_seed(seed, doc_id, dupe)``; an NSP negative comes from the document's bucket, whose
content and order depend only on the corpus and the seed (:mod:`data_pipeline.negatives`).
Nothing depends on bundling, order or worker count.

Differences from the reference, on purpose:
  - NSP negatives. The reference holds the whole corpus in memory and, for every random-next row,
    draws a uniformly random other document, then a uniformly random start sentence in it. A
    distributed pipeline cannot hold the corpus, so here:
      * the other document comes from the document's *bucket*, not the whole corpus: the
        documents whose placement hash falls in the same range, about ``nsp_bucket_tokens``
        tokens of them (thousands of Wikipedia articles; the whole split for a small corpus, so
        there the choice is corpus-wide). Held-out documents draw from held-out documents only;
      * the (document, start sentence) window is *dealt* rather than drawn: the bucket's windows
        are shuffled once, and each document reads its own run of the shuffled order, its dupes
        one after the other (see negatives.py). So a negative starts at a uniformly random
        sentence of the bucket: a document is chosen in proportion to its sentence count, where
        the reference picks documents uniformly. And a window is not reused until a document
        needs more negatives, over all its dupes, than it has sentences. On the Wikipedia
        fragment and the 14 books (seq 128), the random-next rows take 1.00 distinct windows
        per row at dupe 1 and 0.96 at dupe 5; the reference takes 0.64 and 0.28, because it
        reuses the sentences of short documents (benchmarks/data_pipeline.py --negatives).
      * When 10 positions in a row hold windows of the document itself (a bucket of one or two
        documents), the row falls back to the true continuation, labelled IsNext and counted
        (``same_document_fallbacks``); the reference then takes B from the same document and
        labels it random-next.
    B is then read as in the reference: whole sentences from the start until the target length.
  - ``truncate_seq_pair`` removes the same number of tokens from the same segments as the
    reference; the front/back choice per removed token is an independent coin flip as in the
    reference, drawn as one batch of random bits.
  - Whole-word groups never cross [SEP] (the reference joins a '##' piece that starts segment B
    to the last word of A).
  - Span masking (``masking_mode: span``, SpanBERT's selection with whole words, see
    :mod:`bertdist.data.masking`) is not in the reference; it masks row by row through the oracle,
    as whole-word masking does.
  - A chunk that would hold a single sentence (longer than the target) also takes the next
    sentence, so A/B are split and the 50% coin is tossed; the reference forces a random B
    there, which pushes the random-next rate above 50% (by ~4 points on real text). Only a
    single sentence left at a document's end still forces a random B.
  - SOP with a one-sentence chunk splits that sentence at a random token (the reference would
    take B from a random document, which is NSP, not SOP).
"""
from __future__ import annotations

import random
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from bertdist.data.masking import MASKING_MODES, check_replace_probs, mask_sequence
from data_pipeline.instance_batch import InstanceBatch
from data_pipeline.negatives import DocumentDeal
from data_pipeline.seeds import derive_seed


@dataclass(frozen=True)
class InstanceParams:
    max_seq_length: int
    short_seq_prob: float
    objective: str  # nsp | sop | none
    nsp_random_prob: float
    masking: str  # static | dynamic
    masked_lm_prob: float
    max_predictions_per_seq: int
    whole_word_mask: bool  # the older setting: True is masking_mode whole_word, False token
    cls_id: int
    sep_id: int
    mask_id: int
    vocab_size: int
    masking_mode: str = ""  # token | whole_word | span; "" = from whole_word_mask
    mask_replace_prob: float = 0.8  # a chosen position becomes [MASK] ...
    random_replace_prob: float = 0.1  # ... or a random id; the rest keep their token

    def __post_init__(self):
        # whole_word_mask here is a plain bool, so only True can disagree with a masking_mode
        mode = self.masking_mode or ("whole_word" if self.whole_word_mask else "token")
        if mode not in MASKING_MODES or (self.whole_word_mask and mode != "whole_word"):
            raise ValueError(f"masking_mode {self.masking_mode!r} with whole_word_mask={self.whole_word_mask}: "
                             f"expected one of {list(MASKING_MODES)}, and whole_word_mask=True only with whole_word")
        object.__setattr__(self, "masking_mode", mode)  # resolved once: the builders read only this
        check_replace_probs(self.mask_replace_prob, self.random_replace_prob)

    @property
    def needs_words(self) -> bool:
        """Whether static masking needs the vocab's continuation mask (whole words or spans)."""
        return self.masking == "static" and self.masking_mode != "token"


@dataclass
class InstanceStats:
    """Counts of one or more documents. ``distinct_windows`` and ``max_window_reuse`` describe the
    NSP negatives' (document, start sentence) windows, counted per document by
    :meth:`count_windows` (two documents never share a window: they read different positions of
    their bucket's deal, so the sums are corpus-wide counts)."""

    instances: int = 0
    random_next: int = 0
    same_document_fallbacks: int = 0
    skipped_short_sentence: int = 0
    distinct_windows: int = 0
    max_window_reuse: int = 0

    def count_windows(self, deal: DocumentDeal | None) -> None:
        """A document's windows, after its last dupe."""
        if deal is not None and deal.uses:
            self.distinct_windows += len(deal.uses)
            self.max_window_reuse = max(self.max_window_reuse, max(deal.uses.values()))

    def add(self, other: "InstanceStats") -> None:
        """Fold another (ended) document's or unit's counts in."""
        for name in ("instances", "random_next", "same_document_fallbacks", "skipped_short_sentence",
                     "distinct_windows"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_window_reuse = max(self.max_window_reuse, other.max_window_reuse)


def expected_instances(tokens: int, dupe_factor: int, max_seq_length: int) -> int:
    """Rough instance count for ``tokens`` document tokens: one row per (max_seq_length - 3)
    tokens and dupe, 0.9 of that for the shorter rows (short_seq_prob, document ends). It only
    sizes buckets (memory and reads), never the output."""
    return int(dupe_factor * tokens / (0.9 * (max_seq_length - 3))) + 1


def _truncation_counts(la: int, lb: int, max_tokens: int) -> tuple[int, int]:
    """Tokens the reference's truncate_seq_pair removes from (A, B): always from the longer
    segment, from B on ties."""
    ex = la + lb - max_tokens
    ra = rb = 0
    if ex <= 0:
        return 0, 0
    if la > lb:
        d = min(ex, la - lb)
        ra, ex = d, ex - d
    elif lb > la:
        d = min(ex, lb - la)
        rb, ex = d, ex - d
    rb += (ex + 1) // 2
    ra += ex // 2
    return ra, rb


def _trim(seg: np.ndarray, remove: int, rng: random.Random) -> np.ndarray:
    if remove <= 0:
        return seg
    front = rng.getrandbits(remove).bit_count()  # Binomial(remove, 1/2) fronts
    return seg[front: seg.shape[0] - (remove - front)]


def _below(rng: random.Random, n: int) -> int:
    """Uniform in [0, n): one C call (randrange is several Python frames per draw)."""
    return int(rng.random() * n)


def row_keys(base: int, m: int) -> np.ndarray:
    """``m`` well-mixed 64-bit keys from one seed (splitmix64 of base + j), vectorised."""
    with np.errstate(over="ignore"):
        z = np.uint64(base) + np.arange(1, m + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def create_instances(
    doc_id: str,
    ids: np.ndarray,
    bounds: np.ndarray,
    dupe: int,
    *,
    params: InstanceParams,
    seed: int,
    negatives: DocumentDeal | None = None,
    continuation: np.ndarray | None = None,
    stats: InstanceStats | None = None,
) -> InstanceBatch:
    """All instances of one (document, dupe) pass, masked when ``params.masking == 'static'``.

    ``negatives`` is the document's run through its bucket's deal
    (``NegativeSource.dealer(place)``), shared by its dupes in order 0, 1, ...; without it every
    random-next row falls back to the true continuation (counted). Call
    ``stats.count_windows(negatives)`` after the document's last dupe."""
    stats = stats if stats is not None else InstanceStats()
    rng = random.Random(derive_seed(seed, doc_id, dupe))
    p = params
    b = bounds.tolist()
    n = len(b) - 1
    segs_a: list[np.ndarray] = []
    segs_b: list[np.ndarray | None] = []
    labels: list[int] = []
    if p.objective == "none":
        max_tokens = p.max_seq_length - 2
        target = max_tokens
        if rng.random() < p.short_seq_prob:
            target = 2 + _below(rng, max_tokens - 1)
        i = 0
        while i < n:
            e = bisect_left(b, b[i] + target, i + 1, n)
            seg = ids[b[i]:b[e]]
            if seg.shape[0] > max_tokens:
                seg = _trim(seg, seg.shape[0] - max_tokens, rng)
            segs_a.append(seg)
            segs_b.append(None)
            labels.append(-1)
            i = e
    else:
        max_tokens = p.max_seq_length - 3
        target = max_tokens
        if rng.random() < p.short_seq_prob:
            target = 2 + _below(rng, max_tokens - 1)
        i = 0
        while i < n:
            e = bisect_left(b, b[i] + target, i + 1, n)  # chunk = sentences [i, e), e <= n
            if e - i == 1 and e < n:
                e += 1  # see module docstring: keep the coin toss fair for over-long sentences
            k = e - i
            a_end = 1 if k < 2 else 1 + _below(rng, k - 1)
            seg_a = ids[b[i]:b[i + a_end]]
            label = 0
            next_i = e
            if p.objective == "nsp":
                if k == 1 or rng.random() < p.nsp_random_prob:
                    dealt = None if negatives is None else negatives.next_window()
                    if dealt is None:
                        stats.same_document_fallbacks += 1
                        if k == 1:
                            i = e
                            continue
                        seg_b = ids[b[i + a_end]:b[e]]
                    else:
                        source, start = dealt
                        seg_b = negatives.source.window(source, start, target - seg_a.shape[0])
                        label = 1
                        next_i = i + a_end  # the unused segments go back
                else:
                    seg_b = ids[b[i + a_end]:b[e]]
            else:  # sop
                if k == 1:
                    if seg_a.shape[0] < 2:
                        stats.skipped_short_sentence += 1
                        i = e
                        continue
                    cut = 1 + _below(rng, seg_a.shape[0] - 1)
                    seg_a, seg_b = seg_a[:cut], seg_a[cut:]
                else:
                    seg_b = ids[b[i + a_end]:b[e]]
                if rng.random() < 0.5:
                    seg_a, seg_b = seg_b, seg_a
                    label = 1
            if seg_a.shape[0] + seg_b.shape[0] > max_tokens:
                ra, rb = _truncation_counts(seg_a.shape[0], seg_b.shape[0], max_tokens)
                seg_a, seg_b = _trim(seg_a, ra, rng), _trim(seg_b, rb, rng)
            segs_a.append(seg_a)
            segs_b.append(seg_b)
            labels.append(label)
            i = next_i
    stats.instances += len(labels)
    stats.random_next += sum(1 for x in labels if x == 1)
    return _assemble(doc_id, dupe, segs_a, segs_b, labels, ids.dtype, params, seed, continuation)


def _assemble(doc_id, dupe, segs_a, segs_b, labels, dtype, p: InstanceParams, seed, continuation) -> InstanceBatch:
    m = len(labels)
    if m == 0:
        return InstanceBatch.empty(dtype)
    la = np.fromiter((s.shape[0] for s in segs_a), np.int64, m)
    lb = np.fromiter((0 if s is None else s.shape[0] for s in segs_b), np.int64, m)
    has_b = lb > 0
    lengths = la + 2 + np.where(has_b, lb + 1, 0)
    offs = np.zeros(m + 1, np.int64)
    np.cumsum(lengths, out=offs[1:])
    cls, sep = np.array([p.cls_id], dtype), np.array([p.sep_id], dtype)
    parts = []
    for a, bseg in zip(segs_a, segs_b):
        parts += (cls, a, sep) if bseg is None else (cls, a, sep, bseg, sep)
    flat = np.concatenate(parts)
    num_a = (la + 2).astype(np.uint16)
    keys = row_keys(derive_seed(seed, "row", doc_id, dupe), m)
    nsp = np.asarray(labels, np.int8)
    if p.masking == "dynamic":
        z = np.zeros(m + 1, np.int64)
        return InstanceBatch(keys, flat, offs, num_a, nsp, np.empty(0, np.uint16), np.empty(0, dtype), z)
    mrng = np.random.Generator(np.random.PCG64(derive_seed(seed, "mask", doc_id, dupe)))
    if p.masking_mode != "token":
        flat, mpos, mids, moffs = _mask_rows_words(flat, offs, num_a, has_b, mrng, p, continuation)
    else:
        flat, mpos, mids, moffs = _mask_rows(flat, offs, num_a, has_b, mrng, p)
    return InstanceBatch(keys, flat, offs, num_a, nsp, mpos, mids, moffs)


def _special_positions(offs, num_a, has_b):
    """Flat indices of [CLS] and the [SEP]s of every row."""
    starts, ends = offs[:-1], offs[1:]
    sp = [starts, starts + num_a.astype(np.int64) - 1, ends[has_b] - 1]
    return np.concatenate(sp)


def _mask_rows(flat, offs, num_a, has_b, rng: np.random.Generator, p: InstanceParams):
    """Token-level masking of all rows at once: per row, a uniformly random subset of
    ``min(max_pred, max(1, round(len * prob)))`` non-special positions, 80/10/10 (the params'
    ``mask_replace_prob`` / ``random_replace_prob``)."""
    m = offs.shape[0] - 1
    lengths = np.diff(offs)
    width = int(lengths.max())
    row = np.repeat(np.arange(m), lengths)
    col = np.arange(flat.shape[0]) - np.repeat(offs[:-1], lengths)
    # a [rows, width] matrix of random keys; specials and padding get 2.0 so they sort last
    keys = np.full((m, width), 2.0)
    keys[row, col] = rng.random(flat.shape[0])
    sp = _special_positions(offs, num_a, has_b)
    keys[row[sp], col[sp]] = 2.0
    ncand = lengths - 2 - has_b.astype(np.int64)
    budget = np.minimum(np.minimum(p.max_predictions_per_seq, np.maximum(1, np.rint(lengths * p.masked_lm_prob).astype(np.int64))), ncand)
    order = np.argsort(keys, axis=1)  # per row: positions in random order (short rows: cheap)
    sel = np.zeros((m, width), bool)
    np.put_along_axis(sel, order, np.arange(width)[None, :] < budget[:, None], axis=1)
    r_idx, c_idx = np.nonzero(sel)  # row-major: rows in order, positions ascending
    chosen = offs[:-1][r_idx] + c_idx
    labels = flat[chosen]
    out = flat.copy()
    u = rng.random(chosen.shape[0])
    rand_ids = rng.integers(0, p.vocab_size, size=chosen.shape[0]).astype(flat.dtype)
    out[chosen[u < p.mask_replace_prob]] = p.mask_id
    rnd = u >= 1.0 - p.random_replace_prob
    out[chosen[rnd]] = rand_ids[rnd]
    counts = np.bincount(r_idx, minlength=m)
    moffs = np.zeros(m + 1, np.int64)
    np.cumsum(counts, out=moffs[1:])
    mpos = (chosen - np.repeat(offs[:-1], counts)).astype(np.uint16)
    return out, mpos, labels, moffs


def _mask_rows_words(flat, offs, num_a, has_b, rng: np.random.Generator, p: InstanceParams, continuation):
    """Whole-word or span masking: the oracle row by row, one Generator for all rows."""
    if continuation is None:
        what = "whole-word" if p.masking_mode == "whole_word" else "span"
        raise ValueError(f"{what} masking needs the vocab's continuation mask")
    m = offs.shape[0] - 1
    special_flat = np.zeros(flat.shape[0], bool)
    special_flat[_special_positions(offs, num_a, has_b)] = True
    out = flat.copy()
    pos_parts, lab_parts, counts = [], [], np.zeros(m, np.int64)
    for r in range(m):
        s, e = offs[r], offs[r + 1]
        row_ids = flat[s:e]
        masked, pos, lab = mask_sequence(
            row_ids, rng, special=special_flat[s:e], masked_lm_prob=p.masked_lm_prob,
            max_predictions=p.max_predictions_per_seq, mask_id=p.mask_id, vocab_size=p.vocab_size,
            continuation=continuation[row_ids], mode=p.masking_mode, mask_replace_prob=p.mask_replace_prob,
            random_replace_prob=p.random_replace_prob,
        )
        out[s:e] = masked
        pos_parts.append(pos.astype(np.uint16))
        lab_parts.append(lab)
        counts[r] = pos.shape[0]
    moffs = np.zeros(m + 1, np.int64)
    np.cumsum(counts, out=moffs[1:])
    return out, np.concatenate(pos_parts), np.concatenate(lab_parts).astype(flat.dtype), moffs
