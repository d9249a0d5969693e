"""A step's loss by family, checked against the loss computed by hand from the model's scores."""
from __future__ import annotations

import random

import pytest

from bertdist.embed.config import EmbedConfig
from bertdist.embed.step import StepLoss
from tests.embed import fixtures

FAST = dict(kernels="reference", progress=False, hidden_dropout_prob=0.0, max_seq_length=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return fixtures.tiny_checkpoint(d / "tiny", fixtures.word_vocab(d / "vocab.txt"))


@pytest.mark.parametrize("loss", ["listwise", "bce"])
def test_rerank_losses_on_groups_of_unequal_size(ckpt, loss):
    """A query with 1 negative next to one with 3: the missing candidates take no part."""
    import torch

    from bertdist.embed.train import build_model

    cfg = EmbedConfig(task="rerank", checkpoint=str(ckpt), num_negatives=3, loss=loss, **FAST)
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"), loss).eval()  # no attention dropout: score() agrees
    r = fixtures.book_pairs(n=5)
    units = [{"q": r[0]["query"], "p": r[0]["positive"], "negs": [r[1]["positive"]]},
             {"q": r[2]["query"], "p": r[2]["positive"], "negs": [r[3]["positive"], r[4]["positive"],
                                                                  r[1]["positive"]]}]
    got = StepLoss(cfg, model, loss, None).step_loss(model, units, random.Random(0)).item()
    terms = []
    for u in units:
        pairs = [(u["q"], c) for c in [u["p"], *u["negs"]]]
        s = torch.tensor(model.score(pairs, max_seq_length=64), dtype=torch.float64)
        if loss == "listwise":
            terms.append(-torch.log_softmax(s, 0)[0])
        else:
            labels = torch.zeros_like(s)
            labels[0] = 1.0
            terms.extend(torch.nn.functional.binary_cross_entropy_with_logits(s, labels, reduction="none"))
    assert got == pytest.approx(float(torch.stack(terms).mean()), abs=1e-5)
