"""Recipes load, batch-size arithmetic, DeepSpeed config generation and the user-JSON merge."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bertdist.config import ConfigError
from bertdist.train.config import check_batch_sizes, load_train_config
from bertdist.train.ds_config import build_ds_config, generate_ds_config, merge_user_ds_config

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs" / "pretrain").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipes_load_and_generate(path):
    cfg = load_train_config(path)
    accum = check_batch_sizes(cfg.data, 1)
    ds = generate_ds_config(cfg, 1, accum)
    assert ds["train_batch_size"] == cfg.data.global_batch_size
    assert cfg.schedule.resolved_warmup_steps < cfg.schedule.total_steps


def test_recipes_cover_the_two_phases():
    names = {p.stem for p in RECIPES}
    assert {"tiny", "bert-base-phase1", "bert-base-phase2", "bert-large-phase1", "bert-large-phase2"} <= names
    p1 = load_train_config(REPO / "configs/pretrain/bert-large-phase1.yaml")
    p2 = load_train_config(REPO / "configs/pretrain/bert-large-phase2.yaml")
    assert (p1.phase, p1.data.max_seq_length, p1.optimizer.lr) == (1, 128, 6e-3)
    assert (p2.phase, p2.data.max_seq_length, p2.optimizer.lr) == (2, 512, 4e-3)
    assert p2.checkpoint.init_from and p2.schedule.decay == "poly"
    assert (p1.model.num_hidden_layers, p1.model.hidden_size) == (24, 1024)
    base = load_train_config(REPO / "configs/pretrain/bert-base-phase1.yaml", ["model.preset=tiny"])
    assert base.model.hidden_size == 128  # a preset override replaces the preset's sizes


def test_indivisible_batch_sizes_name_the_numbers():
    cfg = load_train_config(REPO / "configs/pretrain/tiny.yaml", ["data.global_batch_size=50"])
    with pytest.raises(ConfigError) as e:
        check_batch_sizes(cfg.data, 3)
    msg = str(e.value)
    assert "50" in msg and "16" in msg and "3" in msg and "48" in msg and "1.042" in msg
    assert check_batch_sizes(load_train_config(REPO / "configs/pretrain/tiny.yaml").data, 2) == 1
    # more ranks than the global batch has micro-batches: the smallest valid size, and a micro batch that fits
    paper = load_train_config(REPO / "configs/pretrain/bert-base-paper.yaml").data  # global 256, micro 32
    with pytest.raises(ConfigError) as e:
        check_batch_sizes(paper, 64)
    assert "smallest valid global batch size is 2048" in str(e.value) and "micro_batch_size 4 (accumulation 1)" \
        in str(e.value)


def test_lamb_with_zero_is_refused():
    with pytest.raises(ConfigError, match="zero_stage=0"):
        load_train_config(REPO / "configs/pretrain/tiny.yaml", ["deepspeed.zero_stage=1"])
    load_train_config(REPO / "configs/pretrain/tiny.yaml", ["deepspeed.zero_stage=3", "optimizer.name=adamw"])


def test_generated_deepspeed_config_covers_precision_zero_and_checkpointing():
    cfg = load_train_config(REPO / "configs/pretrain/tiny.yaml", [
        "optimizer.name=adamw", "deepspeed.zero_stage=3", "deepspeed.precision=fp16",
        "deepspeed.activation_checkpointing=deepspeed", "deepspeed.gradient_clipping=0.5",
        "data.global_batch_size=128"])
    ds = generate_ds_config(cfg, world_size=2, grad_accum=4)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (128, 16, 4)
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_clipping"] == 0.5
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0 and not ds["bf16"]["enabled"]
    assert "activation_checkpointing" in ds
    base = load_train_config(REPO / "configs/pretrain/bert-base-phase1.yaml")
    bf = generate_ds_config(base, 8, check_batch_sizes(base.data, 8))
    assert bf["gradient_accumulation_steps"] == 65536 // (256 * 8)
    # bf16: autocast over fp32 weights, fp32 gradients and all-reduce (precision.py)
    assert bf["torch_autocast"]["enabled"] and not bf["bf16"]["enabled"] and not bf["fp16"]["enabled"]
    assert bf["communication_data_type"] == "fp32"


def test_user_ds_config_merge_and_conflicts(tmp_path):
    cfg = load_train_config(REPO / "configs/pretrain/tiny.yaml", ["optimizer.name=adamw", "deepspeed.zero_stage=2"])
    gen = generate_ds_config(cfg, 2, 1)
    merged = merge_user_ds_config(gen, {"zero_optimization": {"stage": 2, "overlap_comm": True,
                                                              "reduce_bucket_size": 5e7},
                                        "train_batch_size": "auto", "comms_logger": {"enabled": True}})
    assert merged["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7}
    assert merged["train_batch_size"] == 32 and merged["comms_logger"] == {"enabled": True}
    with pytest.raises(ConfigError) as e:
        merge_user_ds_config(gen, {"zero_optimization": {"stage": 3}, "gradient_clipping": 5.0})
    assert "zero_optimization.stage" in str(e.value) and "deepspeed.zero_stage" in str(e.value)
    assert "gradient_clipping" in str(e.value) and "5.0" in str(e.value)
    with pytest.raises(ConfigError, match="optimizer"):
        merge_user_ds_config(gen, {"optimizer": {"type": "Adam"}})
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"bf16": {"enabled": True}}))
    cfg.deepspeed.ds_config = str(user)
    with pytest.raises(ConfigError, match="bf16.enabled"):
        build_ds_config(cfg, 2, 1)
    user.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        build_ds_config(cfg, 2, 1)


def test_who_clips_and_that_deepspeed_never_synchronizes_to_time_the_step():
    """At ZeRO 0 (fp32, bf16) the trainer clips with its own norm, a flat optimizer inside its step;
    either way DeepSpeed's clipping is 0. Its fp16 wrapper and ZeRO keep clipping themselves. Its
    throughput timer (a device sync around every micro-batch) is off everywhere."""
    from bertdist.train.precision import trainer_clips

    tiny = REPO / "configs/pretrain/tiny.yaml"
    cases = {  # overrides -> (DeepSpeed's gradient_clipping, trainer clips)
        ("deepspeed.gradient_clipping=0.5",): (0.0, True),
        ("deepspeed.gradient_clipping=0.5", "deepspeed.precision=bf16"): (0.0, True),
        ("deepspeed.gradient_clipping=0.5", "optimizer.implementation=flat"): (0.0, True),
        ("deepspeed.gradient_clipping=0.5", "optimizer.name=adamw", "deepspeed.zero_stage=2"): (0.5, False),
        ("deepspeed.gradient_clipping=0.5", "deepspeed.precision=fp16"): (0.5, False),
    }
    for overrides, (ds_clip, trainer) in cases.items():
        cfg = load_train_config(tiny, list(overrides))
        ds = generate_ds_config(cfg, world_size=1, grad_accum=2)
        assert ds["gradient_clipping"] == ds_clip, overrides
        assert trainer_clips(cfg.deepspeed.precision, cfg.deepspeed.zero_stage) is trainer, overrides
        assert ds["timers"] == {"throughput": {"enabled": False, "synchronized": False}}
        assert ds["wall_clock_breakdown"] is False
    assert load_train_config(tiny, ["optimizer.implementation=flat"]).optimizer.clips_itself
    for bad in (["deepspeed.zero_stage=1", "optimizer.name=adamw"], ["deepspeed.precision=fp16"]):
        with pytest.raises(ConfigError, match="optimizer.implementation=flat needs deepspeed.zero_stage=0"):
            load_train_config(tiny, ["optimizer.implementation=flat", *bad])


def test_a_modernbert_model_section_and_its_overrides():
    """``model_type: modernbert`` makes the model section ModernBERT's (its presets; explicit keys win);
    dotted overrides are checked against the family the section names, whichever order they come in."""
    from bertdist.model.modernbert_config import ModernBertConfig

    recipe = REPO / "configs/pretrain/modernbert-tiny.yaml"
    cfg = load_train_config(recipe, ["model.preset=base", "model.local_attention=64"])
    assert isinstance(cfg.model, ModernBertConfig) and cfg.model.num_hidden_layers == 22  # base's sizes
    assert cfg.model.local_attention == 64 and cfg.model.max_position_embeddings == 128  # the recipe's key kept
    # a model_type override picks the schema the other model keys are checked against, even after them
    later = load_train_config(None, ["model.global_rope_theta=160000", "model.model_type=modernbert",
                                     "optimizer.name=adamw"])
    assert isinstance(later.model, ModernBertConfig) and later.model.global_rope_theta == 160000.0
    with pytest.raises(ConfigError, match=r"unknown key 'type_vocab_size' under model; valid keys: .*'local_attention'"):
        load_train_config(recipe, ["model.type_vocab_size=2"])
    with pytest.raises(ConfigError, match=r"unknown key 'local_attention' under model; valid keys: .*'type_vocab_size'"):
        load_train_config(REPO / "configs/pretrain/tiny.yaml", ["model.local_attention=64"])
    with pytest.raises(ConfigError, match=r"model.model_type: 'gpt' is not one of \['modernbert'\], or leave it out for a BertConfig"):
        load_train_config(REPO / "configs/pretrain/tiny.yaml", ["model.model_type=gpt"])
    with pytest.raises(ConfigError, match=r"electra: a modernbert model .* trains with masked-LM only"):
        load_train_config(recipe, ["electra.disc_weight=50"])
