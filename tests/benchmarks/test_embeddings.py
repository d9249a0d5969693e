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
