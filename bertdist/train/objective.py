"""The pretraining objective: one protocol for what the trainer does with a model's output.

An objective turns the model's output on a micro-batch into an ``ObjectiveOutput``: the loss the
backward runs on, its unweighted parts (logged as per-step means: ``mlm_loss``, ``nsp_loss``,
``disc_loss``, ``mlm_kl``, ``hidden_cos``) and the counts the metrics are ratios of
(``mlm_correct``/``mlm_count``, ...). Besides, each objective has

* ``generators``: its named ``torch.Generator`` streams (ELECTRA's sampling), which every
  checkpoint saves beside the global RNG states and a resume restores (checkpoint.py, restore.py);
* ``eval_sums``: the held-out sums of one batch (``step.EVAL_FIELDS``), and ``evaluation()``, the
  context an evaluation runs in (ELECTRA draws its replacements from a fixed seed there);
* ``without_nsp``: why it trains without the NSP labels some records carry, or None;
* ``describe()``: the line the trainer logs.

Which objective a run trains with follows from its config's objective sections
(``config.OBJECTIVE_SECTIONS``: ``distill``, ``electra``; none of them: ``MaskedLM``, MLM plus NSP
where the model has the head and the records the label), looked up in ``OBJECTIVES``. What a
resume and a new phase must match is checked here, for every objective alike
(``check_checkpoint``): a resume the same objective sections, a new phase the same model family
and architecture, but for the fields the family lets a new phase change.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from pathlib import Path
from typing import Any, Protocol

import torch

from bertdist.config import ConfigError, to_dict
from bertdist.model.config import IGNORE_INDEX
from bertdist.model.families import family_of
from bertdist.train.config import OBJECTIVE_SECTIONS, TrainConfig, model_config_of


@dataclasses.dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # what the backward runs on
    parts: dict[str, torch.Tensor]  # unweighted loss parts, logged as per-step means
    counts: dict[str, Any]  # device tensors (or host numbers) summed over the micro-batches and ranks
    output: Any = None  # the model's output, with ``loss`` the objective's


class Objective(Protocol):
    generators: dict[str, torch.Generator]
    without_nsp: str | None

    def __call__(self, out, batch: dict[str, torch.Tensor]) -> ObjectiveOutput: ...

    def eval_sums(self, out, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def evaluation(self) -> contextlib.AbstractContextManager: ...

    def describe(self) -> str: ...


def mlm_counts(out) -> dict[str, torch.Tensor]:
    """Correct and counted masked positions (device tensors, no sync)."""
    labels = out.mlm_labels
    keep = labels != IGNORE_INDEX
    return {"mlm_correct": ((out.prediction_logits.argmax(-1) == labels) & keep).sum(), "mlm_count": keep.sum()}


def nsp_counts(out, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """NSP (or SOP) correct and count where the batch has the label and the model the head."""
    if "next_sentence_label" not in batch or getattr(out, "seq_relationship_logits", None) is None:
        return {}
    return {"nsp_correct": (out.seq_relationship_logits.argmax(-1) == batch["next_sentence_label"]).sum(),
            "nsp_count": batch["next_sentence_label"].numel()}


def mlm_eval_sums(out, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The held-out MLM and NSP sums of one batch."""
    import torch.nn.functional as F

    logits = out.prediction_logits.float()
    sums = {"mlm_loss_sum": F.cross_entropy(logits.reshape(-1, logits.shape[-1]), out.mlm_labels.reshape(-1),
                                            ignore_index=IGNORE_INDEX, reduction="sum").double(),
            **mlm_counts(out), **nsp_counts(out, batch)}
    if "nsp_count" in sums:
        sums["nsp_loss_sum"] = F.cross_entropy(out.seq_relationship_logits.float(), batch["next_sentence_label"],
                                               reduction="sum").double()
    return sums


