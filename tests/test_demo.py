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


def test_the_demo_replaces_only_its_own_run_directory(tmp_path):
    from bertdist.demo import DEMO_MARK, fresh_run_dir

    mine = tmp_path / "pretrain"
    mine.mkdir()
    (mine / "notes.txt").write_text("a run of my own")
    with pytest.raises(SystemExit, match="was not made by the demo: not deleting it"):
        fresh_run_dir(mine)
    assert (mine / "notes.txt").read_text() == "a run of my own"
    run = fresh_run_dir(tmp_path / "demo" / "pretrain")
    (run / "metrics.jsonl").write_text("{}")
    again = fresh_run_dir(run)  # the demo's own earlier run is replaced
    assert again == run and sorted(p.name for p in run.iterdir()) == [DEMO_MARK]
