"""The distillation schema: YAML instances load, a partial train: section keeps the student
defaults, unknown keys are refused."""
from pathlib import Path

import pytest

from bertdist.config import ConfigError
from bertdist.distill.config import DistillConfig, load_distill_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "distill").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_configs_load(path):
    cfg = load_distill_config(str(path), ["task=sst2"])
    assert isinstance(cfg, DistillConfig) and cfg.train.learning_rate > 0


def test_partial_train_section_keeps_student_defaults_and_overrides_apply():
    cfg = load_distill_config(None, ["train.batch_size=16", "temperature=4", 'unlabeled=["a.txt","b.txt"]'])
    assert cfg.train.batch_size == 16 and cfg.temperature == 4.0 and cfg.unlabeled == ["a.txt", "b.txt"]
    assert cfg.train.learning_rate == DistillConfig().train.learning_rate == 1e-4
    assert cfg.train.predict_test is False  # the student default, not fine-tuning's
    ft = cfg.finetune_config("out")
    assert (ft.task, ft.output_dir, ft.batch_size) == (cfg.task, "out", 16)
    with pytest.raises(ConfigError, match="unknown key 'temprature'"):
        load_distill_config(None, ["temprature=3"])


def test_the_schema_and_the_cli_module_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, bertdist.distill.config, bertdist.cli.distill, bertdist.distill; "
            "print(sorted(m for m in ('torch', 'pyarrow', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
