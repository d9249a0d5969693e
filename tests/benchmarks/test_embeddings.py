"""benchmarks/embeddings.py: the re-ranker's training groups, the peer's optimizer settings and the
STS-B verdict over seeds (pure helpers; nothing is trained)."""
import argparse
import types

import pytest

pytest.importorskip("bm25s")


@pytest.fixture(scope="module")
def embeddings(load_benchmark):
    return load_benchmark("embeddings")


def _split(n_paragraphs: int, per_paragraph: int):
    words = ["harbour", "castle", "river", "mill", "abbey", "market", "bridge", "forest", "tower", "field"]
    pairs, pids = [], []
    for p in range(n_paragraphs):
        text = " ".join(f"{words[p % len(words)]} {words[(p * 3 + k) % len(words)]} story{p}" for k in range(6))
        for q in range(per_paragraph):
            pairs.append((f"which {words[p % len(words)]} story{p} {q}?", text))
            pids.append(f"a{p // 4}_{p}")
    return types.SimpleNamespace(raw=types.SimpleNamespace(train_pairs=pairs, train_paragraph_ids=pids))


def test_rerank_negatives_are_other_sampled_questions_positives(embeddings):
    split = _split(40, 5)  # 200 questions over 40 paragraphs
    args = argparse.Namespace(seed=3, rerank_train=60, negatives=3)
    groups = embeddings.rerank_groups(split, args)
    assert 50 <= len(groups) <= 60
    positives = {g["positive"] for g in groups}
    # sampled across the train half, not its first articles
    assert len(positives) > 25
    for g in groups:
        assert len(g["negatives"]) == 3 and g["positive"] not in g["negatives"]
        # a passage shown as a negative is some sampled question's positive: no passage-only shortcut
        assert set(g["negatives"]) <= positives
    assert groups == embeddings.rerank_groups(split, args)  # seeded


def test_the_peer_trains_with_our_optimizer_settings(embeddings):
    from bertdist.embed.config import EmbedConfig

    c = EmbedConfig()
    assert embeddings.peer_optimizer() == {"weight_decay": c.weight_decay, "adam_epsilon": c.adam_epsilon,
                                           "max_grad_norm": c.max_grad_norm, "warmup_steps": c.warmup_ratio}


def test_the_sts_verdict_compares_medians_and_reports_the_spread(embeddings):
    res = {"stsb": {"ours": 82.0, "st": 82.3, "ours_runs": [81.0, 82.0, 82.4], "st_runs": [82.3, 82.1, 83.0],
                    "seeds": [1, 2, 3]}}
    (line,) = embeddings.verdicts(res)
    assert "medians over 3 seeds: 82.00 vs sentence-transformers 82.30 (-0.30 points; target >= -0.5: met)" in line
    assert "spread of either is 1.40" in line
    res["stsb"]["ours"] = 81.7
    assert "(-0.60 points; target >= -0.5: NOT met)" in embeddings.verdicts(res)[0]


def test_the_aligned_runs_start_from_a_copy_without_dropout(embeddings, tmp_path):
    import json

    base = tmp_path / "base"
    base.mkdir()
    cfg = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "hidden_size": 8}
    (base / "config.json").write_text(json.dumps(cfg))
    (base / "vocab.txt").write_text("[PAD]\n")
    out = embeddings.no_dropout_copy(str(base), tmp_path / "copy")
    assert json.loads((out / "config.json").read_text()) == {**cfg, "hidden_dropout_prob": 0.0,
                                                             "attention_probs_dropout_prob": 0.0}
    assert (out / "vocab.txt").read_text() == "[PAD]\n"
    assert json.loads((base / "config.json").read_text()) == cfg  # the user's base is untouched
    lines = embeddings.aligned_lines({"steps": 125, "order_seed": 42, "ours": 78.7721, "st": 78.7719,
                                      "dev_pairs": 1500, "max_abs_cosine_difference": 3.58e-7})
    assert "ours 78.772, sentence-transformers 78.772; the largest difference between their 1500 dev cosines " \
           "is 3.6e-07" in lines[2]


