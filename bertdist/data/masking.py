"""MLM masking with google-research/bert semantics, on numpy id arrays.

One implementation for both uses: the pipeline calls it for static masking, the trainer's
loader for dynamic masking. Per sequence: ``num_to_predict = min(max_predictions,
max(1, round(len * masked_lm_prob)))`` (len counts [CLS]/[SEP]); candidates are all non-special
positions (whole words under whole-word masking: a word is a start piece plus its following
'##' pieces, never crossing a special token); candidates are taken in random order, a word that
would overshoot the budget is skipped; each chosen position becomes [MASK] 80%, itself 10%,
a uniformly random vocab id 10%.
"""
from __future__ import annotations

import numpy as np


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

    ``special``: bool array, True at positions never masked ([CLS], [SEP], padding).
    ``continuation``: bool array over positions (True = '##' piece) to mask whole words;
    None = token-level masking.
    """
    n = ids.shape[0]
    budget = min(max_predictions, max(1, int(round(n * masked_lm_prob))))
    cand = np.flatnonzero(~special)
    if cand.size == 0:
        return ids.copy(), np.empty(0, np.int64), np.empty(0, ids.dtype)
    if continuation is None:
        k = min(budget, cand.size)
        positions = np.sort(rng.choice(cand, size=k, replace=False))
    else:
        # word starts: a candidate that is not a continuation piece, or whose predecessor is special
        cont = continuation[cand] & np.concatenate(([False], np.diff(cand) == 1))
        starts = np.flatnonzero(~cont)
        lengths = np.diff(np.append(starts, cand.size))
        order = rng.permutation(starts.size)
        chosen = []
        total = 0
        for w in order:
            if total >= budget:
                break
            ln = lengths[w]
            if total + ln > budget:
                continue
            chosen.append(w)
            total += ln
        if chosen:
            idx = np.concatenate([np.arange(starts[w], starts[w] + lengths[w]) for w in chosen])
            positions = np.sort(cand[idx])
        else:
            positions = np.empty(0, np.int64)
    labels = ids[positions]
    out = ids.copy()
    u = rng.random(positions.size)
    rand_ids = rng.integers(0, vocab_size, size=positions.size)
    out[positions[u < 0.8]] = mask_id
    rnd = u >= 0.9
    out[positions[rnd]] = rand_ids[rnd].astype(ids.dtype)
    return out, positions, labels


def mask_batch(
    input_ids: np.ndarray,
    lengths: np.ndarray,
    rng: np.random.Generator,
    *,
    special_ids: tuple[int, ...] | np.ndarray,
    masked_lm_prob: float,
    max_predictions: int,
    mask_id: int,
    vocab_size: int,
    continuation_vocab: np.ndarray | None = None,
    ignore_index: int = -100,
) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic masking of a padded batch ``[B, S]`` for the loader.

    Returns (masked ids ``[B, S]``, labels ``[B, S]`` with ``ignore_index`` where not predicted).
    ``continuation_vocab`` (from :func:`bertdist.data.continuation_mask`) enables whole-word masking.
    """
    out = input_ids.copy()
    labels = np.full(input_ids.shape, ignore_index, dtype=np.int64)
    special_ids = np.asarray(special_ids)
    for b in range(input_ids.shape[0]):
        n = int(lengths[b])
        row = input_ids[b, :n]
        special = np.isin(row, special_ids)
        cont = continuation_vocab[row] if continuation_vocab is not None else None
        masked, pos, lab = mask_sequence(
            row, rng, special=special, masked_lm_prob=masked_lm_prob, max_predictions=max_predictions,
            mask_id=mask_id, vocab_size=vocab_size, continuation=cont,
        )
        out[b, :n] = masked
        labels[b, pos] = lab
    return out, labels
