"""The package as a cluster user installs it: a wheel, in a fresh venv, with pyproject's dependencies alone.

A fresh venv (no system site-packages) gets torch from the wheel already on this machine's
disk (pip's find-links, e.g. /opt/wheels; a user brings their own CUDA torch the same way) and
the build requirements of pyproject's [build-system]. The wheel is built in that venv against
its torch (as the README's `pip install --no-build-isolation .`), installed with nothing but
the dependencies pyproject declares, and then `bertdist info` and a small `bertdist data build`
run there, outside the source tree. Slow (several minutes: a C++ build and a full dependency
install); `make test` runs it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _local_torch_wheel() -> str | None:
    """A torch wheel for this Python from pip's find-links folders, if any (the lowest version: the CPU build)."""
    r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    dirs = re.findall(r"find-links='([^']+)'", r.stdout) + os.environ.get("PIP_FIND_LINKS", "").split()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = sorted(str(p) for d in dirs for p in Path(d).glob(f"torch-*-{tag}-*linux*.whl"))
    return wheels[0] if wheels else None


def _run(cmd, cwd, env, timeout=1800):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def test_wheel_installs_into_a_fresh_venv_and_runs(repo_root, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(BERTDIST_CUDA="0", MAX_JOBS=str(os.cpu_count() or 1), BERTDIST_JIT="0",
               BERTDIST_CACHE_DIR=str(tmp_path / "cache"))
    # The source as a fresh clone has it (tracked and new files, no build outputs).
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=repo_root, capture_output=True,
                           text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for f in files:
        if (repo_root / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo_root / f, src / f)
    base = getattr(sys, "_base_executable", sys.executable)
    venv = tmp_path / "venv"
    _run([base, "-m", "venv", venv], tmp_path, env)
    py, bertdist = venv / "bin" / "python", venv / "bin" / "bertdist"
    build_requires = tomllib.loads((src / "pyproject.toml").read_text())["build-system"]["requires"]
    torch_req = _local_torch_wheel() or "torch"
    _run([py, "-m", "pip", "install", "-q", torch_req, *[r for r in build_requires if r != "torch"]], tmp_path, env)
    _run([py, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("bertdist-*.whl")
    _run([py, "-m", "pip", "install", "-q", wheel], tmp_path, env)  # pyproject's dependencies, nothing else
    _run([py, "-m", "pip", "check"], tmp_path, env)

    work = tmp_path / "work"  # outside the source tree: only the installed package is importable
    work.mkdir()
    info = json.loads(_run([bertdist, "info", "--json"], work, env).stdout)
    assert info["versions"]["bertdist"] == tomllib.loads((src / "pyproject.toml").read_text())["project"]["version"]
    assert info["data_pipeline"]["instance_builder"].startswith("native")
    where = _run([py, "-c", "import bertdist, data_pipeline; print(bertdist.__file__, data_pipeline.__file__)"], work, env)
    assert str(venv) in where.stdout and str(src) not in where.stdout

    books = src / "data_pipeline" / "samples" / "books"
    beam = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
    _run([bertdist, "data", "vocab", "--input", f"books:{books}", "--output", work / "vocab.txt", "--size", "2000"], work, env)
    _run([bertdist, "data", "build", "--config", src / "configs" / "data" / "tiny_demo.yaml", "--input",
          f"books:{books}", "--vocab", work / "vocab.txt", "--output", work / "records", *beam], work, env)
    manifest = json.loads((work / "records" / "manifest.json").read_text())
    assert manifest["counts"]["instances"] > 1000 and manifest["splits"]["train"]["shards"]
