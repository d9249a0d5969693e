"""The fine-tuning YAMLs are valid instances of the schema; overrides are checked."""
from __future__ import annotations

from pathlib import Path

import pytest

from bertdist.config import ConfigError, load_config
from bertdist.finetune import FinetuneConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "finetune").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_finetune_configs_load(path):
    cfg = load_config(FinetuneConfig, path, ["task=rte", "learning_rate=2e-5"])
    assert cfg.learning_rate == 2e-5 and cfg.batch_size in (16, 32)
    assert all(lr in (5e-5, 3e-5, 2e-5) for lr in cfg.sweep_learning_rates)


def test_paper_recipe_defaults_and_bad_override():
    cfg = FinetuneConfig()
    assert (cfg.batch_size, cfg.epochs, cfg.warmup_ratio, cfg.learning_rate) == (32, 3.0, 0.1, 3e-5)
    with pytest.raises(ConfigError, match="unknown key 'lr'"):
        load_config(FinetuneConfig, None, ["lr=1e-4"])
    assert len(CONFIGS) >= 4
