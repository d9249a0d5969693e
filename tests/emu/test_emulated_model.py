"""The whole tiny model, forward and backward, through the CUDA kernels' code (``kernels: emulated``):
the launchers' layout and tile choices, every kernel, the bindings and the autograd glue."""
from __future__ import annotations

import pytest
import torch

from bertdist.model.bert import BertForPreTraining
from bertdist.model.config import BertConfig
from tests.emu._util import emu, launched
from tests.ops._util import assert_close_rel, ext
from tests.ops.test_fused_model import _batch, _compare

ALL_KERNELS = {"ln_fwd_kernel", "ln_bwd_kernel", "column_sum_kernel", "attn_fwd_kernel", "attn_delta_kernel",
               "attn_dq_kernel", "attn_dkdv_kernel"}


def _models(kinds, **overrides):
    torch.manual_seed(0)
    models = [BertForPreTraining(BertConfig.from_preset("tiny", kernels=k, **overrides), device_type="cpu")
              for k in kinds]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    for m, k in zip(models, kinds):
        assert set(m.bert.kernels.sources.values()) == {k}
    return models


@pytest.mark.parametrize("unpad", [False, True])
def test_tiny_model_matches_reference(unpad):
    C = emu()
    ref, emu_model = _models(["reference", "emulated"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                             unpad=unpad)
    before = C.emulator_counts()
    _compare(ref, emu_model, _batch(ref.config, 3, 40), 1e-5, 1e-4)
    assert launched(before, C.emulator_counts()) == ALL_KERNELS


def test_tiny_model_with_dropout_matches_the_cpu_twin():
    # Same weights, same torch seed: both draw the same dropout seeds, and the CUDA kernels must
    # then drop exactly what the C++ CPU kernels drop, in the forward and in the backward.
    ext()
    emu()
    fus, emu_model = _models(["fused", "emulated"])
    batch = _batch(fus.config, 2, 24, seed=3)
    torch.manual_seed(11)
    out_f = fus(**batch)
    torch.manual_seed(11)
    out_e = emu_model(**batch)
    assert_close_rel(out_e.prediction_logits, out_f.prediction_logits, 1e-5, "prediction_logits")
    out_f.loss.backward()
    out_e.loss.backward()
    params_e = dict(emu_model.named_parameters())
    for name, p in fus.named_parameters():
        if p.grad is not None:
            assert_close_rel(params_e[name].grad, p.grad, 1e-4, f"grad {name}")
