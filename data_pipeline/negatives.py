"""NSP negatives and the build plan as pure functions: hash buckets of documents, and a deal of their windows.

Pure functions and small classes; the Beam wiring is in beam/instance_transform.py (CreateInstances).

Every document has a 64-bit *placement hash* (:func:`placement_hash`). It decides both where the
document goes and which split it is in:
  - the held-out split is the documents with the lowest hashes: those below
    ``heldout_fraction * 2**64``, and at least the ``heldout_min_documents`` lowest (a held-out
    split of one or two documents cannot measure NSP, whose negatives must come from another
    held-out document), at most half the documents, and only when that holds out at most
    ``heldout_floor_max_fraction`` of the tokens (see :func:`make_plan`);
  - each split's hash range is cut into equal *buckets*, as many as its tokens need for a bucket
    to hold about ``nsp_bucket_tokens`` tokens (thousands of Wikipedia articles; the whole split
    for a small corpus). A random-next row takes its B segment from a document of its own bucket.

Nothing here depends on bundling or worker count: the split and bucket of a document come from
its hash and from corpus totals (a :class:`CorpusSummary` merged over the whole corpus), and a
bucket's documents are put in one canonical order (hash, then id) before anything is drawn.

The deal (:class:`NegativeSource`). A bucket's *windows* are its (document, start sentence)
pairs, one per sentence: W in all. They are shuffled once per bucket (a permutation ``perm`` of
[0, W), seeded by the bucket). Document d, which holds s_d sentences, owns the s_d consecutive
positions of the shuffled order that start at its offset (the sentences of the documents before
it). Its dupes read them in order, one after the other, one position per random-next row,
skipping windows of d itself (up to 10 in a row, the reference's retry count; then the row falls
back to the true continuation, counted), and start over when all s_d are read. Positions owned
by different documents are different and ``perm`` is a permutation, so no window is used twice
until a document needs more negatives, over all its dupes, than it has sentences (about
dupe_factor * 0.15 per sentence on English prose at seq 128). A window's B segment is then read
as the reference reads it: whole sentences from the start sentence until the target length is
reached or the document ends.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from data_pipeline.seeds import derive_seed

HASH_SPACE = 1 << 64
NEGATIVE_TRIES = 10  # the reference's retries for "a document other than this one"


def placement_hash(doc_id: str) -> int:
    """The document's 64-bit hash: its split and its bucket (the held-out split's hash since v1)."""
    return derive_seed("heldout", doc_id)


def fraction_threshold(fraction: float) -> int:
    """Hashes below this are the ``fraction`` of the hash space held out."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"heldout fraction {fraction} must be in [0, 1)")
    return int(fraction * 2.0**64)


@dataclass(frozen=True)
class HeldOutSplit:
    """doc_id -> "heldout" when its placement hash is below ``threshold``, else "train"."""

    threshold: int = 0

    @classmethod
    def from_fraction(cls, fraction: float) -> "HeldOutSplit":
        return cls(fraction_threshold(fraction))

    def of_hash(self, h: int) -> str:
        return "heldout" if h < self.threshold else "train"

    def __call__(self, doc_id: str) -> str:
        return self.of_hash(placement_hash(doc_id))


# ---------------------------------------------------------------- corpus totals and the plan


@dataclass
class CorpusSummary:
    """Corpus totals the plan needs, mergeable (a Beam CombineFn accumulator). ``lowest`` keeps the
    ``keep`` lowest distinct hashes as hash -> [documents, tokens, sentences] (documents > 1 only
    for repeated document ids), enough to find the held-out floor; ``below`` counts the documents
    whose hash is below ``fraction_threshold``."""

    keep: int = 0
    fraction_threshold: int = 0
    documents: int = 0
    tokens: int = 0
    sentences: int = 0
    below: list = field(default_factory=lambda: [0, 0, 0])  # documents, tokens, sentences
    lowest: dict = field(default_factory=dict)

    def add(self, h: int, tokens: int, sentences: int) -> None:
        self.documents += 1
        self.tokens += tokens
        self.sentences += sentences
        if h < self.fraction_threshold:
            self.below[0] += 1
            self.below[1] += tokens
            self.below[2] += sentences
        if self.keep:
            entry = self.lowest.setdefault(h, [0, 0, 0])
            entry[0] += 1
            entry[1] += tokens
            entry[2] += sentences
            if len(self.lowest) > 2 * self.keep:
                self._trim()

    def merge(self, other: "CorpusSummary") -> "CorpusSummary":
        if (other.keep, other.fraction_threshold) != (self.keep, self.fraction_threshold):
            raise ValueError(f"cannot merge corpus summaries of different settings: keep {self.keep} vs {other.keep}, "
                             f"threshold {self.fraction_threshold} vs {other.fraction_threshold}")
        self.documents += other.documents
        self.tokens += other.tokens
        self.sentences += other.sentences
        self.below = [a + b for a, b in zip(self.below, other.below)]
        for h, (d, t, s) in other.lowest.items():
            entry = self.lowest.setdefault(h, [0, 0, 0])
            entry[0] += d
            entry[1] += t
            entry[2] += s
        self._trim()
        return self

    def _trim(self) -> None:
        if len(self.lowest) > self.keep:
            self.lowest = {h: self.lowest[h] for h in sorted(self.lowest)[: self.keep]}


