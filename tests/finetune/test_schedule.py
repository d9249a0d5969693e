"""The fine-tuning learning-rate schedule takes the same values as transformers' linear schedule
with warmup, with the warmup's length counted as its Trainer counts a ratio."""
from __future__ import annotations

import pytest
import torch

from bertdist.finetune.config import FinetuneConfig
from bertdist.finetune.train import build_optimization, linear_warmup_decay, warmup_steps


@pytest.mark.parametrize("ratio,total,expected", [(0.1, 125, 13), (0.1, 100, 10), (0.2, 10, 2), (0.06, 7, 1),
                                                  (0.0, 50, 0)])
def test_warmup_steps_round_up(ratio, total, expected):
    assert warmup_steps(ratio, total) == expected


@pytest.mark.parametrize("ratio,total", [(0.1, 125), (0.2, 10), (0.0, 6), (0.5, 3)])
def test_schedule_equals_transformers(ratio, total):
    from transformers import get_linear_schedule_with_warmup

    w = warmup_steps(ratio, total)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = get_linear_schedule_with_warmup(opt, w, total)
    theirs = [hf.lr_lambdas[0](s) for s in range(total + 2)]
    ours = [linear_warmup_decay(s, w, total) for s in range(total + 2)]
    assert ours == pytest.approx(theirs, abs=0, rel=1e-12), (w, ours, theirs)


def test_optimizer_steps_follow_the_schedule():
    """The first step runs at 0 (as in the references), the peak comes after the warmup, the last
    step is the smallest positive rate."""
    cfg = FinetuneConfig(learning_rate=2e-5, warmup_ratio=0.2)
    model = torch.nn.Linear(2, 2)
    _, opt, sched = build_optimization(model, cfg, [{"params": list(model.parameters())}], cfg.learning_rate, 4, 10)
    rates = []
    for _ in range(10):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates == pytest.approx([0.0, 1e-5, 2e-5, 1.75e-5, 1.5e-5, 1.25e-5, 1e-5, 7.5e-6, 5e-6, 2.5e-6])
