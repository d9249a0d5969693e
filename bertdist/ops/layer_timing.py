"""What ``kernels: auto`` times: a candidate inside the layer the trainer runs it in.

An op timed alone is mostly host time: one forward + backward of a layer norm is ~0.45 ms of
Python dispatch and autograd on a GPU against 0.05-0.08 ms of kernels, so the ranking would be
of host overhead. Inside a layer the device's queue runs ahead of the host as in training, and
what is ranked is what the op costs the step.

``layer_step`` builds, for a ``Case`` with a ``LayerContext``, one region of the run's model:

- ``bias_dropout_add_layer_norm``, ``attention``, ``varlen_attention``: one ``BertLayer`` of the
  run's width, heads, FFN, dropout, dtype (bf16 weights, or fp32 weights under autocast) and
  padded or unpadded attention;
- ``layer_norm``: the embeddings' layer norm and dropout (the lookups before it do not depend
  on the choice and are left out).

The op being decided runs the candidate; the other ops run what was already decided for them
(``decided``), else the baseline. The region is compiled when the run compiles its layers
(``nn.Module.compile``, as ``train/compile.py`` does). The step is the region's forward and the
gradients of its input and parameters, with the case's dropout on the op being decided.
"""
from __future__ import annotations

from typing import Callable

import torch

from bertdist.ops.candidates import Candidate, Case
from bertdist.ops.dispatch import BIAS_IN_KERNEL, KernelSet, RoutedOp, reference_set
from bertdist.ops.kernel_plan import DTYPES

COMPILE_BACKEND = "inductor"  # as the trainer compiles (tests use a cheaper one)


def layer_kernels(case: Case, candidate: Candidate, fn: Callable, decided: list[tuple[Case, Candidate]],
                  device_type: str) -> KernelSet:
    """The kernels of the timed region: ``fn`` for ``case.op``; for every other op the
    candidates ``decided`` chose (routed by dtype and dropout, as in a run), else the baseline."""
    base = reference_set(device_type)
    funcs, sources = {}, dict(base.sources)
    for op in ("layer_norm", "bias_dropout_add_layer_norm", "attention", "varlen_attention"):
        if op == case.op:
            funcs[op] = fn
            sources[op] = candidate.name
            continue
        routes = {(c.dtype, c.dropout): cand.load() for c, cand in decided if c.op == op}
        names = {(c.dtype, c.dropout): cand.name for c, cand in decided if c.op == op}
        funcs[op] = RoutedOp(op, routes, getattr(base, op), names) if routes else getattr(base, op)
        training = [cand for c, cand in decided if c.op == op and c.dropout] or [cand for c, cand in decided if c.op == op]
        if training:
            sources[op] = training[0].name
    if case.op == "bias_dropout_add_layer_norm" and candidate.bias_in_kernel and candidate.name not in BIAS_IN_KERNEL:
        raise ValueError(f"candidate {candidate.name!r} takes the dense bias, but the model hands it only to "
                         f"{', '.join(BIAS_IN_KERNEL)}")
    return KernelSet(**funcs, sources=sources)


class _NormRegion(torch.nn.Module):
    """The embeddings' tail: layer norm, then dropout (``BertEmbeddings.forward``)."""

    def __init__(self, hidden: int, eps: float, p: float, kernels: KernelSet):
        super().__init__()
        from bertdist.model.bert import LayerNorm

        self.LayerNorm = LayerNorm(hidden, eps, kernels)
        self.dropout = torch.nn.Dropout(p)

    def forward(self, h: torch.Tensor, mask=None) -> torch.Tensor:
        return self.dropout(self.LayerNorm(h))


def layer_step(case: Case, kernels: KernelSet, device: torch.device) -> Callable[[], None]:
    """One forward + backward of ``case``'s region with ``kernels`` (see the module docstring)."""
    from bertdist.model.bert import BertLayer, Unpadded
    from bertdist.model.config import BertConfig
    from bertdist.ops.numerics_gate import case_lengths

    ctx = case.layer
    if ctx is None:
        raise ValueError(f"{case.key}: no layer to time the candidate in")
    p = case.p if case.dropout else 0.0  # the decided op's dropout is the case's
    hidden_p = p if case.op in ("layer_norm", "bias_dropout_add_layer_norm") else ctx.hidden_dropout
    attention_p = p if case.op in ("attention", "varlen_attention") else ctx.attention_dropout
    cfg = BertConfig(preset="custom", hidden_size=case.hidden, num_attention_heads=case.heads,
                     intermediate_size=ctx.intermediate, num_hidden_layers=1, hidden_dropout_prob=hidden_p,
                     attention_probs_dropout_prob=attention_p, layer_norm_eps=case.eps, kernels="reference",
                     unpad=ctx.unpad, max_position_embeddings=max(512, case.seq))
    g = torch.Generator().manual_seed(4321 + case.lengths_seed)
    region = _NormRegion(case.hidden, case.eps, hidden_p, kernels) if case.op == "layer_norm" else BertLayer(cfg, kernels)
    compute = DTYPES[ctx.dtype]
    weights = torch.float32 if ctx.autocast else compute
    region = region.to(device=device, dtype=weights).train()
    if ctx.compiled:
        # Every candidate is a new region: without a reset Dynamo would hit its recompile limit
        # after a few and run the rest eagerly, unannounced.
        torch._dynamo.reset()
        region.compile(backend=COMPILE_BACKEND)
    lengths = case_lengths(case)
    mask = (torch.arange(case.seq)[None, :] < lengths[:, None]).to(device)
    h = torch.randn(case.batch, case.seq, case.hidden, generator=g).to(device=device, dtype=weights)
    arg = mask
    if ctx.unpad and case.op != "layer_norm":
        arg = Unpadded.from_mask(mask)
        h = arg.pack(h)
    h.requires_grad_(True)
    inputs = [h, *region.parameters()]
    grad_out: list[torch.Tensor] = []

    def step() -> None:
        with torch.autocast(device.type, dtype=compute, enabled=ctx.autocast):
            out = region(h, arg)
        if not grad_out:
            grad_out.append(torch.randn(out.shape, generator=g).to(device=device, dtype=out.dtype))
        torch.autograd.grad(out, inputs, grad_out[0], allow_unused=True)

    return step
