"""``kernels: auto`` as a measured choice: numerics first, then time, per op and case.

For each ``Case`` (op, dtype, dropout on/off, the run's batch x seq and model width) every
candidate of ``candidates.py`` is run on the device:

1. **Numerics** (``numerics_gate.py``): the forward output and the gradient of every input,
   dropout off, against the fp32 math on the same rounded inputs, within twice the baseline's
   own error plus a floor; with dropout the candidate must also apply it, with one mask forward
   and backward, and stay finite.
2. **Time** (``timing.py``): inside the region the trainer runs the op in, built for the run
   (``layer_timing.py``: one encoder layer, or the embeddings' norm, eager or compiled as the
   run is), forward + backward with the case's dropout, the other ops at the candidates already
   chosen for them; after a warm-up, the median of ``repeats`` timings (device time on a GPU:
   CUDA events around a batch of iterations). Timed alone, an op is mostly host dispatch.
3. **Choice**: the fastest candidate that passed, if it beats the baseline (what
   ``kernels: reference`` runs) by at least ``MIN_GAIN``; else the baseline. These timings
   make the choice and are not evidence for it: whole training steps with ``auto`` against
   ``reference`` are timed afresh, interleaved and repeated, by ``bertdist bench``
   (benchmarks/acceptance.py).

A candidate that fails numerics or raises is disabled for that case with a warning naming
the op, the error and the bound. Decisions are cached per environment (device name, torch,
our build: ``kernel_plan.environment``, ``decision_cache.py``) and logged once as a table. On
CUDA the measurement runs in a child process (``isolate``, ``measure_child.py``): a kernel that
corrupts the CUDA context or kills the process costs only that candidate, which is excluded,
and the measurement is repeated without it.

Ranks: ``agree_plan`` decides on rank 0 and broadcasts the plan, so every rank runs the same
kernels whatever its batch looks like. Decisions are made up front, for the shapes the run's
config implies (``Workload``, ``kernel_plan.py``), never lazily inside a forward, where ranks
see different padded lengths. At call time an op picks by dtype and by whether dropout is
active, both the same on every rank.

ModernBERT's ``attention_backend: auto`` runs the same planning over the windowed ops
(``attention_choice.py``): there the baseline is the reference twin, which sets the bounds and is
chosen only when no other candidate passed (``choose``'s ``oracle_baseline``).

This is the module callers use: the plan's types (``Workload``, ``Decision``, ``KernelPlan``)
and ``measure_isolated`` are imported here and can be named from here.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch

from bertdist.device_profile import DeviceProfile, for_device_type
from bertdist.ops.candidates import OPS, WINDOW_OPS, Candidate, Case, baseline_name, candidates_for
from bertdist.ops.kernel_plan import DTYPES, Budget, Decision, KernelPlan, Measurement, Workload, environment
from bertdist.ops.layer_timing import layer_kernels, layer_step
from bertdist.ops.measure_child import measure_isolated
from bertdist.ops.numerics_gate import FLOORS, dropout_problem, make_problem, oracle_for, rel_err, unfused_twin
from bertdist.ops.timing import Timer, default_timer

MIN_GAIN = 0.03  # a candidate must be this much faster than the baseline to replace it


# ---------------------------------------------------------------- one case


class DeviceUnusable(RuntimeError):
    """A candidate left the device unusable (a sticky CUDA error): nothing more can run here."""

    def __init__(self, candidate: str, error: str):
        super().__init__(f"{candidate}: {error}")
        self.candidate, self.error = candidate, error


def _device_ok(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        (torch.ones(1, device=device) + 1).item()
        return True
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False


def _first_line(e: BaseException) -> str:
    """The error's first line, and the next one where the first only introduces it (torch.compile's
    ``backend='inductor' raised:``)."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    head = text[0] if text else ""
    if head.endswith(":") and len(text) > 1:
        head = f"{head} {text[1]}"
    return f"{type(e).__name__}: {head[:200]}"


def _op_step(problem, case: Case, cand: Candidate, fn: Callable, dtype: torch.dtype) -> Callable[[], None]:
    """One forward + backward of the op alone on the numerics problem's inputs (the forward alone
    for an inference case)."""
    leaves = problem.leaves(dtype)
    go = problem.grad_out.to(dtype)

    def step():
        if not case.backward:  # inference: the forward alone
            with torch.no_grad():
                problem.call(fn, {k: v.detach() for k, v in leaves.items()}, dropout=False)
            return
        out = problem.call(fn, leaves, dropout=case.dropout, bias_in_kernel=cand.bias_in_kernel)
        torch.autograd.grad(out, list(leaves.values()), go.to(out.dtype), allow_unused=True)

    return step


