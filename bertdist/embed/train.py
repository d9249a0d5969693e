"""Training bi-encoders (``embed``, ``sts``) and cross-encoders (``rerank``): ``run_embed(cfg)``.

* ``embed``: MNRL over (query, positive, hard negatives); the other rows' positives and negatives
  in the batch are negatives too. Under DeepSpeed data parallel the embeddings of every rank are
  gathered with their gradients (``bertdist.embed.gather``), so each query is ranked against the
  global batch. Batches never hold one text twice (a repeated positive would be its own query's
  negative). Optional Matryoshka widths; optional distillation from a teacher (``distill.py``).
* ``sts``: CoSENT (or cosine MSE against score / 5) on STS-B's scored pairs.
* ``rerank``: a cross-encoder over (query, positive) and (query, negative) pairs: listwise softmax
  over 1 positive + k negatives, or pointwise BCE.

Hard negatives: a row's listed negatives first, topped up to ``num_negatives`` from a mined set
(``hard_negatives: DIR``, or ``mine: bm25`` mined here over the distinct positives of the train
file and saved under ``OUT/negatives``). Rows listing more than ``num_negatives`` get a fresh
sample each epoch.

Evaluation on the dev file before training, after every epoch and every ``eval_every`` steps
(``evaluate.py``); the best evaluation's weights are what ``save_model`` writes, and
``early_stopping_patience`` stops after that many evaluations without a better main metric.
Outputs under ``output_dir``: ``config.yaml`` (the resolved config), ``metrics.json`` and, with
``save_model``, ``model/`` (``export.py``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from bertdist.config import save_config
from bertdist.embed.config import EmbedConfig, check_config, resolved_loss, resolved_mine, resolved_negatives
from bertdist.embed.data import PairExample, read_pairs, read_scored_pairs, read_stsb
from bertdist.embed.evaluate import (MAIN_METRIC, build_rerank_dev, build_retrieval_dev, rerank_eval, retrieval_eval,
                                     sts_eval)
from bertdist.embed.model import BiEncoder, CrossEncoder, forward_by_length, load_bi_encoder, load_cross_encoder
from bertdist.finetune.errors import DataError
from bertdist.finetune.train import apply_update, build_optimization, seed_everything
from bertdist.train.distributed import local_device, process_group, rank_and_world, start_process_group


# ---------------------------------------------------------------- data
@dataclasses.dataclass
class TrainData:
    rows: list  # PairExample (embed, rerank) or ScoredPair (sts), sliced to max_train_examples
    all_rows: list  # every row of the train file (the mined corpus is built from all of them)
    train_path: Path
    dev: list | None
    dev_path: Path | None


def _find(data_dir: str, override: str | None, names: tuple[str, ...], what: str, required: bool) -> Path | None:
    if override:
        p = Path(override)
        if not p.is_file():
            raise DataError(f"{p}: {what} file not found")
        return p
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"data directory not found: {d}")
    for n in names:
        if (d / n).is_file():
            return d / n
    if required:
        raise DataError(f"{d}: no {what} file (looked for {list(names)})")
    return None


def _read(task: str, path: Path) -> list:
    if task != "sts":
        return read_pairs(path)
    return read_scored_pairs(path) if path.suffix.lower() == ".jsonl" else read_stsb(path)


def load_data(cfg: EmbedConfig) -> TrainData:
    names = {"sts": (("train.tsv",), ("dev.tsv",))}.get(cfg.task, (("train.jsonl", "train.tsv"),
                                                                   ("dev.jsonl", "dev.tsv")))
    train_path = _find(cfg.data, cfg.train_file, names[0], "train", True)
    dev_path = _find(cfg.data, cfg.dev_file, names[1], "dev", False)
    all_rows = _read(cfg.task, train_path)
    rows = all_rows[:cfg.max_train_examples] if cfg.max_train_examples else all_rows
    dev = None
    if dev_path is not None:
        dev = _read(cfg.task, dev_path)
        dev = dev[:cfg.max_eval_examples] if cfg.max_eval_examples else dev
    return TrainData(rows, all_rows, train_path, dev, dev_path)


# ---------------------------------------------------------------- hard negatives
def positives_corpus(rows: list[PairExample]) -> list[str]:
    """The distinct positives of ``rows``, in order of first appearance: the corpus a set mined
    from a train file's own positives indexes (a prefix of the rows gives a prefix of it)."""
    return list(dict.fromkeys(r.positive for r in rows))


