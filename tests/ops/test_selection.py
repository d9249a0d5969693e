"""kernels: auto's measured choice, on CPU: the C++ CPU kernels and torch's CPU ops as candidates,
plus injected wrong, slow, dropout-ignoring and crashing ones (tests/ops/selection_candidates.py)."""
from __future__ import annotations

import json
import random
import socket

import pytest
import torch

from bertdist.model import BertConfig, BertForPreTraining
from bertdist.ops import (
    REFERENCE,
    TORCH_NATIVE,
    auto_kernels,
    kernel_plan,
    kernel_set_from_plan,
    measure_child,
    numerics_gate,
    reference_set,
    selection,
    torch_native,
)
from bertdist.ops.candidates import Candidate, Case, candidates_for, register_candidate, unregister_candidate
from bertdist.ops.decision_cache import DecisionCache
from tests.ops._util import ext

CPU = torch.device("cpu")
TC = "tests.ops.selection_candidates"


def _ln_workload(**kw):
    return kernel_plan.Workload(batch=2, seq=8, hidden=16, heads=2, ops=("layer_norm",), **kw)


def _cand(name, attr, op="layer_norm"):
    return Candidate(op, name, f"{TC}:{attr}", "test", test_only=True)


def _fake_timer(ms_by_name):
    def timer(candidate, case, call, device):
        call()  # the call still has to run
        return [ms_by_name.get(candidate.name, 1.0)] * 3  # candidates not named: as slow as torch
    return timer


def test_wrong_kernel_is_rejected_with_a_warning_naming_op_error_and_bound():
    with pytest.warns(RuntimeWarning, match=r"layer_norm candidate 'wrong'.*error .* > bound .*2 x torch's own"):
        plan = selection.decide(_ln_workload(), CPU, extra=[_cand("wrong", "wrong_layer_norm")],
                                include_test_only=True, timer=_fake_timer({"torch": 1.0, "fused": 1.0, "wrong": 0.01}))
    (d,) = plan.decisions.values()
    wrong = d.measurement("wrong")
    assert wrong.status == "failed" and wrong.error > wrong.bound and wrong.ms is None
    assert d.choice != "wrong"  # though it would have been the fastest by far
    assert "wrong" in plan.table() and "failed" in plan.table()


def test_slow_kernel_is_not_chosen_with_real_timing():
    plan = selection.decide(_ln_workload(), CPU, extra=[_cand("slow", "slow_layer_norm")], include_test_only=True)
    (d,) = plan.decisions.values()
    slow, base = d.measurement("slow"), d.measurement("torch")
    # it sleeps 20 ms on top of torch's own op. torch's time is not compared with a constant: a
    # throttled machine once made even this tiny layer norm take 18-21 ms in every repeat
    assert slow.status == "passed" and slow.ms > 15 and base.status == "passed"
    assert d.choice != "slow"


def test_dropout_that_is_not_applied_fails():
    w = kernel_plan.Workload(batch=2, seq=8, hidden=16, heads=2, ops=("bias_dropout_add_layer_norm",))
    cand = _cand("nodrop", "dropout_ignoring_bdaln", op="bias_dropout_add_layer_norm")
    with pytest.warns(RuntimeWarning, match="dropout not applied"):
        plan = selection.decide(w, CPU, extra=[cand], include_test_only=True,
                                timer=_fake_timer({"torch": 1.0, "fused": 1.0, "nodrop": 0.1}))
    by_dropout = {d.case.dropout: d for d in plan.decisions.values()}
    assert by_dropout[True].measurement("nodrop").status == "failed" and by_dropout[True].choice != "nodrop"
    assert by_dropout[False].choice == "nodrop"  # right, and fastest, where no dropout is asked for


