"""What TinyBERT's intermediate losses read from a model: each encoder layer's output (hidden
states) and attention distribution.

Our attention kernels never materialise the probabilities, so they are recomputed from each
layer's input with the layer's own query/key weights (softmax(QK^T / sqrt(d)) over real keys): the
same numbers the kernel uses, at the cost of one extra QK^T per layer. Padded inputs only (not
``unpad``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class LayerCapture:
    """Forward hooks on ``bert.encoder.layer``; ``hidden`` and ``probs`` hold the last forward's."""

    def __init__(self, bert, attention: bool):
        self.hidden: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor] = []
        self.attention = attention
        self.layers = list(bert.encoder.layer)
        self._handles = []
        for layer in self.layers:
            self._handles.append(layer.register_forward_hook(self._on_output))
            if attention:
                self._handles.append(layer.register_forward_pre_hook(self._on_input))

    def _on_output(self, _module, _args, out):
        self.hidden.append(out)

    def _on_input(self, _module, args):
        self.inputs.append(args[0])

    def clear(self) -> None:
        self.hidden, self.inputs = [], []

    def probs(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """[B, heads, S, S] attention distributions per layer, keys masked to real tokens."""
        out = []
        keep = attention_mask.bool()[:, None, None, :]
        for layer, h in zip(self.layers, self.inputs):
            sa = layer.attention.self
            b, s, _ = h.shape
            q = sa.query(h).view(b, s, sa.heads, sa.head_dim).transpose(1, 2)
            k = sa.key(h).view(b, s, sa.heads, sa.head_dim).transpose(1, 2)
            scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(sa.head_dim)
            out.append(F.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1))
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
