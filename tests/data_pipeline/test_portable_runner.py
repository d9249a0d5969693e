"""The data build through Beam's portable job API: a local job service and an external worker pool
whose 2 SDK workers run in an environment of their own, without the project, and get bertdist
only from what the job stages: the wheel (--extra_package), or the sdist of --setup_file, which
each worker builds (native modules included) and installs. The shards must be byte for byte those
of the DirectRunner. One job service and worker pool serve both cases."""
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


INPUTS = [f"books:{SAMPLES / 'books'}", f"wiki:{SAMPLES / 'wiki'}"]


def check_build(staging: str, services, direct: Path, tmp_path: Path, small_vocab: Path, monkeypatch) -> None:
    """One build through ``services``, bertdist staged as a wheel or by --setup_file; its shards
    must be the DirectRunner's."""
    from cluster.beam_portable import REPO, build_wheel
    from data_pipeline import build_records

    if staging == "wheel":
        wheel = build_wheel(tmp_path / "wheel")
        args, installed = services.pipeline_args(wheel, workers=2), wheel.name
    else:
        args, installed = services.pipeline_args(setup_file=REPO / "setup.py", workers=2), "workflow.tar.gz"
    # the launcher's vocab path is relative to a folder that no worker runs in: a worker that
    # opened the launcher's path instead of the staged copy would fail
    launcher_dir = tmp_path / f"launcher-{staging}"
    launcher_dir.mkdir()
    (launcher_dir / "vocab.txt").write_bytes(small_vocab.read_bytes())
    monkeypatch.chdir(launcher_dir)
    out = tmp_path / f"portable-{staging}"
    portable = Path(build_records(INPUTS, out, "vocab.txt", pipeline_args=args, **BUILD))
    pool_log = (services.workdir / "worker_pool.log").read_text()
    booted = [line for line in pool_log.splitlines()
              if "[beam worker boot] worker" in line and f"installed ['{installed}']" in line]
    assert len(booted) >= 2, f"expected 2 workers to install {installed}; worker pool log:\n{pool_log[-4000:]}"
    ours, theirs = shard_bytes(direct), shard_bytes(portable)
    assert sorted(ours) == sorted(theirs) and len(ours) == 3
    for name in ours:
        assert ours[name] == theirs[name], f"{staging}: shard {name} differs between DirectRunner and the portable runner"
    assert json.loads(portable.read_text())["counts"] == json.loads(direct.read_text())["counts"]
    assert not list(out.glob(".staging-*")), "the staged vocab outlived the commit"


@pytest.mark.slow
def test_portable_build_matches_direct_runner(tmp_path, small_vocab, monkeypatch):
    """Both staging paths, one after the other, on one job service and worker pool (its start and
    the DirectRunner build are paid once). With --setup_file each worker compiles the native
    modules while installing the sdist: with a C++ compiler present, a failed compile fails the
    install (setup.py), so a worker that booted built them."""
    from cluster.beam_portable import LocalPortableRunner, worker_env
    from data_pipeline import build_records

    env = worker_env()  # made once under build/, reused by later runs
    assert_no_project_code(env)
    direct = build_records(INPUTS, tmp_path / "direct", small_vocab, **BUILD)
    with LocalPortableRunner(tmp_path / "services", env) as services:
        check_build("wheel", services, direct, tmp_path, small_vocab, monkeypatch)
        check_build("setup_file", services, direct, tmp_path, small_vocab, monkeypatch)
