"""Instances to balanced, sorted Parquet shards: rows are spilled as Arrow run files by (split,
bucket), written as parts and assembled into shards with a sha256 side file each."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import apache_beam as beam

from data_pipeline import sharding
from data_pipeline.beam.metrics import count, distribution
from data_pipeline.beam.spill import BufferedSpillDoFn
from data_pipeline.config import PARQUET_ENCODINGS
from data_pipeline.instance_batch import InstanceBatch


class _HashingWriter:
    """A write-only stream that forwards to ``raw`` and keeps the sha256 and size of what passed."""

    def __init__(self, raw):
        self.raw, self.sha, self.size, self.closed = raw, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        data = bytes(data)
        self.sha.update(data)
        self.size += len(data)
        self.raw.write(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.raw.close()


class _SpillRunsDoFn(BufferedSpillDoFn):
    """Buffers (split, InstanceBatch) pairs up to ``spill_rows`` rows, then writes them as one
    Arrow IPC run file, (split, bucket) by (split, bucket) (one record batch each), and emits
    only ``((split, bucket), where)``. The rows themselves never go through the runner's
    shuffle, so neither the workers nor the runner hold more than a buffer of them. File names
    are unique per attempt: a retried bundle's files are simply never referenced."""

    def __init__(self, runs_dir: str, vocab_size: int, expected_rows: dict[str, int], rows_per_bucket: int,
                 spill_rows: int):
        self.runs_dir, self.vocab_size, self.limit = runs_dir, vocab_size, spill_rows
        self.estimate, self.rows_per_bucket = expected_rows, rows_per_bucket
        self.bits = None  # sized on the first element, once the side input is there

    def process(self, item, expected_rows=None):
        if self.bits is None:  # the data's estimate (the same on every worker) wins over the pre-run one
            rows = expected_rows or {}
            self.bits = {s: sharding.bucket_bits(rows.get(s, n), self.rows_per_bucket)
                         for s, n in self.estimate.items()}
        yield from super().process(item)

    def size_of(self, item) -> int:
        return len(item[1])

    def spill(self, items: list):
        import uuid

        import pyarrow as pa
        from apache_beam.io.filesystems import FileSystems

        by_split: dict[str, list[InstanceBatch]] = {}
        for split, batch in items:
            if split not in self.bits:
                raise ValueError(f"instances of split {split!r} reached WriteShards, which writes {sorted(self.bits)}")
            by_split.setdefault(split, []).append(batch)
        pieces = [((split, bucket), rows) for split in sorted(by_split)
                  for bucket, rows in sharding.split_by_bucket(InstanceBatch.concat(by_split[split]), self.bits[split])]
        if not pieces:
            return
        path = f"{self.runs_dir}/{uuid.uuid4().hex}.arrow"
        with FileSystems.create(path) as f:
            with pa.ipc.new_file(f, pieces[0][1].to_arrow(self.vocab_size, with_keys=True).schema) as w:
                for _, rows in pieces:
                    w.write_table(rows.to_arrow(self.vocab_size, with_keys=True), max_chunksize=1 << 30)
        for split in by_split:
            count(f"{split}_spill_files")
        for i, (key, rows) in enumerate(pieces):
            yield (key, {"path": path, "batch": i, "rows": len(rows)})


def read_run_pieces(metas: list[dict]) -> InstanceBatch:
    """The rows of one bucket, gathered from the run files that hold a piece of it."""
    import pyarrow as pa
    from apache_beam.io.filesystems import FileSystems

    parts = []
    for m in sorted(metas, key=lambda m: (m["path"], m["batch"])):
        with FileSystems.open(m["path"]) as f:  # random access: only this bucket's record batch is read
            table = pa.Table.from_batches([pa.ipc.open_file(f).get_batch(m["batch"])])
        if table.num_rows != m["rows"]:
            raise RuntimeError(f"{m['path']} batch {m['batch']}: {table.num_rows} rows, {m['rows']} were written")
        parts.append(InstanceBatch.from_arrow(table))
    return InstanceBatch.concat(parts)


class _WritePartDoFn(beam.DoFn):
    """((split, shard), bucket, rows) -> an Arrow IPC part file; yields ((split, shard), part description)."""

    def __init__(self, parts_dir: str, vocab_size: int):
        self.parts_dir, self.vocab_size = parts_dir, vocab_size

    def process(self, item):
        import pyarrow as pa
        from apache_beam.io.filesystems import FileSystems

        (split, shard), bucket, batch = item
        path = f"{self.parts_dir}/{split}-{shard:05d}-{bucket:08d}.arrow"
        table = batch.to_arrow(self.vocab_size)
        with FileSystems.create(path) as f:
            with pa.ipc.new_stream(f, table.schema) as w:
                w.write_table(table)
        yield ((split, shard), {"bucket": bucket, "path": path, "rows": len(batch), "tokens": batch.num_tokens(),
                       "masked_tokens": batch.num_masked(), "random_next": int((batch.nsp == 1).sum())})


def parquet_writer_options(schema, compression: str, encoding: str = "dictionary") -> dict:
    """``pq.ParquetWriter`` options for a shard (BuildConfig.parquet_encoding explains the choice).
    "byte_stream_split" names every leaf column (``input_ids.list.element`` for a list)."""
    options = dict(compression=compression, write_statistics=False)
    if encoding == "byte_stream_split":
        import pyarrow as pa

        leaves = [f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name for f in schema]
        options.update(use_dictionary=False, column_encoding={leaf: "BYTE_STREAM_SPLIT" for leaf in leaves})
    elif encoding not in PARQUET_ENCODINGS:
        raise ValueError(f"parquet encoding {encoding!r} is not one of {list(PARQUET_ENCODINGS)}")
    return options