@pytest.mark.parametrize("attr, op, match", [
    ("dropout_rate_halved_bdaln", "bias_dropout_add_layer_norm", r"dropout p=0.1 dropped \d+ of \d+ elements .*binomial"),
    ("dropout_new_mask_in_backward_bdaln", "bias_dropout_add_layer_norm", "do not use one dropout mask"),
    ("attention_new_mask_in_backward", "attention", "do not use one dropout mask"),
])
def test_dropout_with_a_wrong_rate_or_a_backward_mask_of_its_own_fails(attr, op, match):
    w = kernel_plan.Workload(batch=4, seq=16, hidden=64, heads=2, ops=(op,))
    with pytest.warns(RuntimeWarning, match=match):
        plan = selection.decide(w, CPU, extra=[_cand("bad", attr, op=op)], include_test_only=True,
                                timer=_fake_timer({"bad": 0.1}))
    by_dropout = {d.case.dropout: d for d in plan.decisions.values()}
    bad = by_dropout[True].measurement("bad")
    assert bad.status == "failed" and by_dropout[True].choice != "bad"
    # Every correct candidate, the fused C++ kernels included, passes the same check.
    assert all(m.status in ("passed", "unsupported") for m in by_dropout[True].measurements if m.name != "bad")
    assert by_dropout[False].measurement("bad").status == "passed"  # right without dropout


def test_keep_rate_bound():
    assert numerics_gate.keep_rate_problem(10_000, 1_000, 0.1) is None
    assert numerics_gate.keep_rate_problem(10_000, 1_150, 0.1) is None  # 5 sigma
    assert "dropped 1200 of 10000 elements (12.00%)" in numerics_gate.keep_rate_problem(10_000, 1_200, 0.1)
    assert "dropped 500 of 10000" in numerics_gate.keep_rate_problem(10_000, 500, 0.1)


def test_fastest_passing_candidate_wins_only_by_a_clear_margin():
    ext()
    timings = {"torch": 1.0, "fused": 0.5, "same": 0.9}
    plan = selection.decide(_ln_workload(), CPU, extra=[_cand("same", "same_layer_norm")], include_test_only=True,
                            timer=_fake_timer(timings))
    assert next(iter(plan.decisions.values())).choice == "fused"
    near = {"torch": 1.0, "fused": 1 - selection.MIN_GAIN / 2, "same": 1.0}  # within the noise margin
    plan = selection.decide(_ln_workload(), CPU, timer=_fake_timer(near))
    assert next(iter(plan.decisions.values())).choice == "torch"


def test_choice_is_never_slower_than_the_baseline():
    rng = random.Random(0)
    for _ in range(500):
        ms = [rng.uniform(0.1, 2.0) for _ in range(4)]
        status = [rng.choice(["passed", "failed", "error", "unsupported"]) for _ in range(3)]
        results = [kernel_plan.Measurement("torch", "torch", "passed", ms=ms[0])] + [
            kernel_plan.Measurement(f"c{i}", "x", s, ms=m if s == "passed" else None)
            for i, (s, m) in enumerate(zip(status, ms[1:]))]
        chosen = next(r for r in results if r.name == selection.choose(results))
        assert chosen.status == "passed" and chosen.ms <= ms[0]


def test_cache_is_reused_and_invalidated_by_torch_device_or_candidates(tmp_path, monkeypatch):
    cache = DecisionCache(tmp_path / "kd.json")
    calls = []

    def timer(candidate, case, call, device):
        calls.append(candidate.name)
        return [1.0]

    first = selection.decide(_ln_workload(), CPU, cache=cache, timer=timer)
    assert calls and first.note.startswith("measured")
    calls.clear()
    again = selection.decide(_ln_workload(), CPU, cache=cache, timer=timer)
    assert not calls and again.note.startswith("cached")
    assert [d.choice for d in again.decisions.values()] == [d.choice for d in first.decisions.values()]

    monkeypatch.setattr(torch, "__version__", "99.0.0")  # another torch
    selection.decide(_ln_workload(), CPU, cache=cache, timer=timer)
    assert calls
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(kernel_plan, "device_name", lambda device: "another device")
    selection.decide(_ln_workload(), CPU, cache=cache, timer=timer)
    assert calls
    monkeypatch.undo()
    calls.clear()
    selection.decide(_ln_workload(), CPU, cache=cache, timer=timer)  # the first environment, still cached
    assert not calls
    selection.decide(_ln_workload(), CPU, cache=cache, timer=timer, extra=[_cand("same", "same_layer_norm")],
                     include_test_only=True)  # a new candidate: measured again
    assert "same" in calls
    envs = cache.environments()
    assert len(envs) == 3 and {e["environment"]["torch"] for e in envs.values()} == {torch.__version__, "99.0.0"}