def _read_corpus_file(path: Path) -> list[str]:
    """A corpus a mined set names: JSONL rows with a "text" key, or one passage per line."""
    from bertdist.finetune.errors import not_utf8

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    if path.suffix.lower() != ".jsonl":
        return [x for x in lines if x.strip()]
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); a corpus JSONL has one "
                            '{"text": ...} per line') from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise DataError(f"{path}:{n}: expected an object with a \"text\" string")
        out.append(row["text"])
    return out


def _mine(cfg: EmbedConfig, data: TrainData, out: Path, rank: int, barrier) -> Path:
    """Mine BM25 negatives for every train row (rank 0) and write the set under OUT/negatives."""
    from bertdist.retrieval.bm25 import mine_hard_negatives, write_negative_set

    set_dir = out / "negatives"
    if rank == 0:
        corpus = positives_corpus(data.all_rows)
        index = {t: i for i, t in enumerate(corpus)}
        by_query: dict[str, set[int]] = {}
        for r in data.all_rows:
            by_query.setdefault(r.query, set()).add(index[r.positive])
        k = resolved_negatives(cfg)
        mined = mine_hard_negatives([r.query for r in data.rows], [sorted(by_query[r.query]) for r in data.rows],
                                    corpus, k, skip_top=cfg.mine_skip_top, depth=cfg.mine_depth or k,
                                    margin=cfg.mine_margin)
        write_negative_set(set_dir, mined, {"queries": data.train_path, "corpus": data.train_path})
    if barrier is not None:
        barrier()
    return set_dir


def _mined_negatives(set_dir: str | Path, data: TrainData) -> tuple[dict[int, list[str]], dict]:
    """Row index -> mined negative texts from a set made for this train file."""
    from bertdist.data.manifest import file_sha256
    from bertdist.retrieval.bm25 import NegativeSetMismatch, read_negative_set

    mined = read_negative_set(set_dir, {"queries": data.train_path})
    recorded = {s["role"]: s for s in mined.manifest.get("sources", [])}
    corpus_src = recorded.get("corpus")
    if corpus_src is None or corpus_src["sha256"] == recorded["queries"]["sha256"]:
        corpus = positives_corpus(data.all_rows)
    else:
        cpath = Path(corpus_src["path"])
        if not cpath.is_file():
            raise DataError(f"{Path(set_dir) / 'manifest.json'}: the set's corpus file {cpath} is not there")
        if file_sha256(cpath) != corpus_src["sha256"]:
            raise NegativeSetMismatch(f"{Path(set_dir) / 'manifest.json'}: mined from the corpus file {cpath} with "
                                      f"sha256 {corpus_src['sha256']}, but it now has sha256 {file_sha256(cpath)}")
        corpus = _read_corpus_file(cpath)
    out: dict[int, list[str]] = {}
    for r in mined.rows:
        if r.query_index >= len(data.rows):
            continue
        bad = [d for d in r.negative_ids if not 0 <= d < len(corpus)]
        if bad:
            raise DataError(f"{Path(set_dir) / 'negatives.parquet'}: query {r.query_index} names documents {bad[:5]} "
                            f"outside its corpus of {len(corpus)} texts")
        out[r.query_index] = [corpus[d] for d in r.negative_ids]
    info = {"set": str(set_dir), "method": mined.method.get("name"), "k": mined.k, "window": mined.window,
            "counts": mined.counts}
    return out, info