def test_the_peer_head_optimizer_matches_ours(embeddings):
    """--st-head-rate: the peer's pooler and classifier at the multiple, every other parameter at the
    base rate, no weight decay on biases and LayerNorm, as our trainer's groups."""
    torch = pytest.importorskip("torch")

    class Peer(torch.nn.Module):  # named like sentence-transformers' CrossEncoder over BERT
        def __init__(self):
            super().__init__()
            self.model = torch.nn.ModuleDict({
                "bert": torch.nn.ModuleDict({"encoder": torch.nn.Linear(4, 4), "LayerNorm": torch.nn.LayerNorm(4),
                                             "pooler": torch.nn.ModuleDict({"dense": torch.nn.Linear(4, 4)})}),
                "classifier": torch.nn.Linear(4, 1)})

    peer = Peer()
    opt = embeddings.st_head_optimizer(peer, 1e-4, 20.0)
    lr = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    got = {n: lr[id(p)] for n, p in peer.named_parameters()}
    assert got == {"model.bert.encoder.weight": (1e-4, 0.01), "model.bert.encoder.bias": (1e-4, 0.0),
                   "model.bert.LayerNorm.weight": (1e-4, 0.0), "model.bert.LayerNorm.bias": (1e-4, 0.0),
                   "model.bert.pooler.dense.weight": (2e-3, 0.01), "model.bert.pooler.dense.bias": (2e-3, 0.0),
                   "model.classifier.weight": (2e-3, 0.01), "model.classifier.bias": (2e-3, 0.0)}
    with pytest.raises(ValueError, match="no pooler or classifier"):
        embeddings.st_head_optimizer(torch.nn.Linear(2, 2), 1e-4, 20.0)


def test_the_rerank_report_without_a_peer_or_a_bi_encoder(embeddings):
    """--skip retrieval rerank-peer: our row alone, the bi-encoder columns marked not run, and a
    verdict that names the missing peer."""
    counts = {"train_articles": 24, "train_pairs_used": 5397, "eval_articles": 24, "eval_questions_used": 600,
              "eval_queries": 5173, "eval_paragraphs": 1044}
    res = {"counts": counts, "seconds": 10.0, "bm25": {}, "rerank": {
        "groups": 5000, "negatives": 3, "ours": {"bm25_top20": {"before": 87.9, "after": 92.0}, "steps": 625,
                                                 "seconds_per_step": 3.2, "head_learning_rate": 2e-3}}}
    args = argparse.Namespace(threads=2, rerank_questions=300, rerank_lr=1e-4, st_head_rate=None)
    text = embeddings.report(res, args)
    assert "| bertdist (listwise) | 87.9 | 92.0 | not run | not run | 625 | 3.20 |" in text
    assert "sentence-transformers CrossEncoder" not in text and "no sentence-transformers peer in this run" in text
    assert "87.9 -> 92.0 (+4.1; target >= 4.0: met); no sentence-transformers peer in this run" in text


def test_the_listwise_peer_scores_each_group_as_ours_does(embeddings):
    """--st-rerank-loss listwise: one n-tuple row a group (query, positive, its negatives in order), so a
    step of 8 rows holds the 8 groups of one of ours; the report names the peer's loss."""
    groups = [{"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}a", f"n{i}b", f"n{i}c"]} for i in range(5)]
    cols = embeddings.listwise_columns(groups)
    assert list(cols) == ["query", "positive", "negative_1", "negative_2", "negative_3"]
    assert [cols[c][3] for c in cols] == ["q3", "p3", "n3a", "n3b", "n3c"]
    counts = {"train_articles": 24, "train_pairs_used": 2400, "eval_articles": 24, "eval_questions_used": 600,
              "eval_queries": 5173, "eval_paragraphs": 1044}
    row = {"bm25_top20": {"before": 87.9, "after": 90.0}, "steps": 300, "seconds_per_step": 3.0}
    res = {"counts": counts, "seconds": 1.0, "bm25": {}, "rerank": {
        "groups": 2400, "negatives": 3, "ours": {**row, "head_learning_rate": 2e-3},
        "st": {**row, "bm25_top20": {"before": 87.9, "after": 89.5}}}}
    for loss, name in (("listwise", "(listwise: its MultipleNegativesRankingLoss, raw logits, + 1 in-batch negative)"),
                       ("bce", "(BCE, pos_weight)")):
        args = argparse.Namespace(threads=2, rerank_questions=300, rerank_lr=1e-4, st_head_rate=None,
                                  st_rerank_loss=loss)
        text = embeddings.report(res, args)
        assert f"| sentence-transformers CrossEncoder {name} | 87.9 | 89.5 |" in text
        assert "87.9 -> 90.0 (+2.1; target >= 4.0: NOT met); sentence-transformers' 89.5" in text


