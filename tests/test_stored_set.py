"""Stored sets: one rule for when two plans are the same (paths aside, for all three kinds of
set), sharded sets resumed after a kill and split across ranks, one-file sets computed once, and
one model identity."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bertdist.export.tokenizer import tokenizer_sha256
from bertdist.finetune.errors import DataError
from bertdist.stored_set import (MANIFEST, PLAN, SetMismatch, model_sha256, num_shards, open_or_make, plan_diff,
                                 read_manifest, run_sharded, shard_name, write_json_atomic, write_parquet_atomic)
from tests.conftest import REPO, child_env


class OtherSet(SetMismatch):
    """The sets of these tests."""


def write_model(d: Path, bias: bytes = b"\0\1") -> Path:
    """A model directory as far as its identity goes: weights, config, vocabulary."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.safetensors").write_bytes(b"weights" + bias)
    (d / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (d / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\n")
    return d


# ---------------------------------------------------------------- the one rule
def test_plan_diff_sets_paths_aside_at_any_depth_and_names_every_other_difference():
    have = {"model": {"path": "/a/m", "sha256": "1", "format": "hf"},
            "sources": [{"path": "/a/x.txt", "sha256": "s", "rows": 3}], "rows": 3, "created": "earlier"}
    same = {"model": {"path": "/b/m", "sha256": "1"}, "sources": [{"path": "/b/x.txt", "sha256": "s", "rows": 3}],
            "rows": 3}
    assert plan_diff(have, same) == []  # and keys only the stored side has (created, format) are no difference
    other = {"model": {"path": "/b/m", "sha256": "2"}, "sources": [{"path": "/b/y.txt", "sha256": "t", "rows": 4}],
             "rows": 4}
    assert plan_diff(have, other) == [
        "model.sha256: set has '1', this run has '2' (the set's model is /a/m, this run's /b/m)",
        "sources[0].rows: set has 3, this run has 4 (the set's sources[0] is /a/x.txt, this run's /b/y.txt)",
        "sources[0].sha256: set has 's', this run has 't' (the set's sources[0] is /a/x.txt, this run's /b/y.txt)",
        "rows: set has 3, this run has 4"]
    assert plan_diff(have, {**same, "sources": same["sources"] * 2}) == ["sources: 1 in the set, 2 in this run"]
    assert plan_diff({}, {"top_k": 4}) == ["top_k: set has None, this run has 4"]


def pseudo_label_plan(model: Path, source: Path) -> dict:
    from bertdist.distill.pseudolabel import make_plan
    from bertdist.distill.teacher import Teacher

    teacher = SimpleNamespace(path=model, sha256=model_sha256(model), vocab_file=model / "vocab.txt",
                              tokenizer_files=(), vocab_sha256=tokenizer_sha256(model / "vocab.txt"), do_lower_case=True)
    teacher.identity = lambda: Teacher.identity(teacher)
    runner = SimpleNamespace(kind="classification", num_labels=2, label_names=["negative", "positive"])
    examples = source.read_text().splitlines()
    src = SimpleNamespace(path=source, examples=examples, skipped_blank=0)
    return make_plan("sst2", runner, teacher, SimpleNamespace(max_seq_length=32), [src], len(examples), 2)


def teacher_set_plan(model: Path, source: Path) -> dict:
    from bertdist.embed.distill import make_plan, teacher_identity

    teacher = SimpleNamespace(vocab_file=model / "vocab.txt", tokenizer_files=(), do_lower_case=True,
                              max_seq_length=32, pooling="mean", normalize=True, dim=8)
    texts = [(t,) for t in source.read_text().splitlines()]
    return make_plan("embedding_mse", teacher_identity(teacher, model), {"train": source}, texts)


def embedding_job_plan(model: Path, source: Path) -> dict:
    from bertdist.retrieval.embed_job import make_plan, model_identity, read_texts

    encoder = SimpleNamespace(vocab_file=model / "vocab.txt", do_lower_case=True, pooling="mean", normalize=True,
                              truncate_dim=None, dim=8, max_seq_length=32, origin={"format": "hf"})
    return make_plan(model_identity(encoder, model), [read_texts(source)], 2)


KINDS = {"pseudo-labels": pseudo_label_plan, "teacher set": teacher_set_plan, "embedding job": embedding_job_plan}


@pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())
def test_a_path_only_difference_is_accepted_by_every_kind_of_set(make, tmp_path):
    model = write_model(tmp_path / "a" / "model")
    source = tmp_path / "a" / "texts.txt"
    source.write_text("the cat\nthe the cat\ncat\n")
    stored = make(model, source)
    copy = tmp_path / "b"
    shutil.copytree(tmp_path / "a", copy)
    assert plan_diff(stored, make(copy / "model", copy / "texts.txt")) == []
    (copy / "texts.txt").write_text("the cat\nthe the cat\ncat the\n")  # the same length, other content
    diff = plan_diff(stored, make(copy / "model", copy / "texts.txt"))
    assert any(d.startswith("sources[0].sha256: set has") and f"this run's {copy / 'texts.txt'}" in d for d in diff)
    write_model(copy / "model", bias=b"\1\1")
    diff = plan_diff(stored, make(copy / "model", source))
    assert [d.split(":")[0] for d in diff] in (["teacher.sha256"], ["model.sha256"])


# ---------------------------------------------------------------- sharded sets
def plan_of(rows: int, shard_rows: int, source: str = "/a/in.txt", sha: str = "s") -> dict:
    return {"format": "test/1", "sources": [{"path": source, "sha256": sha}], "rows": rows, "shard_rows": shard_rows,
            "num_shards": num_shards(rows, shard_rows)}


def write_rows(path: Path, lo: int, hi: int) -> None:
    write_parquet_atomic({"row": list(range(lo, hi))}, path)


def sharded(out: Path, plan: dict, **kw) -> dict:
    return run_sharded(out, plan, write_rows, mismatch=OtherSet, what="test rows", verb="written", desc="testing",
                       unit="row", progress=False, **kw)


def test_a_sharded_set_is_resumed_and_reused_from_a_copy_of_its_sources_and_refused_for_others(tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "set"
    m = sharded(out, plan_of(7, 3), shard_entry=lambda name, lo, hi: {"file": name, "rows": hi - lo})
    assert m["shards"] == [{"file": shard_name(k, 3), "rows": r} for k, r in enumerate((3, 3, 1))]
    rows = [pq.read_table(out / s["file"]).column("row").to_pylist() for s in m["shards"]]
    assert rows == [[0, 1, 2], [3, 4, 5], [6]]
    assert m["last_run"]["shards_written"] == 3 and m["last_run"]["rows_written"] == 7
    (out / shard_name(1, 3)).unlink()
    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    m = sharded(out, plan_of(7, 3, source="/elsewhere/in.txt"))  # a copy of the input: the same set
    assert (m["last_run"]["shards_written"], m["last_run"]["rows_written"], m["last_run"]["shards_reused"]) == (1, 3, 2)
    assert all((out / name).stat().st_mtime_ns == t for name, t in stamp.items())
    assert read_manifest(out, ("test/1",), "unfinished", "absent")["shards"] == [shard_name(k, 3) for k in range(3)]
    with pytest.raises(OtherSet, match=r"plan\.json: this directory holds test rows of another run: sources\[0\]\."
                                       r"sha256: set has 's', this run has 't'\. Use another output directory"):
        sharded(out, plan_of(7, 3, sha="t"))
    assert not list(out.glob(".*tmp*"))


def test_a_manifest_names_why_a_set_cannot_be_read(tmp_path):
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}: no {MANIFEST}: absent")):
        read_manifest(tmp_path, ("test/1",), "unfinished", "absent")
    write_json_atomic(tmp_path / PLAN, plan_of(1, 1))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}: no {MANIFEST}: unfinished")):
        read_manifest(tmp_path, ("test/1",), "unfinished", "absent")
    write_json_atomic(tmp_path / MANIFEST, {"format": "test/0"})
    with pytest.raises(DataError, match=r"format 'test/0', expected one of \['test/1'\]"):
        read_manifest(tmp_path, ("test/1",), "unfinished", "absent")
    (tmp_path / MANIFEST).write_text("[1]")
    with pytest.raises(DataError, match="expected a JSON object, got list"):
        read_manifest(tmp_path, ("test/1",), "unfinished", "absent")


