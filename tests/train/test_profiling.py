"""The ``profiling`` section: torch.profiler over a window of steps of a real pretraining run."""
from __future__ import annotations

import json

import pytest

from bertdist.config import ConfigError
from bertdist.train.profiling import busy_us
from tests.train.conftest import TINY, assert_ok, metrics, run_pretrain, tiny_args


def test_busy_time_is_the_union_of_the_intervals():
    # [0, 10) and [5, 12) overlap: 12; [20, 25) is apart: 5; [21, 22) lies inside it: 0
    assert busy_us([(20, 25), (0, 10), (5, 12), (21, 22)]) == 17
    assert busy_us([]) == 0


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
        assert summary["regions"][part]["host_ms_per_step"] > 0
    # the parts lie inside the step: their host time cannot exceed its wall time
    assert sum(r["host_ms_per_step"] for r in summary["regions"].values()) <= summary["wall_ms_per_step"]
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
