"""Candidates injected into the kernel selection by tests (importable by path, so an isolated
measuring process can load them too)."""
from __future__ import annotations

import ctypes
import time

import torch
import torch.nn.functional as F

from bertdist.ops import reference


def wrong_layer_norm(x, weight, bias, eps):
    """1% off: far outside twice torch's own fp32 error."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps) * 1.01


def slow_layer_norm(x, weight, bias, eps):
    """Correct, and 20 ms slower than anything else."""
    time.sleep(0.02)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def same_layer_norm(x, weight, bias, eps):
    """Correct and as fast as torch (for tests with an injected timer)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def crashing_layer_norm(x, weight, bias, eps):
    """Kills its process the way a bad kernel can: a segmentation fault."""
    ctypes.string_at(0)


def dropout_ignoring_bdaln(x, bias, residual, weight, ln_bias, *, p, training, eps):
    """Right without dropout, but never applies it."""
    return reference.reference_bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, p=0.0,
                                                           training=False, eps=eps)


def dropout_rate_halved_bdaln(x, bias, residual, weight, ln_bias, *, p, training, eps):
    """Applies dropout, scaled for p, but drops only half as often."""
    return reference.reference_bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, p=p / 2,
                                                           training=training, eps=eps)


class _NewMaskInBackward(torch.autograd.Function):
    """Dropout whose backward draws a fresh mask instead of the forward's."""

    @staticmethod
    def forward(ctx, h, p):
        ctx.p = p
        return h * (torch.rand_like(h) >= p) / (1 - p)

    @staticmethod
    def backward(ctx, grad):
        return grad * (torch.rand_like(grad) >= ctx.p) / (1 - ctx.p), None


def dropout_new_mask_in_backward_bdaln(x, bias, residual, weight, ln_bias, *, p, training, eps):
    h = x if bias is None else x + bias
    if training and p > 0:
        h = _NewMaskInBackward.apply(h, p)
    return F.layer_norm(residual + h, (h.shape[-1],), weight, ln_bias, eps)


def attention_new_mask_in_backward(q, k, v, key_padding_mask, *, dropout_p=0.0, training=False, scale=None):
    """Attention whose dropout on the probabilities draws another mask in the backward."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~key_padding_mask[:, None, None, :].bool(), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if training and dropout_p > 0:
        probs = _NewMaskInBackward.apply(probs, dropout_p)
    return probs @ v


def wrong_varlen_window_attention(q, k, v, packing, *, half_window=None, dropout_p=0.0, training=False, scale=None):
    """ModernBERT's packed attention with the window ignored: right on a global layer only."""
    from bertdist.ops.windowed_attention import sdpa_varlen_window_attention

    return sdpa_varlen_window_attention(q, k, v, packing, half_window=None, dropout_p=dropout_p, training=training,
                                        scale=scale)


CALLS: list[str] = []  # the calls of counting_bdaln, in order


def counting_bdaln(x, bias, residual, weight, ln_bias, *, p, training, eps):
    """Correct; notes each call, so a test sees which layers ran it."""
    CALLS.append("counting_bdaln")
    return reference.reference_bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, p=p,
                                                           training=training, eps=eps)