def row_negatives(cfg: EmbedConfig, data: TrainData, out: Path, rank: int, barrier) -> tuple[list[list[str]], dict]:
    """Each train row's negative pool: its listed negatives, then mined ones up to num_negatives;
    never the row's positive nor a positive of another row with the same query."""
    k = resolved_negatives(cfg)
    mine = resolved_mine(cfg)
    set_dir = cfg.hard_negatives
    if mine == "bm25":
        set_dir = _mine(cfg, data, out, rank, barrier)
    mined, info = ({}, {"set": None})
    if set_dir is not None:
        mined, info = _mined_negatives(set_dir, data)
    positives: dict[str, set[str]] = {}
    for r in data.all_rows:
        positives.setdefault(r.query, set()).add(r.positive)
    pools, listed, topped, without = [], 0, 0, 0
    for i, r in enumerate(data.rows):
        own = [n for n in dict.fromkeys(r.negatives) if n not in positives[r.query]]
        pool = list(own)
        if len(pool) < k:
            extra = [n for n in mined.get(i, []) if n not in positives[r.query] and n not in pool]
            pool += extra[:k - len(pool)]
            topped += bool(extra)
        listed += bool(own)
        without += not pool
        pools.append(pool)
    info.update(num_negatives=k, mine=mine, rows=len(data.rows), rows_with_listed_negatives=listed,
                rows_with_mined_negatives=topped, rows_without_negatives=without)
    return pools, info


# ---------------------------------------------------------------- batches
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


def _rank_share(batch: list[int], rank: int, world: int) -> list[int]:
    """Rank r's rows of a global batch: every world-th one; a batch is cut to a multiple of world so
    every rank gets as many rows (collectives need them all)."""
    if world == 1:
        return batch
    batch = batch[:len(batch) - len(batch) % world]
    return batch[rank::world]


# ---------------------------------------------------------------- losses
def mnrl_loss(q: torch.Tensor, p: torch.Tensor, n: torch.Tensor | None, cfg: EmbedConfig) -> torch.Tensor:
    """MNRL over the global batch (every rank's positives and negatives, gathered with their
    gradients), summed over the Matryoshka widths (one width: the full one)."""
    from bertdist.embed.gather import all_gather_with_grad, gathered_sizes
    from bertdist.embed.losses import mnrl

    if process_group():
        sizes = gathered_sizes(q.shape[0], q.device)
        offset = sum(sizes[:torch.distributed.get_rank()])
        all_p = all_gather_with_grad(p)
        all_q = all_gather_with_grad(q) if cfg.symmetric else q
        # Every rank joins the negatives' gather, with zero rows when it has none.
        all_n = all_gather_with_grad(n if n is not None else q[:0])
        all_n = all_n if all_n.shape[0] else None
    else:
        offset, all_p, all_q, all_n = 0, p, q, n
    dims = cfg.matryoshka_dims or [q.shape[1]]
    weights = cfg.matryoshka_weights or [1.0] * len(dims)
    total = None
    for d, w in zip(dims, weights):
        term = w * mnrl(q[:, :d], all_p[:, :d], None if all_n is None else all_n[:, :d], offset, cfg.scale,
                        cfg.symmetric, queries=all_q[:, :d] if cfg.symmetric else None)
        total = term if total is None else total + term
    return total


