"""`bertdist finetune embed|sts|rerank`: the command line, its config errors and its outputs."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bertdist.cli.main import main
from bertdist.config import ConfigError
from bertdist.embed.config import EmbedConfig, check_config, load_embed_config
from tests.embed import fixtures

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs" / "embed").glob("*.yaml"))
QUICK = ["--set", "kernels=reference", "--set", "progress=false", "--set", "max_seq_length=48",
         "--set", "batch_size=8", "--set", "max_steps=2", "--set", "learning_rate=1e-4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return fixtures.tiny_checkpoint(d / "tiny", fixtures.word_vocab(d / "vocab.txt"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return fixtures.retrieval_dir(tmp_path_factory.mktemp("data"), n_train=24, n_dev=8)


def test_embed_command_trains_saves_and_reports(ckpt, data, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["finetune", "embed", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(out), *QUICK,
               "--set", "save_model=true", "--set", "pooling=cls"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "dev ndcg@10:" in printed and "before training" in printed and "best: step 2" in printed
    assert f"wrote {out}/model" in printed and f"wrote {out}/metrics.json" in printed
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["task"] == "embed" and resolved["pooling"] == "cls" and resolved["max_steps"] == 2
    assert resolved["checkpoint"] == str(ckpt) and resolved["output_dir"] == str(out)
    assert (out / "model" / "modules.json").is_file() and (out / "model" / "1_Pooling" / "config.json").is_file()


def test_rerank_from_a_saved_bi_encoder_and_sts_layout(ckpt, data, tmp_path, capsys):
    """A bi-encoder directory this command wrote is a checkpoint for the next run (its encoder);
    sts reads GLUE STS-B's layout."""
    main(["finetune", "embed", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(tmp_path / "bi"), *QUICK,
          "--set", "save_model=true"])
    rc = main(["finetune", "rerank", "--checkpoint", str(tmp_path / "bi" / "model"), "--data", str(data),
               "--out", str(tmp_path / "ce"), *QUICK, "--set", "num_negatives=2", "--set", "rerank_candidates=5"])
    assert rc == 0, capsys.readouterr().out
    from tests.distill.fixtures import write_stsb

    sts = write_stsb(tmp_path / "stsb", n_train=16, n_dev=8)
    rc = main(["finetune", "sts", "--checkpoint", str(ckpt), "--data", str(sts), "--out", str(tmp_path / "sts"),
               *QUICK, "--set", "loss=cosine_mse"])
    printed = capsys.readouterr().out
    assert rc == 0 and "dev spearman:" in printed, printed


def test_unknown_set_key_is_a_config_error_listing_the_keys(ckpt, data, tmp_path, capsys):
    rc = main(["finetune", "embed", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(tmp_path / "o"),
               "--set", "temperature=0.05"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown key 'temperature'" in err and "'scale'" in err and "'mine'" in err


def test_bad_family_and_cross_family_keys_are_clear(ckpt, data, tmp_path, capsys):
    rc = main(["finetune", "embeddings", "--checkpoint", str(ckpt), "--data", str(data)])
    assert rc == 2
    printed = capsys.readouterr().out
    assert "unknown task 'embeddings'" in printed and "['embed', 'sts', 'rerank']" in printed
    rc = main(["finetune", "embed", "--checkpoint", str(ckpt), "--data", str(data), "--set", "task=retrieval"])
    assert rc == 2 and "task: 'retrieval' is not one of ['embed', 'sts', 'rerank']" in capsys.readouterr().err
    rc = main(["finetune", "sts", "--checkpoint", str(ckpt), "--data", str(data), "--set", "loss=mnrl"])
    err = capsys.readouterr().err
    assert rc == 2 and "loss='mnrl' is not a sts loss; sts takes ['cosent', 'cosine_mse']" in err
    rc = main(["finetune", "rerank", "--checkpoint", str(ckpt), "--data", str(data), "--set", "matryoshka_dims=[64]"])
    assert rc == 2 and "task=rerank trains a cross-encoder" in capsys.readouterr().err
    rc = main(["finetune", "sts", "--checkpoint", str(ckpt), "--data", str(data), "--set", "mine=bm25"])
    assert rc == 2 and "sts trains on scored pairs and takes no negatives" in capsys.readouterr().err


def test_data_error_names_the_line_and_exits_2(ckpt, tmp_path, capsys):
    d = tmp_path / "bad"
    fixtures.write_jsonl(d / "train.jsonl", fixtures.book_pairs(n=3))
    with (d / "train.jsonl").open("a") as f:
        f.write('{"query": "Anne?", "positive": 3}\n')
    rc = main(["finetune", "embed", "--checkpoint", str(ckpt), "--data", str(d), "--out", str(tmp_path / "o"), *QUICK])
    printed = capsys.readouterr().out
    assert rc == 2 and f"{d / 'train.jsonl'}:4: positive must be a string, got int 3" in printed


def test_help_lists_the_new_families(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "embed (bi-encoder for retrieval)" in text and "sts" in text and "rerank (cross-encoder)" in text
    assert "sst2" in text and "squad" in text  # the other tasks are still listed


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_embed_config(str(path), ["checkpoint=x", "data=y"])
    assert cfg.task in ("embed", "sts", "rerank") and cfg.learning_rate == 2e-5
    assert len(CONFIGS) == 3


def test_checks_on_bounds_name_key_and_value():
    with pytest.raises(ConfigError, match="mine_depth=2 is less than num_negatives=3"):
        check_config(EmbedConfig(task="rerank", num_negatives=3, mine_depth=2))
    with pytest.raises(ConfigError, match=r"2 matryoshka_weights \[1.0, 0.5\] for 1 matryoshka_dims \[64\]"):
        check_config(EmbedConfig(matryoshka_dims=[64], matryoshka_weights=[1.0, 0.5]))
    with pytest.raises(ConfigError, match="zero_stage=3"):
        check_config(EmbedConfig(deepspeed=True, zero_stage=3))
    with pytest.raises(ConfigError, match="distill_from='t': distillation trains a retrieval bi-encoder"):
        check_config(EmbedConfig(task="sts", distill_from="t"))
    with pytest.raises(ConfigError, match="head_learning_rate=0.001: only a cross-encoder"):
        check_config(EmbedConfig(task="embed", head_learning_rate=1e-3))
    with pytest.raises(ConfigError, match="head_learning_rate must be positive, got 0.0"):
        check_config(EmbedConfig(task="rerank", head_learning_rate=0.0))
