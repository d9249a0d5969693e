"""Task heads on our ModernBERT, as transformers' ``ModernBertFor<Task>`` builds them, with its
module names: ``model`` (the encoder), ``head`` (``ModernBertPredictionHead``: dense, gelu, norm),
``drop`` and ``classifier``; so a fine-tuned state dict is a ``ModernBertForSequenceClassification``
/ ``ForTokenClassification`` / ``ForQuestionAnswering`` / ``ForMultipleChoice`` one, key for key.

Sequence-level heads (classification, regression, multiple choice) pool the last hidden states
per ``classifier_pooling``: ``cls`` (the first token; for multiple choice transformers takes the
first real token, which is the first with right padding) or ``mean`` (over the real tokens). Token
and span heads run the prediction head on every token; the span head's ``classifier`` has two
outputs, start and end (transformers names it ``classifier``, not BERT's ``qa_outputs``).

``ModernBertBackbone`` is the bare encoder with BERT's call shape, ``(ids, mask, types) ->
(hidden, None)``, for the bi-encoder: its state dict is a bare ``ModernBertModel``'s.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertdist.model import IGNORE_INDEX
from bertdist.model.modernbert import ModernBertModel, ModernBertPredictionHead
from bertdist.model.modernbert_config import ModernBertConfig

POOLINGS = ("cls", "mean")
PREFIX = "model."  # the encoder's keys in a ModernBertForMaskedLM (pretraining) state dict


class ModernBertBackbone(ModernBertModel):
    """``ModernBertModel`` called as ``BertModel`` is: ``(input_ids, attention_mask, token_type_ids)``
    -> ``(hidden [B, S, H], None)``; token types are ignored (ModernBERT has none)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return super().forward(input_ids, attention_mask), None


def backbone_state(pretraining_state_dict: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """The encoder's tensors of a ModernBertForMaskedLM state dict, under the bare model's keys."""
    sd = {k[len(PREFIX):]: v for k, v in pretraining_state_dict.items() if k.startswith(PREFIX)}
    missing = sorted(set(own) - set(sd))
    if missing:
        raise KeyError(f"the checkpoint lacks ModernBERT encoder weights {missing[:5]}")
    return {k: sd[k] for k in own}


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """transformers' pooling of ``ModernBertFor{SequenceClassification,MultipleChoice}``."""
    if how == "cls":
        return hidden[:, 0]
    m = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1)


class ModernBertForTask(nn.Module):
    """ModernBERT + ``head`` + ``drop`` + ``classifier``; ``forward(batch)`` returns (logits, loss or
    None), as ``BertForTask``'s. ``pooling``: the sequence-level heads' ``classifier_pooling``."""

    def __init__(self, cfg: ModernBertConfig, kind: str, num_labels: int = 2, device_type: str | None = None,
                 pooling: str = "cls", classifier_dropout: float = 0.0):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"classifier_pooling {pooling!r} is not one of {list(POOLINGS)}")
        self.kind, self.num_labels, self.pooling = kind, num_labels, pooling
        self.classifier_dropout = classifier_dropout
        self.model = ModernBertModel(cfg)
        self.head = ModernBertPredictionHead(cfg)
        self.drop = nn.Dropout(classifier_dropout)
        out = {"regression": 1, "choice": 1, "span": 2}.get(kind, num_labels)
        self.classifier = nn.Linear(cfg.hidden_size, out)
        self._init_head(cfg)

    @staticmethod
    def head_keys(kind: str) -> tuple[str, ...]:
        """The task head's tensors; first the output layer's weight ([outputs, hidden])."""
        return ("classifier.weight", "classifier.bias", "head.dense.weight", "head.norm.weight")

    @torch.no_grad()
    def _init_head(self, cfg: ModernBertConfig) -> None:
        """transformers' init of these modules: the dense layer as a block's output, the classifier
        at std hidden^-0.5, both truncated normals; the norm at identity, the bias zero."""
        def trunc(w: torch.Tensor, std: float) -> None:
            cut = cfg.initializer_cutoff_factor * std
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-cut, b=cut)

        trunc(self.head.dense.weight, cfg.initializer_range / math.sqrt(2.0 * cfg.num_hidden_layers))
        nn.init.ones_(self.head.norm.weight)
        trunc(self.classifier.weight, cfg.hidden_size ** -0.5)
        nn.init.zeros_(self.classifier.bias)

    def head_modules(self) -> list[nn.Module]:
        return [self.head, self.classifier]

    @property
    def backbone(self) -> ModernBertModel:
        return self.model

    def load_backbone(self, pretraining_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Take the encoder from a ``ModernBertForMaskedLM`` state dict (its ``model.*``)."""
        self.model.load_state_dict(backbone_state(pretraining_state_dict, self.model.state_dict()), strict=True)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.kind == "choice":  # [B, C, S] -> [B*C, S]
            b, c, s = ids.shape
            ids, mask = ids.view(-1, s), mask.view(-1, s)
        seq = self.model(ids, mask)
        labels = batch.get("labels")
        if self.kind in ("token", "span"):
            logits = self.classifier(self.drop(self.head(seq))).float()
            if self.kind == "span":
                loss = None
                if "start_positions" in batch:
                    start, end = logits.unbind(-1)
                    loss = (F.cross_entropy(start, batch["start_positions"])
                            + F.cross_entropy(end, batch["end_positions"])) / 2
                return logits, loss
            loss = None if labels is None else F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1),
                                                                ignore_index=IGNORE_INDEX)
            return logits, loss
        logits = self.classifier(self.drop(self.head(pool(seq, mask, self.pooling)))).float()
        if self.kind == "choice":
            logits = logits.view(b, c)
            return logits, None if labels is None else F.cross_entropy(logits, labels)
        if self.kind == "regression":
            logits = logits.squeeze(-1)
            return logits, None if labels is None else F.mse_loss(logits, labels.float())
        return logits, None if labels is None else F.cross_entropy(logits, labels)
