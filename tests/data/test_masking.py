"""The masking oracle (bertdist.data.masking) and the two vectorised implementations held to it.

The loader's dynamic masking and the pipeline's static token-level masking draw their random
numbers in bulk; each test here replays those draws, feeds them through the oracle's selection
and replacement rules row by row, and demands the same positions, labels and ids.
"""
from __future__ import annotations

import numpy as np
import pytest

from bertdist.data.masking import (
    candidate_words,
    choose_masked_positions,
    mask_sequence,
    masking_budget,
    replace_masked,
)
from bertdist.model import IGNORE_INDEX
from bertdist.train.masking import SpecialIds, dynamic_mask

CLS, SEP, PAD, MASK, VOCAB = 2, 3, 0, 4, 500


def test_budget_follows_bert():
    assert masking_budget(128, 0.15, 20) == 19  # round(19.2)
    assert masking_budget(128, 0.15, 10) == 10  # capped
    assert masking_budget(3, 0.15, 20) == 1  # at least one
    assert masking_budget(10, 0.25, 20) == 2  # round half to even, as numpy's rint


def test_words_never_cross_specials():
    special = np.array([1, 0, 0, 0, 1, 0, 0, 1], bool)
    cont = np.array([0, 0, 1, 1, 0, 1, 0, 0], bool)  # a '##' piece right after [SEP] starts a word
    words = candidate_words(special, cont)
    assert [w.tolist() for w in words] == [[1, 2, 3], [5], [6]]
    assert [w.tolist() for w in candidate_words(special)] == [[1], [2], [3], [5], [6]]
    assert candidate_words(np.ones(4, bool), np.zeros(4, bool)) == []


def test_a_word_that_overshoots_is_skipped_not_cut():
    words = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6])]
    # budget 2: word 0 (3 pieces) is skipped, word 1 taken, word 2 (2 pieces) would overshoot
    assert choose_masked_positions(words, [0, 1, 2], 2).tolist() == [4]
    assert choose_masked_positions(words, [2, 0, 1], 2).tolist() == [5, 6]
    assert choose_masked_positions(words, [0, 2, 1], 3).tolist() == [1, 2, 3]  # stops once full


def test_replacement_is_80_10_10():
    ids = np.arange(10, 20)
    pos = np.array([1, 3, 5])
    out = replace_masked(ids, pos, np.array([0.79, 0.85, 0.95]), np.array([7, 8, 9]), MASK)
    assert out.tolist() == [10, MASK, 12, 13, 14, 9, 16, 17, 18, 19]
    assert ids.tolist() == list(range(10, 20))  # a copy


@pytest.mark.parametrize("wwm", [False, True])
def test_oracle_masks_whole_words_within_budget(wwm):
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(3, 80))
        ids = rng.integers(10, VOCAB, n)
        special = np.zeros(n, bool)
        special[[0, n - 1]] = True
        cont = rng.random(n) < 0.4 if wwm else None
        out, pos, labels = mask_sequence(ids, rng, special=special, masked_lm_prob=0.15, max_predictions=7,
                                         mask_id=MASK, vocab_size=VOCAB, continuation=cont)
        budget = masking_budget(n, 0.15, 7)
        assert pos.size <= budget and not special[pos].any() and (labels == ids[pos]).all()
        if not wwm:
            assert pos.size == min(budget, n - 2)
        else:  # every chosen word is chosen whole
            for w in candidate_words(special, cont):
                assert np.isin(w, pos).all() or not np.isin(w, pos).any()
        unchanged = np.setdiff1d(np.arange(n), pos)
        assert (out[unchanged] == ids[unchanged]).all()


def _padded_batch(rng, b: int, s: int):
    lengths = rng.integers(4, s + 1, b)
    ids = rng.integers(10, VOCAB, (b, s))
    cols = np.arange(s)
    ids[cols[None, :] >= lengths[:, None]] = PAD
    ids[:, 0] = CLS
    ids[np.arange(b), lengths - 1] = SEP
    mid = lengths // 2
    ids[np.arange(b), mid] = SEP  # a second segment
    return ids, lengths


