"""model.kernels_budget_s: the seconds kernels: auto may spend measuring before the first step."""
from pathlib import Path

import pytest

from bertdist.config import ConfigError
from bertdist.model import BertConfig
from bertdist.train.config import load_train_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "tiny.yaml"


def test_the_default_is_five_minutes():
    assert BertConfig().kernels_budget_s == 300.0
    assert load_train_config(TINY).model.kernels_budget_s == 300.0


def test_an_override_sets_it_and_null_means_no_limit():
    assert load_train_config(TINY, ["model.kernels_budget_s=60"]).model.kernels_budget_s == 60.0
    assert load_train_config(TINY, ["model.kernels_budget_s=null"]).model.kernels_budget_s is None


def test_a_negative_budget_is_refused_naming_the_key_and_the_value():
    with pytest.raises(ConfigError, match=r"model\.kernels_budget_s must be >= 0 .*got -1"):
        load_train_config(TINY, ["model.kernels_budget_s=-1"])
    with pytest.raises(ConfigError, match=r"model\.kernels_budget_s.*got -0\.5"):
        BertConfig(kernels_budget_s=-0.5)
