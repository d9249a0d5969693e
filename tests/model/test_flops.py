"""FLOP accounting agrees with a count taken from the model's own GEMM shapes."""
import pytest
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


def test_window_pairs_count_what_a_sliding_window_sees():
    from bertdist.model.flops import window_pairs

    for seq in (1, 2, 5, 9, 40):
        for hw in (0, 1, 3, 16, 64):
            brute = sum(1 for i in range(seq) for j in range(seq) if abs(i - j) <= hw)
            assert window_pairs(seq, hw) == brute, (seq, hw)


def test_modernbert_flops_parts_and_parameters():
    import torch

    from bertdist.model.flops import modernbert_forward_flops, modernbert_parameter_count, window_pairs
    from bertdist.model.modernbert import ModernBertForMaskedLM
    from bertdist.model.modernbert_config import ModernBertConfig

    cfg = ModernBertConfig.from_preset("tiny", vocab_size=100, pad_token_id=0, local_attention=8)  # 3 layers, 1 global
    d, f, s, p = 64, 96, 20, 6
    parts = modernbert_forward_flops(cfg, s, p)
    assert parts["encoder_gemm"] == 3 * 2 * s * (3 * d * d + d * d + 2 * d * f + f * d)  # Wqkv, Wo, Wi (2f), Wo
    assert parts["rope"] == 3 * 2 * 3 * s * d and parts["geglu_gate"] == 3 * s * f
    assert parts["global_attention"] == 1 * 4 * s * s * d
    assert parts["local_attention"] == 2 * 4 * window_pairs(s, 4) * d < 2 * 4 * s * s * d
    assert parts["mlm_head"] == 2 * p * (d * d + d * 100)
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert train_flops_per_sequence(cfg, s, p) == 3 * parts["total"]
    with torch.device("meta"):
        model = ModernBertForMaskedLM(cfg)
    assert modernbert_parameter_count(cfg) == sum(t.numel() for t in {id(t): t for t in model.parameters()}.values())


def test_modernbert_batch_flops_count_each_packed_segment():
    """A row holding two documents costs what the two documents cost apart, less than the row as one
    sequence (attention is per document); rows at the padded width cost what the per-sequence count says."""
    import torch

    from bertdist.model.flops import modernbert_batch_train_flops
    from bertdist.model.modernbert_config import ModernBertConfig

    cfg = ModernBertConfig.from_preset("tiny", vocab_size=100, pad_token_id=0, local_attention=8)
    head = 3 * 2 * (64 * 64 + 64 * 100)
    full = modernbert_batch_train_flops(cfg, torch.tensor([0, 24, 48], dtype=torch.int32), torch.tensor(7))
    assert full.item() == pytest.approx(2 * train_flops_per_sequence(cfg, 24, 0) + 7 * head)
    docs = modernbert_batch_train_flops(cfg, torch.tensor([0, 10, 24], dtype=torch.int32), torch.tensor(0))
    assert docs.item() == pytest.approx(train_flops_per_sequence(cfg, 10, 0) + train_flops_per_sequence(cfg, 14, 0))
    assert docs.item() < train_flops_per_sequence(cfg, 24, 0)