def test_the_own_encoder_report_states_its_epochs(embeddings):
    """--own-epochs: the own encoder's section says how long it trained when that differs from the
    base's epochs, and its rows carry its own steps."""
    counts = {"train_articles": 24, "train_pairs_used": 2400, "eval_articles": 24, "eval_questions_used": 600,
              "eval_queries": 5173, "eval_paragraphs": 1044}
    scores = {"ndcg@10": 3.7, "recall@1": 0.7, "recall@5": 5.3, "recall@20": 11.5, "mrr@10": 2.5}
    own = {"checkpoint": "runs/mini", "seq": 128, "lr": 5e-4, "epochs": 4.0, "untrained": scores,
           "trained": {**scores, "ndcg@10": 18.5, "steps": 300, "seconds_per_step": 0.97}}
    args = argparse.Namespace(threads=2, epochs=1.0)
    text = embeddings.report({"counts": counts, "seconds": 1.0, "bm25": {}, "own": own}, args)
    assert "at seq 128 and learning rate 0.0005, the same train pairs and batch as above, 4 epochs." in text
    assert "| bertdist (MNRL) | 18.5 | 0.7 | 5.3 | 11.5 | 2.5 | 300 | 0.97 |" in text
    text = embeddings.report({"counts": counts, "seconds": 1.0, "bm25": {}, "own": {**own, "epochs": 1.0}}, args)
    assert "the same train pairs and batch as above, the same steps." in text


def test_a_reused_rerank_run_must_hold_train_half_questions_only(embeddings, tmp_path, monkeypatch):
    """--rerank-model: a finished run is re-used only when every question it trained on is a
    train-half question, and the report says it was not trained in this run."""
    import json

    split = _split(4, 2)
    run = tmp_path / "ours-rerank"
    (run / "model").mkdir(parents=True)
    train = tmp_path / "train.jsonl"
    rows = [{"query": q, "positive": p, "negatives": ["x"]} for q, p in split.raw.train_pairs[:3]]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "metrics.json").write_text(json.dumps({"task": "rerank", "train_file": str(train), "train_rows": 3}))
    (run / "config.yaml").write_text("learning_rate: 0.0001\nnum_negatives: 3\n")
    loaded = []
    monkeypatch.setattr("bertdist.embed.model.load_cross_encoder", lambda d: loaded.append(d) or "model")
    model, summary, read = embeddings.reuse_rerank(run, split)
    assert model == "model" and loaded == [run / "model"]
    assert summary["learning_rate"] == 1e-4 and summary["num_negatives"] == 3 and read == rows
    train.write_text(train.read_text() + json.dumps({"query": "an eval-half question?", "positive": "p"}) + "\n")
    with pytest.raises(SystemExit, match="1 rows of .* \\(first: line 4\\) are not train-half questions"):
        embeddings.reuse_rerank(run, split)
    (run / "metrics.json").write_text(json.dumps({"task": "embed", "train_file": str(train)}))
    with pytest.raises(SystemExit, match="task is 'embed', not 'rerank'"):
        embeddings.reuse_rerank(run, split)
    counts = {"train_articles": 24, "train_pairs_used": 5397, "eval_articles": 24, "eval_questions_used": 600,
              "eval_queries": 5173, "eval_paragraphs": 1044}
    res = {"counts": counts, "seconds": 1.0, "bm25": {}, "rerank": {
        "groups": 5397, "negatives": 3, "learning_rate": 1e-4, "reused": str(run),
        "ours": {"bm25_top20": {"before": 87.9, "after": 92.7}, "steps": 1350, "seconds_per_step": 5.3,
                 "head_learning_rate": 2e-3}}}
    text = embeddings.report(res, argparse.Namespace(threads=2, rerank_questions=300, rerank_lr=5e-5,
                                                     st_head_rate=None))
    assert f"Ours: the finished run `{run}`, not trained in this run" in text
    assert "Learning rate 0.0001;" in text


def test_the_peer_of_a_reused_run_trains_on_its_groups(embeddings, tmp_path):
    import json

    split = _split(40, 5)
    args = argparse.Namespace(seed=3, rerank_train=60, negatives=3)
    groups = embeddings.rerank_groups(split, args)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(g) + "\n" for g in groups))
    theirs = [json.loads(line) for line in train.read_text().splitlines()]
    embeddings.same_groups(train, theirs, groups, args)  # the same groups: accepted
    other = embeddings.rerank_groups(split, argparse.Namespace(seed=4, rerank_train=60, negatives=3))
    with pytest.raises(SystemExit, match=r"differs from the \d+ groups of --rerank-train 60 --negatives 3 --seed 3 "
                                         r"\(first at group \d+\)"):
        embeddings.same_groups(train, theirs, other, args)
    with pytest.raises(SystemExit, match="first at group 11"):
        embeddings.same_groups(train, theirs, groups[:10], args)


