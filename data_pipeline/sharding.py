"""Balanced, deterministic shards with memory that does not grow with the corpus (pure functions).

Every row has a uniform 64-bit key. The output is the rows sorted by key, cut into
``num_shards`` consecutive ranges whose sizes differ by at most one. No step holds a whole shard:
  1. rows are grouped into key-range *buckets* (the top ``bits`` of the key), with ``bits``
     chosen from the total row count so a bucket holds about ``rows_per_bucket`` rows;
  2. a bucket is sorted by key; the rows in lower buckets give its first global rank, and the
     ranks say which shard (or two) its rows belong to — each piece becomes a part file;
  3. a shard is its part files in bucket order, streamed into one Parquet file.
Everything depends on the keys and counts only, never on bundling or worker count.
"""
from __future__ import annotations

import numpy as np

from data_pipeline.instance_batch import InstanceBatch

MAX_BUCKET_BITS = 24


def shard_targets(total: int, num_shards: int) -> list[int]:
    """Rows per shard: floor(total/N), the first total mod N shards one more (differ by <= 1)."""
    base, extra = divmod(total, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def bucket_bits(total_rows: int, rows_per_bucket: int) -> int:
    """Fewest key bits that split ``total_rows`` into buckets of about ``rows_per_bucket``."""
    bits = 0
    while (total_rows >> bits) > rows_per_bucket and bits < MAX_BUCKET_BITS:
        bits += 1
    return bits


def bucket_of(keys: np.ndarray, bits: int) -> np.ndarray:
    if bits == 0:
        return np.zeros(keys.shape[0], np.int64)
    return (keys >> np.uint64(64 - bits)).astype(np.int64)


def split_by_bucket(batch: InstanceBatch, bits: int):
    """(bucket, rows of ``batch`` in that bucket), for every bucket the batch touches."""
    if not len(batch):
        return
    buckets = bucket_of(batch.keys, bits)
    order = np.argsort(buckets, kind="stable")
    uniq, first = np.unique(buckets[order], return_index=True)
    ends = np.append(first[1:], order.shape[0])
    for b, lo, hi in zip(uniq.tolist(), first.tolist(), ends.tolist()):
        yield b, batch.take(order[lo:hi])


def bucket_ranks(bucket_counts: dict[int, int]) -> tuple[dict[int, tuple[int, int]], int]:
    """({bucket: (global rank of its first row, its rows)}, total rows), computed once per split."""
    ranks, first = {}, 0
    for b in sorted(bucket_counts):
        ranks[b] = (first, bucket_counts[b])
        first += bucket_counts[b]
    return ranks, first


def place_bucket(bucket: int, batch: InstanceBatch, ranks: tuple[dict[int, tuple[int, int]], int], num_shards: int):
    """Sort one bucket by key and cut it at the shard boundaries: yields (shard, rows).
    ``ranks`` is :func:`bucket_ranks` of every bucket's row count."""
    batch = batch.sorted_by_key()
    table, total = ranks
    first_rank, counted = table.get(bucket, (0, None))
    if counted != len(batch):
        raise RuntimeError(f"bucket {bucket}: {len(batch)} rows arrived, {counted} were counted")
    starts = np.cumsum([0] + shard_targets(total, num_shards))  # shard s holds ranks [starts[s], starts[s+1])
    ranks_of_rows = first_rank + np.arange(len(batch))
    shard = np.searchsorted(starts, ranks_of_rows, side="right") - 1
    cuts = np.flatnonzero(np.diff(shard)) + 1
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(batch)]):
        yield int(shard[lo]), batch.slice(lo, hi)
