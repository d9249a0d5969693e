"""MLM masking with google-research/bert semantics: the oracle, one readable sequence at a time.

Two vectorised implementations follow these rules for speed, and their tests replay their random
draws through the functions here and demand the same positions and ids (tests/data/test_masking.py):
the pipeline's static masking (``data_pipeline/instance_algorithm.py``, and its C++ twin) and the trainer
loader's dynamic masking (``bertdist/train/masking.py``). The pipeline's whole-word masking calls
:func:`mask_sequence` itself.

The rules, per sequence:
- the budget is ``min(max_predictions, max(1, round(len * masked_lm_prob)))``, ``len`` counting
  [CLS]/[SEP];
- candidates are the non-special positions, grouped into words: a word is a start piece plus its
  following '##' pieces (under whole-word masking; otherwise every token is a word), and never
  crosses a special token;
- words are visited in a random order and taken while they fit: one that would overshoot the
  budget is skipped, and the visit stops once the budget is reached;
- each chosen position becomes [MASK] with probability 0.8, a uniformly random vocab id with 0.1,
  and stays itself with 0.1.
"""
from __future__ import annotations

import numpy as np


def masking_budget(length: int, masked_lm_prob: float, max_predictions: int) -> int:
    """How many positions a sequence of ``length`` tokens (specials included) should predict."""
    return min(max_predictions, max(1, int(round(length * masked_lm_prob))))


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


def replace_masked(ids: np.ndarray, positions: np.ndarray, u: np.ndarray, random_ids: np.ndarray,
                   mask_id: int) -> np.ndarray:
    """80/10/10: position ``positions[i]`` becomes ``mask_id`` if ``u[i] < 0.8``, ``random_ids[i]``
    if ``u[i] >= 0.9``, and keeps its id otherwise. Returns a copy of ``ids``."""
    out = ids.copy()
    out[positions[u < 0.8]] = mask_id
    rnd = u >= 0.9
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask one sequence. Returns (masked ids, sorted positions, original ids at positions).

    Draws, in this order: a permutation of the words, then one uniform and one vocab id per chosen
    position (the pipeline's native builder replays exactly this sequence)."""
    words = candidate_words(special, continuation)
    if not words:
        return ids.copy(), np.empty(0, np.int64), np.empty(0, ids.dtype)
    budget = masking_budget(ids.shape[0], masked_lm_prob, max_predictions)
    positions = choose_masked_positions(words, rng.permutation(len(words)), budget)
    u = rng.random(positions.size)
    random_ids = rng.integers(0, vocab_size, size=positions.size)
    return replace_masked(ids, positions, u, random_ids, mask_id), positions, ids[positions]