SHARDED_JOB = """
import sys, time
from pathlib import Path
from tests.test_stored_set import OtherSet, plan_of, write_rows
from bertdist.stored_set import run_sharded

def slow(path, lo, hi):  # the kill lands while shards are still being written
    write_rows(path, lo, hi)
    time.sleep(float(sys.argv[2]))

m = run_sharded(Path(sys.argv[1]), plan_of(40, 2), slow, mismatch=OtherSet, what="test rows", verb="written",
                desc="testing", unit="row", progress=False)
print(m["last_run"]["shards_written"], m["last_run"]["shards_reused"], "shards" in m)
"""


def job(out: Path, sleep: float) -> list[str]:
    return [sys.executable, "-c", SHARDED_JOB, str(out), str(sleep)]


def test_a_killed_job_resumes_without_redoing_done_shards(tmp_path):
    out = tmp_path / "set"
    proc = subprocess.Popen(job(out, 0.3), cwd=REPO, env=child_env(PYTHONPATH=str(REPO)))
    deadline = time.time() + 120
    while len(list(out.glob("shard-*.parquet"))) < 3:
        assert proc.poll() is None, "the job ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}
    assert 3 <= len(done) < 20 and not (out / MANIFEST).exists()
    rc = subprocess.run(job(out, 0), cwd=REPO, env=child_env(PYTHONPATH=str(REPO)), capture_output=True, text=True,
                        timeout=120)
    assert rc.returncode == 0, rc.stderr
    assert rc.stdout.split() == [str(20 - len(done)), str(len(done)), "True"]
    assert all((out / name).stat().st_mtime_ns == t for name, t in done.items())
    assert not list(out.glob(".*tmp*"))


