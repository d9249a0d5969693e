"""`bertdist submit pseudo-label --scheduler slurm` through a real SLURM: a tiny teacher labels a
small text file on two torchrun ranks, and a resubmitted job labels only the shards that are missing
(what a requeued job does)."""
from __future__ import annotations

import pytest

from bertdist.distill.pseudolabel import load_label_rows, read_manifest
from tests.cluster.conftest import bertdist, wait_for_job
from tests.distill import fixtures as fx

pytestmark = pytest.mark.slurm


def test_two_rank_pseudo_label_job_makes_a_complete_set_and_resumes(slurm_cluster, tmp_path):
    vocab = fx.write_vocab(tmp_path / "vocab.txt")
    data = fx.write_sst2(tmp_path / "sst2")
    teacher = fx.teacher(tmp_path, "sst2", data, vocab, steps=2)
    unl = fx.write_unlabeled_text(tmp_path / "u.txt", n=37)
    labels = tmp_path / "labels"

    def submit() -> tuple[str, str]:
        r = bertdist("submit", "pseudo-label", "sst2", "--teacher", str(teacher), "--data", str(data),
                     "--unlabeled", str(unl), "--out", str(labels), "--set", "shard_rows=10",
                     "--set", "train.max_seq_length=48", "--set", "train.kernels=reference",
                     "--set", "train.progress=false", "--scheduler", "slurm", "--procs-per-node", "2",
                     cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.split("submitted SLURM job ")[1].split()[0]
        fields = wait_for_job(job_id, timeout=240)
        log = (labels / "jobs" / f"bertdist-pseudo-label-sst2-{job_id}.out").read_text()
        assert fields["JobState"] == "COMPLETED", log[-3000:]
        return job_id, log

    job_id, log = submit()
    m = read_manifest(labels)
    assert m["rows"] == 37 and m["num_shards"] == 4 and m["last_run"]["world_size"] == 2
    assert m["last_run"]["shards_labelled"] == 2  # rank 0 of 2: shards 0 and 2
    assert len(load_label_rows(labels, m)) == 37 and "world 2" in log
    # a job that stopped part-way (a shard and the manifest missing) is finished by the next start
    (labels / m["shards"][3]).unlink()
    (labels / "manifest.json").unlink()
    kept = {name: (labels / name).stat().st_mtime_ns for name in m["shards"][:3]}
    _, log = submit()
    m = read_manifest(labels)
    assert "37 rows in 4 shards (0 labelled now, 2 already there)" in log  # rank 0's line; rank 1 relabelled 3
    assert {name: (labels / name).stat().st_mtime_ns for name in kept} == kept
    assert len(load_label_rows(labels, m)) == 37
