"""Pooling against hand-computed values, padding included."""
from __future__ import annotations

import math

import pytest
import torch

from bertdist.embed.pooling import EmbeddingHead, pool

# two sequences of 3 positions, H = 2; the second has one padding position whose values are
# large so that a pooling that reads them gives a visibly wrong answer
HIDDEN = torch.tensor([
    [[1.0, 2.0], [3.0, -4.0], [5.0, 0.0]],
    [[-1.0, 1.0], [3.0, 5.0], [100.0, 100.0]],
])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_mean_ignores_padding():
    out = pool(HIDDEN, MASK, "mean")
    # row 0: ((1+3+5)/3, (2-4+0)/3) = (3, -2/3); row 1: ((-1+3)/2, (1+5)/2) = (1, 3)
    torch.testing.assert_close(out, torch.tensor([[3.0, -2.0 / 3.0], [1.0, 3.0]]))


def test_max_ignores_padding():
    out = pool(HIDDEN, MASK, "max")
    # row 1 without its padding: max(-1, 3) = 3, max(1, 5) = 5 (not the padding's 100)
    assert out.tolist() == [[5.0, 2.0], [3.0, 5.0]]


def test_max_of_all_negative_values_is_not_the_padding_zero():
    h = torch.tensor([[[-3.0], [-1.0], [0.0]]])
    assert pool(h, torch.tensor([[1, 1, 0]]), "max").tolist() == [[-1.0]]


def test_cls_is_position_zero():
    assert pool(HIDDEN, MASK, "cls").tolist() == [[1.0, 2.0], [-1.0, 1.0]]


def test_a_row_without_tokens_pools_to_zeros():
    mask = torch.tensor([[1, 0, 0], [0, 0, 0]])
    assert pool(HIDDEN, mask, "mean").tolist() == [[1.0, 2.0], [0.0, 0.0]]
    assert pool(HIDDEN, mask, "max").tolist() == [[1.0, 2.0], [0.0, 0.0]]


def test_bf16_input_pools_in_float32():
    out = pool(HIDDEN.bfloat16(), MASK, "mean")
    assert out.dtype == torch.float32


def test_bad_mode_and_shapes_are_refused():
    with pytest.raises(ValueError, match="'sum' is not one of"):
        pool(HIDDEN, MASK, "sum")
    with pytest.raises(ValueError, match=r"hidden \(2, 3, 2\) and attention_mask \(2, 2\)"):
        pool(HIDDEN, MASK[:, :2], "mean")


def test_head_normalizes_after_truncating():
    h = torch.tensor([[[3.0, 4.0, 12.0]]])
    m = torch.tensor([[1]])
    full = EmbeddingHead("mean", normalize=True)(h, m)
    # |(3, 4, 12)| = 13
    assert full.tolist()[0] == pytest.approx([3 / 13, 4 / 13, 12 / 13])
    cut = EmbeddingHead("mean", normalize=True, truncate_dim=2)(h, m)
    # |(3, 4)| = 5: unit length at the truncated width
    assert cut.tolist()[0] == pytest.approx([0.6, 0.8])
    raw = EmbeddingHead("cls", normalize=False, truncate_dim=2)(h, m)
    assert raw.tolist() == [[3.0, 4.0]]


def test_head_mean_with_padding_and_normalization():
    out = EmbeddingHead("mean", normalize=True)(HIDDEN, MASK)
    # row 1 mean (1, 3): norm sqrt(10)
    assert out[1].tolist() == pytest.approx([1 / math.sqrt(10), 3 / math.sqrt(10)])


def test_head_config_round_trip_and_errors():
    head = EmbeddingHead("max", normalize=False, truncate_dim=64)
    assert EmbeddingHead.from_config(head.config()).config() == {"pooling": "max", "normalize": False,
                                                                 "truncate_dim": 64}
    with pytest.raises(ValueError, match=r"unknown keys \['dim'\]"):
        EmbeddingHead.from_config({"pooling": "mean", "dim": 3})
    with pytest.raises(ValueError, match="truncate_dim must be a positive integer"):
        EmbeddingHead(truncate_dim=0)
    with pytest.raises(ValueError, match="truncate_dim 4 is wider than the embeddings \\(2\\)"):
        EmbeddingHead(truncate_dim=4)(HIDDEN, MASK)