class Trainer:
    """One family's forward + loss over a rank's share of a batch of units."""

    def __init__(self, cfg: EmbedConfig, model, loss: str, distill: dict | None):
        self.cfg, self.model, self.loss, self.distill = cfg, model, loss, distill or {}
        self.k = resolved_negatives(cfg)

    def _autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16" and not self.ds)

    def _embed(self, fwd, texts: list[str], **kw) -> torch.Tensor:
        device = next(self.model.parameters()).device

        def one(batch):
            with self._autocast(device):
                return fwd(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], full_width=True, **kw)

        return forward_by_length(one, self.model.features(texts, self.cfg.max_seq_length), self.cfg.length_groups,
                                 device)

    def step_loss(self, fwd, units: list[dict], rng: random.Random) -> torch.Tensor:
        self.ds = fwd is not self.model
        if self.cfg.task == "sts":
            return self._sts(fwd, units)
        if self.cfg.task == "rerank":
            return self._rerank(fwd, units, rng)
        return self._retrieval(fwd, units, rng)

    def _negatives(self, u: dict, rng: random.Random) -> list[str]:
        pool = u["negs"]
        return list(pool) if len(pool) <= self.k else rng.sample(pool, self.k)

    def _retrieval(self, fwd, units, rng) -> torch.Tensor:
        negs = [self._negatives(u, rng) for u in units]
        flat = [n for ns in negs for n in ns]
        qs, ps = [u["q"] for u in units], [u["p"] for u in units]
        b = len(units)
        kind = self.distill.get("loss")
        kw = {"normalize": self.distill["teacher_normalize"]} if kind == "embedding_mse" else {}
        # Queries and passages in separate forwards, each padded to its own longest: padding short
        # queries to passage length doubled a MiniLM step at seq 256 (5.0 s against 2.6 s).
        q = self._embed(fwd, qs, **kw)
        d = self._embed(fwd, ps + flat, **kw)
        p, n = d[:b], (d[b:] if flat else None)
        if kind is None:
            return mnrl_loss(q, p, n, self.cfg)
        from bertdist.embed.distill import embedding_mse, margin_mse

        if kind == "margin_mse":
            margin = torch.tensor([u["margin"] for u in units], dtype=torch.float32)
            loss = margin_mse(q, p, n, margin, self.cfg.scale)
        else:
            vecs = self.distill["vectors"]
            target = torch.from_numpy(np.stack([vecs[u["tq"]] for u in units] + [vecs[u["tp"]] for u in units]))
            loss = embedding_mse(torch.cat([q, p]), target)
        w = self.cfg.distill_task_weight
        return loss + w * mnrl_loss(q, p, n, self.cfg) if w > 0 else loss

    def _sts(self, fwd, units) -> torch.Tensor:
        from bertdist.embed.losses import CoSENTLoss, CosineMSELoss, MatryoshkaLoss

        b = len(units)
        e = self._embed(fwd, [u["a"] for u in units] + [u["b"] for u in units])
        scores = torch.tensor([u["score"] for u in units], dtype=torch.float32, device=e.device)
        base = CoSENTLoss(self.cfg.scale) if self.loss == "cosent" else CosineMSELoss()
        if self.loss == "cosine_mse":
            scores = scores / 5.0  # STS-B's 0-5 to the cosine's scale
        if self.cfg.matryoshka_dims:
            return MatryoshkaLoss(base, self.cfg.matryoshka_dims, self.cfg.matryoshka_weights or None)(
                e[:b], e[b:], scores=scores)
        return base(e[:b], e[b:], scores)

    def _rerank(self, fwd, units, rng) -> torch.Tensor:
        from bertdist.embed.losses import binary_ce, listwise_softmax_loss

        groups = [[u["p"]] + self._negatives(u, rng) for u in units]
        width = max(len(g) for g in groups)
        pairs = [(u["q"], c) for u, g in zip(units, groups) for c in g]
        device = next(self.model.parameters()).device

        def one(batch):
            with self._autocast(device):
                return fwd(batch)[0].reshape(-1)

        logits = forward_by_length(one, self.model.features(pairs, self.cfg.max_seq_length), self.cfg.length_groups,
                                   device)
        # [groups, 1 + k] with the positive in column 0; rows with fewer negatives are masked
        mask = torch.tensor([[j < len(g) for j in range(width)] for g in groups], device=device)
        scores = logits.float().new_zeros(mask.shape).masked_scatter(mask, logits.float().reshape(-1))
        if self.loss == "listwise":
            return listwise_softmax_loss(scores.masked_fill(~mask, float("-inf")))
        labels = torch.zeros_like(scores)
        labels[:, 0] = 1.0
        return binary_ce(scores[mask], labels[mask])


