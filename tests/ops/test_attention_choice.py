"""``attention_backend: auto`` on CPU: each backend gated against the reference twin on the run's
shapes, the passing ones timed (an injected timer here), one backend chosen for the model."""
from __future__ import annotations

import json

import pytest
import torch

from bertdist.model.modernbert import ModernBertForMaskedLM
from bertdist.model.modernbert_config import ModernBertConfig
from bertdist.ops import attention_choice
from bertdist.ops.attention_choice import AttentionWorkload, decide_attention_backend, set_attention_backend
from bertdist.ops.candidates import Candidate
from bertdist.ops.decision_cache import DecisionCache

CPU = torch.device("cpu")
TC = "tests.ops.selection_candidates"


def _cfg(**kw):
    return ModernBertConfig.from_preset("tiny", vocab_size=256, pad_token_id=0, max_position_embeddings=64,
                                        local_attention=16, **{"attention_backend": "auto", **kw})


def _timer(ms_by_name, calls=None):
    def timer(candidate, case, call, device):
        call()  # the call still has to run
        if calls is not None:
            calls.append((candidate.name, case.half_window))
        return [ms_by_name[candidate.name]] * 3
    return timer


def _decide(cfg=None, *, training, timer, **kw):
    return decide_attention_backend(cfg or _cfg(), CPU, batch=4, seq=64, training=training, cache=False, timer=timer,
                                    agree=False, log=lambda s: None, **kw)


def test_inference_takes_the_fastest_backend_that_passes_and_never_the_reference_twin():
    calls = []
    got = _decide(training=False, timer=_timer({"reference": 0.01, "sdpa": 2.0, "flex": 1.0}, calls))
    assert got.backend == "flex"  # the reference is the fastest here but only sets the bounds
    assert {name for name, _ in calls} == {"reference", "sdpa", "flex"}
    assert {w for _, w in calls} == {None, 8}  # a global layer and a local one (window 16: +-8)
    assert "auto chose flex: forward of 1 global + 2 local (+-8) layers" in got.summary
    assert "sdpa 6.000 ms" in got.summary and "flex 3.000 ms" in got.summary  # time x layers, summed
    assert _decide(training=False, timer=_timer({"reference": 9.0, "sdpa": 1.0, "flex": 2.0})).backend == "sdpa"
    table = got.plan.table()
    assert table.startswith("attention_backend: auto on cpu") and table.count("CHOSEN") == 2


def test_the_choice_weighs_each_layer_kind_by_its_count():
    """flex is faster on the one global layer, sdpa on the two local ones, and in sum: sdpa."""
    def timer(candidate, case, call, device):
        call()
        ms = {"reference": 50.0, "sdpa": 1.0 if case.half_window else 3.0, "flex": 2.5 if case.half_window else 1.0}
        return [ms[candidate.name]]

    got = _decide(training=False, timer=timer)
    assert got.backend == "sdpa", got.summary
    assert "sdpa 5.000 ms" in got.summary and "flex 6.000 ms" in got.summary


def test_cpu_training_never_picks_flex():
    got = _decide(training=True, timer=_timer({"reference": 9.0, "sdpa": 5.0, "flex": 0.001}))
    assert got.backend == "sdpa"
    flex = [d.measurement("flex") for d in got.plan.decisions.values()]
    assert [m.status for m in flex] == ["unsupported", "unsupported"]
    assert "no backward on CPU" in flex[0].reason and "flex unsupported on global" in got.summary
    # nor with attention dropout, on any device
    work = AttentionWorkload.for_model(_cfg(attention_dropout=0.1), batch=4, seq=64, training=True)
    assert all(c.dropout and c.p == 0.1 for c in work.cases("cuda"))
    from bertdist.ops.candidates import candidates_for, flex_unsupported

    flex_cand = next(c for c in candidates_for(work.op, "cuda") if c.name == "flex")
    assert flex_cand.check.endswith(":flex_unsupported")
    assert "no attention dropout" in flex_unsupported(work.cases("cuda")[0])


