"""In-batch negatives across data-parallel ranks.

``all_gather_with_grad(x)`` concatenates every rank's ``[b_r, H]`` rows, in rank order, into
``[sum b_r, H]`` and keeps the graph: the backward pass all-reduces (SUM) the gradient of the
gathered tensor and hands each rank the rows of its own slice. ``mnrl_across_ranks`` ranks each
rank's queries against the positives (and hard negatives) of all ranks.

Why SUM, and why that is right under DDP. Rank r's loss L_r is the mean over its own b queries;
with equal batch sizes the loss of the global batch is L = (1/W) sum_r L_r. Rank s's embeddings
x_s enter every L_r (as in-batch negatives), so the SUM backward gives rank s

    g_s = sum_r dL_r/dx_s = W * dL/dx_s,

and DDP, which averages parameter gradients over the W ranks, then yields
(1/W) sum_s J_s^T g_s = sum_s J_s^T dL/dx_s = dL/dtheta: exactly the gradient of the single
process that holds the whole global batch. The per-rank embedding gradients are W times the
single-process gradients of those rows; DDP's averaging takes the W out. (The deprecated
``torch.distributed.nn.functional.all_gather`` has the same backward, a reduce-scatter SUM.)

The tempting alternatives are wrong: a backward that returns only the local slice of the
gathered gradient (no communication) drops dL_r/dx_s for r != s, a wrong gradient and not a
rescaled one; an AVG all-reduce gives dL/dx_s and, after DDP's averaging, a gradient W times too
small. ``tests/embed/test_gather.py`` checks the sum against the single-process gradients and
shows the local-slice backward failing that check.

Ranks may hold different numbers of rows (a short last batch): the sizes are gathered first and
the rows padded for the collective. Every rank must call the gather and run the backward, as with
any collective, and every rank must pass hard negatives or none. With unequal sizes the mean of
the per-rank losses weighs each rank equally, as DDP does for any loss.
Without an initialised process group the gather returns ``x`` itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from bertdist.embed.losses import MultipleNegativesRankingLoss, flat_negatives, mnrl


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def gathered_sizes(n: int, device: torch.device, group=None) -> list[int]:
    """Every rank's row count, in rank order (a small collective; the sizes decide the padding)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([n], dtype=torch.long, device=device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        most = max(sizes)
        x = x.contiguous()
        if x.shape[0] < most:  # the collective needs one shape on every rank
            x = torch.cat([x, x.new_zeros((most - x.shape[0],) + tuple(x.shape[1:]))], 0)
        parts = [torch.empty_like(x) for _ in sizes]
        dist.all_gather(parts, x, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.contiguous().clone()  # the collective works in place; autograd's buffer is not ours
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.sizes[:ctx.rank])
        return g[start:start + ctx.sizes[ctx.rank]], None, None, None


def all_gather_with_grad(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[b_r, ...]`` on each rank -> ``[sum_r b_r, ...]`` on every rank, rank order, with gradients
    flowing back to each rank's own rows (summed over the ranks' losses; see the module doc)."""
    if not _initialized():
        return x
    sizes = gathered_sizes(x.shape[0], x.device, group)
    return _AllGatherWithGrad.apply(x, sizes, dist.get_rank(group), group)


def mnrl_across_ranks(loss: MultipleNegativesRankingLoss, query: torch.Tensor, positive: torch.Tensor,
                      negatives: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """This rank's queries against the positives and hard negatives of every rank; query i's
    target is its own positive, at row ``offset + i`` of the gathered positives, where ``offset``
    is the number of rows on the ranks before this one (rank * B with equal batches). Symmetric:
    this rank's positives are also ranked against the gathered queries. Returns this rank's mean;
    the mean over ranks is the loss of the global batch, and under DDP the parameter gradients are
    that loss's (see the module doc)."""
    if query.dim() != 2 or query.shape != positive.shape:
        raise ValueError(f"mnrl_across_ranks expects query and positive [B, H] of one shape; got "
                         f"{tuple(query.shape)} and {tuple(positive.shape)}")
    negs = flat_negatives(negatives, query.shape[0], query.shape[1])
    if not _initialized():
        return mnrl(query, positive, negs, 0, loss.scale, loss.symmetric, queries=query)
    sizes = gathered_sizes(query.shape[0], query.device, group)
    rank = dist.get_rank(group)
    offset = sum(sizes[:rank])
    all_pos = _AllGatherWithGrad.apply(positive, sizes, rank, group)
    all_negs = all_gather_with_grad(negs, group) if negs is not None else None
    all_q = _AllGatherWithGrad.apply(query, sizes, rank, group) if loss.symmetric else None
    return mnrl(query, all_pos, all_negs, offset, loss.scale, loss.symmetric, queries=all_q)
