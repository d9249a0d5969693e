"""Instance creation and masking (pure functions): rates, whole words, text round trip."""
from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.instance_algorithm import InstanceParams, InstanceStats, _truncation_counts, create_instances
from data_pipeline.negatives import NegativeSource, canonical_order, placement_hash



def params(**kw):
    base = dict(max_seq_length=128, short_seq_prob=0.1, objective="nsp", nsp_random_prob=0.5, masking="static",
                masked_lm_prob=0.15, max_predictions_per_seq=20, whole_word_mask=False, cls_id=101, sep_id=102,
                mask_id=103, vocab_size=30522)
    base.update(kw)
    return InstanceParams(**base)


def synthetic_docs(n_docs=60, n_sent=200, seed=0):
    """Documents of short sentences (so a chunk always has >= 2 segments)."""
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(n_docs):
        lens = rng.integers(5, 15, size=n_sent)
        ids = rng.integers(1000, 30000, size=lens.sum()).astype(np.uint16)
        bounds = np.concatenate([[0], np.cumsum(lens)])
        docs.append((f"doc{d}", ids, bounds))
    return docs


def one_bucket(docs, seed=1):
    """All documents in one bucket, in the pipeline's canonical order: (source, place of each id)."""
    order = canonical_order([placement_hash(d[0]) for d in docs], [d[0] for d in docs], [d[1] for d in docs])
    source = NegativeSource.from_documents([docs[i] for i in order], seed=seed)
    return source, {docs[i][0]: place for place, i in enumerate(order)}


def build(docs, p, dupes=1, seed=1, continuation=None):
    from data_pipeline.instance_batch import InstanceBatch

    source, place = one_bucket(docs, seed)
    stats, parts = InstanceStats(), []
    for d in docs:
        deal = source.dealer(place[d[0]])
        parts += [create_instances(*d, k, params=p, seed=seed, negatives=deal, continuation=continuation, stats=stats)
                  for k in range(dupes)]
        stats.count_windows(deal)
    return InstanceBatch.concat(parts), stats


def test_mask_rate_and_80_10_10():
    p = params(max_predictions_per_seq=200)  # no cap: the rate is the configured probability
    b, _ = build(synthetic_docs(), p)
    rate = b.num_masked() / b.num_tokens()
    assert abs(rate - 0.15) < 0.005, rate
    # recover what each masked position holds: [MASK], itself, or another id
    held = np.concatenate([b.ids[b.ids_offsets[r] + b.mpos[b.m_offsets[r]:b.m_offsets[r + 1]]] for r in range(len(b))])
    frac_mask = (held == 103).mean()
    frac_kept = (held == b.mids).mean()
    frac_rand = 1 - frac_mask - frac_kept
    assert abs(frac_mask - 0.8) < 0.01 and abs(frac_kept - 0.1) < 0.01 and abs(frac_rand - 0.1) < 0.01


def test_max_predictions_cap_and_specials_never_masked():
    b, _ = build(synthetic_docs(20), params())
    counts = np.diff(b.m_offsets)
    assert counts.max() <= 20 and (counts == 19).mean() > 0.5  # round(128*.15)=19 for full rows
    for r in range(len(b)):
        pos = b.mpos[b.m_offsets[r]:b.m_offsets[r + 1]].astype(int)
        n, na = b.ids_offsets[r + 1] - b.ids_offsets[r], int(b.num_a[r])
        assert not set(pos) & {0, na - 1, n - 1}
        assert (np.diff(pos) > 0).all()


def test_nsp_random_next_rate():
    b, stats = build(synthetic_docs(), params(), dupes=3)
    rate = (b.nsp == 1).mean()
    assert abs(rate - 0.5) < 0.01, rate
    # every random-next row took a window no other row took (60 x 200 windows, ~5k rows over 3 dupes)
    assert stats.same_document_fallbacks == 0 and stats.random_next == int((b.nsp == 1).sum())
    assert stats.distinct_windows == stats.random_next and stats.max_window_reuse == 1


