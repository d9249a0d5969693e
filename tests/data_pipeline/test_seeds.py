"""data_pipeline.seeds: the seed of given parts never changes (every shard byte depends on it)."""
from __future__ import annotations

from data_pipeline.seeds import derive_seed


def test_seeds_are_pinned_values():
    # Pinned: a change here changes every placement hash, split, bucket and row of every build.
    assert derive_seed("heldout", "doc-1") == 4689477182626017912
    assert derive_seed(12345, "doc", 0) == 2442394288097054684


def test_parts_are_joined_with_a_separator_not_concatenated():
    assert derive_seed("ab", "c") != derive_seed("a", "bc")
    assert derive_seed(1, 2) == derive_seed("1", "2")  # str() of each part
    assert 0 <= derive_seed("x") < 2**64
