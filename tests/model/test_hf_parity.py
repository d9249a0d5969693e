"""Our BertForPreTraining against transformers.BertForPreTraining: same names, same numbers."""
import pytest
import torch
import transformers

from bertdist.model import BertConfig, BertForPreTraining

TOL = 1e-5


def _tiny(**kw) -> BertConfig:
    return BertConfig.from_preset("tiny", vocab_size=997, kernels="reference", **kw)


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (4, 23), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # padded tail
    mask[2, 2:] = 0  # all but two tokens padded
    mask[3, 1:] = 0  # all but one token padded
    ids = ids * mask  # [PAD] = 0 under padding, as a tokenizer would produce
    types = torch.zeros_like(ids)
    types[:, 9:] = 1  # mixed segments A and B
    types = types * mask
    return ids, mask, types


def _hf(cfg: BertConfig) -> transformers.BertForPreTraining:
    hf_cfg = transformers.BertConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    return transformers.BertForPreTraining(hf_cfg).eval()


def _max_diffs(hf, ours, ids, mask, types):
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        b = ours(ids, mask, types)
    real = mask.bool()
    # Padded query positions carry no meaning in either model; compare the real ones.
    mlm = (a.prediction_logits - b.prediction_logits)[real].abs().max().item()
    nsp = (a.seq_relationship_logits - b.seq_relationship_logits).abs().max().item()
    return mlm, nsp


def test_state_dict_names_and_shapes_match_hf():
    cfg = _tiny()
    hf_sd, our_sd = _hf(cfg).state_dict(), BertForPreTraining(cfg).state_dict()
    assert sorted(hf_sd) == sorted(our_sd)
    assert {k: tuple(v.shape) for k, v in hf_sd.items()} == {k: tuple(v.shape) for k, v in our_sd.items()}


def test_hf_weights_into_ours_give_hf_logits():
    cfg = _tiny()
    torch.manual_seed(1)
    hf = _hf(cfg)
    ours = BertForPreTraining(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    mlm, nsp = _max_diffs(hf, ours, *_batch(cfg.vocab_size))
    assert mlm <= TOL and nsp <= TOL, (mlm, nsp)


def test_our_weights_into_hf_give_our_logits():
    cfg = _tiny()
    torch.manual_seed(2)
    ours = BertForPreTraining(cfg).eval()
    hf = _hf(cfg)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=True)
    assert not missing and not unexpected
    mlm, nsp = _max_diffs(hf, ours, *_batch(cfg.vocab_size, seed=3))
    assert mlm <= TOL and nsp <= TOL, (mlm, nsp)


def test_tied_decoder_survives_loading():
    cfg = _tiny()
    ours = BertForPreTraining(cfg)
    ours.load_state_dict(_hf(cfg).state_dict())
    assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight
    assert ours.cls.predictions.decoder.bias is ours.cls.predictions.bias


@pytest.mark.parametrize("sparse", [True, False])
def test_losses_match_hf(sparse):
    cfg = _tiny(sparse_mlm_head=sparse)
    torch.manual_seed(4)
    hf = _hf(cfg)
    ours = BertForPreTraining(cfg).eval()
    ours.load_state_dict(hf.state_dict())
    ids, mask, types = _batch(cfg.vocab_size, seed=5)
    labels = torch.full_like(ids, -100)
    labels[:, 1:4] = ids[:, 1:4]
    nsp = torch.tensor([0, 1, 0, 1])
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp)
        b = ours(ids, mask, types, labels=labels, next_sentence_label=nsp)
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    rows = int((labels != -100).sum()) if sparse else ids.numel()
    assert b.prediction_logits.reshape(-1, cfg.vocab_size).shape[0] == rows


def test_sparse_head_equals_dense_head_at_masked_positions():
    cfg = _tiny()
    torch.manual_seed(6)
    dense = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=997, kernels="reference", sparse_mlm_head=False)).eval()
    sparse = BertForPreTraining(cfg).eval()
    sparse.load_state_dict(dense.state_dict())
    ids, mask, types = _batch(cfg.vocab_size, seed=7)
    labels = torch.full_like(ids, -100)
    labels[0, [2, 5, 7]] = 11
    labels[1, 3] = 12
    with torch.no_grad():
        d = dense(ids, mask, types, labels=labels)
        s = sparse(ids, mask, types, labels=labels)
    picked = d.prediction_logits[labels != -100]
    assert torch.allclose(picked, s.prediction_logits, atol=1e-6)
    assert torch.allclose(d.mlm_loss, s.mlm_loss, atol=1e-6)
