"""The AdamW parameter groups of an embedding run: no weight decay on biases and LayerNorm, and
a cross-encoder's head (BERT's pooler + classifier; ModernBERT's head + classifier) at its own rate."""
from __future__ import annotations

import torch

from bertdist.embed.config import EmbedConfig
from bertdist.embed.model import CrossEncoder


NEW_HEAD_RATE = 20.0  # x learning_rate: a new cross-encoder head's default rate


def head_learning_rate(model: torch.nn.Module, cfg: EmbedConfig) -> float | None:
    """The cross-encoder head's rate (pooler + classifier); None for a bi-encoder."""
    if not isinstance(model, CrossEncoder):
        return None
    if cfg.head_learning_rate is not None:
        return cfg.head_learning_rate
    trained = model.origin.get("format") == "cross-encoder"
    return cfg.learning_rate if trained else NEW_HEAD_RATE * cfg.learning_rate


def no_weight_decay(name: str) -> bool:
    """Biases and norms: BERT's ``LayerNorm``, ModernBERT's ``*norm`` modules."""
    return name.endswith("bias") or "LayerNorm" in name or "norm." in name


def grouped_parameters(named_parameters, weight_decay: float, head_lr: float | None = None,
                       is_head=lambda name: name.startswith(("classifier.", "bert.pooler.", "head."))) -> list[dict]:
    """AdamW groups over ``(name, parameter)`` pairs: no weight decay on biases and LayerNorm; with
    ``head_lr``, the parameters ``is_head`` names at that rate (the others at the optimizer's)."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in named_parameters:
        if p.requires_grad:
            head = head_lr is not None and is_head(name)
            groups.setdefault((head, no_weight_decay(name)), []).append(p)
    return [{"params": params, "weight_decay": 0.0 if no_decay else weight_decay,
             **({"lr": head_lr} if head else {})}
            for (head, no_decay), params in sorted(groups.items())]


def param_groups(model: torch.nn.Module, cfg: EmbedConfig) -> list[dict]:
    """Our AdamW groups: a cross-encoder's head at its own rate."""
    return grouped_parameters(model.named_parameters(), cfg.weight_decay, head_learning_rate(model, cfg))