def test_ranks_without_a_process_group_split_the_shards_and_rank_0_writes_the_manifest(tmp_path):
    out = tmp_path / "set"
    procs = [subprocess.Popen(job(out, 0), cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=child_env(PYTHONPATH=str(REPO), RANK=str(r), WORLD_SIZE="2")) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert [o.split() for o, _ in outs] == [["10", "0", "True"], ["10", "0", "False"]]  # rank 0: 0, 2, ..., 18
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) == 20


# ---------------------------------------------------------------- one-file sets
def test_a_one_file_set_is_computed_once_reused_from_a_copy_and_refused_for_other_data(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"text": ["a", "b"]}

    def open_set(plan):
        return open_or_make(tmp_path / "set", plan, "rows.parquet", compute, mismatch=OtherSet, what="test set",
                            advice="Use another directory.")

    table, m = open_set(plan_of(2, 2))
    assert table == {"text": ["a", "b"]} and not m["reused"] and m["file"] == "rows.parquet"
    table, m = open_set(plan_of(2, 2, source="/elsewhere/in.txt"))
    assert table == {"text": ["a", "b"]} and m["reused"] and len(calls) == 1
    with pytest.raises(OtherSet, match=r"manifest\.json: test set of another run: rows: set has 2, this run has 3"):
        open_set(plan_of(3, 2))
    (tmp_path / "set" / MANIFEST).unlink()  # an unfinished set: its plan decides
    with pytest.raises(OtherSet, match=r"plan\.json: an unfinished test set of another run: .*sha256.*\. Use another"):
        open_set(plan_of(2, 2, sha="t"))


# ---------------------------------------------------------------- model identity
def test_the_model_hash_is_the_same_for_a_copy_and_changes_with_weights_config_or_vocabulary(tmp_path):
    model = write_model(tmp_path / "m")
    (model / ".cache").mkdir()
    (model / ".cache" / "x.json").write_text("{}")  # hidden: not the model
    (model / "global_step1").mkdir()
    (model / "global_step1" / "bf16_zero_pp_rank_0_optim_states.pt").write_bytes(b"adam")  # optimizer state
    want = model_sha256(model)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(model, copy)
    (copy / "global_step1" / "bf16_zero_pp_rank_0_optim_states.pt").write_bytes(b"other adam")
    assert model_sha256(copy) == want
    for name, text in (("model.safetensors", "other weights"), ("config.json", "{}"), ("vocab.txt", "[PAD]\n")):
        other = tmp_path / f"other-{name}"
        shutil.copytree(model, other)
        (other / name).write_text(text)
        assert model_sha256(other) != want, name
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no weight or config files"):
        model_sha256(empty)
