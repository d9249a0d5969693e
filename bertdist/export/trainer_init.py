"""Weights from elsewhere (an HF dir) as a checkpoint our trainer starts a phase from.

``bertdist pretrain ... checkpoint.init_from=OUT checkpoint.init_load_optimizer=false``
loads the module weights of a DeepSpeed checkpoint (``engine.load_checkpoint(...,
load_module_only=True)``) and checks the architecture in ``trainer_state.json``.
So we write a genuine DeepSpeed checkpoint (a one-process, fp32, ZeRO-0 engine
saves it) plus the trainer's metadata in its layout (bertdist.train.checkpoint):
``latest``, ``<tag>/trainer_state.json``, ``<tag>/bertdist_config.yaml``, ``COMPLETE``.
The same directory is what ``bertdist finetune --checkpoint`` and ``bertdist export`` read.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from bertdist.config import to_dict
from bertdist.export.sources import PretrainedWeights

TAG = "step_00000000"


_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE")


def _init_single_process_dist() -> dict | None:
    """A 1-process gloo group when none exists (DeepSpeed needs one); returns the env to restore."""
    import socket

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return None
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    return saved


def _teardown_dist(saved: dict | None) -> None:
    """Leave no process group and no rendezvous variables behind (child processes inherit the env)."""
    if saved is None:
        return
    from deepspeed.utils import groups

    # DeepSpeed caches a clone of the world group; once destroyed, a second import in this
    # process would hand the stale clone to the next engine ("Group ... is not registered").
    groups._WORLD_GROUP = None
    torch.distributed.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def write_trainer_init(out_dir: str | os.PathLike, w: PretrainedWeights, source: str) -> Path:
    """A DeepSpeed checkpoint dir (``latest`` -> step_00000000) holding ``w``'s weights."""
    import deepspeed
    import yaml

    from bertdist.model import BertForPreTraining
    from bertdist.train.checkpoint import COMPLETE, CONFIG_FILE, LATEST, STATE_FILE
    from bertdist.train.trainer import STATE_FORMAT

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = _init_single_process_dist()
    try:
        cfg = dataclasses.replace(w.config, kernels="reference")
        model = BertForPreTraining(cfg, device_type="cpu")
        model.load_state_dict(w.state_dict, strict=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, dist_init_required=False, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9,
            "zero_allow_untested_optimizer": True})
        engine.save_checkpoint(str(out), tag=TAG, save_latest=False)
    finally:
        _teardown_dist(made)
    tdir = out / TAG
    state = {"format": STATE_FORMAT, "step": 0, "phase": 0,
             "phases": [{"phase": 0, "init_from": f"import-hf:{source}", "init_step": None}],
             "loader": None, "world_size": 1, "model": to_dict(w.config), "optimizer": "none",
             "zero_stage": 0, "precision": "fp32", "skipped_steps": 0, "imported_from": source}
    (tdir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    run_cfg = {"model": to_dict(w.config),
               "data": {"vocab_file": str((out / "vocab.txt").resolve()) if w.vocab_file else None,
                        "do_lower_case": w.do_lower_case}}
    if w.vocab_file is not None:
        import shutil

        shutil.copyfile(w.vocab_file, out / "vocab.txt")
    (tdir / CONFIG_FILE).write_text(yaml.safe_dump(run_cfg, sort_keys=False))
    (tdir / COMPLETE).write_text("")
    (out / LATEST).write_text(TAG)
    return out
