"""CreateInstances with packing: documents packed within fixed hash-range groups, every token
counted in and out, and the rows the same however the work is cut."""
from __future__ import annotations

import hashlib
import json

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline

from data_pipeline.beam.instance_transform import CreateInstances, pack_groups
from data_pipeline.beam.shards import SplitShards, WriteShards
from tests.data_pipeline.beam._util import OPTS

SEQ = 64


def _documents(n: int, seed: int) -> list:
    """``n`` documents of 1-6 sentences; document i holds only the id 1000 + i, so every token of
    a row names its document. A few are longer than a row."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        lens = rng.integers(2, 40 if i % 7 else 90, size=int(rng.integers(1, 6)))
        bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        docs.append((f"doc{i}", np.full(int(bounds[-1]), 1000 + i, np.uint16), bounds))
    return docs


def _params():
    from data_pipeline.config import BuildConfig
    from data_pipeline.pipeline import instance_params

    cfg = BuildConfig(max_seq_length=SEQ, objective="none", masking="dynamic", dupe_factor=1, pack_documents=True)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"t{i}" for i in range(2000)]
    return instance_params(cfg, tokens)


def _build(out, docs, **cut):
    import pyarrow.parquet as pq

    params = _params()
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        built = p | beam.Create(docs) | CreateInstances(
            params, seed=3, dupe_factor=1, vocab_path="", scratch_dir=str(out / "docs"),
            report_dir=str(out / "report"), heldout_fraction=0.1, heldout_min_documents=8, **cut)
        (built["instances"]
         | WriteShards(str(out), {"train": SplitShards(2, 100), "heldout": SplitShards(1, 10)}, params.vocab_size, 16,
                       "zstd", rows_per_bucket=20, spill_rows=30, expected_rows=built["expected_rows"]))
    counters = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    tables = {f.name: pq.read_table(f) for f in sorted(out.glob("*.parquet"))}
    units = [json.loads(f.read_text()) for f in (out / "report" / "units").glob("*.json")]
    return tables, counters, units, params


def test_packed_rows_hold_every_document_once_framed(tmp_path):
    docs = _documents(80, seed=1)
    tables, counters, units, params = _build(tmp_path / "a", docs, bucket_tokens=1500, pack_group_tokens=600)
    seen: dict[int, int] = {}
    rows = 0
    for t in tables.values():
        for ids, lens in zip(t.column("input_ids").to_pylist(), t.column("document_lengths").to_pylist()):
            rows += 1
            assert len(ids) == sum(lens) <= SEQ
            pos = 0
            for n in lens:
                piece = ids[pos:pos + n]
                assert piece[0] == params.cls_id and piece[-1] == params.sep_id
                assert len(set(piece[1:-1])) == 1
                seen[piece[1]] = seen.get(piece[1], 0) + n - 2
                pos += n
        assert set(t.column("next_sentence_label").to_pylist()) == {-1}
        assert t.column("num_a_tokens").to_pylist() == [len(x) for x in t.column("input_ids").to_pylist()]
    assert seen == {1000 + i: int(d[1].shape[0]) for i, d in enumerate(docs)}  # no token lost or repeated
    assert counters["train_instances"] + counters["heldout_instances"] == rows
    assert counters["packed_documents_split"] == sum(1 for d in docs if d[1].shape[0] > SEQ - 2) > 0
    # the units' reports reconcile: document tokens in, two framing tokens a piece, rows' tokens out
    pack = [u["packing"] for u in units]
    assert sum(p["document_tokens"] for p in pack) == sum(int(d[1].shape[0]) for d in docs)
    assert sum(p["row_tokens"] for p in pack) == sum(len(x) for t in tables.values()
                                                     for x in t.column("input_ids").to_pylist())
    assert sum(p["documents"] for p in pack) == len(docs)
    assert len(units) > 2  # several pack groups: buckets of 1,500 tokens cut into groups of 600
    fill = sum(p["row_tokens"] for p in pack) / (rows * SEQ)
    assert fill > 0.9, fill


def test_packed_rows_do_not_depend_on_how_the_work_is_cut(tmp_path):
    docs = _documents(60, seed=2)
    digests = {}
    for name, cut in (("coarse", dict(slot_bits=2, target_units=1, spill_tokens=100_000)),
                      ("fine", dict(slot_bits=7, target_units=9, spill_tokens=300))):
        tables, *_ = _build(tmp_path / name, docs, bucket_tokens=2000, pack_group_tokens=700, **cut)
        digests[name] = {n: hashlib.sha256((tmp_path / name / n).read_bytes()).hexdigest() for n in tables}
    assert digests["coarse"] == digests["fine"] and len(digests["fine"]) == 3


def test_pack_groups_cut_a_bucket_by_the_plan_tokens():
    assert pack_groups(0, 1000, split_tokens=10_000, split_buckets=2, group_tokens=1000) == \
        [(i * 200, (i + 1) * 200) for i in range(5)]
    assert pack_groups(10, 20, split_tokens=5, split_buckets=1, group_tokens=1000) == [(10, 20)]


def test_packing_takes_one_dupe():
    with pytest.raises(ValueError, match="dupe_factor 1"):
        CreateInstances(_params(), seed=1, dupe_factor=2, vocab_path="", scratch_dir="x", pack_group_tokens=100)
