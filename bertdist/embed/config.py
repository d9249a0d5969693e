"""EmbedConfig: the schema of embedding, STS and re-ranking training (YAML instances in configs/embed/).

``task`` picks the family: ``embed`` (a bi-encoder for retrieval, contrastive loss with in-batch
and hard negatives), ``sts`` (a bi-encoder for semantic similarity, trained on scored pairs) or
``rerank`` (a cross-encoder scoring (query, passage) pairs). Keys shared with ``finetune``
(``epochs``, ``batch_size``, ``learning_rate``, ``max_seq_length``, ``save_model``, ...) mean the
same there and here. Defaults follow sentence-transformers' recipes: AdamW at 2e-5, 10% linear
warmup, one epoch, mean pooling with L2 normalisation, MNRL at scale 20 (temperature 0.05).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from bertdist.config import ConfigError

TASKS = ("embed", "sts", "rerank")
# The losses each family accepts; the first is the default (`loss: auto`).
LOSSES = {"embed": ("mnrl",), "sts": ("cosent", "cosine_mse"), "rerank": ("listwise", "bce")}
DEFAULT_NEGATIVES = {"embed": 1, "rerank": 7}


@dataclasses.dataclass
class EmbedConfig:
    task: Literal["embed", "sts", "rerank"] = "embed"
    # Our run / checkpoint, a torch-format dir, an HF dir, a sentence-transformers dir, or a
    # bi-encoder / cross-encoder directory this command wrote (OUT/model).
    checkpoint: str = ""
    data: str = ""  # embed, rerank: train.jsonl (+ dev.jsonl); sts: GLUE STS-B train.tsv/dev.tsv
    output_dir: str = "runs/embed"
    vocab_file: str | None = None  # the data tokenizer's vocab; default: the checkpoint's
    do_lower_case: bool | None = None  # default: the checkpoint's casing
    kernels: Literal["reference", "fused", "auto"] = "auto"
    device: str = "auto"  # auto | cpu | cuda
    precision: Literal["fp32", "bf16"] = "fp32"

    max_seq_length: int = 128  # per text (bi-encoders) or per (query, passage) pair (rerank)
    batch_size: int = 32  # global: under DeepSpeed the ranks' batches together; embed: the in-batch negatives
    eval_batch_size: int = 64
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs when set
    learning_rate: float = 2e-5
    # rerank: the rate of the pooler and classifier. None: 20 x learning_rate for a new head (a
    # randomly initialised head at the encoder's rate leaves the loss at chance for many steps),
    # learning_rate for a cross-encoder's own trained head.
    head_learning_rate: float | None = None
    warmup_ratio: float = 0.1  # linear from 0 over ceil(ratio x steps), then linear to 0 (as transformers)
    weight_decay: float = 0.01
    adam_epsilon: float = 1e-6
    max_grad_norm: float = 1.0
    hidden_dropout_prob: float | None = None  # None: keep the checkpoint's
    seed: int = 42
    # Each training forward runs its texts sorted by length in up to this many groups, each padded to
    # its own longest and holding at least 1,024 real tokens (1: one batch padded to the longest
    # text). Same loss, far less padding.
    length_groups: int = 4
    max_train_examples: int | None = None  # the first N rows of the train file
    max_eval_examples: int | None = None  # the first N rows of the dev file
    train_file: str | None = None  # default: DATA/train.jsonl (sts: DATA/train.tsv)
    dev_file: str | None = None  # default: DATA/dev.jsonl (sts: DATA/dev.tsv) when present

    # --- the bi-encoder (embed, sts) ---
    # mean | cls | max; auto: the checkpoint's own (a sentence-transformers dir) else mean.
    pooling: Literal["auto", "mean", "cls", "max"] = "auto"
    normalize: bool | None = None  # L2-normalise the embeddings; None: the checkpoint's, else true
    truncate_dim: int | None = None  # serve the first d dimensions (a Matryoshka-trained model); export too

    # --- the loss ---
    # embed: mnrl; sts: cosent | cosine_mse; rerank: listwise | bce. auto: the first of its family.
    loss: Literal["auto", "mnrl", "cosent", "cosine_mse", "listwise", "bce"] = "auto"
    scale: float = 20.0  # MNRL and CoSENT: cosine similarities times scale (1 / temperature)
    symmetric: bool = False  # MNRL: also rank each positive against the batch's queries
    matryoshka_dims: list[int] = dataclasses.field(default_factory=list)  # e.g. [768, 256, 64]; empty: off
    matryoshka_weights: list[float] = dataclasses.field(default_factory=list)  # one per dim; empty: all 1

    # --- hard negatives (embed, rerank) ---
    num_negatives: int | None = None  # per query and step; None: embed 1, rerank 7
    hard_negatives: str | None = None  # a mined set's directory (negatives.parquet + manifest.json)
    # Mine BM25 negatives at the start for the rows that list none, and save the set under
    # OUT/negatives. auto: bm25 for rerank, none for embed.
    mine: Literal["auto", "none", "bm25"] = "auto"
    mine_skip_top: int = 0  # skip the first N BM25 hits that are not the positive (likely false negatives)
    mine_depth: int | None = None  # take negatives from the next N hits; None: num_negatives
    mine_margin: float | None = None  # keep a hit only when its score <= (1 - margin) x the positive's

    # --- evaluation and early stopping ---
    eval_every: int | None = None  # also evaluate every N optimizer steps (always after each epoch)
    early_stopping_patience: int | None = None  # stop after N evaluations without a better dev score
    rerank_candidates: int = 20  # rerank dev: BM25 top N over the dev positives for queries that list no negatives

    # --- distillation (embed) ---
    # A teacher: a cross-encoder directory (margin-MSE on (query, positive, negative) triples) or a
    # bi-encoder (MSE between the student's and the teacher's embeddings). None: off.
    distill_from: str | None = None
    distill_loss: Literal["auto", "margin_mse", "embedding_mse"] = "auto"  # auto: by the teacher's kind
    distill_set: str | None = None  # where the teacher's scores / embeddings are stored; default: OUT/teacher_scores
    distill_task_weight: float = 0.0  # add this weight x the MNRL loss to the distillation loss

    # DeepSpeed (data parallel over the launched processes; ZeRO stage 0-2)
    deepspeed: bool = False
    zero_stage: int = 0

    progress: bool = True
    save_model: bool = False  # write OUT/model: a sentence-transformers dir (embed, sts) or an HF cross-encoder


def resolved_loss(cfg: EmbedConfig) -> str:
    return LOSSES[cfg.task][0] if cfg.loss == "auto" else cfg.loss


def resolved_negatives(cfg: EmbedConfig) -> int:
    return cfg.num_negatives if cfg.num_negatives is not None else DEFAULT_NEGATIVES.get(cfg.task, 0)


def resolved_mine(cfg: EmbedConfig) -> str:
    if cfg.mine != "auto":
        return cfg.mine
    return "bm25" if cfg.task == "rerank" and cfg.hard_negatives is None else "none"


def check_config(cfg: EmbedConfig) -> EmbedConfig:
    """Refuse combinations the schema's types cannot: a loss of another family, negatives for
    STS, Matryoshka for a cross-encoder, bounds. Every message names the keys and values."""
    loss = resolved_loss(cfg)
    if loss not in LOSSES[cfg.task]:
        raise ConfigError(f"loss={cfg.loss!r} is not a {cfg.task} loss; {cfg.task} takes {list(LOSSES[cfg.task])} "
                          f"(or auto = {LOSSES[cfg.task][0]})")
    if cfg.task == "sts":
        for key in ("hard_negatives", "num_negatives"):
            if getattr(cfg, key) is not None:
                raise ConfigError(f"{key}={getattr(cfg, key)!r}: sts trains on scored pairs and takes no negatives")
        if cfg.mine == "bm25":
            raise ConfigError("mine='bm25': sts trains on scored pairs and takes no negatives")
    if cfg.task == "rerank":
        bi_only = {"matryoshka_dims": cfg.matryoshka_dims, "truncate_dim": cfg.truncate_dim,
                   "symmetric": cfg.symmetric or None}
        bad = {k: v for k, v in bi_only.items() if v}
        if bad:
            raise ConfigError(f"{bad}: bi-encoder settings, but task=rerank trains a cross-encoder")
        if cfg.pooling not in ("auto",) or cfg.normalize is not None:
            raise ConfigError(f"pooling={cfg.pooling!r}, normalize={cfg.normalize!r}: a cross-encoder scores "
                              "[CLS]'s pooled output; leave pooling auto and normalize unset for task=rerank")
    if cfg.distill_from is not None and cfg.task != "embed":
        raise ConfigError(f"distill_from={cfg.distill_from!r}: distillation trains a retrieval bi-encoder "
                          f"(task=embed), not task={cfg.task}")
    if cfg.hard_negatives is not None and cfg.mine == "bm25":
        raise ConfigError(f"hard_negatives={cfg.hard_negatives!r} and mine='bm25': use a mined set or mine "
                          "one, not both")
    positive = {"max_seq_length": cfg.max_seq_length, "batch_size": cfg.batch_size, "length_groups": cfg.length_groups,
                "eval_batch_size": cfg.eval_batch_size, "rerank_candidates": cfg.rerank_candidates}
    for key in ("max_steps", "eval_every", "early_stopping_patience", "num_negatives", "truncate_dim", "mine_depth"):
        if getattr(cfg, key) is not None:
            positive[key] = getattr(cfg, key)
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be at least 1, got {value}")
    if cfg.epochs <= 0 and cfg.max_steps is None:
        raise ConfigError(f"epochs must be positive (or set max_steps), got {cfg.epochs}")
    if not cfg.scale > 0:
        raise ConfigError(f"scale must be positive (it is 1 / temperature), got {cfg.scale}")
    if cfg.mine_skip_top < 0:
        raise ConfigError(f"mine_skip_top must be >= 0, got {cfg.mine_skip_top}")
    if cfg.mine_depth is not None and cfg.mine_depth < resolved_negatives(cfg):
        raise ConfigError(f"mine_depth={cfg.mine_depth} is less than num_negatives={resolved_negatives(cfg)}: "
                          "the window must hold the negatives it gives")
    if cfg.mine_margin is not None and not 0.0 <= cfg.mine_margin < 1.0:
        raise ConfigError(f"mine_margin must be in [0, 1), got {cfg.mine_margin}")
    if cfg.matryoshka_weights and len(cfg.matryoshka_weights) != len(cfg.matryoshka_dims):
        raise ConfigError(f"{len(cfg.matryoshka_weights)} matryoshka_weights {cfg.matryoshka_weights} for "
                          f"{len(cfg.matryoshka_dims)} matryoshka_dims {cfg.matryoshka_dims}: one weight per dim")
    if any(d < 1 for d in cfg.matryoshka_dims) or len(set(cfg.matryoshka_dims)) != len(cfg.matryoshka_dims):
        raise ConfigError(f"matryoshka_dims {cfg.matryoshka_dims} must be distinct positive widths")
    if cfg.zero_stage not in (0, 1, 2):
        # Evaluation and best-model snapshots read full parameters on every rank; ZeRO-3 shards them.
        raise ConfigError(f"zero_stage={cfg.zero_stage}: embedding training supports ZeRO stages 0-2")
    if cfg.head_learning_rate is not None and cfg.task != "rerank":
        raise ConfigError(f"head_learning_rate={cfg.head_learning_rate}: only a cross-encoder (task=rerank) has a "
                          f"head; task={cfg.task} trains the encoder alone")
    if cfg.head_learning_rate is not None and not cfg.head_learning_rate > 0:
        raise ConfigError(f"head_learning_rate must be positive, got {cfg.head_learning_rate}")
    if cfg.distill_task_weight < 0:
        raise ConfigError(f"distill_task_weight must be >= 0, got {cfg.distill_task_weight}")
    return cfg


def load_embed_config(path: str | None = None, overrides: list[str] = ()) -> EmbedConfig:
    """Schema + optional YAML instance + dotted overrides, then the cross-key checks."""
    from bertdist.config import load_config

    return check_config(load_config(EmbedConfig, path, list(overrides)))