def test_corrupt_cache_is_moved_aside_not_lost(tmp_path):
    path = tmp_path / "kd.json"
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert DecisionCache(path).load({"device": "x"}) == {}
    assert [p.read_text() for p in tmp_path.glob("kd.json.corrupt-*")] == ["{not json"]


@pytest.mark.slow  # isolated measurement subprocesses: about 8 s
def test_crashing_kernel_costs_only_itself_in_an_isolated_measurement():
    cases = [(c, candidates_for(c.op, "cpu", extra=[_cand("crash", "crashing_layer_norm")], include_test_only=True))
             for c in _ln_workload().cases("cpu")]
    with pytest.warns(RuntimeWarning, match="'crash' killed the measuring process"):
        (d,) = measure_child.measure_isolated(cases, CPU)
    crash = d.measurement("crash")
    assert crash.status == "error" and "exit" in crash.reason
    assert d.measurement("torch").ms is not None and d.choice != "crash"


def test_routed_set_picks_by_dtype_and_dropout_and_falls_back_to_torch(monkeypatch):
    ext()
    w = kernel_plan.Workload(batch=2, seq=8, hidden=16, heads=2, ops=("bias_dropout_add_layer_norm",))
    plan = selection.decide(w, CPU, timer=lambda cand, case, call, dev: [0.1 if case.dropout == (cand.name == "fused")
                                                                           else 1.0])
    ks = kernel_set_from_plan(plan, "cpu")
    assert ks.sources["bias_dropout_add_layer_norm"] == "fused"  # the training call's choice
    assert ks.layer_norm is REFERENCE.layer_norm  # undecided ops: torch-native
    seen = []
    for name in ("fused", "torch"):
        cand = Candidate.from_dict(plan.candidates["bias_dropout_add_layer_norm"][name])
        fn = cand.load()
        monkeypatch.setitem(ks.bias_dropout_add_layer_norm.routes,
                            next(k for k, n in ks.bias_dropout_add_layer_norm.names.items() if n == name),
                            lambda *a, _n=name, _f=fn, **k: seen.append(_n) or _f(*a, **k))
    x, r, w_, b = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16), torch.zeros(16)
    ks.bias_dropout_add_layer_norm(x, None, r, w_, b, p=0.1, training=True, eps=1e-12)
    ks.bias_dropout_add_layer_norm(x, None, r, w_, b, p=0.1, training=False, eps=1e-12)
    assert seen == ["fused", "torch"]
    y = ks.bias_dropout_add_layer_norm(x.double(), None, r.double(), w_.double(), b.double(), p=0.1, training=True,
                                       eps=1e-12)  # float64 was not decided: torch-native
    assert y.dtype == torch.float64 and seen == ["fused", "torch"]


def test_model_runs_on_a_measured_plan_and_matches_the_reference():
    ext()
    cfg = BertConfig.from_preset("tiny", vocab_size=300, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 unpad=True)
    w = kernel_plan.Workload.for_model(cfg, batch=3, seq=16)
    prefer_fused = lambda cand, case, call, dev: [0.1 if cand.name == "fused" else 1.0]  # noqa: E731
    ks = kernel_set_from_plan(selection.decide(w, CPU, timer=prefer_fused), "cpu")
    assert ks.sources == {"layer_norm": "fused", "bias_dropout_add_layer_norm": "fused",
                          "attention": "reference", "varlen_attention": "fused"}  # unpad: padded attention not decided
    torch.manual_seed(0)
    ours = BertForPreTraining(cfg, device_type="cpu", kernels=ks)
    ref = BertForPreTraining(cfg, device_type="cpu", kernels=REFERENCE)
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(5, 300, (3, 16))
    mask = (torch.arange(16)[None] < torch.tensor([16, 9, 3])[:, None]).long()
    a, b = ours(ids, mask).seq_relationship_logits, ref(ids, mask).seq_relationship_logits
    assert torch.allclose(a, b, atol=1e-5)


