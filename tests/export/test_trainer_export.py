"""Export from checkpoints written by the real trainer (`bertdist pretrain`), two CPU processes,
ZeRO-3 with bf16: the run's own config names the vocab, the fp32 masters are consolidated from
both ranks' shards, and transformers reproduces our logits. About 60 s on 2 cores."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from bertdist.export.sources import load_pretrained
from bertdist.export.verify import max_logit_diff
from tests.conftest import child_env, torchrun

pytestmark = [pytest.mark.shared, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_export_real_trainer_zero3_two_ranks(tmp_path, shared_data):
    from bertdist.cli.main import main
    from data_pipeline import build_records

    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    manifest = build_records([f"books:{REPO / 'data_pipeline' / 'samples' / 'books'}"], tmp_path / "records", vocab,
                             max_seq_length=64, dupe_factor=1, num_shards=2, masking="dynamic")
    run = tmp_path / "run"
    cmd = [*torchrun(2), "-m", "bertdist.cli.pretrain", str(REPO / "configs" / "pretrain" / "tiny.yaml"),
           f"run_dir={run}", f"data.train_manifest={manifest}", f"data.vocab_file={vocab}", "data.eval_split=null",
           "logging.progress=none", "schedule.total_steps=3", "schedule.warmup_steps=1", "checkpoint.every_steps=0",
           "deepspeed.zero_stage=3", "deepspeed.precision=bf16", "optimizer.name=adamw", "optimizer.lr=1e-3", "data.micro_batch_size=8", "data.global_batch_size=16"]
    env = child_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    w = load_pretrained(run)
    assert (w.origin["zero_stage"], w.origin["world_size"], w.origin["tag"]) == (3, 2, "step_00000003")
    assert w.vocab_file == vocab and w.do_lower_case is True  # from the run's bertdist_config.yaml
    assert all(v.dtype == torch.float32 for v in w.state_dict.values())
    extra = sum((t != t.bfloat16().float()).sum().item() for t in w.state_dict.values())
    assert extra > 0  # fp32 masters, not the bf16 module copy
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    d = max_logit_diff(out, w.config, w.state_dict)
    assert max(d.values()) <= 1e-4, d
