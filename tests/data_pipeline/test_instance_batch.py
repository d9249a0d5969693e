"""data_pipeline.instance_batch: the columnar batch of instances."""
from __future__ import annotations

import numpy as np

from tests.data_pipeline.test_instance_algorithm import build, params, synthetic_docs


def test_slice_equals_take_of_a_range():
    b, _ = build(synthetic_docs(3, 30), params())
    for lo, hi in ((0, len(b)), (3, 9), (5, 5), (len(b) - 1, len(b))):
        s, t = b.slice(lo, hi), b.take(np.arange(lo, hi))
        for f in ("keys", "ids", "ids_offsets", "num_a", "nsp", "mpos", "mids", "m_offsets"):
            assert np.array_equal(getattr(s, f), getattr(t, f)), (f, lo, hi)
