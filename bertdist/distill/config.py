"""DistillConfig: the schema of task distillation (YAML instances in configs/distill/).

The student's training loop is the fine-tuning loop, so its settings (lr, epochs, batch size,
sequence length, DeepSpeed, ...) are a ``FinetuneConfig`` under ``train``; ``task``, ``data`` and
``output_dir`` are set from the top level. Defaults follow DistilBERT/TinyBERT task distillation:
T = 2 on logits, gold labels weighted by ``alpha`` where the row has one.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from bertdist.finetune.config import FinetuneConfig


def _student_train_defaults() -> FinetuneConfig:
    # A student learns from soft targets over many rows: a higher lr than fine-tuning's 3e-5
    # (DistilBERT/TinyBERT task distillation use 5e-5..1e-4) and fewer passes.
    return FinetuneConfig(learning_rate=1e-4, epochs=3.0, max_seq_length=128, predict_test=False, tensorboard=False)


@dataclasses.dataclass
class DistillConfig:
    task: str = "sst2"
    teacher: str = ""  # a fine-tuned task model: `finetune ... save_model=true` output, or an HF task dir
    student: str = "layers:6"  # layers:K | preset:NAME | a checkpoint or HF directory (see student.py)
    data: str = ""  # the task's directory: dev scores the student; train rows, if any, are the labelled rows
    unlabeled: list[str] = dataclasses.field(default_factory=list)  # text, JSONL or task-layout files
    labels_dir: str | None = None  # the pseudo-label set; default: <output_dir>/pseudo_labels
    output_dir: str = "runs/distill"

    temperature: float = 2.0  # softening of both distributions; the KL term is scaled by T^2
    alpha: float = 0.5  # weight of the gold-label loss on rows that have a gold label
    use_labelled_rows: bool = True  # train on the task's own train rows too (KL + alpha * gold loss)
    # TinyBERT intermediate losses (0 = off): hidden-state MSE (through a learned projection when
    # widths differ) and attention-map KL, on the student layers of `layer_map`.
    hidden_weight: float = 0.0
    attention_weight: float = 0.0
    layer_map: list[int] = dataclasses.field(default_factory=list)  # teacher layer per student layer; default: the copied layers
    patience: int | None = None  # early stopping: evaluations without a better dev score before stopping

    # --- pseudo-labelling ---
    shard_rows: int = 4096  # rows per Parquet shard (the unit of resume and of data parallelism)
    label_batch_size: int = 128
    # Store only the teacher's k largest logits (and their indices) per output distribution; null:
    # full logits. Spans: the top-k start and end positions. A distribution with at most k outputs is
    # stored whole; regression refuses it. A student run reads a set with at least its k (or full).
    top_k: int | None = None

    baseline: Literal["none", "direct"] = "none"  # direct: also fine-tune the same student on the labelled rows alone
    direct_epochs: float | None = None  # passes of the direct baseline over its (fewer) rows; None: train.epochs
    bench_repeats: int = 5  # timed repeats for latency and throughput in the report
    bench_seq_length: int = 128
    train: FinetuneConfig = dataclasses.field(default_factory=_student_train_defaults)

    def finetune_config(self, output_dir: str | None = None) -> FinetuneConfig:
        """The fine-tuning loop's settings for this task, data and output directory."""
        return dataclasses.replace(self.train, task=self.task, data=self.data,
                                   output_dir=output_dir or self.output_dir)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def load_distill_config(path: str | None = None, overrides: list[str] = ()) -> DistillConfig:
    """Schema defaults (the student's ``train`` defaults included) + a YAML instance + dotted
    overrides. A partial ``train:`` section keeps the other student defaults instead of falling
    back to fine-tuning's."""
    from bertdist.config import apply_overrides, from_dict, load_yaml, to_dict

    data = to_dict(DistillConfig())
    if path is not None:
        data = _merge(data, load_yaml(path))
    return from_dict(DistillConfig, apply_overrides(DistillConfig, data, list(overrides)))
