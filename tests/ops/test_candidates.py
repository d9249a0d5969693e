"""The candidate registry of kernels: auto, for every op and device type: every target loads,
and the ones that run on CPU tensors are called and agree with the fp32 math."""
from __future__ import annotations

import pytest
import torch

from bertdist.ops import candidates, measure_child, numerics_gate
from bertdist.ops.candidates import OPS, Case, baseline_target, candidates_for

DEVICE_TYPES = ("cpu", "cuda")


def _case(op: str, device_type: str, dtype: str = "float32") -> Case:
    return Case(op, dtype, False, device_type, batch=2, seq=16, hidden=64, heads=2)


@pytest.mark.parametrize("device_type", DEVICE_TYPES)
@pytest.mark.parametrize("op", OPS)
def test_every_candidate_and_baseline_target_resolves_to_a_callable(op, device_type):
    assert callable(candidates._resolve(baseline_target(op, device_type))), baseline_target(op, device_type)
    for cand in candidates_for(op, device_type, include_test_only=True):
        assert callable(cand.load()), f"{op} on {device_type}: {cand.name} -> {cand.target}"
        if cand.check:
            assert callable(candidates._resolve(cand.check)), f"{op}: {cand.name} check {cand.check}"


@pytest.mark.parametrize("op", OPS)
def test_cuda_baselines_run_on_cpu_tensors_and_match_the_math(op):
    """The torch-native functions kernels: reference runs on CUDA are device-generic: called here."""
    case = _case(op, "cpu")
    problem = numerics_gate.make_problem(case, torch.device("cpu"))
    oracle = problem.run(numerics_gate.oracle_for(op), torch.float32, masters_dtype=torch.float32)
    got = problem.run(candidates._resolve(baseline_target(op, "cuda")), torch.float32)
    for k, v in got.items():
        assert numerics_gate.rel_err(v, oracle[k]) < 1e-4, (op, k)


# ---------------------------------------------------------------- the CUDA branch on a CUDA profile

import subprocess  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from bertdist.device_profile import by_name  # noqa: E402
from bertdist.ops import TORCH_NATIVE, _extension, fused, kernels_for_run, resolve_kernels  # noqa: E402
from bertdist.ops.decision_cache import DecisionCache  # noqa: E402
from bertdist.ops.kernel_plan import Decision, Measurement  # noqa: E402
from bertdist.ops.selection import choose  # noqa: E402
from bertdist.train.config import load_train_config  # noqa: E402

H100 = by_name("h100")
CUDA = torch.device("cuda")  # a descriptor only: nothing is allocated on it
# The recipes of model families that run bertdist.ops kernels (ModernBERT picks its attention in its config).
RECIPES = sorted(r for r in (Path(__file__).resolve().parents[2] / "configs" / "pretrain").glob("*.yaml")
                 if "model_type: modernbert" not in r.read_text())


class _Extension:
    """Stands in for bertdist._C: a build with or without CUDA kernels."""

    def __init__(self, with_cuda: bool):
        self.with_cuda = with_cuda

    def build_info(self):
        note = "built with CUDA for sm_80,sm_90" if self.with_cuda else "built without CUDA kernels: no CUDA toolkit"
        return {"with_cuda": self.with_cuda, "cuda_archs": "sm_80,sm_90" if self.with_cuda else "", "note": note}


@pytest.fixture
def extension(monkeypatch):
    def use(with_cuda: bool):
        monkeypatch.setattr(_extension, "load", lambda: (_Extension(with_cuda), "prebuilt bertdist._C (stand-in)"))
    use(True)
    return use


def injected_timings(ms_of):
    """A measurer that runs no kernel: each candidate the profile supports is loaded and given the
    time ``ms_of(case, candidate)``; numerics count as passed (only a GPU can check them)."""
    def measurer(todo, device, profile):
        out = []
        for case, cands in todo:
            ms = []
            for c in cands:
                why = c.unsupported(case, profile)
                if why:
                    ms.append(Measurement(c.name, c.family, "unsupported", why))
                    continue
                assert callable(c.load())
                t = ms_of(case, c)
                ms.append(Measurement(c.name, c.family, "passed", ms=t, ms_range=(t, t)))
            out.append(Decision(case, choose(ms), ms, [c.name for c in cands]))
        return out
    return measurer


def _recipe_kernels(recipe: Path, autocast: bool, measurer, cache):
    cfg = load_train_config(recipe)
    return cfg, kernels_for_run("auto", cfg.model, CUDA, micro_batch=cfg.data.micro_batch_size,
                                seq=cfg.data.max_seq_length, precision=cfg.deepspeed.precision, autocast=autocast,
                                cache=cache, profile=H100, measurer=measurer)


