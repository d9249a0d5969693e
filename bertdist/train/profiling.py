"""torch.profiler over a window of training steps (the ``profiling`` section of a pretraining config).

Where a step's time goes decides what would make it faster: a step whose device is busy most of
the time is bound by arithmetic and memory, one whose device waits is bound by the host (Python,
operator dispatch, kernel launches, DeepSpeed's per-parameter work). The summary says which, with
the numbers: wall time per step, the device's busy time per step (the union of its kernel and copy
intervals, so overlapping streams are not counted twice), kernel launches and aten operator calls
per step, and the operators that take the most host and device time.

Each rank writes ``run_dir/profile/rank<r>.summary.json`` and ``rank<r>.ops.txt`` (torch's
operator tables), and with ``trace`` a Chrome trace ``rank<r>.trace.json``.
"""
from __future__ import annotations

import bisect
import json
import time
from pathlib import Path

import torch

from bertdist.train.config import ProfilingConfig

PROFILE_DIR = "profile"


def _device_time(evt) -> float:
    # torch >= 2.4 names it self_device_time_total; older releases self_cuda_time_total
    return float(getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0.0)) or 0.0)


def _is_device_event(evt) -> bool:
    return getattr(evt, "device_type", None) not in (None, torch.autograd.DeviceType.CPU)


def _annotation_names(events) -> set[str]:
    """Names of ``record_function`` ranges: on CUDA the profiler also lays each over the device's
    timeline (from its first kernel to its last, gaps included), which is not work."""
    from bertdist.train.step import REGIONS

    return set(REGIONS) | {e.name for e in events if getattr(e, "is_user_annotation", False)}


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: the time at least one of them runs."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _top(averages, key, n: int) -> list[dict]:
    rows = sorted(averages, key=key, reverse=True)[:n]
    return [{"op": a.key, "calls": int(a.count), "self_cpu_ms": a.self_cpu_time_total / 1e3,
             "self_device_ms": _device_time(a) / 1e3} for a in rows if key(a) > 0]


def regions(events, names: tuple[str, ...], steps: int) -> dict[str, dict]:
    """Per step, for each ``record_function`` region of ``names`` (bertdist.train.step.REGIONS):
    its wall time on the host's clock (waits for the device included) and the aten calls that
    started inside it on any thread: autograd runs a CUDA backward on a thread of its own."""
    host = [e for e in events if not _is_device_event(e)]
    aten = sorted(e.time_range.start for e in host if e.name.startswith("aten::"))
    out = {}
    for name in names:
        hits = [e for e in host if e.name == name]
        if hits:
            calls = sum(bisect.bisect_left(aten, e.time_range.end) - bisect.bisect_left(aten, e.time_range.start)
                        for e in hits)
            out[name.rsplit("/", 1)[-1]] = {"wall_ms_per_step": sum(e.cpu_time_total for e in hits) / 1e3 / steps,
                                            "aten_calls_per_step": calls / steps}
    return out


# CUDA runtime calls that make the host wait for the device, and those that launch a kernel
HOST_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                   "cuStreamSynchronize", "cuCtxSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch")


def summarize(prof, steps: int, wall_s: float, top: int, device_type: str) -> dict:
    """The numbers of one profiled window of ``steps`` steps that took ``wall_s`` seconds."""
    from bertdist.train.step import REGIONS

    events = prof.events()
    annotations = _annotation_names(events)
    device = [e for e in events if _is_device_event(e) and e.name not in annotations
              and not getattr(e, "is_user_annotation", False)]
    # collectives wait for the other ranks on the device: their time is not this rank's work
    comm = [e for e in device if e.name.lower().startswith("nccl")]
    work = [e for e in device if not e.name.lower().startswith("nccl")]
    copies = [e for e in work if e.name.lower().startswith(("memcpy", "memset"))]
    averages = [a for a in prof.key_averages() if a.key not in annotations]
    per_step = wall_s * 1e3 / steps
    out = {
        "steps": steps, "device_type": device_type, "wall_ms_per_step": per_step,
        "aten_calls_per_step": sum(1 for e in events if not _is_device_event(e) and e.name.startswith("aten::"))
        / steps,
        "regions": regions(events, REGIONS, steps),
        "top_by_self_cpu": _top([a for a in averages if not _is_device_event(a)], lambda a: a.self_cpu_time_total, top),
    }
    if device_type == "cuda":
        busy = busy_us([(e.time_range.start, e.time_range.end) for e in work]) / 1e3
        host = [e for e in events if not _is_device_event(e)]
        out.update(
            host_syncs_per_step=sum(1 for e in host if e.name in HOST_SYNC_CALLS) / steps,
            launches_per_step=sum(1 for e in host if e.name in LAUNCH_CALLS) / steps,
            device_busy_ms_per_step=busy / steps, device_busy_fraction=busy / steps / per_step if per_step else 0.0,
            kernels_per_step=(len(work) - len(copies)) / steps, copies_per_step=len(copies) / steps,
            collectives_ms_per_step=busy_us([(e.time_range.start, e.time_range.end) for e in comm]) / 1e3 / steps,
            # operators by the device time of the kernels they launched, and the kernels themselves
            top_by_self_device=_top([a for a in averages if not _is_device_event(a)], _device_time, top),
            top_kernels=_top([a for a in averages if _is_device_event(a)], _device_time, top))
    return out


