"""Packed MLM-only records through the whole build, with a BPE tokenizer.json: the manifest
describes them (format 2), its counters reconcile with the shards, and the reader serves them."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bertdist.config import ConfigError
from bertdist.data import RecordsError, open_records, vocab_sha256
from tests.conftest import SAMPLES


def test_packed_build_round_trips_through_the_manifest(packed_records, small_bpe_tokenizer):
    from tokenizers import Tokenizer

    rec = open_records(packed_records, expect_vocab_sha256=vocab_sha256(small_bpe_tokenizer),
                       expect_max_seq_length=1024)
    man = rec.manifest
    tok = Tokenizer.from_file(str(small_bpe_tokenizer))
    assert man["format_version"] == 2 and rec.packed
    fmt = rec.record_format
    assert fmt["packing"]["documents"] and fmt["packing"]["column"] == "document_lengths"
    assert "document_lengths" in fmt["columns"] and fmt["objective"] == "none" and fmt["masking"] == "dynamic"
    assert fmt["masked_lm_prob"] == 0.3 and fmt["max_predictions_per_seq"] == 308  # ceil(0.3 x 1,024)
    assert man["vocab"]["kind"] == "tokenizer.json" and man["vocab"]["model"] == "BPE"
    assert man["vocab"]["size"] == tok.get_vocab_size(with_added_tokens=True)
    assert man["special_token_ids"] == {r: tok.token_to_id(t) for r, t in (
        ("pad", "[PAD]"), ("unk", "[UNK]"), ("cls", "[CLS]"), ("sep", "[SEP]"), ("mask", "[MASK]"))}
    cls, sep = man["special_token_ids"]["cls"], man["special_token_ids"]["sep"]
    counts = man["counts"]
    total_tokens = pieces = rows = 0
    for split in ("train", "heldout"):
        part = open_records(packed_records, split=split)
        pk = counts["packing"][split]
        split_tokens = 0
        for i in range(len(part.shards)):
            t = part.read_shard(i)
            assert t.schema.field("input_ids").type.value_type.bit_width == 16
            for ids, lens in zip(t.column("input_ids").to_pylist(), t.column("document_lengths").to_pylist()):
                assert len(ids) == sum(lens) <= 1024
                starts = np.cumsum([0] + lens[:-1])
                assert all(ids[s] == cls and ids[s + n - 1] == sep for s, n in zip(starts, lens))
                split_tokens += len(ids)
                pieces += len(lens)
                rows += 1
        assert split_tokens == pk["row_tokens"] == pk["document_tokens"] + 2 * pk["pieces"]
        assert pk["documents"] == man["splits"][split]["documents"] and pk["rows"] == man["splits"][split]["rows"]
        total_tokens += split_tokens
    assert counts["tokens"] == total_tokens and counts["instances"] == rows
    assert counts["input_tokens"] + 2 * pieces == total_tokens  # every document token is in the rows
    assert counts["packing"]["train"]["split_documents"] >= 1 and counts["packing"]["train"]["fill"] > 0.9
    # the text comes back: Macbeth's words decode from its pieces
    bodies = [ids[s + 1:s + n - 1] for i in range(len(rec.shards)) for ids, lens in zip(
        rec.read_shard(i).column("input_ids").to_pylist(), rec.read_shard(i).column("document_lengths").to_pylist())
        for s, n in zip(np.cumsum([0] + lens[:-1]), lens)]
    texts = [tok.decode(b) for b in bodies]
    assert sum("Macbeth" in t for t in texts) >= 3 and all(t.strip() for t in texts)


def test_a_reader_of_format_1_refuses_packed_records(packed_records, monkeypatch):
    import bertdist.data.manifest as manifest

    monkeypatch.setattr(manifest, "READABLE_VERSIONS", (1,))
    with pytest.raises(RecordsError, match="format_version 2, this reader knows 1: update bertdist"):
        open_records(packed_records, verify=False)


def test_packing_and_word_masks_are_checked_before_the_build(tmp_path, small_bpe_tokenizer, small_vocab):
    from data_pipeline import build_records

    common = dict(max_seq_length=1024, objective="none", masking="dynamic", dupe_factor=1)
    inputs = [f"books:{SAMPLES / 'books' / 'shakespeare-macbeth.txt'}"]
    with pytest.raises(ConfigError, match="needs objective: none, masking: dynamic and dupe_factor: 1.*masking: static"):
        build_records(inputs, tmp_path / "a", small_vocab, **{**common, "masking": "static"}, pack_documents=True)
    unmarked = tmp_path / "unmarked" / "tokenizer.json"  # a BPE marking neither continuations nor word starts
    spec = json.loads(small_bpe_tokenizer.read_text())
    spec["pre_tokenizer"], spec["decoder"] = {"type": "Whitespace"}, None
    unmarked.parent.mkdir()
    unmarked.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="masking_mode 'whole_word' needs word boundaries.*nor word starts"):
        build_records(inputs, tmp_path / "b", unmarked, **common, masking_mode="whole_word")
    with pytest.raises(ConfigError, match="normalizer decides the case"):
        build_records(inputs, tmp_path / "c", small_bpe_tokenizer, **common, lowercase=True)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").glob("manifest.json"))


def test_unpacked_wordpiece_records_stay_format_1(sample_records):
    man = json.loads(sample_records.read_text())
    assert man["format_version"] == 1 and "packing" not in man["records"] and "kind" not in man["vocab"]
    assert "document_lengths" not in man["records"]["columns"]


def test_8192_token_rows(tmp_path, small_bpe_tokenizer):
    """Rows of 8,192 tokens: uint16 positions and lengths still hold them; the default
    max_predictions_per_seq at 30% is 2,458."""
    from data_pipeline import build_records

    m = build_records([f"books:{SAMPLES / 'books'}"], tmp_path / "r", small_bpe_tokenizer, max_seq_length=8192,
                      objective="none", masking="dynamic", masked_lm_prob=0.3, dupe_factor=1, pack_documents=True,
                      num_shards=1, heldout_fraction=0.0)
    rec = open_records(m)
    assert rec.record_format["max_predictions_per_seq"] == 2458
    t = rec.read_shard(0)
    lens = t.column("document_lengths").to_pylist()
    assert max(max(x) for x in lens) == 8192 and all(sum(x) <= 8192 for x in lens)
    assert rec.manifest["counts"]["packing"]["train"]["fill"] > 0.95


def test_bert_tokenizer_json_builds_the_same_shards_as_its_vocab_txt(tmp_path, small_vocab):
    """BERT's tokenizer saved as a tokenizer.json gives the ordinary (NSP, static whole-word
    masking) build the same ids, masks and shards as its vocab.txt: only the manifest says which
    file it was (format 2, vocab.kind)."""
    from data_pipeline import build_records
    from data_pipeline.tokenization import load_tokenizer

    tok, _ = load_tokenizer(small_vocab)
    tok.save(str(tmp_path / "tokenizer.json"))
    inputs = [f"books:{SAMPLES / 'books' / 'shakespeare-macbeth.txt'}", f"wiki:{SAMPLES / 'wiki'}"]
    common = dict(max_seq_length=96, dupe_factor=1, num_shards=2, masking_mode="whole_word")
    shards = {}
    for name, vocab in (("txt", small_vocab), ("json", tmp_path / "tokenizer.json")):
        man = json.loads(build_records(inputs, tmp_path / name, vocab, **common).read_text())
        shards[name] = [s["sha256"] for sp in man["splits"].values() for s in sp["shards"]]
        assert man["format_version"] == (1 if name == "txt" else 2)
        assert man["counts"]["instances"] > 100 and 0.13 < man["counts"]["masked_fraction"] < 0.17
    assert shards["txt"] == shards["json"]


@pytest.mark.slow  # Beam worker processes: about 10 s
def test_packed_shards_are_byte_identical_across_worker_counts(tmp_path, small_bpe_tokenizer):
    """1 in-process worker and 2 worker processes (the CLI) pack the same rows into the same bytes."""
    import subprocess
    import sys

    from data_pipeline import build_records
    from tests.conftest import child_env

    sets = {"max_seq_length": 1024, "objective": "none", "masking": "dynamic", "masked_lm_prob": 0.3,
            "dupe_factor": 1, "pack_documents": True, "pack_group_tokens": 30_000, "num_shards": 3}
    inputs = [f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"]
    a = build_records(inputs, tmp_path / "a", small_bpe_tokenizer, **sets)
    cmd = [sys.executable, "-m", "bertdist.cli.main", "data", "build", "--vocab", str(small_bpe_tokenizer),
           "--output", str(tmp_path / "b"), *[x for i in inputs for x in ("--input", i)],
           *[x for k, v in sets.items() for x in ("--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}")],
           "--runner=DirectRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "packed train" in r.stdout and "rows of 1,024" in r.stdout
    shards = {}
    for name in ("a", "b"):
        man = json.loads((tmp_path / name / "manifest.json").read_text())
        shards[name] = {s["path"].rsplit("/", 1)[-1]: s["sha256"] for sp in man["splits"].values() for s in sp["shards"]}
    assert shards["a"] == shards["b"] and len(shards["a"]) == 4
    assert a == tmp_path / "a" / "manifest.json"


def test_static_whole_word_masking_with_a_byte_level_bpe_masks_whole_words(tmp_path, small_bpe_tokenizer):
    """A build with the byte-level BPE tokenizer.json and static whole-word masking: its words come
    from the 'Ġ' word starts, and every word of every row is masked whole or not at all."""
    from bertdist.data import continuation_mask, open_records
    from data_pipeline import build_records

    table = continuation_mask(small_bpe_tokenizer)
    manifest = build_records([f"books:{SAMPLES / 'books' / 'shakespeare-macbeth.txt'}"], tmp_path / "r",
                             small_bpe_tokenizer, max_seq_length=128, objective="none", masking="static",
                             masking_mode="whole_word", dupe_factor=1, num_shards=1, dedup={"enabled": False})
    records = open_records(manifest)
    assert records.manifest["vocab"]["word_boundaries"] is True
    special = set(records.manifest["vocab"]["special_ids"])
    rows = words = whole = 0
    for table_ in records.iter_shards():
        for ids, pos, mids in zip(*(table_.column(c).to_pylist() for c in
                                    ("input_ids", "masked_lm_positions", "masked_lm_ids"))):
            orig = np.asarray(ids)
            orig[pos] = mids
            masked = np.zeros(len(orig), bool)
            masked[pos] = True
            maskable = ~np.isin(orig, list(special))
            prev = np.concatenate([[False], maskable[:-1]])
            word = np.cumsum(maskable & (~table[orig] | ~prev))
            for k in range(1, word[-1] + 1):
                w = np.flatnonzero(maskable & (word == k))
                assert masked[w].all() or not masked[w].any(), (orig[w], masked[w])
                words += 1
                whole += len(w) > 1 and masked[w].all()
            rows += 1
    assert rows > 50 and words > 1000 and whole > 20