def test_whole_word_masking_never_partial():
    rng = np.random.default_rng(3)
    vocab = 30522
    continuation = np.zeros(vocab, bool)
    continuation[20000:] = True  # ids >= 20000 are '##' pieces
    b, _ = build(synthetic_docs(30), params(whole_word_mask=True), continuation=continuation)
    for r in range(len(b)):
        s, e = b.ids_offsets[r], b.ids_offsets[r + 1]
        orig = b.ids[s:e].copy()
        pos = b.mpos[b.m_offsets[r]:b.m_offsets[r + 1]].astype(int)
        orig[pos] = b.mids[b.m_offsets[r]:b.m_offsets[r + 1]]
        masked = np.zeros(e - s, bool)
        masked[pos] = True
        na = int(b.num_a[r])
        special = np.zeros(e - s, bool)
        special[[0, na - 1, e - s - 1]] = True
        # a continuation piece is masked iff the piece before it is (within a segment)
        cont = continuation[orig] & ~special & np.concatenate([[False], ~special[:-1]])
        idx = np.flatnonzero(cont)
        assert (masked[idx] == masked[idx - 1]).all()
    assert abs(b.num_masked() / b.num_tokens() - 0.15) < 0.02


def test_sop_and_none_objectives():
    b, _ = build(synthetic_docs(10), params(objective="sop"))
    assert set(np.unique(b.nsp)) == {0, 1} and abs((b.nsp == 1).mean() - 0.5) < 0.05
    b, _ = build(synthetic_docs(10), params(objective="none", masking="dynamic"))
    assert (b.nsp == -1).all() and b.num_masked() == 0
    lengths = np.diff(b.ids_offsets)
    assert (b.num_a == lengths).all() and lengths.max() <= 128


def test_deterministic_per_document():
    docs = synthetic_docs(5)
    a, _ = build(docs, params(), dupes=2)
    b, _ = build(list(reversed(docs)), params(), dupes=2)
    a, b = a.sorted_by_key(), b.sorted_by_key()
    assert np.array_equal(a.keys, b.keys) and np.array_equal(a.ids, b.ids) and np.array_equal(a.mids, b.mids)
    c, _ = build(docs, params(), dupes=2, seed=2)
    assert not np.array_equal(c.sorted_by_key().ids[:500], a.ids[:500])


def _reference_truncate(la, lb, m):
    a, b = list(range(la)), list(range(lb))
    while len(a) + len(b) > m:
        t = a if len(a) > len(b) else b
        t.pop()
    return la - len(a), lb - len(b)


@pytest.mark.parametrize("la,lb,m", [(100, 60, 125), (60, 100, 125), (70, 70, 125), (300, 2, 125), (5, 5, 125), (90, 91, 100)])
def test_truncation_counts_match_reference(la, lb, m):
    assert _truncation_counts(la, lb, m) == _reference_truncate(la, lb, m)


def test_unmasked_tokens_decode_to_normalized_text(small_vocab):
    """Static masking undone (labels put back) + decoding reproduces the normalized input."""
    from data_pipeline.tokenization import load_tokenizer

    tok, _ = load_tokenizer(small_vocab)
    sentences = ["The quick brown fox jumps over the lazy dog.", "It was the best of times, it was the worst of times.",
                 "Call me Ishmael.", "Some years ago, never mind how long precisely, I thought I would sail about.",
                 "Whenever I find myself growing grim about the mouth, I go to sea."] * 4
    encs = tok.encode_batch(sentences, add_special_tokens=False)
    ids = np.concatenate([np.array(e.ids, np.uint16) for e in encs])
    bounds = np.concatenate([[0], np.cumsum([len(e.ids) for e in encs])])
    p = params(objective="none", short_seq_prob=0.0, max_seq_length=512, vocab_size=tok.get_vocab_size())
    b = create_instances("d", ids, bounds, 0, params=p, seed=7)
    assert len(b) == 1 and b.num_masked() > 0
    restored = b.ids.copy()
    restored[b.mpos.astype(int)] = b.mids
    text = tok.decode(restored[1:-1].tolist())
    norm = tok.decode(tok.encode(" ".join(sentences), add_special_tokens=False).ids)
    assert text == norm
    assert text == " ".join(sentences).lower()  # uncased vocab: normalization is lower-casing