@dataclass(frozen=True)
class BuildPlan:
    """Which documents are held out and how each split is cut into buckets.

    ``buckets[split]`` lists the buckets' [lo, hi) hash ranges; ``documents``, ``tokens`` and
    ``sentences`` are per split. Written to the staging directory as JSON; the driver checks the
    built units against it."""

    heldout_threshold: int
    heldout_min_documents: int
    bucket_tokens: int
    documents: dict
    tokens: dict
    sentences: dict
    buckets: dict
    warnings: tuple = ()

    @property
    def split(self) -> HeldOutSplit:
        return HeldOutSplit(self.heldout_threshold)

    def num_buckets(self) -> int:
        return sum(len(b) for b in self.buckets.values())

    def to_json(self) -> dict:
        return {"heldout_threshold": str(self.heldout_threshold), "heldout_min_documents": self.heldout_min_documents,
                "bucket_tokens": self.bucket_tokens, "documents": dict(self.documents), "tokens": dict(self.tokens),
                "sentences": dict(self.sentences),
                "buckets": {s: [[str(lo), str(hi)] for lo, hi in r] for s, r in self.buckets.items()},
                "warnings": list(self.warnings)}

    @classmethod
    def from_json(cls, d: dict) -> "BuildPlan":
        return cls(heldout_threshold=int(d["heldout_threshold"]), heldout_min_documents=d["heldout_min_documents"],
                   bucket_tokens=d["bucket_tokens"], documents=d["documents"], tokens=d["tokens"],
                   sentences=d["sentences"],
                   buckets={s: [(int(lo), int(hi)) for lo, hi in r] for s, r in d["buckets"].items()},
                   warnings=tuple(d["warnings"]))


