"""A run's engine and step runner built in this process, without ``run_pretraining``'s loop: the
trainer's own step for benchmarks that time it beside other implementations on the same batches
(benchmarks/train_throughput.py, ``ours-trainer``), and for tests. One rank; the caller holds the
process group (``distributed.single_process_group``)."""
from __future__ import annotations

import dataclasses

import torch

from bertdist.train.config import TrainConfig


@dataclasses.dataclass
class InProcessRun:
    runner: object  # bertdist.train.step.StepRunner
    engine: object  # deepspeed.DeepSpeedEngine
    compile_reason: str
    compiled_regions: int
    cuda_graphs: bool = False
    cuda_graphs_reason: str = ""


def build_run(cfg: TrainConfig, device: torch.device, kernels=None) -> InProcessRun:
    """What ``run_pretraining`` builds before its first step, for a fresh start on one rank:
    the engine (model, optimizer, schedule, DeepSpeed), the compile and CUDA graph decisions applied, the runner."""
    from bertdist.train.compile import apply_compile, decide_compile
    from bertdist.train.cuda_graphs import decide_cuda_graphs
    from bertdist.train.engine import build_engine
    from bertdist.train.restore import RestorePlan, new_state, restore
    from bertdist.train.step import StepRunner

    built = build_engine(cfg, RestorePlan("fresh"), 1, 1, device.type, kernels)
    restore(built.engine, built.scheduler, RestorePlan("fresh"), cfg, 0, new_state(cfg, 1, 1))
    built.engine.train()
    decision = decide_compile(cfg.model.compile, device.type)
    graphs = decide_cuda_graphs(cfg.model.cuda_graphs, device.type, decision)
    regions = apply_compile(built.engine.module, decision, graphs=graphs.enabled)
    return InProcessRun(StepRunner.for_run(built.engine, cfg, device, 1, cuda_graphs=graphs.enabled), built.engine,
                        decision.reason, len(regions), graphs.enabled, graphs.reason)
