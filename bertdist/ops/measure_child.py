"""The crash-isolated measurement of ``kernels: auto``: the planning's ``measure`` in a child process.

On CUDA a kernel can corrupt the CUDA context or kill the process. ``measure_isolated`` runs the
measurement in a child (``_child_main``, started with this interpreter) that writes one JSON line
per event (a candidate starting, a case decided, the device left unusable) and fsyncs it, so the
parent knows which candidate was running when the child died. That candidate is recorded as an
error and excluded, and the cases not yet decided are measured again in a fresh child without it.

A time budget (``kernels_budget_s``) travels to the child as the seconds already spent; the child
stops starting cases once it is spent and emits a ``budget`` event per case left, which the
parent takes as decided (the baseline), not as a crash. No new child starts once it is spent.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from bertdist.device_profile import DeviceProfile
from bertdist.ops.candidates import Candidate, Case
from bertdist.ops.kernel_plan import Budget, Decision, Measurement


def _child_main(spec_path: str, out_path: str) -> int:
    """The isolated measurement: cases from ``spec_path``; a progress/result JSON line per event to ``out_path``."""
    # Imported here: the planning module imports this one (for ``measure_isolated``).
    from bertdist.ops.selection import DeviceUnusable, measure

    spec = json.loads(Path(spec_path).read_text())
    sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    p = spec.get("profile")
    profile = DeviceProfile(**{**p, "capability": tuple(p["capability"]) if p["capability"] else None}) if p else None
    cases = [(Case(**c["case"]), [Candidate.from_dict(x) for x in c["candidates"]]) for c in spec["cases"]]
    decided = [(Case(**c["case"]), Candidate.from_dict(c["candidate"])) for c in spec.get("decided", [])]
    with open(out_path, "a", buffering=1) as f:
        def emit(obj):
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

        def done(d):
            emit({"budget" if d.origin == "budget" else "decision": d.to_dict()})

        try:
            measure(cases, device, on_start=lambda case, c: emit({"start": case.key, "candidate": c.name}),
                    on_done=done, profile=profile, decided=decided, budget=Budget.from_child(spec.get("budget")))
        except DeviceUnusable as e:
            emit({"unusable": e.candidate, "error": e.error})
            return 3
    return 0


TIMEOUT_S = 900.0  # one child's measurement of eager cases
COMPILE_ALLOWANCE_S = 120.0  # more per candidate timed in a compiled layer (each compiles its own)


def measure_isolated(cases: list[tuple[Case, list[Candidate]]], device: torch.device, *,
                     timeout_s: float | None = None, profile: DeviceProfile | None = None,
                     decided: list[tuple[Case, Candidate]] = (), budget: Budget | None = None) -> list[Decision]:
    """``measure`` in child processes: a candidate that kills the child or the CUDA context is
    recorded as an error and excluded, and the remaining cases are measured again without it.
    ``timeout_s``: per child (default: ``TIMEOUT_S`` plus ``COMPILE_ALLOWANCE_S`` per compiled
    candidate measurement). ``decided``: choices made before (cached), which the layers run.
    ``budget``: once spent, the cases not started get the baseline (``Budget.skipped``)."""
    if timeout_s is None:
        compiled = sum(len(cands) for case, cands in cases if case.layer is not None and case.layer.compiled)
        timeout_s = TIMEOUT_S + COMPILE_ALLOWANCE_S * compiled
    done: dict[str, Decision] = {}
    excluded: dict[str, dict[str, str]] = {}  # case key -> candidate -> reason
    for _attempt in range(1 + sum(len(c) for _, c in cases)):
        todo = [(case, [c for c in cands if c.name not in excluded.get(case.key, {})])
                for case, cands in cases if case.key not in done]
        if not todo:
            break
        if budget is not None and budget.spent():  # no new child: the rest run the baseline
            done.update((case.key, budget.skipped(case, cands)) for case, cands in todo)
            break
        with tempfile.TemporaryDirectory(prefix="bertdist_select_") as tmp:
            spec, out = Path(tmp) / "spec.json", Path(tmp) / "events.jsonl"
            spec.write_text(json.dumps({"device": str(device), "sys_path": sys.path,
                                        "budget": budget.to_child() if budget is not None else None,
                                        "profile": profile.to_dict() if profile else None, "cases": [
                {"case": dataclasses.asdict(case), "candidates": [c.to_dict() for c in cands]} for case, cands in todo],
                # a fresh child times its layers with the choices the earlier ones made
                "decided": [{"case": dataclasses.asdict(case), "candidate": cand.to_dict()} for case, cand in decided]
                + [{"case": dataclasses.asdict(case), "candidate": next(
                    c.to_dict() for c in cands if c.name == done[case.key].choice)}
                    for case, cands in cases if case.key in done]}))
            cmd = [sys.executable, "-c", "import sys; from bertdist.ops.measure_child import _child_main; "
                   "sys.exit(_child_main(sys.argv[1], sys.argv[2]))", str(spec), str(out)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
                rc, tail = proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1][:200]
            except subprocess.TimeoutExpired:
                rc, tail = -1, f"timed out after {timeout_s:.0f} s"
            last_start, unusable = None, None
            for line in (out.read_text().splitlines() if out.exists() else []):
                ev = json.loads(line)
                if "start" in ev:
                    last_start = (ev["start"], ev["candidate"])
                elif "decision" in ev or "budget" in ev:
                    d = (Decision.from_dict(ev["decision"], "measured") if "decision" in ev
                         else Decision.from_dict(ev["budget"], "budget"))
                    done[d.case.key] = d
                    last_start = None
                elif "unusable" in ev:
                    unusable = ev
            if rc == 0:
                continue
            if last_start is None:
                raise RuntimeError(f"kernel measurement process failed (exit {rc}) before any candidate ran: {tail}")
            key, name = last_start
            if name == next(cands[0].name for case, cands in cases if case.key == key):  # the baseline
                raise RuntimeError(f"kernel measurement: the baseline {name!r} failed on {key} (exit {rc}): {tail}")
            why = (f"left the CUDA device unusable: {unusable['error']}" if unusable
                   else f"killed the measuring process (exit {rc}): {tail}")
            excluded.setdefault(key, {})[name] = why
            warnings.warn(f"kernels=auto: candidate {name!r} {why}; measuring again without it", RuntimeWarning,
                          stacklevel=2)
    decisions = []
    for case, cands in cases:
        d = done[case.key]
        for name, why in excluded.get(case.key, {}).items():  # crashed candidates appear in the table too
            fam = next(c.family for c in cands if c.name == name)
            d.measurements.append(Measurement(name, fam, "error", why))
        d.candidates = [c.name for c in cands]
        decisions.append(d)
    return decisions
