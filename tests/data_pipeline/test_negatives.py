"""NSP negative buckets and the held-out plan (data_pipeline.negatives, pure functions): the
held-out floor, bucket ranges, order-independent corpus totals, and the deal of windows."""
from __future__ import annotations

import random

import numpy as np
import pytest

from data_pipeline.negatives import (
    HASH_SPACE, BuildPlan, CorpusSummary, HeldOutSplit, NegativeSource, buckets_of_slot, canonical_order,
    fraction_threshold, make_plan, placement_hash, slot_range, split_units,
)


def summary_of(docs, *, keep=20, fraction=0.05) -> CorpusSummary:
    """docs: (doc_id, tokens, sentences)."""
    s = CorpusSummary(keep=keep, fraction_threshold=fraction_threshold(fraction))
    for doc_id, tokens, sentences in docs:
        s.add(placement_hash(doc_id), tokens, sentences)
    return s


def heldout_ids(plan, docs) -> set[str]:
    split = plan.split
    return {d[0] for d in docs if split(d[0]) == "heldout"}


def test_heldout_floor_takes_the_lowest_hashes_whole():
    docs = [(f"d{i}", 1000, 40) for i in range(200)]
    by_hash = sorted(docs, key=lambda d: placement_hash(d[0]))
    below = [d for d in docs if placement_hash(d[0]) < fraction_threshold(0.05)]
    assert len(below) < 20  # the fraction alone holds out too few
    plan = make_plan(summary_of(docs), heldout_fraction=0.05, heldout_min_documents=20, bucket_tokens=10**9)
    assert plan.documents == {"heldout": 20, "train": 180} and not plan.warnings
    assert heldout_ids(plan, docs) == {d[0] for d in by_hash[:20]}
    assert plan.tokens["heldout"] == 20_000 and plan.sentences["train"] == 180 * 40
    # a larger fraction needs no floor; no fraction means no held-out split at all, floor or not
    big = make_plan(summary_of(docs, fraction=0.3), heldout_fraction=0.3, heldout_min_documents=20, bucket_tokens=10**9)
    assert big.documents["heldout"] == sum(placement_hash(d[0]) < fraction_threshold(0.3) for d in docs) > 20
    none = make_plan(summary_of(docs, fraction=0.0), heldout_fraction=0.0, heldout_min_documents=20, bucket_tokens=10**9)
    assert none.documents["heldout"] == 0 and none.buckets["heldout"] == [] and not none.warnings


def test_heldout_floor_is_capped_by_the_corpus_and_warns():
    docs = [(f"d{i}", 1000, 40) for i in range(30)]  # half of 30 documents: 15, within 25% of tokens? no
    plan = make_plan(summary_of(docs), heldout_fraction=0.05, heldout_min_documents=20, bucket_tokens=10**9,
                     heldout_floor_max_fraction=0.5)
    assert plan.documents["heldout"] == 15 and len(plan.warnings) == 1
    assert "15 document(s)" in plan.warnings[0] and "heldout_min_documents=20" in plan.warnings[0]
    # a floor that would hold out more than heldout_floor_max_fraction of the tokens is not applied
    few = make_plan(summary_of(docs), heldout_fraction=0.05, heldout_min_documents=20, bucket_tokens=10**9)
    assert few.documents["heldout"] == sum(placement_hash(d[0]) < fraction_threshold(0.05) for d in docs)
    assert few.warnings and "at most 25% of the tokens" in few.warnings[0]
    # repeated document ids share a hash: they are held out (or not) together
    twice = docs[:25] + [docs[0]] * 3
    plan = make_plan(summary_of(twice), heldout_fraction=0.05, heldout_min_documents=4, bucket_tokens=10**9)
    assert plan.documents["heldout"] + plan.documents["train"] == 28
    held = [d for d in twice if plan.split(d[0]) == "heldout"]
    assert len(held) == plan.documents["heldout"] >= 4


def test_corpus_summary_merges_in_any_order():
    docs = [(f"doc-{i}", 50 + 7 * i, 3 + i % 5) for i in range(300)] + [("doc-7", 10, 2)]  # a repeated id
    rng = random.Random(0)
    plans = []
    for _ in range(3):
        rng.shuffle(docs)
        parts = [summary_of(docs[i:i + 37]) for i in range(0, len(docs), 37)]
        rng.shuffle(parts)
        total = CorpusSummary(keep=20, fraction_threshold=fraction_threshold(0.05))
        for p in parts:
            total.merge(p)
        plans.append(make_plan(total, heldout_fraction=0.05, heldout_min_documents=20, bucket_tokens=2000).to_json())
    assert plans[0] == plans[1] == plans[2]
    with pytest.raises(ValueError, match="different settings"):
        CorpusSummary(keep=1).merge(CorpusSummary(keep=2))


