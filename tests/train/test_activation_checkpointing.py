"""Activation checkpointing applied from outside the model: names unchanged, same gradients."""
from __future__ import annotations

import pytest
import torch

from bertdist.model import BertConfig, BertForPreTraining
from bertdist.train.activation_checkpointing import apply_activation_checkpointing, checkpoint_modules


def _model(seed: int = 0) -> BertForPreTraining:
    torch.manual_seed(seed)
    return BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=300, kernels="reference"), device_type="cpu")


def _loss(model, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.2, ids, torch.full_like(ids, -100))
    torch.manual_seed(7)  # the same dropout masks in both models
    return model(ids, mask, labels=labels, next_sentence_label=torch.tensor([0, 1, 0])).loss


def test_names_state_and_gradients_are_unchanged():
    plain, ckpt = _model(), _model()
    names = [n for n, _ in plain.named_parameters()]
    assert apply_activation_checkpointing(ckpt, "torch") == 2
    assert [n for n, _ in ckpt.named_parameters()] == names
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    _loss(plain).backward()
    _loss(ckpt).backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=n)


def test_checkpoint_runs_only_when_training_with_gradients():
    model = _model()
    calls = []

    def fn(forward, *args):
        calls.append(len(args))
        return forward(*args)

    assert checkpoint_modules(model.bert.encoder.layer, fn) == 2
    _loss(model)
    assert calls == [2, 2]  # both layers, (hidden states, mask)
    model.eval()
    _loss(model)
    model.train()
    with torch.no_grad():
        _loss(model)
    assert calls == [2, 2]


def test_unknown_mode_is_an_error():
    assert apply_activation_checkpointing(_model(), "none") == 0
    with pytest.raises(ValueError, match="'selective' is not one of"):
        apply_activation_checkpointing(_model(), "selective")
