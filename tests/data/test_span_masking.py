"""Span masking (SpanBERT's selection, whole words) and the [MASK] / random / keep split: the
oracle's rules, the loader's dynamic masking and the pipeline's static masking (Python and its C++
twin) held to the oracle by replaying their draws, the span lengths' distribution, the settings
and their checks, and a Beam build whose span-masked records the trainer's loader reads."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np
import pytest

from bertdist.config import ConfigError
from bertdist.data.masking import (
    SPAN_GEOMETRIC_P,
    SPAN_MAX_WORDS,
    candidate_words,
    choose_span_positions,
    mask_sequence,
    masking_budget,
    replace_masked,
    resolve_masking_mode,
    span_length_cdf,
    span_lengths,
)
from bertdist.model import IGNORE_INDEX
from bertdist.train.masking import SpecialIds, dynamic_mask
from data_pipeline import instance_native

CLS, SEP, PAD, MASK, VOCAB = 2, 3, 0, 4, 500

needs_native = pytest.mark.skipif(not instance_native.available(),
                                  reason=instance_native.unavailable_reason() or "native builder not built")


def _exact_length_probs() -> list[Fraction]:
    """P(length = k), k = 1..10: geometric(1/5) truncated at 10 and renormalised, as fractions."""
    p = Fraction(1, 5)
    w = [p * (1 - p) ** (k - 1) for k in range(1, SPAN_MAX_WORDS + 1)]
    return [x / sum(w) for x in w]


# ---------------------------------------------------------------- span lengths


def test_span_length_cdf_is_the_truncated_geometric():
    assert SPAN_GEOMETRIC_P == 0.2 and SPAN_MAX_WORDS == 10
    probs = _exact_length_probs()
    cdf = span_length_cdf()
    exact = np.cumsum([float(x) for x in probs])
    assert np.allclose(cdf, exact, rtol=0, atol=1e-15) and cdf[-1] == 1.0
    # the boundaries of the inverse: just below cdf[0] is 1 word, at it 2, just below 1.0 is 10
    assert span_lengths(np.array([0.0, np.nextafter(cdf[0], 0), cdf[0], cdf[3], np.nextafter(1.0, 0)])).tolist() == \
        [1, 1, 2, 5, 10]


@needs_native
def test_native_span_length_cdf_is_bitwise_the_same():
    native = np.array(instance_native._ext.testing.span_length_cdf(SPAN_GEOMETRIC_P, SPAN_MAX_WORDS))
    assert native.tobytes() == span_length_cdf().tobytes()


def test_span_lengths_follow_the_truncated_geometric():
    """Mean and frequencies of 400,000 draws against the exact distribution: mean 3.797 words
    (SpanBERT's 3.8); the capped min(Geometric, 10) would give 4.463."""
    probs = _exact_length_probs()
    mean = float(sum(k * p for k, p in enumerate(probs, 1)))
    assert abs(mean - 3.7971) < 1e-4
    n = 400_000
    lengths = span_lengths(np.random.default_rng(0).random(n))
    assert lengths.min() == 1 and lengths.max() == 10
    sd = float(sum(k * k * p for k, p in enumerate(probs, 1))) - mean ** 2
    # 5 standard errors: about 0.02 words
    assert abs(lengths.mean() - mean) < 5 * (sd / n) ** 0.5, (lengths.mean(), mean)
    freq = np.bincount(lengths, minlength=11)[1:] / n
    for k, (f, p) in enumerate(zip(freq, probs), 1):
        assert abs(f - float(p)) < 5 * (float(p) * (1 - float(p)) / n) ** 0.5, (k, f, float(p))


# ---------------------------------------------------------------- the oracle's rule


def _words(*sizes_and_specials):
    """Words from a layout: ints are word sizes, 'S' a special token; the first position is [CLS]."""
    words, pos = [], 1
    for x in sizes_and_specials:
        if x == "S":
            pos += 1
            continue
        words.append(np.arange(pos, pos + x))
        pos += x
    return words


def test_a_span_takes_consecutive_words_up_to_its_length():
    words = _words(1, 1, 1, 1, 1, 1)
    lengths = np.full(6, 3)
    assert choose_span_positions(words, [1], lengths, 10).tolist() == [2, 3, 4]
    assert choose_span_positions(words, [4], lengths, 10).tolist() == [5, 6]  # the sequence ends
    assert choose_span_positions(words, [4, 0], lengths, 10).tolist() == [1, 2, 3, 5, 6]


def test_a_span_never_crosses_a_special_token():
    words = _words(1, 2, "S", 1, 1)  # [CLS] a bb [SEP] c d
    assert choose_span_positions(words, [0], np.full(4, 10), 10).tolist() == [1, 2, 3]
    assert choose_span_positions(words, [1, 2], np.full(4, 10), 10).tolist() == [2, 3, 5, 6]


def test_an_overshooting_span_is_cut_back_to_whole_words_or_skipped():
    words = _words(1, 2, 1, 1)  # positions [1], [2, 3], [4], [5]
    lengths = np.full(4, 4)
    # budget 2: word 0, then word 1 (2 pieces) would overshoot: the span is word 0 alone, then
    # the next visit (word 2) starts a span that fills the budget
    assert choose_span_positions(words, [0, 2], lengths, 2).tolist() == [1, 4]
    # budget 3: words 0 and 1 fill it exactly; the visit stops there
    assert choose_span_positions(words, [0, 2], lengths, 3).tolist() == [1, 2, 3]
    # budget 1: a span starting at word 1 (2 pieces) is skipped, a later start still fits
    assert choose_span_positions(words, [1, 3], lengths, 1).tolist() == [5]


def test_spans_stop_at_earlier_spans_and_skip_starts_inside_them():
    words = _words(1, 1, 1, 1, 1, 1)
    lengths = np.array([5, 5, 5, 2, 5, 5])
    # span from word 3 takes words 3, 4; the span from word 1 stops before word 3; word 4 is inside
    assert choose_span_positions(words, [3, 1, 4, 0], lengths, 10).tolist() == [1, 2, 3, 4, 5]


def _random_sequence(rng, n: int, cont_rate: float):
    ids = rng.integers(10, VOCAB, n)
    special = np.zeros(n, bool)
    special[[0, n - 1]] = True
    if n > 6 and rng.random() < 0.7:
        special[int(rng.integers(2, n - 2))] = True  # a [SEP] between two segments
    cont = rng.random(n) < cont_rate
    return ids, special, cont


@pytest.mark.parametrize("cont_rate", [0.0, 0.4])
def test_oracle_spans_are_whole_words_within_segments_and_fill_the_budget(cont_rate):
    """Per sequence: only non-special positions, every word masked whole or not at all, and the
    budget exact unless every unmasked word is longer than what is left of it (always exact when
    every word is one piece). Each maximal run of masked words lies inside one segment."""
    rng = np.random.default_rng(3)
    short = 0
    for _ in range(400):
        n = int(rng.integers(3, 90))
        ids, special, cont = _random_sequence(rng, n, cont_rate)
        prob, max_pred = float(rng.choice([0.15, 0.3, 0.6])), int(rng.integers(1, 30))
        out, pos, labels = mask_sequence(ids, rng, special=special, masked_lm_prob=prob, max_predictions=max_pred,
                                         mask_id=MASK, vocab_size=VOCAB, continuation=cont, mode="span")
        budget = masking_budget(n, prob, max_pred)
        words = candidate_words(special, cont)
        assert not special[pos].any() and (labels == ids[pos]).all() and pos.size <= budget
        masked_words = [w for w in words if np.isin(w, pos).any()]
        for w in masked_words:
            assert np.isin(w, pos).all(), (w, pos)
        left = budget - pos.size
        unmasked = [w.size for w in words if not np.isin(w, pos).any()]
        if left:
            short += 1
            assert all(size > left for size in unmasked), (left, unmasked)
        if cont_rate == 0.0:
            assert pos.size == min(budget, n - int(special.sum()))
        unchanged = np.setdiff1d(np.arange(n), pos)
        assert (out[unchanged] == ids[unchanged]).all()
    assert cont_rate == 0.0 or short > 0  # the multi-piece case did reach the exception


def test_oracle_span_draws_are_a_permutation_then_one_length_per_word():
    rng = np.random.default_rng(8)
    ids, special, cont = _random_sequence(rng, 60, 0.3)
    out, pos, _ = mask_sequence(ids, np.random.default_rng(1), special=special, masked_lm_prob=0.3,
                                max_predictions=40, mask_id=MASK, vocab_size=VOCAB, continuation=cont, mode="span")
    replay = np.random.default_rng(1)
    words = candidate_words(special, cont)
    order = replay.permutation(len(words))
    want = choose_span_positions(words, order, span_lengths(replay.random(len(words))), masking_budget(60, 0.3, 40))
    assert pos.tolist() == want.tolist() and pos.size == 18
    u, rid = replay.random(pos.size), replay.integers(0, VOCAB, size=pos.size)
    assert out.tolist() == replace_masked(ids, pos, u, rid, MASK).tolist()


# ---------------------------------------------------------------- the loader's dynamic masking


def _padded_batch(rng, b: int, s: int):
    lengths = rng.integers(4, s + 1, b)
    ids = rng.integers(10, VOCAB, (b, s))
    cols = np.arange(s)
    ids[cols[None, :] >= lengths[:, None]] = PAD
    ids[:, 0] = CLS
    ids[np.arange(b), lengths - 1] = SEP
    has_b = rng.random(b) < 0.7
    ids[np.arange(b)[has_b], (lengths // 2)[has_b]] = SEP  # a second segment
    return ids, lengths


@pytest.mark.parametrize("prob,max_pred,cont_rate", [(0.15, 20, 0.35), (0.5, 12, 0.5), (0.3, 40, 0.0)])
def test_loader_span_mask_equals_oracle(prob, max_pred, cont_rate):
    """``dynamic_mask(mode="span")`` draws noise [B, S] (word k's visiting key is noise[r, k]),
    span_u [B, S] (word k's span length), actions [B, S] and the random ids, row-major; replayed
    through the oracle they give exactly its labels and ids."""
    rng = np.random.default_rng(11)
    b, s = 96, 64
    ids, lengths = _padded_batch(rng, b, s)
    cont_vocab = rng.random(VOCAB) < cont_rate
    seed = 4321
    out, labels = dynamic_mask(ids.copy(), lengths, SpecialIds(PAD, CLS, SEP, MASK), VOCAB,
                               np.random.default_rng(seed), prob, max_pred, cont_vocab, mode="span")
    replay = np.random.default_rng(seed)
    noise, span_u, action = replay.random((b, s)), replay.random((b, s)), replay.random((b, s))
    random_ids = iter(replay.integers(0, VOCAB, int(((labels != IGNORE_INDEX) & (action >= 0.9)).sum())))
    multi_word_spans = 0
    for r in range(b):
        n = int(lengths[r])
        row = ids[r, :n]
        special = np.isin(row, (CLS, SEP, PAD))
        words = candidate_words(special, cont_vocab[row])
        nw = len(words)
        pos = choose_span_positions(words, np.argsort(noise[r, :nw], kind="stable"), span_lengths(span_u[r, :nw]),
                                    masking_budget(n, prob, max_pred))
        assert np.flatnonzero(labels[r] != IGNORE_INDEX).tolist() == pos.tolist(), r
        u = action[r, pos]
        drawn = np.array([next(random_ids) if x >= 0.9 else -1 for x in u], np.int64)
        assert out[r, :n].tolist() == replace_masked(row, pos, u, drawn, MASK).tolist(), r
        assert (out[r, n:] == PAD).all()
        multi_word_spans += int(np.sum(np.diff(pos) == 1))
    assert multi_word_spans > b  # spans, not scattered words


def test_loader_replace_split_settings():
    rng = np.random.default_rng(2)
    ids, lengths = _padded_batch(rng, 64, 48)
    cont = rng.random(VOCAB) < 0.3
    for mode in ("token", "whole_word", "span"):
        out, labels = dynamic_mask(ids.copy(), lengths, SpecialIds(PAD, CLS, SEP, MASK), VOCAB, np.random.default_rng(5),
                                   0.3, 30, None if mode == "token" else cont, mode=mode, mask_replace_prob=1.0,
                                   random_replace_prob=0.0)
        chosen = labels != IGNORE_INDEX
        assert chosen.sum() > 200 and (out[chosen] == MASK).all() and (out[~chosen] == ids[~chosen]).all()
    # any split is the oracle's replacement of the same draws
    out, labels = dynamic_mask(ids.copy(), lengths, SpecialIds(PAD, CLS, SEP, MASK), VOCAB, np.random.default_rng(6),
                               0.3, 30, cont, mode="span", mask_replace_prob=0.5, random_replace_prob=0.3)
    replay = np.random.default_rng(6)
    replay.random(ids.shape), replay.random(ids.shape)
    action = replay.random(ids.shape)
    chosen = labels != IGNORE_INDEX
    rnd = chosen & (action >= 1.0 - 0.3)
    random_ids = replay.integers(0, VOCAB, int(rnd.sum()))
    expect = ids.copy()
    expect[chosen & (action < 0.5)] = MASK
    expect[rnd] = random_ids
    assert (out == expect).all() and 0 < (chosen & (action >= 0.5) & (action < 0.7)).sum()
    with pytest.raises(ValueError, match="masking_mode 'span' needs the vocab's continuation table"):
        dynamic_mask(ids.copy(), lengths, SpecialIds(PAD, CLS, SEP, MASK), VOCAB, rng, 0.3, 30, None, mode="span")


# ---------------------------------------------------------------- the pipeline's static masking


def _pipeline_rows(rng, m: int):
    la = rng.integers(3, 30, m)
    lb = np.where(rng.random(m) < 0.8, rng.integers(1, 30, m), 0)
    has_b = lb > 0
    lengths = la + 2 + np.where(has_b, lb + 1, 0)
    offs = np.concatenate(([0], np.cumsum(lengths)))
    rows = [[CLS, *rng.integers(10, VOCAB, a), SEP] + ([*rng.integers(10, VOCAB, bl), SEP] if bl else [])
            for a, bl in zip(la, lb)]
    return np.concatenate(rows).astype(np.uint16), offs, (la + 2).astype(np.uint16), has_b


def _params(**kw):
    from data_pipeline.instance_algorithm import InstanceParams

    base = dict(max_seq_length=128, short_seq_prob=0.1, objective="nsp", nsp_random_prob=0.5, masking="static",
                masked_lm_prob=0.15, max_predictions_per_seq=20, whole_word_mask=False, cls_id=CLS, sep_id=SEP,
                mask_id=MASK, vocab_size=VOCAB)
    return InstanceParams(**{**base, **kw})


def test_pipeline_span_mask_equals_oracle_draw_for_draw():
    """The pipeline's static span masking (``_mask_rows_words``, which its native twin replays):
    one Generator for all rows; per row a permutation of the words, one length uniform per word,
    then one uniform and one id per chosen position."""
    from data_pipeline.instance_algorithm import _mask_rows_words

    rng = np.random.default_rng(5)
    flat, offs, num_a, has_b = _pipeline_rows(rng, 40)
    cont_vocab = rng.random(VOCAB) < 0.35
    p = _params(masking_mode="span", masked_lm_prob=0.3, max_predictions_per_seq=12)
    out, mpos, mids, moffs = _mask_rows_words(flat, offs, num_a, has_b, np.random.default_rng(9), p, cont_vocab)
    replay = np.random.default_rng(9)
    for r in range(40):
        s, e = offs[r], offs[r + 1]
        row = flat[s:e]
        special = np.zeros(e - s, bool)
        special[[0, num_a[r] - 1, e - s - 1]] = True
        words = candidate_words(special, cont_vocab[row])
        order = replay.permutation(len(words))
        pos = choose_span_positions(words, order, span_lengths(replay.random(len(words))),
                                    masking_budget(int(e - s), 0.3, 12))
        sl = slice(moffs[r], moffs[r + 1])
        assert mpos[sl].tolist() == pos.tolist(), r
        assert mids[sl].tolist() == row[pos].tolist()
        u, rid = replay.random(pos.size), replay.integers(0, VOCAB, size=pos.size)
        assert out[s:e].tolist() == replace_masked(row, pos, u, rid, MASK).tolist(), r


def test_pipeline_token_mask_all_mask_split():
    from data_pipeline.instance_algorithm import _mask_rows

    flat, offs, num_a, has_b = _pipeline_rows(np.random.default_rng(1), 30)
    out, mpos, mids, moffs = _mask_rows(flat, offs, num_a, has_b, np.random.default_rng(2),
                                        _params(mask_replace_prob=1.0, random_replace_prob=0.0))
    chosen = np.repeat(offs[:-1], np.diff(moffs)) + mpos
    assert chosen.size > 30 and (out[chosen] == MASK).all() and (mids == flat[chosen]).all()
    rest = np.setdiff1d(np.arange(flat.size), chosen)
    assert (out[rest] == flat[rest]).all()


@needs_native
@pytest.mark.parametrize("objective", ["nsp", "sop", "none"])
def test_native_twin_does_span_masking_bitwise(objective):
    from tests.data_pipeline.test_instance_native import assert_same, continuation_table, make_source, params, \
        synthetic_docs

    docs = synthetic_docs(seed=4)
    for kw, rate in ((dict(), 0.35), (dict(masked_lm_prob=0.4, max_predictions_per_seq=30), 0.5),
                     (dict(max_predictions_per_seq=0), 0.35), (dict(), 0.0), (dict(), 0.9),
                     (dict(mask_replace_prob=1.0, random_replace_prob=0.0), 0.3),
                     (dict(mask_replace_prob=0.5, random_replace_prob=0.3), 0.3)):
        for seq in (16, 128):
            p = params(objective=objective, max_seq_length=seq, masking_mode="span", **kw)
            assert assert_same(docs, p, seed=5, dupes=2, source=make_source(docs, 5),
                               continuation=continuation_table(p.vocab_size, rate=rate)) > 0
    # the replacement split in the other two modes too
    for mode in ("token", "whole_word"):
        p = params(objective=objective, masking_mode=mode, mask_replace_prob=0.6, random_replace_prob=0.4)
        assert assert_same(docs, p, seed=6, dupes=2, source=make_source(docs, 6),
                           continuation=continuation_table(p.vocab_size)) > 0


@needs_native
def test_native_masking_arguments_are_checked():
    from tests.data_pipeline.test_instance_native import doc

    ext = instance_native._ext
    _, ids, bounds = doc("d", [4, 5, 6], np.random.default_rng(0))
    seeds, _, masks = instance_native.dupe_seeds("d", 1, 1)
    kw = dict(max_seq_length=32, short_seq_prob=0.1, objective="nsp", nsp_random_prob=0.5, masking="static",
              masked_lm_prob=0.15, max_predictions_per_seq=5, whole_word_mask=False, cls_id=101, sep_id=102,
              mask_id=103, vocab_size=30522, negatives=None, doc_index=-1)
    for over, message in [
        (dict(masking_mode="spans"), "masking_mode: expected token, whole_word or span, got 'spans'"),
        (dict(masking_mode="span", whole_word_mask=True), "masking_mode: 'span' disagrees with whole_word_mask=True"),
        (dict(masking_mode="whole_word"), "masking_mode: 'whole_word' disagrees with whole_word_mask=False"),
        (dict(masking_mode="span"), "continuation: span masking needs the vocab's continuation mask, got None"),
        (dict(mask_replace_prob=0.95, random_replace_prob=0.1),
         r"mask_replace_prob 0\.950000 and random_replace_prob 0\.100000: expected each in \[0, 1\], adding up to at most 1"),
        (dict(random_replace_prob=-0.1), "random_replace_prob -0.100000"),
    ]:
        with pytest.raises(ValueError, match=message):
            ext.build_document(ids, bounds, seeds, seeds, masks, **{**kw, **over})


# ---------------------------------------------------------------- settings


def test_masking_mode_and_whole_word_mask_resolve_or_disagree():
    assert resolve_masking_mode(None, None) is None
    assert resolve_masking_mode(None, True) == "whole_word" and resolve_masking_mode(None, False) == "token"
    assert resolve_masking_mode("span", None) == "span" and resolve_masking_mode("whole_word", True) == "whole_word"
    with pytest.raises(ValueError, match="data.masking_mode is 'span' but data.whole_word_mask is True"):
        resolve_masking_mode("span", True, "data.")
    with pytest.raises(ValueError, match="masking_mode is 'whole_word' but whole_word_mask is False"):
        resolve_masking_mode("whole_word", False)


def test_build_config_masking_settings():
    from data_pipeline.config import BuildConfig

    assert BuildConfig().resolved_masking_mode == "token"
    assert BuildConfig(whole_word_mask=True).resolved_masking_mode == "whole_word"
    assert BuildConfig(masking_mode="span").resolved_masking_mode == "span"
    with pytest.raises(ConfigError, match="masking_mode is 'token' but whole_word_mask is True"):
        BuildConfig(masking_mode="token", whole_word_mask=True)
    with pytest.raises(ConfigError, match="mask_replace_prob 0.9 and random_replace_prob 0.2 .* add up to 1.1"):
        BuildConfig(mask_replace_prob=0.9, random_replace_prob=0.2)
    with pytest.raises(ValueError, match="whole_word_mask=True only with whole_word"):
        _params(whole_word_mask=True, masking_mode="span")


def test_loader_config_masking_settings_and_the_manifest():
    from bertdist.train.config import LoaderConfig
    from bertdist.train.loader import records_masking_mode

    with pytest.raises(ConfigError, match="data.masking_mode is 'span' but data.whole_word_mask is False"):
        LoaderConfig(masking_mode="span", whole_word_mask=False)
    with pytest.raises(ConfigError, match="data.mask_replace_prob 1.0 and data.random_replace_prob 0.1"):
        LoaderConfig(mask_replace_prob=1.0)
    LoaderConfig(mask_replace_prob=1.0, random_replace_prob=0.0)
    old = {"whole_word_mask": True}  # records written before masking_mode
    assert records_masking_mode(LoaderConfig(), old) == "whole_word"
    assert records_masking_mode(LoaderConfig(), {"whole_word_mask": False}) == "token"
    assert records_masking_mode(LoaderConfig(), {"masking_mode": "span", "whole_word_mask": False}) == "span"
    assert records_masking_mode(LoaderConfig(masking_mode="span"), old) == "span"
    assert records_masking_mode(LoaderConfig(whole_word_mask=False), {"masking_mode": "span"}) == "token"


# ---------------------------------------------------------------- a Beam build, read by the trainer's loader


@pytest.mark.parametrize("masking", ["static", "dynamic"])
def test_span_records_from_a_beam_build_feed_the_loader(tmp_path, small_vocab, masking):
    """The bundled books and wiki sample through the whole pipeline with masking_mode span: the
    manifest records it, the loader resolves it (auto masking), and its batches mask whole-word
    spans within the budget; static masks are the records' own."""
    from bertdist.data import continuation_mask
    from bertdist.train.config import LoaderConfig
    from bertdist.train.loader import LoaderState, PretrainingLoader, open_training_records
    from data_pipeline import build_records
    from tests.conftest import SAMPLES

    manifest = build_records([f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"], tmp_path / "rec",
                             small_vocab, max_seq_length=64, dupe_factor=1, num_shards=2, heldout_fraction=0.1,
                             masking=masking, masking_mode="span", masked_lm_prob=0.3, max_predictions_per_seq=19,
                             objective="none")
    cfg = LoaderConfig(train_manifest=str(manifest), vocab_file=str(small_vocab), max_seq_length=64,
                       micro_batch_size=32, global_batch_size=64)
    src = open_training_records(cfg.train_manifest, cfg.vocab_file, 64)
    rec = src.manifest["records"]
    assert (rec["masking_mode"], rec["whole_word_mask"], rec["masking"]) == ("span", False, masking)
    cont = continuation_mask(small_vocab)
    if masking == "static":  # masked records are never masked again
        with pytest.raises(ConfigError, match="data.masking=dynamic but the records of .* are already masked"):
            PretrainingLoader(src, dataclasses.replace(cfg, masking="dynamic"), rank=0, world_size=1, grad_accum=2,
                              continuation=cont)
    loader = PretrainingLoader(src, cfg, rank=0, world_size=1, grad_accum=2, continuation=cont)
    assert loader.dynamic == (masking == "dynamic") and loader.masking_mode == "span"
    runs = total = rows = 0
    for batch in loader.micro_batches(LoaderState()):
        assert "next_sentence_label" not in batch
        ids, labels, att = batch["input_ids"].numpy(), batch["labels"].numpy(), batch["attention_mask"].numpy()
        chosen = labels != IGNORE_INDEX
        orig = np.where(chosen, labels, ids)
        for r in range(ids.shape[0]):
            n = int(att[r].sum())
            special = np.isin(orig[r, :n], [loader.special.cls, loader.special.sep])
            pos = np.flatnonzero(chosen[r, :n])
            assert not special[pos].any() and 0 < pos.size <= masking_budget(n, 0.3, 19)
            for w in candidate_words(special, cont[orig[r, :n]]):
                assert np.isin(w, pos).all() or not np.isin(w, pos).any()
            runs += int(np.sum(np.diff(pos) > 1)) + 1
            total += pos.size
            rows += 1
    assert rows == 64 and total / runs > 2.0  # spans of several tokens, not single words
