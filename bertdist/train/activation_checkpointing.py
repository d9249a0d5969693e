"""Activation checkpointing, applied to a built model from outside (as torchtitan does).

Each encoder layer's forward is routed through a checkpoint function in training, so its
activations are recomputed in the backward instead of kept. The layer is not wrapped in a new
module: its parameter names (HF's, which DeepSpeed records in its checkpoints and universal
conversion) and its state dict stay exactly as without checkpointing, so checkpoints with and
without it are interchangeable.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
from torch import nn

CHECKPOINT_MODES = ("none", "torch", "deepspeed")


def checkpoint_function(mode: str, ds_config: dict | None = None) -> Callable | None:
    """``fn(forward, *args)`` recomputing ``forward(*args)`` in the backward, or None for "none"."""
    if mode == "none":
        return None
    if mode == "torch":
        from torch.utils.checkpoint import checkpoint

        return functools.partial(checkpoint, use_reentrant=False)
    if mode == "deepspeed":
        import deepspeed

        deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)  # partitioning etc. from the config
        return deepspeed.checkpointing.checkpoint
    raise ValueError(f"activation checkpointing mode {mode!r} is not one of {list(CHECKPOINT_MODES)}")


def checkpoint_modules(modules: Iterable[nn.Module], fn: Callable) -> int:
    """Route each module's forward through ``fn`` while it trains with gradients on; returns the count."""
    n = 0
    for module in modules:
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, _module=module):
            if _module.training and torch.is_grad_enabled():
                return fn(_inner, *args)
            return _inner(*args)

        module.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
        n += 1
    return n


def apply_activation_checkpointing(model: nn.Module, mode: str, ds_config: dict | None = None) -> int:
    """Checkpoint every encoder layer of a pretraining model (both towers of an
    ``ElectraForPreTraining``), the layer class its family names (bertdist/model/families.py);
    returns how many."""
    from bertdist.model.bert import BertLayer
    from bertdist.model.families import family_of

    fn = checkpoint_function(mode, ds_config)
    if fn is None:
        return 0
    config = getattr(model, "config", None)
    layer = family_of(config).encoder_layer() if config is not None else BertLayer
    return checkpoint_modules([m for m in model.modules() if isinstance(m, layer)], fn)
