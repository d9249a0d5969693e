"""data_pipeline.sharding: rows bucketed by key and placed into exact, sorted, deterministic shards."""
from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.sharding import bucket_bits, bucket_ranks, place_bucket, shard_targets, split_by_bucket
from tests.data_pipeline.test_instance_algorithm import build, params, synthetic_docs


def test_bucketed_shards_are_exact_sorted_and_deterministic():
    """Buckets of ~rows_per_bucket rows, cut at the shard boundaries: shard sizes are
    shard_targets, and the shards in order are all rows sorted by key, however the rows arrive."""
    from data_pipeline.instance_batch import InstanceBatch

    docs = synthetic_docs(8, 50)
    b, _ = build(docs, params())
    n, per_bucket = 5, 7
    bits = bucket_bits(len(b), per_bucket)
    assert 2 ** (bits - 1) * per_bucket < len(b) <= 2 ** bits * per_bucket
    for order in (np.arange(len(b)), np.random.default_rng(0).permutation(len(b))):
        pieces = {}
        for chunk in np.array_split(order, 9):  # rows arrive in arbitrary batches
            for bucket, rows in split_by_bucket(b.take(chunk), bits):
                pieces.setdefault(bucket, []).append(rows)
        counts = {k: sum(len(x) for x in v) for k, v in pieces.items()}
        assert max(counts.values()) < 4 * per_bucket  # memory bound: a bucket is small
        final: dict[int, list] = {}
        for bucket in sorted(pieces, reverse=True):  # placement does not depend on bucket order either
            for shard, rows in place_bucket(bucket, InstanceBatch.concat(pieces[bucket]), bucket_ranks(counts), n):
                final.setdefault(shard, []).append((bucket, rows))
        sizes = [sum(len(r) for _, r in final.get(s, [])) for s in range(n)]
        assert sizes == shard_targets(len(b), n) and max(sizes) - min(sizes) <= 1
        merged = InstanceBatch.concat([r for s in range(n) for _, r in sorted(final[s], key=lambda x: x[0])])
        assert np.array_equal(merged.keys, b.sorted_by_key().keys)
        assert np.array_equal(merged.ids, b.sorted_by_key().ids)


def test_place_bucket_rejects_a_count_mismatch():
    b, _ = build(synthetic_docs(2, 20), params())
    with pytest.raises(RuntimeError, match="rows arrived"):
        list(place_bucket(0, b, bucket_ranks({0: len(b) + 1}), 2))