def decide_case(case: Case, candidates: list[Candidate], device: torch.device, *, timer: Timer = default_timer,
                on_start: Callable[[Candidate], None] | None = None, profile: DeviceProfile | None = None,
                decided: list[tuple[Case, Candidate]] = ()) -> Decision:
    """Measure every candidate of ``case`` (the baseline first) on ``device`` (described by
    ``profile``; default: this machine's) and choose. With ``case.layer`` each candidate is
    timed inside that layer, the other ops running the candidates ``decided`` chose for them
    (``layer_timing.py``)."""
    baseline = baseline_name(case.op)
    if candidates[0].name != baseline:
        raise ValueError(f"the first candidate must be the baseline {baseline!r}, got {candidates[0].name!r}")
    dtype = DTYPES[case.dtype]
    problem = make_problem(case, device)
    oracle = problem.run(oracle_for(case.op), dtype, masters_dtype=torch.float32, backward=case.backward)
    floor = FLOORS[case.dtype]
    base_err: dict[str, float] | None = None
    results: list[Measurement] = []
    for cand in candidates:
        if on_start is not None:
            on_start(cand)
        m = Measurement(cand.name, cand.family, "passed")
        results.append(m)
        why = cand.unsupported(case, profile)
        if why:
            m.status, m.reason = "unsupported", why
            continue
        try:
            fn = cand.load()
            got = problem.run(fn, dtype, backward=case.backward)
            errs = {k: rel_err(v, oracle[k]) for k, v in got.items()}
            if base_err is None:  # the baseline: its own error sets the bounds
                base_err = errs
                twin = unfused_twin(case.op, case.dtype)
                if twin is not None:  # an fp32 oracle as baseline: an unfused kernel's error in the dtype
                    yard = problem.run(twin, dtype, backward=case.backward)
                    base_err = {k: max(v, rel_err(yard[k], oracle[k])) for k, v in errs.items()}
            worst = max(errs, key=lambda k: errs[k] / (2 * base_err[k] + floor))
            m.error, m.bound, m.tensor = errs[worst], 2 * base_err[worst] + floor, worst
            if not all(math.isfinite(v) for v in errs.values()) or m.error > m.bound:
                m.status = "failed"
                whose = "torch's own" if case.op not in WINDOW_OPS else "the baseline's or an unfused kernel's"
                m.reason = (f"error {m.error:.3e} on {worst} > bound {m.bound:.3e} (2 x {whose} "
                            f"{base_err[worst]:.3e} + {floor:g})")
                continue
            if case.dropout:
                bad = dropout_problem(problem, fn, dtype, got["out"])
                if bad:
                    m.status, m.reason = "failed", bad
                    continue
            step = (layer_step(case, layer_kernels(case, cand, fn, decided, device.type), device)
                    if case.layer is not None else _op_step(problem, case, cand, fn, dtype))
            samples = timer(cand, case, step, device)
            m.ms, m.ms_range = statistics.median(samples), (min(samples), max(samples))
        except Exception as e:  # noqa: BLE001 - a failing candidate is disabled, never fatal
            m.status, m.reason = "error", _first_line(e)
            if not _device_ok(device):
                raise DeviceUnusable(cand.name, m.reason) from e
            if cand.name == baseline:
                raise RuntimeError(f"kernels=auto: the baseline {baseline!r} failed on {case.key}: {m.reason}") from e
    choice = choose(results, oracle_baseline=case.op in WINDOW_OPS)
    for m in results:
        if m.status in ("failed", "error"):
            warnings.warn(f"kernels=auto: {case.op} candidate {m.name!r} disabled for {case.dtype}"
                          f"{' with dropout' if case.dropout else ''} on {device.type}: {m.reason}",
                          RuntimeWarning, stacklevel=2)
    return Decision(case, choice, results, [c.name for c in candidates])


def choose(results: list[Measurement], *, oracle_baseline: bool = False) -> str:
    """The fastest passing candidate if it beats the baseline by MIN_GAIN, else the baseline.
    ``oracle_baseline``: the baseline is a reference twin, there to set the bounds: the fastest
    other passing candidate, the baseline only when none passed."""
    base = results[0]
    timed = [m for m in results if m.status == "passed" and m.ms is not None]
    if oracle_baseline:
        others = [m for m in timed if m is not base]
        return min(others, key=lambda m: m.ms).name if others else base.name
    if base.ms is None or not timed:
        return base.name
    best = min(timed, key=lambda m: m.ms)
    return best.name if best.ms < base.ms * (1 - MIN_GAIN) else base.name


