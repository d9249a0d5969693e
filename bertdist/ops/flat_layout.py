"""Where each tensor sits in the flat optimizer buffers, and how the buffers are cut into chunks.

The flat-buffer optimizer ops (``fused_optim``, ``reference.reference_flat_*``) take every
parameter tensor back to back in one fp32 buffer. ``FlatLayout.table`` is their segment table,
int64 ``[2, segments + 1]``: row 0 the element offsets of the tensors (segment ``s`` is elements
``offsets[s]:offsets[s + 1]``), row 1 the chunk offsets. A chunk is at most ``chunk_size``
elements of one segment; each is one CUDA block, and every sum is taken per chunk and then over
the chunks in index order, so the results do not depend on scheduling. The table is built here,
on the CPU, once per optimizer; the CUDA entry points do not re-check a device copy (that would
cost a sync).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

# 256 threads x 256 elements: few enough blocks for BERT-large (about 6,000 per launch), enough
# for every SM, and a size-1 bias still costs one block only.
DEFAULT_CHUNK_SIZE = 65536


@dataclasses.dataclass(frozen=True, eq=False)
class FlatLayout:
    sizes: tuple[int, ...]
    chunk_size: int
    table: torch.Tensor  # CPU int64 [2, segments + 1]
    num_chunks: int

    @functools.cached_property
    def numel(self) -> int:
        # from the sizes, not the table: a step reads it, and reading a tensor is a host read
        return sum(self.sizes)

    @property
    def offsets(self) -> list[int]:
        return self.table[0].tolist()

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of each segment in the flat buffers."""
        o = self.offsets
        return list(zip(o[:-1], o[1:]))

    def sub(self, first: int, last: int) -> "FlatLayout":
        """The layout of segments ``first .. last - 1`` alone (their slice of the buffers)."""
        return flat_layout(self.sizes[first:last], self.chunk_size)


def flat_layout(sizes: Sequence[int], chunk_size: int = DEFAULT_CHUNK_SIZE) -> FlatLayout:
    """The layout of tensors of ``sizes`` elements, back to back."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    sizes = tuple(int(n) for n in sizes)
    bad = [(i, n) for i, n in enumerate(sizes) if n < 0]
    if bad:
        raise ValueError(f"segment sizes must be >= 0, got (index, size) {bad}")
    offsets, chunks = [0], [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
        chunks.append(chunks[-1] + (n + chunk_size - 1) // chunk_size)
    table = torch.tensor([offsets, chunks], dtype=torch.int64)
    return FlatLayout(sizes, int(chunk_size), table, chunks[-1])
