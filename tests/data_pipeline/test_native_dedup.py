"""The native dedup signing (data_pipeline._native_dedup) against the numpy reference of
data_pipeline.dedup: the same word hashes and MinHash signatures on every byte value, edge
lengths, words longer than the reference's steps, real books, several n-gram sizes, signature
lengths and seeds; argument errors."""
from __future__ import annotations

import random

import numpy as np
import pytest

from data_pipeline import dedup

pytestmark = pytest.mark.skipif(not dedup.native_available(),
                                reason=dedup.native_unavailable_reason() or "native dedup not built")


def assert_same_words(raw: bytes) -> np.ndarray:
    from data_pipeline import _native_dedup

    got, want = _native_dedup.word_hashes(raw), dedup._word_hashes_reference(raw)
    assert got.dtype == want.dtype == np.uint32
    assert np.array_equal(got, want), raw[:80]
    return got


def test_word_hashes_match_on_every_byte_value_and_edge_lengths():
    r = random.Random(0)
    for raw in (b"", b" ", b"a", b"a ", b" a", b"_", b"\x80", b"A", b"ab cd", bytes(range(256)), bytes(range(256)) * 3):
        assert_same_words(raw)
    for _ in range(300):
        # mostly word bytes (runs of every length), then anything
        alphabet = b"ab_9\xc3\xa9 .\n" if r.random() < 0.7 else bytes(range(256))
        assert_same_words(bytes(r.choice(alphabet) for _ in range(r.randrange(0, 400))))


def test_a_word_longer_than_a_step_is_one_word():
    raw = b"x" * (dedup._CHUNK + 12345) + b" tail " + b"y" * (2 * dedup._CHUNK)
    h = assert_same_words(raw)
    assert len(h) == 3
    assert len(dedup.word_hashes("a" * (dedup._CHUNK - 3) + "bcdefgh", native=False)) == 1


@pytest.mark.parametrize("ngram,num_perm,seed", [(5, 128, 1), (1, 64, 7), (3, 256, 2), (9, 16, 1)])
def test_signatures_match(ngram, num_perm, seed):
    r = random.Random(ngram * 1000 + num_perm)
    for length in [1, 2, ngram - 1, ngram, ngram + 1, 3, 40, 2000] + [r.randrange(1, 5000) for _ in range(20)]:
        words = np.array([r.randrange(1 << 32) for _ in range(max(1, length))], np.uint32)
        got = dedup.signature(words, ngram, num_perm, seed, native=True)
        want = dedup.signature(words, ngram, num_perm, seed, native=False)
        assert got.dtype == want.dtype == np.uint32 and np.array_equal(got, want), (length, ngram)
    empty = np.zeros(0, np.uint32)
    assert np.array_equal(dedup.signature(empty, ngram, num_perm, seed, native=True),
                          dedup.minhash(np.zeros(0, np.uint64), num_perm, seed))


@pytest.mark.shared
def test_native_matches_reference_on_the_books(shared_data):
    for book in sorted((shared_data / "books").glob("*.txt"))[:4]:
        text = book.read_text(encoding="utf-8")
        words = dedup.word_hashes(text, native=True)
        assert np.array_equal(words, dedup.word_hashes(text, native=False)), book.name
        assert np.array_equal(dedup.signature(words, 5, 128, native=True),
                              dedup.signature(words, 5, 128, native=False)), book.name


def test_argument_errors_name_the_argument():
    from data_pipeline import _native_dedup

    mult = dedup._ngram_multipliers(5, 1)
    with pytest.raises(ValueError, match="words: expected dtype uint32"):
        _native_dedup.bin_minima(np.zeros(8, np.int64), mult, 1, 2, 128)
    with pytest.raises(ValueError, match="ngram_multipliers: expected dtype uint64"):
        _native_dedup.bin_minima(np.zeros(8, np.uint32), mult.astype(np.int64), 1, 2, 128)
    with pytest.raises(ValueError, match="at least one word"):
        _native_dedup.bin_minima(np.zeros(0, np.uint32), mult, 1, 2, 128)
    with pytest.raises(ValueError, match="num_perm must be in"):
        _native_dedup.bin_minima(np.zeros(8, np.uint32), mult, 1, 2, 0)
    with pytest.raises(ValueError, match="2-D|1-D"):
        _native_dedup.bin_minima(np.zeros((2, 4), np.uint32), mult, 1, 2, 128)
    with pytest.raises(TypeError):
        _native_dedup.word_hashes("not bytes")


def test_native_true_without_the_module_is_an_error(monkeypatch):
    monkeypatch.setattr(dedup, "_native_dedup", None)
    with pytest.raises(ValueError, match="native=True"):
        dedup.word_hashes("a b", native=True)
    assert len(dedup.word_hashes("a b")) == 2  # None: the reference
