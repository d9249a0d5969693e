"""MLM masking with google-research/bert semantics: the oracle, one readable sequence at a time.

Two vectorised implementations follow these rules for speed, and their tests replay their random
draws through the functions here and demand the same positions and ids (tests/data/test_masking.py,
tests/data/test_span_masking.py): the pipeline's static masking (``data_pipeline/instance_algorithm.py``,
and its C++ twin) and the trainer loader's dynamic masking (``bertdist/train/masking.py``). The
pipeline's whole-word and span masking call :func:`mask_sequence` itself.

The rules, per sequence:
- the budget is ``min(max_predictions, max(1, round(len * masked_lm_prob)))``, ``len`` counting
  [CLS]/[SEP];
- candidates are the non-special positions, grouped into words: a word is a start piece plus its
  following '##' pieces (masking modes ``whole_word`` and ``span``; under ``token`` every token is
  a word), and never crosses a special token;
- ``token`` and ``whole_word``: words are visited in a random order and taken while they fit: one
  that would overshoot the budget is skipped, and the visit stops once the budget is reached;
- ``span`` (SpanBERT, Joshi et al. 2020): words are visited in a random order as span starts, each
  with its own span length in words, drawn from a geometric distribution (p = 0.2) truncated at 10
  words and renormalised, as SpanBERT draws it (mean 3.80 words). A visited word already inside an
  earlier span is passed over. A span takes its start word and the words after it while it has
  fewer words than its length, the next word is in the same segment (no [CLS]/[SEP] between them)
  and not yet masked, and the budget still holds that word whole; so a span that would overshoot
  is cut back to the longest run of whole words that fits, and one whose first word alone would
  overshoot is skipped (a later, shorter start may still fit). The visit stops once the budget is
  reached. Spans never split a word nor cross a special token, and never overlap;
- the budget is exact under ``token`` (all candidates when fewer); under ``whole_word`` and
  ``span`` the masked count falls short of it only when every word not masked is longer than what
  is left of it (so it is exact whenever a one-piece word is left unmasked): whole words are never
  cut to fill it. SpanBERT fills the budget exactly by cutting the last span inside a word; whole
  words are kept here, as in the whole-word mode, so the two differ only in how words are grouped;
- each chosen position becomes [MASK] with probability ``mask_replace_prob`` (0.8), a uniformly
  random vocab id with ``random_replace_prob`` (0.1), and stays itself otherwise: per token in
  every mode. SpanBERT decides once per span; per token keeps one replacement rule and one draw
  layout for all modes (and the native twin's code shared), so comparing modes changes only
  which positions are chosen.
"""
from __future__ import annotations

import numpy as np

MASKING_MODES = ("token", "whole_word", "span")
# SpanBERT's span lengths: geometric with p = 0.2, truncated at 10 words and renormalised
SPAN_GEOMETRIC_P = 0.2
SPAN_MAX_WORDS = 10


def resolve_masking_mode(masking_mode: str | None, whole_word_mask: bool | None, where: str = "") -> str | None:
    """The masking mode of a config that may set ``masking_mode`` and the older ``whole_word_mask``
    (True means ``whole_word``, False ``token``). None when neither is set. Both set and meaning
    different modes is a ValueError naming both (``where`` prefixes the keys, e.g. ``"data."``)."""
    if masking_mode is not None and masking_mode not in MASKING_MODES:
        raise ValueError(f"{where}masking_mode {masking_mode!r} is not one of {list(MASKING_MODES)}")
    if whole_word_mask is None:
        return masking_mode
    implied = "whole_word" if whole_word_mask else "token"
    if masking_mode is not None and masking_mode != implied:
        raise ValueError(f"{where}masking_mode is {masking_mode!r} but {where}whole_word_mask is {whole_word_mask} "
                         f"(which means {implied!r}); set masking_mode alone (whole_word_mask: true is "
                         "masking_mode: whole_word, false is token)")
    return implied


def check_replace_probs(mask_replace_prob: float, random_replace_prob: float, where: str = "") -> None:
    """ValueError unless both are in [0, 1] and add up to at most 1 (the rest keeps its token)."""
    if not (0.0 <= mask_replace_prob <= 1.0 and 0.0 <= random_replace_prob <= 1.0
            and mask_replace_prob + random_replace_prob <= 1.0):
        raise ValueError(f"{where}mask_replace_prob {mask_replace_prob} and {where}random_replace_prob "
                         f"{random_replace_prob} must each be in [0, 1] and add up to at most 1 "
                         f"(they add up to {mask_replace_prob + random_replace_prob})")


def default_max_predictions(masked_lm_prob: float, max_seq_length: int) -> int:
    """max_predictions_per_seq when a config leaves it unset: ceil(rate x length), at least 1, so
    the rate holds at every length (20 at 0.15 x 128; 2,458 at 0.30 x 8,192). Rounded first:
    0.15 x 128 is 19.200000000000003 in floating point."""
    import math

    return max(1, math.ceil(round(masked_lm_prob * max_seq_length, 6)))


def masking_budget(length: int, masked_lm_prob: float, max_predictions: int) -> int:
    """How many positions a sequence of ``length`` tokens (specials included) should predict."""
    return min(max_predictions, max(1, int(round(length * masked_lm_prob))))


def span_length_cdf(p: float = SPAN_GEOMETRIC_P, max_words: int = SPAN_MAX_WORDS) -> np.ndarray:
    """``P(length <= k)`` for k = 1 .. max_words: the geometric distribution ``p (1 - p)^(k - 1)``
    truncated at ``max_words`` and renormalised. Plain sums and products in this order, which the
    native twin repeats, so both get the same doubles (the last is exactly 1.0)."""
    weights, w = [], p
    for _ in range(max_words):
        weights.append(w)
        w *= 1.0 - p
    total = 0.0
    for w in weights:
        total += w
    cdf, acc = [], 0.0
    for w in weights:
        acc += w
        cdf.append(acc / total)
    return np.array(cdf)


