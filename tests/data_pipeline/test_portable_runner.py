"""The data build through Beam's portable job API: a local job service and an external worker pool
whose 2 SDK workers run in an environment of their own, without the project, and get bertdist
only from the wheel the job stages. The shards must be byte for byte those of the DirectRunner."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SAMPLES

BUILD = dict(max_seq_length=64, dupe_factor=2, num_shards=2, heldout_num_shards=1, heldout_fraction=0.1,
             heldout_min_documents=0)


def shard_bytes(manifest_path: Path) -> dict[str, bytes]:
    """{shard path relative to its run folder: bytes} of every shard the manifest lists."""
    manifest = json.loads(manifest_path.read_text())
    out = {}
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            path = manifest_path.parent / shard["path"]
            out[Path(shard["path"]).name] = path.read_bytes()
    return out


def assert_no_project_code(env: Path) -> None:
    for module in ("data_pipeline", "bertdist"):
        probe = subprocess.run([str(env / "bin" / "python"), "-c", f"import {module}"], cwd="/",
                               capture_output=True, text=True)
        assert probe.returncode != 0 and f"No module named '{module}'" in probe.stderr, probe.stderr


@pytest.mark.slow
def test_portable_build_matches_direct_runner(tmp_path, small_vocab, monkeypatch):
    from cluster.beam_portable import LocalPortableRunner, build_wheel, worker_env
    from data_pipeline import build_records

    env = worker_env()  # made once under build/, reused by later runs
    assert_no_project_code(env)
    wheel = build_wheel(tmp_path / "wheel")
    inputs = [f"books:{SAMPLES / 'books'}", f"wiki:{SAMPLES / 'wiki'}"]
    direct = build_records(inputs, tmp_path / "direct", small_vocab, **BUILD)

    # the launcher's vocab path is relative to a folder that no worker runs in: a worker that
    # opened the launcher's path instead of the staged copy would fail
    launcher_dir = tmp_path / "launcher"
    launcher_dir.mkdir()
    (launcher_dir / "vocab.txt").write_bytes(small_vocab.read_bytes())
    monkeypatch.chdir(launcher_dir)
    with LocalPortableRunner(tmp_path / "services", env) as services:
        portable = build_records(inputs, tmp_path / "portable", "vocab.txt",
                                 pipeline_args=services.pipeline_args(wheel, workers=2), **BUILD)
    pool_log = (tmp_path / "services" / "worker_pool.log").read_text()

    booted = [line for line in pool_log.splitlines() if "[beam worker boot] worker" in line and wheel.name in line]
    assert len(booted) >= 2, f"expected 2 workers to install {wheel.name}; worker pool log:\n{pool_log[-4000:]}"
    ours, theirs = shard_bytes(direct), shard_bytes(Path(portable))
    assert sorted(ours) == sorted(theirs) and len(ours) == 3
    for name in ours:
        assert ours[name] == theirs[name], f"shard {name} differs between DirectRunner and the portable runner"
    m_direct, m_portable = json.loads(direct.read_text()), json.loads(Path(portable).read_text())
    assert m_portable["counts"] == m_direct["counts"]
    assert not list((tmp_path / "portable").glob(".staging-*")), "the staged vocab outlived the commit"
