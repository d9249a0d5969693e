"""`bertdist bench`: its verdicts can fail, a failing stage is a row of the report, and on CPU the
quick variant times `bertdist pretrain` itself and writes the report."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def acceptance(load_benchmark):
    return load_benchmark("acceptance")


CPU_ENV = {"device_type": "cpu", "device": "CPU (test)"}


def _auto_ref(acceptance, auto_s, reference_s):
    return {"recipe": "bert-large-phase1.yaml", "repeats": len(auto_s), "runs": [],
            "scaled": "scaled: test", **acceptance.compare_auto_reference(auto_s, reference_s)}


def test_auto_slower_than_reference_beyond_the_spread_is_not_met(acceptance):
    slower = _auto_ref(acceptance, [0.130, 0.128, 0.131], [0.100, 0.101, 0.099])
    assert slower["verdict"] == "NOT met"
    assert slower["auto_slower_by_s"] == pytest.approx(0.030) and slower["spread_s"] == pytest.approx(0.003)
    rows = acceptance.targets(CPU_ENV, [], slower)
    (row,) = [r for r in rows if r[0].startswith("kernels: auto never slower")]
    assert row[2] == "NOT met" and "130.0 ms vs reference 100.0 ms" in row[1]
    assert acceptance.exit_status({"targets": rows}) == 1
    # within the spread, or faster: met
    assert acceptance.compare_auto_reference([0.102, 0.099, 0.104], [0.100, 0.101, 0.097])["verdict"] == "met"
    assert acceptance.compare_auto_reference([0.090], [0.100])["verdict"] == "met"
    assert acceptance.compare_auto_reference([], [0.100])["verdict"].startswith("NOT met")


def test_report_says_not_met_and_shows_failed_rows(acceptance):
    recipes = [{"recipe": "tiny.yaml", "status": "failed", "error": "exit 1: ConfigError: boom",
                "scaled": "scaled: test", "command": "bertdist pretrain tiny.yaml"}]
    report = {"environment": {**CPU_ENV, "date": "2026-01-01", "python": "3", "torch": "t", "cuda": "none",
                              "cudnn": "n/a", "deepspeed": "d", "transformers": "t", "bertdist": "b"},
              "command": "bertdist bench", "deadline_s": 10.0, "seconds": 1.0, "stage_seconds": {},
              "skipped_stages": [], "failed_stages": [], "throughput": [], "tests": None, "kernels": None,
              "decisions": None, "recipes": recipes,
              "auto_vs_reference": _auto_ref(acceptance, [0.2], [0.1])}
    report["targets"] = acceptance.targets(report["environment"], [], report["auto_vs_reference"], recipes)
    text = acceptance.markdown(report)
    assert "| NOT met |" in text and "FAILED: exit 1: ConfigError: boom" in text
    assert acceptance.exit_status(report) == 1


def test_a_stage_that_raises_becomes_a_failed_row(acceptance):
    report = {}

    def broken():
        raise RuntimeError("variant exploded")

    assert acceptance.guarded(report, "throughput", broken) is None
    assert report["failed_stages"] == ["throughput: RuntimeError: variant exploded"]
    assert acceptance.exit_status(report) == 1


def test_pytest_collecting_nothing_is_a_failure(acceptance):
    assert acceptance.exit_status({"tests": {"returncode": 5}, "targets": []}) == 1
    assert acceptance.exit_status({"tests": {"returncode": 0}, "targets": [("t", "m", "met")]}) == 0


def test_recipe_run_that_fails_is_a_row_not_an_exception(acceptance, tmp_path):
    scale = acceptance.RecipeScale(steps=2, skip_steps=1, model_preset="tiny", micro_batch=2)
    row = acceptance.run_recipe(REPO / "configs" / "pretrain" / "tiny.yaml", str(tmp_path / "missing.json"),
                                str(tmp_path / "vocab.txt"), tmp_path, scale, timeout=120)
    assert row["status"] == "failed" and row["error"].startswith("exit ") and "vocab.txt" in row["error"]
    assert "data.global_batch_size=2" in row["command"] and "max_steps=2" in row["command"]


@pytest.mark.slow  # bertdist pretrain 6 recipes + 6 auto/reference runs + the throughput variants: minutes
def test_bench_quick_cpu_variant_times_the_trainer_and_writes_the_report(repo_root, tmp_path):
    cmd = [sys.executable, "-m", "bertdist.cli.main", "bench", "--out", str(tmp_path), "--steps", "1",
           "--recipes", "tiny.yaml,bert-large-phase1.yaml,bert-base-phase2.yaml", "--recipe-steps", "3",
           "--repeats", "2", "--variants", "ours-reference,hf-sdpa", "--skip", "kernels", "--deadline-s", "480"]
    r = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "BERTDIST_CACHE_DIR": str(tmp_path / "user_cache")})
    (md,) = tmp_path.glob("acceptance_*.md")
    (js,) = tmp_path.glob("acceptance_*.json")
    text, rep = md.read_text(), json.loads(js.read_text())
    assert r.returncode == rep["exit_status"], r.stderr[-3000:]
    env = rep["environment"]
    assert env["device_type"] == "cpu" and env["date"] and env["torch"] and "git" in env["bertdist"]
    assert "bench" in rep["command"] and "quick CPU variant" in text
    assert rep["tests"]["returncode"] == 0 and "skipped" in rep["tests"]["summary"]
    # bertdist pretrain itself, with each recipe's settings and the trainer's metrics
    # bert-large-phase1's own figures come from its kernels: auto runs, not from a run of its own
    rows = {row["recipe"]: row for row in rep["recipes"]}
    assert set(rows) == {"tiny.yaml", "bert-base-phase2.yaml"}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["seq_per_s"] > 0 and row["tokens_per_s"] > 0 and row["steps_run"] == 3
    assert rows["bert-base-phase2.yaml"]["optimizer"] == "lamb" and rows["bert-base-phase2.yaml"]["seq"] == 512
    assert rows["bert-base-phase2.yaml"]["kernels"] == "auto" and "model preset tiny" in text
    # most valuable first: the throughput comparison, auto vs reference, the recipes, seq 512, the rest
    assert list(rep["progress"]) == ["records", "throughput mini seq 64", "auto vs reference", "recipes",
                                     "recipes seq 512", "GPU tests", "kernel benchmark", "kernels: auto decisions"]
    assert rep["progress"]["kernel benchmark"] == "skipped (--skip)" and rep["complete"]
    assert rep["seconds"] < 480
    # auto vs reference: a fresh measurement of whole steps, interleaved, with its spread
    ar = rep["auto_vs_reference"]
    assert [x["kernels"] for x in ar["runs"]] == ["auto", "reference", "reference", "auto"]
    assert ar["runs"][0]["optimizer"] == "lamb" and ar["runs"][0]["seq"] == 128
    assert len(ar["auto_s"]) == len(ar["reference_s"]) == 2 and ar["spread_s"] >= 0
    verdicts = {t[0]: t[2] for t in rep["targets"]}
    (label,) = [k for k in verdicts if k.startswith("kernels: auto never slower")]
    assert verdicts[label] in ("met", "NOT met") and "whole training steps" in label
    assert any(v.startswith("n/a") for v in verdicts.values())  # no GPU claim from a CPU run
    (run,) = rep["throughput"]
    assert set(run["variants"]) == {"ours-reference", "hf-sdpa"} and not run["skipped"]
    assert not (tmp_path / "user_cache").exists()  # the bench measured into its own cache, not the user's


def test_a_failed_throughput_variant_is_a_row_and_fails_the_bench(acceptance):
    run = {"preset": "mini", "seq": 64, "batch": 2, "precision": "fp32", "variants": {}, "skipped": {},
           "failed_variants": {"ours-optimized": "RuntimeError: boom"}}
    assert acceptance.exit_status({"throughput": [run], "targets": []}) == 1
    report = {"environment": {**CPU_ENV, "date": "d", "python": "3", "torch": "t", "cuda": "none", "cudnn": "n/a",
                              "deepspeed": "d", "transformers": "t", "bertdist": "b"},
              "command": "bertdist bench", "deadline_s": 1.0, "seconds": 1.0, "stage_seconds": {},
              "skipped_stages": [], "throughput": [run], "tests": None, "kernels": None, "decisions": None,
              "targets": []}
    assert "| ours-optimized | FAILED: RuntimeError: boom |" in acceptance.markdown(report)


H200_ENV = {"device_type": "cuda", "device": "NVIDIA H200"}


def _throughput(ours: float, hf: float, hf_compile: float | None) -> dict:
    variants = {"ours-optimized": {"seq_per_s": ours, "mfu": ours / 4000}, "hf-sdpa": {"seq_per_s": hf}}
    if hf_compile:
        variants["hf-sdpa-compile"] = {"seq_per_s": hf_compile}
    return {"preset": "large", "seq": 128, "batch": 64, "variants": variants, "skipped": {}}


def test_an_h200_is_judged_by_the_targets_with_its_own_peak(acceptance):
    auto_ref = {"recipe": "bert-large-phase1.yaml", "repeats": 1, "verdict": "met",
                "runs": [{"kernels": "auto", "status": "ok", "seq_per_s": 1900.0, "mfu": 0.46},
                         {"kernels": "reference", "status": "ok", "seq_per_s": 1800.0, "mfu": 0.44}]}
    rows = {t: (m, v) for t, m, v in acceptance.targets(H200_ENV, [_throughput(855, 872, 1367)], auto_ref)}
    trainer = [k for k in rows if "one H200" in k and "kernels: auto run" in k]
    assert len(trainer) == 2 and all(rows[k][1] == "met" for k in trainer)  # 1,900 seq/s, 46% of the H200's peak
    bench = [k for k in rows if "one H200" in k and "train_throughput" in k]
    assert [rows[k][1] for k in bench] == ["NOT met", "NOT met"]
    assert rows["large seq 128: ours-optimized >= 1.5x hf-sdpa seq/s (same process, interleaved)"] == ("0.98x", "NOT met")
    assert rows["large seq 128: ours-optimized >= 1.2x hf-sdpa-compile seq/s (same process, interleaved)"][1] == "NOT met"
    # a GPU of another kind is not judged; a missing compile baseline on the target GPU is not a pass
    assert acceptance.target_device({"device_type": "cuda", "device": "NVIDIA A100-SXM4-80GB"}) is None
    rows = {t: v for t, _, v in acceptance.targets(H200_ENV, [_throughput(2000, 1000, None)], None)}
    assert rows["large seq 128: ours-optimized >= 1.2x hf-sdpa-compile seq/s (same process, interleaved)"].startswith(
        "NOT met (no measurement")


def test_each_run_is_capped_by_the_time_left_and_none_starts_after_it(acceptance, tmp_path):
    deadline = acceptance.Deadline(5.0)
    assert 4.0 < deadline.cap(600) <= 5.0 and deadline.cap(1.0) == 1.0
    assert acceptance.Deadline(-1.0).cap() == 0.0
    scale = acceptance.RecipeScale(steps=2, skip_steps=1, model_preset="tiny", micro_batch=2)
    row = acceptance.run_recipe(REPO / "configs" / "pretrain" / "tiny.yaml", "m.json", "v.txt", tmp_path, scale,
                                timeout=0.0)
    assert row["status"] == "skipped" and "deadline" in row["error"]
    assert acceptance.exit_status({"recipes": [row], "targets": []}) == 0  # left out, not failed
    assert acceptance.exit_status({"setup": [{"step": "install", "status": "failed"}], "targets": []}) == 1
    r = acceptance.run_child([sys.executable, "-c", "import time; print('x', flush=True); time.sleep(60)"], 1.0)
    assert r["timed_out"] and r["seconds"] < 10 and r["output"].startswith("x")


def test_the_environment_is_recorded_without_git_or_nvidia_smi(acceptance, monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("PATH", str(tmp_path))  # neither git nor nvidia-smi on it, as on some GPU nodes
    env = acceptance.environment(torch, kit={"image": {"name": "site"}, "built": "d", "built_with": {"bertdist_git": "g"},
                                             "wheels": [{"name": "deepspeed", "version": "0.19.8"}]})
    assert "git unknown: no git or no repository" in env["bertdist"]
    assert env["kit"] == "image site, built d from git g; deepspeed 0.19.8"


def test_an_electra_recipe_reads_unmasked_records_and_is_judged_against_its_own_mlm_twin(acceptance):
    manifests = {"static": {128: "static-128.json", 512: "static-512.json"}, "unmasked": {128: "unmasked-128.json"}}
    recipes = REPO / "configs" / "pretrain"
    assert acceptance._manifest_for(recipes / "electra-small.yaml", manifests) == "unmasked-128.json"
    assert acceptance._manifest_for(recipes / "bert-base-paper.yaml", manifests) == "static-128.json"
    with pytest.raises(ValueError, match=r"no unmasked records with max_seq_length 512 for electra-base.yaml"):
        acceptance._manifest_for(recipes / "electra-base.yaml", manifests)
    assert acceptance._is_electra(recipes / "electra-base.yaml") and not acceptance._is_electra(recipes / "tiny.yaml")

    def row(step_s, overrides=None):
        return {"recipe": "electra-base.yaml", "status": "ok", "step_time_s": step_s,
                **({"overrides": overrides} if overrides else {})}

    for electra_s, verdict in ((0.130, "met"), (0.140, "NOT met")):
        rows = [row(electra_s), row(0.100, ["electra=null"])]
        (t,) = [t for t in acceptance.targets(H200_ENV, [], None, rows) if "ELECTRA step" in t[0]]
        assert t[1].startswith(f"{electra_s / 0.100:.2f}x") and t[2] == verdict
    # a CPU run shows the ratio but claims nothing; without the MLM twin there is no ratio at all
    (t,) = [t for t in acceptance.targets(CPU_ENV, [], None, [row(0.2), row(0.1, ["electra=null"])]) if "ELECTRA" in t[0]]
    assert t[1].startswith("2.00x") and t[2].startswith("n/a")
    assert not [t for t in acceptance.targets(H200_ENV, [], None, [row(0.2)]) if "ELECTRA" in t[0]]


def test_profiled_steps_are_left_out_of_the_medians_and_reported_on_their_own(acceptance, tmp_path):
    scale = acceptance.RecipeScale(steps=30, skip_steps=5, profile_steps=3)
    cmd = acceptance.recipe_command(REPO / "configs" / "pretrain" / "electra-small.yaml", "m.json", "v.txt",
                                    tmp_path, scale)
    assert cmd[-4:] == ["profiling.enabled=true", "profiling.start_step=28", "profiling.num_steps=3",
                        "profiling.trace=false"]
    assert "steps 28-30 under torch.profiler (left out of the medians)" in scale.describe()
    # step times 0.1 s, except the three profiled steps at 0.9 s: the median stays 0.1
    rows = [{"kind": "run", "step": 0, "compile": False}] + [
        {"kind": "train", "step": s, "seq_per_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.1,
         "step_time_s": 0.9 if s >= 28 else 0.1, **({"profiled": True} if s >= 28 else {})} for s in range(1, 31)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = acceptance.trainer_metrics(tmp_path, scale.skip_steps)
    assert m["step_time_s"] == 0.1 and m["steps_timed"] == 22 and m["steps_run"] == 30

    profile = {"steps": 3, "wall_ms_per_step": 120.0, "aten_calls_per_step": 24000.0, "device_busy_ms_per_step": 30.0,
               "device_busy_fraction": 0.25, "kernels_per_step": 3000.0, "first_step": 28,
               "regions": {"forward": {"wall_ms_per_step": 40.0, "aten_calls_per_step": 3700.0},
                           "backward": {"wall_ms_per_step": 60.0}},
               "top_by_self_cpu": [{"op": "aten::copy_", "calls": 5700, "self_cpu_ms": 36.0, "self_device_ms": 9.0}],
               "top_by_self_device": [{"op": "aten::mm", "calls": 600, "self_cpu_ms": 12.0, "self_device_ms": 15.0}]}
    broken = {"steps": 3, "wall_ms_per_step": 90.0, "first_step": 28, "error": "RuntimeError: no events"}
    lines = acceptance.profile_section([{"recipe": "electra-small.yaml", "status": "ok", "profile": profile},
                                        {"recipe": "tiny.yaml", "status": "ok"},
                                        {"recipe": "electra-base.yaml", "status": "ok", "profile": broken}])
    text = "\n".join(lines)
    assert "| electra-small.yaml | 120.0 | 30.0 | 25% | 3,000 | 24,000 | 40.0 (3,700) | - | 60.0 | - |" in text
    assert "| electra-base.yaml | 90.0 | - | - | - | - | - | - | - | - |" in text
    assert "electra-base.yaml: the profile could not be summarised: RuntimeError: no events" in text
    assert "| `aten::copy_` | 1,900 | 12.00 | | `aten::mm` | 200 | 5.00 |" in text  # per step: 3 steps
    assert "tiny.yaml" not in text and acceptance.profile_section([{"recipe": "x", "status": "failed"}]) == []
    # too few steps to time anything beside the warm-up and the profiled ones: refused up front
    with pytest.raises(SystemExit, match=r"--profile: 8 steps .* use --recipe-steps 9 or more"):
        acceptance.RecipeScale.for_device(gpu=True, quick=False, steps=8, profile=True)
    assert acceptance.RecipeScale.for_device(gpu=True, quick=False, steps=9, profile=True).profile_start == 7


def test_each_trainer_variant_is_judged_against_hf_compile_the_model_alone_and_mfu(acceptance):
    variants = {"ours-trainer-flat": {"seq_per_s": 1800.0, "mfu": 0.44, "step_s": 0.0356},
                "ours-trainer": {"seq_per_s": 1500.0, "mfu": 0.37, "step_s": 0.0427},
                "ours-reference-compile": {"seq_per_s": 1900.0, "step_s": 0.0337},
                "hf-sdpa-compile": {"seq_per_s": 1367.0}}
    run = {"preset": "large", "seq": 128, "batch": 64, "variants": variants, "skipped": {}}
    rows = {t: (m, v) for t, m, v in acceptance.targets(H200_ENV, [run], None)}
    flat = {t.split(": ", 1)[1]: mv for t, mv in rows.items() if "ours-trainer-flat:" in t}
    assert flat["bertdist pretrain's step >= 1.25x hf-sdpa-compile seq/s (same process, interleaved)"] == (
        "1.32x (1,800 vs 1,367 seq/s)", "met")
    assert flat["bertdist pretrain's step <= 1.1x the model-only step (ours-reference-compile)"][1] == "met"  # 1.06x
    plain = [mv for t, mv in rows.items() if "ours-trainer:" in t]
    assert plain == [("1.10x (1,500 vs 1,367 seq/s)", "NOT met"), ("1.27x (42.7 vs 33.7 ms)", "NOT met")]
    mfu = {t: mv for t, mv in rows.items() if "45% MFU" in t}
    assert [mv[1] for mv in mfu.values()] == ["NOT met", "NOT met"] and len(mfu) == 2  # 44% and 37%
    # without a trainer variant the old rows stay; on a CPU nothing is judged
    assert not [t for t in acceptance.targets(H200_ENV, [_throughput(855, 872, 1367)], None) if "pretrain's step" in t[0]]
    cpu = acceptance.targets(CPU_ENV, [run], None)
    assert all(v == "n/a (CPU: no GPU claim)" for t, _, v in cpu if "pretrain's step" in t)


def test_the_graphs_variant_is_reported_against_the_same_step_without_graphs(acceptance):
    """ours-trainer-graphs: judged like every trainer variant, and its step time against
    ours-trainer's reported (not a target: the measurement model.cuda_graphs: auto waits for)."""
    variants = {"ours-trainer": {"seq_per_s": 1500.0, "mfu": 0.37, "step_s": 0.0427},
                "ours-trainer-graphs": {"seq_per_s": 1700.0, "mfu": 0.41, "step_s": 0.0376}}
    run = {"preset": "large", "seq": 128, "batch": 64, "variants": variants, "skipped": {}}
    rows = {t: (m, v) for t, m, v in acceptance.targets(H200_ENV, [run], None)}
    graphs = [mv for t, mv in rows.items() if "with CUDA graphs / without (ours-trainer)" in t]
    assert graphs == [("0.88x (37.6 vs 42.7 ms)", "faster")]
    assert any("ours-trainer-graphs" in t and "45% MFU" in t for t in rows)
    slower = dict(variants, **{"ours-trainer-graphs": {"seq_per_s": 1400.0, "mfu": 0.35, "step_s": 0.0457}})
    rows = acceptance.targets(H200_ENV, [dict(run, variants=slower)], None)
    assert [v for t, _, v in rows if "with CUDA graphs" in t] == ["not faster"]
    assert [v for t, _, v in acceptance.targets(CPU_ENV, [run], None) if "with CUDA graphs" in t] == [
        "n/a (CPU: no GPU claim)"]


def test_the_kernels_budget_travels_from_bertdist_bench_to_each_throughput_run(acceptance, monkeypatch):
    """`bertdist bench --kernels-budget-s N` -> acceptance's option -> train_throughput's, per configuration."""
    import argparse

    from bertdist.cli import bench

    seen = []
    monkeypatch.setattr(bench, "acceptance_module",
                        lambda: argparse.Namespace(main=lambda argv: seen.append(argv) or {"exit_status": 0}))
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    assert bench.run(parser.parse_args(["bench", "--kernels-budget-s", "60"])) == 0
    args = acceptance.parse_args(seen[0])
    assert args.kernels_budget_s == "60"
    extra = acceptance.throughput_extra(args, "large", 128)
    assert extra[extra.index("--kernels-budget-s") + 1] == "60"
    assert "--kernels-budget-s" not in acceptance.throughput_extra(acceptance.parse_args([]), "large", 128)
    with pytest.raises(SystemExit):
        acceptance.parse_args(["--kernels-budget-s", "-5"])
