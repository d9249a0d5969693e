"""Sharded Hugging Face checkpoints (a shard index + several weight files) import exactly as the
single-file ones: through read_hf_dir, load_pretrained and `bertdist import-hf`; a missing shard or
a key missing from its shard is a clear error."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from bertdist.export import ExportError, bert_tokenizer, read_hf_dir
from bertdist.export.sources import load_pretrained

pytestmark = pytest.mark.shared


def _with_tokenizer(d, vocab):
    bert_tokenizer(vocab, True).save_pretrained(str(d))
    shutil.copyfile(vocab, d / "vocab.txt")
    return d


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, shared_data):
    """The same tiny HF BertForPreTraining saved whole and in shards of at most 200 kB."""
    from transformers import BertConfig as HFConfig, BertForPreTraining as HF

    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    torch.manual_seed(4)
    hf = HF(HFConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=128))
    root = tmp_path_factory.mktemp("hf_sharded")
    whole, sharded = root / "whole", root / "sharded"
    hf.save_pretrained(str(whole))
    hf.save_pretrained(str(sharded), max_shard_size="200KB")
    return _with_tokenizer(whole, vocab), _with_tokenizer(sharded, vocab)


def _shards(d, pattern):
    return sorted(d.glob(pattern))


def _assert_bitwise_equal(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_sharded_safetensors_import_bitwise(hf_dirs):
    whole, sharded = hf_dirs
    assert not (sharded / "model.safetensors").exists()
    assert len(_shards(sharded, "model-*-of-*.safetensors")) > 1  # really sharded
    ref, got = read_hf_dir(whole, kernels="reference"), read_hf_dir(sharded, kernels="reference")
    assert not got.fresh_keys
    _assert_bitwise_equal(ref.raw_state_dict, got.raw_state_dict)
    _assert_bitwise_equal(ref.state_dict, got.state_dict)
    assert got.config == ref.config


def test_sharded_pytorch_bin_import_bitwise(hf_dirs, tmp_path):
    """The older layout: pytorch_model-0000k-of-0000n.bin + pytorch_model.bin.index.json."""
    from safetensors.torch import load_file

    whole, sharded = hf_dirs
    d = tmp_path / "bin"
    shutil.copytree(sharded, d, ignore=shutil.ignore_patterns("*.safetensors*"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    renamed = {}
    for shard in _shards(sharded, "model-*-of-*.safetensors"):
        renamed[shard.name] = shard.name.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
        torch.save(load_file(str(shard)), d / renamed[shard.name])
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert len(_shards(d, "pytorch_model-*.bin")) > 1
    _assert_bitwise_equal(read_hf_dir(whole).state_dict, load_pretrained(d).state_dict)


def test_missing_shard_file_is_named(hf_dirs, tmp_path):
    d = shutil.copytree(hf_dirs[1], tmp_path / "partial")
    gone = _shards(d, "model-*-of-*.safetensors")[-1]
    gone.unlink()
    with pytest.raises(ExportError, match=f"missing from .*{gone.name}"):
        read_hf_dir(d)


def test_key_absent_from_its_shard_is_an_error(hf_dirs, tmp_path):
    d = shutil.copytree(hf_dirs[1], tmp_path / "wrong_index")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = "bert.embeddings.word_embeddings.weight"
    index["weight_map"][key] = next(s for s in shards if s != index["weight_map"][key])
    index_path.write_text(json.dumps(index))
    with pytest.raises(ExportError, match=f"lacks 1 key.*{key}"):
        read_hf_dir(d)


@pytest.mark.parametrize("where", ["../elsewhere.safetensors", "/etc/hostname"])
def test_a_shard_index_cannot_point_outside_its_directory(hf_dirs, tmp_path, where):
    d = shutil.copytree(hf_dirs[1], tmp_path / "escaping_index")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    shutil.copy(d / index["weight_map"][first], tmp_path / "elsewhere.safetensors")  # a real file out there
    index["weight_map"][first] = where
    index_path.write_text(json.dumps(index))
    with pytest.raises(ExportError, match=r"outside .*relative paths inside its folder"):
        read_hf_dir(d)


def test_import_hf_cli_reads_sharded_dir(hf_dirs, tmp_path, capsys):
    """`bertdist import-hf` (with its logits check against transformers) in both output formats; the
    DeepSpeed format twice, as a second import in one process once tripped on DeepSpeed's cached groups."""
    from bertdist.cli.main import main

    whole, sharded = hf_dirs
    ref = read_hf_dir(whole).state_dict
    for i, fmt in enumerate(("deepspeed", "torch", "deepspeed")):
        out = tmp_path / f"{fmt}{i}"
        assert main(["import-hf", str(sharded), "--out", str(out), "--format", fmt]) == 0
        assert "verify: max |ours - transformers| logits" in capsys.readouterr().out
        w = load_pretrained(out)
        assert all(torch.equal(w.state_dict[k], ref[k]) for k in ref), fmt