# ---------------------------------------------------------------- many cases (isolated: measure_child.py)


def measure(cases: list[tuple[Case, list[Candidate]]], device: torch.device, *, timer: Timer = default_timer,
            on_start: Callable[[Case, Candidate], None] | None = None,
            on_done: Callable[[Decision], None] | None = None, profile: DeviceProfile | None = None,
            decided: Iterable[tuple[Case, Candidate]] = (), budget: Budget | None = None) -> list[Decision]:
    """Decide ``cases`` in order; ``decided``: choices made before (another process's). Once
    ``budget`` is spent, the cases not started get the baseline (``Budget.skipped``)."""
    out: list[Decision] = []
    decided = list(decided)  # what the layers of later cases run for the ops decided
    for case, cands in cases:
        if budget is not None and budget.spent():
            d = budget.skipped(case, cands)
        else:
            d = decide_case(case, cands, device, timer=timer, profile=profile, decided=decided,
                            on_start=(lambda c, case=case: on_start(case, c)) if on_start else None)
        out.append(d)
        decided.append((case, next(c for c in cands if c.name == d.choice)))
        if on_done is not None:
            on_done(d)
    return out


# ---------------------------------------------------------------- plans


# (cases with their candidates, device, profile) -> one Decision per case: how ``decide`` measures.
Measurer = Callable[[list[tuple[Case, list[Candidate]]], torch.device, DeviceProfile], list[Decision]]


def survey(workload: Workload, profile: DeviceProfile, *, extra: Iterable[Candidate] = (),
           include_test_only: bool = False) -> list[tuple[Case, list[tuple[Candidate, str | None]]]]:
    """The cases ``auto`` decides for ``workload`` on ``profile``, each with its candidates and
    why one cannot run there (None: it will be measured). Measures nothing."""
    extra = list(extra)
    return [(case, [(c, c.unsupported(case, profile))
                    for c in candidates_for(case.op, profile.type, include_test_only=include_test_only, extra=extra)])
            for case in workload.cases(profile.type)]


def _warn_without_fused_cuda(profile: DeviceProfile, cands: Iterable[Candidate]) -> None:
    """On CUDA, one warning when our fused kernels cannot take part (e.g. a build without CUDA kernels)."""
    if profile.type != "cuda" or not any(c.family == "fused" for c in cands):
        return
    from bertdist.ops import fused

    ok, why = fused.availability("layer_norm", profile)
    if not ok:
        warnings.warn(f"kernels=auto: bertdist's fused CUDA kernels cannot run on {profile.name}: {why}; "
                      "choosing among torch's kernels", RuntimeWarning, stacklevel=3)


