"""benchmarks/serving.py: the model-alone ceiling beside the load test, and its verdict (a tiny
exported model; no server is started)."""
import argparse

import pytest

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def serving(load_benchmark):
    return load_benchmark("serving")


def _load(batching: bool, rps: float) -> dict:
    return {"batching": batching, "clients": 32, "throughput_rps": rps, "p50_ms": 20.0, "p99_ms": 40.0,
            "rounds_rps": [rps], "answered": 100, "wrong": 0, "shed": 0, "errors": 0, "lost": 0}


def test_the_batching_verdict_gives_the_model_alone_ceiling(serving):
    load = [_load(True, 1000.0), _load(False, 500.0)]
    alone = {"b1_seq_per_s": 1000.0, "b32_sorted_seq_per_s": 1400.0, "rounds": [{"b1_seq_per_s": 1000.0,
                                                                               "b32_sorted_seq_per_s": 1400.0}]}
    line = serving.verdicts({}, load, alone)[0]
    assert line.startswith("32 clients: batching 2.00x the throughput without (target >= 3.0: NOT met)")
    assert "batch 32 sorted by length runs 2.80x the unbatched server's throughput (1.40x its own batch-1 rate)" in line
    assert "sorted by length" not in serving.verdicts({}, load)[0]  # no ceiling measured: no clause


def test_the_model_alone_is_timed_on_the_served_file(serving, tmp_path, small_vocab):
    from bertdist.serve.onnx_export import ExportOptions, export_onnx
    from tests.serve.conftest import make_hf_dir

    onnx_dir = tmp_path / "onnx"
    export_onnx(make_hf_dir(tmp_path / "hf", "classification", small_vocab), onnx_dir, ExportOptions(),
                log=lambda *_: None)
    args = argparse.Namespace(serve_variant="fp32", threads=2, load_rounds=1, load_seconds=1.0)
    texts = ["a short one", "a somewhat longer sentence than the first one is"] * 40
    alone = serving.model_alone(onnx_dir, texts, args)
    ways = ("spin", "sleep", "per_core")
    assert set(alone) == {f"{b}_{k}" for b in ("b1", "b32_sorted") for k in ("seq_per_s",) + ways}
    assert min(alone.values()) > 0
    for b in ("b1", "b32_sorted"):  # the ceiling is the fastest way to use the cores
        assert alone[f"{b}_seq_per_s"] == max(alone[f"{b}_{w}"] for w in ways)
    (onnx_dir / "model.onnx").unlink()
    with pytest.raises(Exception, match="model.onnx"):  # the served variant's own file, nothing else
        serving.model_alone(onnx_dir, texts, args)


def test_the_served_share_and_the_hostile_ratio_are_judged(serving):
    load = [_load(True, 980.0), _load(False, 500.0)]
    alone = {"b1_seq_per_s": 1000.0, "b32_sorted_seq_per_s": 1400.0, "rounds": []}
    hostile = {"with": {"p99_ms": 90.0}, "without": {"p99_ms": 40.0}, "ratio": 2.25}
    lines = serving.verdicts({}, load, alone, hostile)
    assert "the batching server answers 70% of the model's own batch-32 length-sorted rate (target >= 70%: met)" in \
        lines[1]
    assert lines[2] == ("16 clients' p99 beside a client sending maximum-size bodies: 90.0 ms, 2.25x their p99 "
                        "without it (40.0 ms; target <= 2.0x: NOT met)")


def test_the_hostile_bodies_are_as_large_as_the_server_takes():
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("serving_load", Path(__file__).resolve().parents[2] /
                                                  "benchmarks" / "serving_load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bodies = mod.hostile_bodies(["a few words of text", "and some more here"])
    assert all(0.95 * (1 << 20) < len(b) <= 1 << 20 for b in bodies), [len(b) for b in bodies]
    assert [len(x["inputs"]) if isinstance(x["inputs"], list) else 1 for x in map(json.loads, bodies)] == [1, 256, 1000]


@pytest.mark.slow
def test_the_load_client_counts_answers_and_wrong_labels_against_a_real_server(tmp_path, small_vocab):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from bertdist.serve.onnx_export import ExportOptions, export_onnx
    from bertdist.serve.runtime import load_served_model
    from tests.serve.conftest import make_hf_dir
    from tests.serve.test_server import CliServer

    model_dir = tmp_path / "onnx"
    export_onnx(make_hf_dir(tmp_path / "hf", "classification", small_vocab), model_dir, ExportOptions(),
                log=lambda *_: None)
    m = load_served_model(model_dir)
    texts = ["a gripping film", "dull and far too long", "fine", "the best thing I have seen this year"]
    labels = []
    for t in texts:
        job = m.prepare("predict", {"inputs": t})
        labels.append(job.finish(m.run(job.items))[0]["label"])
    server = CliServer(str(model_dir), "--workers", "2")
    try:
        rows = []
        for expected in (labels, ["no such label"] * len(labels)):
            exp = tmp_path / "expected.json"
            exp.write_text(json.dumps({"texts": texts, "labels": expected}))
            out = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks" /
                                                      "serving_load.py"), "--port", str(server.port), "--clients", "4",
                                  "--seconds", "1.5", "--expected", str(exp)],
                                 capture_output=True, text=True, check=True, timeout=60)
            rows.append(json.loads(out.stdout))
    finally:
        assert server.stop() == 0
    right, wrong = rows
    for row in rows:
        assert row["answered"] > 20 and row["errors"] == 0 and row["lost"] == 0 and row["shed"] == 0, row
        assert row["p50_ms"] <= row["p99_ms"] and row["throughput_rps"] > 0
    assert right["wrong"] == 0 and wrong["wrong"] == wrong["answered"]
