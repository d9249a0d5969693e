"""Fine-tuning with our fused kernels (`--set kernels=fused`; on CPU the C++ kernels of bertdist._C):
with dropout off, the same few SST-2 steps give the reference kernels' losses and dev logits
(fp32, within LOSS_TOL / LOGIT_TOL), and the fused ops really ran (counted at the op, and
metrics.json records what `kernels` resolved to)."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from tests.finetune import fixtures

pytestmark = pytest.mark.shared

STEPS = 4
# fp32 on both paths; the C++ kernels sum in another order than torch's ops, so the two agree to
# rounding. Measured on 2 CPU cores: losses identical as TensorBoard stores them (float32, ~0.69),
# dev logits (|x| <= 0.07) within 3.4e-8 after 4 AdamW steps at lr 1e-4.
LOSS_TOL = 1e-6
LOGIT_TOL = 1e-6


@pytest.fixture(scope="module")
def no_dropout_ckpt(tmp_path_factory, shared_data):
    """A tiny checkpoint whose config turns off hidden and attention dropout (so both paths are deterministic)."""
    return fixtures.tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_no_dropout"),
                                       shared_data / "vocab" / "bert-base-uncased-vocab.txt",
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _finetune(out, ckpt, data, kernels):
    from bertdist.cli.main import main

    settings = [f"kernels={kernels}", "device=cpu", f"max_steps={STEPS}", "epochs=1", "batch_size=8",
                "max_seq_length=64", "max_train_examples=32", "max_eval_examples=24", "learning_rate=1e-4",
                "predict_test=false", "progress=false"]
    argv = ["finetune", "sst2", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(out)]
    assert main(argv + [a for s in settings for a in ("--set", s)]) == 0
    summary = json.loads((out / "metrics.json").read_text())
    run = summary["runs"][0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / f"lr{run['lr']:g}_seed{run['seed']}" / "tensorboard")).Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    logits = np.array([r["logits"] for r in json.loads((out / "predictions" / "dev.json").read_text())])
    return summary, np.array(losses), logits


def test_finetune_fused_kernels_match_reference(tmp_path, no_dropout_ckpt, shared_data, monkeypatch):
    from bertdist.ops.dispatch import kernel_status

    unusable = [f"{s.op}: {s.reason}" for s in kernel_status("cpu") if not s.usable]  # via fused.availability
    if unusable:
        pytest.skip(f"fused CPU kernels unavailable: {'; '.join(unusable)}")
    from bertdist.ops import fused

    calls = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    data = shared_data / "glue" / "SST-2"
    ref, ref_losses, ref_logits = _finetune(tmp_path / "reference", no_dropout_ckpt, data, "reference")
    assert set(ref["kernel_sources"].values()) == {"reference"}

    # The model picks its ops from the fused module when it is built, so the counters sit in the path.
    for op in ("layer_norm", "bias_dropout_add_layer_norm", "attention"):
        monkeypatch.setattr(fused, op, counted(op, getattr(fused, op)))
    fus, fus_losses, fus_logits = _finetune(tmp_path / "fused", no_dropout_ckpt, data, "fused")
    assert fus["kernels"] == "fused" and set(fus["kernel_sources"].values()) == {"fused"}
    # 2 layers x (attention + 2 residual LNs) and the embedding LN per forward; train + eval forwards
    assert calls["attention"] >= 2 * STEPS and calls["bias_dropout_add_layer_norm"] >= 4 * STEPS
    assert calls["layer_norm"] >= STEPS

    assert len(ref_losses) == len(fus_losses) == STEPS
    assert np.abs(fus_losses - ref_losses).max() <= LOSS_TOL, (ref_losses, fus_losses)
    assert ref_logits.shape == fus_logits.shape == (24, 2)
    assert np.abs(fus_logits - ref_logits).max() <= LOGIT_TOL
    assert np.abs(ref_logits).max() > 1000 * LOGIT_TOL  # logits are not ~0, so the tolerance is not vacuous
