"""Task heads on our ``BertModel``, with Hugging Face's module names
(``bert``, ``classifier``, ``qa_outputs``) so a fine-tuned state dict matches
``BertForSequenceClassification`` / ``BertForTokenClassification`` /
``BertForQuestionAnswering`` / ``BertForMultipleChoice``.

An ELECTRA backbone (an ``ElectraConfig``: the discriminator) gets ``ElectraForTask``: the
discriminator's encoder (``electra``: embeddings, projection, encoder; no pooler) with the heads
of ``ElectraForSequenceClassification`` (``classifier.dense`` + gelu + ``classifier.out_proj`` on
the first token), ``ElectraForTokenClassification``, ``ElectraForQuestionAnswering`` and
``ElectraForMultipleChoice`` (``sequence_summary.summary`` + gelu, then ``classifier``), so its
task models load in transformers as those. A ModernBERT backbone's heads are in
modernbert_heads.py. ``task_model`` builds the one that fits the config's family
(bertdist/export/encoders.py).
"""
from __future__ import annotations

from typing import Literal, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertdist.model import IGNORE_INDEX, BertConfig, BertModel, ElectraConfig
from bertdist.model.bert import init_weights

HeadKind = Literal["classification", "regression", "token", "span", "choice"]
def hf_architecture(kind: str, cfg: BertConfig) -> str:
    """The transformers class of a task model of head ``kind`` on the backbone ``cfg``."""
    from bertdist.export.encoders import family_of

    return family_of(cfg).hf_architecture(kind)


def head_keys(kind: str, cfg: BertConfig | None = None) -> tuple[str, ...]:
    """The task head's tensors in a task model's state dict on the backbone ``cfg``; first the
    output layer's weight ([outputs, hidden])."""
    from bertdist.export.encoders import family_of

    return (BertForTask if cfg is None else family_of(cfg).task_class()).head_keys(kind)


def task_model(cfg: BertConfig, kind: HeadKind, num_labels: int = 2, device_type: str | None = None,
               **head) -> nn.Module:
    """The task model of the backbone's family (``BertForTask``, ``ElectraForTask``,
    ``ModernBertForTask``); ``head``: options of that family's heads (ModernBERT's ``pooling``)."""
    from bertdist.export.encoders import family_of

    return family_of(cfg).task_model(cfg, kind, num_labels, device_type=device_type, **head)


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

    @staticmethod
    def head_keys(kind: str) -> tuple[str, ...]:
        return ("qa_outputs.weight", "qa_outputs.bias") if kind == "span" else ("classifier.weight", "classifier.bias")

    def head_modules(self) -> list[nn.Module]:
        return [self.qa_outputs] if self.kind == "span" else [self.classifier]

    @property
    def backbone(self) -> BertModel:
        return self.bert

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


class ElectraClassificationHead(nn.Module):
    """HF's ``ElectraClassificationHead``: dropout, dense, gelu, dropout, out_proj on the first token."""

    def __init__(self, cfg: BertConfig, out: int):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.out_proj = nn.Linear(cfg.hidden_size, out)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dropout(F.gelu(self.dense(self.dropout(seq[:, 0])))))


class ElectraSequenceSummary(nn.Module):
    """HF's ``ElectraSequenceSummary`` as ``ElectraForMultipleChoice`` configures it: the first
    token, a dense layer, gelu, dropout 0.1 (``summary_last_dropout``)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.summary = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.last_dropout = nn.Dropout(0.1)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        return self.last_dropout(F.gelu(self.summary(seq[:, 0])))


class ElectraForTask(nn.Module):
    """The ELECTRA discriminator's encoder + one task head (HF's ``ElectraFor<Task>`` names);
    ``forward(batch)`` returns (logits, loss or None), as ``BertForTask``'s."""

    def __init__(self, cfg: ElectraConfig, kind: HeadKind, num_labels: int = 2, device_type: str | None = None):
        from bertdist.model.bert import _default_device_type
        from bertdist.model.electra import ElectraModel
        from bertdist.ops import resolve_kernels

        super().__init__()
        self.kind, self.num_labels = kind, num_labels
        disc = cfg.discriminator_config()
        kernels = resolve_kernels(disc.kernels, device_type or _default_device_type(), model_config=disc)
        self.electra = ElectraModel(disc, cfg.embedding_width, kernels)
        if kind in ("classification", "regression"):
            self.classifier = ElectraClassificationHead(disc, 1 if kind == "regression" else num_labels)
        elif kind == "choice":
            self.sequence_summary = ElectraSequenceSummary(disc)
            self.classifier = nn.Linear(disc.hidden_size, 1)
        elif kind == "token":
            self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
            self.classifier = nn.Linear(disc.hidden_size, num_labels)
        else:
            self.qa_outputs = nn.Linear(disc.hidden_size, 2)
        for m in self.head_modules():
            m.apply(lambda module: init_weights(module, cfg.initializer_range))

    @staticmethod
    def head_keys(kind: str) -> tuple[str, ...]:
        if kind in ("classification", "regression"):
            return ("classifier.out_proj.weight", "classifier.out_proj.bias", "classifier.dense.weight",
                    "classifier.dense.bias")
        if kind == "choice":
            return ("classifier.weight", "classifier.bias", "sequence_summary.summary.weight",
                    "sequence_summary.summary.bias")
        return BertForTask.head_keys(kind)

    def head_modules(self) -> list[nn.Module]:
        if self.kind == "span":
            return [self.qa_outputs]
        return [self.sequence_summary, self.classifier] if self.kind == "choice" else [self.classifier]

    @property
    def backbone(self) -> nn.Module:
        return self.electra

    def load_backbone(self, pretraining_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Take the encoder from an ``ElectraForPreTraining`` state dict (its ``discriminator.electra.*``)."""
        prefix = "discriminator.electra."
        own = self.electra.state_dict()
        sd = {k[len(prefix):]: v for k, v in pretraining_state_dict.items() if k.startswith(prefix)}
        missing = sorted(set(own) - set(sd))
        if missing:
            raise KeyError(f"the checkpoint lacks ELECTRA discriminator weights {missing[:5]}")
        self.electra.load_state_dict({k: sd[k] for k in own}, strict=True)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
        if self.kind == "choice":  # [B, C, S] -> [B*C, S]
            b, c, s = ids.shape
            ids, mask, types = ids.view(-1, s), mask.view(-1, s), types.view(-1, s)
        seq = self.electra(ids, mask, types)
        labels = batch.get("labels")
        if self.kind == "span":
            start, end = self.qa_outputs(seq).float().unbind(-1)
            loss = None
            if "start_positions" in batch:
                loss = (F.cross_entropy(start, batch["start_positions"]) + F.cross_entropy(end, batch["end_positions"])) / 2
            return torch.stack([start, end], dim=-1), loss
        if self.kind == "token":
            logits = self.classifier(self.dropout(seq)).float()
            loss = None if labels is None else F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1),
                                                                ignore_index=IGNORE_INDEX)
            return logits, loss
        if self.kind == "choice":
            logits = self.classifier(self.sequence_summary(seq)).float().view(b, c)
            return logits, None if labels is None else F.cross_entropy(logits, labels)
        logits = self.classifier(seq).float()
        if self.kind == "regression":
            logits = logits.squeeze(-1)
            return logits, None if labels is None else F.mse_loss(logits, labels.float())
        return logits, None if labels is None else F.cross_entropy(logits, labels)
