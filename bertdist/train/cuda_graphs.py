"""``model.cuda_graphs``: whether the compiled regions run as CUDA graphs.

A BERT-large step on a GPU launches thousands of kernels, and the host's time to launch them can
exceed the device's time to run them. A CUDA graph replays a captured sequence of launches in one
call. The trainer captures through Inductor's CUDA graph trees, the mechanism behind
``torch.compile(mode="reduce-overhead")``: each region ``compile.apply_compile`` compiles with
static shapes (every encoder layer, the embeddings) gets ``graph_options()``, the options of that
mode plus ``triton.cudagraph_skip_dynamic_graphs``. Forward and backward are both captured; all
graphs share one memory pool.

What a run needs besides the option:

- Dynamic shapes are not captured. The sparse MLM head sees a different number of masked
  positions every batch (it is compiled with ``dynamic=True``), and a graph is recorded per shape,
  so it would record one graph per masked count; it stays compiled without graphs. A static region
  that Dynamo recompiles with symbolic shapes (a new batch width, ``unpad``'s token count) is
  skipped by Inductor for the same reason, instead of recording a graph per shape.
- Steps are marked (``mark_step``): once marked, CUDA graph trees start a new generation only at
  the next mark, and a replay reuses the memory of the previous generation's outputs. Each
  micro-batch (and each evaluation batch) is one generation, marked before its forward: the
  outputs read after it (the loss and counts added to the step's sums) are queued on the stream
  before the next replay.
- Gradient accumulation: a backward graph's outputs live in the graph pool, and a parameter whose
  ``.grad`` is None takes that output as its ``.grad``; the next micro-batch's replay would
  overwrite it. With more than one micro-batch per step every such parameter gets a zeroed
  ``.grad`` of its own before the first backward (``stable_grads``), so the backward adds into it.
  (DeepSpeed drops the gradients after each optimizer step; the flat optimizer's gradients are
  views of its own buffer and already stable.)
- Dropout: Inductor draws its random numbers from the CUDA generator, whose Philox offset
  advances on the device at every replay, so each replay draws new numbers; the fused custom ops
  draw from the same generator state (bertdist/ops/fused.py).
- DeepSpeed: the regions are submodules of ``engine.module``; the engine's forward and backward
  hooks run outside the regions, unchanged. ZeRO-3 (weights gathered into new memory every
  forward) and activation checkpointing (forwards recomputed inside the backward) are refused
  with ``true`` (bertdist/train/config.py).
- A capture that fails, or a replay that reads memory a later replay overwrote, raises inside a
  step. The run stops there with ``CudaGraphError``, naming the step, the micro-batch and the fix,
  rather than falling back: by then the step has accumulated part of its gradients and drawn from
  the RNG, and a compiled region cannot drop its graphs without being compiled again, so a
  fallback would not be the same step. Checkpoints make the restart cheap (``--resume auto``). A
  region Inductor decides not to capture (an op a graph cannot hold) is no failure: it runs
  compiled without graphs, and the count of such skips is logged after the first step
  (``skipped_graphs``).

``auto`` is a measured choice per device type, like ``model.compile: auto``: the table below names
the committed measurement. Nothing is measured yet, so ``auto`` runs without graphs, saying so.
``true`` on a CPU device is refused, as ``deepspeed.precision=fp16`` is: a setting that cannot act
on the device is a mistake in the config, and ``auto`` is the setting that travels between
devices.

This module imports torch only inside the functions that run a step.
"""
from __future__ import annotations

import dataclasses
import traceback

from bertdist.config import ConfigError

# The benchmark variant that measures graphs against the same compiled step without them.
BENCH_VARIANT = "ours-trainer-graphs"
# device type -> (graphs under auto, the measurement behind it)
AUTO_DECISIONS: dict[str, tuple[bool, str]] = {}


@dataclasses.dataclass(frozen=True)
class CudaGraphsDecision:
    enabled: bool
    reason: str


class CudaGraphError(RuntimeError):
    """A CUDA graph capture or replay failed inside a step."""


def decide_cuda_graphs(setting: "str | bool", device_type: str, compiled) -> CudaGraphsDecision:
    """What ``model.cuda_graphs: setting`` means on ``device_type`` given the compile decision
    ``compiled`` (a ``compile.CompileDecision``); ConfigError where ``true`` cannot be obeyed."""
    if setting is False:
        return CudaGraphsDecision(False, "model.cuda_graphs=false")
    if setting is True:
        if device_type != "cuda":
            raise ConfigError(f"model.cuda_graphs=true needs a CUDA device; this run's device is {device_type}. "
                              "Set model.cuda_graphs=auto (graphs on CUDA only) or false")
        if not compiled.enabled:
            raise ConfigError(f"model.cuda_graphs=true captures the compiled regions, and this run compiles none "
                              f"({compiled.reason}); set model.compile=true, or model.cuda_graphs=false (or auto)")
        return CudaGraphsDecision(True, "model.cuda_graphs=true")
    if setting != "auto":
        raise ValueError(f"model.cuda_graphs must be true, false or auto, got {setting!r}")
    if device_type != "cuda":
        return CudaGraphsDecision(False, f"model.cuda_graphs=auto: off: CUDA graphs are CUDA's only "
                                         f"(device {device_type})")
    if not compiled.enabled:
        return CudaGraphsDecision(False, "model.cuda_graphs=auto: off: the model is not compiled "
                                         f"({compiled.reason})")
    if device_type in AUTO_DECISIONS:
        enabled, why = AUTO_DECISIONS[device_type]
        return CudaGraphsDecision(enabled, f"model.cuda_graphs=auto: {why}")
    return CudaGraphsDecision(False, f"model.cuda_graphs=auto: off: CUDA graphs not yet measured on {device_type} "
                                     f"(benchmarks/train_throughput.py --variants {BENCH_VARIANT} measures them)")


def graph_options() -> dict[str, bool]:
    """torch.compile's ``options`` for a region captured in CUDA graphs: those of
    ``mode="reduce-overhead"`` (torch's own list), and no capture of a graph with dynamic shapes."""
    from torch._inductor import list_mode_options

    return {**list_mode_options("reduce-overhead"), "triton.cudagraph_skip_dynamic_graphs": True}


def mark_step() -> None:
    """A new generation of CUDA graph trees begins: the previous one's outputs may be overwritten."""
    import torch

    torch.compiler.cudagraph_mark_step_begin()


def stable_grads(params) -> int:
    """A zeroed ``.grad`` for every parameter that needs one and has none, allocated outside any
    graph so the backward adds into it; how many were allocated."""
    import torch

    missing = [p for p in params if p.requires_grad and p.grad is None]
    for p in missing:
        p.grad = torch.zeros_like(p)
    return len(missing)


def skipped_graphs() -> int:
    """Graphs Inductor chose not to capture so far in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))


def is_graph_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from capturing or replaying a CUDA graph: raised inside CUDA graph
    trees, or a CUDA error about stream capture, or torch's error about an overwritten output."""
    text = str(exc).lower()
    if "captur" in text or "cudagraph" in text:
        return True
    return any("cudagraph" in frame.filename for frame in traceback.extract_tb(exc.__traceback__))


def raise_graph_failure(exc: BaseException, where: str) -> None:
    """Stop the run: a graph failed ``where`` (e.g. "step 3, micro-batch 2 of 4")."""
    raise CudaGraphError(f"CUDA graphs (model.cuda_graphs) failed at {where}: {type(exc).__name__}: {exc}. "
                         "Restart without them: model.cuda_graphs=false, with --resume auto to continue from the "
                         "last checkpoint") from exc
