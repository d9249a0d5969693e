"""Export from real DeepSpeed checkpoints written by a two-process CPU (gloo) run.

Each case launches tests/export/ds_tiny_run.py under torch.distributed.run with 2
processes (about 25 s each on 2 cores), then consolidates the checkpoint and
checks it against the weights the engine held: with bf16 the fp32 masters must
round to the bf16 module copy exactly and carry more precision than it.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from bertdist.export.deepspeed_ckpt import consolidate, resolve_checkpoint
from bertdist.export.hf import ExportError
from bertdist.export.sources import load_pretrained
from bertdist.export.verify import max_logit_diff
from tests.conftest import child_env, torchrun

pytestmark = pytest.mark.shared
SCRIPT = Path(__file__).with_name("ds_tiny_run.py")


def _run(out: Path, stage: int, dtype: str, vocab: Path, nproc: int = 2) -> None:
    env = child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [*torchrun(nproc), str(SCRIPT), str(out), str(stage), dtype, str(vocab)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


# Stage 0 in bf16 (LAMB's setting): no optimizer shards, the fp32 masters sit unnamed in the
# optimizer wrapper's state. Stage 0 fp32 is covered by the real-trainer run in test_import_pretrain.py.
@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype,nproc", [(2, "bf16", 2), (3, "bf16", 2), (0, "bf16", 1)])
def test_export_deepspeed_checkpoint(tmp_path, shared_data, stage, dtype, nproc):
    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    run_dir = tmp_path / "run"
    _run(run_dir, stage, dtype, vocab, nproc)

    ref = resolve_checkpoint(run_dir)  # a run dir: finds checkpoints/latest
    assert ref.tag == "step3"
    ck = consolidate(run_dir)
    assert ck.zero_stage == stage and ck.world_size == nproc and ck.master_weights
    held = {k[len("model."):]: v for k, v in torch.load(run_dir / "module_weights.pt").items()}
    assert set(held) == set(ck.state_dict)
    for k, v in held.items():
        assert ck.state_dict[k].dtype == torch.float32
        assert torch.equal(ck.state_dict[k].to(v.dtype), v), k
    if dtype == "bf16":
        extra = sum((t != t.bfloat16().float()).sum().item() for t in ck.state_dict.values())
        assert extra > 0, "the export should carry the fp32 masters, not the bf16 module copy"

    # The CLI: export to HF, then transformers reproduces our logits from the consolidated weights.
    from bertdist.cli.main import main

    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    w = load_pretrained(run_dir)
    assert w.vocab_file == vocab and w.do_lower_case is True
    d = max_logit_diff(out, w.config, w.state_dict)
    assert max(d.values()) <= 1e-4, d
    # the torch format round-trips exactly
    assert main(["export", str(run_dir / "checkpoints" / "step3"), "--out", str(tmp_path / "pt"), "--format", "torch"]) == 0
    back = load_pretrained(tmp_path / "pt")
    assert all(torch.equal(back.state_dict[k], w.state_dict[k]) for k in w.state_dict)


def test_missing_checkpoint_errors_are_clear(tmp_path):
    with pytest.raises(ExportError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(ExportError, match="names checkpoint 'global_step9'"):
        resolve_checkpoint(tmp_path)
