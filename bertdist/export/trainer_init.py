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
from bertdist.train.state import TrainerState, checkpoint_tag

TAG = checkpoint_tag(0)


def write_trainer_init(out_dir: str | os.PathLike, w: PretrainedWeights, source: str) -> Path:
    """A DeepSpeed checkpoint dir (``latest`` -> step_00000000) holding ``w``'s weights."""
    import deepspeed
    import yaml

    from bertdist.export.hf import ExportError
    from bertdist.model import ElectraConfig
    from bertdist.model.families import family_of
    from bertdist.train.checkpoint import COMPLETE, CONFIG_FILE, LATEST, STATE_FILE
    from bertdist.train.distributed import single_process_group

    electra = isinstance(w.config, ElectraConfig)
    if electra and not w.config.has_generator:
        raise ExportError(f"{source}: an ELECTRA discriminator without its generator (no generator/ directory "
                          "beside it): ELECTRA pretraining cannot continue from it. Fine-tune or distil the "
                          "directory itself (finetune --checkpoint / distill --student take it as it is), or "
                          "import it with --format torch")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with single_process_group():
        family = family_of(w.config)
        cfg = dataclasses.replace(w.config, kernels="reference") if family.uses_kernels else w.config
        model = family.build(cfg, "cpu")
        model.load_state_dict(w.state_dict, strict=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, dist_init_required=False, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9,
            "zero_allow_untested_optimizer": True})
        engine.save_checkpoint(str(out), tag=TAG, save_latest=False)
    tdir = out / TAG
    state = TrainerState(step=0, phase=0, phases=[{"phase": 0, "init_from": f"import-hf:{source}", "init_step": None}],
                         loader=None, world_size=1, model=to_dict(w.config), optimizer="none", zero_stage=0,
                         precision="fp32", imported_from=source)
    (tdir / STATE_FILE).write_text(json.dumps(state.to_dict(), indent=2) + "\n")
    import shutil

    # the tokenizer travels with the weights, so that exporting this checkpoint writes it again
    tokenizer = None
    if w.vocab_file is not None:
        tokenizer = out / "vocab.txt"
        shutil.copyfile(w.vocab_file, tokenizer)
    elif w.tokenizer_json is not None:
        for f in w.tokenizer_files:
            shutil.copyfile(f, out / f.name)
        tokenizer = out / "tokenizer.json"
    run_cfg = {"model": to_dict(w.config),
               "data": {"vocab_file": str(tokenizer.resolve()) if tokenizer else None,
                        "do_lower_case": w.do_lower_case}}
    (tdir / CONFIG_FILE).write_text(yaml.safe_dump(run_cfg, sort_keys=False))
    (tdir / COMPLETE).write_text("")
    (out / LATEST).write_text(TAG)
    return out
