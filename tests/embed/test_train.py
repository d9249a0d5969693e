"""Training bi-encoders and cross-encoders end to end on real text, tiny models, CPU.

Retrieval rows come from the bundled books (a sentence of a paragraph against the rest of it,
``fixtures.book_pairs``); STS-B and SQuAD from ../shared/data when present."""
from __future__ import annotations

import dataclasses
import json
import subprocess

import numpy as np
import pytest

from bertdist.embed.config import EmbedConfig
from bertdist.embed.train import run_embed
from bertdist.finetune.errors import DataError
from tests.conftest import child_env, torchrun
from tests.embed import fixtures

FAST = dict(kernels="reference", progress=False, hidden_dropout_prob=0.0, max_seq_length=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return fixtures.tiny_checkpoint(d / "tiny", fixtures.word_vocab(d / "vocab.txt"))


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory):
    return fixtures.retrieval_dir(tmp_path_factory.mktemp("books"), n_train=96, n_dev=32)


def test_embed_learns_to_retrieve_on_book_paragraphs(ckpt, retrieval, tmp_path):
    out = tmp_path / "out"
    s = run_embed(EmbedConfig(task="embed", checkpoint=str(ckpt), data=str(retrieval), output_dir=str(out),
                              batch_size=16, epochs=3, learning_rate=5e-4, save_model=True, **FAST))
    before = s["initial"]["metrics"]["ndcg@10"]
    after = s["best"]["metrics"]["ndcg@10"]
    assert after > before + 0.08, (before, after)
    assert set(s["best"]["metrics"]) >= {"ndcg@10", "recall@1", "recall@5", "recall@20", "mrr@10"}
    assert s["best"]["metrics"]["queries"] == 32 and s["best"]["metrics"]["corpus"] == 32
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 18 and m["seconds_per_step"] > 0 and len(m["evals"]) == 3 and m["main_metric"] == "ndcg@10"
    assert m["loss_curve"][-1]["loss"] < m["loss_curve"][0]["loss"]
    assert "task: embed" in (out / "config.yaml").read_text()
    # the saved model is the best evaluation's: re-evaluated from disk, it scores the same
    from bertdist.embed.evaluate import build_retrieval_dev, retrieval_eval
    from bertdist.embed.data import read_pairs
    from bertdist.embed.model import load_bi_encoder

    dev = build_retrieval_dev(read_pairs(retrieval / "dev.jsonl"))
    again = retrieval_eval(load_bi_encoder(out / "model", kernels="reference"), dev, max_seq_length=64)
    assert again["ndcg@10"] == pytest.approx(after, abs=1e-6)


def test_mined_negatives_are_saved_reused_and_pinned_to_their_file(ckpt, retrieval, tmp_path):
    from bertdist.retrieval.bm25 import NegativeSetMismatch, read_negative_set

    base = dict(task="embed", checkpoint=str(ckpt), data=str(retrieval), batch_size=16, max_steps=2,
                learning_rate=1e-4, num_negatives=2, **FAST)
    first = run_embed(EmbedConfig(output_dir=str(tmp_path / "a"), mine="bm25", mine_skip_top=1, **base))
    neg = first["negatives"]
    assert neg["mine"] == "bm25" and neg["rows_with_mined_negatives"] == 96 and neg["rows_without_negatives"] == 0
    mined = read_negative_set(tmp_path / "a" / "negatives")
    assert mined.k == 2 and mined.window["skip_top"] == 1 and mined.counts["corpus"] == 96
    second = run_embed(EmbedConfig(output_dir=str(tmp_path / "b"), hard_negatives=str(tmp_path / "a" / "negatives"),
                                   **base))
    assert second["negatives"]["rows_with_mined_negatives"] == 96 and second["negatives"]["mine"] == "none"
    # another train file: the set's ids would point at other rows, so it is refused
    other = fixtures.retrieval_dir(tmp_path / "other", n_train=40, n_dev=8)
    with pytest.raises(NegativeSetMismatch, match="sha256"):
        run_embed(EmbedConfig(output_dir=str(tmp_path / "c"), hard_negatives=str(tmp_path / "a" / "negatives"),
                              **{**base, "data": str(other)}))


