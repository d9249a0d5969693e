"""How ``kernels: auto`` times a candidate that passed the numerics gate.

Forward + backward with the case's dropout, after a warm-up, as ``repeats`` samples, each
averaged over enough calls to last ~1 ms (CUDA events on a GPU, perf_counter elsewhere); the
planning takes their median. A ``Timer`` can be injected (tests give fixed times) in place of
``default_timer``.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from bertdist.ops.candidates import Candidate, Case


def time_call(call: Callable[[], None], device: torch.device, *, warmup: int = 3, repeats: int = 7,
              target_ms: float = 1.0) -> list[float]:
    """Milliseconds per call, ``repeats`` samples, each averaged over enough calls to last
    ``target_ms`` (CUDA events on a GPU, perf_counter elsewhere), after ``warmup`` calls."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        call()
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize(device)
    inner = int(min(50, max(1, math.ceil(target_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)))))
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            t = time.perf_counter()
            for _ in range(inner):
                call()
            samples.append((time.perf_counter() - t) * 1e3 / inner)
    return samples


# (candidate, case, one forward + backward call, device) -> samples in ms: how ``decide_case`` times.
Timer = Callable[[Candidate, Case, Callable[[], None], torch.device], list[float]]


def default_timer(candidate: Candidate, case: Case, call: Callable[[], None], device: torch.device) -> list[float]:
    return time_call(call, device)
