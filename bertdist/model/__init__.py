"""The BERT model (bert.py), its config and presets (config.py), FLOP accounting (flops.py)."""
from bertdist.model.bert import (
    IGNORE_INDEX,
    BertForPreTraining,
    BertModel,
    PreTrainingOutput,
    count_parameters,
    mlm_loss,
    nsp_loss,
)
from bertdist.model.config import BERT_VOCAB_SIZE, PRESETS, BertConfig
from bertdist.model.flops import forward_flops_per_sequence, mfu, train_flops_per_sequence

__all__ = [
    "BERT_VOCAB_SIZE",
    "IGNORE_INDEX",
    "PRESETS",
    "BertConfig",
    "BertForPreTraining",
    "BertModel",
    "PreTrainingOutput",
    "count_parameters",
    "forward_flops_per_sequence",
    "mfu",
    "mlm_loss",
    "nsp_loss",
    "train_flops_per_sequence",
]
