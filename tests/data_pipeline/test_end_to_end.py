"""End to end: real data, byte-identical shards across worker counts, killed runs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bertdist.data import RecordsError, open_records, vocab_sha256

from tests.conftest import IN_PROCESS, SAMPLES


@pytest.mark.shared
def test_wiki_and_books_end_to_end(shared_data, tmp_path):
    from data_pipeline import build_records
    from data_pipeline.tokenization import load_tokenizer

    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    m = build_records([f"wiki:{shared_data / 'wiki'}", f"books:{shared_data / 'books' / 'austen-persuasion.txt'}",
                       f"books:{shared_data / 'books' / 'shakespeare-macbeth.txt'}"],
                      tmp_path / "out", vocab, max_seq_length=128, dupe_factor=1, num_shards=4)
    rec = open_records(m, expect_vocab_sha256=vocab_sha256(vocab), expect_max_seq_length=128)
    man = rec.manifest
    assert man["counts"]["documents"] >= 95  # 98 articles + 2 books, minus held-out/short ones
    assert man["skips"]["skipped_wiki_redirect"] == 99  # + 1 redirect outside ns 0
    assert man["skips"]["skipped_wiki_not_article_namespace"] == 1
    assert 0.14 < man["counts"]["masked_fraction"] < 0.16
    assert abs(man["counts"]["random_next_fraction"] - 0.5) < 0.03
    # the held-out floor: 20 documents, not 1% of ~100; every random-next row its own window
    assert man["heldout"]["documents"] == man["splits"]["heldout"]["documents"] == 20 and not man["warnings"]
    for split in ("train", "heldout"):
        neg = man["negatives"][split]
        assert neg["random_next"] > 500 and neg["distinct_fraction"] >= 0.95, (split, neg)
        assert neg["max_window_reuse"] <= 2 and neg["same_document_fallbacks"] == 0
    rows = [r for _, r in rec.shards]
    assert max(rows) - min(rows) <= 1
    tok, _ = load_tokenizer(vocab)
    text = " ".join(tok.decode(r) for r in rec.read_shard(0).column("input_ids").to_pylist()[:200])
    for junk in ("{{", "}}", "[[", "<ref", "thumb|", "category :"):
        assert junk not in text


def _build_cmd(out: Path, vocab: Path, workers: int, mode: str) -> list[str]:
    return [sys.executable, "-m", "bertdist.cli.main", "data", "build", "--input", f"wiki:{SAMPLES / 'wiki'}",
            "--input", f"books:{SAMPLES / 'books'}", "--vocab", str(vocab), "--output", str(out),
            "--set", "max_seq_length=64", "--set", "dupe_factor=2", "--set", "num_shards=3",
            "--runner=DirectRunner", f"--direct_running_mode={mode}", f"--direct_num_workers={workers}"]


def _shard_bytes(manifest: Path) -> dict[str, bytes]:
    man = json.loads(manifest.read_text())
    return {Path(s["path"]).name: (manifest.parent / s["path"]).read_bytes()
            for sp in man["splits"].values() for s in sp["shards"]}


@pytest.mark.slow  # Beam worker processes: about 7 s
def test_byte_identical_across_worker_counts(tmp_path, small_vocab):
    """1 in-process worker and 2 worker processes write the same shard bytes. The manifest records
    the NSP negatives' diversity and the held-out split, with the small-corpus warning."""
    from data_pipeline import build_records

    a = build_records([f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"], tmp_path / "a", small_vocab,
                      max_seq_length=64, dupe_factor=2, num_shards=3)
    r = subprocess.run(_build_cmd(tmp_path / "b", small_vocab, 2, "multi_processing"), check=True,
                       capture_output=True, text=True, timeout=300)
    sa, sb = _shard_bytes(a), _shard_bytes(tmp_path / "b" / "manifest.json")
    assert sa.keys() == sb.keys() and len(sa) == 4
    for k in sa:
        assert sa[k] == sb[k], f"{k} differs between 1 in-process worker and 2 processes"
    ma, mb = json.loads(a.read_text()), json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert ma["negatives"] == mb["negatives"] and ma["counts"] == mb["counts"] and ma["heldout"] == mb["heldout"]
    neg = ma["negatives"]["train"]
    assert neg["random_next"] == ma["counts"]["random_next"] - ma["negatives"]["heldout"]["random_next"] > 5000
    assert neg["distinct_windows"] >= 0.99 * neg["random_next"] and neg["max_window_reuse"] <= 2
    assert ma["negatives"]["buckets"] == {"train": 1, "heldout": 1}
    # 31 documents, 3 of them books: 20 held-out documents would hold out most of the text
    assert ma["heldout"]["documents"] == ma["splits"]["heldout"]["documents"] < 20 and len(ma["warnings"]) == 1
    assert "fewer than heldout_min_documents=20" in ma["warnings"][0]
    assert "NSP negatives, (document, start sentence) windows" in r.stdout and "WARNING: held-out split" in r.stdout


# Runs the CLI build in a child that stops for good at one step of the commit, so the test kills
# it at that exact point instead of racing a polling loop against a build that may already be done.
_HANG_AT = """
import pathlib, sys, time
from data_pipeline import commit, output_dir, pipeline
step, flag = sys.argv[1], pathlib.Path(sys.argv[2])
def hang():
    flag.touch()
    time.sleep(600)
if step == "before_commit":  # every shard staged, nothing committed
    def stop(*a, **k):
        hang()
    pipeline.commit = stop
else:  # the staging dir is renamed to shards-<run>/, manifest.json not yet written
    finish = output_dir.OutputDir.finish
    def stop(self, *a):
        finish(self, *a)
        hang()
    output_dir.OutputDir.finish = stop
sys.argv = ["bertdist", *sys.argv[3:]]
from bertdist.cli.main import run
run()
"""


@pytest.mark.slow  # a killed CLI build and a re-run: about 8 s
@pytest.mark.parametrize("step", ["before_commit", "after_shard_rename"])
def test_killed_run_leaves_no_valid_manifest_and_rerun_replaces(tmp_path, small_vocab, step):
    out, flag = tmp_path / "out", tmp_path / "stopped"
    cmd = _build_cmd(out, small_vocab, 1, "in_memory")
    proc = subprocess.Popen([sys.executable, "-c", _HANG_AT, step, str(flag), *cmd[3:]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not flag.exists() and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert flag.exists(), f"the build never reached {step} (exit code {proc.returncode})"
    staged = list(out.glob(".staging-*/*.parquet")) + list(out.glob("shards-*/*.parquet"))
    assert staged, "the killed run wrote no shards, so this test checks nothing"
    assert not (out / "manifest.json").exists()
    with pytest.raises(RecordsError, match="manifest not found"):
        open_records(out)
    # a full re-run commits, and removes the dead run's staging or shard directory
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    assert open_records(out).num_rows > 0
    assert not list(out.glob(".staging-*")) and len(list(out.glob("shards-*"))) == 1


def test_byte_stream_split_shards_hold_the_same_rows(tmp_path, small_vocab):
    """``parquet_encoding=byte_stream_split``: every column is BYTE_STREAM_SPLIT-encoded (no
    dictionary), the rows equal the default encoding's, and the reader verifies and reads them."""
    import pyarrow.parquet as pq

    from bertdist.config import ConfigError
    from data_pipeline import build_records
    from data_pipeline.config import BuildConfig

    inputs = [f"books:{SAMPLES / 'books'}"]
    kw = dict(max_seq_length=64, dupe_factor=1, num_shards=2, heldout_fraction=0.3)
    plain = build_records(inputs, tmp_path / "dict", small_vocab, **kw)
    split = build_records(inputs, tmp_path / "bss", small_vocab, parquet_encoding="byte_stream_split", **kw)
    assert open_records(split, expect_vocab_sha256=vocab_sha256(small_vocab)).manifest["config"][
        "parquet_encoding"] == "byte_stream_split"  # the manifest says how its shards are encoded
    for name in ("train", "heldout"):
        a, b = open_records(plain, split=name), open_records(split, split=name)
        assert len(a.shards) == len(b.shards) >= 1
        for i, (path, _) in enumerate(b.shards):
            assert b.read_shard(i).equals(a.read_shard(i))
            meta = pq.ParquetFile(path).metadata
            encodings = {e for rg in range(meta.num_row_groups) for c in range(meta.num_columns)
                         for e in meta.row_group(rg).column(c).encodings}
            assert "BYTE_STREAM_SPLIT" in encodings and not encodings & {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}
    with pytest.raises(ConfigError, match=r"parquet_encoding: 'delta' is not one of \['dictionary', 'byte_stream_split'\]"):
        BuildConfig(parquet_encoding="delta")
