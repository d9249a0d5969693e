"""Distillation losses: the student matches the teacher's outputs, plus a gold-label term.

* classification: ``T^2 * KL(softmax(t/T) || softmax(s/T))`` (mean over rows) + ``alpha * CE(s, gold)``
  over the rows that have a gold label (``IGNORE_INDEX`` elsewhere);
* regression: ``MSE(s, t)`` + ``alpha * MSE(s, gold)`` over the rows with a gold value (NaN elsewhere);
* token (NER): the same KL per token, averaged over the tokens of ``mask`` (first word pieces;
  padding, special tokens and continuation pieces excluded) + ``alpha * CE`` on gold tags;
* span (SQuAD): the KL on the start and on the end distribution over the positions of the
  sequence (padding excluded), averaged, + ``alpha * CE`` on gold start/end positions;
* with top-k pseudo-labels (the teacher's k largest logits and their indices), the same terms with
  ``topk_kl`` in place of the full KL;
* TinyBERT's intermediate losses: hidden-state MSE through a learned projection when the widths
  differ, and the KL between attention maps, on the layers of a layer map.

The T^2 factor keeps the soft-target gradients at the scale of the hard-target ones as T grows
(Hinton et al., 2015).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertdist.model import IGNORE_INDEX


def _mean_over_mask(per_row: torch.Tensor, student: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``per_row`` where ``mask`` is true (all rows without one); a zero that keeps the
    student in the graph when no row is selected."""
    if mask is None:
        return per_row.mean()
    mask = mask.bool()
    if not mask.any():
        return student.sum() * 0.0
    return per_row[mask].mean()


def soft_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """``T^2 * KL(p_t || p_s)`` over the last dimension, averaged over the rows where ``mask`` is true
    (all rows without a mask). Both distributions are softened by the temperature."""
    t = float(temperature)
    log_s = F.log_softmax(student.float() / t, dim=-1)
    log_t = F.log_softmax(teacher.float() / t, dim=-1)
    per_row = (log_t.exp() * (log_t - log_s)).sum(-1)
    return _mean_over_mask(per_row, student, mask) * t * t


