"""General distillation during pretraining: the ``distill`` section of a pretraining config.

The model being pretrained (the student) learns a frozen teacher's MLM distribution on the
same masked batches, DistilBERT's three losses (Sanh et al., 2019):

* ``T^2 * KL(softmax(t/T) || softmax(s/T))`` at the masked positions (mean over them);
* the gold MLM cross-entropy (and the gold NSP/SOP loss where the records carry the label);
* optionally ``1 - cos(h_s, h_t)`` of the last hidden states, averaged over the real tokens
  (needs the teacher's hidden size).

The teacher is loaded once per rank, in eval mode with its parameters frozen, outside the
DeepSpeed engine: it is not trained, partitioned or checkpointed. Its outputs are computed under
``no_grad`` for exactly the micro-batch the student sees, so they depend only on the batch and a
resumed run stays bitwise equal to an uninterrupted one. Building it does not touch the global
RNG streams (``fork_rng``), so dropout and masking draw the same numbers with or without it.
The trainer calls ``GeneralDistillation`` on the student's output from outside the model; it is
an objective like the others (bertdist/train/objective.py), which also checks that a resume keeps
the ``distill`` section.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertdist.config import ConfigError
from bertdist.model import IGNORE_INDEX, BertConfig, ElectraConfig
from bertdist.model.bert import BertForPreTraining, PreTrainingOutput
from bertdist.train.config import PretrainDistillConfig, TrainConfig
from bertdist.train.objective import ObjectiveOutput, mlm_counts, mlm_eval_sums, nsp_counts


@dataclasses.dataclass
class DistillOutput(PreTrainingOutput):
    """The student's output with ``loss`` the combined objective; the unweighted parts for logging."""

    mlm_kl: torch.Tensor | None = None  # T^2-scaled KL at the masked positions
    hidden_cos: torch.Tensor | None = None  # mean 1 - cos of the last hidden states over real tokens


def mlm_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
           temperature: float) -> torch.Tensor:
    """``T^2 * KL(p_t || p_s)`` averaged over the rows whose label is not IGNORE_INDEX (all rows of
    the sparse head's [N_masked, V] logits; the masked positions of [B, S, V]). 0 with no such row.
    Weighted by a mask, not indexed by it, so that it reads nothing back to the host."""
    t = float(temperature)
    v = student_logits.shape[-1]
    log_s = F.log_softmax(student_logits.float().reshape(-1, v) / t, dim=-1)
    log_t = F.log_softmax(teacher_logits.float().reshape(-1, v) / t, dim=-1)
    per_row = (log_t.exp() * (log_t - log_s)).sum(-1)
    keep = (labels.reshape(-1) != IGNORE_INDEX).float()
    return (per_row * keep).sum() / keep.sum().clamp(min=1.0) * (t * t)