# ---------------------------------------------------------------- units
def make_units(cfg: EmbedConfig, data: TrainData, pools: list[list[str]] | None) -> list[dict]:
    """The training examples: sts pairs; retrieval/rerank rows with their negative pools. ``texts``:
    what a batch must not hold twice."""
    if cfg.task == "sts":
        return [{"a": r.text_a, "b": r.text_b, "score": r.score, "texts": frozenset()} for r in data.rows]
    units = []
    for r, pool in zip(data.rows, pools):
        units.append({"q": r.query, "p": r.positive, "negs": pool, "texts": frozenset([r.query, r.positive, *pool])})
    return units


# ---------------------------------------------------------------- the run
def build_model(cfg: EmbedConfig, device: torch.device, loss: str):
    common = dict(max_seq_length=cfg.max_seq_length, kernels=cfg.kernels, hidden_dropout_prob=cfg.hidden_dropout_prob,
                  vocab_file=cfg.vocab_file, do_lower_case=cfg.do_lower_case, device=device)
    if cfg.task == "rerank":
        return load_cross_encoder(cfg.checkpoint, activation="sigmoid" if loss == "bce" else "identity", **common)
    model = load_bi_encoder(cfg.checkpoint, pooling=None if cfg.pooling == "auto" else cfg.pooling,
                            normalize=cfg.normalize, truncate_dim=cfg.truncate_dim, **common)
    if cfg.matryoshka_dims and max(cfg.matryoshka_dims) > model.full_dim:
        raise DataError(f"matryoshka_dims {cfg.matryoshka_dims} exceed the embedding width {model.full_dim} of "
                        f"{cfg.checkpoint}")
    return model


NEW_HEAD_RATE = 20.0  # x learning_rate: a new cross-encoder head's default rate


def head_learning_rate(model: torch.nn.Module, cfg: EmbedConfig) -> float | None:
    """The cross-encoder head's rate (pooler + classifier); None for a bi-encoder."""
    if not isinstance(model, CrossEncoder):
        return None
    if cfg.head_learning_rate is not None:
        return cfg.head_learning_rate
    trained = model.origin.get("format") == "cross-encoder"
    return cfg.learning_rate if trained else NEW_HEAD_RATE * cfg.learning_rate


def grouped_parameters(named_parameters, weight_decay: float, head_lr: float | None = None,
                       is_head=lambda name: name.startswith(("classifier.", "bert.pooler."))) -> list[dict]:
    """AdamW groups over ``(name, parameter)`` pairs: no weight decay on biases and LayerNorm; with
    ``head_lr``, the parameters ``is_head`` names at that rate (the others at the optimizer's)."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in named_parameters:
        if p.requires_grad:
            head = head_lr is not None and is_head(name)
            groups.setdefault((head, name.endswith("bias") or "LayerNorm" in name), []).append(p)
    return [{"params": params, "weight_decay": 0.0 if no_decay else weight_decay,
             **({"lr": head_lr} if head else {})}
            for (head, no_decay), params in sorted(groups.items())]


def param_groups(model: torch.nn.Module, cfg: EmbedConfig) -> list[dict]:
    """Our AdamW groups: a cross-encoder's head at its own rate."""
    return grouped_parameters(model.named_parameters(), cfg.weight_decay, head_learning_rate(model, cfg))


def _dev_set(cfg: EmbedConfig, dev: list):
    if cfg.task == "sts":
        return dev
    if cfg.task == "embed":
        return build_retrieval_dev(dev)
    return build_rerank_dev(dev, cfg.rerank_candidates)


def evaluate(cfg: EmbedConfig, model, dev) -> dict:
    if cfg.task == "sts":
        return sts_eval(model, dev, cfg.eval_batch_size, cfg.max_seq_length)
    if cfg.task == "embed":
        return retrieval_eval(model, dev, cfg.eval_batch_size, cfg.max_seq_length)
    return rerank_eval(model, dev, cfg.eval_batch_size, cfg.max_seq_length)


