"""`bertdist pretrain RECIPE --plan`: every shipped recipe at world sizes 1, 8 and 64 on a CUDA
device profile, without a GPU, a process group or data."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bertdist.cli.main import main
from bertdist.config import load_yaml

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs" / "pretrain").glob("*.yaml"))


def _plan(capsys, *args: str) -> tuple[int, dict | None, str]:
    rc = main(["pretrain", *args, "--plan", "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else None), out.err


@pytest.mark.parametrize("world", [1, 8, 64])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_plan_of_every_recipe(recipe, world, capsys):
    raw = load_yaml(recipe)
    micro, glob = raw["data"]["micro_batch_size"], raw["data"]["global_batch_size"]
    rc, plan, err = _plan(capsys, str(recipe), "--world-size", str(world), "--device-profile", "h100")
    if glob % (micro * world):
        # A world size that does not divide the global batch: a config error naming every number.
        assert rc == 2 and plan is None
        for n in (glob, micro, world, micro * world):
            assert str(n) in err, (n, err)
        return
    assert rc == 0, err
    b, ds, prec = plan["batch"], plan["ds_config"], plan["precision"]
    assert b["grad_accum"] == glob // (micro * world) and b["micro"] * b["grad_accum"] * world == glob
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == \
        (glob, micro, b["grad_accum"])
    assert ds["zero_optimization"]["stage"] == raw["deepspeed"]["zero_stage"]
    assert plan["recipe_config"]["optimizer"]["name"] == raw["optimizer"]["name"] == plan["optimizer"]["name"]
    assert plan["optimizer"]["implementation"] and plan["optimizer"]["why"]
    if raw["deepspeed"]["precision"] in ("bf16", "fp32"):
        # fp32 weights, gradients accumulated and all-reduced in fp32, in the policy and in the JSON
        assert (prec["weights"], prec["grad_accumulation"], prec["communication"]) == ("fp32", "fp32", "fp32")
        assert ds["communication_data_type"] == "fp32" and not ds["bf16"]["enabled"]
    if raw["deepspeed"]["precision"] == "bf16":
        assert prec["compute"] == "bf16" and ds["torch_autocast"]["dtype"] == "bfloat16"
    k = plan["kernels"]
    if raw["model"].get("attention_backend") == "auto":  # ModernBERT: a global and a local layer, gated and timed
        assert k["decides"] and [c["op"] for c in k["cases"]] == ["varlen_window_attention"] * 2
        for c in k["cases"]:
            names = [x["name"] for x in c["candidates"] if x["unsupported"] is None]
            assert names[0] == "reference" and "sdpa" in names, c
    elif raw["model"].get("kernels") == "auto":
        # CUDA profile: every case the run will call, each with the baseline among its runnable candidates
        ops = {c["op"] for c in k["cases"]}
        assert k["decides"] and {"layer_norm", "bias_dropout_add_layer_norm"} <= ops
        assert ("varlen_attention" if raw["model"].get("unpad") else "attention") in ops
        for c in k["cases"]:
            names = [x["name"] for x in c["candidates"] if x["unsupported"] is None]
            assert names[0] == "torch" and len(names) >= 2, c
    else:
        assert not k["decides"] and k["cases"] == []
    m = plan["memory"]
    # the smallest recipe, electra-tiny (64-wide embeddings shared by its two towers), has 2.47 M
    assert m["parameters"] > 2_000_000 and m["weights"] == m["parameters"] * 4
    assert 0 < m["activations_checkpointed"] < m["activations"]
    assert m["total"] > m["total_checkpointed"] > m["weights"] + m["gradients"] + m["optimizer_state"]
    assert 0 < m["total_gib"] < plan["device_profile"]["memory_gib"], m  # every recipe fits its 80 GB target


def test_plan_of_the_large_recipe_on_eight_h100(tmp_path):
    """The command a cluster user runs before submitting, in its own process."""
    cmd = [sys.executable, "-m", "bertdist.cli.main", "pretrain", "configs/pretrain/bert-large-phase1.yaml", "--plan",
           "--world-size", "8", "--device-profile", "h100", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout)
    assert plan["precision"]["grad_accumulation"] == "fp32" and plan["precision"]["communication"] == "fp32"
    assert plan["optimizer"]["name"] == "lamb" and plan["optimizer"]["implementation"].endswith("FusedLamb")
    assert plan["batch"]["grad_accum"] == 128 and plan["ds_config"]["gradient_accumulation_steps"] == 128
    assert plan["memory"]["total"] > 0 and plan["memory"]["parameters"] == 336_226_108


def test_plan_text_and_bad_arguments(capsys):
    recipe = str(REPO / "configs" / "pretrain" / "bert-base-phase1.yaml")
    assert main(["pretrain", recipe, "--plan", "--world-size", "8", "--device-profile", "a100"]) == 0
    out = capsys.readouterr().out
    for text in ("global 65536 = micro 256 x accumulation 32 x world 8", "gradient accumulation fp32",
                 "communication fp32", "memory per GPU", "with activation checkpointing", '"torch_autocast"'):
        assert text in out, text
    assert main(["pretrain", recipe, "--plan", "--device-profile", "v100"]) == 2
    assert "h100" in capsys.readouterr().err
    assert main(["pretrain", recipe, "--plan", "--world-size", "0"]) == 2
    assert main(["pretrain", recipe, "data.global_batch_size=1000", "--plan", "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "1000" in err and "768" in err and "256" in err  # micro 256 x world 3
