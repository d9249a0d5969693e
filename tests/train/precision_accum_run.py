"""One optimizer step of 64 accumulated micro-batches per rank through DeepSpeed's real engine,
with the DeepSpeed config bertdist generates for ``deepspeed.precision`` (launched by
tests/train/test_precision.py on 2 CPU ranks, gloo).

The probe is one ``nn.Linear(WIDTH, 1)`` with zero weights and loss = its output, so the gradient
of micro-batch i is its input x_i. Every x_i is exact in bf16 (1 + k/128) and so is every
per-micro-batch gradient, in bf16 compute too; the exact mean over the 128 micro-batches needs
about 14 significant bits. With plain SGD at lr 1 the applied update is minus the gradient the
optimizer saw, so any difference from the float64 reference comes from how the gradients were
accumulated, communicated and stored. Rank 0 writes the result to OUT_JSON.

Usage: precision_accum_run.py OUT_JSON PRECISION
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

from bertdist.train.config import check_batch_sizes, train_config_from_dict  # noqa: E402
from bertdist.train.ds_config import generate_ds_config  # noqa: E402
from bertdist.train.lamb import Lamb  # noqa: E402

WIDTH = 256
ACCUM = 64


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(WIDTH, 1, bias=False)
        torch.nn.init.zeros_(self.dense.weight)

    def forward(self, x):
        # x is exact in bf16: the cast matters only where DeepSpeed made the weights bf16.
        return self.dense(x.to(self.dense.weight.dtype)).sum()


def micro_batch(rank: int, i: int) -> torch.Tensor:
    k = (torch.arange(WIDTH) * 13 + i * 7 + rank * 29) % 128
    return (1.0 + k.double() / 128).float().unsqueeze(0)  # [1, WIDTH], exact in bf16


def main() -> None:
    out, precision = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = train_config_from_dict({
        "model": {"preset": "tiny"},
        "data": {"micro_batch_size": 1, "global_batch_size": ACCUM * world},
        "optimizer": {"name": "lamb"},
        "deepspeed": {"zero_stage": 0, "precision": precision, "gradient_clipping": 0.0},
    })
    accum = check_batch_sizes(cfg.data, world)
    assert accum == ACCUM, accum
    ds_config = generate_ds_config(cfg, world, accum)

    model = Probe()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                           config=ds_config, dist_init_required=False)
    for i in range(ACCUM):
        engine.backward(engine(micro_batch(rank, i)))
        grad = engine.module.dense.weight.grad
        grad_dtype = str(grad.dtype) if grad is not None else None
        engine.step()
    update = engine.module.dense.weight.detach().double().reshape(-1)
    reference = -torch.stack([micro_batch(r, i).double().reshape(-1) for r in range(world)
                              for i in range(ACCUM)]).mean(0)

    # LAMB through the same config: DeepSpeed must hand our optimizer the module's own tensors
    # (its per-tensor trust ratio), not flattened or low-precision copies.
    lamb_model = Probe()
    lamb = Lamb(lamb_model.parameters(), lr=1e-2)
    lamb_engine, _, _, _ = deepspeed.initialize(model=lamb_model, optimizer=lamb, config=ds_config,
                                                dist_init_required=False)
    module_params = {id(p) for p in lamb_engine.module.parameters()}
    optimizer_params = [p for g in lamb_engine.optimizer.param_groups for p in g["params"]]
    for i in range(ACCUM):
        lamb_engine.backward(lamb_engine(micro_batch(rank, i)))
        lamb_engine.step()

    if rank == 0:
        with open(out, "w") as f:
            json.dump({
                "update": update.tolist(), "reference": reference.tolist(),
                "param_dtype": str(engine.module.dense.weight.dtype), "last_grad_dtype": grad_dtype,
                "optimizer": type(engine.optimizer).__name__,
                "lamb_optimizer": type(lamb_engine.optimizer).__name__,
                "lamb_params_are_module_tensors": all(id(p) in module_params for p in optimizer_params)
                and len(optimizer_params) == len(module_params),
                "lamb_param_dtypes": sorted({str(p.dtype) for p in optimizer_params}),
                "lamb_moved": bool((lamb_engine.module.dense.weight != 0).any()),
            }, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from bertdist.cli.main import end_program

    main()
    end_program(0)