def test_dev_sets_corpus_relevance_and_candidates():
    from bertdist.embed.data import PairExample
    from bertdist.embed.evaluate import build_rerank_dev, build_retrieval_dev, rank_by_similarity

    rows = [PairExample("who is anne?", "Anne Elliot is the heroine.", ("Sir Walter Elliot is vain.",)),
            PairExample("who is anne?", "Anne is Sir Walter's daughter."),  # the same query, a second positive
            PairExample("where is kellynch?", "Kellynch Hall is in Somersetshire.")]
    dev = build_retrieval_dev(rows)
    assert len(dev.queries) == 2 and len(dev.corpus) == 4  # 3 positives and the listed negative
    anne = dev.queries.index("who is anne?")
    assert {dev.corpus[i] for i in dev.relevant[anne]} == {"Anne Elliot is the heroine.",
                                                          "Anne is Sir Walter's daughter."}
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    c = np.array([[0.0, 2.0], [1.0, 0.1], [1.0, 1.0]])
    assert rank_by_similarity(q, c, 2, chunk=1) == [[1, 2], [0, 2]]
    rr = build_rerank_dev(rows, k=1)
    assert rr.bm25["bm25_queries"] == 1  # only the query that lists no negative needs BM25
    for cands, rel in zip(rr.candidates, rr.relevant):
        assert rel and all(i < len(cands) for i in rel)  # the positive is always a candidate


