"""Inductor's fused kernels as ``kernels: auto`` candidates: ``torch.compile`` of our reference twins.

For the layer-norm family Inductor generates one fused kernel per pass from the plain PyTorch
twin (Triton on CUDA, C++ on CPU), the competitor our hand-written kernels must beat. It is
judged like any candidate: the numerics gate, then time inside the run's layer; a compile that
fails is that candidate's error, counted in the plan, never the run's. Each function compiles
its twin once per process (recompiled per shape by Dynamo's guards, as any compiled function).
"""
from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING, Callable

import torch

from bertdist.ops import reference

if TYPE_CHECKING:
    from bertdist.device_profile import DeviceProfile
    from bertdist.ops.candidates import Case

OPS = ("layer_norm", "bias_dropout_add_layer_norm")
BACKEND = "inductor"  # torch.compile's backend (tests use a cheaper one)


@functools.lru_cache(maxsize=None)
def _compiled(op: str, backend: str) -> Callable:
    return torch.compile(getattr(reference, f"reference_{op}"), backend=backend, dynamic=False)


def layer_norm(x, weight, bias, eps):
    return _compiled("layer_norm", BACKEND)(x, weight, bias, eps)


def bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, *, p, training, eps):
    return _compiled("bias_dropout_add_layer_norm", BACKEND)(x, bias, residual, weight, ln_bias, p=p,
                                                             training=training, eps=eps)


def unsupported(case: "Case", profile: "DeviceProfile | None" = None) -> str | None:
    """A candidate on CUDA, for the layer-norm family; Inductor's CUDA code is Triton. (On CPU
    ``kernels: auto`` measures nothing; tests add the candidate there without this check.)"""
    if case.op not in OPS:
        return f"no Inductor candidate for {case.op} (only {', '.join(OPS)})"
    if case.device_type != "cuda":
        return f"CUDA only (this is {case.device_type})"
    if importlib.util.find_spec("triton") is None:
        return "Inductor's CUDA kernels need Triton, which is not installed"
    return None
