"""Inductor's fused kernel (torch.compile of our reference twin) as a kernels: auto candidate for
the layer-norm family: gated like any other, chosen when fastest, reported next to ours, and a
compile that fails costs only itself (bertdist/ops/inductor.py)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from bertdist.device_profile import by_name
from bertdist.ops import inductor, kernel_plan, selection
from bertdist.ops.candidates import Candidate
from tests.ops._util import ext

CPU = torch.device("cpu")
NORM_OPS = ("layer_norm", "bias_dropout_add_layer_norm")


def _on_cpu(op):
    """The built-in candidate without its CUDA-only check: on CPU Inductor compiles C++."""
    return Candidate(op, "inductor", f"bertdist.ops.inductor:{op}", "inductor", test_only=True,
                     bias_in_kernel=op == "bias_dropout_add_layer_norm")


def _workload(ops=NORM_OPS):
    return kernel_plan.Workload(batch=2, seq=8, hidden=16, heads=2, intermediate=32, ops=ops)


def _timer(ms_by_name):
    def timer(candidate, case, call, device):
        call()
        return [ms_by_name.get(candidate.name, 1.0)] * 3
    return timer


@pytest.fixture
def cheap_compile(monkeypatch):
    # aot_eager traces the twin and its backward as Inductor does, without generating code
    monkeypatch.setattr(inductor, "BACKEND", "aot_eager")


def test_inductor_is_a_cuda_candidate_for_the_layer_norm_family_only():
    for case, cands in selection.survey(kernel_plan.Workload(batch=8, seq=128, hidden=768, heads=12),
                                        by_name("h100")):
        why = dict((c.name, reason) for c, reason in cands).get("inductor", "absent")
        if case.op in NORM_OPS:
            triton = importlib.util.find_spec("triton") is not None
            assert why is None if triton else "Triton" in why, (case.key, why)
        else:
            assert why == "absent", case.key
    cpu_case = _workload(("layer_norm",)).cases("cpu")[0]
    assert inductor.unsupported(cpu_case) == "CUDA only (this is cpu)"


def test_inductor_is_chosen_when_fastest_and_the_table_gives_both_figures(cheap_compile):
    ext()
    extra = [_on_cpu(op) for op in NORM_OPS]
    plan = selection.decide(_workload(), CPU, extra=extra, include_test_only=True,
                            timer=_timer({"torch": 1.0, "fused": 0.8, "inductor": 0.5}))
    assert {d.choice for d in plan.decisions.values()} == {"inductor"}
    for d in plan.decisions.values():
        assert d.measurement("inductor").status == "passed"  # through the same numerics gate
    table = plan.table()
    assert "layer_norm float32: Inductor 0.500 ms vs ours (fused) 0.800 ms" in table
    assert table.count("Inductor's kernel chosen") == len(plan.decisions) == 3
    # the model hands the dense bias to Inductor's bias_dropout_add_layer_norm, as to ours
    from bertdist.ops import kernel_set_from_plan

    assert kernel_set_from_plan(plan, "cpu").sources["bias_dropout_add_layer_norm"] == "inductor"


def test_ours_is_chosen_when_faster_than_inductor(cheap_compile):
    ext()
    plan = selection.decide(_workload(("layer_norm",)), CPU, extra=[_on_cpu("layer_norm")], include_test_only=True,
                            timer=_timer({"torch": 1.0, "fused": 0.5, "inductor": 0.7}))
    (d,) = plan.decisions.values()
    assert d.choice == "fused"
    assert "Inductor 0.700 ms vs ours (fused) 0.500 ms in the embeddings' layer norm + dropout, eager: ours chosen" \
        in plan.table()


def test_a_failing_inductor_compile_is_skipped_and_counted(monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("injected: the compiler is broken")

    monkeypatch.setattr(inductor, "BACKEND", broken)
    with pytest.warns(RuntimeWarning, match="candidate 'inductor' disabled.*injected: the compiler is broken"):
        plan = selection.decide(_workload(), CPU, extra=[_on_cpu(op) for op in NORM_OPS], include_test_only=True,
                                timer=_timer({"inductor": 0.1}))
    for d in plan.decisions.values():
        m = d.measurement("inductor")
        assert m.status == "error" and "injected" in m.reason and m.ms is None and d.choice != "inductor"
    assert "3 candidate measurement(s) skipped after an error: inductor for layer_norm float32" in plan.table()


@pytest.mark.slow  # Inductor generates and compiles C++: tens of seconds
def test_real_inductor_passes_the_numerics_gate_on_cpu():
    plan = selection.decide(_workload(("layer_norm",)), CPU, extra=[_on_cpu("layer_norm")], include_test_only=True,
                            timer=_timer({}))
    (d,) = plan.decisions.values()
    m = d.measurement("inductor")
    assert m.status == "passed" and m.error <= m.bound, m.reason


@pytest.mark.gpu
@pytest.mark.slow  # compiles Triton kernels and times layers
def test_on_a_gpu_inductor_compiles_and_is_timed_in_the_layer_beside_ours():
    w = kernel_plan.Workload(batch=8, seq=128, hidden=768, heads=12, dtypes=("bfloat16",), ops=NORM_OPS)
    plan = selection.decide(w, torch.device("cuda"), isolate=False)
    print(plan.table())
    for d in plan.decisions.values():
        m = d.measurement("inductor")
        assert m.status in ("passed", "failed"), (d.case.key, m.status, m.reason)  # compiled and ran
        if m.status == "passed":
            assert m.ms is not None and f"Inductor {m.ms:.3f} ms" in plan.table()
