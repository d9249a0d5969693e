"""What TinyBERT's intermediate losses read from a model: each encoder layer's output (hidden
states) and attention distribution, for BERT-layout encoders (BERT, ELECTRA) and ModernBERT.

Our attention kernels never materialise the probabilities, so they are recomputed from each
layer's input with the layer's own query/key weights (softmax(QK^T / sqrt(d)) over real keys): the
same numbers the kernel uses, at the cost of one extra QK^T per layer. Whatever the attention
backend (ModernBERT's sdpa, flex or flash included), the distribution is the layer's own.

ModernBERT: a layer's output is its residual stream (pre-norm: what transformers returns as that
layer's hidden state; the final norm comes after the last layer). Its attention is recomputed
from the normed input with the layer's RoPE (global or local θ). A local layer attends to a window
of ``local_attention / 2`` tokens each side: its distribution is zero outside, and ``allowed``
gives that window (None: every real key), for the loss to compare two layers on the keys both
can see. A batch the model runs unpadded (``unpad``: [tokens, hidden] inside the layers) is put
back into [B, S, H] here, zeros at padding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class LayerCapture:
    """Forward hooks on an encoder's layers; ``states`` and ``probs`` read the last forward's."""

    def __init__(self, backbone, attention: bool):
        self.hidden: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor] = []
        self.attention = attention
        from bertdist.model.modernbert import ModernBertModel

        self.modernbert = isinstance(backbone, ModernBertModel)
        self.backbone = backbone
        self.layers = list(backbone.layers if self.modernbert else backbone.encoder.layer)
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

    @staticmethod
    def _padded(h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, S, H] from a layer's tensor: as it is, or scattered back from [real tokens, H]."""
        if h.dim() == 3:
            return h
        m = attention_mask.bool()
        out = h.new_zeros(*m.shape, h.shape[-1])
        out[m] = h
        return out

    def states(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's output, [B, S, H]."""
        return [self._padded(h, attention_mask) for h in self.hidden]

    def probs(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """[B, heads, S, S] attention distributions per layer, keys masked to real tokens (and to a
        local layer's window)."""
        if self.modernbert:
            return [self._modernbert_probs(i, attention_mask) for i in range(len(self.layers))]
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

    def allowed(self, attention_mask: torch.Tensor) -> list[torch.Tensor | None]:
        """Per layer, the [S, S] keys a query may attend to beyond the padding: a local layer's
        window, None for a global layer (and every BERT layer)."""
        s = attention_mask.shape[-1]
        out = []
        for layer in self.layers:
            half = layer.attn.half_window if self.modernbert else None
            if half is None:
                out.append(None)
                continue
            pos = torch.arange(s, device=attention_mask.device)
            out.append((pos[:, None] - pos[None, :]).abs() <= half)
        return out

    def _modernbert_probs(self, i: int, attention_mask: torch.Tensor) -> torch.Tensor:
        from bertdist.model.modernbert import apply_rotary

        layer = self.layers[i]
        attn = layer.attn
        h = layer.attn_norm(self._padded(self.inputs[i], attention_mask))
        b, s, _ = h.shape
        qkv = attn.Wqkv(h).view(b, s, 3, attn.heads, attn.head_dim)
        q, k, _ = qkv.unbind(-3)
        rope = self.backbone.rotary["global" if layer.is_global else "local"](torch.arange(s, device=h.device))
        q, k = (apply_rotary(t, *rope).transpose(1, 2) for t in (q, k))  # [B, heads, S, head_dim]
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(attn.head_dim)
        keep = attention_mask.bool()[:, None, None, :]
        window = self.allowed(attention_mask)[i]
        if window is not None:
            keep = keep & window
        probs = F.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        # a padded query near the end of a local layer may see no real key at all: zeros, not NaN
        # (the loss skips padded queries, but 0 x NaN would not be 0)
        return probs.masked_fill(~keep.any(-1, keepdim=True), 0.0)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
