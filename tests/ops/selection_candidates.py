"""Candidates injected into the kernel selection by tests (importable by path, so an isolated
measuring process can load them too)."""
from __future__ import annotations

import ctypes
import time

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