def test_a_missing_peer_library_stops_the_run_before_any_part_runs(embeddings, monkeypatch):
    real = embeddings.importlib.util.find_spec
    monkeypatch.setattr(embeddings.importlib.util, "find_spec",
                        lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(SystemExit, match=r"peer of retrieval, sts, rerank needs datasets.*--skip retrieval sts rerank-peer"):
        embeddings.check_peer_installed([])
    with pytest.raises(SystemExit, match=r"peer of sts needs datasets"):
        embeddings.check_peer_installed(["retrieval", "rerank-peer"])
    with pytest.raises(SystemExit, match=r"peer of sts needs datasets"):  # before the base model or any data is read
        embeddings.main(["--out", "x.md", "--skip", "retrieval", "rerank"])
    embeddings.check_peer_installed(["retrieval", "sts", "rerank-peer"])  # no peer to train: runs
    embeddings.check_peer_installed(["retrieval", "sts", "rerank"])


def test_paired_differences_are_ours_minus_the_peer_seed_by_seed(embeddings):
    d = embeddings.paired_differences([81.0, 82.0, 83.0, 80.0], [82.0, 81.5, 83.5, 81.0])
    assert d["differences"] == pytest.approx([-1.0, 0.5, -0.5, -1.0])
    assert d["mean"] == pytest.approx(-0.5) and d["median"] == pytest.approx(-0.75)
    assert d["ours_ahead"] == 1 and d["n"] == 4
    # squared deviations from the mean 0.25 + 1 + 0 + 0.25 = 1.5: sample variance 0.5, over 4 seeds
    assert d["standard_error"] == pytest.approx(0.5 ** 0.5 / 2)
    assert d["t_test_p"] == pytest.approx(0.2522, abs=1e-3)  # t = -0.5 / 0.3536 = -1.414, 3 df
    assert 0 < d["wilcoxon_p"] <= 1
    res = {"stsb": {"ours": 81.5, "st": 81.75, "ours_runs": [81.0, 82.0, 83.0, 80.0],
                    "st_runs": [82.0, 81.5, 83.5, 81.0], "seeds": [1, 2, 3, 4], "paired": d}}
    assert "ours minus the peer averages -0.50 (standard error 0.35)" in embeddings.verdicts(res)[0]
    (line, _) = embeddings.paired_lines(d)
    assert line.startswith("Seed by seed, ours minus sentence-transformers: -1.00, +0.50, -0.50, -1.00. Mean -0.50")
    assert "ours ahead on 1 of 4" in line


def test_the_peer_trains_on_the_batches_our_sts_trainer_draws(embeddings, shared_data, tmp_path, monkeypatch):
    """--sts-order shared: the order handed to the peer's batch sampler is, epoch by epoch, the one
    `bertdist finetune sts` trains on for the same seed (recorded from a real run of ours)."""
    pytest.importorskip("sentence_transformers")
    import bertdist.embed.train as ours_train
    from tests.embed import fixtures

    ckpt = fixtures.tiny_checkpoint(tmp_path / "ckpt", shared_data / "vocab" / "bert-base-uncased-vocab.txt")
    drawn = []

    def recording(units, batch_size, rng, no_duplicates):
        batches = epoch_batches(units, batch_size, rng, no_duplicates)
        drawn.append(batches)
        return batches

    epoch_batches = ours_train.epoch_batches
    monkeypatch.setattr(ours_train, "epoch_batches", recording)
    monkeypatch.setattr(embeddings, "SHARED", shared_data)
    args = argparse.Namespace(sts_batch=8, lr=1e-4)
    rows, seed = 36, 7  # 5 batches an epoch, the last of 4
    summary = embeddings.run_ours_sts(args, tmp_path / "ours", str(ckpt), rows, steps=10, seed=seed)
    assert summary["steps"] == 10
    trained = drawn[1:]  # the first call only counts an epoch's batches
    assert len(trained) == 2 and trained[0] != trained[1]
    order = embeddings.sts_order(rows, 8, seed)
    assert [order(0), order(1)] == trained
    assert embeddings.sts_order(rows, 8, seed + 1)(0) != trained[0]

    sampler = embeddings.order_sampler(order)(list(range(rows)), batch_size=8, drop_last=False)
    assert list(sampler) == trained[0] and len(sampler) == 5
    sampler.set_epoch(1)
    assert list(sampler) == trained[1]
