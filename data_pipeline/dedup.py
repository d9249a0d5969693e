"""Duplicate detection, pure functions: normalized text and its content hash (exact
duplicates), MinHash signatures over word n-grams, LSH band keys, candidate pairs within a band
bucket, and connected components of the pairs with one kept document per component.

Every hash here is stable across processes and machines (blake2b and fixed-seed numpy
arithmetic; never Python's salted ``hash``), so workers agree without talking to each other.

MinHash is numpy's, not ``datasketch``'s: words and n-grams are hashed in vectorized integer
arithmetic instead of one SHA-1 call per n-gram, and the signature is one-permutation hashing
(see :func:`minhash`) instead of ``num_perm`` hashes per n-gram; both measured on the shared corpus
in benchmarks/results/dedup_cpu_2026-11-25.md. The word hashes and the signature's binning also
have a C++ twin (csrc/data_pipeline/dedup.cpp), used when it is built; the numpy functions stay
the reference, and tests hold the two to identical results.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any, Iterable, Mapping

import numpy as np

from data_pipeline.native_build import import_native

# the native twin of word_hashes and of minhash's binning (csrc/data_pipeline/dedup.cpp)
_native_dedup, _NATIVE_UNAVAILABLE = import_native("data_pipeline._native_dedup")


def native_available() -> bool:
    return _native_dedup is not None


def native_unavailable_reason() -> str:
    """Why the native signing cannot be used ("" when it can)."""
    return _NATIVE_UNAVAILABLE


def _use_native(native: bool | None) -> bool:
    """``native``: None uses the native twin when it is built, True requires it, False never."""
    if native and _native_dedup is None:
        raise ValueError(f"native=True, but {_NATIVE_UNAVAILABLE} (use native=None or False)")
    return native is not False and _native_dedup is not None


# Word bytes of lower-cased UTF-8: ASCII letters, digits, "_" and every byte of a non-ASCII
# character (so "café" is one word; a non-ASCII dash joins its neighbours, the same way everywhere).
_WORD_BYTES = b"abcdefghijklmnopqrstuvwxyz0123456789_" + bytes(range(0x80, 0x100))
# bytes.translate table: word byte -> 1, any other -> 0 (far faster than a numpy table lookup)
_IS_WORD = bytes(1 if i in _WORD_BYTES else 0 for i in range(256))
_P = 0x01000193  # odd, so invertible mod 2^32 (32-bit word hashes: half the memory traffic of 64)
_CHUNK = 1 << 18  # bytes per step: its work arrays (1 MB each) stay in cache


@lru_cache(maxsize=1)
def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """P^k and P^-k mod 2^32 for k <= _CHUNK, and a reused prefix-sum buffer (a fresh array per
    step cost more in page faults than the arithmetic)."""
    with np.errstate(over="ignore"):
        pw = np.concatenate([[np.uint32(1)], np.cumprod(np.full(_CHUNK, _P, np.uint32), dtype=np.uint32)])
        inv = np.concatenate([[np.uint32(1)],
                              np.cumprod(np.full(_CHUNK, pow(_P, -1, 1 << 32), np.uint32), dtype=np.uint32)])
    return pw, inv, np.zeros(_CHUNK + 1, np.uint32)


def word_hashes(text: str, *, native: bool | None = None) -> np.ndarray:
    """uint32 hash of every word of the lower-cased text, in order: a polynomial hash of the
    word's bytes mod 2^32, sum of (byte + 1) * P^offset. A vocabulary of a million words has
    about a hundred colliding pairs: noise far below the MinHash estimate's. ``native``: see
    :func:`_use_native` (the 14 books: 38 ms with the native twin, 68 ms with numpy, lower-casing
    and encoding included)."""
    raw = text.lower().encode("utf-8")
    return _native_dedup.word_hashes(raw) if _use_native(native) else _word_hashes_reference(raw)


def _word_hashes_reference(raw: bytes) -> np.ndarray:
    """:func:`word_hashes` of lower-cased UTF-8 bytes, from prefix sums over the whole text (numpy,
    no Python call per word)."""
    data = np.frombuffer(raw, np.uint8)
    is_word = np.frombuffer(raw.translate(_IS_WORD), np.int8)
    pw, inv, prefix = _tables()
    out = []
    pos, n = 0, len(data)
    while pos < n:
        end = min(pos + _CHUNK, n)
        if end < n:  # cut after the chunk's last non-word byte, so no word is split
            gap = raw.rfind(b" ", pos, end)  # nearly always a space; else any non-word byte
            if gap < 0:
                gaps = np.flatnonzero(is_word[pos:end] == 0)
                gap = pos + int(gaps[-1]) if len(gaps) else -1
            if gap < 0:  # one word from pos, longer than a step: hashed in pieces
                rest = np.flatnonzero(is_word[end:] == 0)
                word_end = end + int(rest[0]) if len(rest) else n
                out.append(np.array([_long_word_hash(data[pos:word_end], pw)], np.uint32))
                pos = word_end
                continue
            end = gap + 1
        c = data[pos:end]
        edges = np.diff(is_word[pos:end], prepend=np.int8(0), append=np.int8(0))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        n_c = len(c)
        with np.errstate(over="ignore"):
            acc = prefix[1:n_c + 1]
            np.add(c, 1, out=acc, dtype=np.uint32)  # +1: a 0 byte still counts
            np.multiply(acc, pw[:n_c], out=acc)
            np.cumsum(acc, out=acc)
            out.append((prefix[ends] - prefix[starts]) * inv[starts])
        pos = end
    return np.concatenate(out) if out else np.zeros(0, np.uint32)


def _long_word_hash(word: np.ndarray, pw: np.ndarray) -> int:
    """:func:`word_hashes`' hash of one word longer than a step: the pieces' sums, each shifted by
    P^(its offset)."""
    h = 0
    for o in range(0, len(word), _CHUNK):
        piece = word[o:o + _CHUNK]
        with np.errstate(over="ignore"):
            part = int(np.sum((piece.astype(np.uint32) + np.uint32(1)) * pw[:len(piece)], dtype=np.uint32))
        h = (h + part * pow(_P, o, 1 << 32)) % (1 << 32)
    return h


def content_hash(words: np.ndarray) -> bytes:
    """16 bytes of blake2b over the word hashes: equal for exact duplicates (up to case,
    punctuation and spacing), and the document's name in the near-duplicate stages."""
    return hashlib.blake2b(words.tobytes(), digest_size=16).digest()


