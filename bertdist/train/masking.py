"""Vectorised BERT masking and collation of variable-length records into padded batches.

Everything works on whole batches with numpy (no per-sequence Python loop), so
collation plus dynamic masking stays far ahead of the GPU (see
benchmarks/loader.py).

Masking (Devlin et al.): choose ``k = min(max_predictions, max(1, round(n * p)))``
of the ``n`` maskable tokens (everything but [CLS], [SEP] and padding); of the
chosen, 80% become [MASK], 10% a random token, 10% stay (``mask_replace_prob`` /
``random_replace_prob``). With whole-word masking, a word (a piece plus its
following "##" pieces) is chosen or skipped as a unit: words are visited in a
random order and taken while they fit in ``k``. With span masking (SpanBERT),
the visited words start spans of whole words, of geometric lengths, cut back to
fit ``k``. These are the rules of the oracle ``bertdist.data.masking``, which
masks one sequence at a time; this version works on whole batches for the
loader's speed, and tests/data/test_masking.py and test_span_masking.py replay
its random draws through the oracle and require identical labels and ids.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from bertdist.data.masking import MASKING_MODES, SPAN_MAX_WORDS, span_lengths
from bertdist.model.config import IGNORE_INDEX


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    pad: int
    cls: int
    sep: int
    mask: int


def special_ids_from_manifest(ids: dict[str, int]) -> SpecialIds:
    """From the manifest's ``special_token_ids`` ({'pad','cls','sep','mask',...} -> id)."""
    return SpecialIds(int(ids["pad"]), int(ids["cls"]), int(ids["sep"]), int(ids["mask"]))


def pad_rows(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int, pad: int) -> np.ndarray:
    """Gather variable-length rows ``flat[starts[i] : starts[i] + lengths[i]]`` into an int64 [B, width] array."""
    cols = np.arange(width, dtype=np.int64)
    real = cols[None, :] < lengths[:, None]
    idx = np.where(real, starts[:, None] + cols[None, :], 0)
    out = flat[idx].astype(np.int64)
    out[~real] = pad
    return out


