"""data_pipeline.dedup: hashes that ignore what should not count, MinHash that estimates
Jaccard similarity, LSH parameters from the threshold, and order-free connected components."""
from __future__ import annotations

import random

import numpy as np

from data_pipeline import dedup

WORDS = ("river bridge winter flood morning committee account hall grey old long agreed repair before "
         "arrived discussion town market bell tower stone road field harvest").split()


def doc(r: random.Random, n: int) -> list[str]:
    return [r.choice(WORDS) + str(r.randrange(50)) for _ in range(n)]


def jaccard(a: list[str], b: list[str], n: int = 5) -> float:
    sa = {tuple(a[i:i + n]) for i in range(len(a) - n + 1)}
    sb = {tuple(b[i:i + n]) for i in range(len(b) - n + 1)}
    return len(sa & sb) / len(sa | sb)


def signature(words: list[str]) -> np.ndarray:
    return dedup.minhash(dedup.ngram_hashes(dedup.word_hashes(" ".join(words)), 5), 128)


def test_word_hashes_ignore_case_punctuation_and_spacing():
    a = dedup.word_hashes("Hello, World!  It's   café\ntime.")
    b = dedup.word_hashes("hello world it s CAFÉ time")
    assert len(a) == 6 and np.array_equal(a, b)
    assert dedup.content_hash(a) == dedup.content_hash(b)
    assert dedup.content_hash(a) != dedup.content_hash(dedup.word_hashes("hello world it s cafe time"))


def test_word_hashes_agree_across_chunk_boundaries():
    text = " ".join(f"w{i}" for i in range(120_000))  # ~800 KB: several of word_hashes' steps
    h = dedup.word_hashes(text)
    assert len(h) == 120_000
    assert np.array_equal(h[100_000:100_003], dedup.word_hashes("w100000 w100001 w100002"))


def test_minhash_estimates_jaccard():
    r = random.Random(0)
    errors = []
    for _ in range(60):
        a = doc(r, r.randrange(80, 2000))
        b = list(a)
        for i in r.sample(range(len(b)), int(len(b) * r.uniform(0.0, 0.1))):
            b[i] = "edit" + str(r.randrange(10**9))
        errors.append(dedup.estimated_jaccard(signature(a), signature(b)) - jaccard(a, b))
    assert abs(np.mean(errors)) < 0.02 and np.std(errors) < 0.06, (np.mean(errors), np.std(errors))
    assert np.array_equal(signature(a), signature(list(a)))  # deterministic


def test_bands_and_rows_from_the_threshold():
    b, r = dedup.bands_and_rows(0.8, 128)
    assert b * r <= 128 and (b, r) == (16, 8)
    b5, r5 = dedup.bands_and_rows(0.5, 128)
    assert r5 < r  # a lower threshold: shorter bands, more candidates
    p = lambda s, b, r: 1 - (1 - s ** r) ** b  # noqa: E731
    assert p(0.8, b, r) > 0.94 and p(0.85, b, r) > 0.99 and p(0.5, b, r) < 0.07


def test_bucket_pairs_verify_the_estimate():
    r = random.Random(1)
    a = doc(r, 400)
    near = a[:200] + ["changed"] + a[201:]
    other = doc(r, 400)
    members = [(b"\x01", signature(a)), (b"\x02", signature(near)), (b"\x03", signature(other)), (b"\x01", signature(a))]
    (a, b, est), = dedup.bucket_pairs(members, 0.8, 64)
    assert (a, b) == (b"\x01", b"\x02") and 0.8 <= est < 1.0


def test_components_are_order_free_and_rooted_at_the_minimum():
    pairs = [(b"c", b"d"), (b"a", b"c"), (b"x", b"y"), (b"d", b"e")]
    want = {b"a": b"a", b"c": b"a", b"d": b"a", b"e": b"a", b"x": b"x", b"y": b"x"}
    r = random.Random(2)
    for _ in range(20):
        r.shuffle(pairs)
        assert dedup.components([(b, a) if r.random() < 0.5 else (a, b) for a, b in pairs]) == want
