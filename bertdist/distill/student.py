"""The student, from a spec:

* ``layers:K``: K of the teacher's layers, evenly spread with the first and the last included
  (``default_layer_map``: 6 of 12 -> 0, 2, 4, 7, 9, 11), with the teacher's embeddings and pooler:
  DistilBERT's initialisation;
* ``preset:NAME``: one of our presets (tiny, mini, base, large), randomly initialised, with the
  teacher's vocabulary size and position count;
* a path: our run or checkpoint, a torch-format or Hugging Face directory (e.g. a ``mini`` we
  pretrained, or one made by general distillation, or an ELECTRA discriminator); its vocabulary
  must be the teacher's.

The task head is copied from the teacher wherever the shapes match (always for ``layers:K``);
otherwise it starts fresh. BERT's, ELECTRA's and ModernBERT's task heads differ in form, so a
student of another family than its teacher starts with a fresh head. A ModernBERT ``layers:K``
student keeps its own global/local layer pattern (every ``global_attn_every_n_layers``-th layer
from 0), so a copied layer may attend globally where the teacher's attended locally: the copy is
an initialisation, as DistilBERT's is. ``preset:NAME`` takes the teacher's family's presets.
"""
from __future__ import annotations

import dataclasses

import torch

from bertdist.distill.losses import default_layer_map
from bertdist.distill.teacher import Teacher
from bertdist.export.encoders import FAMILIES, family_of
from bertdist.export.tokenizer import read_vocab, tokenizer_sha256, vocab_sha256
from bertdist.finetune.errors import DataError
from bertdist.finetune.heads import BertForTask, task_model
from bertdist.model import BertConfig


class StudentSpecError(DataError):
    """A student spec that cannot be built from (or does not fit) the teacher."""


@dataclasses.dataclass
class StudentPlan:
    """How to build the student; ``build()`` makes a fresh copy (one per training run)."""
    spec: str
    config: BertConfig
    backbone_state: dict[str, torch.Tensor] | None  # BertForPreTraining layout; None: random
    head_state: dict[str, torch.Tensor]  # what is copied from the teacher ({} when shapes differ)
    teacher_layers: list[int] | None  # for layers:K, the teacher layer of each student layer
    head_options: dict = dataclasses.field(default_factory=dict)  # the family's head options (ModernBERT's pooling)

    def describe(self) -> dict:
        c = self.config
        return {"spec": self.spec, "layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
                "heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
                "copied_teacher_layers": self.teacher_layers, "head_from_teacher": bool(self.head_state)}

    def build(self, kind: str, num_labels: int, device_type: str, kernels: str | None = None,
              hidden_dropout_prob: float | None = None) -> BertForTask:
        family = family_of(self.config)
        cfg = family.with_dropout(family.with_kernels(self.config, kernels), hidden_dropout_prob)
        model = task_model(cfg, kind, num_labels, device_type=device_type, **self.head_options)
        if self.backbone_state is not None:
            model.load_backbone(self.backbone_state)
        if self.head_state:
            model.load_state_dict({**model.state_dict(), **self.head_state})
        return model


def _layer_state(sd: dict[str, torch.Tensor], teacher_layers: list[int]) -> dict[str, torch.Tensor]:
    """The teacher's state dict with encoder layer ``teacher_layers[i]`` renamed to layer ``i``."""
    out = {}
    prefix = next(f.layer_prefix for f in FAMILIES if any(k.startswith(f.layer_prefix) for k in sd))
    for k, v in sd.items():
        if not k.startswith(prefix):
            out[k] = v
            continue
        n, rest = k[len(prefix):].split(".", 1)
        if int(n) in teacher_layers:
            out[f"{prefix}{teacher_layers.index(int(n))}.{rest}"] = v
    return out


def _head_options(teacher: Teacher, cfg) -> dict:
    """The student's head options: the teacher's (its pooling) when both are of one family."""
    family = family_of(cfg)
    return family.head_options_of(teacher.hf_config) if family is family_of(teacher.config) else {}