def hash_ranges(lo: int, hi: int, n: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into ``n`` consecutive ranges of equal width (to one)."""
    return [(lo + (hi - lo) * j // n, lo + (hi - lo) * (j + 1) // n) for j in range(n)]


def make_plan(summary: CorpusSummary, *, heldout_fraction: float, heldout_min_documents: int,
              bucket_tokens: int, heldout_floor_max_fraction: float = 0.25) -> BuildPlan:
    """The split threshold and the buckets, from the whole corpus's summary.

    The held-out split is the documents below ``heldout_fraction`` of the hash space. When they
    are fewer than the floor, K = min(``heldout_min_documents``, half the documents), the next
    lowest are added (whole documents, in hash order) up to K, unless that would hold out more
    than ``heldout_floor_max_fraction`` of the tokens (a few long books in a small corpus): then
    the floor is not applied at all, since a few more documents would not make held-out NSP
    measurable but would take much of the training text. Fewer than ``heldout_min_documents``
    held-out documents is a warning."""
    if bucket_tokens < 1:
        raise ValueError(f"nsp_bucket_tokens must be >= 1, got {bucket_tokens}")
    warnings = []
    threshold = 0
    held = [0, 0, 0]
    if heldout_fraction > 0 and summary.documents:
        threshold = fraction_threshold(heldout_fraction)
        held = list(summary.below)
        floor = min(heldout_min_documents, summary.documents // 2)
        grown, grown_threshold = list(held), threshold
        for h in sorted(summary.lowest):  # the floor: the lowest hashes (repeated ids stay together)
            if grown[0] >= floor:
                break
            if h >= threshold:  # below it: already held out by the fraction
                grown = [a + b for a, b in zip(grown, summary.lowest[h])]
                grown_threshold = h + 1
        if grown[1] <= heldout_floor_max_fraction * summary.tokens or grown[0] == held[0]:
            held, threshold = grown, grown_threshold
        if held[0] < heldout_min_documents:
            warnings.append(
                f"held-out split: {held[0]} document(s) ({held[1]:,} of {summary.tokens:,} tokens), fewer than "
                f"heldout_min_documents={heldout_min_documents}: the corpus has {summary.documents} documents, and "
                f"the floor holds out at most half of them and at most {heldout_floor_max_fraction:.0%} of the "
                "tokens. Held-out NSP negatives come from held-out documents only, so held-out NSP figures on "
                "so few documents are noise")
    totals = [summary.documents, summary.tokens, summary.sentences]
    train = [a - b for a, b in zip(totals, held)]
    buckets = {}
    for split, (lo, hi), (docs, tokens, _) in (("train", (threshold, HASH_SPACE), train),
                                               ("heldout", (0, threshold), held)):
        n = max(1, math.ceil(tokens / bucket_tokens)) if docs else 0
        buckets[split] = hash_ranges(lo, hi, n)
    return BuildPlan(heldout_threshold=threshold, heldout_min_documents=heldout_min_documents,
                     bucket_tokens=bucket_tokens,
                     documents={"train": train[0], "heldout": held[0]}, tokens={"train": train[1], "heldout": held[1]},
                     sentences={"train": train[2], "heldout": held[2]}, buckets=buckets, warnings=tuple(warnings))


def slot_bits(expected_tokens: int, bucket_tokens: int, max_bits: int = 12) -> int:
    """Hash bits that cut spilled documents into slots (record batches), from an estimate made
    before the run: about four slots per expected bucket, so that reading one bucket reads little
    else. Only the cost of reading depends on it, never the output."""
    want = 4 * max(1, math.ceil(expected_tokens / max(1, bucket_tokens)))
    return min(max_bits, max(2, math.ceil(math.log2(want))))


def slot_range(slot: int, bits: int) -> tuple[int, int]:
    width = HASH_SPACE >> bits
    return slot * width, (slot + 1) * width


def buckets_of_slot(plan: BuildPlan, slot: int, bits: int) -> list[tuple[str, int]]:
    """(split, bucket) of every bucket whose hash range meets the slot's."""
    lo, hi = slot_range(slot, bits)
    return [(split, j) for split in sorted(plan.buckets) for j, (a, b) in enumerate(plan.buckets[split])
            if a < hi and lo < b]


def split_units(sizes: Sequence[int], n_units: int) -> list[list[int]]:
    """Indices 0..len(sizes)-1 cut into min(``n_units``, len(sizes)) consecutive, non-empty
    groups: a group ends when the running total reaches its share of the whole, or when every
    item left must start a group of its own."""
    n = len(sizes)
    n_units = max(1, min(n_units, n))
    total = sum(sizes)
    groups: list[list[int]] = []
    current: list[int] = []
    run = 0
    for i, size in enumerate(sizes):
        current.append(i)
        run += size
        groups_left = n_units - len(groups) - 1  # after this one
        if groups_left and (run * n_units >= total * (len(groups) + 1) or n - i - 1 == groups_left):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


# ---------------------------------------------------------------- one bucket's documents


def canonical_order(hashes: Sequence[int], doc_ids: Sequence[str], ids: Sequence[np.ndarray]) -> list[int]:
    """The bucket's document order: by hash, then id, then content (repeated ids with different
    text would otherwise come in bundling order)."""
    order = sorted(range(len(hashes)), key=lambda i: (hashes[i], doc_ids[i]))
    j = 0
    while j < len(order):  # ties of (hash, id): rare, sorted by their tokens
        k = j + 1
        while k < len(order) and (hashes[order[k]], doc_ids[order[k]]) == (hashes[order[j]], doc_ids[order[j]]):
            k += 1
        if k - j > 1:
            order[j:k] = sorted(order[j:k], key=lambda i: (ids[i].shape[0], ids[i].tobytes()))
        j = k
    return order


class NegativeSource:
    """One bucket's documents in canonical order (flat arrays) and the deal of their windows
    (module docstring). Document ``d`` is ``ids[id_offsets[d]:id_offsets[d+1]]`` with sentence
    bounds ``bounds[bound_offsets[d]:bound_offsets[d+1]]`` (from 0)."""

    def __init__(self, doc_ids: Sequence[str], ids: np.ndarray, id_offsets: np.ndarray, bounds: np.ndarray,
                 bound_offsets: np.ndarray, *, seed: int):
        self.doc_ids = list(doc_ids)
        self.ids, self.id_offsets = ids, np.asarray(id_offsets, np.int64)
        self.bounds, self.bound_offsets = np.asarray(bounds, np.int64), np.asarray(bound_offsets, np.int64)
        self.sentences = np.diff(self.bound_offsets) - 1
        self.offsets = np.zeros(len(self.doc_ids) + 1, np.int64)
        np.cumsum(self.sentences, out=self.offsets[1:])
        self.num_windows = int(self.offsets[-1])
        self.perm = np.random.Generator(np.random.PCG64(seed)).permutation(self.num_windows).astype(np.int64)
        self._offsets_list = self.offsets.tolist()  # bisect on a list: C speed
        self._bounds_lists: dict[int, list] = {}
        self._native = None

    @classmethod
    def from_documents(cls, docs: Sequence[tuple[str, np.ndarray, np.ndarray]], *, seed: int) -> "NegativeSource":
        """From (doc_id, ids, bounds) documents, already in canonical order."""
        dtype = docs[0][1].dtype if docs else np.uint16
        id_offsets = np.zeros(len(docs) + 1, np.int64)
        np.cumsum([d[1].shape[0] for d in docs], out=id_offsets[1:])
        bound_offsets = np.zeros(len(docs) + 1, np.int64)
        np.cumsum([len(d[2]) for d in docs], out=bound_offsets[1:])
        ids = np.concatenate([d[1] for d in docs]).astype(dtype, copy=False) if docs else np.empty(0, dtype)
        bounds = np.concatenate([np.asarray(d[2], np.int64) for d in docs]) if docs else np.empty(0, np.int64)
        return cls([d[0] for d in docs], ids, id_offsets, bounds, bound_offsets, seed=seed)

    def __len__(self) -> int:
        return len(self.doc_ids)

    def document(self, d: int) -> tuple[str, np.ndarray, np.ndarray]:
        io, bo = self.id_offsets, self.bound_offsets
        return self.doc_ids[d], self.ids[io[d]:io[d + 1]], self.bounds[bo[d]:bo[d + 1]]

    def dealer(self, d: int) -> "DocumentDeal":
        """Document ``d``'s run through the deal (one per document, shared by its dupes)."""
        if not 0 <= d < len(self.doc_ids):
            raise ValueError(f"document {d} is not in this bucket of {len(self.doc_ids)} documents")
        return DocumentDeal(self, d)

    def window(self, e: int, start: int, target_b: int) -> np.ndarray:
        """Document e from sentence ``start``: whole sentences until ``target_b`` tokens or its end."""
        b = self._bounds_lists.get(e)
        if b is None:
            b = self._bounds_lists[e] = self.bounds[self.bound_offsets[e]:self.bound_offsets[e + 1]].tolist()
        end = bisect_left(b, b[start] + target_b, start + 1, len(b) - 1)
        io = int(self.id_offsets[e])
        return self.ids[io + b[start]: io + b[end]]


class DocumentDeal:
    """One document's positions in its bucket's shuffled windows, read in order by its dupes one
    after the other; ``uses`` counts how often each position's window was taken."""

    def __init__(self, source: NegativeSource, d: int):
        self.source, self.doc = source, d
        self.sentences = int(source.sentences[d])
        self.base = int(source.offsets[d])
        self.cursor = 0
        self.uses: Counter = Counter()

    def next_window(self) -> tuple[int, int] | None:
        """(source document, start sentence) of the next window not from this document, or None
        when ``NEGATIVE_TRIES`` positions in a row held windows of this document."""
        offsets = self.source._offsets_list
        for _ in range(NEGATIVE_TRIES):
            local = self.cursor % self.sentences
            self.cursor += 1
            g = int(self.source.perm[self.base + local])
            e = bisect_right(offsets, g) - 1
            if e != self.doc:
                self.uses[local] += 1
                return e, g - offsets[e]
        return None
