"""import-hf -> continued pretraining with the real trainer -> export: the HF weights carry through.

The trainer starts a phase from the imported checkpoint (checkpoint.init_from, module only) and
takes 2 steps at lr 1e-12, so its checkpoint must still hold the HF weights (to ~1e-9), while a
fresh init would differ by ~0.02. About 40 s (record building ~10 s, DeepSpeed start-up).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bertdist.export.sources import load_pretrained
from tests.conftest import child_env

pytestmark = [pytest.mark.shared, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_import_hf_then_continue_pretraining(tmp_path, shared_data):
    from transformers import BertConfig as HFConfig, BertForPreTraining as HF

    from bertdist.cli.main import main
    from bertdist.export import bert_tokenizer
    from data_pipeline import build_records

    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    torch.manual_seed(3)
    hf = HF(HFConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=128))
    src = tmp_path / "hf"
    hf.save_pretrained(str(src))
    bert_tokenizer(vocab, True).save_pretrained(str(src))
    shutil.copyfile(vocab, src / "vocab.txt")

    init = tmp_path / "init"
    assert main(["import-hf", str(src), "--out", str(init)]) == 0
    state = json.loads((init / "step_00000000" / "trainer_state.json").read_text())
    assert state["model"]["hidden_size"] == 64 and (init / "latest").read_text() == "step_00000000"

    manifest = build_records([f"books:{REPO / 'data_pipeline' / 'samples' / 'books'}"], tmp_path / "records",
                             init / "vocab.txt", max_seq_length=64, dupe_factor=1, num_shards=1, masking="dynamic")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "bertdist.cli.pretrain", str(REPO / "configs" / "pretrain" / "tiny.yaml"),
           f"run_dir={run}", f"data.train_manifest={manifest}", f"data.vocab_file={init / 'vocab.txt'}",
           "data.eval_split=null", "logging.progress=none", "schedule.total_steps=2", "schedule.warmup_steps=0",
           "checkpoint.every_steps=0", f"checkpoint.init_from={init}", "checkpoint.init_load_optimizer=false",
           "model.preset=custom", "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
           "model.intermediate_size=128", "model.max_position_embeddings=128", "optimizer.lr=1e-12"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=child_env(OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "init at step 0" in r.stdout + r.stderr

    trained = load_pretrained(run)
    original = load_pretrained(src)
    assert trained.origin["tag"] == "step_00000002"
    diff = max((trained.state_dict[k] - original.state_dict[k]).abs().max().item() for k in original.state_dict)
    assert diff < 1e-9, diff
    # and the imported checkpoint itself is a fine-tuning/export source
    imported = load_pretrained(init)
    assert all(torch.equal(imported.state_dict[k], original.state_dict[k]) for k in original.state_dict)