def _odd_uint64(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.integers(0, 1 << 63, size=n, dtype=np.uint64) << np.uint64(1)) | np.uint64(1)


@lru_cache(maxsize=16)
def _permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Multipliers (odd) and offsets of the MinHash permutations."""
    rng = np.random.default_rng([seed, 0])
    return _odd_uint64(rng, num_perm), rng.integers(0, 1 << 63, size=num_perm, dtype=np.uint64)


@lru_cache(maxsize=16)
def _ngram_multipliers(ngram: int, seed: int) -> np.ndarray:
    return _odd_uint64(np.random.default_rng([seed, 1]), ngram)


def ngram_hashes(w: np.ndarray, ngram: int, seed: int = 1) -> np.ndarray:
    """uint64 hashes of the word n-grams, from :func:`word_hashes` (a document shorter than
    ``ngram`` words is one n-gram of all its words; repeats are kept: they do not change a minimum)."""
    if not len(w):
        return np.zeros(0, np.uint64)
    w = w.astype(np.uint64)
    n = max(1, len(w) - ngram + 1)
    mult = _ngram_multipliers(ngram, seed)
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as intended
        for j in range(min(ngram, len(w))):
            h += w[j:j + n] * mult[j]
        h ^= h >> np.uint64(31)  # a final mix so that nearby sums spread over all bits
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(29)
    return h


@lru_cache(maxsize=16)
def _probes(num_perm: int, seed: int, attempts: int = 64) -> np.ndarray:
    """Per bin, a fixed random sequence of bins to borrow from when it is empty."""
    return np.random.default_rng([seed, 2]).integers(0, num_perm, size=(num_perm, attempts))


def signature(words: np.ndarray, ngram: int, num_perm: int, seed: int = 1, *, native: bool | None = None
              ) -> np.ndarray:
    """``minhash(ngram_hashes(words, ngram, seed), num_perm, seed)``; the native twin bins the
    n-grams in one pass, without their array (see :func:`_use_native`)."""
    if not len(words) or not _use_native(native):
        return minhash(ngram_hashes(words, ngram, seed), num_perm, seed)
    a, b = _permutations(1, seed)
    sig, filled = _native_dedup.bin_minima(np.ascontiguousarray(words, np.uint32), _ngram_multipliers(ngram, seed),
                                           int(a[0]), int(b[0]), num_perm)
    return _densify(sig, filled, num_perm, seed)


def minhash(hashes: np.ndarray, num_perm: int, seed: int = 1) -> np.ndarray:
    """uint32[num_perm] MinHash signature by one-permutation hashing with optimal densification
    (Shrivastava, ICML 2017): one hash per n-gram; its high 32 bits pick a bin, its low 32 bits
    are the value, each bin keeps its minimum, and an empty bin borrows the value of the first
    filled bin along its own fixed probe sequence. Two signatures agree in a bin with probability
    equal to the sets' Jaccard similarity, as with ``num_perm`` independent permutations, at one
    hash per n-gram instead of ``num_perm`` (3.5x faster than 128 permutations and 20x faster than
    datasketch on the shared corpus, same error: benchmarks/results/dedup_cpu_2026-11-25.md)."""
    sig = np.full(num_perm, np.uint32(0xFFFFFFFF), np.uint32)
    if not len(hashes):
        return sig
    a, b = _permutations(1, seed)
    with np.errstate(over="ignore"):
        x = hashes * a[0] + b[0]
        x ^= x >> np.uint64(29)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(32)
    bins = (((x >> np.uint64(32)) * np.uint64(num_perm)) >> np.uint64(32)).astype(np.intp)
    np.minimum.at(sig, bins, x.astype(np.uint32))
    filled = np.zeros(num_perm, bool)
    filled[bins] = True
    return _densify(sig, filled, num_perm, seed)


def _densify(sig: np.ndarray, filled: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """Fill :func:`minhash`'s empty bins (``~filled``) from filled ones, in place; returns ``sig``."""
    if filled.all():
        return sig
    empty = np.flatnonzero(~filled)
    src = np.full(len(empty), -1, np.intp)
    probes = _probes(num_perm, seed)
    for t in range(probes.shape[1]):
        need = np.flatnonzero(src < 0)
        if not len(need):
            break
        cand = probes[empty[need], t]
        ok = filled[cand]
        src[need[ok]] = cand[ok]
    for j in np.flatnonzero(src < 0):  # rare (a handful of filled bins): the next filled bin
        i = empty[j]
        src[j] = next((i + d) % num_perm for d in range(1, num_perm) if filled[(i + d) % num_perm])
    # mixed with the borrowing bin's index, so two borrowed bins of one set do not match each other
    # more often than chance; both sets borrow the same way, so their agreement keeps its odds
    with np.errstate(over="ignore"):
        sig[empty] = sig[src] ^ (np.uint32(0x9E3779B1) * (empty.astype(np.uint32) + np.uint32(1)))
    return sig