def dynamic_mask(
    input_ids: np.ndarray,
    lengths: np.ndarray,
    special: SpecialIds,
    vocab_size: int,
    rng: np.random.Generator,
    mask_prob: float,
    max_predictions: int,
    continuation: np.ndarray | None = None,
    *,
    mode: str | None = None,
    mask_replace_prob: float = 0.8,
    random_replace_prob: float = 0.1,
    replace_ids: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Mask ``input_ids`` [B, S] in place; returns (input_ids, labels) with labels = IGNORE_INDEX where not predicted.

    ``replace_ids``: the ids a random replacement draws from (None: every id below ``vocab_size``,
    as BERT); the draws are the same either way, ``replace_ids[draw]`` with ``len(replace_ids)``
    for ``vocab_size``.

    The oracle's rules (``bertdist.data.masking``): budget ``min(max_predictions, max(1, round(len * p)))``
    with ``len`` counting [CLS]/[SEP]; words are visited in the order of their ``noise`` draw and one
    that would overshoot the budget is skipped. ``mode``: ``token``, ``whole_word`` or ``span``;
    None is ``whole_word`` with a ``continuation`` ("##" table over the vocab) and ``token``
    without. ``whole_word`` and ``span`` need ``continuation``.

    Draws: ``noise`` [B, S] (word k's visiting key is ``noise[:, k]``; under ``token`` each
    position's own), under ``span`` ``span_u`` [B, S] (word k's span length from ``span_u[:, k]``),
    then ``action`` [B, S] (the replacement of each chosen position) and the random ids, row-major.
    """
    if mode is None:
        mode = "token" if continuation is None else "whole_word"
    if mode not in MASKING_MODES:
        raise ValueError(f"mode {mode!r} is not one of {list(MASKING_MODES)}")
    if mode != "token" and continuation is None:
        raise ValueError(f"masking_mode {mode!r} needs the vocab's continuation table ('##' pieces), got None")
    b, s = input_ids.shape
    cols = np.arange(s)
    real = cols[None, :] < lengths[:, None]
    maskable = real & (input_ids != special.cls) & (input_ids != special.sep) & (input_ids != special.pad)
    n = maskable.sum(1)
    k = np.minimum(max_predictions, np.maximum(1, np.rint(lengths * mask_prob).astype(np.int64)))
    k = np.minimum(k, n)
    noise = rng.random((b, s))
    if mode == "token":
        # k uniformly random maskable positions per row: the k smallest noise values.
        score = np.where(maskable, noise, np.inf)
        order = np.argsort(score, axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.broadcast_to(cols, (b, s)), axis=1)
        chosen = rank < k[:, None]
    else:
        # A word starts at a maskable token that is not a "##" piece or follows a non-maskable one.
        prev_maskable = np.concatenate([np.zeros((b, 1), bool), maskable[:, :-1]], axis=1)
        starts = maskable & (~continuation[input_ids] | ~prev_maskable)
        word = np.where(maskable, np.cumsum(starts, axis=1) - 1, s)  # s = "no word" bucket
        n_words = starts.sum(1)
        flat = (np.arange(b)[:, None] * (s + 1) + word).ravel()
        wlen = np.bincount(flat, minlength=b * (s + 1)).reshape(b, s + 1)
        wlen[:, s] = 0
        wscore = np.where(cols[None, :] < n_words[:, None], noise, np.inf)
        order = np.argsort(wscore, axis=1, kind="stable")  # random visiting order of the words
        if mode == "whole_word":
            word_taken = _take_words(order, wlen[:, :s], n_words, k)
        else:
            word_taken = _take_spans(order, wlen, n_words, k, starts, word, prev_maskable,
                                     span_lengths(rng.random((b, s))))
        chosen = np.take_along_axis(word_taken, word, axis=1) & maskable
    labels = np.where(chosen, input_ids, IGNORE_INDEX)
    action = rng.random((b, s))
    to_mask = chosen & (action < mask_replace_prob)
    to_random = chosen & (action >= 1.0 - random_replace_prob)
    input_ids[to_mask] = special.mask
    n_rand = int(to_random.sum())
    if n_rand:
        if replace_ids is None:
            input_ids[to_random] = rng.integers(0, vocab_size, n_rand)
        else:
            input_ids[to_random] = replace_ids[rng.integers(0, len(replace_ids), n_rand)]
    return input_ids, labels


def _take_words(order: np.ndarray, wlen: np.ndarray, n_words: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Whole words: visit the words of each row in ``order`` and take each that fits in what is
    left of ``k``. Returns taken [B, S + 1] by word index (the last column, "no word", False)."""
    b, s = order.shape
    sorted_len = np.take_along_axis(wlen, order, axis=1)
    taken_sorted = np.zeros((b, s), bool)
    total = np.zeros(b, np.int64)
    for j in range(int(n_words.max(initial=0))):
        fits = (j < n_words) & (total < k) & (total + sorted_len[:, j] <= k)
        taken_sorted[:, j] = fits
        total += np.where(fits, sorted_len[:, j], 0)
        if (total >= k).all():
            break
    word_taken = np.zeros((b, s + 1), bool)
    np.put_along_axis(word_taken, order, taken_sorted, axis=1)
    return word_taken


def _take_spans(order: np.ndarray, wlen: np.ndarray, n_words: np.ndarray, k: np.ndarray, starts: np.ndarray,
                word: np.ndarray, prev_maskable: np.ndarray, span_words: np.ndarray) -> np.ndarray:
    """Spans of whole words, all rows at once: the j-th visit of every row in step j, and a span
    grown one word per inner step (at most SPAN_MAX_WORDS - 1), as the oracle's
    ``choose_span_positions``. ``wlen`` [B, S + 1] and the result are by word index."""
    b, s = order.shape
    rows = np.arange(b)
    # same_segment[r, w]: word w directly follows word w - 1 (no special token between them)
    same_segment = np.zeros((b, s + 1), bool)
    r_idx, c_idx = np.nonzero(starts)
    same_segment[r_idx, word[r_idx, c_idx]] = prev_maskable[r_idx, c_idx]
    taken = np.zeros((b, s + 1), bool)
    total = np.zeros(b, np.int64)
    for j in range(int(n_words.max(initial=0))):
        w = order[:, j]
        wc = np.minimum(w, s)
        grow = (j < n_words) & (total < k) & ~taken[rows, wc] & (total + wlen[rows, wc] <= k)
        size = np.where(grow, wlen[rows, wc], 0)
        taken[rows[grow], wc[grow]] = True
        want = span_words[rows, wc]
        for t in range(1, SPAN_MAX_WORDS):
            nxt = np.minimum(w + t, s)  # s: the "no word" column, never taken, never same segment
            grow &= ((t < want) & (w + t < n_words) & ~taken[rows, nxt] & same_segment[rows, nxt]
                     & (total + size + wlen[rows, nxt] <= k))
            if not grow.any():
                break
            size += np.where(grow, wlen[rows, nxt], 0)
            taken[rows[grow], nxt[grow]] = True
        total += size
        if (total >= k).all():
            break
    return taken


def static_labels(
    shape: tuple[int, int],
    pos_flat: np.ndarray,
    ids_flat: np.ndarray,
    pos_starts: np.ndarray,
    pos_lengths: np.ndarray,
) -> np.ndarray:
    """Labels [B, S] from records that carry their masks (masked_lm_positions / masked_lm_ids)."""
    b, s = shape
    labels = np.full((b, s), IGNORE_INDEX, dtype=np.int64)
    total = int(pos_lengths.sum())
    if total:
        row = np.repeat(np.arange(b), pos_lengths)
        within = np.arange(total) - np.repeat(np.cumsum(pos_lengths) - pos_lengths, pos_lengths)
        src = np.repeat(pos_starts, pos_lengths) + within
        cols = pos_flat[src].astype(np.int64)
        if cols.max() >= s:
            raise ValueError(f"masked_lm_positions reach {cols.max()}, beyond the sequence width {s}")
        labels[row, cols] = ids_flat[src]
    return labels
