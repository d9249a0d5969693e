"""The BERT model (bert.py), ELECTRA built from its parts (electra.py), their configs and presets
(config.py), ModernBERT (modernbert.py, its config and presets in modernbert_config.py), FLOP
accounting (flops.py).

The config and the FLOP accounting import no torch, so schemas and tooling can use them without
it; the model classes load torch when first asked for.
"""
from bertdist.model.config import BERT_VOCAB_SIZE, IGNORE_INDEX, PRESETS, BertConfig, ElectraConfig
from bertdist.model.modernbert_config import MODERNBERT_PRESETS, ModernBertConfig
from bertdist.model.flops import forward_flops_per_sequence, mfu, train_flops_per_sequence

_MODEL_NAMES = ("BertForPreTraining", "BertModel", "PreTrainingOutput", "count_parameters", "mlm_loss", "nsp_loss")
_ELECTRA_NAMES = ("ElectraForPreTraining", "ElectraModel", "ElectraPreTrainingOutput")
_MODERNBERT_NAMES = ("ModernBertForMaskedLM", "ModernBertModel")


def __getattr__(name: str):
    if name in _MODEL_NAMES:
        from bertdist.model import bert

        return getattr(bert, name)
    if name in _ELECTRA_NAMES:
        from bertdist.model import electra

        return getattr(electra, name)
    if name in _MODERNBERT_NAMES:
        from bertdist.model import modernbert

        return getattr(modernbert, name)
    raise AttributeError(f"module 'bertdist.model' has no attribute {name!r}")


__all__ = [
    "BERT_VOCAB_SIZE",
    "IGNORE_INDEX",
    "MODERNBERT_PRESETS",
    "PRESETS",
    "BertConfig",
    "BertForPreTraining",
    "BertModel",
    "ElectraConfig",
    "ElectraForPreTraining",
    "ElectraModel",
    "ElectraPreTrainingOutput",
    "ModernBertConfig",
    "ModernBertForMaskedLM",
    "ModernBertModel",
    "PreTrainingOutput",
    "count_parameters",
    "forward_flops_per_sequence",
    "mfu",
    "mlm_loss",
    "nsp_loss",
    "train_flops_per_sequence",
]
