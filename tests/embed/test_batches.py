"""Batches of training units: no text twice in a batch, every unit once an epoch, and rank shares
of equal size that together are the global batch."""
from __future__ import annotations

import random

from bertdist.embed.batches import epoch_batches, rank_share


def test_no_text_twice_in_a_batch():
    units = [{"texts": frozenset([f"q{i}", f"p{i % 5}"])} for i in range(20)]  # positives repeat every 5 rows
    batches = epoch_batches(units, 4, random.Random(0), no_duplicates=True)
    assert sorted(i for b in batches for i in b) == list(range(20))
    for b in batches:
        seen = [t for i in b for t in units[i]["texts"]]
        assert len(seen) == len(set(seen)) and len(b) <= 4


def test_rank_shares_are_equal_and_together_the_cut_batch():
    batch = list(range(10, 21))  # 11 rows over 3 ranks: the last 2 are cut, every rank takes 3
    shares = [rank_share(batch, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [3, 3, 3]
    assert sorted(i for s in shares for i in s) == batch[:9]
    assert rank_share(batch, 0, 1) == batch