def test_a_spent_budget_runs_torchs_kernels_on_h100_without_measuring_or_caching(extension, tmp_path):
    cfg = load_train_config(RECIPES[0])
    cache = DecisionCache(tmp_path / "kd.json")

    def measurer(todo, device, profile):
        raise AssertionError("the budget was spent: nothing may be measured")

    ks = kernels_for_run("auto", cfg.model, CUDA, micro_batch=cfg.data.micro_batch_size, seq=cfg.data.max_seq_length,
                         precision=cfg.deepspeed.precision, cache=cache, profile=H100, measurer=measurer, budget_s=0)
    assert ks.plan is not None and {d.origin for d in ks.plan.decisions.values()} == {"budget"}
    assert {ks.sources[d.case.op] for d in ks.plan.decisions.values()} == {"torch"}, ks.sources
    assert cache.load(ks.plan.environment) == {}


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_each_recipe_plan_on_h100_decides_every_case(recipe, autocast, extension, tmp_path):
    fastest = {"torch": 1.0, "fused": 0.5, "torch:sdpa-cudnn": 0.6}  # others as slow as torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        cfg, ks = _recipe_kernels(recipe, autocast, injected_timings(lambda case, c: fastest.get(c.name, 1.0)),
                                  DecisionCache(tmp_path / "kd.json"))
    plan = ks.plan
    assert plan is not None and ks is not TORCH_NATIVE
    assert plan.environment["device"] == H100.name and plan.environment["cuda"] == "13.0"
    cases = list(plan.decisions.values())
    attention_op = "varlen_attention" if cfg.model.unpad else "attention"
    assert {d.case.op for d in cases} == {"layer_norm", "bias_dropout_add_layer_norm", attention_op}
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[cfg.deepspeed.precision]
    for d in cases:
        assert d.case.device_type == "cuda" and d.case.batch == cfg.data.micro_batch_size
        assert d.case.seq == min(cfg.data.max_seq_length, cfg.model.max_position_embeddings)
        assert d.case.hidden == cfg.model.hidden_size and d.case.heads == cfg.model.num_attention_heads
        assert d.origin == "measured" and d.choice == "fused", plan.table()  # the injected fastest
        norm = d.case.op in ("layer_norm", "bias_dropout_add_layer_norm")
        assert d.case.dtype == ("float32" if norm and autocast and dtype != "float32" else dtype)
    # Training calls (with dropout) and evaluation calls (without) are both decided.
    assert {d.case.dropout for d in cases if d.case.op == attention_op} == {True, False}
    assert ks.sources == {"layer_norm": "fused", "bias_dropout_add_layer_norm": "fused",
                          "attention": "fused" if attention_op == "attention" else "reference",
                          "varlen_attention": "fused" if attention_op == "varlen_attention" else "reference"}
    # The same run again reads the cache instead of measuring.
    _, again = _recipe_kernels(recipe, autocast, lambda *a: pytest.fail("measured again"),
                               DecisionCache(tmp_path / "kd.json"))
    assert {d.origin for d in again.plan.decisions.values()} == {"cache"}


def test_baseline_is_chosen_and_loads_when_nothing_beats_it(extension, tmp_path):
    _, ks = _recipe_kernels(RECIPES[0], False, injected_timings(lambda case, c: 1.0), DecisionCache(tmp_path / "k"))
    assert ks.plan is not None and {d.choice for d in ks.plan.decisions.values()} == {"torch"}
    assert set(ks.sources.values()) == {"torch", "reference"}


def test_failing_measurement_child_falls_back_to_torch_native_with_one_warning(extension, monkeypatch, tmp_path):
    def crashed(cmd, **kw):
        return subprocess.CompletedProcess(cmd, -11, "", "Fatal Python error: Segmentation fault")
    monkeypatch.setattr(measure_child, "subprocess", SimpleNamespace(run=crashed, TimeoutExpired=subprocess.TimeoutExpired))
    with pytest.warns(RuntimeWarning) as record:
        _, ks = _recipe_kernels(RECIPES[0], False, None, DecisionCache(tmp_path / "kd.json"))
    assert ks is TORCH_NATIVE
    (w,) = record.list
    assert "could not decide the kernels" in str(w.message) and "exit -11" in str(w.message)
    assert "Segmentation fault" in str(w.message) and "running torch-native" in str(w.message)
    assert not (tmp_path / "kd.json").exists()  # nothing decided, nothing cached


def test_extension_without_cuda_kernels_leaves_fused_out_with_one_warning(extension, tmp_path):
    extension(False)
    ok, why = fused.availability("attention", H100)
    assert not ok and "has no CUDA kernels" in why
    with pytest.warns(RuntimeWarning) as record:
        _, ks = _recipe_kernels(RECIPES[0], False, injected_timings(lambda case, c: 0.5 if c.name == "fused" else 1.0),
                                DecisionCache(tmp_path / "kd.json"))
    (w,) = record.list
    assert "fused CUDA kernels cannot run on NVIDIA H100" in str(w.message) and "no CUDA kernels" in str(w.message)
    assert ks.plan is not None
    for d in ks.plan.decisions.values():
        assert d.choice == "torch" and d.measurement("fused").status == "unsupported"
    with pytest.raises(RuntimeError, match="kernels=fused requested on cuda but: layer_norm: .*no CUDA kernels"):
        resolve_kernels("fused", "cuda", profile=H100)


def test_fused_support_follows_the_profile(extension):
    assert fused.availability("attention", H100)[0]
    old = H100.with_(name="Tesla V100", capability=(7, 0))
    ok, why = fused.availability("attention", old)
    assert not ok and "need sm_80+, device Tesla V100 is sm_70" in why
    ok, why = fused.availability("attention", H100.with_(visible_count=0))
    assert not ok and "no CUDA device is visible" in why
    case = Case("attention", "bfloat16", False, "cuda", batch=2, seq=16, hidden=96, heads=2)  # head_dim 48
    fused_cand = next(c for c in candidates_for("attention", "cuda") if c.name == "fused")
    assert "head_dim 32, 64 or 128, not 48" in fused_cand.unsupported(case, H100)


def test_fused_on_cuda_is_forced_and_says_once_that_it_is_a_test_mode(extension, monkeypatch):
    from bertdist.ops import dispatch

    monkeypatch.setattr(dispatch, "_fused_warned", False)
    with pytest.warns(RuntimeWarning, match="fused is a test and comparison mode; for training use kernels=auto"):
        ks = resolve_kernels("fused", "cuda", profile=H100)
    assert set(ks.sources.values()) == {"fused"} and ks.attention is fused.attention
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_kernels("fused", "cuda", profile=H100)  # once per process
        resolve_kernels("fused", "cpu")  # CPU: the mode's purpose, no warning