_SPAN_CDF = span_length_cdf()


def span_lengths(u: np.ndarray) -> np.ndarray:
    """Span lengths in words from uniform draws ``u`` in [0, 1) by the inverse of
    :func:`span_length_cdf`: ``1 + #{k : cdf[k] <= u}``, any shape."""
    return 1 + np.searchsorted(_SPAN_CDF, u, side="right")


def candidate_words(special: np.ndarray, continuation: np.ndarray | None = None) -> list[np.ndarray]:
    """The maskable words of a sequence, in order, as arrays of positions.

    ``special``: bool per position, True where nothing may be masked ([CLS], [SEP], padding).
    ``continuation``: bool per position, True at '##' pieces; None = every token is a word."""
    cand = np.flatnonzero(~special)
    if continuation is None:
        return [cand[i:i + 1] for i in range(cand.size)]
    # a word starts at a candidate that is not a continuation piece or does not follow a candidate
    follows = np.concatenate(([False], np.diff(cand) == 1))
    starts = np.flatnonzero(~(continuation[cand] & follows))
    return np.split(cand, starts[1:]) if cand.size else []


def choose_masked_positions(words: list[np.ndarray], word_order, budget: int) -> np.ndarray:
    """Visit ``words`` in ``word_order``; take each that fits in what is left of ``budget``.
    Returns the chosen positions, sorted."""
    chosen, total = [], 0
    for w in word_order:
        if total >= budget:
            break
        if total + words[w].size > budget:
            continue  # would overshoot: skipped, a shorter word may still fit
        chosen.append(words[w])
        total += words[w].size
    return np.sort(np.concatenate(chosen)) if chosen else np.empty(0, np.int64)


def choose_span_positions(words: list[np.ndarray], word_order, span_words, budget: int) -> np.ndarray:
    """Span masking: visit ``words`` in ``word_order`` as span starts; a span from word ``w`` wants
    ``span_words[w]`` words (see the module docstring for the rule). Returns the chosen positions,
    sorted."""
    n = len(words)
    taken = np.zeros(n, bool)
    chosen, total = [], 0
    for w in word_order:
        if total >= budget:
            break
        if taken[w] or total + words[w].size > budget:
            continue  # inside an earlier span, or its first word alone would overshoot
        end, size = w + 1, words[w].size
        while (end < n and end - w < span_words[w] and not taken[end]
               and words[end][0] == words[end - 1][-1] + 1  # no special token between them
               and total + size + words[end].size <= budget):
            size += words[end].size
            end += 1
        taken[w:end] = True
        chosen.extend(words[w:end])
        total += size
    return np.sort(np.concatenate(chosen)) if chosen else np.empty(0, np.int64)


def replace_masked(ids: np.ndarray, positions: np.ndarray, u: np.ndarray, random_ids: np.ndarray,
                   mask_id: int, mask_replace_prob: float = 0.8, random_replace_prob: float = 0.1) -> np.ndarray:
    """80/10/10 by default: position ``positions[i]`` becomes ``mask_id`` if
    ``u[i] < mask_replace_prob``, ``random_ids[i]`` if ``u[i] >= 1 - random_replace_prob``, and
    keeps its id otherwise. Returns a copy of ``ids``."""
    out = ids.copy()
    out[positions[u < mask_replace_prob]] = mask_id
    rnd = u >= 1.0 - random_replace_prob
    out[positions[rnd]] = np.asarray(random_ids)[rnd].astype(ids.dtype)
    return out


def mask_sequence(
    ids: np.ndarray,
    rng: np.random.Generator,
    *,
    special: np.ndarray,
    masked_lm_prob: float,
    max_predictions: int,
    mask_id: int,
    vocab_size: int,
    continuation: np.ndarray | None = None,
    mode: str | None = None,
    mask_replace_prob: float = 0.8,
    random_replace_prob: float = 0.1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask one sequence. Returns (masked ids, sorted positions, original ids at positions).

    ``mode``: ``token``, ``whole_word`` or ``span``; None is ``whole_word`` with a
    ``continuation`` and ``token`` without. ``span`` groups words by ``continuation`` when given
    (else every token is a word).

    Draws, in this order: a permutation of the words; under ``span`` one uniform per word (its
    span length, :func:`span_lengths`); then one uniform and one vocab id per chosen position (the
    pipeline's native builder replays exactly this sequence). No draw at all without words."""
    if mode is None:
        mode = "token" if continuation is None else "whole_word"
    if mode not in MASKING_MODES:
        raise ValueError(f"mode {mode!r} is not one of {list(MASKING_MODES)}")
    if mode == "whole_word" and continuation is None:
        raise ValueError("whole-word masking needs the continuation mask ('##' pieces), got None")
    words = candidate_words(special, None if mode == "token" else continuation)
    if not words:
        return ids.copy(), np.empty(0, np.int64), np.empty(0, ids.dtype)
    budget = masking_budget(ids.shape[0], masked_lm_prob, max_predictions)
    order = rng.permutation(len(words))
    if mode == "span":
        positions = choose_span_positions(words, order, span_lengths(rng.random(len(words))), budget)
    else:
        positions = choose_masked_positions(words, order, budget)
    u = rng.random(positions.size)
    random_ids = rng.integers(0, vocab_size, size=positions.size)
    masked = replace_masked(ids, positions, u, random_ids, mask_id, mask_replace_prob, random_replace_prob)
    return masked, positions, ids[positions]
