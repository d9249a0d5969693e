"""What `bertdist pretrain --plan` decides for a named device: the optimizer and its reason, the
kernel cases (bertdist/train/launch_plan.py; the CLI and every recipe: tests/cli/test_pretrain.py)."""
from __future__ import annotations

from pathlib import Path

from bertdist.device_profile import by_name
from bertdist.train.config import load_train_config
from bertdist.train.launch_plan import format_launch_plan, kernel_cases, launch_plan, optimizer_choice

REPO = Path(__file__).resolve().parents[2]
LARGE = REPO / "configs" / "pretrain" / "bert-large-phase1.yaml"


def test_optimizer_choice_per_profile():
    lamb = load_train_config(LARGE)
    h100 = by_name("h100")
    assert optimizer_choice(lamb, h100)["implementation"] == "deepspeed.ops.lamb.FusedLamb"
    mismatch = optimizer_choice(lamb, h100.with_(toolkit="12.4"))  # DeepSpeed's JIT build refuses the pair
    assert mismatch["implementation"] == "bertdist.train.lamb.Lamb"
    assert "12.4" in mismatch["why"] and "13.0" in mismatch["why"]
    assert "no CUDA toolkit" in optimizer_choice(lamb, h100.with_(toolkit=None))["why"]
    assert optimizer_choice(lamb, by_name("cpu"))["implementation"] == "bertdist.train.lamb.Lamb"
    adamw = load_train_config(LARGE, ["optimizer.name=adamw"])
    assert optimizer_choice(adamw, h100)["implementation"] == "torch.optim.AdamW(fused=True)"
    assert optimizer_choice(adamw, by_name("cpu"))["implementation"] == "torch.optim.AdamW"
    torch_impl = load_train_config(LARGE, ["optimizer.implementation=torch"])
    assert optimizer_choice(torch_impl, h100)["implementation"] == "bertdist.train.lamb.Lamb"


def test_kernel_cases_only_where_auto_decides():
    cfg = load_train_config(LARGE)
    assert kernel_cases(cfg, by_name("cpu"))["cases"] == []
    ref = load_train_config(LARGE, ["model.kernels=reference"])
    assert not kernel_cases(ref, by_name("h100"))["decides"]
    cases = kernel_cases(cfg, by_name("h100"))["cases"]
    # bf16 under autocast: attention in bf16, the layer norms in fp32 (torch's autocast policy)
    assert {(c["op"], c["dtype"]) for c in cases} == {("layer_norm", "float32"),
                                                      ("bias_dropout_add_layer_norm", "float32"),
                                                      ("attention", "bfloat16")}
    assert "at most 300 s (model.kernels_budget_s" in kernel_cases(cfg, by_name("h100"))["why"]
    unlimited = load_train_config(LARGE, ["model.kernels_budget_s=null"])
    assert "no time limit" in kernel_cases(unlimited, by_name("h100"))["why"]
    unpadded = load_train_config(LARGE, ["model.unpad=true"])
    assert "varlen_attention" in {c["op"] for c in kernel_cases(unpadded, by_name("h100"))["cases"]}


def test_plan_uses_the_vocab_files_size_or_says_where_it_came_from(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *[f"w{i}" for i in range(95)]]) + "\n")
    plan = launch_plan(load_train_config(LARGE, [f"data.vocab_file={vocab}"]), 8, by_name("h100"))
    assert plan["vocab_size"]["value"] == 100 and plan["recipe_config"]["model"]["vocab_size"] == 100
    missing = launch_plan(load_train_config(LARGE, [f"data.vocab_file={tmp_path / 'none.txt'}"]), 8, by_name("h100"))
    assert missing["vocab_size"]["value"] == 30522 and "not found" in missing["vocab_size"]["source"]


MODERNBERT = REPO / "configs" / "pretrain" / "modernbert-base.yaml"
MODERNBERT_CTX = REPO / "configs" / "pretrain" / "modernbert-base-ctx8192.yaml"


