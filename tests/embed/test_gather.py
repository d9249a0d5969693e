"""In-batch negatives across 2 gloo ranks against one process holding the whole batch.

Each rank saves its loss and gradients; the parent checks them against the single-process
loss over the concatenated batch: the mean of the rank losses is that loss, each rank's
embedding gradients divided by the world size (DDP's averaging) are the single-process
gradients of its rows, and a DDP-wrapped encoder ends with the single-process parameter
gradients. A gather whose backward keeps only the local slice must fail the same check.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from bertdist.embed.gather import all_gather_with_grad, mnrl_across_ranks
from bertdist.embed.losses import MultipleNegativesRankingLoss, mnrl
from tests.conftest import free_port

WORLD, B, K, H, H_IN = 2, 3, 2, 8, 5
UNEVEN = (3, 2)  # rows per rank in the uneven case


def _data():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(WORLD * B, H, generator=g, dtype=torch.float64)
    p = torch.randn(WORLD * B, H, generator=g, dtype=torch.float64)
    n = torch.randn(WORLD * B, K, H, generator=g, dtype=torch.float64)
    xq = torch.randn(WORLD * B, H_IN, generator=g, dtype=torch.float64)
    xp = torch.randn(WORLD * B, H_IN, generator=g, dtype=torch.float64)
    return q, p, n, xq, xp


def _encoder() -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(H_IN, H).double()


class _LocalSliceGather(torch.autograd.Function):
    """The tempting wrong gather: the backward keeps this rank's slice of the gradient, no communication."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_(True)


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        q, p, n, xq, xp = _data()
        rows = slice(rank * B, (rank + 1) * B)
        out = {}
        for name, loss, negs in (("negs", MultipleNegativesRankingLoss(), True),
                                 ("sym", MultipleNegativesRankingLoss(symmetric=True), False)):
            lq, lp, ln = _leaf(q[rows]), _leaf(p[rows]), _leaf(n[rows])
            value = mnrl_across_ranks(loss, lq, lp, ln if negs else None)
            value.backward()
            out[name] = {"loss": value.item(), "q": lq.grad, "p": lp.grad, "n": ln.grad if negs else None}

        # unequal row counts: rank 0 holds rows 0..2, rank 1 rows 3..4
        start = sum(UNEVEN[:rank])
        urows = slice(start, start + UNEVEN[rank])
        lq, lp, ln = _leaf(q[urows]), _leaf(p[urows]), _leaf(n[urows])
        value = mnrl_across_ranks(MultipleNegativesRankingLoss(), lq, lp, ln)
        value.backward()
        out["uneven"] = {"loss": value.item(), "q": lq.grad, "p": lp.grad, "n": ln.grad,
                         "gathered": all_gather_with_grad(q[urows]).detach()}

        # the wrong gather, for the negative control
        lq, lp = _leaf(q[rows]), _leaf(p[rows])
        value = mnrl(lq, _LocalSliceGather.apply(lp), None, rank * B, 20.0)
        value.backward()
        out["local_slice"] = {"q": lq.grad, "p": lp.grad}

        # an encoder under DDP: its averaged parameter gradients
        model = DDP(_encoder())
        value = mnrl_across_ranks(MultipleNegativesRankingLoss(), model(xq[rows]), model(xp[rows]))
        value.backward()
        out["ddp"] = {"weight": model.module.weight.grad, "bias": model.module.bias.grad}
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=lambda m: f"{what}: {m}")


def _single(loss: MultipleNegativesRankingLoss, negs: bool):
    q, p, n, _, _ = _data()
    lq, lp, ln = _leaf(q), _leaf(p), _leaf(n)
    value = loss(lq, lp, ln if negs else None)
    value.backward()
    return value.item(), lq.grad, lp.grad, ln.grad


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("gather")
    mp.spawn(_rank_main, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow  # two gloo rank processes (the module's fixture): about 7 s
@pytest.mark.parametrize("case,symmetric,negs", [("negs", False, True), ("sym", True, False)])
def test_rank_losses_and_gradients_equal_the_single_process_ones(ranks, case, symmetric, negs):
    loss, gq, gp, gn = _single(MultipleNegativesRankingLoss(symmetric=symmetric), negs)
    mean = sum(r[case]["loss"] for r in ranks) / WORLD
    assert mean == pytest.approx(loss, abs=1e-6), f"mean of rank losses {[r[case]['loss'] for r in ranks]}"
    for rank, r in enumerate(ranks):
        rows = slice(rank * B, (rank + 1) * B)
        _close(r[case]["q"] / WORLD, gq[rows], f"{case} rank {rank} query grad / {WORLD}")
        _close(r[case]["p"] / WORLD, gp[rows], f"{case} rank {rank} positive grad / {WORLD}")
        if negs:
            _close(r[case]["n"] / WORLD, gn[rows], f"{case} rank {rank} negative grad / {WORLD}")


@pytest.mark.slow
def test_uneven_rank_batches(ranks):
    q, p, n, _, _ = _data()
    lq, lp, ln = _leaf(q[:sum(UNEVEN)]), _leaf(p[:sum(UNEVEN)]), _leaf(n[:sum(UNEVEN)])
    # each rank: its own rows' mean against everything gathered; DDP sums the rank losses' gradients
    per_rank = [mnrl(lq[o:o + b], lp, ln.reshape(-1, H), o, 20.0) for o, b in ((0, UNEVEN[0]), (UNEVEN[0], UNEVEN[1]))]
    sum(per_rank).backward()
    for rank, r in enumerate(ranks):
        _close(r["uneven"]["gathered"], q[:sum(UNEVEN)], f"rank {rank} gathered rows")
        assert r["uneven"]["loss"] == pytest.approx(per_rank[rank].item(), abs=1e-6)
        rows = slice(sum(UNEVEN[:rank]), sum(UNEVEN[:rank + 1]))
        _close(r["uneven"]["q"], lq.grad[rows], f"uneven rank {rank} query grad")
        _close(r["uneven"]["p"], lp.grad[rows], f"uneven rank {rank} positive grad")
        _close(r["uneven"]["n"], ln.grad[rows], f"uneven rank {rank} negative grad")


@pytest.mark.slow
def test_a_local_slice_backward_fails_the_same_check(ranks):
    _, _, gp, _ = _single(MultipleNegativesRankingLoss(), False)
    # the positives are every rank's in-batch negatives: their gradient misses the other rank's loss
    worst = max((r["local_slice"]["p"] / WORLD - gp[rank * B:(rank + 1) * B]).abs().max().item()
                for rank, r in enumerate(ranks))
    assert worst > 1e-3, f"the local-slice gather's positive gradients differ by only {worst}"


@pytest.mark.slow
def test_ddp_parameter_gradients_equal_the_single_process_ones(ranks):
    _, _, _, xq, xp = _data()
    enc = _encoder()
    MultipleNegativesRankingLoss()(enc(xq), enc(xp)).backward()
    for rank, r in enumerate(ranks):
        _close(r["ddp"]["weight"], enc.weight.grad, f"rank {rank} DDP weight grad")
        _close(r["ddp"]["bias"], enc.bias.grad, f"rank {rank} DDP bias grad")


def test_without_a_process_group_the_gather_is_the_identity():
    x = torch.randn(3, 4)
    assert all_gather_with_grad(x) is x
    q, p, n, _, _ = _data()
    loss = MultipleNegativesRankingLoss()
    assert mnrl_across_ranks(loss, q, p, n).item() == pytest.approx(loss(q, p, n).item(), abs=1e-12)
