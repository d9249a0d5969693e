"""The encoder-family seam (bertdist/export/encoders.py) and a checkpoint's own fast tokenizer
(bertdist/export/tokenizer.py ``fast_tokenizer``, ``trim_byte_level_offsets``)."""
from __future__ import annotations

import shutil

import pytest

from bertdist.export.encoders import FAMILIES, family_named, family_of
from bertdist.model import BertConfig, ElectraConfig
from bertdist.model.modernbert_config import ModernBertConfig
from tests.export.tiny_modernbert import write_bpe_tokenizer

transformers = pytest.importorskip("transformers")
KINDS = ("classification", "regression", "token", "span", "choice", "encoder")


def test_each_config_has_one_family_and_its_classes_exist_in_transformers():
    configs = {"bert": BertConfig.from_preset("tiny"), "modernbert": ModernBertConfig.from_preset("tiny"),
               "electra": ElectraConfig(preset="custom", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=64, embedding_size=16)}
    for name, cfg in configs.items():
        family = family_of(cfg)
        assert family.name == name and family_named(family.model_type) is family
        for kind in KINDS:
            assert hasattr(transformers, family.hf_architecture(kind)), family.hf_architecture(kind)
    assert family_named("roberta") is None and len({f.name for f in FAMILIES}) == len(FAMILIES)
    with pytest.raises(TypeError, match="no encoder family for a dict"):
        family_of({})


def test_modernbert_family_maps_bert_knobs_onto_its_config():
    f = family_of(ModernBertConfig.from_preset("tiny"))
    cfg = ModernBertConfig.from_preset("tiny")
    assert f.with_kernels(cfg, "fused") is cfg  # one implementation: kernels do not apply
    assert f.with_dropout(cfg, 0.2).mlp_dropout == 0.2 and f.with_dropout(cfg, None) is cfg
    student = f.student_preset("tiny", ModernBertConfig.from_preset("base", vocab_size=320, pad_token_id=0,
                                                                    max_position_embeddings=64, local_attention=16))
    assert (student.hidden_size, student.vocab_size, student.pad_token_id) == (64, 320, 0)
    assert student.local_attention <= student.max_position_embeddings == 64


def test_a_tokenizer_json_alone_is_enough(tmp_path):
    """A directory with only tokenizer.json (no tokenizer_config.json for AutoTokenizer) still loads,
    and every encoding carries token types, as BERT's does."""
    from bertdist.export.tokenizer import fast_tokenizer

    write_bpe_tokenizer(tmp_path / "full")
    (tmp_path / "bare").mkdir()
    shutil.copyfile(tmp_path / "full" / "tokenizer.json", tmp_path / "bare" / "tokenizer.json")
    full, bare = fast_tokenizer(tmp_path / "full" / "tokenizer.json"), fast_tokenizer(tmp_path / "bare" / "tokenizer.json")
    a, b = full("a great film", "truly fine"), bare("a great film", "truly fine")
    assert a["input_ids"] == b["input_ids"] and a["input_ids"][0] == full.convert_tokens_to_ids("[CLS]")
    assert set(a) >= {"input_ids", "token_type_ids", "attention_mask"} and "token_type_ids" in b
    with pytest.raises(FileNotFoundError):
        fast_tokenizer(tmp_path / "nowhere" / "tokenizer.json")


def test_byte_level_spans_leave_out_the_space_before_a_word(tmp_path):
    from tokenizers import Tokenizer

    from bertdist.export.tokenizer import trim_byte_level_offsets

    write_bpe_tokenizer(tmp_path)
    raw, trimmed = (Tokenizer.from_file(str(tmp_path / "tokenizer.json")) for _ in range(2))
    trim_byte_level_offsets(trimmed)
    text = "The man is cooking dinner"
    a, b = raw.encode(text), trimmed.encode(text)
    assert a.ids == b.ids and a.word_ids == b.word_ids
    assert any(text[s:e].startswith(" ") for s, e in a.offsets)  # what it would be without
    assert not any(text[s:e].startswith(" ") for s, e in b.offsets)
    trim_byte_level_offsets(trimmed)  # twice is once
    assert trimmed.encode(text).offsets == b.offsets
