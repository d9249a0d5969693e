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
    half_window: int | None = None,
) -> torch.Tensor:
    """``softmax(Q K^T * scale + mask) -> dropout -> @ V``, explicit; softmax in fp32.
    ``half_window``: query i sees only keys j with ``|i - j| <= half_window`` (a sliding window;
    None: every key)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if key_padding_mask is not None:
        scores = scores + _additive_mask(key_padding_mask, torch.float32)
    if half_window is not None:
        seq = torch.arange(q.shape[-2], device=q.device)
        outside = (seq[:, None] - seq[None, :]).abs() > half_window
        scores = scores.masked_fill(outside, torch.finfo(torch.float32).min)
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
    half_window: int | None = None,
) -> torch.Tensor:
    """Unpadded attention: ``q, k, v`` are ``[total_tokens, heads, head_dim]`` and
    ``cu_seqlens`` ``[batch + 1]`` int32 holds the cumulative sequence lengths.
    Each sequence attends only to itself (within ``half_window`` positions, when given). It loops
    over the sequences in Python: the oracle the varlen kernels are tested against, and the
    unpadded path on CPU under ``reference`` and ``auto`` (where torch has no varlen kernel); on
    CUDA those modes use torch_native.py."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = reference_attention_math(qs, ks, vs, None, dropout_p=dropout_p, training=training, scale=scale,
                                     half_window=half_window)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out


# ---------------------------------------------------------------- flat-buffer optimizers
# The oracles of fused_optim's ops, same signatures: every tensor of the model back to back in
# flat fp32 buffers, segment s being elements table[0, s]:table[0, s + 1] (flat_layout.py). They
# split the buffers per segment with the offsets read on the host (a device sync on CUDA) and
# ignore the chunking, which changes only the kernels' order of summation.


def _flat_segments(table: torch.Tensor) -> list[int]:
    offsets = table[0].tolist()
    return [b - a for a, b in zip(offsets[:-1], offsets[1:])]


def _per_segment_sum(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return torch.stack([s.sum() for s in x.split(sizes)]) if sizes else x.new_zeros(0)


def reference_flat_grad_norm(grads: torch.Tensor, table: torch.Tensor, num_chunks: int, chunk_size: int,
                             max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-segment sums of g^2, [global norm, clip coefficient min(1, max_norm / (norm + 1e-6))]);
    the coefficient is 1 when max_norm <= 0."""
    g = grads.float()
    seg_norm2 = _per_segment_sum(g * g, _flat_segments(table))
    norm = torch.linalg.vector_norm(g)
    clip = (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)
    return seg_norm2, torch.stack([norm, clip])


def reference_flat_lamb_step_(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor,
                              exp_avg_sq: torch.Tensor, table: torch.Tensor, num_chunks: int, chunk_size: int,
                              weight_decay: torch.Tensor, stats: torch.Tensor, *, step: int, lr: float, beta1: float,
                              beta2: float, eps: float, bias_correction: bool = True, max_coeff: float = 10.0,
                              min_coeff: float = 0.01, params_bf16: torch.Tensor | None = None) -> None:
    """bertdist.train.lamb.Lamb's step for every segment, the gradient scaled by stats[1] first:
    ``u = m_hat / (sqrt(v_hat) + eps) + wd * p``, ``p -= lr * r * u`` with the segment's trust ratio
    ``r = clamp(||p|| / ||u||, min_coeff, max_coeff)``, 1 when either norm is 0. ``params_bf16``
    receives the new params in bf16."""
    sizes = _flat_segments(table)
    g = grads.float() * stats[1]
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    wd = torch.repeat_interleave(weight_decay, torch.tensor(sizes, device=params.device), output_size=params.numel())
    u = (exp_avg / bc1) / ((exp_avg_sq / bc2).sqrt() + eps) + wd * params
    w_norm = _per_segment_sum(params * params, sizes).sqrt()
    u_norm = _per_segment_sum(u * u, sizes).sqrt()
    ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
    trust = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
    r = torch.repeat_interleave(trust, torch.tensor(sizes, device=params.device), output_size=params.numel())
    params.sub_(lr * (r * u))
    if params_bf16 is not None:
        params_bf16.copy_(params)


def reference_flat_adamw_step_(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor,
                               exp_avg_sq: torch.Tensor, table: torch.Tensor, num_chunks: int, chunk_size: int,
                               weight_decay: torch.Tensor, stats: torch.Tensor, *, step: int, lr: float, beta1: float,
                               beta2: float, eps: float, params_bf16: torch.Tensor | None = None) -> None:
    """torch.optim.AdamW's step (decoupled weight decay, bias correction) for every segment, the
    gradient scaled by stats[1] first; ``params_bf16`` receives the new params in bf16."""
    sizes = _flat_segments(table)
    g = grads.float() * stats[1]
    wd = torch.repeat_interleave(weight_decay, torch.tensor(sizes, device=params.device), output_size=params.numel())
    params.mul_(1 - lr * wd)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    params.addcdiv_(exp_avg, denom, value=-step_size)
    if params_bf16 is not None:
        params_bf16.copy_(params)