def _broadcast(value: float, device: torch.device) -> float:
    """Rank 0's value on every rank: every rank must take the same early-stopping decision."""
    if not process_group():
        return value
    t = torch.tensor([value], dtype=torch.float64,
                     device=device if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.broadcast(t, 0)
    return float(t.item())


def run_embed(cfg: EmbedConfig) -> dict:
    """Train (see the module doc), write the outputs, return the metrics JSON as a dict."""
    check_config(cfg)
    if cfg.deepspeed:
        start_process_group(deepspeed=True)
    rank, world = rank_and_world()
    barrier = torch.distributed.barrier if process_group() else None
    if cfg.batch_size % world:
        raise DataError(f"batch_size {cfg.batch_size} is not divisible by the {world} processes")
    out = Path(cfg.output_dir)
    loss_name = resolved_loss(cfg)
    data = load_data(cfg)
    if not data.rows:
        raise DataError(f"{data.train_path}: no training rows")
    if cfg.early_stopping_patience and data.dev is None:
        raise DataError(f"early_stopping_patience={cfg.early_stopping_patience} needs a dev set, but {cfg.data} has no "
                        "dev file (dev.jsonl; sts: dev.tsv) and dev_file is not set")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    if barrier is not None:
        barrier()
    seed_everything(cfg.seed)
    device = local_device(cfg.device)
    model = build_model(cfg, device, loss_name)

    negatives_info, pools = None, None
    if cfg.task != "sts":
        pools, negatives_info = row_negatives(cfg, data, out, rank, barrier)
    units = make_units(cfg, data, pools)
    distill, distill_info = None, None
    if cfg.distill_from:
        from bertdist.embed import distill as distill_mod

        units, distill, distill_info = _prepare_distillation(cfg, model, units, data, out, rank, barrier, device,
                                                             distill_mod)
    if cfg.task == "rerank" and loss_name == "listwise":
        kept = [u for u in units if u["negs"]]
        if negatives_info is not None:
            negatives_info["rows_skipped_without_negatives"] = len(units) - len(kept)
        if not kept:
            raise DataError(f"{data.train_path}: no row has a negative to rank its positive against (listwise loss); "
                            "list negatives in the rows, set mine=bm25, or use loss=bce")
        units = kept

    dev = _dev_set(cfg, data.dev) if data.dev else None
    micro = cfg.batch_size // world
    no_dup = cfg.task == "embed"
    # Batches without repeated texts can outnumber len(units) / batch_size: count epoch 0's.
    per_epoch = max(1, sum(1 for b in epoch_batches(units, cfg.batch_size, epoch_rng(cfg, 0), no_dup)
                           if _rank_share(b, 0, world)))
    total = cfg.max_steps if cfg.max_steps is not None else max(1, math.ceil(per_epoch * cfg.epochs))
    engine, opt, sched = build_optimization(model, cfg, param_groups(model, cfg), cfg.learning_rate, micro, total)
    fwd = engine if engine is not None else model
    trainer = Trainer(cfg, model, loss_name, distill)
    main_metric = MAIN_METRIC[cfg.task]

    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=f"{cfg.task} ({loss_name})", disable=not cfg.progress or rank != 0, dynamic_ncols=True)
    state = {"best": None, "bad": 0, "stop": False, "eval_seconds": 0.0, "best_state": None, "last_eval_step": -1}
    evals: list[dict] = []

    def do_eval(step: int, epoch: int, initial: bool = False) -> None:
        t = time.time()
        metrics = evaluate(cfg, model, dev) if rank == 0 else {}
        score = _broadcast(metrics.get(main_metric, 0.0), device)
        model.train()
        state["eval_seconds"] += time.time() - t
        state["last_eval_step"] = step
        record = {"step": step, "epoch": epoch, "metrics": metrics}
        evals.append(record)
        if initial:
            return
        if state["best"] is None or score > state["best"]["score"]:
            state["best"], state["bad"] = {**record, "score": score}, 0
            if cfg.save_model and rank == 0:
                state["best_state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        else:
            state["bad"] += 1
            if cfg.early_stopping_patience and state["bad"] >= cfg.early_stopping_patience:
                state["stop"] = True

    t0 = time.time()
    if dev is not None:
        do_eval(0, 0, initial=True)
    step, epoch, losses = 0, 0, []
    model.train()
    while step < total and not state["stop"]:
        rng = epoch_rng(cfg, epoch)
        for batch in epoch_batches(units, cfg.batch_size, rng, no_dup):
            mine = _rank_share(batch, rank, world)
            if not mine:
                continue
            loss = trainer.step_loss(fwd, [units[i] for i in mine], rng)
            apply_update(engine, opt, sched, loss, [p for p in model.parameters() if p.requires_grad],
                         cfg.max_grad_norm)
            step += 1
            losses.append(float(loss.item()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if dev is not None and cfg.eval_every and step % cfg.eval_every == 0:
                do_eval(step, epoch + 1)
            if step >= total or state["stop"]:
                break
        epoch += 1
        if dev is not None and state["last_eval_step"] != step:
            do_eval(step, epoch)
    bar.close()
    seconds = time.time() - t0
    train_seconds = seconds - state["eval_seconds"]

    summary = {
        "task": cfg.task, "loss": loss_name, "checkpoint": cfg.checkpoint,
        "checkpoint_origin": getattr(model, "origin", None), "main_metric": main_metric,
        "train_file": str(data.train_path), "dev_file": str(data.dev_path) if data.dev_path else None,
        "train_rows": len(data.rows), "train_units": len(units), "dev_rows": len(data.dev) if data.dev else 0,
        "world_size": world, "deepspeed": {"zero_stage": cfg.zero_stage} if cfg.deepspeed else None,
        "global_batch_size": cfg.batch_size, "gathered_negatives": world > 1 and cfg.task == "embed",
        "initial": evals[0] if evals else None, "evals": evals[1:] if evals else [],
        "best": state["best"], "stopped_early": state["stop"], "steps": step, "planned_steps": total,
        "epochs_run": epoch, "seconds": round(seconds, 3), "train_seconds": round(train_seconds, 3),
        "eval_seconds": round(state["eval_seconds"], 3),
        "seconds_per_step": round(train_seconds / max(1, step), 5), "loss_curve": loss_curve(losses),
        "negatives": negatives_info, "distill": distill_info,
        "model": {"pooling": model.pooling, "normalize": model.normalize, "dim": model.dim,
                  "max_seq_length": cfg.max_seq_length} if isinstance(model, BiEncoder)
        else {"activation": model.activation, "max_seq_length": cfg.max_seq_length,
              "head_learning_rate": head_learning_rate(model, cfg)},
    }
    if rank == 0:
        if cfg.save_model:
            if state["best_state"] is not None:
                model.load_state_dict(state["best_state"])
            summary["model_dir"] = str(_export(model, out / "model", cfg))
        (out / "metrics.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def epoch_rng(cfg: EmbedConfig, epoch: int) -> random.Random:
    return random.Random(cfg.seed * 1_000_003 + epoch)  # the same batches on every rank


def loss_curve(losses: list[float], points: int = 100) -> list[dict]:
    """The training loss averaged over up to ``points`` equal windows of steps."""
    if not losses:
        return []
    size = max(1, math.ceil(len(losses) / points))
    return [{"step": i + min(size, len(losses) - i), "loss": float(np.mean(losses[i:i + size]))}
            for i in range(0, len(losses), size)]


def _export(model, path: Path, cfg: EmbedConfig) -> Path:
    from bertdist.embed.export import write_bi_encoder, write_cross_encoder

    if isinstance(model, CrossEncoder):
        return write_cross_encoder(path, model, cfg.max_seq_length)
    return write_bi_encoder(path, model, cfg.max_seq_length)


# ---------------------------------------------------------------- distillation
def _prepare_distillation(cfg: EmbedConfig, model: BiEncoder, units: list[dict], data: TrainData, out: Path, rank: int,
                          barrier, device, dm) -> tuple[list[dict], dict, dict]:
    """The teacher's stored outputs for this run's units (computed once), and the units to train
    on: triples for margin-MSE, rows for embedding MSE."""
    loss = dm.resolve_distill_loss(cfg.distill_loss, cfg.distill_from)
    set_dir = Path(cfg.distill_set) if cfg.distill_set else out / "teacher_scores"
    sources = {"train": data.train_path}
    if loss == "margin_mse":
        triples = [(u["q"], u["p"], n) for u in units for n in u["negs"][:resolved_negatives(cfg)]]
        if not triples:
            raise DataError(f"{data.train_path}: margin-MSE distillation needs (query, positive, negative) "
                            f"triples, but none of the {len(units)} rows has a negative; list negatives in the rows, "
                            "set mine=bm25 or hard_negatives=DIR")
        teacher = load_cross_encoder(cfg.distill_from, kernels=cfg.kernels, device=device)
        plan = dm.make_plan(loss, dm.teacher_identity(teacher, cfg.distill_from), sources, triples)
        table, manifest = dm.open_or_make(
            set_dir, plan, lambda: dm.margin_scores(teacher, triples, cfg.eval_batch_size), rank, barrier)
        margins = np.asarray(table["teacher_positive"], np.float32) - np.asarray(table["teacher_negative"], np.float32)
        new_units = [{"q": q, "p": p, "negs": [n], "margin": float(m), "texts": frozenset([q, p, n])}
                     for (q, p, n), m in zip(triples, margins)]
        info = {"loss": loss, "teacher": cfg.distill_from, "teacher_kind": "cross-encoder", "set": str(set_dir),
                "reused": manifest["reused"], "triples": len(triples),
                "rows_without_negatives": sum(not u["negs"] for u in units),
                "teacher_margin_mean": float(margins.mean()), "teacher_margin_std": float(margins.std())}
        del teacher
        return new_units, {"loss": loss}, info
    teacher = load_bi_encoder(cfg.distill_from, kernels=cfg.kernels, device=device)
    texts = list(dict.fromkeys([u["q"] for u in units] + [u["p"] for u in units]))
    plan = dm.make_plan(loss, dm.teacher_identity(teacher, cfg.distill_from), sources, [(t,) for t in texts])
    table, manifest = dm.open_or_make(set_dir, plan, lambda: dm.teacher_embeddings(teacher, texts, cfg.eval_batch_size),
                                      rank, barrier)
    vectors = np.asarray(table["embedding"], dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[0] != len(texts):
        raise DataError(f"{set_dir}: embeddings of shape {vectors.shape}, expected {len(texts)} rows of one width")
    index = {t: i for i, t in enumerate(table["text"])}
    teacher_dim, teacher_norm = vectors.shape[1], teacher.normalize
    del teacher
    projection = None
    if model.projection is None and teacher_dim != model.full_dim:
        from bertdist.model.bert import init_weights

        model.projection = torch.nn.Linear(model.config.hidden_size, teacher_dim).to(device)
        init_weights(model.projection, model.config.initializer_range)
        projection = [model.config.hidden_size, teacher_dim]
    elif model.full_dim != teacher_dim:
        raise DataError(f"the student {cfg.checkpoint} embeds into {model.full_dim} dimensions (its Dense module), the "
                        f"teacher {cfg.distill_from} into {teacher_dim}")
    if cfg.truncate_dim and cfg.truncate_dim > model.full_dim:
        raise DataError(f"truncate_dim {cfg.truncate_dim} is wider than the student's {model.full_dim} dimensions")
    for u in units:
        u["tq"], u["tp"] = index[u["q"]], index[u["p"]]
    info = {"loss": loss, "teacher": cfg.distill_from, "teacher_kind": "bi-encoder", "set": str(set_dir),
            "reused": manifest["reused"], "texts": len(texts), "teacher_dim": teacher_dim,
            "teacher_normalize": teacher_norm, "projection": projection}
    return units, {"loss": loss, "vectors": vectors, "teacher_normalize": teacher_norm}, info