def test_workload_cases_follow_the_config():
    cfg = BertConfig.from_preset("base", unpad=True, attention_probs_dropout_prob=0.0)
    w = kernel_plan.Workload.for_model(cfg, batch=64, seq=128, precision="bf16", autocast=True)
    ops = {(c.op, c.dtype, c.dropout) for c in w.cases("cuda")}
    assert ops == {("layer_norm", "float32", False), ("bias_dropout_add_layer_norm", "float32", True),
                   ("bias_dropout_add_layer_norm", "float32", False), ("varlen_attention", "bfloat16", False)}
    with pytest.raises(ValueError, match="divisible"):
        kernel_plan.Workload(batch=1, seq=8, hidden=10, heads=3)


def test_reference_means_torch_native_on_cuda_and_the_old_reference_on_cpu():
    assert reference_set("cpu") is REFERENCE
    assert reference_set("cuda") is TORCH_NATIVE
    assert TORCH_NATIVE.attention is torch_native.sdpa_attention
    assert TORCH_NATIVE.varlen_attention is torch_native.varlen_attention


def test_registry_takes_test_only_candidates_without_exposing_them_to_runs():
    c = Candidate("attention", "emulated", f"{TC}:same_layer_norm", "emulated", test_only=True)
    register_candidate(c)
    try:
        assert "emulated" not in [x.name for x in candidates_for("attention", "cuda")]
        assert [x.name for x in candidates_for("attention", "cuda", include_test_only=True)][-1] == "emulated"
        with pytest.raises(ValueError, match="baseline"):
            register_candidate(Candidate("attention", "torch", "x:y", "torch"))
    finally:
        unregister_candidate("attention", "emulated")


def test_case_key_names_everything_a_decision_depends_on():
    a = Case("attention", "bfloat16", True, "cuda", 64, 128, 1024, 16)
    assert "attention | bfloat16 | dropout 0.1 | b64 s128 h1024 n16" in a.key
    assert Case("attention", "bfloat16", False, "cuda", 64, 128, 1024, 16, p=0.0).key != a.key


