"""data_pipeline.beam.instance_transform: splits never mix, and the output does not depend on how the work is cut."""
from __future__ import annotations

import apache_beam as beam
import numpy as np
from apache_beam.testing.test_pipeline import TestPipeline

from data_pipeline.beam.instance_transform import CreateInstances
from data_pipeline.beam.shards import SplitShards, WriteShards
from tests.data_pipeline.beam._util import OPTS


def test_splits_share_the_transforms_and_never_mix(tmp_path, small_vocab):
    """Train and held-out documents go through one CreateInstances + WriteShards, keyed by split:
    each split gets its own balanced shards, and an NSP negative comes from its own split only."""
    import pyarrow.parquet as pq

    from bertdist.data.vocab import load_vocab
    from data_pipeline.config import BuildConfig
    from data_pipeline.negatives import HeldOutSplit
    from data_pipeline.pipeline import instance_params

    tokens = load_vocab(small_vocab)
    # document i holds only ids 1000 + 10 i ... 1000 + 10 i + 9 (unmasked records keep them; the
    # special tokens are below 1000), so every token of a row names the document it came from
    docs = []
    for i in range(40):
        ids = np.array([1000 + 10 * i + (j % 10) for j in range(20 * 12)], np.uint16)
        docs.append((f"doc{i}", ids, np.arange(0, 241, 12, dtype=np.int64)))
    split_of = HeldOutSplit.from_fraction(0.3)
    want = {d[0]: split_of(d[0]) for d in docs}
    assert set(want.values()) == {"train", "heldout"}
    cfg = BuildConfig(max_seq_length=48, dupe_factor=2, masking="dynamic")
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        built = p | beam.Create(docs) | CreateInstances(
            instance_params(cfg, tokens), seed=3, dupe_factor=2, vocab_path=str(small_vocab),
            scratch_dir=str(tmp_path / "docs"), heldout_fraction=0.3, spill_tokens=700)
        (built["instances"]
         | WriteShards(str(tmp_path), {"train": SplitShards(3, 200), "heldout": SplitShards(2, 80)}, len(tokens), 16,
                       "zstd", rows_per_bucket=30, spill_rows=50))
    counters = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    doc_split = {i: want[f"doc{i}"] for i in range(40)}
    for split, n in (("train", 3), ("heldout", 2)):
        rows = [pq.read_table(tmp_path / f"{split}-{s:05d}-of-{n:05d}.parquet").num_rows for s in range(n)]
        assert max(rows) - min(rows) <= 1 and sum(rows) == counters[f"{split}_instances"] > 0
        negatives = 0
        for s in range(n):
            t = pq.read_table(tmp_path / f"{split}-{s:05d}-of-{n:05d}.parquet")
            for ids, nsp in zip(t.column("input_ids").to_pylist(), t.column("next_sentence_label").to_pylist()):
                from_docs = {(i - 1000) // 10 for i in ids if i >= 1000}
                assert {doc_split[d] for d in from_docs} == {split}, (split, from_docs)
                negatives += nsp == 1 and len(from_docs) == 2
        assert negatives > 0  # random-next rows did draw from another document of the same split
    assert counters["heldout_random_next"] > 0 and counters["train_random_next"] > 0


def test_instances_do_not_depend_on_how_the_work_is_cut(tmp_path, small_vocab):
    """How the spilled documents are sliced (slot_bits), how many work units there are and how
    big the spill files are change nothing in the shards; the plan and the units' reports add up
    to what was written. Small buckets (bucket_tokens) make several per split."""
    import hashlib
    import json

    import pyarrow.parquet as pq

    from bertdist.data.vocab import load_vocab
    from data_pipeline.config import BuildConfig
    from data_pipeline.pipeline import instance_params

    tokens = load_vocab(small_vocab)
    docs = _random_documents(60, seed=5)
    cfg = BuildConfig(max_seq_length=48, dupe_factor=2)
    shards = {}
    for name, cut in (("coarse", dict(slot_bits=2, target_units=1, spill_tokens=100_000)),
                      ("fine", dict(slot_bits=7, target_units=9, spill_tokens=400))):
        out = tmp_path / name
        with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
            built = p | beam.Create(docs) | CreateInstances(
                instance_params(cfg, tokens), seed=3, dupe_factor=2, vocab_path=str(small_vocab),
                scratch_dir=str(out / "docs"), report_dir=str(out / "report"), heldout_fraction=0.1,
                heldout_min_documents=12, bucket_tokens=4000, **cut)
            (built["instances"]
             | WriteShards(str(out), {"train": SplitShards(2, 300), "heldout": SplitShards(1, 60)}, len(tokens), 16,
                           "zstd", rows_per_bucket=50, spill_rows=80, expected_rows=built["expected_rows"]))
        shards[name] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.glob("*.parquet"))}
        plans = [json.loads(f.read_text()) for f in (out / "report").glob("plan-*.json")]
        plan = plans[0]
        assert plans and all(p == plan for p in plans)
        units = [json.loads(f.read_text()) for f in (out / "report" / "units").glob("*.json")]
        assert plan["documents"] == {"train": 48, "heldout": 12} and len(plan["buckets"]["train"]) > 1
        for split, n in (("train", 2), ("heldout", 1)):
            mine = [u for u in units if u["split"] == split]
            rows = sum(pq.read_metadata(out / f"{split}-{i:05d}-of-{n:05d}.parquet").num_rows for i in range(n))
            assert sum(u["documents"] for u in mine) == plan["documents"][split]
            assert sum(u["instances"] for u in mine) == rows > 0
            negatives = sum(u["random_next"] for u in mine)
            assert 0.97 * negatives <= sum(u["distinct_windows"] for u in mine) <= negatives
            assert max(u["max_window_reuse"] for u in mine) <= 2
        if name == "fine":
            assert len(units) > len(plan["buckets"]["train"]) + 1  # buckets were cut into several units
    assert shards["coarse"] == shards["fine"] and len(shards["fine"]) == 3


