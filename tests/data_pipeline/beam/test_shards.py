"""data_pipeline.beam.tokenize and .shards: tokenized documents through instances into shards under
TestPipeline, and what WriteShards refuses."""
from __future__ import annotations

import pickle
import uuid

import apache_beam as beam
import numpy as np
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from data_pipeline.beam.instance_transform import CreateInstances
from data_pipeline.beam.shards import SplitShards, WriteShards
from data_pipeline.beam.tokenize import Tokenize
from data_pipeline.instance_batch import InstanceBatch
from tests.data_pipeline.beam._util import OPTS, _check


def test_tokenize_instances_and_write(tmp_path, small_vocab):
    from data_pipeline.pipeline import instance_params
    from data_pipeline.config import BuildConfig
    from bertdist.data.vocab import load_vocab
    import pyarrow.parquet as pq

    tokens = load_vocab(small_vocab)
    docs = [(f"d{i}", [f"Sentence {j} of document {i} is here." for j in range(30)]) for i in range(12)]
    docs += [("empty", []), ("one", ["Only one sentence."])]
    cfg = BuildConfig(max_seq_length=32, dupe_factor=2)
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        tok = p | beam.Create(docs) | Tokenize(str(small_vocab))
        assert_that(tok | beam.Map(lambda d: (d[0], len(d[2]) - 1)), equal_to([(f"d{i}", 30) for i in range(12)]),
                    label="tok")
        inst = (tok | CreateInstances(instance_params(cfg, tokens), seed=1, dupe_factor=2,
                                      vocab_path=str(small_vocab), scratch_dir=str(tmp_path / "docs"),
                                      spill_tokens=500))["instances"]
        assert_that(inst | "n" >> beam.MapTuple(lambda split, b: (split, len(b) > 0)),
                    equal_to([("train", True)] * 12), label="inst")
        kept = tmp_path / "kept"  # every instance batch, to check the shards' order against
        inst | "Keep" >> beam.Map(_keep, kept)
        # 40 rows per bucket: several buckets, most straddling a shard boundary; spills every 100 rows
        written = inst | WriteShards(str(tmp_path), {"train": SplitShards(3, expected_rows=300)}, len(tokens), 16,
                                     "zstd", rows_per_bucket=40, spill_rows=100)
        assert_that(written | beam.Map(lambda s: s["rows"]) | beam.combiners.ToList(),
                    lambda r: _check(len(r[0]) == 3 and max(r[0]) - min(r[0]) <= 1), label="rows")
    names = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    assert names["skipped_empty_document"] == 1 and names["skipped_too_few_sentences"] == 1
    assert names["train_spill_files"] >= 3  # rows went through several run files
    t = pq.read_table(tmp_path / "train-00000-of-00003.parquet")
    assert t.num_rows > 0 and max(len(x) for x in t.column("input_ids").to_pylist()) <= 32
    assert not list((tmp_path / "parts").iterdir())  # every part file was streamed into a shard and removed
    import hashlib, json
    for i in range(3):
        side = json.loads((tmp_path / f"train-{i:05d}-of-00003.parquet.json").read_text())
        assert side["sha256"] == hashlib.sha256((tmp_path / side["path"]).read_bytes()).hexdigest()
        assert side["bytes"] == (tmp_path / side["path"]).stat().st_size
    # shards are consecutive key ranges, each sorted: the rows of all shards in order are all the
    # instances sorted by key
    batches = [pickle.loads(f.read_bytes())[1] for f in sorted(kept.iterdir())]
    want = InstanceBatch.concat(batches).sorted_by_key().to_arrow(len(tokens))
    shards = [pq.read_table(tmp_path / f"train-{i:05d}-of-00003.parquet") for i in range(3)]
    got = [row for t in shards for row in t.column("input_ids").to_pylist()]
    assert got == want.column("input_ids").to_pylist()
    assert [r for t in shards for r in t.column("masked_lm_ids").to_pylist()] == want.column("masked_lm_ids").to_pylist()


def _keep(kv, folder):
    folder.mkdir(exist_ok=True)
    (folder / uuid.uuid4().hex).write_bytes(pickle.dumps(kv))
    return kv


def test_write_shards_rejects_a_split_it_was_not_given(tmp_path):
    import pytest

    batch = InstanceBatch(keys=np.array([1], np.uint64), ids=np.array([2, 3], np.uint16), ids_offsets=np.array([0, 2]),
                          num_a=np.array([1], np.uint16), nsp=np.array([0], np.int8), mpos=np.empty(0, np.uint16),
                          mids=np.empty(0, np.uint16), m_offsets=np.zeros(2, np.int64))
    with pytest.raises(Exception, match="split 'dev' reached WriteShards, which writes \\['train'\\]"):
        with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
            (p | beam.Create([("dev", batch)])
             | WriteShards(str(tmp_path), {"train": SplitShards(1, 10)}, 100, 16, "zstd"))