def _head_if_shapes_match(teacher: Teacher, cfg: BertConfig, kind: str) -> dict[str, torch.Tensor]:
    if family_of(teacher.config) is not family_of(cfg):
        return {}
    keys = family_of(cfg).head_keys(kind)
    head = {k: teacher.head_state[k].float() for k in keys}
    return head if head[keys[0]].shape[1] == cfg.hidden_size else {}


def check_same_vocab(teacher: Teacher, vocab_file, what: str, tokenizer_files=()) -> None:
    if teacher.vocab_file is None or vocab_file is None and tokenizer_files:  # own tokenizer files (ModernBERT)
        theirs = tokenizer_sha256(vocab_file, tokenizer_files) if (vocab_file or tokenizer_files) else None
        if theirs != teacher.vocab_sha256:
            raise StudentSpecError(f"the student {what}'s tokenizer (sha256 {str(theirs)[:12]}) is not the teacher's "
                                   f"(sha256 {teacher.vocab_sha256[:12]}, {teacher.path})")
        return
    if vocab_file is None:
        raise StudentSpecError(f"the student {what} names no vocab file; the teacher's is {teacher.vocab_file}")
    if vocab_sha256(vocab_file) == vocab_sha256(teacher.vocab_file):
        return
    a, b = read_vocab(teacher.vocab_file), read_vocab(vocab_file)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    at = lambda v: repr(v[first]) if first < len(v) else "(end)"  # noqa: E731
    raise StudentSpecError(
        f"the student's vocabulary differs from the teacher's: teacher {teacher.vocab_file} ({len(a)} tokens, "
        f"sha256 {vocab_sha256(teacher.vocab_file)[:12]}), student {what} {vocab_file} ({len(b)} tokens, sha256 "
        f"{vocab_sha256(vocab_file)[:12]}); first difference at id {first}: {at(a)} vs {at(b)}")


def plan_student(spec: str, teacher: Teacher, kind: str) -> StudentPlan:
    tcfg = teacher.config
    if spec.startswith("layers:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            raise StudentSpecError(f"student {spec!r}: expected layers:K with K an integer") from None
        if not 1 <= k <= tcfg.num_hidden_layers:
            raise StudentSpecError(f"student {spec!r}: K must be in 1..{tcfg.num_hidden_layers} (the teacher's layers)")
        layers = default_layer_map(k, tcfg.num_hidden_layers)
        cfg = dataclasses.replace(tcfg, num_hidden_layers=k, preset="custom")
        sd = _layer_state({k_: v.float() for k_, v in teacher.backbone_state.items()}, layers)
        return StudentPlan(spec, cfg, sd, _head_if_shapes_match(teacher, cfg, kind), layers, _head_options(teacher, cfg))
    if spec.startswith("preset:"):
        name = spec.split(":", 1)[1]
        from bertdist.config import ConfigError

        try:
            cfg = family_of(tcfg).student_preset(name, tcfg)
        except ConfigError as e:
            raise StudentSpecError(f"student {spec!r}: {e}") from None
        return StudentPlan(spec, cfg, None, _head_if_shapes_match(teacher, cfg, kind), None, _head_options(teacher, cfg))
    from bertdist.export.hf import ExportError
    from bertdist.export.safe_load import UnsafeCheckpointError
    from bertdist.export.sources import load_pretrained

    try:
        w = load_pretrained(spec)
    except UnsafeCheckpointError:
        raise  # its message names the file and --trust-checkpoint; "not a loadable checkpoint" would mislead
    except ExportError as e:
        raise StudentSpecError(f"student {spec!r}: not layers:K, preset:NAME or a loadable checkpoint ({e})") from None
    check_same_vocab(teacher, w.vocab_file, spec, w.tokenizer_files)
    if w.config.vocab_size != tcfg.vocab_size:
        raise StudentSpecError(f"student {spec}: {w.config.vocab_size} embedding rows, the teacher has {tcfg.vocab_size}")
    cfg = family_of(w.config).with_kernels(w.config, getattr(tcfg, "kernels", None))
    return StudentPlan(spec, cfg, w.state_dict, _head_if_shapes_match(teacher, cfg, kind), None,
                       _head_options(teacher, cfg))
