"""Every windowed-attention backend against the reference twin on CPU, padded and packed, with and
without a window, forward and (where the backend trains) backward."""
from __future__ import annotations

import pytest
import torch

from bertdist.ops.windowed_attention import PADDED_BACKENDS, VARLEN_BACKENDS, Packing

HEADS, HEAD_DIM = 2, 16
LENGTHS = [1, 7, 40, 23]  # a single token, shorter and longer than the window


def packed_qkv(seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    qkv = [torch.randn(total, HEADS, HEAD_DIM, generator=g).requires_grad_(requires_grad) for _ in range(3)]
    cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(torch.int32)
    return qkv, Packing.from_cu_seqlens(cu, max(LENGTHS), total)


@pytest.mark.parametrize("half_window", [None, 4])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_backend_matches_reference(backend, half_window):
    (q, k, v), packing = packed_qkv()
    want = VARLEN_BACKENDS["reference"](q, k, v, packing, half_window=half_window)
    got = VARLEN_BACKENDS[backend](q, k, v, packing, half_window=half_window)
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"{backend}, half_window={half_window}: max |diff| = {diff:.3e}"


@pytest.mark.parametrize("half_window", [None, 4])
def test_packed_sdpa_gradients_match_reference(half_window):
    grads = {}
    for backend in ("reference", "sdpa"):
        (q, k, v), packing = packed_qkv(requires_grad=True)
        out = VARLEN_BACKENDS[backend](q, k, v, packing, half_window=half_window)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[backend] = [t.grad for t in (q, k, v)]
    for name, want, got in zip("qkv", grads["reference"], grads["sdpa"]):
        diff = (got - want).abs().max().item()
        assert diff <= 1e-5, f"d{name}: max |sdpa - reference| = {diff:.3e}"


def test_packed_reference_window_matches_the_definition():
    """The oracle itself, on one sequence: a key outside ``|i - j| <= half_window`` gets no weight."""
    (q, k, v), packing = packed_qkv()
    start, end = 8, 48  # the 40-token sequence
    out = VARLEN_BACKENDS["reference"](q, k, v, packing, half_window=3)[start + 10]
    keys = range(start + 7, start + 14)
    scores = torch.stack([(q[start + 10] * k[j]).sum(-1) for j in keys]) / HEAD_DIM ** 0.5  # [7, heads]
    want = (scores.softmax(0)[:, :, None] * torch.stack([v[j] for j in keys])).sum(0)
    assert (out - want).abs().max().item() <= 1e-6


@pytest.mark.parametrize("half_window", [None, 4])
def test_padded_sdpa_matches_reference_on_real_tokens(half_window):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, HEADS, 24, HEAD_DIM, generator=g) for _ in range(3))
    mask = torch.arange(24)[None, :] < torch.tensor([24, 17, 5])[:, None]
    want = PADDED_BACKENDS["reference"](q, k, v, mask, half_window=half_window)
    got = PADDED_BACKENDS["sdpa"](q, k, v, mask, half_window=half_window)
    real = mask[:, None, :, None].expand_as(got)
    assert (got - want)[real].abs().max().item() <= 1e-5


def test_flex_refuses_attention_dropout():
    (q, k, v), packing = packed_qkv()
    with pytest.raises(ValueError, match="no attention dropout.*dropout_p=0.1"):
        VARLEN_BACKENDS["flex"](q, k, v, packing, dropout_p=0.1, training=True)


def test_flex_refuses_training_on_cpu_with_the_way_out():
    (q, k, v), packing = packed_qkv(requires_grad=True)
    with pytest.raises(ValueError, match="no backward on CPU.*attention_backend=sdpa"):
        VARLEN_BACKENDS["flex"](q, k, v, packing)
