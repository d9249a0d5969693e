"""The trainer's reader: verification of checksums, vocab hash, max_seq_length; clear errors."""
from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest

from bertdist.data import RecordsError, open_records, vocab_sha256


@pytest.fixture()
def records_copy(sample_records, tmp_path):
    dst = tmp_path / "rec"
    shutil.copytree(sample_records.parent, dst)
    return dst / "manifest.json"


def test_open_and_read(sample_records, small_vocab):
    rec = open_records(sample_records, expect_vocab_sha256=vocab_sha256(small_vocab), expect_max_seq_length=64)
    assert len(rec.shards) == 3 and rec.num_rows > 100
    rows = [r for _, r in rec.shards]
    assert max(rows) - min(rows) <= 1  # balanced
    t = rec.read_shard(0)
    assert t.column_names == ["input_ids", "num_a_tokens", "next_sentence_label", "masked_lm_positions", "masked_lm_ids"]
    assert str(t.schema.field("input_ids").type.value_type) == "uint16"
    sp = rec.special_token_ids
    for row in t.slice(0, 50).to_pylist():
        ids = row["input_ids"]
        assert len(ids) <= 64 and ids[0] == sp["cls"] and ids[-1] == sp["sep"]
        assert ids[row["num_a_tokens"] - 1] == sp["sep"]
        assert row["next_sentence_label"] in (0, 1)
        assert len(row["masked_lm_positions"]) == len(row["masked_lm_ids"]) <= 10
    held = open_records(sample_records, split="heldout")
    assert held.num_rows > 0


def test_vocab_and_seq_len_mismatch(sample_records):
    with pytest.raises(RecordsError, match="vocab sha256"):
        open_records(sample_records, expect_vocab_sha256="0" * 64)
    with pytest.raises(RecordsError, match="max_seq_length 64"):
        open_records(sample_records, expect_max_seq_length=128)


def test_altered_shard_named(records_copy):
    rec = open_records(records_copy)
    path = rec.shards[1][0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(RecordsError, match=path.name + ".*altered"):
        open_records(records_copy)


def test_truncated_shard_named(records_copy):
    rec = open_records(records_copy)
    path = rec.shards[0][0]
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(RecordsError, match=path.name + ".*truncated"):
        open_records(records_copy)
    # without verification the read itself still fails loudly, naming the file
    unverified = open_records(records_copy, verify=False)
    with pytest.raises(RecordsError, match=path.name):
        unverified.read_shard(0)


def test_missing_shard_and_bad_manifest(records_copy):
    rec = open_records(records_copy)
    rec.shards[2][0].unlink()
    with pytest.raises(RecordsError, match="missing"):
        open_records(records_copy)
    records_copy.write_text("{not json")
    with pytest.raises(RecordsError, match="not valid JSON"):
        open_records(records_copy)


def test_readable_without_our_code(sample_records):
    """Plain pyarrow (and so pandas/Spark/datasets) reads a shard directly."""
    man = json.loads(sample_records.read_text())
    t = pq.read_table(sample_records.parent / man["splits"]["train"]["shards"][0]["path"])
    assert t.num_rows == man["splits"]["train"]["shards"][0]["rows"]
    assert isinstance(t.column("input_ids").to_pylist()[0][0], int)



@pytest.mark.parametrize("where", ["../outside.parquet", "/etc/passwd", "shards/../../outside.parquet"])
def test_a_manifest_cannot_point_outside_its_folder(records_copy, where):
    outside = records_copy.parent.parent / "outside.parquet"
    outside.write_bytes(b"not ours to read")
    man = json.loads(records_copy.read_text())
    man["splits"]["train"]["shards"][0]["path"] = where
    records_copy.write_text(json.dumps(man))
    for verify in (True, False):
        with pytest.raises(RecordsError, match=r"outside .*relative paths inside its folder"):
            open_records(records_copy, verify=verify)