def _false_rates(threshold: float, bands: int, rows: int, steps: int = 200) -> tuple[float, float]:
    """Areas of false positives (below ``threshold``) and false negatives (above it) under the
    LSH S-curve P(candidate | J = s) = 1 - (1 - s^rows)^bands."""
    def curve(lo: float, hi: float, above: bool) -> float:
        s = np.linspace(lo, hi, steps)
        p = 1.0 - (1.0 - s ** rows) ** bands
        return float(np.trapezoid(1.0 - p if above else p, s))

    return curve(0.0, threshold, False), curve(threshold, 1.0, True)


# A missed pair is a duplicate kept; a candidate below the threshold only costs one signature
# comparison (every candidate pair is verified), so misses weigh 19 times more.
FALSE_NEGATIVE_WEIGHT = 0.95


@lru_cache(maxsize=64)
def bands_and_rows(threshold: float, num_perm: int, fn_weight: float = FALSE_NEGATIVE_WEIGHT) -> tuple[int, int]:
    """LSH bands x rows <= num_perm that minimize the weighted false-positive and false-negative
    areas under the S-curve around ``threshold`` (datasketch's MinHashLSH rule, with weights for
    verified candidates): (16, 8) for 0.8 and 128, a pair at Jaccard 0.8 is a candidate with
    probability 0.95, at 0.85 with 0.994."""
    best, best_err = (1, num_perm), float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            fp, fn = _false_rates(threshold, bands, rows)
            err = (1.0 - fn_weight) * fp + fn_weight * fn
            if err < best_err:
                best, best_err = (bands, rows), err
    return best


def band_keys(signature: np.ndarray, bands: int, rows: int) -> list[bytes]:
    """One key per band: the band index and 8 bytes of blake2b over its rows."""
    return [i.to_bytes(2, "big") + hashlib.blake2b(signature[i * rows:(i + 1) * rows].tobytes(), digest_size=8).digest()
            for i in range(bands)]


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.count_nonzero(a == b)) / len(a)


def bucket_pairs(members: Iterable[tuple[bytes, np.ndarray]], threshold: float, max_comparisons: int
                 ) -> list[tuple[bytes, bytes, float]]:
    """Pairs (smaller hash, larger hash, estimate) of one band bucket whose signatures estimate
    a Jaccard similarity >= ``threshold``. Members are taken in hash order and each is compared with at most
    ``max_comparisons`` members before it, so a huge bucket costs linear, not quadratic, work."""
    uniq = dict(members)  # exact duplicates share a hash: one node
    keys = sorted(uniq)
    out = []
    for j, kj in enumerate(keys):
        for i in range(max(0, j - max_comparisons), j):
            est = estimated_jaccard(uniq[keys[i]], uniq[kj])
            if est >= threshold:
                out.append((keys[i], kj, est))
    return out


def components(pairs: Iterable[tuple[bytes, bytes]], rank: Mapping[bytes, Any] | None = None) -> dict[bytes, bytes]:
    """Union-find over the pairs: {node: its component's root} for every node in a pair (roots map
    to themselves). The root is the node with the smallest ``(rank[node], node)``, or the smallest
    node without ``rank``; the result does not depend on the pairs' order."""
    parent: dict[bytes, bytes] = {}
    order = (lambda x: x) if rank is None else (lambda x: (rank[x], x))

    def find(x: bytes) -> bytes:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    for a, b in pairs:
        parent.setdefault(a, a)
        parent.setdefault(b, b)
        ra, rb = find(a), find(b)
        if ra != rb:
            lo, hi = (ra, rb) if order(ra) < order(rb) else (rb, ra)
            parent[hi] = lo  # the smaller one is the root: the root is the component's minimum
    return {x: find(x) for x in parent}
