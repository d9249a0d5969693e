"""FLOP accounting agrees with a count taken from the model's own GEMM shapes."""
import torch

from bertdist.model import BertConfig, BertModel, forward_flops_per_sequence, mfu, train_flops_per_sequence


def test_encoder_gemm_flops_are_two_per_weight_per_token():
    cfg = BertConfig.from_preset("base", kernels="reference")
    with torch.device("meta"):
        model = BertModel(cfg)
    gemm_weights = sum(
        m.weight.numel() for layer in model.encoder.layer for m in layer.modules() if isinstance(m, torch.nn.Linear)
    )
    seq = 128
    assert forward_flops_per_sequence(cfg, seq)["encoder_gemm"] == 2 * seq * gemm_weights


def test_attention_term_grows_quadratically_and_sparse_head_is_cheaper():
    cfg = BertConfig.from_preset("large")
    a128 = forward_flops_per_sequence(cfg, 128)["attention"]
    a512 = forward_flops_per_sequence(cfg, 512)["attention"]
    assert a512 == 16 * a128
    assert forward_flops_per_sequence(cfg, 128, predicted=20)["mlm_head"] < forward_flops_per_sequence(cfg, 128)["mlm_head"]


def test_mfu_of_peak_rate_is_one():
    cfg = BertConfig.from_preset("tiny")
    per_seq = train_flops_per_sequence(cfg, 64)
    assert abs(mfu(cfg, sequences_per_s=1000.0, seq=64, peak_flops=per_seq * 1000.0) - 1.0) < 1e-12
