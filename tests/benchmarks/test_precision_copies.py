"""benchmarks/precision_copies.py on the tiny model: the step it counts runs in each mode, and bf16
weights cast far less than autocast over fp32 weights (the figure the benchmark reports)."""
import pytest


@pytest.fixture(scope="module")
def precision_copies(load_benchmark):
    return load_benchmark("precision_copies")


def test_bf16_weights_cast_less_than_autocast(precision_copies):
    assert precision_copies.MODES == ("fp32", "autocast", "bf16_weights")
    rows = {m: precision_copies.count(m, "tiny", "fused", "cpu", batch=2, seq=32, accum=2)
            for m in ("autocast", "bf16_weights")}
    casts = {m: r["aten::_to_copy"] for m, r in rows.items()}
    # autocast casts every weight each forward and its gradient back; bf16 weights cast none of them
    assert casts["autocast"] > 4 * casts["bf16_weights"], casts
    assert rows["bf16_weights"]["aten::copy_"] < rows["autocast"]["aten::copy_"], rows
