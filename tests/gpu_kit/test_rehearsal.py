"""The GPU kit rehearsed on CPU, so that it cannot rot between the rare GPU loans.

The kit is built for this machine's Python by the same code as `make gpu-kit`, beside a copy of
what travels of the repository. A fresh venv stands in for the image: a CPU torch and the
image's packages that bertdist's GPU paths reach (at the lock's versions, which exist for this
Python), and none of what the kit ships. Its node script then runs in quick mode: once to the
end, once killed partway, after which the report on disk must list the stages done so far.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from bertdist.gpu_kit import build
from bertdist.gpu_kit.image import canonical, load_image
from bertdist.gpu_kit.requirements import read_lock, resolve

pytestmark = pytest.mark.slow  # a venv, a kit, two runs of the node script: minutes
QUICK = ["--quick", "--recipes", "tiny.yaml,bert-large-phase1.yaml", "--recipe-steps", "2", "--repeats", "1",
         "--steps", "1"]
STAGE_LABELS = {"records", "throughput mini seq 64", "auto vs reference", "recipes", "GPU tests", "kernel benchmark",
                "kernels: auto decisions"}


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                   check=True, capture_output=True, text=True)


def _installed(venv: Path) -> set[str]:
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"], check=True,
                            capture_output=True, text=True).stdout
    return {canonical(p["name"]) for p in json.loads(listed)}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, repo_root):
    tmp = tmp_path_factory.mktemp("gpu_kit_rehearsal")
    # What travels to a node: the repository's files (no venv, no in-place builds), the kit inside it.
    repo = tmp / "repo"
    for f in build.repository_files(repo_root):
        dst = repo / f.relative_to(repo_root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)
    shipped = repo_root / "configs" / "images" / "gpu-node-cuda13-py312.yaml"
    data = yaml.safe_load(shipped.read_text())
    data.update(name="ci-rehearsal", python=f"{sys.version_info.major}.{sys.version_info.minor}",
                python_full=".".join(map(str, sys.version_info[:3])))
    image_path = tmp / "image.yaml"
    image_path.write_text(yaml.safe_dump(data))
    image = load_image(image_path)
    kit_dir = repo / "dist" / "gpu-kit"
    kit = build.build_kit(image, image_path, kit_dir, lock=repo_root / "requirements.lock", log=lambda *_: None)

    # The stand-in image: a CPU torch, then what the GPU paths reach that the image has.
    lock = read_lock(repo_root / "requirements.lock")
    reached: set[str] = set()
    shipped_names = {n.name for n in resolve(image, lock, present=reached)}
    venv = tmp / "image-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _pip(venv, "torch==2.13.0")
    cpu_only = ("torch", "triton", "nvidia-", "cuda-")
    constraints = tmp / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in lock.items() if not n.startswith(cpu_only)))
    _pip(venv, "-c", str(constraints), *sorted(n for n in reached if not n.startswith(cpu_only)))
    # pip may pull in some of what the kit ships (typer's pydantic, at this lock); the image lacks them.
    extra = _installed(venv) & shipped_names
    if extra:
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *sorted(extra)],
                       check=True, capture_output=True)
    assert not _installed(venv) & shipped_names
    return {"repo": repo, "kit_dir": kit_dir, "kit": kit, "venv": venv, "tmp": tmp}


def _node_command(r: dict, out: Path, *extra: str) -> tuple[list[str], dict]:
    env = {**os.environ, "PYTHON": str(r["venv"] / "bin" / "python"), "BERTDIST_REPO": str(r["repo"]),
           "BERTDIST_CACHE_DIR": str(r["tmp"] / "user_cache")}
    env.pop("PYTHONPATH", None)
    cmd = ["bash", str(r["kit_dir"] / "run.sh"), str(out), "--site", str(out.parent / f"{out.name}-site"),
           "--work", str(out.parent / f"{out.name}-work"), *extra]
    return cmd, env


def test_the_kit_carries_what_the_image_lacks_under_the_limit(rehearsal):
    kit = rehearsal["kit"]
    names = {w["name"] for w in kit["wheels"]}
    assert {"deepspeed", "pydantic", "hjson"} <= names and "torch" not in names
    assert all(w["file"].endswith(".whl") and (rehearsal["kit_dir"] / w["file"]).is_file() for w in kit["wheels"])
    assert kit["size"]["total_mib"] <= build.DEFAULT_LIMIT_MIB
    assert set(kit["records"]["seqs"]) >= {128, 512}


def test_the_node_script_installs_builds_and_benches_with_every_stage_reported(rehearsal):
    out = rehearsal["tmp"] / "out-complete"
    cmd, env = _node_command(rehearsal, out, "--deadline-s", "480", *QUICK)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    (report,) = out.glob("acceptance_*.json")
    rep = json.loads(report.read_text())
    assert (out / "env.txt").read_text().count("## ") >= 5 and (out / "node.log").is_file()
    setup = {r["step"]: r["status"] for r in rep["setup"]}
    assert setup == {"install": "ok", "import check": "ok", "build bertdist extension": "ok",
                     "build DeepSpeed fused LAMB": "skipped"}, log[-3000:]
    assert rep["complete"] and set(rep["progress"]) == STAGE_LABELS
    assert all(v == "done" for v in rep["progress"].values()), rep["progress"]
    assert rep["environment"]["kit"].startswith("image ci-rehearsal") and "deepspeed" in rep["environment"]["kit"]
    assert {r["recipe"]: r["status"] for r in rep["recipes"]} == {"tiny.yaml": "ok"}  # large-phase1: the auto runs
    assert [r["status"] for r in rep["auto_vs_reference"]["runs"]] == ["ok", "ok"]
    assert rep["seconds"] < 480 and proc.returncode == rep["exit_status"], log[-3000:]
    md = report.with_suffix(".md").read_text()
    assert "## Node set-up (the GPU kit's run.sh)" in md and "| install | ok |" in md


def test_a_run_killed_partway_leaves_the_report_of_the_stages_done(rehearsal):
    out = rehearsal["tmp"] / "out-killed"
    cmd, env = _node_command(rehearsal, out, "--deadline-s", "480", *QUICK)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    done: dict = {}
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 400 and proc.poll() is None:
            reports = list(out.glob("acceptance_*.json"))
            if reports:
                try:
                    progress = json.loads(reports[0].read_text())["progress"]
                except (json.JSONDecodeError, KeyError):
                    progress = {}
                if progress.get("throughput mini seq 64") == "done":
                    done = progress
                    break
            time.sleep(0.5)
    finally:
        # The bench starts some children in sessions of their own (an extension build among them):
        # the kill must reach them too, or they go on loading the machine after this test.
        tree = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        os.killpg(proc.pid, signal.SIGKILL)
        for child in tree:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        psutil.wait_procs(tree, timeout=30)
    assert done, "the bench never reported a finished throughput stage"
    (report,) = out.glob("acceptance_*.json")
    rep = json.loads(report.read_text())
    assert not rep["complete"] and rep["progress"]["records"] == "done"
    assert rep["progress"]["throughput mini seq 64"] == "done"
    assert rep["throughput"] and rep["throughput"][0]["variants"]
    assert "GPU tests" not in rep["progress"] or rep["progress"]["GPU tests"] != "done"
    md = report.with_suffix(".md").read_text()
    assert "throughput mini seq 64 done" in md and "## Training throughput" in md
