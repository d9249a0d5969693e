"""Fixtures for the trainer tests: real records from the real pipeline, and process launchers.

Records are built by ``data_pipeline.build_records`` (the Beam pipeline, in-process) from the
bundled real text in ``data_pipeline/samples`` (Gutenberg books + a Wikipedia sample), with a
3,000-piece WordPiece vocab trained on the same text (``../shared`` is not needed). Unmasked
(dynamic masking in the loader), seq 64, NSP.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import child_env, free_port, torchrun

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "data_pipeline" / "samples"
TINY = REPO / "configs" / "pretrain" / "tiny.yaml"


def build(out: Path, vocab: Path, **overrides) -> Path:
    from data_pipeline import build_records

    args = dict(max_seq_length=64, dupe_factor=2, num_shards=4, heldout_fraction=0.1, masking="dynamic")
    args.update(overrides)
    return build_records([f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"], out, vocab, **args)


@pytest.fixture(scope="session")
def train_records(tmp_path_factory, small_vocab) -> Path:
    """manifest.json of dynamic-masking records (seq 64) with a train and a held-out split."""
    return build(tmp_path_factory.mktemp("train_records"), small_vocab)


FAULTS = Path(__file__).with_name("fault_injection.py")


def pretrain_cmd(nproc: int, *args: str, faults: list[str] | None = None, launcher: str = "torchrun") -> list[str]:
    """``bertdist pretrain`` under torchrun (env rendezvous) or the deepspeed launcher, or a plain
    process for one rank. ``faults``: options of fault_injection.py (the run then goes through it)."""
    entry = ["-m", "bertdist.cli.pretrain"] if faults is None else [str(FAULTS), *faults, "--"]
    if nproc == 1:
        return [sys.executable, *entry, *args]
    if launcher == "deepspeed":
        # DeepSpeed's per-node launcher (what the `deepspeed` command runs on every node). The
        # `deepspeed` runner itself is not used here: on SIGTERM it exits after ~1 s, too soon for a
        # checkpoint (deepspeed/launcher/runner.py sigkill_handler).
        import base64

        assert faults is None
        world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nproc))}).encode()).decode()
        return [sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--module", "bertdist.cli.pretrain", *args]
    return [*torchrun(nproc), *entry, *args]


def proc_env() -> dict[str, str]:
    env = child_env()
    # faulthandler: a rank that dies of a fatal signal prints every thread's Python stack
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1")
    return env


def tiny_args(run_dir: Path, manifest: Path, vocab: Path, *extra: str) -> list[str]:
    return [str(TINY), f"run_dir={run_dir}", f"data.train_manifest={manifest}", f"data.vocab_file={vocab}",
            "logging.progress=none", *extra]


def run_pretrain(nproc: int, args: list[str], timeout: float = 300, faults: list[str] | None = None
                 ) -> subprocess.CompletedProcess:
    return subprocess.run(pretrain_cmd(nproc, *args, faults=faults), env=proc_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def start_pretrain(nproc: int, args: list[str], log: Path, launcher: str = "torchrun") -> subprocess.Popen:
    f = open(log, "w")
    return subprocess.Popen(pretrain_cmd(nproc, *args, launcher=launcher), env=proc_env(), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(pred, proc: subprocess.Popen, timeout: float, what: str, log: Path | None = None) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}:\n"
                                 + (log.read_text()[-4000:] if log else ""))
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"timed out waiting for {what}:\n" + (log.read_text()[-4000:] if log else ""))


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group in this process, for DeepSpeed engines built by the tests themselves."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    from bertdist.train.distributed import single_process_group

    with single_process_group():
        yield


def tiny_cfg(tmp_path, records, vocab, *overrides):
    from bertdist.data import load_vocab
    from bertdist.train.config import load_train_config

    cfg = load_train_config(TINY, [f"run_dir={tmp_path}", f"data.train_manifest={records}",
                                   f"data.vocab_file={vocab}", "data.prefetch_steps=0",
                                   "data.global_batch_size=16", *overrides])
    return dataclasses.replace(cfg, model=cfg.model.with_vocab(len(load_vocab(vocab))))


def run_steps(cfg, records_path, n: int, *, fault=None):
    """Builds a fresh engine and takes ``n`` steps; returns (per-step results, the engine)."""
    import torch

    from bertdist.data import continuation_mask
    from bertdist.train.engine import build_engine
    from bertdist.train.loader import LoaderState, PretrainingLoader, open_training_records
    from bertdist.train.restore import RestorePlan, new_state, restore
    from bertdist.train.step import StepRunner, train_step

    built = build_engine(cfg, RestorePlan("fresh"), 1, 1, "cpu")
    state = restore(built.engine, built.scheduler, RestorePlan("fresh"), cfg, 0, new_state(cfg, 1, 1))
    assert state.step == 0 and state.loader == {"epoch": 0, "position": 0}
    if fault:
        fault(built.engine)
    records = open_training_records(str(records_path), cfg.data.vocab_file, cfg.data.max_seq_length)
    loader = PretrainingLoader(records, cfg.data, rank=0, world_size=1, grad_accum=1,
                               continuation=continuation_mask(cfg.data.vocab_file))
    runner = StepRunner.for_run(built.engine, cfg, torch.device("cpu"), 1)
    steps = loader.steps(LoaderState())
    try:
        results = [train_step(runner, next(steps)[0], i + 1, stop_requested=False) for i in range(n)]
    finally:
        steps.close()
    return results, built.engine


def assert_ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"


def metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if row["kind"] == kind:
            rows.append(row)
    return rows


def last_train_step(run_dir: Path) -> int:
    rows = metrics(run_dir)
    return rows[-1]["step"] if rows else 0
