"""`bertdist bench` on CPU: the quick variant of the GPU acceptance runs end to end and writes its report."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # the whole quick acceptance in a subprocess: about 15 s
def test_bench_quick_cpu_variant_writes_the_report(repo_root, sample_records, tmp_path):
    cmd = [sys.executable, "-m", "bertdist.cli.main", "bench", "--out", str(tmp_path),
           "--lengths-from", str(sample_records), "--steps", "1"]
    r = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "BERTDIST_CACHE_DIR": str(tmp_path / "user_cache")})
    assert r.returncode == 0, r.stderr[-3000:]
    (md,) = tmp_path.glob("acceptance_*.md")
    (js,) = tmp_path.glob("acceptance_*.json")
    text, rep = md.read_text(), json.loads(js.read_text())
    env = rep["environment"]
    assert env["device_type"] == "cpu" and env["date"] and env["torch"] and "git" in env["bertdist"]
    assert "bench" in rep["command"] and "quick CPU variant" in text
    # GPU tests: run, and skipped without CUDA (pytest's own summary)
    assert rep["tests"]["returncode"] == 0 and "skipped" in rep["tests"]["summary"]
    # kernel benchmark, with varlen_attn reported as not applicable on CPU
    assert any(row["impl"] == "varlen_attn" and "n/a" in row.get("note", "") for row in rep["kernels"]["rows"])
    # the measured choice, exercised with the C++ CPU kernels as candidates
    (dec,) = rep["decisions"]
    assert dec["preset"] == "mini" and "CHOSEN" in dec["table"] and "fused" in dec["table"]
    assert rep["auto_vs_reference"] and all(d["choice_ms"] <= d["torch_ms"] for d in rep["auto_vs_reference"])
    # training throughput side by side, lengths from the real shards, ratios to HF
    (run,) = rep["throughput"]
    assert set(run["variants"]) == {"ours-optimized", "ours-reference", "hf-sdpa"} and not run["skipped"]
    assert str(sample_records) in run["lengths"]["source"]
    for v in run["variants"].values():
        assert v["seq_per_s"] > 0 and v["real_tokens_per_s"] > 0 and 0 < v["mfu"] < 1 and v["peak_mem_bytes"] > 0
    assert "| mini b2 s64 | fp32 | hf-sdpa |" in text and "1.00x" in text
    verdicts = dict((t[0], t[2]) for t in rep["targets"])
    assert verdicts["kernels: auto never slower than reference, per op (measured in the same run)"] == "met"
    assert any(v.startswith("n/a") for v in verdicts.values())  # no GPU claim from a CPU run
    assert not (tmp_path / "user_cache").exists()  # the bench measured into its own cache, not the user's
