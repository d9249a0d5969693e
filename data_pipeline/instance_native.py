"""The native bridge of the instance algorithm: all dupes of one document in one C++ call.

``data_pipeline._native_instances`` (csrc/data_pipeline/instances.cpp, a plain pybind11
module: no torch) is the fast twin of :func:`data_pipeline.instance_algorithm.create_instances`; that
Python code stays the readable reference and the test oracle, and the two give bitwise the same
InstanceBatch and InstanceStats. This module loads the extension when it is built, packs a
bucket's NegativeSource once (the extension checks it once, not per document), derives the
per-dupe seeds exactly as the reference does (``derive_seed``), and turns the extension's
columns into an InstanceBatch.
"""
from __future__ import annotations

import hashlib
import logging

import numpy as np

from data_pipeline.config import INSTANCE_BUILDERS
from data_pipeline.instance_algorithm import InstanceParams, InstanceStats
from data_pipeline.instance_batch import InstanceBatch
from data_pipeline.native_build import import_native
from data_pipeline.negatives import NegativeSource

log = logging.getLogger("data_pipeline")

_ext, _UNAVAILABLE = import_native("data_pipeline._native_instances")


def available() -> bool:
    return _ext is not None


def unavailable_reason() -> str:
    """Why the extension cannot be used ("" when it can)."""
    return _UNAVAILABLE


def choose_builder(requested: str) -> tuple[str, str]:
    """("native" | "reference", why) for the config's ``instance_builder``. The native builder
    supports every config of the reference; "native" when the extension is not built is an
    error, "auto" then falls back to the reference."""
    if requested not in INSTANCE_BUILDERS:
        raise ValueError(f"instance_builder {requested!r} is not one of {list(INSTANCE_BUILDERS)}")
    if requested == "reference":
        return "reference", "instance_builder=reference"
    why_not = unavailable_reason()
    if requested == "native":
        if why_not:
            raise ValueError(f"instance_builder=native, but {why_not} (use auto or reference)")
        return "native", "instance_builder=native"
    if why_not:
        return "reference", f"instance_builder=auto: {why_not}"
    return "native", "instance_builder=auto: the extension is built"


_logged: set[tuple[str, str]] = set()


def log_choice(builder: str, why: str) -> None:
    """Log the builder once per worker process (setup() runs once per DoFn instance)."""
    if (builder, why) not in _logged:
        _logged.add((builder, why))
        log.info("training instances: %s builder (%s)", builder, why)


def packed(negatives: NegativeSource | None):
    """The extension's NegativeSource for ``negatives``, built once and kept on the object (the
    flat arrays are shared, not copied)."""
    if negatives is None:
        return None
    native = getattr(negatives, "_native", None)
    if native is None:
        native = negatives._native = _ext.NegativeSource(
            np.ascontiguousarray(negatives.ids), negatives.id_offsets, negatives.bounds, negatives.bound_offsets,
            negatives.perm)
    return native


def _derived_seeds(prefix_parts: tuple, n: int) -> np.ndarray:
    """``[derive_seed(*prefix_parts, k) for k in range(n)]`` as uint64: the blake2b state of the
    common prefix is hashed once and copied (the same bytes as derive_seed joins)."""
    head = hashlib.blake2b(("\x1f".join(map(str, prefix_parts)) + "\x1f").encode("utf-8"), digest_size=8)
    out = np.empty(n, np.uint64)
    for k in range(n):
        h = head.copy()
        h.update(str(k).encode("utf-8"))
        out[k] = int.from_bytes(h.digest(), "little")
    return out


def dupe_seeds(doc_id: str, dupe_factor: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference's per-(document, dupe) seeds: the random.Random seed, the row-key base and
    the seed of the masking Generator's PCG64 (the extension runs numpy's seeding of it)."""
    return (_derived_seeds((seed, doc_id), dupe_factor), _derived_seeds((seed, "row", doc_id), dupe_factor),
            _derived_seeds((seed, "mask", doc_id), dupe_factor))


def create_document_instances(doc_id: str, ids: np.ndarray, bounds: np.ndarray, dupe_factor: int, *,
                              params: InstanceParams, seed: int, negatives: NegativeSource | None = None,
                              doc_index: int = -1, continuation: np.ndarray | None = None,
                              stats: InstanceStats | None = None) -> InstanceBatch:
    """``InstanceBatch.concat([create_instances(doc_id, ids, bounds, d, ..., negatives=deal) for d in
    range(dupe_factor)])`` with ``deal = negatives.dealer(doc_index)``, in one native call;
    ``stats`` gets the same counts as the reference's after ``stats.count_windows(deal)``.
    ``continuation`` (the vocab's '##' mask, :func:`bertdist.data.vocab.continuation_mask`) is
    needed for static whole-word and span masking, as in the reference."""
    if _ext is None:
        raise RuntimeError(unavailable_reason())
    source = packed(negatives) if params.objective == "nsp" else None
    if source is not None and not 0 <= doc_index < len(negatives):
        raise ValueError(f"doc_index {doc_index}: not a document of the negative source ({len(negatives)} documents)")
    mt, rows, masks = dupe_seeds(doc_id, dupe_factor, seed)
    p = params
    out = _ext.build_document(
        np.ascontiguousarray(ids), np.ascontiguousarray(bounds, dtype=np.int64), mt, rows, masks,
        max_seq_length=int(p.max_seq_length), short_seq_prob=float(p.short_seq_prob), objective=p.objective,
        nsp_random_prob=float(p.nsp_random_prob), masking=p.masking, masked_lm_prob=float(p.masked_lm_prob),
        max_predictions_per_seq=int(p.max_predictions_per_seq),
        whole_word_mask=p.masking_mode == "whole_word", masking_mode=p.masking_mode,
        mask_replace_prob=float(p.mask_replace_prob), random_replace_prob=float(p.random_replace_prob),
        cls_id=int(p.cls_id), sep_id=int(p.sep_id), mask_id=int(p.mask_id), vocab_size=int(p.vocab_size),
        negatives=source, doc_index=int(doc_index) if source is not None else -1,
        continuation=None if continuation is None else np.ascontiguousarray(continuation, dtype=np.bool_),
    )
    keys, flat, offs, num_a, nsp, mpos, mids, moffs, counts = out
    if stats is not None:
        stats.add(InstanceStats(*counts))
    return InstanceBatch(keys, flat, offs, num_a, nsp, mpos, mids, moffs)
