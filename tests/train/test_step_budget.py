"""Host syncs and aten operators of a real trainer step, against the budget committed beside this
file (step_budget.json). A step that does not log must never read the device; settling a logging
window reads it once; and the operators a step dispatches (about the kernels it launches on a GPU)
must not grow past the budget. Raising a budget is a decision to make in review, with the reason."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.train.conftest import tiny_cfg
from tests.train.host_sync_counter import HostSyncCounter

BUDGET = json.loads(Path(__file__).with_name("step_budget.json").read_text())
CASES = {  # budget key -> overrides of the tiny recipe (fp32 on CPU; LAMB as in the BERT recipes)
    "lamb": (),
    "adamw": ("optimizer.name=adamw",),
    # bf16 with the flat optimizer: weights fp32 under autocast, and bf16 weights with fp32 masters
    "lamb_flat_bf16_autocast": ("optimizer.implementation=flat", "deepspeed.precision=bf16",
                                "deepspeed.bf16_weights=fp32"),
    "lamb_flat_bf16_weights": ("optimizer.implementation=flat", "deepspeed.precision=bf16",
                               "deepspeed.bf16_weights=bf16"),
    # the same with the fused kernels (the C++ twins of the CUDA ones): no cast of the layer norms'
    # parameters. Dropout off: on CPU a fused op draws its dropout seed on the host (a CUDA kernel
    # draws it from the device generator), which the counter would count as a device read
    "lamb_flat_bf16_weights_fused": ("optimizer.implementation=flat", "deepspeed.precision=bf16",
                                     "deepspeed.bf16_weights=bf16", "model.kernels=fused",
                                     "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0"),
}
COPIES = ("aten.copy_", "aten._to_copy")  # casts and copies: what bf16 weights save


def _runner(cfg, records):
    """The run's engine and runner as the trainer builds them (``inprocess.build_run``), and its loader."""
    from bertdist.data import continuation_mask
    from bertdist.train.inprocess import build_run
    from bertdist.train.loader import LoaderState, PretrainingLoader, open_training_records

    run = build_run(cfg, torch.device("cpu"))
    loader = PretrainingLoader(open_training_records(str(records), cfg.data.vocab_file, cfg.data.max_seq_length),
                               cfg.data, rank=0, world_size=1, grad_accum=1,
                               continuation=continuation_mask(cfg.data.vocab_file))
    return run.runner, loader.steps(LoaderState())


def _host_tensors(engine) -> list[torch.Tensor]:
    """The optimizer's step counters: host tensors on every device, by design (bertdist.train.lamb)."""
    return [s["step"] for s in engine.optimizer.state.values()
            if isinstance(s.get("step"), torch.Tensor) and s["step"].device.type == "cpu"]


def measure(cfg, records) -> dict:
    from bertdist.train.loader import HOST_INTS
    from bertdist.train.step import launch_step, settle

    runner, steps = _runner(cfg, records)
    try:
        warm = [launch_step(runner, next(steps)[0], False) for _ in range(2)]  # optimizer state made
        settle(warm, 1, cfg.deepspeed.precision)
        batches = [next(steps)[0] for _ in range(3)]
        # the batches' packing sizes are read from host tensors (loader.HOST_INTS), by design
        host = _host_tensors(runner.engine) + [mb[k] for b in batches for mb in b for k in HOST_INTS if k in mb]
        with HostSyncCounter(host) as unlogged:
            pending = [launch_step(runner, batches[0], False)]
        with HostSyncCounter(host) as more:
            pending += [launch_step(runner, b, False) for b in batches[1:]]
        with HostSyncCounter(host) as settled:
            results = settle(pending, 3, cfg.deepspeed.precision)
    finally:
        steps.close()
    assert len(results) == 3 and all(r.sums["sequences"] == 16 for r in results)
    copies = max(sum(unlogged.ops[k] for k in COPIES), sum(more.ops[k] for k in COPIES) // 2)
    return {"unlogged_step_syncs": unlogged.syncs + more.syncs, "settle_syncs": settled.syncs,
            "aten_ops_per_step": max(unlogged.aten_ops, more.aten_ops // 2), "copies_per_step": copies}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_reads_the_device_only_when_its_window_settles(group, tmp_path, train_records, small_vocab, case):
    budget = BUDGET[case]
    got = measure(tiny_cfg(tmp_path, train_records, small_vocab, *CASES[case]), train_records)
    assert got["unlogged_step_syncs"] == [], f"steps that do not log read the device: {got['unlogged_step_syncs']}"
    assert len(got["settle_syncs"]) <= budget["settle_syncs"], got["settle_syncs"]
    assert got["aten_ops_per_step"] <= budget["aten_ops_per_step"], (
        f"{case}: {got['aten_ops_per_step']} aten operators per step, budget {budget['aten_ops_per_step']} "
        f"(tests/train/step_budget.json)")
    if "copies_per_step" in budget:
        assert got["copies_per_step"] <= budget["copies_per_step"], (
            f"{case}: {got['copies_per_step']} aten copy_/_to_copy per step, budget {budget['copies_per_step']} "
            f"(tests/train/step_budget.json)")


def test_the_counter_sees_each_kind_of_host_read():
    t = torch.ones(3)
    with HostSyncCounter([]) as c:
        t.sum().item()
        float(t[0])
        bool(t.any())
        t.tolist()
        t.cpu()
        torch.cuda.synchronize()  # counted, not run: the counter replaces it
    assert [what for what, _ in c.syncs] == ["item", "item", "item", "tolist", "cpu", "synchronize"]
    assert c.ops["aten.sum"] == 1 and c.aten_ops >= 4
    with HostSyncCounter([t]) as c:
        t[1].item()  # a view at another offset is another data pointer: counted
        t.sum().item()
    assert len(c.syncs) == 2