def test_matryoshka_trains_and_truncated_model_exports(ckpt, retrieval, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    out = tmp_path / "m"
    s = run_embed(EmbedConfig(task="embed", checkpoint=str(ckpt), data=str(retrieval), output_dir=str(out),
                              batch_size=16, max_steps=3, learning_rate=1e-3, matryoshka_dims=[128, 32],
                              truncate_dim=32, save_model=True, **FAST))
    assert s["model"]["dim"] == 32
    texts = fixtures.book_pairs(n=4)[0]["query"], "Captain Wentworth"
    from bertdist.embed.model import load_bi_encoder

    ours = load_bi_encoder(out / "model", kernels="reference").encode(list(texts))
    theirs = st.SentenceTransformer(str(out / "model"), device="cpu").encode(list(texts))
    assert ours.shape == theirs.shape == (2, 32) and np.abs(ours - theirs).max() < 1e-5
    assert np.allclose(np.linalg.norm(theirs, axis=1), 1.0, atol=1e-5)


def test_rerank_listwise_fits_its_training_groups(ckpt, tmp_path):
    """The listwise cross-encoder learns to put each training query's positive above its mined
    BM25 negatives: the re-ranking of those groups (the train rows, listed with the negatives the
    run mined, as the dev file) improves. A tiny randomly initialised cross-encoder learns the
    groups it sees; it does not generalise from a few dozen rows (see the shared-data test)."""
    rows = fixtures.book_pairs(n=48)
    data = tmp_path / "data"
    fixtures.write_jsonl(data / "train.jsonl", rows)
    base = dict(task="rerank", checkpoint=str(ckpt), data=str(data), batch_size=8, num_negatives=3, **FAST)
    # mine the groups once, then train with them listed in the dev file
    run_embed(EmbedConfig(output_dir=str(tmp_path / "mine"), max_steps=1, learning_rate=1e-5, **base))
    from bertdist.retrieval.bm25 import read_negative_set

    mined = read_negative_set(tmp_path / "mine" / "negatives")
    corpus = list(dict.fromkeys(r["positive"] for r in rows))
    dev = [{**r, "negatives": [corpus[d] for d in m.negative_ids]} for r, m in zip(rows, mined.rows)]
    fixtures.write_jsonl(data / "dev.jsonl", dev)
    s = run_embed(EmbedConfig(output_dir=str(tmp_path / "out"), epochs=10, learning_rate=1e-3, eval_every=20,
                              save_model=True, **{**base, "max_seq_length": 48}))
    before, after = s["initial"]["metrics"]["ndcg@10"], s["best"]["metrics"]["ndcg@10"]
    assert s["loss"] == "listwise" and s["negatives"]["rows_with_mined_negatives"] == 48
    assert after > before + 0.1, (before, after)
    curve = [p["loss"] for p in s["loss_curve"]]
    assert np.mean(curve[-10:]) < np.mean(curve[:10]) - 0.3, curve
    cfg = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert cfg["architectures"] == ["BertForSequenceClassification"] and cfg["num_labels"] == 1
    assert cfg["sentence_transformers"]["activation_fn"].endswith("Identity")


def _rates(model, cfg, steps: int = 1) -> dict[str, float]:
    """Each trainable parameter's learning rate after ``steps`` scheduler steps of a 10-step run
    (step 0 runs at rate 0, the warmup's start)."""
    from bertdist.embed.optim import param_groups
    from bertdist.finetune.train import build_optimization

    _, opt, sched = build_optimization(model, cfg, param_groups(model, cfg), cfg.learning_rate, 8, 10)
    for _ in range(steps):
        opt.step()
        sched.step()
    lr = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    return {n: lr[id(p)] for n, p in model.named_parameters() if p.requires_grad}


def test_cross_encoder_head_has_its_own_rate(ckpt, tmp_path):
    """A new head (pooler + classifier) trains at 20 x learning_rate through warmup and decay; a
    trained cross-encoder's head keeps learning_rate; head_learning_rate sets it; no weight decay on
    the head's bias either way."""
    import torch

    from bertdist.embed.export import write_cross_encoder
    from bertdist.embed.optim import param_groups
    from bertdist.embed.train import build_model

    cfg = EmbedConfig(task="rerank", checkpoint=str(ckpt), learning_rate=1e-4, warmup_ratio=0.2, **FAST)
    model = build_model(cfg, torch.device("cpu"), "listwise")
    for steps in (1, 5):  # in warmup, then in decay
        r = _rates(model, cfg, steps)
        body = r["bert.encoder.layer.0.attention.self.query.weight"]
        assert body > 0
        for name in ("classifier.weight", "classifier.bias", "bert.pooler.dense.weight"):
            assert r[name] == pytest.approx(20 * body), (steps, name, r[name], body)
    groups = param_groups(model, cfg)
    head_bias = next(g for g in groups if any(p is model.classifier.bias for p in g["params"]))
    assert head_bias["weight_decay"] == 0.0 and head_bias["lr"] == pytest.approx(2e-3)
    assert sum(len(g["params"]) for g in groups) == sum(p.requires_grad for p in model.parameters())
    r = _rates(model, dataclasses.replace(cfg, head_learning_rate=5e-4))
    assert r["classifier.weight"] / r["bert.embeddings.word_embeddings.weight"] == pytest.approx(5.0)
    trained = build_model(dataclasses.replace(cfg, checkpoint=str(write_cross_encoder(tmp_path / "ce", model))),
                          torch.device("cpu"), "listwise")
    r = _rates(trained, cfg)
    assert r["classifier.weight"] == pytest.approx(r["bert.embeddings.word_embeddings.weight"])


def test_rerank_bce_runs_on_rows_and_labels(ckpt, tmp_path):
    data = fixtures.retrieval_dir(tmp_path / "data", n_train=24, n_dev=8, negatives=2)
    s = run_embed(EmbedConfig(task="rerank", checkpoint=str(ckpt), data=str(data), output_dir=str(tmp_path / "o"),
                              loss="bce", batch_size=8, max_steps=3, learning_rate=1e-3, num_negatives=2,
                              save_model=True, **FAST))
    assert s["loss"] == "bce" and s["model"]["activation"] == "sigmoid" and s["steps"] == 3
    assert s["best"]["metrics"]["candidates"] == 8 * 3  # the positive and the 2 listed negatives
    conf = json.loads((tmp_path / "o" / "model" / "config.json").read_text())
    assert conf["sentence_transformers"]["activation_fn"].endswith("Sigmoid")


def test_early_stopping_stops_and_keeps_the_best(ckpt, retrieval, tmp_path):
    # a learning rate far too high: dev scores fall after a few steps, evaluated after every step
    out = tmp_path / "es"
    s = run_embed(EmbedConfig(task="embed", checkpoint=str(ckpt), data=str(retrieval), output_dir=str(out),
                              batch_size=16, epochs=20, learning_rate=0.05, warmup_ratio=0.0, eval_every=1,
                              early_stopping_patience=2, save_model=True, **FAST))
    scores = [e["metrics"]["ndcg@10"] for e in s["evals"]]
    assert s["stopped_early"] and s["steps"] < s["planned_steps"]
    best_i = int(np.argmax(scores))
    assert len(scores) == best_i + 1 + 2  # stopped two evaluations after the best
    assert s["best"]["step"] == s["evals"][best_i]["step"]
    from bertdist.embed.data import read_pairs
    from bertdist.embed.evaluate import build_retrieval_dev, retrieval_eval
    from bertdist.embed.model import load_bi_encoder

    dev = build_retrieval_dev(read_pairs(retrieval / "dev.jsonl"))
    again = retrieval_eval(load_bi_encoder(out / "model", kernels="reference"), dev, max_seq_length=64)
    assert again["ndcg@10"] == pytest.approx(s["best"]["score"], abs=1e-6)


def test_data_errors_name_file_and_line(ckpt, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"query": "a", "positive": "b"}\n\n{"query": "c"}\n')
    cfg = EmbedConfig(task="embed", checkpoint=str(ckpt), data=str(data), output_dir=str(tmp_path / "o"), **FAST)
    with pytest.raises(DataError, match=r"train\.jsonl:3: missing key 'positive'"):
        run_embed(cfg)
    (data / "train.jsonl").write_text('{"query": "a", "positive": "b"}\n{"query": "a", "positive": "b", ')
    with pytest.raises(DataError, match=r"train\.jsonl:2: not valid JSON"):
        run_embed(cfg)
    with pytest.raises(DataError, match=r"no train file \(looked for \['train\.jsonl', 'train\.tsv'\]\)"):
        run_embed(EmbedConfig(task="embed", checkpoint=str(ckpt), data=str(tmp_path), **FAST))
    sts = tmp_path / "sts"
    sts.mkdir()
    (sts / "train.tsv").write_text("index\tsentence1\tsentence2\tscore\n0\ta b\tc d\tfive\n")
    with pytest.raises(DataError, match=r"train\.tsv:2: score 'five' is not a number"):
        run_embed(EmbedConfig(task="sts", checkpoint=str(ckpt), data=str(sts), **FAST))
    (data / "train.jsonl").write_text('{"query": "a", "positive": "b"}\n')
    with pytest.raises(DataError, match="early_stopping_patience=2 needs a dev set"):
        run_embed(EmbedConfig(task="embed", checkpoint=str(ckpt), data=str(data), early_stopping_patience=2, **FAST))


# ---------------------------------------------------------------- real data, slow
@pytest.mark.shared
@pytest.mark.slow
def test_sts_spearman_rises_on_stsb(ckpt, shared_data, tmp_path):
    s = run_embed(EmbedConfig(task="sts", checkpoint=str(ckpt), data=str(shared_data / "glue" / "STS-B"),
                              output_dir=str(tmp_path / "sts"), batch_size=16, epochs=1, learning_rate=5e-4,
                              max_train_examples=1024, max_eval_examples=500, **FAST))
    before, after = s["initial"]["metrics"]["spearman"], s["best"]["metrics"]["spearman"]
    print(f"STS-B dev Spearman (500 pairs): {before:.4f} before, {after:.4f} after {s['steps']} steps")
    assert after > before + 0.05, (before, after)


@pytest.mark.shared
@pytest.mark.slow
def test_embed_learns_on_squad_passage_retrieval(shared_data, tmp_path):
    from bertdist.retrieval.squad_split import load_squad_retrieval

    # BERT's own vocab: SQuAD's words are mostly not in the books' vocab
    ckpt = fixtures.tiny_checkpoint(tmp_path / "ckpt", shared_data / "vocab" / "bert-base-uncased-vocab.txt")
    split = load_squad_retrieval(shared_data / "squad" / "dev-v1.1.json")
    data = tmp_path / "squad"
    # every other train question, every 15th eval question: every article of each half, a few hundred paragraphs
    fixtures.write_jsonl(data / "train.jsonl", [{"query": q, "positive": p} for q, p in split.train_pairs[::2]])
    by_id = dict(zip(split.corpus_ids, split.corpus))
    fixtures.write_jsonl(data / "dev.jsonl", [{"query": q, "positive": by_id[next(iter(rel))]}
                                              for q, rel in zip(split.eval_queries[::15], split.eval_relevant[::15])])
    s = run_embed(EmbedConfig(task="embed", checkpoint=str(ckpt), data=str(data), output_dir=str(tmp_path / "o"),
                              batch_size=32, max_steps=90, learning_rate=1e-3, **{**FAST, "max_seq_length": 128}))
    before, after = s["initial"]["metrics"], s["best"]["metrics"]
    print(f"SQuAD by-article dev ({after['queries']} questions, {after['corpus']} paragraphs): nDCG@10 "
          f"{before['ndcg@10']:.4f} -> {after['ndcg@10']:.4f}, recall@20 {before['recall@20']:.4f} -> "
          f"{after['recall@20']:.4f} after {s['steps']} steps")
    assert after["ndcg@10"] > before["ndcg@10"] + 0.15


@pytest.mark.slow
def test_deepspeed_two_ranks_gathers_negatives_like_one_process(tmp_path):
    """2 gloo ranks with micro-batches of 8 and cross-rank negatives train the same model as one
    process with batches of 16 (dropout off, fp32, no repeated text so the batches are equal)."""
    ckpt = fixtures.tiny_checkpoint(tmp_path / "ckpt", fixtures.word_vocab(tmp_path / "vocab.txt"),
                                    attention_probs_dropout_prob=0.0)
    data = fixtures.retrieval_dir(tmp_path / "data", n_train=48, n_dev=16)
    settings = ["batch_size=16", "epochs=2", "learning_rate=5e-4", "kernels=reference", "progress=false",
                "hidden_dropout_prob=0.0", "max_seq_length=48", "save_model=true"]
    from bertdist.embed.config import load_embed_config

    single = load_embed_config(None, [f"checkpoint={ckpt}", f"data={data}", f"output_dir={tmp_path / 'single'}",
                                      *settings])
    run_embed(single)
    env = child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [*torchrun(2), "-m", "bertdist.cli.main", "finetune", "embed", "--checkpoint", str(ckpt), "--data", str(data),
           "--out", str(tmp_path / "ds"), "--deepspeed", "--set", "zero_stage=1"]
    for s in settings:
        cmd += ["--set", s]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a = json.loads((tmp_path / "single" / "metrics.json").read_text())
    b = json.loads((tmp_path / "ds" / "metrics.json").read_text())
    assert b["world_size"] == 2 and b["gathered_negatives"] and b["deepspeed"] == {"zero_stage": 1}
    assert a["steps"] == b["steps"] == 6
    assert b["best"]["metrics"]["ndcg@10"] == pytest.approx(a["best"]["metrics"]["ndcg@10"], abs=1e-4)
    from bertdist.embed.model import load_bi_encoder

    texts = [r["query"] for r in fixtures.book_pairs(n=8)]
    ea = load_bi_encoder(tmp_path / "single" / "model", kernels="reference").encode(texts)
    eb = load_bi_encoder(tmp_path / "ds" / "model", kernels="reference").encode(texts)
    assert np.abs(ea - eb).max() < 1e-4
    assert (tmp_path / "ds" / "model" / "modules.json").is_file()
    # batches of 8 (what each rank would train on without the gather) give another model
    small = dataclasses.replace(single, batch_size=8, output_dir=str(tmp_path / "small"))
    run_embed(small)
    ec = load_bi_encoder(tmp_path / "small" / "model", kernels="reference").encode(texts)
    assert np.abs(ea - ec).max() > 1e-3
