"""The pseudo-label set: made once, reused by students of any size and from a copy of its teacher
and input, refused for another teacher, and split across two ranks (the resumable-set mechanism
itself: tests/test_stored_set.py)."""
import subprocess

import pyarrow.parquet as pq
import pytest
import torch

from bertdist.distill.pseudolabel import LabelSetMismatch, load_label_rows, read_manifest
from bertdist.distill.train import run_distill, run_pseudo_label
from tests.conftest import REPO, child_env
from tests.distill import fixtures as fx


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("labels")
    vocab = fx.write_vocab(tmp / "vocab.txt")
    data = fx.write_sst2(tmp / "sst2")
    return tmp, vocab, data, fx.teacher(tmp, "sst2", data, vocab, steps=4)


def test_shards_hold_the_teachers_logits_for_every_row(tmp_path, task):
    tmp, _, data, teacher = task
    unl = fx.write_unlabeled_text(tmp_path / "u.txt", n=37)
    cfg = fx.distill_config("sst2", teacher, data, [unl], tmp_path / "run", labels_dir=str(tmp_path / "labels"),
                            shard_rows=10)
    m = run_pseudo_label(cfg)
    assert m["rows"] == 37 and m["num_shards"] == 4 and m["logits"] == "full" and m["num_outputs"] == 2
    assert m["teacher"]["sha256"] and m["tokenizer"]["max_seq_length"] == 48
    assert m["sources"][0]["rows"] == 37 and len(m["sources"][0]["sha256"]) == 64
    rows = load_label_rows(tmp_path / "labels", read_manifest(tmp_path / "labels"))
    assert [pq.read_metadata(tmp_path / "labels" / s).num_rows for s in m["shards"]] == [10, 10, 10, 7]
    # the stored logits are the teacher's own on those inputs
    from bertdist.distill.teacher import load_teacher

    t = load_teacher(teacher, "sst2", "classification", 2, device=torch.device("cpu"), kernels="reference")
    r = rows[5]
    batch = {k: torch.tensor([r[k]]) for k in ("input_ids", "token_type_ids", "attention_mask")}
    with torch.no_grad():
        want = t.model(batch)[0][0]
    assert torch.allclose(torch.from_numpy(r["teacher"]), want, atol=1e-5)
    # a copy of the teacher and of the input elsewhere: the same set, nothing relabelled
    import shutil

    shutil.copytree(teacher, tmp_path / "copy" / "teacher")
    shutil.copy(unl, tmp_path / "copy" / "u.txt")
    cfg = fx.distill_config("sst2", tmp_path / "copy" / "teacher", data, [tmp_path / "copy" / "u.txt"],
                            tmp_path / "run", labels_dir=str(tmp_path / "labels"), shard_rows=10)
    again = run_pseudo_label(cfg)
    assert again["last_run"]["shards_labelled"] == 0 and again["last_run"]["shards_reused"] == 4


def test_students_of_any_size_reuse_the_set_and_another_teacher_is_refused(tmp_path, task):
    tmp, vocab, data, teacher = task
    unl = fx.write_unlabeled_text(tmp_path / "u.txt", n=24)
    labels = tmp_path / "labels"
    copy = tmp_path / "copy" / "u.txt"  # the second student names a copy of the input: the same set
    copy.parent.mkdir()
    copy.write_bytes(unl.read_bytes())
    for i, (student, source) in enumerate((("layers:1", unl), ("preset:tiny", copy))):
        cfg = fx.distill_config("sst2", teacher, data, [source], tmp_path / f"s{i}", labels_dir=str(labels), steps=2,
                                student="layers:1")
        r = run_distill(cfg)
        if i == 0:
            stamp = {p.name: p.stat().st_mtime_ns for p in labels.iterdir()}
        assert r["pseudo_labels"]["reused"] is (i == 1) and r["student"]["train_rows"] == 24 + 32
    assert {p.name: p.stat().st_mtime_ns for p in labels.iterdir()} == stamp  # nothing relabelled
    copy.write_text(unl.read_text() + "one more line of text\n")
    cfg = fx.distill_config("sst2", teacher, data, [copy], tmp_path / "s4", labels_dir=str(labels), steps=2,
                            student="layers:1")
    with pytest.raises(LabelSetMismatch, match=r"made from other files than --unlabeled names .*sources\[0\]\.sha256"):
        run_distill(cfg)
    other = fx.teacher(tmp_path, "sst2", data, vocab, steps=4, seed=1)
    cfg = fx.distill_config("sst2", other, data, [unl], tmp_path / "s2", labels_dir=str(labels), steps=2,
                            student="layers:1")
    with pytest.raises(LabelSetMismatch, match="another teacher or tokenizer.*teacher.sha256"):
        run_distill(cfg)
    cfg = fx.distill_config("sst2", teacher, data, [unl], tmp_path / "s3", labels_dir=str(labels), steps=2,
                            student="layers:1")
    cfg.train.max_seq_length = 32
    with pytest.raises(LabelSetMismatch, match="tokenizer.max_seq_length: set has 48, this run has 32"):
        run_distill(cfg)


@pytest.mark.slow
def test_two_ranks_split_the_shards_and_rank_0_writes_the_manifest(tmp_path, task):
    from tests.conftest import torchrun

    tmp, _, data, teacher = task
    unl = fx.write_unlabeled_text(tmp_path / "u.txt", n=50)
    labels = tmp_path / "labels"
    cmd = [*torchrun(2), "-m", "bertdist.cli.main", "pseudo-label", "sst2", "--teacher", str(teacher),
           "--data", str(data), "--unlabeled", str(unl), "--out", str(labels), "--set", "shard_rows=10",
           "--set", "train.max_seq_length=48", "--set", "train.kernels=reference", "--set", "train.progress=false"]
    rc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stdout[-3000:] + rc.stderr[-3000:]
    m = read_manifest(labels)
    assert m["last_run"]["world_size"] == 2 and m["last_run"]["shards_labelled"] == 3  # rank 0: shards 0, 2, 4
    assert [r["input_ids"] for r in load_label_rows(labels, m)][:1] and len(load_label_rows(labels, m)) == 50


def test_a_corrupt_or_outside_shard_is_an_error_naming_it(tmp_path, task):
    from bertdist.finetune.errors import DataError

    tmp, _, data, teacher = task
    unl = fx.write_unlabeled_text(tmp_path / "u.txt", n=12)
    cfg = fx.distill_config("sst2", teacher, data, [unl], tmp_path / "run", labels_dir=str(tmp_path / "labels"),
                            shard_rows=10)
    m = run_pseudo_label(cfg)
    first = tmp_path / "labels" / m["shards"][0]
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    with pytest.raises(DataError, match=first.name + ": not a readable pseudo-label shard"):
        load_label_rows(tmp_path / "labels", m)
    with pytest.raises(DataError, match=r"outside .*relative paths inside its folder"):
        load_label_rows(tmp_path / "labels", {**m, "shards": ["../u.txt"]})