@pytest.mark.parametrize("wwm", [False, True])
def test_loader_dynamic_mask_equals_oracle(wwm):
    """``dynamic_mask`` draws noise [B, S] (the visiting order), actions [B, S] and the random ids in
    row-major order; replayed through the oracle they give exactly its labels and ids."""
    rng = np.random.default_rng(11)
    b, s, prob, max_pred = 64, 48, 0.2, 6
    ids, lengths = _padded_batch(rng, b, s)
    cont_vocab = rng.random(VOCAB) < 0.35 if wwm else None
    seed = 1234
    out, labels = dynamic_mask(ids.copy(), lengths, SpecialIds(PAD, CLS, SEP, MASK), VOCAB,
                               np.random.default_rng(seed), prob, max_pred, cont_vocab)
    replay = np.random.default_rng(seed)
    noise = replay.random((b, s))
    action = replay.random((b, s))
    random_ids = iter(replay.integers(0, VOCAB, int(((labels != IGNORE_INDEX) & (action >= 0.9)).sum())))
    for r in range(b):
        n = int(lengths[r])
        row = ids[r, :n]
        special = np.isin(row, (CLS, SEP, PAD))
        words = candidate_words(special, None if cont_vocab is None else cont_vocab[row])
        # the loader visits words in the order of their noise draws: word k's draw is noise[r, k]
        # (whole words) or the noise at its one position (tokens)
        keys = noise[r, :len(words)] if wwm else noise[r, [w[0] for w in words]]
        pos = choose_masked_positions(words, np.argsort(keys, kind="stable"), masking_budget(n, prob, max_pred))
        assert np.flatnonzero(labels[r] != IGNORE_INDEX).tolist() == pos.tolist(), r
        assert (labels[r, pos] == row[pos]).all()
        u = action[r, pos]
        drawn = np.array([next(random_ids) if x >= 0.9 else -1 for x in u], np.int64)
        assert out[r, :n].tolist() == replace_masked(row, pos, u, drawn, MASK).tolist(), r
        assert (out[r, n:] == PAD).all()


def test_pipeline_static_mask_equals_oracle():
    """The pipeline's token-level ``_mask_rows`` (and so its bitwise-identical native twin) draws one
    key per token (the visiting order), then one uniform and one id per chosen position."""
    from data_pipeline.instance_algorithm import InstanceParams, _mask_rows

    rng = np.random.default_rng(5)
    m = 40
    la = rng.integers(3, 30, m)
    lb = np.where(rng.random(m) < 0.8, rng.integers(1, 30, m), 0)
    has_b = lb > 0
    lengths = la + 2 + np.where(has_b, lb + 1, 0)
    offs = np.concatenate(([0], np.cumsum(lengths)))
    rows = []
    for a, bl in zip(la, lb):
        rows.append([CLS, *rng.integers(10, VOCAB, a), SEP] + ([*rng.integers(10, VOCAB, bl), SEP] if bl else []))
    flat = np.concatenate(rows).astype(np.uint16)
    num_a = (la + 2).astype(np.uint16)
    p = InstanceParams(max_seq_length=128, short_seq_prob=0.1, objective="nsp", nsp_random_prob=0.5,
                       masking="static", masked_lm_prob=0.15, max_predictions_per_seq=5, whole_word_mask=False,
                       cls_id=CLS, sep_id=SEP, mask_id=MASK, vocab_size=VOCAB)
    out, mpos, mids, moffs = _mask_rows(flat, offs, num_a, has_b, np.random.default_rng(9), p)
    replay = np.random.default_rng(9)
    keys = replay.random(flat.shape[0])
    total = int(moffs[-1])
    u_all, ids_all = replay.random(total), replay.integers(0, VOCAB, size=total)
    for r in range(m):
        s, e = offs[r], offs[r + 1]
        row = flat[s:e]
        special = np.zeros(e - s, bool)
        special[[0, num_a[r] - 1]] = True
        special[-1] = True
        words = candidate_words(special)
        pos = choose_masked_positions(words, np.argsort(keys[s:e][[w[0] for w in words]]),
                                      masking_budget(int(e - s), p.masked_lm_prob, p.max_predictions_per_seq))
        assert mpos[moffs[r]:moffs[r + 1]].tolist() == pos.tolist(), r
        assert mids[moffs[r]:moffs[r + 1]].tolist() == row[pos].tolist()
        sl = slice(moffs[r], moffs[r + 1])
        assert out[s:e].tolist() == replace_masked(row, pos, u_all[sl], ids_all[sl], MASK).tolist(), r
