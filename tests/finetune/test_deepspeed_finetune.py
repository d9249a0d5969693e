"""Fine-tuning under DeepSpeed with two CPU processes (gloo) matches the single-process run.

With dropout off and fp32, rank r's micro-batches of 8 together are exactly the single-process
batch of 16 and DeepSpeed averages the gradients, so both runs train the same model: the dev
predictions must agree (logits within 1e-4). About 40 s on 2 cores.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from bertdist.finetune import FinetuneConfig, run_finetune
from tests.conftest import child_env, torchrun
from tests.finetune import fixtures

pytestmark = [pytest.mark.shared, pytest.mark.slow]

SETTINGS = ["max_seq_length=64", "batch_size=16", "max_train_examples=96", "max_eval_examples=64", "epochs=1",
            "learning_rate=2e-4", "hidden_dropout_prob=0.0", "kernels=reference", "progress=false",
            "predict_test=false", "tensorboard=false"]


@pytest.mark.parametrize("zero_stage", [2])
def test_two_process_deepspeed_matches_single_process(tmp_path, shared_data, zero_stage):
    ckpt = fixtures.tiny_hf_checkpoint(tmp_path / "ckpt", shared_data / "vocab" / "bert-base-uncased-vocab.txt",
                                         attention_probs_dropout_prob=0.0)
    data = shared_data / "glue" / "SST-2"

    single = FinetuneConfig(task="sst2", checkpoint=str(ckpt), data=str(data), output_dir=str(tmp_path / "single"),
                            **{k: json.loads(v) if v[0].isdigit() or v in ("true", "false") else v
                               for k, v in (s.split("=") for s in SETTINGS)})
    run_finetune(single)

    env = child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [*torchrun(2), "-m", "bertdist.cli.main", "finetune", "sst2", "--checkpoint", str(ckpt), "--data", str(data),
           "--out", str(tmp_path / "ds"), "--deepspeed", "--set", f"zero_stage={zero_stage}"]
    for s in SETTINGS:
        cmd += ["--set", s]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    a = json.loads((tmp_path / "single" / "predictions" / "dev.json").read_text())
    b = json.loads((tmp_path / "ds" / "predictions" / "dev.json").read_text())
    assert [x["prediction"] for x in a] == [x["prediction"] for x in b]
    diff = max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x["logits"], y["logits"]))
    assert diff <= 1e-4, diff
    # (the single-process run trained 6 steps; an engine that skipped its updates would not match it)
    sa = json.loads((tmp_path / "single" / "metrics.json").read_text())
    sb = json.loads((tmp_path / "ds" / "metrics.json").read_text())
    assert sa["world_size"] == 1 and sb["world_size"] == 2 and sb["deepspeed"] == {"zero_stage": zero_stage}
    assert sb["runs"][0]["steps"] == sa["runs"][0]["steps"] == 6
    ma, mb = sa["best"], sb["best"]
    assert ma["metrics"] == mb["metrics"] and ma["epoch"] == mb["epoch"]