def test_buckets_cut_each_split_and_slots_find_them():
    docs = [(f"d{i}", 1000, 40) for i in range(200)]
    plan = make_plan(summary_of(docs), heldout_fraction=0.05, heldout_min_documents=20, bucket_tokens=30_000)
    assert len(plan.buckets["train"]) == 6 and len(plan.buckets["heldout"]) == 1  # 180k and 20k tokens
    t = plan.heldout_threshold
    for split, lo, hi in (("train", t, HASH_SPACE), ("heldout", 0, t)):
        ranges = plan.buckets[split]
        assert ranges[0][0] == lo and ranges[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # consecutive, no gap
    for bits in (2, 5):
        for slot in range(1 << bits):
            lo, hi = slot_range(slot, bits)
            found = set(buckets_of_slot(plan, slot, bits))
            want = {(s, j) for s, r in plan.buckets.items() for j, (a, b) in enumerate(r) if a < hi and lo < b}
            assert found == want and found
    assert BuildPlan.from_json(plan.to_json()) == plan  # the plan files round trip


def test_split_units_are_consecutive_non_empty_and_balanced():
    for sizes, n in (([5] * 10, 3), ([100, 1, 1, 1, 1], 3), ([1], 8), ([3, 3], 2), ([0, 0, 0], 2), ([9, 1] * 20, 7)):
        groups = split_units(sizes, n)
        assert [i for g in groups for i in g] == list(range(len(sizes)))
        assert all(groups) and len(groups) == min(n, len(sizes))
    groups = split_units([10] * 12, 4)
    assert [len(g) for g in groups] == [3, 3, 3, 3]


def make_docs(n_docs, rng, sentences=(5, 60), lengths=(5, 40)):
    docs = []
    for d in range(n_docs):
        lens = rng.integers(*lengths, size=int(rng.integers(*sentences)))
        bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        docs.append((f"doc{d}", rng.integers(1000, 30000, size=int(bounds[-1])).astype(np.uint16), bounds))
    return docs


def test_deal_gives_every_row_its_own_window_from_another_document():
    rng = np.random.default_rng(1)
    docs = make_docs(40, rng)
    source = NegativeSource.from_documents(docs, seed=3)
    assert source.num_windows == sum(len(d[2]) - 1 for d in docs)
    assert sorted(source.perm) == list(range(source.num_windows))
    seen, own_total = set(), 0
    for d in range(len(docs)):
        deal = source.dealer(d)
        s, base = len(docs[d][2]) - 1, int(source.offsets[d])
        own = sum(source.offsets[d] <= g < source.offsets[d + 1] for g in source.perm[base:base + s])
        own_total += own
        taken = 0
        while taken < s - own:  # every position of this document that holds another's window, once
            window = deal.next_window()
            if window is None:  # ten of its own windows in a row
                continue
            taken += 1
            e, start = window
            assert e != d and 0 <= start < len(docs[e][2]) - 1
            assert (e, start) not in seen  # windows of different rows never repeat
            seen.add((e, start))
        assert sum(deal.uses.values()) == len(deal.uses) == s - own
    assert len(seen) == source.num_windows - own_total  # every window dealt once, but a document's own
    # B reads whole sentences from the start until the target length, as the reference does
    e, start = 5, 2
    b = docs[e][2]
    for target in (1, int(b[3] - b[2]), int(b[3] - b[2]) + 1, 10**6):
        seg = source.window(e, start, target)
        end = next((j for j in range(start + 1, len(b)) if b[j] - b[start] >= target), len(b) - 1)
        assert np.array_equal(seg, docs[e][1][b[start]:b[end]])


def test_a_document_alone_in_its_bucket_has_no_negative():
    rng = np.random.default_rng(2)
    alone = NegativeSource.from_documents(make_docs(1, rng), seed=1)
    deal = alone.dealer(0)
    assert deal.next_window() is None and deal.cursor == 10  # the reference's 10 tries, then the fallback
    with pytest.raises(ValueError, match="document 1 is not in this bucket of 1 documents"):
        alone.dealer(1)


def test_canonical_order_does_not_depend_on_arrival():
    rng = np.random.default_rng(4)
    docs = make_docs(12, rng) + [("doc3", np.array([7, 8, 9], np.uint16), np.array([0, 1, 3]))]  # a repeated id
    want = None
    for _ in range(4):
        random.Random(_).shuffle(docs)
        order = canonical_order([placement_hash(d[0]) for d in docs], [d[0] for d in docs], [d[1] for d in docs])
        got = [(docs[i][0], docs[i][1].tobytes()) for i in order]
        assert want is None or got == want
        want = got
    assert HeldOutSplit.from_fraction(0.5)("doc3") in ("train", "heldout")
