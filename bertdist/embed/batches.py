"""Training units and their batches: what a batch must not hold twice, shuffled global batches
drawn the same on every rank, and each rank's share of one."""
from __future__ import annotations

import random

from bertdist.embed.config import EmbedConfig
from bertdist.embed.data import TrainData


def make_units(cfg: EmbedConfig, data: TrainData, pools: list[list[str]] | None) -> list[dict]:
    """The training examples: sts pairs; retrieval/rerank rows with their negative pools. ``texts``:
    what a batch must not hold twice."""
    if cfg.task == "sts":
        return [{"a": r.text_a, "b": r.text_b, "score": r.score, "texts": frozenset()} for r in data.rows]
    units = []
    for r, pool in zip(data.rows, pools):
        units.append({"q": r.query, "p": r.positive, "negs": pool, "texts": frozenset([r.query, r.positive, *pool])})
    return units


def epoch_rng(cfg: EmbedConfig, epoch: int) -> random.Random:
    return random.Random(cfg.seed * 1_000_003 + epoch)  # the same batches on every rank


def epoch_batches(units: list[dict], batch_size: int, rng: random.Random, no_duplicates: bool) -> list[list[int]]:
    """Shuffled global batches of ``batch_size`` unit indices; with ``no_duplicates`` no text occurs
    twice in a batch (units that would repeat one wait for a later batch)."""
    order = list(range(len(units)))
    rng.shuffle(order)
    if not no_duplicates:
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    batches, pending = [], order
    while pending:
        batch, seen, later = [], set(), []
        for i in pending:
            texts = units[i]["texts"]
            if len(batch) < batch_size and not (texts & seen):
                batch.append(i)
                seen |= texts
            else:
                later.append(i)
        batches.append(batch)
        pending = later
    return batches


def rank_share(batch: list[int], rank: int, world: int) -> list[int]:
    """Rank r's rows of a global batch: every world-th one; a batch is cut to a multiple of world so
    every rank gets as many rows (collectives need them all)."""
    if world == 1:
        return batch
    batch = batch[:len(batch) - len(batch) % world]
    return batch[rank::world]
