"""kernels: auto times each candidate inside the region the trainer runs it in (one encoder layer,
or the embeddings' norm), eager or compiled as the run is (bertdist/ops/layer_timing.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bertdist.model import BertConfig
from bertdist.ops import kernel_plan, layer_timing, selection
from bertdist.ops.candidates import Candidate, LayerContext
from bertdist.ops.decision_cache import DecisionCache
from tests.ops import selection_candidates

CPU = torch.device("cpu")
TC = "tests.ops.selection_candidates"


def _workload(**kw):
    return kernel_plan.Workload(**{"batch": 2, "seq": 8, "hidden": 16, "heads": 2, "intermediate": 32, **kw})


def test_workload_for_model_times_in_the_runs_layer():
    cfg = BertConfig.from_preset("base", unpad=True)
    w = kernel_plan.Workload.for_model(cfg, batch=32, seq=128, precision="bf16", autocast=True, compiled=True)
    by_op = {c.op: c for c in w.cases("cuda")}
    assert by_op["layer_norm"].dtype == "float32"  # autocast runs layer norm in fp32...
    assert by_op["layer_norm"].layer == LayerContext(3072, "bfloat16", True, 0.1, 0.1, unpad=True, compiled=True)
    assert by_op["varlen_attention"].layer.dtype == "bfloat16"  # ...inside a bf16 layer
    assert "layer i3072 bfloat16 autocast hd0.1 ad0.1 unpad compiled" in by_op["layer_norm"].key
    eager = kernel_plan.Workload.for_model(cfg, batch=32, seq=128, precision="bf16", autocast=True)
    assert {c.key for c in eager.cases("cuda")}.isdisjoint(c.key for c in w.cases("cuda"))
    alone = dataclasses.replace(w, in_layer=False)
    assert all(c.layer is None and c.region == "the op alone" for c in alone.cases("cuda"))


def test_cached_decisions_carry_their_layer(tmp_path):
    cache = DecisionCache(tmp_path / "kd.json")
    timer = lambda cand, case, call, dev: [1.0]  # noqa: E731
    w = _workload(ops=("layer_norm",))
    first = selection.decide(w, CPU, cache=cache, timer=timer)
    again = selection.decide(w, CPU, cache=cache, timer=timer)
    assert again.note.startswith("cached")
    assert [d.case for d in again.decisions.values()] == [d.case for d in first.decisions.values()]
    assert next(iter(again.decisions.values())).case.layer.intermediate == 32


def test_each_candidate_is_timed_in_a_layer_that_runs_the_other_ops_choices():
    # bias_dropout_add_layer_norm is decided first: the counting candidate wins it; the attention
    # candidates are then timed in layers that call it, twice per forward (both halves of the layer).
    extra = [Candidate("bias_dropout_add_layer_norm", "counting", f"{TC}:counting_bdaln", "test", test_only=True)]
    per_call = {}

    def timer(candidate, case, call, device):
        if case.op == "attention":
            start = len(selection_candidates.CALLS)
            call()
            per_call[(candidate.name, case.dropout)] = len(selection_candidates.CALLS) - start
        else:
            call()
        return [0.1 if candidate.name == "counting" else 1.0]

    w = _workload(ops=("bias_dropout_add_layer_norm", "attention"), unpad=False)
    selection_candidates.CALLS.clear()
    plan = selection.decide(w, CPU, timer=timer, extra=extra, include_test_only=True)
    assert {d.case.op: d.choice for d in plan.decisions.values() if d.case.op != "attention"} == {
        "bias_dropout_add_layer_norm": "counting"}
    assert per_call and all(n == 2 for n in per_call.values()), per_call
    assert "ms = forward + backward of one encoder layer, eager" in plan.table()


def test_layer_step_runs_the_candidate_with_the_cases_dropout_and_a_gradient():
    seen = []

    def spy(x, bias, residual, weight, ln_bias, *, p, training, eps):
        seen.append((p, training, x.dtype, bias is None))
        return selection_candidates.counting_bdaln(x, bias, residual, weight, ln_bias, p=p, training=training, eps=eps)

    for dropout in (True, False):
        case = next(c for c in _workload(ops=("bias_dropout_add_layer_norm",), dtypes=("bfloat16",)).cases("cpu")
                    if c.dropout == dropout)
        cand = Candidate(case.op, "fused", "unused:unused", "fused", bias_in_kernel=True)
        step = layer_timing.layer_step(case, layer_timing.layer_kernels(case, cand, spy, [], "cpu"), CPU)
        seen.clear()
        step()
        # both halves of the layer, bf16 weights, the bias handed to a kernel that takes it
        assert seen == [(0.1 if dropout else 0.0, True, torch.bfloat16, False)] * 2


def test_a_bias_taking_candidate_the_model_would_not_hand_the_bias_is_an_error():
    case = _workload(ops=("bias_dropout_add_layer_norm",)).cases("cpu")[0]
    cand = Candidate(case.op, "mine", "unused:unused", "test", bias_in_kernel=True)
    with pytest.raises(ValueError, match="takes the dense bias, but the model hands it only to fused"):
        layer_timing.layer_kernels(case, cand, lambda *a, **k: None, [], "cpu")


def test_compiled_runs_time_candidates_in_a_compiled_layer(monkeypatch):
    graphs = []

    def backend(gm, example_inputs):  # torch.compile's backend hook: records the graph, runs it eagerly
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(layer_timing, "COMPILE_BACKEND", backend)
    # attention is timed in compiled layers whose bias_dropout_add_layer_norm is routed to its choice
    w = _workload(ops=("bias_dropout_add_layer_norm", "attention"), hidden_dropout=0.0, attention_dropout=0.0,
                  unpad=False, compiled=True)
    plan = selection.decide(w, CPU, timer=lambda cand, case, call, dev: (call(), [1.0])[1])
    assert all(d.case.layer.compiled for d in plan.decisions.values())
    timed = sum(m.ms is not None for d in plan.decisions.values() for m in d.measurements)
    assert len(graphs) >= timed >= 3, (len(graphs), timed)  # every timed candidate ran a compiled layer
    assert "one encoder layer, compiled" in plan.table()


def test_the_default_timer_runs_a_layer_in_batches_of_at_least_five():
    import time

    from bertdist.ops.timing import default_timer

    case = _workload(ops=("layer_norm",)).cases("cpu")[0]
    calls = []
    samples = default_timer(None, case, lambda: (calls.append(1), time.sleep(0.01)), CPU)
    assert len(samples) == 7 and len(calls) == 3 + 1 + 7 * 5  # warm-up, probe, 7 batches of 5
    assert min(samples) >= 10


def test_an_isolated_measurement_of_compiled_layers_gets_time_to_compile(monkeypatch):
    import subprocess

    from bertdist.ops import measure_child
    from bertdist.ops.candidates import candidates_for

    def timeout(cmd, timeout, **kw):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(subprocess, "run", timeout)
    for compiled, expected in ((False, 900), (True, 900 + 120 * 2)):  # torch and fused, one case
        cases = [(c, candidates_for(c.op, "cpu")[:2]) for c in _workload(ops=("layer_norm",), compiled=compiled).cases("cpu")]
        with pytest.raises(RuntimeError, match=f"timed out after {expected} s"):
            measure_child.measure_isolated(cases, CPU)


def test_real_timing_in_a_layer_ranks_a_slower_kernel_last():
    # slow_layer_norm sleeps 20 ms per call, so the region with it takes over 20 ms per step
    w = _workload(ops=("layer_norm",))
    extra = [Candidate("layer_norm", "slow", f"{TC}:slow_layer_norm", "test", test_only=True)]
    plan = selection.decide(w, CPU, extra=extra, include_test_only=True)
    (d,) = plan.decisions.values()
    # torch's time is not compared with a constant: a loaded machine has made tiny steps take 20 ms
    assert d.measurement("slow").ms > 15 and d.measurement("torch").status == "passed" and d.choice != "slow"


def test_layers_run_the_cached_choices_of_the_ops_not_measured_again(tmp_path):
    extra = [Candidate("bias_dropout_add_layer_norm", "counting", f"{TC}:counting_bdaln", "test", test_only=True)]
    cache = DecisionCache(tmp_path / "kd.json")
    prefer_counting = lambda cand, case, call, dev: [0.1 if cand.name == "counting" else 1.0]  # noqa: E731
    norm_only = _workload(ops=("bias_dropout_add_layer_norm",), unpad=False)
    selection.decide(norm_only, CPU, cache=cache, timer=prefer_counting, extra=extra, include_test_only=True)
    calls = []

    def timer(candidate, case, call, device):
        assert case.op == "attention", case.key  # bias_dropout_add_layer_norm comes from the cache
        start = len(selection_candidates.CALLS)
        call()
        calls.append(len(selection_candidates.CALLS) - start)
        return [1.0]

    plan = selection.decide(dataclasses.replace(norm_only, ops=("bias_dropout_add_layer_norm", "attention")), CPU,
                            cache=cache, timer=timer, extra=extra, include_test_only=True)
    assert plan.note.startswith("partly cached") and calls and set(calls) == {2}, calls


def test_a_model_built_without_a_plan_decides_for_layers_of_its_own_ffn_width():
    from bertdist.device_profile import by_name
    from bertdist.ops.dispatch import default_workload

    cfg = BertConfig.from_preset("tiny", intermediate_size=48)
    cases = default_workload(cfg, "cuda", by_name("h100")).cases("cuda")
    assert cases and {c.layer.intermediate for c in cases} == {48}