def test_modernbert_plan_at_8_and_64_ranks():
    """FLOPs per sequence from ModernBERT's own parts (local layers see at most the window), and a
    memory plan with the whole optimizer state on every rank (StableAdamW runs at ZeRO 0)."""
    import pytest

    from bertdist.model.flops import modernbert_forward_flops, window_pairs

    plans = {n: launch_plan(load_train_config(MODERNBERT), n, by_name("h100")) for n in (8, 64)}
    for n, plan in plans.items():
        assert plan["batch"] == {"global": 4608, "micro": 24, "grad_accum": 4608 // (24 * n), "world_size": n}
        assert plan["model"]["type"] == "modernbert" and plan["model"]["max_position_embeddings"] == 1024
        k = plan["kernels"]  # the recipe's attention_backend: auto, on an H100: sdpa and flex both take part
        assert k["mode"] == "attention_backend auto" and k["decides"]
        assert [(c["op"], c["dtype"], c["dropout"], c["shape"]) for c in k["cases"]] == [
            ("varlen_window_attention", "bfloat16", 0.0, f"b4 x s1024, 12 x 64, {w}") for w in ("global", "window +-64")]
        assert [[(x["name"], x["unsupported"]) for x in c["candidates"]] for c in k["cases"]] == \
            [[("reference", None), ("sdpa", None), ("flex", None)]] * 2
    p8, p64 = plans[8], plans[64]
    cfg = load_train_config(MODERNBERT).model  # the recipe's vocab file is absent: the config's 50,368
    f = p8["flops"]["forward"]
    assert f == modernbert_forward_flops(cfg, 1024, 308)
    d, s = 768, 1024
    assert f["global_attention"] == 8 * 2 * 2 * s * s * d  # layers 0, 3, ..., 21: 8 of the 22 are global
    assert f["local_attention"] == 14 * 2 * 2 * window_pairs(s, 64) * d
    assert window_pairs(s, 64) < s * 129  # each query sees at most 129 keys (itself and 64 on each side)
    assert p8["flops"]["train_per_sequence"] == 3 * f["total"] == p64["flops"]["train_per_sequence"]
    m8, m64 = p8["memory"], p64["memory"]
    assert m8["parameters"] == m64["parameters"] == 149_655_232  # ModernBERT-base, its 50,368 tokens
    assert m8["optimizer_state"] == m64["optimizer_state"] == m8["parameters"] * 8  # two fp32 moments, unsplit
    assert m8["weights"] == m64["weights"] == m8["parameters"] * 4
    assert m8["total"] == m64["total"] and m8["activations"] == m64["activations"]
    text = format_launch_plan(p64)
    assert "ModernBERT 22 x 768, context 1024, local window 128" in text and "FLOPs per sequence of 1024" in text
    assert pytest.approx(f["total"] / 1e9, rel=1e-3) == float(text.split("forward ")[1].split(" GFLOP")[0])


def test_modernbert_plan_counts_8192_token_batches():
    """At 8,192 tokens the global layers' attention grows quadratically, the local layers' linearly,
    and the SDPA backend's [b, s, s] masks are in the memory plan."""
    short = launch_plan(load_train_config(MODERNBERT), 8, by_name("h100"))
    plan = launch_plan(load_train_config(MODERNBERT_CTX), 64, by_name("h100"))
    f, f1 = plan["flops"]["forward"], short["flops"]["forward"]
    assert plan["flops"]["seq"] == 8192 and plan["model"]["global_rope_theta"] == 160000.0
    assert f["global_attention"] == f1["global_attention"] * 64  # quadratic: 8x the tokens, 64x the work
    from bertdist.model.flops import window_pairs

    assert f["local_attention"] == 14 * 2 * 2 * window_pairs(8192, 64) * 768
    # linear in the tokens, but for the edges (a query near either end sees fewer keys)
    assert 8 < f["local_attention"] / f1["local_attention"] < 8.3
    assert f["global_attention"] / f["total"] > 4 * f1["global_attention"] / f1["total"]  # its share grows
    m = plan["memory"]
    assert m["attention_probs_per_layer"] == 3 * 8192 * 8192  # one bool mask per layer, micro-batch 3
    flex = launch_plan(load_train_config(MODERNBERT_CTX, ["model.attention_backend=flex"]), 64, by_name("h100"))
    assert flex["memory"]["attention_probs_per_layer"] == 0 and flex["memory"]["total"] < m["total"]
    assert m["total_checkpointed"] < m["total"] < 80 * 2**30  # fits an 80 GB H100 without checkpointing


def test_modernbert_plan_says_what_attention_backend_auto_can_choose_on_cpu():
    tiny = REPO / "configs" / "pretrain" / "modernbert-tiny.yaml"
    k = kernel_cases(load_train_config(tiny), by_name("cpu"))
    assert k["decides"] and [c["shape"] for c in k["cases"]] == ["b4 x s128, 2 x 32, global",
                                                                 "b4 x s128, 2 x 32, window +-16"]
    flex = [x for c in k["cases"] for x in c["candidates"] if x["name"] == "flex"]
    assert len(flex) == 2 and all("no backward on CPU" in x["unsupported"] for x in flex)
    text = format_launch_plan(launch_plan(load_train_config(tiny), 1, by_name("cpu")))
    assert "kernels: attention_backend auto: rank 0 gates each backend" in text
    assert "varlen_window_attention float32 dropout 0 b4 x s128, 2 x 32, window +-16: candidates reference, sdpa; " \
           "cannot run: flex (FlexAttention has no backward on CPU" in text
    fixed = kernel_cases(load_train_config(tiny, ["model.attention_backend=sdpa"]), by_name("cpu"))
    assert (fixed["mode"], fixed["cases"]) == ("none", []) and "runs model.attention_backend sdpa" in fixed["why"]


def test_modernbert_plan_shows_its_layer_split_window_and_packed_token_budget(tmp_path, packed_records,
                                                                              small_bpe_tokenizer):
    """The plan's ModernBERT lines: which layers are global and local with their RoPE θ and window,
    the tokens and predictions of a micro-batch and a step, and the packing of the run's records
    (read from their manifest), or why it is unknown."""
    import json

    tiny = REPO / "configs" / "pretrain" / "modernbert-tiny.yaml"
    over = [f"data.train_manifest={packed_records}", f"data.vocab_file={small_bpe_tokenizer}",
            "data.max_seq_length=1024", "model.max_position_embeddings=1024", "data.max_predictions_per_seq=308",
            "model.global_rope_theta=160000"]
    plan = launch_plan(load_train_config(tiny, over), 2, by_name("h100"))
    lay = plan["model"]["layout"]
    counts = json.loads(packed_records.read_text())["counts"]["packing"]["train"]
    assert lay["global_layers"] == [0] and lay["local_layers"] == [1, 2] and lay["half_window"] == 16
    assert lay["tokens"] == {"row": 1024, "micro_batch": 16 * 1024, "step": 32 * 1024}
    assert lay["predicted"] == {"mask_prob": 0.3, "row": 308, "step": 308 * 32}
    assert lay["records"]["packed"] and lay["records"]["rows"] == counts["rows"] and lay["unpad"]
    text = format_launch_plan(plan)
    assert ("  layers: 1 global (0): RoPE θ 160,000, every token sees its whole document; 2 local (1, 2): RoPE θ "
            "10,000, a token sees itself and 16 tokens each side (local_attention 32)") in text
    assert "  tokens: rows of 1,024; 16,384 a micro-batch, 32,768 a step; MLM at 0.3: up to 308 predicted a row, " \
           "9,856 a step" in text
    assert (f"  records: packed, {counts['documents']:,} documents ({counts['split_documents']:,} cut across rows) in "
            f"{counts['rows']:,} rows, {counts['pieces'] / counts['rows']:.1f} a row, {counts['fill']:.1%} of the rows' "
            "room filled; each document attends within itself; unpadded: padding never reaches the encoder") in text

    base = launch_plan(load_train_config(MODERNBERT), 8, by_name("h100"))["model"]["layout"]
    assert base["global_layers"] == list(range(0, 22, 3)) and len(base["local_layers"]) == 14
    assert not base["records"]["known"] and "not found" in base["records"]["why"]
    unpacked = tmp_path / "manifest.json"
    unpacked.write_text(json.dumps({"records": {"columns": ["input_ids"]}, "counts": {"tokens": 10}}))
    flat = launch_plan(load_train_config(tiny, [*over, f"data.train_manifest={unpacked}", "model.unpad=false"]), 2,
                       by_name("h100"))
    assert "holds one sequence a row, not packed documents" in format_launch_plan(flat)
    assert "padded: the encoder runs the padding too (model.unpad: false)" in format_launch_plan(flat)
    assert "layout" not in launch_plan(load_train_config(LARGE), 8, by_name("h100"))["model"]  # BERT's has none