class StepProfiler:
    """Starts torch.profiler before step ``cfg.start_step`` and stops it after ``cfg.last_step``;
    ``before(step)`` / ``after(step)`` take the 1-based number of the step being run."""

    def __init__(self, cfg: ProfilingConfig, run_dir: str | Path, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.dir = Path(run_dir) / PROFILE_DIR
        self.prof = None
        self.t0 = 0.0

    def active(self, step: int) -> bool:
        """Whether ``step`` ran under the profiler (a run resumed inside the window profiles nothing)."""
        return self.prof is not None and self.cfg.start_step <= step <= self.cfg.last_step

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, step: int) -> None:
        if not self.cfg.enabled or step != self.cfg.start_step:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self.prof = profile(activities=activities)
        self.prof.start()
        self.t0 = time.perf_counter()

    def after(self, step: int) -> dict | None:
        """The summary, once the window's last step is done (else None)."""
        if self.prof is None or step != self.cfg.last_step:
            return None
        return self._finish(self.cfg.num_steps)

    def close(self, steps_done: int) -> None:
        """Ends a window cut short (the run stopped inside it), writing what it has."""
        if self.prof is not None and steps_done >= self.cfg.start_step:
            self._finish(steps_done - self.cfg.start_step + 1)

    def abandon(self) -> None:
        """Stops a window without writing it (the run failed inside it)."""
        prof, self.prof = self.prof, None
        if prof is not None:
            try:
                prof.stop()
            except Exception:  # noqa: BLE001 - the run's own error is the one to report
                pass

    def _finish(self, steps: int) -> dict:
        self._sync()
        wall = time.perf_counter() - self.t0
        prof, self.prof = self.prof, None
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        base = self.dir / f"rank{self.rank}"
        try:
            summary = summarize(prof, steps, wall, self.cfg.top_ops, self.device.type)
        except Exception as e:  # noqa: BLE001 - a profiler that cannot be read must not end the run
            summary = {"steps": steps, "device_type": self.device.type, "wall_ms_per_step": wall * 1e3 / steps,
                       "error": f"{type(e).__name__}: {e}"}
        summary["first_step"] = self.cfg.start_step
        # torch's own tables and trace: a profiler version that cannot write them leaves a note, not a failed run
        sorts = ["self_cpu_time_total"] + (["self_device_time_total"] if self.device.type == "cuda" else [])
        tables = []
        for key in sorts:
            try:
                tables.append(prof.key_averages().table(sort_by=key, row_limit=self.cfg.top_ops))
            except Exception as e:  # noqa: BLE001
                tables.append(f"(no table sorted by {key}: {type(e).__name__}: {e})")
        Path(f"{base}.ops.txt").write_text("\n\n".join(tables) + "\n")
        if self.cfg.trace:
            try:
                prof.export_chrome_trace(f"{base}.trace.json")
            except Exception as e:  # noqa: BLE001
                summary["trace_error"] = f"{type(e).__name__}: {e}"
        Path(f"{base}.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary


def describe(summary: dict) -> str:
    """One line for the run's log."""
    s = f"profile of steps {summary['first_step']}-{summary['first_step'] + summary['steps'] - 1}: " \
        f"{summary['wall_ms_per_step']:.1f} ms/step"
    if "error" in summary:
        return s + f"; the profile could not be summarised: {summary['error']}"
    s += f", {summary['aten_calls_per_step']:.0f} aten calls/step"
    if "device_busy_ms_per_step" in summary:
        s += (f", device busy {summary['device_busy_ms_per_step']:.1f} ms/step "
              f"({100 * summary['device_busy_fraction']:.0f}%), {summary['kernels_per_step']:.0f} kernels/step, "
              f"{summary['launches_per_step']:.0f} launches/step, {summary['host_syncs_per_step']:.1f} host syncs/step")
    parts = [f"{k} {v['wall_ms_per_step']:.1f} ms / {v['aten_calls_per_step']:.0f} calls"
             for k, v in summary.get("regions", {}).items()]
    return s + ("; per step: " + ", ".join(parts) if parts else "")
