"""benchmarks/train_throughput.py on CPU: tiny preset, one timed step, the cheap variants."""
import json
import math

import numpy as np
import pytest
import torch

from bertdist.data import open_records


@pytest.fixture(scope="module")
def harness(load_benchmark):
    return load_benchmark("train_throughput")


def test_lengths_come_from_the_shards(harness, sample_records):
    lengths, msl = harness.lengths_from_manifest(sample_records)
    recs = open_records(sample_records)
    expect = [len(x) for i in range(len(recs.shards)) for x in recs.read_shard(i).column("input_ids").to_pylist()]
    assert msl == 64 and sorted(lengths.tolist()) == sorted(expect)
    rng = np.random.default_rng(0)
    wide = harness.sample_lengths(lengths, msl, (4, 8), 128, rng)  # rescaled to a wider benchmark
    assert wide.max() <= 128 and wide.min() >= 2 and wide.mean() > lengths.mean()


def test_synthetic_lengths_and_batches(harness):
    rng = np.random.default_rng(0)
    lengths = harness.synthetic_lengths(4000, 128, rng)
    assert lengths.min() >= 8 and lengths.max() == 128
    assert 0.8 < (lengths == 128).mean() < 0.9 and 110 < lengths.mean() < 128
    b = harness.make_batch(np.array([128, 40, 2]), 128, 30522, 20, rng)
    t = b.tensors
    assert t["attention_mask"].sum(1).tolist() == [128, 40, 2] and b.real_tokens == 170
    predicted = (t["labels"] != -100).sum(1).tolist()
    assert predicted == b.predicted.tolist() == [19, 6, 1]  # BERT's round(0.15 * len), at least 1, never [CLS]
    assert not (t["labels"][:, 0] != -100).any() and not ((t["labels"] != -100) & (t["attention_mask"] == 0)).any()
    assert (t["token_type_ids"] * (1 - t["attention_mask"])).sum() == 0


def test_encoder_runs_on_real_tokens_only_when_unpadded(harness):
    from bertdist.model import BertConfig

    cfg = BertConfig.from_preset("tiny", vocab_size=500)
    b = harness.make_batch(np.array([64, 30, 5]), 64, cfg.vocab_size, 10, np.random.default_rng(1))
    rows = {}
    for name in ("ours-optimized", "ours-reference", "hf-sdpa"):
        _, raw, info = harness.build_variant(name, cfg, torch.device("cpu"), False)
        rows[name] = harness.encoder_rows(raw, b.tensors, cfg.hidden_size)
    assert rows == {"ours-optimized": 99, "ours-reference": 192, "hf-sdpa": 192}


