"""The emulated CUDA kernels as a test-only candidate of ``kernels: auto``'s measured choice:
judged by the same numerics gate as every other candidate, never offered to a real run."""
from __future__ import annotations

import torch

from bertdist.ops import kernel_plan, selection
from bertdist.ops.candidates import OPS, candidates_for
from tests.emu._util import emu

CPU = torch.device("cpu")


def test_emulated_kernels_pass_the_numerics_gate_on_every_op():
    emu()
    workload = kernel_plan.Workload(batch=2, seq=37, hidden=128, heads=2, dtypes=("float32", "bfloat16"))
    calls = []

    def timer(candidate, case, call, device):
        call()
        calls.append((candidate.name, case.op))
        return [0.5 if candidate.name == "emulated" else 1.0] * 3  # pretend it is the fastest

    plan = selection.decide(workload, CPU, timer=timer, include_test_only=True)
    emulated = [(d.case, m) for d in plan.decisions.values() for m in d.measurements if m.name == "emulated"]
    assert {case.op for case, _ in emulated} == set(OPS)
    for case, m in emulated:
        assert m.status == "passed", (case.key, m.reason, m.error, m.bound)
        assert m.error <= m.bound
    # passing numerics and measured fastest, it is the choice for every case
    assert {d.choice for d in plan.decisions.values()} == {"emulated"}
    assert {op for name, op in calls if name == "emulated"} == set(OPS)


def test_emulated_kernels_are_never_offered_to_a_run():
    for op in OPS:
        assert "emulated" not in [c.name for c in candidates_for(op, "cpu")]
        assert "emulated" in [c.name for c in candidates_for(op, "cpu", include_test_only=True)]
        assert "emulated" not in [c.name for c in candidates_for(op, "cuda", include_test_only=False)]
