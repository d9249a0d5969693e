"""The per-GPU memory estimate of `bertdist pretrain --plan` (bertdist/train/memory.py)."""
from __future__ import annotations

import pytest

from bertdist.model import BertConfig
from bertdist.train.memory import bert_parameter_count, estimate_memory


@pytest.mark.parametrize("preset", ["tiny", "mini", "base", "large"])
def test_parameter_count_is_the_models(preset):
    import torch

    from bertdist.model import BertForPreTraining, count_parameters

    cfg = BertConfig.from_preset(preset, kernels="reference")
    with torch.device("meta"):
        model = BertForPreTraining(cfg, device_type="cpu")
    assert bert_parameter_count(cfg) == count_parameters(model)


def _est(**kw):
    args = dict(micro_batch=64, seq=128, precision="bf16", zero_stage=0, world_size=8, max_predictions=20)
    args.update(kw)
    return estimate_memory(BertConfig.from_preset("large"), **args)


def test_states_by_precision_and_zero_stage():
    p = _est().parameters
    bf = _est()
    assert (bf.weights, bf.master_weights, bf.autocast_copies, bf.gradients, bf.optimizer_state) == \
        (4 * p, 0, 2 * p, 4 * p, 8 * p)
    bw = _est(weights_dtype="bf16")  # bf16 weights, fp32 masters, bf16 gradients and their fp32 sum
    assert (bw.weights, bw.master_weights, bw.autocast_copies, bw.gradients, bw.optimizer_state) == \
        (2 * p, 4 * p, 0, 6 * p, 8 * p)
    assert _est(precision="fp32", weights_dtype="bf16").weights == 4 * p  # only bf16 has bf16 weights
    fp16 = _est(precision="fp16")
    assert (fp16.weights, fp16.master_weights, fp16.autocast_copies, fp16.gradients) == (2 * p, 4 * p, 0, 2 * p)
    z1, z2, z3 = (_est(precision="fp32", zero_stage=z) for z in (1, 2, 3))
    assert z1.optimizer_state == 8 * p // 8 and z1.gradients == 4 * p and z1.weights == 4 * p
    assert z2.gradients == 4 * p // 8 and z2.weights == 4 * p
    assert z3.weights == 4 * p // 8


def test_activations_follow_the_formula():
    e = _est()
    b, s, h, a, L, v = 64, 128, 1024, 16, 24, 30522
    assert e.activations_per_layer == s * b * h * (16 * 2 + 2)  # 34sbh at 2 bytes (Korthikanti et al.)
    assert e.attention_probs_per_layer == 5 * a * s * s * b
    assert e.mlm_head_activations == 2 * b * 20 * v * 4 + b * 20 * h * 2 * 2
    assert e.activations == L * (e.activations_per_layer + e.attention_probs_per_layer) + e.mlm_head_activations
    assert e.activations_checkpointed == (L * s * b * h * 2 + e.activations_per_layer + e.attention_probs_per_layer
                                          + e.mlm_head_activations)
    assert _est(micro_batch=128).activations > 1.9 * e.activations
    assert _est(precision="fp32").activations_per_layer == s * b * h * (16 * 4 + 2)
    assert e.total - e.total_checkpointed == e.activations - e.activations_checkpointed
    assert 10 < e.to_dict()["total_gib"] < 20  # BERT-large, micro 64, seq 128, bf16: ~14 GiB