def _parts(out, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {n: getattr(out, n) for n in names if getattr(out, n, None) is not None}


class MaskedLM:
    """Masked-LM pretraining, plus NSP (or SOP) where the model has the head and the records the
    label: the model's own loss, unweighted (BERT, ModernBERT). It draws no random numbers."""

    def __init__(self, cfg: TrainConfig):
        m = cfg.model_config
        self.family = family_of(m)
        self.has_nsp_head = self.family.nsp_head
        self.without_nsp = None if self.has_nsp_head else f"{self.family.name} has no NSP head"
        self.generators = {}

    def __call__(self, out, batch: dict[str, torch.Tensor]) -> ObjectiveOutput:
        return ObjectiveOutput(out.loss, _parts(out, ("mlm_loss", "nsp_loss")),
                               {**mlm_counts(out), **nsp_counts(out, batch)}, out)

    def eval_sums(self, out, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        return mlm_eval_sums(out, batch)

    def evaluation(self):
        return contextlib.nullcontext()

    def describe(self) -> str:
        return (f"objective: masked LM{' + NSP where the records carry the label' if self.has_nsp_head else ''} "
                f"({self.family.name})")


# objective section (None: none set) -> "module:function"(cfg, model, device, rank) building its objective
OBJECTIVES = {
    None: "bertdist.train.objective:masked_lm",
    "distill": "bertdist.train.distill_objective:from_config",
    "electra": "bertdist.train.electra_objective:from_config",
}


def masked_lm(cfg: TrainConfig, model, device: torch.device, rank: int = 0) -> MaskedLM:
    return MaskedLM(cfg)


def objective_section(cfg: TrainConfig) -> str | None:
    """The objective section a config sets (TrainConfig allows one at most), or None."""
    return next((name for name, section in cfg.objective_sections.items() if section is not None), None)


def build_objective(cfg: TrainConfig, model, device: torch.device, rank: int = 0) -> Objective:
    """The objective of ``cfg``'s run, applied to ``model``'s outputs on ``device``."""
    module, name = OBJECTIVES[objective_section(cfg)].split(":")
    return getattr(importlib.import_module(module), name)(cfg, model, device, rank)


def saved_run_config(load_dir: Path, tag: str) -> dict | None:
    """The resolved config saved in a checkpoint (``bertdist_config.yaml``), or None."""
    import yaml

    from bertdist.train.checkpoint import CONFIG_FILE

    path = Path(load_dir) / tag / CONFIG_FILE
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else None


def check_checkpoint(cfg: TrainConfig, load_dir: Path, tag: str, mode: str) -> None:
    """A resume continues the objective it was saved with: each objective section of the checkpoint
    (none, or every field) must be this config's. A new phase (``checkpoint.init_from``, mode
    "init") needs the same model family and architecture, but for the fields the family lets a new
    phase change (ModernBERT: the context and the global RoPE base); the objective may change
    within the family (new loss weights)."""
    saved = saved_run_config(load_dir, tag)
    if saved is None:
        return
    where = Path(load_dir) / tag
    if mode == "resume":
        for name, section in cfg.objective_sections.items():
            theirs, ours = saved.get(name), to_dict(section) if section is not None else None
            if theirs != ours:
                raise ConfigError(f"cannot resume from {where}: its {name} section differs from this config's "
                                  f"(checkpoint {theirs}, config {ours}); resume with the same {name} section, or "
                                  f"start a new phase from it with checkpoint.init_from")
        return
    try:
        theirs = model_config_of(saved)
    except ConfigError as e:
        raise ConfigError(f"checkpoint.init_from {where}: its saved config does not describe a model: {e}") from None
    ours = cfg.model_config
    ft, fo = family_of(theirs), family_of(ours)
    fields = [f for f in fo.arch_fields if f not in fo.phase_fields]
    differ = [f"{f}: checkpoint {getattr(theirs, f)}, config {getattr(ours, f)}" for f in fields
              if ft is fo and getattr(theirs, f) != getattr(ours, f)]
    if ft is not fo or differ:
        may = f" (a new phase may change {', '.join(fo.phase_fields)})" if fo.phase_fields else ""
        raise ConfigError(f"cannot start a new phase from {where}: it holds {ft.describe(theirs)}, this config trains "
                          f"{fo.describe(ours)}" + (f"; {'; '.join(differ)}" if differ else "")
                          + f"; the weights must fit the model{may}")