def test_a_backend_that_fails_the_gate_is_never_chosen():
    """A wrong backend (the window ignored), however fast, is disabled with a warning naming the
    error and the bound, on the local layers it gets wrong; the model's choice excludes it."""
    wrong = Candidate("varlen_window_attention", "windowless", f"{TC}:wrong_varlen_window_attention", "test",
                      test_only=True)
    with pytest.warns(RuntimeWarning, match=r"candidate 'windowless' disabled .*error .* > bound"):
        got = _decide(training=True, timer=_timer({"reference": 9.0, "sdpa": 5.0, "flex": 1.0, "windowless": 0.001}),
                      extra=[wrong], include_test_only=True)
    assert got.backend == "sdpa"
    by_window = {d.case.half_window: d.measurement("windowless") for d in got.plan.decisions.values()}
    assert by_window[None].status == "passed" and by_window[8].status == "failed"  # right without a window only
    assert by_window[8].error > by_window[8].bound
    assert "windowless failed on window +-8" in got.summary


def test_the_reference_twin_runs_only_when_nothing_else_passes():
    broken_sdpa = Candidate("varlen_window_attention", "sdpa", f"{TC}:wrong_varlen_window_attention", "test")
    with pytest.warns(RuntimeWarning, match="candidate 'sdpa' disabled"):
        got = _decide(training=True, timer=_timer({"reference": 9.0, "sdpa": 1.0, "flex": 1.0}), extra=[broken_sdpa])
    assert got.backend == "reference"
    assert "reference 27.000 ms (reference twin)" in got.summary


def test_decisions_are_cached_and_copied_to_the_run_dir(tmp_path):
    cache = DecisionCache(tmp_path / "cache.json")
    calls = []
    kw = dict(cache=cache, timer=_timer({"reference": 9.0, "sdpa": 2.0, "flex": 1.0}, calls), agree=False,
              log=lambda s: None)
    first = decide_attention_backend(_cfg(), CPU, batch=4, seq=64, training=False, run_dir=str(tmp_path), **kw)
    n = len(calls)
    again = decide_attention_backend(_cfg(), CPU, batch=4, seq=64, training=False, **kw)
    assert first.backend == again.backend == "flex" and len(calls) == n == 6  # nothing measured the second time
    assert {d.origin for d in again.plan.decisions.values()} == {"cache"}
    saved = json.loads((tmp_path / attention_choice.DECISIONS_FILE).read_text())
    assert {d["choice"] for d in saved["decisions"].values()} == {"flex"}
    # training is another decision (another case key): measured afresh
    decide_attention_backend(_cfg(), CPU, batch=4, seq=64, training=True, **kw)
    assert len(calls) == n + 4  # reference and sdpa, per layer kind; flex cannot run it
    from bertdist.cli.info import cached_decisions  # what `bertdist info` lists

    rows = cached_decisions(cache)["environments"][0]["decisions"]
    assert sorted(r["shape"] for r in rows) == ["b4 s64 h64 n2 global", "b4 s64 h64 n2 global fwd",
                                                "b4 s64 h64 n2 window +-8", "b4 s64 h64 n2 window +-8 fwd"]
    assert {(r["baseline"], r["torch_ms"]) for r in rows} == {("reference", 9.0)}


def test_the_gate_is_a_small_case_of_the_runs_shape():
    cfg = ModernBertConfig.from_preset("base", attention_backend="auto", attention_dropout=0.1)
    work = AttentionWorkload.for_model(cfg, batch=96, seq=8192, precision="bf16", training=True)
    assert (work.batch, work.seq, work.dtype, work.dropout) == (4, 1024, "bfloat16", 0.1)
    assert work.layers == ((None, 8), (64, 14)) and work.op == "varlen_window_attention"
    cases = work.cases("cuda")
    assert [c.head_dim for c in cases] == [64, 64] and [c.half_window for c in cases] == [None, 64]
    assert AttentionWorkload.for_model(cfg.__class__.from_preset("tiny", unpad=False), batch=2, seq=64).op == \
        "window_attention"


@pytest.mark.parametrize("backend", ["sdpa", "flex", "reference"])
def test_a_named_backend_is_obeyed(backend):
    from bertdist.model.families import family_of

    cfg = _cfg(attention_backend=backend)
    model = ModernBertForMaskedLM(cfg)
    assert {m.backend for m in model.modules() if hasattr(m, "half_window")} == {backend}

    class Run:  # what the family's attention decision reads of a TrainConfig
        model_config = cfg

    family = family_of(cfg)
    assert family.choose_attention(Run(), CPU, None) is None  # nothing measured, nothing replaced
    family.use_attention(model, None)
    assert {m.backend for m in model.modules() if hasattr(m, "half_window")} == {backend}


