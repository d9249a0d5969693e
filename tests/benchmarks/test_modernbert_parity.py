"""benchmarks/modernbert_parity.py at a tiny scale: our trainer and transformers' ModernBertForMaskedLM
in a plain loop start from the same weights, take the same batches, and stay together step by step
(fp32: only rounding separates them); the report and the verdict."""
import copy
import json

import pytest

from tests.train.conftest import train_records  # noqa: F401 - the fixture: seq-64 unmasked records

STEPS = 4


@pytest.fixture(scope="module")
def harness(load_benchmark):
    return load_benchmark("modernbert_parity")


@pytest.fixture(scope="module")
def tiny_run(harness, train_records, small_vocab, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("parity")
    rc = harness.main(["--manifest", str(train_records), "--vocab", str(small_vocab), "--seq", "64", "--micro", "8",
                       "--global-batch", "16", "--steps", str(STEPS), "--eval-every", "2", "--eval-sequences", "64",
                       "--seeds", "3", "--timing-rounds", "2", "--timing-steps", "1", "--out", str(out)])
    return rc, out, json.loads((out / "results.json").read_text())


def test_both_paths_agree_step_by_step(tiny_run):
    rc, _, res = tiny_run
    assert rc == 0 and res["met"]
    (seed,) = res["seeds"]
    assert seed["seed"] == 3 and seed["initial_max_abs_weight_diff"] == 0.0  # the same start, exactly
    assert seed["initial_heldout"]["rel_diff"] < 1e-5
    rows = seed["train_steps"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["ours_loss"] == pytest.approx(r["reference_loss"], rel=1e-4), r
        assert r["ours_grad_norm"] == pytest.approx(r["reference_grad_norm"], rel=1e-4), r
        assert r["ours_lr"] == r["reference_lr"], r
    # the recipe's peak, a warmup of 1 step (10% of 4), then linear decay to 0 at the last step
    assert [r["ours_lr"] for r in rows] == pytest.approx([2e-3, 2e-3 * 2 / 3, 2e-3 / 3, 0.0], abs=1e-12)
    assert rows[-1]["ours_loss"] < rows[0]["ours_loss"] - 0.05  # it learns (8.0 at the start)
    curve = seed["heldout_curve"]
    assert [c["step"] for c in curve] == [0, 2, 4]
    assert all(c["rel_diff"] < 1e-4 for c in curve), curve
    assert curve[-1]["ours"] < curve[0]["ours"]
    # gradient accumulation: two micro-batches of 8 per step of 16 sequences, the same held-out set for both
    assert seed["heldout_sequences"] == 64 and seed["heldout_masked_tokens"] > 0


def test_timing_and_report(tiny_run):
    _, out, res = tiny_run
    t = res["seeds"][0]["timing"]
    assert t["timed_steps_per_arm"] == 1 and len(t["raw_rounds"]) == 2 and t["micro_batches_per_step"] == 2
    for arm in ("ours", "hf-padded", "hf-packed-sparse"):
        assert t["median_ms"][arm] > 0 and all(len(r["ms"][arm]) == 1 for r in t["raw_rounds"])
    assert t["raw_rounds"][0]["order"] != t["raw_rounds"][1]["order"]  # the order rotates
    assert t["ratio_over_ours"]["ours"] == 1.0
    # the packed, sparse transformers arm computes the loss the other two do on the same batch and weights
    assert t["first_step_rel_spread"] < 1e-5 and len(set(t["first_step_losses"])) == 3
    report = (out / "report.md").read_text()
    assert "**Met**" in report and "| hf-packed-sparse |" in report and "--steps 4" in report
    env = (out / "env.txt").read_text()
    assert "torch" in env and "transformers" in env and "load average" in env


def test_verdict_fails_a_seed_over_the_tolerance(harness, tiny_run, tmp_path):
    _, _, res = tiny_run
    ok, lines = harness.verdict(res["seeds"], 0.03)
    assert ok and "within 3%" in lines[0]
    far = copy.deepcopy(res)
    f = far["seeds"][0]["final_heldout"]
    f["ours"] = f["reference"] * 1.031
    f["rel_diff"] = harness.rel(f["ours"], f["reference"])
    ok, lines = harness.verdict(far["seeds"], 0.03)
    assert not ok and "NOT within 3%" in lines[0]
    f["ours"], f["rel_diff"] = f["reference"] * 0.971, 0.029
    assert harness.verdict(far["seeds"], 0.03)[0]
    f["ours"], f["rel_diff"] = float("nan"), float("nan")
    assert not harness.verdict(far["seeds"], 0.03)[0]
    far["met"] = False
    (tmp_path / "results.json").write_text(json.dumps(far))
    assert harness.main(["--render", str(tmp_path)]) == 1
    assert "**NOT met**" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("decay, fraction, shape", [("linear", None, "linear"), ("wsd", 0.25, "1-sqrt"),
                                                     ("wsd", 0.3, "linear"), ("wsd", 0.0, "linear")])
def test_the_reference_schedule_written_out_agrees_with_the_trainers(harness, decay, fraction, shape):
    """The reference loop's multiplier is written independently of bertdist's; both give the same lr
    for every update, for the linear decay the benchmark runs and the recipe's warmup-stable-decay."""
    from bertdist.train.optim import WarmupDecay

    total, warmup = 20, 3
    ours = WarmupDecay(warmup, total, decay, 0.5, 0.0,
                       (max(1, round(fraction * total)) if fraction else 0) if decay == "wsd" else 0, shape)
    ref = harness.lr_multiplier(warmup, total, fraction, shape)
    assert [ref(k) for k in range(total)] == pytest.approx([ours(k) for k in range(total)], abs=1e-12)