@pytest.mark.slow  # trains every variant: about 20 s
def test_harness_cpu_tiny(harness, sample_records, tmp_path):
    out = tmp_path / "tt.json"
    md = tmp_path / "tt.md"
    res = harness.main(["--preset", "tiny", "--batch", "8", "--seq", "64", "--steps", "1", "--warmup", "1",
                        "--num-batches", "2", "--lengths-from", str(sample_records), "--loss-curve", "2",
                        "--json", str(out), "--markdown", str(md)])
    data = json.loads(out.read_text())
    assert data["variants"].keys() == {"ours-optimized", "ours-reference", "hf-sdpa"} and not data["skipped"]
    for key in ("device", "device_type", "date", "command", "torch", "transformers", "peak_flops", "peak_note",
                "precision", "lengths"):
        assert data[key], key
    assert data["device_type"] == "cpu" and data["isolated_processes"] and "--lengths-from" in data["command"]
    assert "estimate" in data["peak_note"]
    real = {r["real_tokens"] for r in data["variants"].values()}
    assert len(real) == 1, "every variant (each in its own process) must time the same batches"
    for name, r in data["variants"].items():
        assert r["seq_per_s"] > 0 and r["real_tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0, name
        assert r["real_tokens"] <= r["padded_tokens"] == r["sequences"] * 64
        assert 0 < r["mfu"] < 1 and math.isfinite(r["final_loss"])
        check = r["encoder_rows_check"]
        assert check["encoder_rows"] == (check["real_tokens"] if name == "ours-optimized" else check["padded_tokens"])
    opt, ref, hf = (data["variants"][k] for k in ("ours-optimized", "ours-reference", "hf-sdpa"))
    assert opt["unpad"] and not ref["unpad"] and set(ref["kernels"].values()) == {"reference"}
    assert hf["vs_hf_sdpa"]["seq_per_s"] == 1.0
    assert opt["vs_hf_sdpa"]["seq_per_s"] == pytest.approx(opt["seq_per_s"] / hf["seq_per_s"])
    lc = data["loss_curve"]
    assert [len(lc["curves"][k]["loss"]) for k in ("ours-optimized", "ours-reference")] == [2, 2]
    assert all(math.isfinite(x) for k in lc["curves"] for x in lc["curves"][k]["loss"])
    assert (tmp_path / "tt_loss_curve.png").stat().st_size > 1000
    assert "| ours-optimized |" in md.read_text() and res["markdown"] == md.read_text()


def test_interleaved_rounds_rotate_and_time_the_same_batches(harness, sample_records, tmp_path):
    """--interleave: every variant in this one process, timed in rounds whose order rotates; each
    round runs the same batches for every variant, and a variant's figure is its median round."""
    out = tmp_path / "tt.json"
    harness.main(["--preset", "tiny", "--batch", "4", "--seq", "64", "--steps", "4", "--warmup", "1",
                  "--num-batches", "2", "--lengths-from", str(sample_records), "--variants",
                  "ours-optimized,hf-sdpa", "--interleave", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["interleaved"] == {"rounds": 2} and not data["isolated_processes"]
    assert data["variants"].keys() == {"ours-optimized", "hf-sdpa"} and not data["skipped"]
    for name, r in data["variants"].items():
        assert r["interleaved"] == {"rounds": 2, "steps_per_round": 2}, name
        assert len(r["round_seq_per_s"]) == 2 and r["seq_per_s"] > 0, name
        assert min(r["round_seq_per_s"]) <= r["seq_per_s"] * (1 + 1e-9)
        assert r["seq_per_s"] <= max(r["round_seq_per_s"]) * (1 + 1e-9)
        assert r["peak_mem_bytes"] is None and "not separable" in r["peak_mem_kind"]  # one process on CPU
    assert len({r["real_tokens"] for r in data["variants"].values()}) == 1
    assert data["variants"]["ours-optimized"]["vs_hf_sdpa"]["seq_per_s"] > 0


def test_a_failing_variant_does_not_stop_the_interleaved_others(harness, sample_records, monkeypatch, tmp_path):
    real_build = harness.build_variant

    def build(name, *a, **k):
        if name == "hf-sdpa":
            raise RuntimeError("no such model")
        return real_build(name, *a, **k)

    monkeypatch.setattr(harness, "build_variant", build)
    res = harness.main(["--preset", "tiny", "--batch", "2", "--seq", "64", "--steps", "2", "--warmup", "1",
                        "--num-batches", "1", "--lengths-from", str(sample_records), "--variants",
                        "ours-optimized,hf-sdpa", "--interleave", "2", "--keep-going"])
    assert set(res["variants"]) == {"ours-optimized"}
    assert res["failed"] == {"hf-sdpa": "RuntimeError: no such model"}


def test_the_graphs_variant_measures_cuda_graphs_and_is_a_skip_off_cuda(harness, sample_records):
    """ours-trainer-graphs: ours-trainer with model.cuda_graphs=true, the measurement that
    model.cuda_graphs: auto waits for; on CPU a skip with the reason, interleaved or not."""
    from bertdist.device_profile import by_name
    from bertdist.train.compile import decide_compile
    from bertdist.train.cuda_graphs import BENCH_VARIANT, decide_cuda_graphs
    from bertdist.train.config import load_train_config

    assert BENCH_VARIANT in harness.VARIANTS
    base, graphs = (set(harness.TRAINER_VARIANTS[n]) for n in ("ours-trainer", BENCH_VARIANT))
    assert graphs - base == {"model.cuda_graphs=true"}  # the same step otherwise
    tc = load_train_config(str(harness.TRAINER_RECIPE), list(harness.TRAINER_VARIANTS[BENCH_VARIANT]))
    h100 = by_name("h100").type
    assert decide_cuda_graphs(tc.model.cuda_graphs, h100, decide_compile(tc.model.compile, h100)).enabled
    why = "CUDA graphs need a CUDA device (model.cuda_graphs=true)"
    assert harness.measure(BENCH_VARIANT, None, None, None, torch.device("cpu"), "fp32", 1, 1, None, 0.0) == \
        {"skipped": why}
    res = harness.main(["--preset", "tiny", "--batch", "2", "--seq", "64", "--steps", "2", "--warmup", "1",
                        "--num-batches", "1", "--lengths-from", str(sample_records), "--variants",
                        f"ours-optimized,{BENCH_VARIANT}", "--interleave", "2"])
    assert set(res["variants"]) == {"ours-optimized"} and res["skipped"] == {BENCH_VARIANT: why}


@pytest.mark.slow  # builds two DeepSpeed engines and compiles the tiny model with inductor (about a minute)
def test_the_trainers_own_step_runs_beside_hf_with_profiles_and_a_compile_cache(harness, sample_records, tmp_path):
    """ours-trainer*: the trainer's step (bertdist.train.step.launch_step on the engine a run builds
    from the recipe) in the same process and on the same batches as HF's; the GPU window's command
    runs these options."""
    out, cache = tmp_path / "tt.json", tmp_path / "cache" / "compile.bin"
    harness.main(["--preset", "tiny", "--batch", "4", "--seq", "64", "--steps", "4", "--warmup", "2",
                  "--num-batches", "2", "--lengths-from", str(sample_records), "--variants",
                  "ours-trainer-flat,ours-trainer-eager,hf-sdpa", "--interleave", "2", "--profile-steps", "1",
                  "--compile-cache", str(cache), "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["variants"].keys() == {"ours-trainer-flat", "ours-trainer-eager", "hf-sdpa"} and not data["skipped"]
    flat, eager = data["variants"]["ours-trainer-flat"], data["variants"]["ours-trainer-eager"]
    for r in (flat, eager):
        assert r["impl"] == "bertdist pretrain step" and r["recipe"] == "bert-large-phase1.yaml"
        assert r["optimizer_name"] == "lamb" and r["gradient_clipping"] == 1.0 and r["settle_every"] == 10
        assert r["seq_per_s"] > 0 and math.isfinite(r["final_loss"])
    assert flat["optimizer"] == "FlatLamb" and flat["optimizer_kernels"] in ("fused", "reference")
    assert flat["compile"] is True and flat["compiled_regions"] == 4  # 2 layers, embeddings, MLM head
    assert eager["compile"] is False and eager["compiled_regions"] == 0 and eager["optimizer"] == "Lamb"
    assert len({r["real_tokens"] for r in data["variants"].values()}) == 1  # the same batches
    assert set(data["profiles"]) == set(data["variants"])
    assert all(p["steps"] == 1 and p["wall_ms_per_step"] > 0 and p["aten_calls_per_step"] > 0
               for p in data["profiles"].values())
    saved = data["compile_cache"]["saved"]
    assert saved["bytes"] == cache.stat().st_size > 0
    assert "Profiled steps" in data["markdown"] and "one host sync every 10 steps" in data["markdown"]


def test_the_kernels_budget_option_reaches_ours_and_the_trainer_variants(harness):
    """--kernels-budget-s: the config's default, 'none' for no limit, and the trainer variants'
    model.kernels_budget_s override."""
    from bertdist.model import BertConfig

    assert harness.parse_args([]).kernels_budget_s == BertConfig().kernels_budget_s
    assert harness.parse_args(["--kernels-budget-s", "none"]).kernels_budget_s is None
    with pytest.raises(SystemExit):
        harness.parse_args(["--kernels-budget-s", "-1"])
    for given in (60.0, None):
        cfg = BertConfig.from_preset("tiny", kernels_budget_s=given)
        tc = harness.trainer_config("ours-trainer", cfg, harness.TRAINER_RECIPE, 2, 64, "fp32")
        assert tc.model.kernels_budget_s == given