# ---------------------------------------------------------------- ranks agree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from bertdist.ops import selection as sel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # Each rank would choose differently on its own: rank 1 sees "same" as fastest.
        def timer(candidate, case, call, device):
            fast = "same" if rank == 1 else "torch"
            return [0.1 if candidate.name == fast else 1.0]

        extra = [Candidate("layer_norm", "same", f"{TC}:same_layer_norm", "test", test_only=True)]
        make = lambda: sel.decide(_ln_workload(), CPU, timer=timer, extra=extra, include_test_only=True)  # noqa: E731
        own = make()
        agreed = sel.agree_plan(make, CPU)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump({"own": [d.choice for d in own.decisions.values()],
                       "agreed": [d.choice for d in agreed.decisions.values()]}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two gloo rank processes: about 6 s
def test_ranks_run_rank_zeros_choice(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["own"] == ["torch"] and r1["own"] == ["same"]  # left alone, they would disagree
    assert r0["agreed"] == r1["agreed"] == ["torch"]


# ---------------------------------------------------------------- the time budget (model.kernels_budget_s)


def _two_case_workload():
    return kernel_plan.Workload(batch=2, seq=8, hidden=16, heads=2, dtypes=("float32", "float64"), ops=("layer_norm",))


def _stepping_clock(per_case, timer):
    """A clock that advances ``per_case`` seconds each time ``timer`` times a baseline (one per case)."""
    now = [0.0]

    def timed(candidate, case, call, device):
        if candidate.name == candidates_for(case.op, "cpu")[0].name:
            now[0] += per_case
        return timer(candidate, case, call, device)

    return (lambda: now[0]), timed


def test_without_a_budget_every_case_is_measured(tmp_path):
    cache = DecisionCache(tmp_path / "kd.json")
    plan = selection.decide(_two_case_workload(), CPU, cache=cache, timer=_fake_timer({}), budget_s=None)
    assert [d.origin for d in plan.decisions.values()] == ["measured", "measured"]
    assert len(cache.load(plan.environment)) == 2


def test_a_spent_budget_measures_nothing_and_caches_nothing(tmp_path):
    cache = DecisionCache(tmp_path / "kd.json")
    timed = []
    plan = selection.decide(_two_case_workload(), CPU, cache=cache, budget_s=0,
                            timer=lambda cand, case, call, dev: timed.append(cand.name) or [1.0])
    assert not timed
    for d in plan.decisions.values():
        assert d.origin == "budget" and d.choice == candidates_for(d.case.op, "cpu")[0].name
        assert d.measurements[0].status == "not measured"
    assert cache.load(plan.environment) == {}
    table = plan.table()
    assert "2 case(s) not measured" in table and "kernels budget (0 s" in table and "a later run measures" in table
    assert "kernels budget 0 s: 2 case(s) not measured" in plan.note


def test_a_budget_spent_after_one_case_decides_it_and_leaves_the_rest_to_a_later_run(tmp_path):
    cache = DecisionCache(tmp_path / "kd.json")
    clock, timer = _stepping_clock(10.0, _fake_timer({}))
    plan = selection.decide(_two_case_workload(), CPU, cache=cache, timer=timer, budget_s=5.0, clock=clock)
    first, second = plan.decisions.values()
    assert (first.origin, second.origin) == ("measured", "budget")
    assert "spent after 10 s" in second.measurements[0].reason
    assert list(cache.load(plan.environment)) == [first.case.key]
    timed = []
    again = selection.decide(_two_case_workload(), CPU, cache=cache, budget_s=None,
                             timer=lambda cand, case, call, dev: timed.append(case.key) or [1.0])
    assert [d.origin for d in again.decisions.values()] == ["cache", "measured"]
    assert set(timed) == {second.case.key}
    assert len(cache.load(plan.environment)) == 2


def test_a_spent_budget_starts_no_custom_measurer():
    def measurer(todo, device, profile):
        raise AssertionError("the budget was spent: nothing may be measured")

    plan = selection.decide(_two_case_workload(), CPU, measurer=measurer, budget_s=0)
    assert {d.origin for d in plan.decisions.values()} == {"budget"}


@pytest.mark.slow  # an isolated measurement subprocess: a few seconds
def test_an_isolated_measurement_stops_at_the_budget_without_calling_it_a_crash():
    # "slow" sleeps 20 ms per call: the first case takes well over the 0.3 s budget; the second is not started
    cases = [(c, candidates_for(c.op, "cpu", extra=[_cand("slow", "slow_layer_norm")], include_test_only=True))
             for c in _two_case_workload().cases("cpu")]
    budget = kernel_plan.Budget(0.3, clock=lambda: 0.0)  # the parent's clock: nothing spent before the child
    first, second = measure_child.measure_isolated(cases, CPU, budget=budget)
    assert first.origin == "measured" and first.measurement("slow").ms is not None
    assert second.origin == "budget" and second.choice == cases[1][1][0].name
    assert not [m for d in (first, second) for m in d.measurements if m.status == "error"]


def test_an_isolated_measurement_starts_no_child_once_the_budget_is_spent(monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a child started after the budget was spent"))
    cases = [(c, candidates_for(c.op, "cpu")) for c in _two_case_workload().cases("cpu")]
    out = measure_child.measure_isolated(cases, CPU, budget=kernel_plan.Budget(0.0))
    assert [d.origin for d in out] == ["budget", "budget"]