def hidden_cosine(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                  attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean ``1 - cos(h_s, h_t)`` over the real tokens ([B, S, H] each; the mask [B, S], None: all)."""
    cos = F.cosine_similarity(student_hidden.float(), teacher_hidden.float(), dim=-1)
    if attention_mask is None:
        return (1.0 - cos).mean()
    real = attention_mask.float()
    return ((1.0 - cos) * real).sum() / real.sum().clamp(min=1.0)


def combined_loss(cfg: PretrainDistillConfig, out: PreTrainingOutput, teacher_logits: torch.Tensor,
                  student_hidden: torch.Tensor | None = None, teacher_hidden: torch.Tensor | None = None,
                  attention_mask: torch.Tensor | None = None) -> DistillOutput:
    """``out`` (the student's output, with its gold MLM and NSP losses) with ``loss`` replaced by
    alpha_mlm_kl * KL + alpha_mlm_ce * MLM CE + alpha_hidden_cos * (1 - cos) + alpha_nsp * NSP CE."""
    kl = mlm_kl(out.prediction_logits, teacher_logits, out.mlm_labels, cfg.temperature)
    loss = cfg.alpha_mlm_kl * kl + cfg.alpha_mlm_ce * out.mlm_loss
    cos = None
    if cfg.alpha_hidden_cos:
        cos = hidden_cosine(student_hidden, teacher_hidden, attention_mask)
        loss = loss + cfg.alpha_hidden_cos * cos
    if out.nsp_loss is not None and cfg.alpha_nsp:
        loss = loss + cfg.alpha_nsp * out.nsp_loss
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(PreTrainingOutput)}
    return DistillOutput(**{**fields, "loss": loss}, mlm_kl=kl, hidden_cos=cos)


class _LastHidden:
    """Forward hook on a ``BertModel``: keeps its sequence output [B, S, H] of the last call."""

    def __init__(self, bert: nn.Module):
        self.value: torch.Tensor | None = None
        self.handle = bert.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.value = output[0]

    def take(self) -> torch.Tensor:
        value, self.value = self.value, None
        return value


@dataclasses.dataclass
class LoadedTeacher:
    model: BertForPreTraining
    config: BertConfig
    origin: dict
    vocab_file: Path | None


def _vocab_error(teacher: str, student_size: int, teacher_size: int, student_vocab: str,
                 teacher_vocab: Path | None, student_sha: str | None, teacher_sha: str | None) -> ConfigError:
    return ConfigError(
        f"distill.teacher {teacher}: its vocabulary differs from the student's, so their MLM "
        f"distributions are over different tokens:\n"
        f"  student: {student_size} tokens, {student_vocab} (sha256 {student_sha or 'n/a'})\n"
        f"  teacher: {teacher_size} tokens, {teacher_vocab or 'no vocab file'} (sha256 {teacher_sha or 'n/a'})\n"
        f"build the records with the teacher's vocab (data.vocab_file) or pick a teacher trained on this one")


def check_vocab(teacher: str, teacher_cfg: BertConfig, teacher_vocab: Path | None, student_cfg: BertConfig,
                student_vocab: str) -> None:
    """The teacher's vocab must be the student's: same size, and same tokens where it ships a vocab file."""
    from bertdist.export.tokenizer import vocab_sha256

    s_sha = vocab_sha256(student_vocab) if student_vocab and Path(student_vocab).is_file() else None
    t_sha = vocab_sha256(teacher_vocab) if teacher_vocab is not None and Path(teacher_vocab).is_file() else None
    if teacher_cfg.vocab_size != student_cfg.vocab_size or (s_sha and t_sha and s_sha != t_sha):
        raise _vocab_error(teacher, student_cfg.vocab_size, teacher_cfg.vocab_size, student_vocab, teacher_vocab,
                           s_sha, t_sha)


def load_teacher(cfg: TrainConfig, device: torch.device, kernels=None) -> LoadedTeacher:
    """The frozen teacher of ``cfg.distill`` on ``device``, in eval mode, checked against the student.
    ``kernels``: a KernelSet for it (None: the reference kernels)."""
    from bertdist.export.hf import ExportError
    from bertdist.export.sources import load_pretrained

    d = cfg.distill
    try:
        w = load_pretrained(d.teacher)
    except (ExportError, FileNotFoundError) as e:
        raise ConfigError(f"distill.teacher {d.teacher}: cannot load a BERT with an MLM head from it: {e}") from None
    if isinstance(w.config, ElectraConfig):
        raise ConfigError(f"distill.teacher {d.teacher}: an ELECTRA model; general distillation learns a BERT's "
                          f"MLM distribution (an ELECTRA discriminator has no MLM head)")
    check_vocab(d.teacher, w.config, w.vocab_file, cfg.model, cfg.data.vocab_file)
    if d.alpha_hidden_cos and w.config.hidden_size != cfg.model.hidden_size:
        raise ConfigError(
            f"distill.alpha_hidden_cos={d.alpha_hidden_cos} compares the last hidden states, which needs equal "
            f"widths: student hidden_size {cfg.model.hidden_size}, teacher hidden_size {w.config.hidden_size}; "
            f"set distill.alpha_hidden_cos=0 or give the student the teacher's width")
    # The student's head layout, so both project exactly the same (masked) positions.
    tcfg = dataclasses.replace(w.config, sparse_mlm_head=cfg.model.sparse_mlm_head, unpad=cfg.model.unpad,
                               compile=False, kernels=w.config.kernels if kernels is not None else "reference")
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        model = BertForPreTraining(tcfg, device_type=device.type, kernels=kernels)
    missing, unexpected = model.load_state_dict(w.state_dict, strict=False)
    bad = [k for k in missing if not k.startswith("cls.seq_relationship")]  # an MLM-only teacher has no NSP head
    if bad or unexpected:
        raise ConfigError(f"distill.teacher {d.teacher}: weights do not fit a BERT with an MLM head: "
                          f"missing {bad[:8]}, unexpected {unexpected[:8]}")
    model.to(device).eval()
    model.requires_grad_(False)
    return LoadedTeacher(model, tcfg, w.origin, w.vocab_file)


class GeneralDistillation:
    """The objective of a run with a ``distill`` section: ``__call__(out, batch)`` on each student output."""

    without_nsp = None  # the gold NSP/SOP loss is one of its parts (alpha_nsp)

    def __init__(self, cfg: PretrainDistillConfig, student: nn.Module, teacher: BertForPreTraining,
                 precision: str = "fp32", device_type: str = "cpu", origin: dict | None = None):
        from bertdist.train.precision import autocast_dtype

        self.cfg, self.teacher, self.origin = cfg, teacher, origin or {}
        self.generators: dict[str, torch.Generator] = {}
        dtype = autocast_dtype(precision)
        self._autocast = (lambda: torch.autocast(device_type, dtype=getattr(torch, dtype))) if dtype else \
            contextlib.nullcontext
        self._student_hidden = self._teacher_hidden = None
        if cfg.alpha_hidden_cos:
            self._student_hidden = _LastHidden(student.bert)
            self._teacher_hidden = _LastHidden(teacher.bert)

    @torch.no_grad()
    def teacher_forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The teacher's MLM logits at the rows the student predicts (the same masked positions)."""
        inputs = {k: v for k, v in batch.items() if k != "next_sentence_label"}
        with self._autocast():
            return self.teacher(**inputs).prediction_logits

    def __call__(self, out: PreTrainingOutput, batch: dict[str, torch.Tensor]) -> ObjectiveOutput:
        teacher_logits = self.teacher_forward(batch)
        s_hidden = t_hidden = None
        if self._student_hidden is not None:
            s_hidden, t_hidden = self._student_hidden.take(), self._teacher_hidden.take()
        out = combined_loss(self.cfg, out, teacher_logits, s_hidden, t_hidden, batch.get("attention_mask"))
        parts = {n: getattr(out, n) for n in ("mlm_loss", "nsp_loss", "mlm_kl", "hidden_cos")
                 if getattr(out, n) is not None}
        return ObjectiveOutput(out.loss, parts, {**mlm_counts(out), **nsp_counts(out, batch)}, out)

    def eval_sums(self, out: PreTrainingOutput, batch: dict[str, torch.Tensor]) -> dict:
        return mlm_eval_sums(out, batch)  # held out: the student's own MLM and NSP

    def evaluation(self):
        return contextlib.nullcontext()

    def describe(self) -> str:
        c, origin = self.cfg, self.origin
        return (f"general distillation from {c.teacher} ({origin.get('kind', '?')}): loss = {c.alpha_mlm_kl} x "
                f"T^2 KL (T={c.temperature}) + {c.alpha_mlm_ce} x MLM CE + {c.alpha_hidden_cos} x hidden cos + "
                f"{c.alpha_nsp} x NSP")


def build_objective(cfg: TrainConfig, student: nn.Module, device: torch.device, kernels=None
                    ) -> tuple[GeneralDistillation, LoadedTeacher]:
    """The objective of a run with a ``distill`` section, its teacher loaded on ``device``."""
    teacher = load_teacher(cfg, device, kernels)
    return GeneralDistillation(cfg.distill, student, teacher.model, cfg.deepspeed.precision, device.type,
                               teacher.origin), teacher


def from_config(cfg: TrainConfig, student: nn.Module, device: torch.device, rank: int = 0) -> GeneralDistillation:
    """The objective of a run with a ``distill`` section (bertdist/train/objective.py: OBJECTIVES)."""
    return build_objective(cfg, student, device)[0]
