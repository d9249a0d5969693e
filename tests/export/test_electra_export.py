"""ELECTRA <-> Hugging Face (bertdist/export/electra_hf.py): the discriminator as an
ElectraForPreTraining directory, the generator as an ElectraForMaskedLM in its generator/ subdirectory.

- HF -> ours -> HF is byte-identical for both files (directly, and through our torch format);
- ours -> HF loads in transformers with no missing or unexpected key, the generator's head tied;
  logits within 1e-4 on a padded fp32 batch, and a changed weight is caught;
- a bare ElectraModel or a task model reads as a discriminator (a fresh replaced-token head);
  a generator alone, or a generator whose embeddings differ, is refused with the reason;
- `bertdist import-hf` reads an ELECTRA directory (torch and DeepSpeed formats), and refuses a
  DeepSpeed init checkpoint without a generator.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import shutil
from pathlib import Path

import pytest
import torch

from bertdist.export import ExportError, bert_tokenizer, read_hf_dir, write_hf_dir
from bertdist.export.sources import load_pretrained, write_torch_dir
from bertdist.export.verify import electra_max_logit_diff, max_logit_diff
from bertdist.model import ElectraConfig
from bertdist.model.electra import ElectraForPreTraining

VOCAB = 300


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    p.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]) + "\n")
    return p


def _with_tokenizer(d: Path, vocab: Path) -> Path:
    bert_tokenizer(vocab, True).save_pretrained(str(d))
    shutil.copyfile(vocab, d / "vocab.txt")
    return d


def _hf_configs():
    from transformers import ElectraConfig as HFConfig

    disc = HFConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, max_position_embeddings=64)
    gen = HFConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=1,
                   intermediate_size=64, max_position_embeddings=64)
    return disc, gen


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory, vocab) -> Path:
    """A discriminator saved by transformers, with a generator sharing its embeddings in generator/."""
    from transformers import ElectraForMaskedLM, ElectraForPreTraining as HFElectra

    torch.manual_seed(1)
    dc, gc = _hf_configs()
    disc, gen = HFElectra(dc), ElectraForMaskedLM(gc)
    gen.electra.embeddings.load_state_dict(disc.electra.embeddings.state_dict())
    src = tmp_path_factory.mktemp("hf_pair")
    disc.save_pretrained(str(src))
    gen.save_pretrained(str(src / "generator"))
    _with_tokenizer(src, vocab)
    _with_tokenizer(src / "generator", vocab)
    return src


def test_hf_to_ours_to_hf_is_byte_identical(tmp_path, hf_pair, vocab):
    ck = read_hf_dir(hf_pair, kernels="reference")
    assert isinstance(ck.config, ElectraConfig) and not ck.fresh_keys
    assert (ck.config.embedding_width, ck.config.hidden_size, ck.config.generator_hidden_size,
            ck.config.generator_num_attention_heads) == (32, 64, 16, 1)
    model = ElectraForPreTraining(ck.config, device_type="cpu")
    model.load_state_dict(ck.state_dict, strict=True)
    direct = write_hf_dir(tmp_path / "direct", ck.config, model.state_dict(), vocab, True)
    mid = write_torch_dir(tmp_path / "mid", load_pretrained(hf_pair))  # import-hf --format torch, then export
    w = load_pretrained(mid)
    assert isinstance(w.config, ElectraConfig) and w.config == dataclasses.replace(ck.config, kernels="auto")
    back = write_hf_dir(tmp_path / "back", w.config, w.state_dict, w.vocab_file, w.do_lower_case)
    for out in (direct, back):
        assert sha(hf_pair / "model.safetensors") == sha(out / "model.safetensors")
        assert sha(hf_pair / "generator" / "model.safetensors") == sha(out / "generator" / "model.safetensors")
    d = electra_max_logit_diff(hf_pair, ck.config, ck.state_dict)
    assert d["discriminator"] <= 1e-4 and d["generator_mlm"] <= 1e-4, d
    # the check sees a difference in either tower
    for key in ("discriminator.discriminator_predictions.dense_prediction.bias",
                "generator.generator_predictions.dense.bias"):
        changed = {**ck.state_dict, key: ck.state_dict[key] + 0.01}
        assert max(electra_max_logit_diff(hf_pair, ck.config, changed).values()) > 1e-4, key


def test_ours_loads_in_transformers_with_every_key(tmp_path, vocab):
    from transformers import AutoModel, AutoModelForSequenceClassification, ElectraForMaskedLM
    from transformers import ElectraForPreTraining as HFElectra

    torch.manual_seed(0)
    cfg = ElectraConfig(preset="custom", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64, kernels="reference", embedding_size=32,
                        generator_hidden_size=16, generator_num_hidden_layers=1, generator_num_attention_heads=1,
                        generator_intermediate_size=64)
    model = ElectraForPreTraining(cfg, device_type="cpu")
    with torch.no_grad():  # non-zero biases: a dropped or swapped bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    out = write_hf_dir(tmp_path / "hf", cfg, model.state_dict(), vocab)
    disc, info = HFElectra.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info
    assert disc.config.architectures == ["ElectraForPreTraining"] and disc.config.embedding_size == 32
    gen, info = ElectraForMaskedLM.from_pretrained(str(out / "generator"), output_loading_info=True)
    assert not any(info.values()), info
    assert gen.generator_lm_head.weight.data_ptr() == gen.electra.embeddings.word_embeddings.weight.data_ptr()
    _, info = AutoModel.from_pretrained(str(out), output_loading_info=True)  # the encoder fine-tuning starts from
    assert not info["missing_keys"] and set(info["unexpected_keys"]) == {
        "discriminator_predictions.dense.weight", "discriminator_predictions.dense.bias",
        "discriminator_predictions.dense_prediction.weight", "discriminator_predictions.dense_prediction.bias"}
    _, info = AutoModelForSequenceClassification.from_pretrained(str(out), num_labels=3, output_loading_info=True)
    assert {k.split(".")[0] for k in info["missing_keys"]} == {"classifier"}
    d = max_logit_diff(out, cfg, model.state_dict())
    assert d["mlm"] <= 1e-4 and d["nsp"] <= 1e-4, d
    alone = write_hf_dir(tmp_path / "alone", cfg.without_generator(),
                         {k: v for k, v in model.state_dict().items() if k.startswith("discriminator.")}, vocab)
    assert not (alone / "generator").exists()
    assert sha(alone / "model.safetensors") == sha(out / "model.safetensors")


def test_bare_and_task_models_read_as_a_discriminator(tmp_path, vocab):
    from transformers import ElectraForSequenceClassification, ElectraModel

    dc, _ = _hf_configs()
    torch.manual_seed(2)
    bare = ElectraModel(dc)
    bare.save_pretrained(str(tmp_path / "bare"))
    ck = read_hf_dir(_with_tokenizer(tmp_path / "bare", vocab), kernels="reference")
    assert not ck.config.has_generator
    assert {k.rsplit(".", 1)[0] for k in ck.fresh_keys} == {"discriminator.discriminator_predictions.dense",
                                                           "discriminator.discriminator_predictions.dense_prediction"}
    assert torch.equal(ck.state_dict["discriminator.electra.embeddings_project.weight"],
                       bare.embeddings_project.weight)
    task = ElectraForSequenceClassification(dc)
    task.save_pretrained(str(tmp_path / "task"))
    ck = read_hf_dir(_with_tokenizer(tmp_path / "task", vocab), kernels="reference")
    assert "classifier.out_proj.weight" in ck.raw_state_dict and not any(k.startswith("classifier")
                                                                           for k in ck.state_dict)
    model = ElectraForPreTraining(ck.config, device_type="cpu")
    model.load_state_dict(ck.state_dict, strict=True)


def test_a_generator_alone_or_unshared_embeddings_are_refused(tmp_path, hf_pair, vocab):
    with pytest.raises(ExportError, match="an ElectraForMaskedLM .*give the discriminator's directory"):
        read_hf_dir(hf_pair / "generator")
    bad = tmp_path / "bad"
    shutil.copytree(hf_pair, bad)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(bad / "generator" / "model.safetensors"))
    sd["electra.embeddings.position_embeddings.weight"] = sd["electra.embeddings.position_embeddings.weight"] + 1
    save_file(sd, str(bad / "generator" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"generator's embeddings differ .*position_embeddings.*ELECTRA shares them"):
        read_hf_dir(bad)


def test_import_hf_reads_electra(tmp_path, hf_pair, vocab):
    from bertdist.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["import-hf", str(hf_pair), "--out", str(tmp_path / "torch"), "--format", "torch"]) == 0
    text = out.getvalue()
    assert "verify: max |ours - transformers| logits: discriminator" in text and "generator MLM" in text
    assert "ELECTRA discriminator E=32 + generator L=2 H=16" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["import-hf", str(hf_pair), "--out", str(tmp_path / "ds")]) == 0, out.getvalue()
    assert "electra.generator_hidden_size=16" in out.getvalue()  # the overrides to continue pretraining
    a, b = load_pretrained(tmp_path / "torch"), load_pretrained(tmp_path / "ds")
    assert isinstance(b.config, ElectraConfig) and b.config.generator_hidden_size == 16
    assert a.state_dict.keys() == b.state_dict.keys()
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    alone = tmp_path / "alone"
    shutil.copytree(hf_pair, alone, ignore=shutil.ignore_patterns("generator"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["import-hf", str(alone), "--out", str(tmp_path / "ds-alone")]) == 2
    assert "without its generator" in out.getvalue() and "--format torch" in out.getvalue()
