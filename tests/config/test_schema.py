"""Config machinery: dataclass schema, YAML instances, dotted overrides, saving."""
import dataclasses
from pathlib import Path
from typing import Literal, Optional

import pytest
import yaml

from bertdist.config import ConfigError, from_dict, load_config, save_config, to_dict
from bertdist.config.schema import load_yaml
from bertdist.model import BertConfig

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclasses.dataclass
class Optim:
    lr: float = 1e-4
    betas: tuple[float, ...] = (0.9, 0.999)
    name: Literal["adamw", "lamb"] = "adamw"


@dataclasses.dataclass
class Run:
    steps: int = 10
    out: Optional[str] = None
    fp16: bool = False
    optim: Optim = dataclasses.field(default_factory=Optim)


def test_yaml_instance_and_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("steps: 5\noptim:\n  lr: 3.0e-4\n")
    cfg = load_config(Run, p, ["optim.name=lamb", "fp16=true", "optim.betas=[0.9,0.98]", "steps=1_000"])
    assert cfg.steps == 1000 and cfg.fp16 is True
    assert cfg.optim == Optim(lr=3e-4, betas=(0.9, 0.98), name="lamb")


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("optim.lrr=1", "unknown key 'lrr' under optim; valid keys: ['betas', 'lr', 'name']"),
        ("stepz=1", "unknown key 'stepz' under <root>"),
        ("steps.x=1", "'steps' is a leaf value"),
        ("optim.name=sgd", "'sgd' is not one of ['adamw', 'lamb']"),
        ("steps=ten", "steps: expected an integer, got 'ten'"),
        ("steps", "not of the form key.path=value"),
    ],
)
def test_bad_overrides_are_rejected_with_the_reason(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(Run, None, [override])
    assert fragment in str(e.value)


def test_unknown_yaml_key_lists_valid_keys(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("optim:\n  momentum: 0.9\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['optim.momentum'\].*valid keys: \['betas', 'lr', 'name'\]"):
        load_config(Run, p)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Run, tmp_path / "nope.yaml")


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(Run, None, ["optim.lr=0.006", "out=/x"])
    path = save_config(cfg, tmp_path / "sub" / "resolved.yaml")
    assert yaml.safe_load(path.read_text())["optim"]["lr"] == 0.006
    assert from_dict(Run, yaml.safe_load(path.read_text())) == cfg
    assert not list(tmp_path.rglob("*.tmp"))


def test_model_config_from_preset_mapping_and_validation():
    cfg = BertConfig.from_mapping({"preset": "mini", "hidden_dropout_prob": 0.0})
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.hidden_dropout_prob) == (4, 256, 0.0)
    assert to_dict(cfg)["preset"] == "mini"
    with pytest.raises(ConfigError, match=r"hidden_size \(100\) must be divisible by num_attention_heads \(3\); 100 / 3 = 33.333"):
        BertConfig(hidden_size=100, num_attention_heads=3)
    with pytest.raises(ConfigError, match="preset"):
        BertConfig.from_mapping({"preset": "huge"})


@pytest.mark.parametrize("override", ["optimizer.lr=nan", "optimizer.lr=.nan", "optimizer.lr=.inf", "optimizer.lr=-inf"])
def test_nan_and_infinity_are_refused(override):
    from bertdist.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"optimizer.lr: .* is not a finite number"):
        load_config(TrainConfig, REPO_CONFIGS / "pretrain" / "tiny.yaml", [override])


def test_malformed_or_binary_yaml_is_a_config_error_naming_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: [tiny\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML"):
        load_yaml(bad)
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\x80\x04\x95 pickle")
    with pytest.raises(ConfigError, match=r"weights.yaml: not UTF-8 text"):
        load_yaml(binary)


def test_zero_heads_is_a_config_error_not_a_division_by_zero():
    with pytest.raises(ConfigError, match=r"model.num_attention_heads must be positive, got 0"):
        BertConfig.from_preset("tiny", num_attention_heads=0)