def _random_documents(n: int, seed: int) -> list:
    """``n`` tokenized documents of 3-40 sentences of 4-20 random ids each."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        lens = rng.integers(4, 20, size=int(rng.integers(3, 40)))
        bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        docs.append((f"doc{i}", rng.integers(1000, 2999, size=int(bounds[-1])).astype(np.uint16), bounds))
    return docs


def test_shard_buckets_are_sized_from_the_plan_not_the_prerun_estimate(tmp_path, small_vocab):
    """The held-out floor makes the held-out split many times ``heldout_fraction`` of the corpus:
    sized by the estimate made before the run it would be one bucket, which a worker holds and
    sorts whole, growing with the corpus. WriteShards sizes its buckets from CreateInstances'
    ``expected_rows`` (the plan's real token counts) instead; the rows are the same either way."""
    import pyarrow.parquet as pq

    from bertdist.data.vocab import load_vocab
    from data_pipeline.config import BuildConfig
    from data_pipeline.pipeline import instance_params

    tokens = load_vocab(small_vocab)
    docs = _random_documents(60, seed=9)
    cfg = BuildConfig(max_seq_length=48, dupe_factor=2)
    found = {}
    for name in ("prerun_estimate", "plan"):
        out = tmp_path / name
        with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
            built = p | beam.Create(docs) | CreateInstances(
                instance_params(cfg, tokens), seed=3, dupe_factor=2, vocab_path=str(small_vocab),
                scratch_dir=str(out / "docs"), heldout_fraction=0.01, heldout_min_documents=20,
                heldout_floor_max_fraction=0.5)
            # before the run, 1% of about 1,200 rows: 12, one bucket
            (built["instances"]
             | WriteShards(str(out), {"train": SplitShards(2, 1200), "heldout": SplitShards(1, 12)}, len(tokens), 16,
                           "zstd", rows_per_bucket=40, expected_rows=built["expected_rows"] if name == "plan" else None))
        dist = {d.key.metric.name: d.committed for d in p.result.metrics().query()["distributions"]}
        heldout = pq.read_table(out / "heldout-00000-of-00001.parquet")
        found[name] = (dist["heldout_bucket_rows"], heldout, pq.read_table(out / "train-00000-of-00002.parquet"))
    before, after = found["prerun_estimate"][0], found["plan"][0]
    rows = found["plan"][1].num_rows
    assert rows > 200, rows  # the floor's 20 documents: a third of the corpus, not 1%
    assert before.count == 1 and before.max == rows
    assert after.count >= rows // 80 and after.max <= 80, (after.count, after.max, rows)
    assert found["plan"][1].equals(found["prerun_estimate"][1]) and found["plan"][2].equals(found["prerun_estimate"][2])