def topk_kl(student: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, temperature: float,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """``T^2 * sum_i p_t(i) (log p_t(i) - log q_s(i))`` over the stored support of each row, averaged
    over the rows where ``mask`` is true. ``student``: [..., N] logits over all outputs (-inf where an
    output does not exist, e.g. span padding); ``values``/``indices``: [..., k] the teacher's top
    logits and where they are; a -inf value marks an unused slot (span rows shorter than k).

    The choice: the teacher distribution is softmax(top-k / T) renormalised over the support (the
    dropped tail has no logits to soften); the student's log-probabilities are log_softmax over ALL
    its outputs, then gathered at the support, so mass the student puts outside the support still
    lowers log q_s there and is penalised. With k = N this is exactly ``soft_kl``."""
    t = float(temperature)
    valid = torch.isfinite(values)
    log_t = F.log_softmax(values.float().masked_fill(~valid, float("-inf")) / t, dim=-1)
    log_s = F.log_softmax(student.float() / t, dim=-1).gather(-1, indices.long())
    # zero the unused slots before multiplying: 0 * -inf would be NaN, in the value or its gradient
    log_t = log_t.masked_fill(~valid, 0.0)
    log_s = log_s.masked_fill(~valid, 0.0)
    per_row = (log_t.exp() * valid * (log_t - log_s)).sum(-1)
    return _mean_over_mask(per_row, student, mask) * t * t


def _masked_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not ``IGNORE_INDEX``; 0 when there are none."""
    labels = labels.reshape(-1)
    if not (labels != IGNORE_INDEX).any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits.float().reshape(labels.numel(), -1), labels, ignore_index=IGNORE_INDEX)


def classification_loss(student: torch.Tensor, teacher: torch.Tensor, gold: torch.Tensor | None,
                        temperature: float, alpha: float, teacher_idx: torch.Tensor | None = None) -> torch.Tensor:
    """student, teacher: [B, C]; gold: [B] class ids, ``IGNORE_INDEX`` where a row has none.
    With ``teacher_idx`` [B, k], ``teacher`` holds the top-k values [B, k] (``topk_kl``)."""
    if teacher_idx is not None:
        loss = topk_kl(student, teacher, teacher_idx, temperature)
    else:
        loss = soft_kl(student, teacher, temperature)
    if gold is not None and alpha:
        loss = loss + alpha * _masked_ce(student, gold)
    return loss


def regression_loss(student: torch.Tensor, teacher: torch.Tensor, gold: torch.Tensor | None,
                    alpha: float) -> torch.Tensor:
    """student, teacher: [B]; gold: [B] values, NaN where a row has none."""
    s = student.float().reshape(-1)
    loss = F.mse_loss(s, teacher.float().reshape(-1))
    if gold is not None and alpha:
        gold = gold.float().reshape(-1)
        have = ~torch.isnan(gold)
        if have.any():
            loss = loss + alpha * F.mse_loss(s[have], gold[have])
    return loss


def token_loss(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, gold: torch.Tensor | None,
               temperature: float, alpha: float, teacher_idx: torch.Tensor | None = None) -> torch.Tensor:
    """student, teacher: [B, S, C]; mask: [B, S] (1 on the tokens that carry a word's tag);
    gold: [B, S] tag ids, ``IGNORE_INDEX`` on tokens without a gold tag. With ``teacher_idx``
    [B, S, k], ``teacher`` holds the top-k values per position [B, S, k]."""
    if teacher_idx is not None:
        loss = topk_kl(student, teacher, teacher_idx, temperature, mask)
    else:
        loss = soft_kl(student, teacher, temperature, mask)
    if gold is not None and alpha:
        loss = loss + alpha * _masked_ce(student, gold)
    return loss


def span_loss(student: torch.Tensor, teacher: torch.Tensor, attention_mask: torch.Tensor,
              start_positions: torch.Tensor | None, end_positions: torch.Tensor | None,
              temperature: float, alpha: float, teacher_idx: torch.Tensor | None = None) -> torch.Tensor:
    """student, teacher: [B, S, 2] start/end logits; the softmax runs over the sequence's real
    positions (padding gets -inf); gold positions: [B], ``IGNORE_INDEX`` on rows without an answer.
    With ``teacher_idx`` [B, 2, k], ``teacher`` holds the top-k start and end values [B, 2, k]
    (positions over the sequence; -inf in the slots of rows shorter than k)."""
    pad = ~attention_mask.bool()
    loss = student.new_zeros((), dtype=torch.float32)
    for i, gold in ((0, start_positions), (1, end_positions)):
        s = student[..., i].float().masked_fill(pad, float("-inf"))
        t_ = float(temperature)
        if teacher_idx is not None:
            kl = topk_kl(s, teacher[:, i], teacher_idx[:, i], t_)
        else:
            t = teacher[..., i].float().masked_fill(pad, float("-inf"))
            log_s = F.log_softmax(s / t_, dim=-1)
            log_t = F.log_softmax(t / t_, dim=-1)
            p_t = log_t.exp()
            kl = torch.where(pad, torch.zeros_like(p_t), p_t * (log_t - log_s)).sum(-1).mean() * t_ * t_
        loss = loss + kl / 2
        if gold is not None and alpha:
            loss = loss + alpha * _masked_ce(s, gold) / 2
    return loss


# ---------------------------------------------------------------- TinyBERT intermediate losses
def default_layer_map(student_layers: int, teacher_layers: int) -> list[int]:
    """The teacher layer each student layer learns from: evenly spread, first and last included
    (for 6 of 12: 0, 2, 4, 7, 9, 11, DistilBERT's choice). Also the layers ``layers:K`` copies."""
    if student_layers > teacher_layers:
        raise ValueError(f"a student of {student_layers} layers cannot take layers from a teacher of {teacher_layers}")
    if student_layers == 1:
        return [teacher_layers - 1]
    return [int(round(i * (teacher_layers - 1) / (student_layers - 1))) for i in range(student_layers)]


def check_layer_map(layer_map: list[int], student_layers: int, teacher_layers: int) -> list[int]:
    if len(layer_map) != student_layers:
        raise ValueError(f"layer_map {layer_map} has {len(layer_map)} entries; the student has {student_layers} layers")
    bad = [t for t in layer_map if not 0 <= t < teacher_layers]
    if bad:
        raise ValueError(f"layer_map {layer_map}: teacher layers {bad} are outside 0..{teacher_layers - 1}")
    return list(layer_map)


class HiddenProjection(nn.Module):
    """The learned map from student to teacher width (TinyBERT's W_h); identity when they agree."""

    def __init__(self, student_width: int, teacher_width: int):
        super().__init__()
        self.proj = nn.Linear(student_width, teacher_width, bias=False) if student_width != teacher_width else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.proj is None else self.proj(h)


def hidden_mse(student_hidden: list[torch.Tensor], teacher_hidden: list[torch.Tensor], layer_map: list[int],
               attention_mask: torch.Tensor, projection: HiddenProjection) -> torch.Tensor:
    """Mean over the mapped layers of the MSE between the projected student hidden states and the
    teacher's, over real tokens only. Hidden lists are the layer outputs, [B, S, H] each."""
    m = attention_mask.bool()
    total = student_hidden[0].new_zeros((), dtype=torch.float32)
    for s_i, t_i in enumerate(layer_map):
        s = projection(student_hidden[s_i].float())[m]
        total = total + F.mse_loss(s, teacher_hidden[t_i].float()[m])
    return total / len(layer_map)


def renormalised(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``probs`` [..., S, S] restricted to the ``keys`` [S, S] and summing to 1 again per query."""
    kept = probs * keys
    return kept / kept.sum(-1, keepdim=True).clamp_min(1e-12)


def attention_kl(student_probs: list[torch.Tensor], teacher_probs: list[torch.Tensor], layer_map: list[int],
                 attention_mask: torch.Tensor, student_allowed: list | None = None,
                 teacher_allowed: list | None = None) -> torch.Tensor:
    """Mean over the mapped layers of ``KL(A_t || A_s)`` between attention distributions
    [B, heads, S, S] (per query row, averaged over heads and real query tokens). Head counts must agree.

    ``*_allowed``: per layer, the [S, S] keys the layer may attend to (a ModernBERT local layer's
    window), or None for all. Where the two layers of a pair see different keys, both
    distributions are renormalised over the keys both see, so a windowed layer is compared on its
    window only (outside it, its probability is 0 and the KL would be unbounded)."""
    q = attention_mask.bool()[:, None, :].float()  # [B, 1, S] real query rows
    total = student_probs[0].new_zeros((), dtype=torch.float32)
    eps = 1e-12
    for s_i, t_i in enumerate(layer_map):
        a_s, a_t = student_probs[s_i].float(), teacher_probs[t_i].float()
        if a_s.shape != a_t.shape:
            raise ValueError(f"attention maps of student layer {s_i} {tuple(a_s.shape)} and teacher layer {t_i} "
                             f"{tuple(a_t.shape)} differ (heads must agree for the attention loss)")
        w_s = student_allowed[s_i] if student_allowed else None
        w_t = teacher_allowed[t_i] if teacher_allowed else None
        if w_s is not None or w_t is not None:
            common = w_s if w_t is None else w_t if w_s is None else w_s & w_t
            a_s, a_t = (renormalised(a, common) for a in (a_s, a_t))
        kl = (a_t * ((a_t + eps).log() - (a_s + eps).log())).sum(-1)  # [B, heads, S]
        kl = kl * q
        total = total + kl.sum() / (q.sum() * a_s.shape[1])
    return total / len(layer_map)
