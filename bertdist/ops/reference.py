"""Pure-PyTorch reference implementations of the ops the model calls.

These are the CPU/GPU fallback and the oracle that fused kernels are tested
against. They are written for clarity first; where PyTorch has an exactly
equivalent builtin (``F.layer_norm``, ``F.scaled_dot_product_attention``) the
default path uses it so that the fallback is not slower than stock PyTorch,
and an explicit ``*_math`` twin spells out the arithmetic.

Conventions shared with the fused kernels:
- hidden tensors are ``[..., hidden]``;
- attention tensors are ``[batch, heads, seq, head_dim]``;
- ``key_padding_mask`` is ``[batch, seq]`` bool, True for real tokens. Masked
  keys get the dtype's most negative value rather than -inf, so that a fully
  padded row gives a uniform (finite) distribution like Hugging Face does.
- layer-norm statistics are computed in fp32 whatever the input dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def reference_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim; statistics in fp32 (F.layer_norm accumulates in fp32)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def reference_layer_norm_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The same LayerNorm spelled out, mean/variance in fp32, output in x's dtype."""
    xf = x.float()
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    return (y * weight.float() + bias.float()).to(x.dtype)


def reference_bias_dropout_add_layer_norm(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    ln_bias: torch.Tensor,
    *,
    p: float,
    training: bool,
    eps: float,
) -> torch.Tensor:
    """BERT's post-LN block output: ``LN(residual + dropout(x + bias))``."""
    h = x if bias is None else x + bias
    h = F.dropout(h, p=p, training=training)
    return reference_layer_norm(residual + h, weight, ln_bias, eps)


def _additive_mask(key_padding_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # [B, S] bool -> [B, 1, 1, S] additive, 0 for real keys, dtype-min for padding.
    neg = torch.finfo(dtype).min
    mask = torch.zeros(key_padding_mask.shape, dtype=dtype, device=key_padding_mask.device)
    mask.masked_fill_(~key_padding_mask, neg)
    return mask[:, None, None, :]


def reference_attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(Q K^T * scale + mask) -> dropout -> @ V``, explicit; softmax in fp32."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if key_padding_mask is not None:
        scores = scores + _additive_mask(key_padding_mask, torch.float32)
    probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs, p=dropout_p, training=training)
    return torch.matmul(probs, v.float()).to(q.dtype)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as ``reference_attention_math``, through torch's SDPA (its fastest stock path)."""
    mask = None if key_padding_mask is None else _additive_mask(key_padding_mask, q.dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p if training else 0.0, scale=scale
    )


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Unpadded attention: ``q, k, v`` are ``[total_tokens, heads, head_dim]`` and
    ``cu_seqlens`` ``[batch + 1]`` int32 holds the cumulative sequence lengths.
    Each sequence attends only to itself. It loops over the sequences in Python: the oracle the
    varlen kernels are tested against, and the unpadded path on CPU under ``reference`` and
    ``auto`` (where torch has no varlen kernel); on CUDA those modes use torch_native.py."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = reference_attention_math(qs, ks, vs, None, dropout_p=dropout_p, training=training, scale=scale)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out
