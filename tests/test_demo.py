"""make demo's launch decisions, on CPU: one rank per visible GPU, 2 CPU ranks without CUDA."""
from __future__ import annotations

import pytest
import torch

from bertdist.demo import DEMO_MICRO_BATCH, demo_global_batch, local_ranks
from bertdist.train.config import LoaderConfig, check_batch_sizes


@pytest.mark.parametrize("gpus", [1, 2, 3, 8])
def test_one_rank_per_visible_gpu(monkeypatch, gpus):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    ranks, why = local_ranks()
    assert ranks == gpus and f"{gpus} visible CUDA device" in why
    # the demo's batch sizes must be valid for that many ranks
    data = LoaderConfig(micro_batch_size=DEMO_MICRO_BATCH, global_batch_size=demo_global_batch(ranks))
    assert check_batch_sizes(data, ranks) >= 1


def test_two_cpu_ranks_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_ranks() == (2, "no CUDA device: 2 CPU ranks (gloo)")
    assert demo_global_batch(2) == 32  # the recipe's own global batch on the CPU demo, as before