class _AssembleShardDoFn(beam.DoFn):
    """((split, shard), parts) -> the shard's Parquet file, parts streamed in bucket order, plus a sidecar."""

    def __init__(self, staging: str, num_shards: dict[str, int], row_group_size: int, compression: str,
                 encoding: str = "dictionary"):
        self.staging, self.num_shards = staging, num_shards
        self.row_group_size, self.compression, self.encoding = row_group_size, compression, encoding

    def process(self, kv):
        import pyarrow as pa
        import pyarrow.parquet as pq
        from apache_beam.io.filesystems import FileSystems

        (split, shard), parts = kv
        parts = sorted(parts, key=lambda d: d["bucket"])
        name = shard_name(split, shard, self.num_shards[split])
        out = _HashingWriter(FileSystems.create(f"{self.staging}/{name}"))
        writer = None
        for part in parts:
            with FileSystems.open(part["path"]) as f:
                table = pa.ipc.open_stream(f).read_all()
            if writer is None:
                writer = pq.ParquetWriter(out, table.schema, **parquet_writer_options(table.schema, self.compression,
                                                                                      self.encoding))
            writer.write_table(table, row_group_size=self.row_group_size)
        writer.close()
        out.close()
        FileSystems.delete([p["path"] for p in parts])
        stats = {"path": name, "rows": sum(p["rows"] for p in parts), "bytes": out.size,
                 "sha256": out.sha.hexdigest(),
                 **{k: sum(p[k] for p in parts) for k in ("tokens", "masked_tokens", "random_next")}}
        with FileSystems.create(f"{self.staging}/{name}.json") as f:
            f.write(json.dumps(stats).encode())
        count(f"{split}_rows_written", stats["rows"])
        yield stats


def shard_name(split: str, i: int, n: int) -> str:
    return f"{split}-{i:05d}-of-{n:05d}.parquet"


@dataclass(frozen=True)
class SplitShards:
    """What WriteShards makes of one split: ``num_shards`` shards. ``expected_rows`` is an
    estimate made before the run; it only sizes the buckets (memory), never the output."""

    num_shards: int
    expected_rows: int


class WriteShards(beam.PTransform):
    """(split, InstanceBatch) pairs -> exactly balanced Parquet shards per split in ``staging``,
    rows sorted by key (see :mod:`data_pipeline.sharding`); each shard also gets a ``.json``
    sidecar with size, sha256 and counts. Workers hold one bucket (about ``rows_per_bucket``
    rows) at a time, never a shard. All splits share the transforms, keyed by split.
    ``encoding``: BuildConfig.parquet_encoding.

    The bucket count comes from an estimate, so bucketing needs no extra pass over the rows:
    ``expected_rows`` (optional), a one-element PCollection {split: rows} estimated from the data
    (CreateInstances' build plan), else each SplitShards' estimate made before the run. The
    manifest records the real bucket sizes."""

    def __init__(self, staging: str, splits: dict[str, SplitShards], vocab_size: int, row_group_size: int,
                 compression: str, *, rows_per_bucket: int = 16384, spill_rows: int = 32768,
                 encoding: str = "dictionary", expected_rows=None):
        super().__init__()
        self.staging, self.splits = staging, dict(splits)
        self.vocab_size, self.row_group_size, self.compression = vocab_size, row_group_size, compression
        self.encoding, self.expected_rows = encoding, expected_rows
        self.rows_per_bucket, self.spill_rows = rows_per_bucket, spill_rows

    def expand(self, batches):
        num_shards = {s: v.num_shards for s, v in self.splits.items()}

        def place(kv, ranks):
            (split, bucket), metas = kv
            batch = read_run_pieces(list(metas))
            distribution(f"{split}_bucket_rows", len(batch))
            return (((split, s), bucket, rows)
                    for s, rows in sharding.place_bucket(bucket, batch, ranks[split], num_shards[split]))

        estimate = {s: v.expected_rows for s, v in self.splits.items()}
        side = () if self.expected_rows is None else (beam.pvalue.AsSingleton(self.expected_rows, default_value=None),)
        runs = batches | "Spill" >> beam.ParDo(
            _SpillRunsDoFn(f"{self.staging}/runs", self.vocab_size, estimate, self.rows_per_bucket, self.spill_rows),
            *side)
        ranks = (runs | "BucketRows" >> beam.Map(lambda kv: (kv[0], kv[1]["rows"]))
                 | "CountPerBucket" >> beam.CombinePerKey(sum)
                 | "BySplit" >> beam.MapTuple(lambda key, n: (key[0], (key[1], n)))
                 | "GroupSplit" >> beam.GroupByKey()
                 | "Ranks" >> beam.MapTuple(lambda split, counts: (split, sharding.bucket_ranks(dict(counts)))))
        return (
            runs
            | "GroupBucket" >> beam.GroupByKey()
            | "Place" >> beam.FlatMap(place, beam.pvalue.AsDict(ranks))
            | "WritePart" >> beam.ParDo(_WritePartDoFn(f"{self.staging}/parts", self.vocab_size))
            | "GroupShard" >> beam.GroupByKey()
            | "Assemble" >> beam.ParDo(_AssembleShardDoFn(self.staging, num_shards, self.row_group_size,
                                                          self.compression, self.encoding))
        )
