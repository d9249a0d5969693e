"""In-batch negatives across data-parallel ranks.

``all_gather_with_grad(x)`` concatenates every rank's ``[b_r, H]`` rows, in rank order, into
``[sum b_r, H]`` and keeps the graph: the backward pass all-reduces (SUM) the gradient of the
gathered tensor and hands each rank the rows of its own slice. ``mnrl_across_ranks`` ranks each
rank's queries against the positives (and hard negatives) of all ranks; ``global_batch_mnrl`` does
the same over Matryoshka widths (the embedding trainer's loss).

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
any collective; a rank without hard negatives joins their gather with zero rows. With unequal
sizes the mean of the per-rank losses weighs each rank equally, as DDP does for any loss.
Without an initialised process group the gather returns ``x`` itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from bertdist.embed.losses import MultipleNegativesRankingLoss, flat_negatives, mnrl
from bertdist.train.distributed import process_group


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
    if not process_group():
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
    offset, all_pos, all_q, all_negs = gather_batch(query, positive, negs, loss.symmetric, group)
    return mnrl(query, all_pos, all_negs, offset, loss.scale, loss.symmetric, queries=all_q)


def global_batch_mnrl(query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None, scale: float,
                      symmetric: bool, dims: list[int] | None = None, weights: list[float] | None = None,
                      group=None) -> torch.Tensor:
    """``mnrl_across_ranks`` on the first d dimensions for each of ``dims`` (Matryoshka), summed
    with ``weights``; one width, the full one, without ``dims``. ``negatives``: ``[N, H]`` rows."""
    offset, all_p, all_q, all_n = gather_batch(query, positive, negatives, symmetric, group)
    dims = dims or [query.shape[1]]
    total = None
    for d, w in zip(dims, weights or [1.0] * len(dims)):
        term = w * mnrl(query[:, :d], all_p[:, :d], None if all_n is None else all_n[:, :d], offset, scale,
                        symmetric, queries=all_q[:, :d] if symmetric else None)
        total = term if total is None else total + term
    return total


def gather_batch(query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None, symmetric: bool,
                 group=None) -> tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The global batch as this rank's MNRL sees it: ``(offset, positives, queries, negatives)``,
    every rank's rows in rank order with gradients; ``offset``: the rows on the ranks before this
    one; queries only when ``symmetric``. Without a process group, this rank's own rows."""
    if not process_group():
        return 0, positive, query if symmetric else None, negatives
    sizes = gathered_sizes(query.shape[0], query.device, group)
    rank = dist.get_rank(group)
    all_p = _AllGatherWithGrad.apply(positive, sizes, rank, group)
    all_q = _AllGatherWithGrad.apply(query, sizes, rank, group) if symmetric else None
    # every rank joins the negatives' gather, with zero rows when it has none
    all_n = all_gather_with_grad(negatives if negatives is not None else query[:0], group)
    return sum(sizes[:rank]), all_p, all_q, all_n if all_n.shape[0] else None
