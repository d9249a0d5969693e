"""The unpadded encoder path (packed real tokens + varlen attention) against the padded path."""
import pytest
import torch

from bertdist.model import BertConfig, BertForPreTraining
from bertdist.model.bert import Unpadded


def _assert_same_grads(model_a, loss_a, model_b, loss_b):
    loss_a.backward()
    loss_b.backward()
    grads_b = dict(model_b.named_parameters())
    for name, p in model_a.named_parameters():
        assert torch.allclose(p.grad, grads_b[name].grad, atol=5e-5, rtol=1e-4), name


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([29, 1, 17, 30, 2])
    s = 30
    mask = (torch.arange(s)[None] < lengths[:, None]).long()
    ids = torch.randint(5, vocab, (5, s), generator=g) * mask
    types = ((torch.arange(s)[None] >= (lengths // 2)[:, None]).long()) * mask  # mixed A/B segments
    labels = torch.where((torch.rand(5, s, generator=g) < 0.3) & mask.bool(), ids, torch.full_like(ids, -100))
    labels[1, 0] = ids[1, 0]  # the length-1 row predicts something too
    nsp = torch.tensor([0, 1, 1, 0, 1])
    return ids, mask, types, labels, nsp


@pytest.mark.parametrize("sparse", [True, False])
def test_unpadded_matches_padded_outputs_losses_and_grads(sparse):
    cfg = BertConfig.from_preset("tiny", vocab_size=500, kernels="reference", sparse_mlm_head=sparse,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    padded = BertForPreTraining(cfg)
    unpadded = BertForPreTraining(BertConfig.from_mapping({**cfg.__dict__, "unpad": True}))
    unpadded.load_state_dict(padded.state_dict())
    ids, mask, types, labels, nsp = _batch(cfg.vocab_size)
    a = padded(ids, mask, types, labels=labels, next_sentence_label=nsp)
    b = unpadded(ids, mask, types, labels=labels, next_sentence_label=nsp)
    real = mask.bool()
    if not sparse:  # dense logits: compare the real positions (padding rows differ by design)
        assert torch.allclose(a.prediction_logits[real], b.prediction_logits[real], atol=2e-5)
    else:
        assert torch.allclose(a.prediction_logits, b.prediction_logits, atol=2e-5)
    # NSP reads the pooled [CLS]; token types went in before packing, so it is unchanged.
    assert torch.allclose(a.seq_relationship_logits, b.seq_relationship_logits, atol=2e-5)
    assert torch.allclose(a.loss, b.loss, atol=1e-5)
    _assert_same_grads(padded, a.loss, unpadded, b.loss)


def test_token_types_still_matter_when_unpadded():
    cfg = BertConfig.from_preset("tiny", vocab_size=500, kernels="reference", unpad=True)
    model = BertForPreTraining(cfg).eval()
    ids, mask, types, _, _ = _batch(cfg.vocab_size)
    with torch.no_grad():
        x = model(ids, mask, types).seq_relationship_logits
        y = model(ids, mask, torch.zeros_like(types)).seq_relationship_logits
    assert not torch.allclose(x, y)


def test_pack_unpack_round_trip_and_left_padding_rejected():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    u = Unpadded.from_mask(mask)
    assert u.cu_seqlens.tolist() == [0, 3, 4, 8] and u.max_seqlen == 4
    x = torch.arange(12.0).view(3, 4, 1)
    packed = u.pack(x)
    assert packed.squeeze(1).tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert torch.equal(u.unpack(packed), x * mask[..., None])
    with pytest.raises(ValueError, match="right-padded"):
        Unpadded.from_mask(torch.tensor([[0, 1, 1]]))


def test_unpadded_fused_kernels_match_reference():
    from bertdist.ops import kernel_status

    if not {s.op: s for s in kernel_status("cpu")}["varlen_attention"].usable:
        pytest.skip("fused CPU extension not built")
    base = dict(vocab_size=500, unpad=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ref = BertForPreTraining(BertConfig.from_preset("tiny", kernels="reference", **base))
    fused = BertForPreTraining(BertConfig.from_preset("tiny", kernels="fused", **base))
    fused.load_state_dict(ref.state_dict())
    assert fused.bert.kernels.sources["varlen_attention"] == "fused"
    ids, mask, types, labels, nsp = _batch(500)
    a = ref(ids, mask, types, labels=labels, next_sentence_label=nsp)
    b = fused(ids, mask, types, labels=labels, next_sentence_label=nsp)
    assert torch.allclose(a.loss, b.loss, atol=1e-5)
    _assert_same_grads(ref, a.loss, fused, b.loss)