def test_an_auto_model_runs_sdpa_until_given_its_decision_and_matches_the_reference():
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(_cfg()).eval()
    assert {m.backend for m in model.modules() if hasattr(m, "half_window")} == {attention_choice.UNMEASURED}
    ids = torch.randint(5, 256, (30,))
    cu, longest = torch.tensor([0, 12, 30], dtype=torch.int32), 18
    with torch.no_grad():
        outs = {}
        for backend in ("reference", "flex"):
            assert set_attention_backend(model, backend) == 3
            outs[backend] = model(ids, cu_seqlens=cu, max_seqlen=longest).logits
    torch.testing.assert_close(outs["flex"], outs["reference"], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="'auto' is not one of"):
        set_attention_backend(model, "auto")


def test_export_writes_no_backend_into_the_hf_config():
    from bertdist.export.modernbert_hf import config_from_hf, hf_config_dict

    hf = hf_config_dict(_cfg())
    assert "auto" not in json.dumps(hf) and "attention_backend" not in hf
    assert config_from_hf(hf, "config.json").attention_backend == "sdpa"  # what the dataclass defaults to


def test_a_fine_tuning_summary_names_the_backend_that_runs_not_auto():
    from bertdist.export.encoders import family_of
    from bertdist.finetune.heads import task_model

    model = task_model(_cfg(), "sequence", 2, device_type="cpu")
    assert family_of(_cfg()).kernel_sources(model) == {"attention": attention_choice.UNMEASURED}
    set_attention_backend(model, "reference")
    assert family_of(_cfg()).kernel_sources(model) == {"attention": "reference"}


def test_in_bf16_the_bounds_are_an_unfused_kernels_error_and_still_catch_a_wrong_one():
    """The reference twin computes in fp32 and rounds once: twice its error would fail flex's correct
    bf16 result (seen: 5.7e-3 against 4.0e-3). The bound is twice an unfused bf16 kernel's error,
    far below what ignoring the window costs."""
    wrong = Candidate("varlen_window_attention", "windowless", f"{TC}:wrong_varlen_window_attention", "test",
                      test_only=True)
    with pytest.warns(RuntimeWarning, match="candidate 'windowless' disabled"):
        got = decide_attention_backend(_cfg(), CPU, batch=4, seq=64, precision="bf16", training=False, cache=False,
                                       timer=_timer({"reference": 9.0, "sdpa": 2.0, "flex": 1.0, "windowless": 0.1}),
                                       agree=False, log=lambda s: None, extra=[wrong], include_test_only=True)
    assert got.backend == "flex"
    for d in got.plan.decisions.values():
        ref, flex = d.measurement("reference"), d.measurement("flex")
        assert d.case.dtype == "bfloat16" and flex.status == "passed" and ref.bound > 2 * ref.error
    local = next(d for d in got.plan.decisions.values() if d.case.half_window == 8).measurement("windowless")
    assert local.status == "failed" and local.error > 10 * local.bound


@pytest.mark.slow  # a measuring child process (~10 s on a shared CPU)
def test_the_isolated_measurement_cuda_uses_decides_the_windowed_cases_too():
    """On CUDA ``selection.decide`` measures in a child process: the windowed cases (their window
    and forward-only flag) and their candidates travel there and back. Forced here on the CPU."""
    from bertdist.ops import selection

    work = AttentionWorkload.for_model(_cfg(), batch=2, seq=64, precision="bf16", training=False)
    plan = selection.decide(work, CPU, isolate=True)
    assert [(d.case.half_window, d.case.backward) for d in plan.decisions.values()] == [(None, False), (8, False)]
    for d in plan.decisions.values():
        assert [m.name for m in d.measurements] == ["reference", "sdpa", "flex"]
        assert all(m.status == "passed" and m.ms > 0 for m in d.measurements), d.measurements
    backend, summary = attention_choice.combine(plan, work)
    assert backend in ("sdpa", "flex") and summary.startswith(f"attention_backend: auto chose {backend}: forward of")


def test_a_family_whose_kernel_plan_fixes_its_attention_decides_none_at_the_start():
    from bertdist.model.config import BertConfig
    from bertdist.model.families import family_of

    bert = family_of(BertConfig.from_preset("tiny"))
    assert bert.decide_attention is None and bert.choose_attention(object(), CPU, None) is None
    assert family_of(_cfg()).decide_attention == "bertdist.ops.attention_choice:decide_for_run"
