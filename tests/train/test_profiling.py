"""The ``profiling`` section: torch.profiler over a window of steps of a real pretraining run."""
from __future__ import annotations

import json

import pytest

from bertdist.config import ConfigError
from bertdist.train.profiling import busy_us, summarize
from tests.train.conftest import TINY, assert_ok, metrics, run_pretrain, tiny_args


def test_busy_time_is_the_union_of_the_intervals():
    # [0, 10) and [5, 12) overlap: 12; [20, 25) is apart: 5; [21, 22) lies inside it: 0
    assert busy_us([(20, 25), (0, 10), (5, 12), (21, 22)]) == 17
    assert busy_us([]) == 0


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Event:
    def __init__(self, name, start, end, device=False, annotation=False):
        import torch

        self.name, self.key, self.count = name, name, 1
        self.time_range = _Range(start, end)
        self.device_type = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
        self.is_user_annotation = annotation
        self.cpu_time_total = self.self_cpu_time_total = 0.0 if device else (end - start)
        self.self_device_time_total = (end - start) if device else 0.0


class _Profile:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events

    def key_averages(self):
        return self._events


def test_device_busy_time_counts_kernels_and_copies_not_annotations_or_collectives():
    """Times in microseconds, one step of 1,000 us: kernels at [100, 300) and [250, 400), a copy at
    [600, 650), the backward region's range on the device timeline [100, 900) (not work), an NCCL
    all-reduce [700, 800); the backward region on the host holds two aten calls, one from autograd's
    own thread (start 520), one forward call lies outside it."""
    events = [
        _Event("bertdist/backward", 100, 900), _Event("bertdist/backward", 100, 900, device=True, annotation=True),
        _Event("aten::mm", 150, 160), _Event("aten::mm", 520, 530), _Event("aten::add", 950, 960),
        _Event("sm90_gemm_kernel", 100, 300, device=True), _Event("elementwise_kernel", 250, 400, device=True),
        _Event("Memcpy DtoD (Device -> Device)", 600, 650, device=True),
        _Event("ncclDevKernel_AllReduce_Sum_f32", 700, 800, device=True),
    ]
    s = summarize(_Profile(events), steps=1, wall_s=1e-3, top=5, device_type="cuda")
    assert s["device_busy_ms_per_step"] == pytest.approx(0.35)  # [100, 400) and [600, 650)
    assert s["device_busy_fraction"] == pytest.approx(0.35)
    assert s["kernels_per_step"] == 2 and s["copies_per_step"] == 1
    assert s["collectives_ms_per_step"] == pytest.approx(0.1)
    assert s["aten_calls_per_step"] == 3
    assert s["regions"] == {"backward": {"wall_ms_per_step": pytest.approx(0.8), "aten_calls_per_step": 2}}
    assert [r["op"] for r in s["top_kernels"]][:2] == ["sm90_gemm_kernel", "elementwise_kernel"]
    assert all(not r["op"].startswith("bertdist/") for r in s["top_by_self_cpu"] + s["top_kernels"])


def test_window_is_checked_against_the_run(tmp_path):
    from bertdist.train.config import load_train_config

    with pytest.raises(ConfigError, match=r"profiling.start_step must be >= 1, got 0"):
        load_train_config(TINY, ["profiling.enabled=true", "profiling.start_step=0"])
    # tiny.yaml runs 40 steps; max_steps=5 stops at 5, before steps 4-6 are done
    with pytest.raises(ConfigError, match=r"steps 4-6 end after the run's last step 5 .*max_steps 5"):
        load_train_config(TINY, ["profiling.enabled=true", "profiling.start_step=4", "profiling.num_steps=3",
                                 "max_steps=5"])
    cfg = load_train_config(TINY, ["max_steps=5", "profiling.start_step=4", "profiling.num_steps=3"])
    assert not cfg.profiling.enabled  # a window past the end is fine while profiling is off


def test_a_profiled_window_writes_its_summary_tables_and_trace(tmp_path, train_records, small_vocab):
    run_dir = tmp_path / "run"
    res = run_pretrain(1, tiny_args(run_dir, train_records, small_vocab, "max_steps=4", "eval.every_steps=0",
                                    "eval.at_start=false", "eval.at_end=false", "checkpoint.every_steps=0",
                                    "checkpoint.save_at_end=false", "profiling.enabled=true",
                                    "profiling.start_step=2", "profiling.num_steps=2", "profiling.top_ops=5"))
    assert_ok(res)
    assert "profile of steps 2-3:" in res.stderr
    prof = run_dir / "profile"
    summary = json.loads((prof / "rank0.summary.json").read_text())
    assert summary["steps"] == 2 and summary["first_step"] == 2 and summary["device_type"] == "cpu"
    assert summary["wall_ms_per_step"] > 0 and summary["aten_calls_per_step"] > 100
    assert set(summary["regions"]) == {"forward", "metrics", "backward", "optimizer_step"}
    for part in ("forward", "backward", "optimizer_step"):
        assert summary["regions"][part]["aten_calls_per_step"] > 0
        assert summary["regions"][part]["wall_ms_per_step"] > 0
    # the parts lie inside the step: neither their time nor their calls can exceed the step's
    regions = summary["regions"].values()
    assert sum(r["wall_ms_per_step"] for r in regions) <= summary["wall_ms_per_step"]
    assert sum(r["aten_calls_per_step"] for r in regions) <= summary["aten_calls_per_step"]
    top = summary["top_by_self_cpu"]
    assert 0 < len(top) <= 5 and all(r["op"] not in ("bertdist/forward", "bertdist/backward") for r in top)
    assert "device_busy_ms_per_step" not in summary  # no device timeline on a CPU run
    assert "Self CPU" in (prof / "rank0.ops.txt").read_text()
    trace = json.loads((prof / "rank0.trace.json").read_text())
    assert any(e.get("name") == "bertdist/backward" for e in trace["traceEvents"])
    # the profiled steps are marked (throughput figures leave them out), the others are not
    rows = {r["step"]: r for r in metrics(run_dir)}
    assert [s for s, r in sorted(rows.items()) if r.get("profiled")] == [2, 3]
    assert metrics(run_dir, "profile")[0]["steps"] == 2


def test_a_window_entered_late_profiles_nothing_and_one_cut_short_writes_what_it_has(tmp_path):
    import torch

    from bertdist.train.config import ProfilingConfig
    from bertdist.train.profiling import StepProfiler

    cfg = ProfilingConfig(enabled=True, start_step=2, num_steps=3, trace=False)
    late = StepProfiler(cfg, tmp_path / "late", 0, torch.device("cpu"))
    late.before(3)  # resumed at step 2: the window's first step has run
    assert not late.active(3) and late.after(4) is None
    late.close(3)
    assert not (tmp_path / "late" / "profile").exists()

    cut = StepProfiler(cfg, tmp_path / "cut", 1, torch.device("cpu"))
    cut.before(2)
    assert cut.active(2)
    torch.ones(8, 8).mm(torch.ones(8, 8))
    assert cut.after(2) is None  # steps 3 and 4 are still to come
    cut.close(2)  # the run stopped (SIGTERM) after step 2
    summary = json.loads((tmp_path / "cut" / "profile" / "rank1.summary.json").read_text())
    assert summary["steps"] == 1 and summary["first_step"] == 2 and summary["aten_calls_per_step"] >= 1
    assert not cut.active(3)
