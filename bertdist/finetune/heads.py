"""Task heads on our ``BertModel``, with Hugging Face's module names
(``bert``, ``classifier``, ``qa_outputs``) so a fine-tuned state dict matches
``BertForSequenceClassification`` / ``BertForTokenClassification`` /
``BertForQuestionAnswering`` / ``BertForMultipleChoice``.
"""
from __future__ import annotations

from typing import Literal, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertdist.model import IGNORE_INDEX, BertConfig, BertModel
from bertdist.model.bert import init_weights

HeadKind = Literal["classification", "regression", "token", "span", "choice"]
HF_ARCHITECTURE = {
    "classification": "BertForSequenceClassification",
    "regression": "BertForSequenceClassification",
    "token": "BertForTokenClassification",
    "span": "BertForQuestionAnswering",
    "choice": "BertForMultipleChoice",
}


class BertForTask(nn.Module):
    """BERT + dropout + one linear head; ``forward(batch)`` returns (logits, loss or None)."""

    def __init__(self, cfg: BertConfig, kind: HeadKind, num_labels: int = 2, device_type: str | None = None):
        super().__init__()
        self.kind = kind
        self.num_labels = num_labels
        pooled = kind in ("classification", "regression", "choice")
        self.bert = BertModel(cfg, add_pooling_layer=pooled, device_type=device_type)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        if kind == "span":
            self.qa_outputs = nn.Linear(cfg.hidden_size, 2)
        else:
            out = 1 if kind in ("regression", "choice") else num_labels
            self.classifier = nn.Linear(cfg.hidden_size, out)
        for m in self.head_modules():
            init_weights(m, cfg.initializer_range)

    def head_modules(self) -> list[nn.Module]:
        return [self.qa_outputs] if self.kind == "span" else [self.classifier]

    def load_backbone(self, pretraining_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Take the encoder (and pooler, where used) from a BertForPreTraining state dict."""
        own = self.bert.state_dict()
        sd = {k[len("bert."):]: v for k, v in pretraining_state_dict.items() if k.startswith("bert.")}
        sd = {k: v for k, v in sd.items() if k in own}
        missing = sorted(set(own) - set(sd))
        if missing:
            raise KeyError(f"the checkpoint lacks encoder weights {missing[:5]}")
        self.bert.load_state_dict(sd, strict=True)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
        if self.kind == "choice":  # [B, C, S] -> [B*C, S]
            b, c, s = ids.shape
            ids, mask, types = ids.view(-1, s), mask.view(-1, s), types.view(-1, s)
        seq, pooled = self.bert(ids, mask, types)
        if self.kind == "span":
            start, end = self.qa_outputs(seq).float().unbind(-1)
            logits = torch.stack([start, end], dim=-1)  # [B, S, 2]
            loss = None
            if "start_positions" in batch:
                loss = (F.cross_entropy(start, batch["start_positions"]) + F.cross_entropy(end, batch["end_positions"])) / 2
            return logits, loss
        if self.kind == "token":
            logits = self.classifier(self.dropout(seq)).float()
            loss = None
            if "labels" in batch:
                loss = F.cross_entropy(logits.view(-1, self.num_labels), batch["labels"].view(-1), ignore_index=IGNORE_INDEX)
            return logits, loss
        logits = self.classifier(self.dropout(pooled)).float()
        if self.kind == "choice":
            logits = logits.view(b, c)
        loss = None
        if "labels" in batch:
            if self.kind == "regression":
                logits = logits.squeeze(-1)
                loss = F.mse_loss(logits, batch["labels"].float())
            else:
                loss = F.cross_entropy(logits, batch["labels"])
        elif self.kind == "regression":
            logits = logits.squeeze(-1)
        return logits, loss
