"""FinetuneConfig: the fine-tuning schema (YAML instances in configs/finetune/).

Defaults are the BERT paper's recipe: AdamW, batch 32, 3 epochs, 10% linear
warmup, lr picked from {5e-5, 3e-5, 2e-5} (``sweep_learning_rates``).
"""
from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass
class FinetuneConfig:
    task: str = "sst2"
    checkpoint: str = ""  # our run / DeepSpeed checkpoint, a torch-format dir, or an HF dir
    data: str = ""  # the task's directory (e.g. glue/SST-2)
    output_dir: str = "runs/finetune"
    vocab_file: str | None = None  # the data tokenizer's vocab; default: the checkpoint's
    do_lower_case: bool | None = None  # default: the checkpoint's casing
    kernels: Literal["reference", "fused", "auto"] = "auto"
    device: str = "auto"  # auto | cpu | cuda
    precision: Literal["fp32", "bf16"] = "fp32"

    max_seq_length: int = 128
    batch_size: int = 32
    eval_batch_size: int = 64
    epochs: float = 3.0
    max_steps: int | None = None  # overrides epochs when set
    learning_rate: float = 3e-5
    head_learning_rate: float | None = None  # None: same as learning_rate; set higher for the new head
    warmup_ratio: float = 0.1  # linear from 0 over ceil(ratio x steps), then linear to 0 (as transformers)
    weight_decay: float = 0.01
    adam_epsilon: float = 1e-6
    max_grad_norm: float = 1.0
    hidden_dropout_prob: float | None = None  # None: keep the checkpoint's (ModernBERT: its mlp_dropout)
    # ModernBERT's sequence-level heads pool the first token (cls) or the mean of the real tokens,
    # as transformers' classifier_pooling; BERT and ELECTRA heads read [CLS] and ignore this.
    classifier_pooling: Literal["cls", "mean"] = "cls"
    seed: int = 42

    # Small seeded sweep with best-on-dev selection; random restarts re-run each lr with new seeds.
    sweep_learning_rates: list[float] = dataclasses.field(default_factory=list)
    restarts: int = 1

    # Slices (tests, quick demos) and explicit files (e.g. a SQuAD train split made from dev).
    max_train_examples: int | None = None
    max_eval_examples: int | None = None
    train_file: str | None = None
    dev_file: str | None = None
    predict_test: bool = True

    # SQuAD
    doc_stride: int = 128
    max_query_length: int = 64
    n_best: int = 20
    max_answer_length: int = 30
    null_threshold: float = 0.0  # v2.0: predict no answer when null score - best span score > this

    # NER
    ner_scheme: Literal["auto", "IOB1", "IOB2"] = "auto"

    # DeepSpeed (data parallel over the launched processes; ZeRO stage 0-2)
    deepspeed: bool = False
    zero_stage: int = 0

    progress: bool = True
    tensorboard: bool = True
    save_model: bool = False  # write the fine-tuned model as a Hugging Face task-model directory
