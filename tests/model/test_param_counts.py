"""Parameter counts of the presets, against the published BERT figures."""
import pytest
import torch

from bertdist.model import PRESETS, BertConfig, BertForPreTraining, BertModel, count_parameters


@pytest.mark.parametrize("preset,expected", [("base", 109_482_240), ("large", 335_141_888)])
def test_bert_model_with_pooler(preset, expected):
    with torch.device("meta"):
        model = BertModel(BertConfig.from_preset(preset, vocab_size=30522, kernels="reference"))
    assert count_parameters(model) == expected


def test_pretraining_heads_add_transform_bias_and_nsp_only():
    # The decoder is tied to the word embeddings, so the heads add: transform dense + LN, vocab bias, NSP.
    cfg = BertConfig.from_preset("base", kernels="reference")
    with torch.device("meta"):
        full = count_parameters(BertForPreTraining(cfg))
    d, v = cfg.hidden_size, cfg.vocab_size
    assert full == 109_482_240 + (d * d + d) + 2 * d + v + (2 * d + 2)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_documented_shapes(name):
    cfg = BertConfig.from_preset(name)
    assert cfg.hidden_size == cfg.num_attention_heads * cfg.head_dim
    assert cfg.intermediate_size == 4 * cfg.hidden_size
    assert (cfg.max_position_embeddings, cfg.type_vocab_size, cfg.initializer_range) == (512, 2, 0.02)
