"""benchmarks/int8.py: its verdicts against the targets, and batch-by-batch turns (no model is run)."""
import pytest


@pytest.fixture(scope="module")
def int8(load_benchmark):
    return load_benchmark("int8")


def _timing(acc: float, ratio: float) -> dict:
    return {"torch_eager_fp32": {"dev_accuracy": 0.7351, "b32_vs_torch_eager": 1.0},
            "onnx_int8_per-channel": {"dev_accuracy": acc, "b32_vs_torch_eager": ratio}}


def test_verdicts_say_met_or_not(int8):
    met = int8.verdicts({"timing": _timing(0.7339, 2.4)}, "per-channel")
    assert met == ["default mode (per-channel): dev accuracy drop +0.12 points (target <= 0.5: met)",
                   "default mode (per-channel): 2.40x PyTorch eager fp32 at batch 32 (target >= 2.0: met)"]
    missed = int8.verdicts({"timing": _timing(0.7236, 1.9)}, "per-channel")
    assert "+1.15 points (target <= 0.5: NOT met)" in missed[0] and "1.90x" in missed[1] and "NOT met" in missed[1]
    assert "refused" in int8.verdicts({"timing": {"torch_eager_fp32": {}}}, "per-channel")[0]


def test_variants_take_turns_batch_by_batch(int8):
    calls = []
    runners = {v: (lambda name: lambda b: calls.append((name, b)) or b)(v) for v in ("a", "b", "c")}
    secs, outs = int8.interleaved(runners, ["a", "b", "c"], [0, 1, 2], rnd=1)
    assert calls == [("b", 0), ("c", 0), ("a", 0), ("c", 1), ("a", 1), ("b", 1), ("a", 2), ("b", 2), ("c", 2)]
    assert outs == {"a": [0, 1, 2], "b": [0, 1, 2], "c": [0, 1, 2]} and set(secs) == {"a", "b", "c"}
