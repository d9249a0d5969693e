"""How ``kernels: auto`` times a candidate that passed the numerics gate.

One call is a forward + backward of the region the candidate is timed in (``layer_timing.py``)
or of the op alone, after a warm-up, as ``repeats`` samples, each averaged over enough calls to
last ~20 ms for a region, ~1 ms for an op (CUDA events on a GPU, perf_counter elsewhere); the
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
              target_ms: float = 1.0, min_inner: int = 1) -> list[float]:
    """Milliseconds per call, ``repeats`` samples, each averaged over enough calls (at least
    ``min_inner``) to last ``target_ms`` (CUDA events on a GPU, perf_counter elsewhere), after
    ``warmup`` calls. On a GPU the events bracket a batch of calls queued back to back, so the
    device time is measured: the host's dispatch counts only where it leaves the device idle."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        call()
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize(device)
    inner = int(min(50, max(min_inner, math.ceil(target_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)))))
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
    if case.layer is not None:  # a layer's step: a batch of at least 5 to keep the device's queue full
        return time_call(call, device, target_ms=20.0, min_inner=5)
    return time_call(call, device)
