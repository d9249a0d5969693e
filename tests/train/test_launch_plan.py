"""What `bertdist pretrain --plan` decides for a named device: the optimizer and its reason, the
kernel cases (bertdist/train/launch_plan.py; the CLI and every recipe: tests/cli/test_pretrain.py)."""
from __future__ import annotations

from pathlib import Path

from bertdist.device_profile import by_name
from bertdist.train.config import load_train_config
from bertdist.train.launch_plan import kernel_cases, launch_plan, optimizer_choice

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
    unpadded = load_train_config(LARGE, ["model.unpad=true"])
    assert "varlen_attention" in {c["op"] for c in kernel_cases(unpadded, by_name("h100"))["cases"]}


def test_plan_uses_the_vocab_files_size_or_says_where_it_came_from(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *[f"w{i}" for i in range(95)]]) + "\n")
    plan = launch_plan(load_train_config(LARGE, [f"data.vocab_file={vocab}"]), 8, by_name("h100"))
    assert plan["vocab_size"]["value"] == 100 and plan["recipe_config"]["model"]["vocab_size"] == 100
    missing = launch_plan(load_train_config(LARGE, [f"data.vocab_file={tmp_path / 'none.txt'}"]), 8, by_name("h100"))
    assert missing["vocab_size"]["value"] == 30522 and "not found" in missing["vocab_size"]["source"]