def decide(workload: Workload, device: torch.device, *, cache=None, timer: Timer | None = None,
           isolate: bool | None = None, extra: Iterable[Candidate] = (), include_test_only: bool = False,
           profile: DeviceProfile | None = None, measurer: Measurer | None = None,
           budget_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> KernelPlan:
    """The plan for ``workload`` on ``device`` (described by ``profile``; default: this
    machine's): cached decisions where the cache holds them for this environment and the same
    candidates, measured ones otherwise (then cached). ``measurer`` replaces the measurement
    (default: in child processes on CUDA, ``isolate``; in this process with ``timer`` otherwise).
    ``budget_s``: seconds the measuring may take (None: no limit), on ``clock``; the cases left
    when it is spent run the baseline and are not cached. A custom ``measurer`` is not given the
    budget: it is only not called when the budget is spent before it would start."""
    budget = Budget.of(budget_s, clock)
    profile = profile or for_device_type(device.type)
    if profile.type != device.type:
        raise ValueError(f"device {device} is {device.type} but the profile {profile.name!r} is {profile.type}")
    env = environment(device, profile)
    extra = list(extra)
    wanted = [(case, candidates_for(case.op, device.type, include_test_only=include_test_only, extra=extra))
              for case in workload.cases(device.type)]
    _warn_without_fused_cuda(profile, (c for _, cands in wanted for c in cands))
    cached = cache.load(env) if cache is not None else {}
    decisions: dict[str, Decision] = {}
    todo = []
    prior: list[tuple[Case, Candidate]] = []  # cached choices: the measured cases' layers run them
    for case, cands in wanted:
        hit = cached.get(case.key)
        if hit is not None and hit["candidates"] == [c.name for c in cands]:
            decisions[case.key] = Decision.from_dict(hit, "cache")
            prior.append((case, next(c for c in cands if c.name == hit["choice"])))
        else:
            todo.append((case, cands))
    if todo:
        isolate = device.type == "cuda" if isolate is None else isolate
        if budget is not None and budget.spent():  # nothing to start: no child, no measurer
            measured = [budget.skipped(case, cands) for case, cands in todo]
        elif measurer is not None:
            if timer is not None:
                raise ValueError("give a measurer or a timer, not both")
            measured = measurer(todo, device, profile)
        elif timer is not None and isolate:
            raise ValueError("a custom timer runs in this process only (isolate=False)")
        else:
            measured = (measure_isolated(todo, device, profile=profile, decided=prior, budget=budget) if isolate else
                        measure(todo, device, timer=timer or default_timer, profile=profile, decided=prior,
                                budget=budget))
        for d in measured:
            decisions[d.case.key] = d
        missing = [case.key for case, _ in todo if case.key not in decisions]
        if missing:
            raise RuntimeError(f"kernel measurement decided {len(todo) - len(missing)} of {len(todo)} cases; "
                               f"undecided: {'; '.join(missing)}")
        kept = {d.case.key: d.to_dict() for d in measured if d.origin != "budget"}  # the rest: a later run's
        if cache is not None and kept:
            cache.store(env, kept)
    chosen: dict[str, dict] = {}
    for case, cands in wanted:
        d = decisions[case.key]
        c = next(c for c in cands if c.name == d.choice)
        chosen.setdefault(case.op, {})[c.name] = c.to_dict()
    origin = _origin(len(wanted), len(wanted) - len(todo), sum(d.origin == "budget" for d in decisions.values()))
    where = f" ({cache.path})" if cache is not None else ""
    return KernelPlan(env, {case.key: decisions[case.key] for case, _ in wanted}, chosen,
                      f"{origin}{where}{_budget_note(budget, decisions.values())}")


def _origin(cases: int, cached: int, unmeasured: int) -> str:
    """Where the plan's decisions came from, in a word or two for its note."""
    if cached == cases:
        return "cached"
    if unmeasured == cases:
        return "not measured"
    if cached == 0 and unmeasured == 0:
        return "measured"
    return "partly cached" if cached else "partly measured"


def _budget_note(budget: Budget | None, decisions: Iterable[Decision]) -> str:
    """The plan note's word on the budget: what it was, and how many cases it left unmeasured."""
    if budget is None:
        return ""
    left = sum(d.origin == "budget" for d in decisions)
    return (f"; kernels budget {budget.seconds:g} s" + (f": {left} case(s) not measured (baseline)" if left else ""))


def agree_plan(make_plan: Callable[[], KernelPlan], device: torch.device) -> KernelPlan:
    """Rank 0 runs ``make_plan`` and broadcasts the result: every rank gets the same plan (a
    failure on rank 0 is broadcast too and raised on every rank, so no rank waits forever)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return make_plan()
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = {"plan": make_plan().to_dict()}
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            payload[0] = {"error": _first_line(e)}
    dist.broadcast_object_list(payload, src=0, device=device if dist.get_backend() == "nccl" else None)
    if "error" in payload[0]:
        raise RuntimeError(f"kernels=auto: rank 0 could not decide the kernels: {payload[0]['error']}")
    return KernelPlan.from_dict(payload[0]["plan"])


_logged: set[str] = set()


def log_once(plan: KernelPlan, write: Callable[[str], None] | None = None) -> None:
    """Print the plan's table once per process (``write``: a logger's message function)."""
    text = plan.table()
    if text in _logged:
        return
    _logged.add(text)
    (write or (lambda s: print(s, file=sys.stderr, flush=True)))(text)


def plan_copy(plan: KernelPlan, run_dir: str | os.PathLike, name: str = "kernel_decisions.json") -> Path:
    """Write the plan into the run directory (``name``) and return the path."""
    path = Path(run_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
    return path


__all__ = ["OPS", "Workload", "Measurement", "Decision", "Budget", "KernelPlan", "Measurer", "decide", "decide_case",
           "survey", "agree_plan", "measure", "measure_isolated", "log_once", "plan_copy", "environment", "choose", "MIN_GAIN"]
