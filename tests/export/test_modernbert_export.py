"""ModernBERT hand-off: a transformers ``ModernBertForMaskedLM`` directory -> ``bertdist import-hf``
-> ``bertdist export`` gives back the same bytes, and what we write loads in transformers."""
from __future__ import annotations

import json

import pytest
import torch

from bertdist.cli.main import main
from bertdist.export.hf import ExportError
from bertdist.export.modernbert_hf import config_from_hf, hf_config_dict, write_modernbert_hf_dir
from bertdist.model.modernbert import ModernBertForMaskedLM
from bertdist.model.modernbert_config import ModernBertConfig

transformers = pytest.importorskip("transformers")

VOCAB = 128


def hf_dir(tmp_path):
    """A tiny ModernBertForMaskedLM saved by transformers, with a tokenizer.json beside it."""
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=512, local_attention=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, global_rope_theta=80_000.0)
    model = transformers.ModernBertForMaskedLM(config)
    out = tmp_path / "hf"
    model.save_pretrained(out)
    vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(out / "tokenizer.json"))
    return out


def test_import_then_export_is_bitwise_identical(tmp_path, capsys):
    src = hf_dir(tmp_path)
    assert main(["import-hf", str(src), "--out", str(tmp_path / "ours"), "--format", "torch"]) == 0
    assert main(["export", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("-> OK") == 2, printed  # both commands compared logits with transformers
    for name in ("model.safetensors", "tokenizer.json"):
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes(), name
    back = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "back")
    assert back.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert back.config.rope_parameters["full_attention"]["rope_theta"] == 80_000.0


def test_import_to_a_trainer_checkpoint_exports_the_same_weights(tmp_path, capsys):
    """The default import writes a DeepSpeed checkpoint in the trainer's layout (what checkpoint.init_from
    starts a run from); exporting that checkpoint gives back the HF weights bit for bit."""
    src = hf_dir(tmp_path)
    assert main(["import-hf", str(src), "--out", str(tmp_path / "init")]) == 0
    printed = capsys.readouterr().out
    assert "-> OK" in printed and "checkpoint.init_from=" in printed and "model.model_type=modernbert" in printed
    assert "model.global_rope_theta=80000.0" in printed and "model.local_attention=16" in printed
    assert (tmp_path / "init" / "latest").is_file()
    assert main(["export", str(tmp_path / "init"), "--out", str(tmp_path / "back")]) == 0
    for name in ("model.safetensors", "tokenizer.json"):  # the tokenizer travels through the checkpoint
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes(), name
    assert transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "back").config.local_attention == 16


def test_export_does_not_overwrite_what_is_there(tmp_path):
    cfg = ModernBertConfig.from_preset("tiny", vocab_size=VOCAB, pad_token_id=0)
    with torch.device("meta"):
        shapes = ModernBertForMaskedLM(cfg).state_dict()
    sd = {k: torch.zeros(v.shape) for k, v in shapes.items()}
    sd["decoder.weight"] = sd["model.embeddings.tok_embeddings.weight"]
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="already holds.*config.json"):
        write_modernbert_hf_dir(tmp_path, cfg, sd)
    assert (tmp_path / "config.json").read_text() == "{}"


def test_config_round_trips_and_reads_the_older_form(tmp_path):
    cfg = ModernBertConfig.from_preset("base", global_attn_every_n_layers=2, local_rope_theta=20_000.0)
    assert config_from_hf(hf_config_dict(cfg), tmp_path) == ModernBertConfig(**{**vars(cfg), "preset": "custom"})
    older = {"model_type": "modernbert", "num_hidden_layers": 6, "global_attn_every_n_layers": 3,
             "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "hidden_size": 64,
             "num_attention_heads": 2, "intermediate_size": 96}
    got = config_from_hf(older, tmp_path)
    assert (got.global_attn_every_n_layers, got.global_rope_theta, got.num_hidden_layers) == (3, 160000.0, 6)


def test_a_layer_pattern_we_do_not_have_is_refused(tmp_path):
    d = hf_config_dict(ModernBertConfig.from_preset("tiny"))
    d["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    with pytest.raises(ExportError, match=r"global layers \[1\] of 3"):
        config_from_hf(d, tmp_path / "config.json")
    d = json.loads(json.dumps(hf_config_dict(ModernBertConfig.from_preset("tiny"))))
    d["mlp_bias"] = True
    with pytest.raises(ExportError, match="mlp_bias"):
        config_from_hf(d, tmp_path / "config.json")
