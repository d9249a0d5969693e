"""What each precision setting stores, computes, accumulates and communicates: the generated
DeepSpeed config, and DeepSpeed's real engine on 2 CPU ranks accumulating 64 micro-batches."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bertdist.config import ConfigError
from bertdist.train.config import load_train_config
from bertdist.train.ds_config import generate_ds_config
from bertdist.train.precision import PRECISIONS, engine_reports_grad_norm, precision_policy
from tests.conftest import child_env, torchrun
from tests.train.conftest import tiny_cfg

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_bf16_is_autocast_over_fp32_weights_with_fp32_communication(zero_stage):
    cfg = load_train_config(None, ["optimizer.name=adamw", f"deepspeed.zero_stage={zero_stage}",
                                   "deepspeed.precision=bf16", "data.micro_batch_size=8",
                                   "data.global_batch_size=64"])
    ds = generate_ds_config(cfg, world_size=2, grad_accum=4)
    # DeepSpeed's bf16 section would make the parameters, and so the accumulated .grad, bf16.
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert ds["communication_data_type"] == "fp32"
    assert "data_types" not in ds


def test_fp16_keeps_deepspeed_loss_scaling_with_integer_min_scale():
    cfg = load_train_config(None, ["optimizer.name=adamw", "deepspeed.precision=fp16",
                                   "deepspeed.min_loss_scale=2.0"])
    ds = generate_ds_config(cfg, world_size=1, grad_accum=cfg.data.global_batch_size // cfg.data.micro_batch_size)
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0 and "torch_autocast" not in ds
    assert ds["fp16"]["min_loss_scale"] == 2 and isinstance(ds["fp16"]["min_loss_scale"], int)


def test_fp16_on_cpu_is_refused_before_deepspeed_starts():
    """DeepSpeed's CPU accelerator takes fp16 only where oneDNN has fp16 kernels, and otherwise fails
    inside its engine; the trainer refuses first, naming what works on CPU."""
    import torch

    from bertdist.train.trainer import _check_device

    cfg = load_train_config(None, ["optimizer.name=adamw", "deepspeed.precision=fp16"])
    with pytest.raises(ConfigError, match=r"fp16 needs CUDA .*use bf16 or fp32 on CPU"):
        _check_device(cfg, torch.device("cpu"))
    _check_device(load_train_config(None, ["optimizer.name=adamw", "deepspeed.precision=bf16"]), torch.device("cpu"))


@pytest.mark.parametrize("value", ["0.5", "0", "-1"])
def test_min_loss_scale_below_one_or_fractional_is_refused(value):
    with pytest.raises(ConfigError, match="min_loss_scale"):
        load_train_config(None, [f"deepspeed.min_loss_scale={value}"])


def test_policy_table():
    rows = {p: precision_policy(p, "cuda") for p in PRECISIONS}
    assert (rows["bf16"].weights, rows["bf16"].compute, rows["bf16"].grad_accumulation,
            rows["bf16"].communication) == ("fp32", "bf16", "fp32", "fp32")
    assert rows["fp32"].compute == "tf32" and precision_policy("fp32", "cpu").compute == "fp32"
    assert rows["fp16"].grad_accumulation.startswith("fp16") and rows["fp16"].loss_scaling == "dynamic"
    with pytest.raises(ValueError, match="fp8"):
        precision_policy("fp8")
    # Our optimizer sees whole fp32 tensors at ZeRO 0 in fp32 and bf16: the trainer measures the norm.
    assert not engine_reports_grad_norm("bf16", 0) and not engine_reports_grad_norm("fp32", 0)
    assert engine_reports_grad_norm("fp16", 0) and engine_reports_grad_norm("bf16", 1)


def test_tf32_on_cuda_only():
    import torch

    from bertdist.train.engine import use_tf32

    before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        use_tf32("cpu")
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        use_tf32("cuda")
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


@pytest.mark.slow
def test_bf16_accumulates_64_micro_batches_in_fp32_on_two_ranks(tmp_path):
    """The update DeepSpeed applies after 2 ranks x 64 micro-batches in bf16 equals the float64
    mean of the gradients: accumulated, all-reduced and stored in fp32. bf16 accumulation (an
    8-bit significand) would be off by up to about 1e-2 relative. About 40 s on 2 cores."""
    out = tmp_path / "result.json"
    cmd = [*torchrun(2), str(REPO / "tests" / "train" / "precision_accum_run.py"), str(out), "bf16"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=child_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    ref, got = res["reference"], res["update"]
    rel = max(abs(g - e) / abs(e) for g, e in zip(got, ref))
    assert rel <= 1e-7, (f"applied update differs from the fp32-accumulated reference by {rel:.3g} relative "
                         f"(params {res['param_dtype']}, grads {res['last_grad_dtype']}, "
                         f"optimizer {res['optimizer']})")
    assert res["param_dtype"] == "torch.float32" and res["last_grad_dtype"] == "torch.float32"
    # LAMB keeps its per-tensor trust ratio: it is DeepSpeed's optimizer, over the module's own fp32 tensors.
    assert res["lamb_optimizer"] == "Lamb" and res["lamb_params_are_module_tensors"], res
    assert res["lamb_param_dtypes"] == ["torch.float32"] and res["lamb_moved"]


@pytest.mark.slow
def test_bf16_trainer_run_on_two_ranks(tmp_path, train_records, small_vocab):
    """`bertdist pretrain` in bf16 (autocast on CPU) with accumulation: it learns, the trainer reports a
    finite gradient norm for LAMB at ZeRO 0, and the checkpoint says its weights are fp32. About 40 s."""
    from tests.train.conftest import metrics, run_pretrain, tiny_args

    run = tmp_path / "run"
    res = run_pretrain(2, tiny_args(run, train_records, small_vocab, "deepspeed.precision=bf16",
                                    "data.micro_batch_size=8", "data.global_batch_size=32", "schedule.total_steps=12",
                                    "schedule.warmup_steps=2", "checkpoint.every_steps=0", "eval.at_start=false",
                                    "eval.every_steps=0"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    train, run_row = metrics(run), metrics(run, "run")[0]
    assert run_row["grad_accum"] == 2 and len(train) == 12
    assert all(0 < r["grad_norm"] < float("inf") for r in train), [r["grad_norm"] for r in train]
    assert train[-1]["loss"] < train[0]["loss"], [r["loss"] for r in train]
    ds = json.loads((run / "ds_config.json").read_text())
    assert ds["torch_autocast"]["enabled"] and ds["communication_data_type"] == "fp32"
    state = json.loads((run / "checkpoints" / "step_00000012" / "trainer_state.json").read_text())
    assert (state["precision"], state["weights"]) == ("bf16", "fp32")


# ---------------------------------------------------------------- bf16 weights with fp32 masters

FLAT = ("optimizer.implementation=flat", "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0",
        "data.micro_batch_size=8", "data.global_batch_size=16", "schedule.total_steps=40", "schedule.warmup_steps=2",
        "optimizer.lr=1e-2")
PARITY_STEPS = 12


def _losses(cfg, records, steps: int) -> tuple[list[float], object]:
    """Per-step losses of ``steps`` steps of the trainer's own step (2 micro-batches each) on the
    tiny recipe's batches, which depend on the loader's seed only."""
    import torch

    from bertdist.data import continuation_mask
    from bertdist.train.engine import build_engine
    from bertdist.train.loader import LoaderState, PretrainingLoader, open_training_records
    from bertdist.train.restore import RestorePlan, new_state, restore
    from bertdist.train.step import StepRunner, launch_step, settle

    built = build_engine(cfg, RestorePlan("fresh"), 1, 2, "cpu")
    restore(built.engine, built.scheduler, RestorePlan("fresh"), cfg, 0, new_state(cfg, 1, 2))
    runner = StepRunner.for_run(built.engine, cfg, torch.device("cpu"), 2)
    loader = PretrainingLoader(open_training_records(str(records), cfg.data.vocab_file, cfg.data.max_seq_length),
                               cfg.data, rank=0, world_size=1, grad_accum=2,
                               continuation=continuation_mask(cfg.data.vocab_file))
    it = loader.steps(LoaderState())
    try:
        pending = [launch_step(runner, next(it)[0], False) for _ in range(steps)]
    finally:
        it.close()
    return [r.sums["loss"] for r in settle(pending, 1, cfg.deepspeed.precision)], built.engine


def test_bf16_weights_resolve_and_refuse_with_the_settings():
    from bertdist.train.precision import autocast_dtype

    flat = ["optimizer.implementation=flat", "deepspeed.zero_stage=0"]
    assert load_train_config(None, [*flat, "deepspeed.precision=bf16"]).weights == "bf16"  # auto
    assert load_train_config(None, [*flat, "deepspeed.precision=bf16", "deepspeed.bf16_weights=fp32"]).weights == "fp32"
    assert load_train_config(None, [*flat, "deepspeed.precision=fp32"]).weights == "fp32"
    assert load_train_config(None, ["optimizer.name=adamw", "deepspeed.precision=bf16"]).weights == "fp32"  # ZeRO 1
    with pytest.raises(ConfigError, match=r"bf16_weights=bf16: it needs optimizer.implementation flat and "
                                          r"deepspeed.zero_stage 0, .*\(got implementation auto, zero_stage 1\)"):
        load_train_config(None, ["optimizer.name=adamw", "deepspeed.precision=bf16", "deepspeed.bf16_weights=bf16"])
    with pytest.raises(ConfigError, match=r"bf16_weights=bf16: it needs deepspeed.precision bf16 \(got fp32"):
        load_train_config(None, [*flat, "deepspeed.precision=fp32", "deepspeed.bf16_weights=bf16"])
    cfg = load_train_config(None, [*flat, "deepspeed.precision=bf16"])
    ds = generate_ds_config(cfg, world_size=2, grad_accum=cfg.data.global_batch_size // 64)
    assert "torch_autocast" not in ds and ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert autocast_dtype("bf16", "bf16") is None and autocast_dtype("bf16", "fp32") == "bfloat16"
    row = precision_policy("bf16", "cuda", "bf16")
    assert (row.weights, row.master_weights, row.compute, row.grad_accumulation, row.communication) == (
        "bf16", "fp32 (the flat optimizer's)", "bf16", "fp32", "fp32")


@pytest.mark.slow  # three engines, 12 steps each: ~1.5 min on a busy 2-core machine
def test_bf16_weights_loss_stays_near_fp32_and_no_worse_than_autocast(group, tmp_path, train_records, small_vocab):
    """12 steps of the tiny BERT (2 layers, hidden 128, seq 64, LAMB, 2 micro-batches per step,
    dropout off so that only the arithmetic differs) on the same batches: in fp32, in bf16 under
    autocast over fp32 weights, and with bf16 weights and fp32 masters.

    The bound: bf16's unit roundoff is 2^-9 (0.2%). The loss is computed in fp32 from bf16 logits
    and averaged over ~100 masked positions, so with the same weights it is within about one
    roundoff of the fp32 loss; with fp32 masters the weights drift from fp32's only by the rounding
    of each step's gradients, which LAMB's normalised update keeps from compounding over 12 steps.
    So every step's loss must be within 0.2% of fp32's (measured: at most 0.0083%), and the
    bf16-weights run's mean |loss - fp32 loss| at most 2x autocast's + 1e-3 nats (measured: 2e-4
    and 1e-4 nats, both ~0.002% of the loss): holding the weights in bf16 must not make it
    materially worse than rounding them per matmul."""
    import torch

    def cfg(*extra):
        return tiny_cfg(tmp_path, train_records, small_vocab, *FLAT, *extra)

    fp32, _ = _losses(cfg("deepspeed.precision=fp32"), train_records, PARITY_STEPS)
    autocast, _ = _losses(cfg("deepspeed.precision=bf16", "deepspeed.bf16_weights=fp32"), train_records, PARITY_STEPS)
    bf16_cfg = cfg("deepspeed.precision=bf16")
    assert bf16_cfg.weights == "bf16"
    bf16, engine = _losses(bf16_cfg, train_records, PARITY_STEPS)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    assert fp32[-1] < fp32[0] - 0.2, f"the fp32 run must learn for the comparison to mean anything: {fp32}"
    dev_bf16 = [abs(a - b) for a, b in zip(bf16, fp32)]
    dev_autocast = [abs(a - b) for a, b in zip(autocast, fp32)]
    worst = max(d / f for d, f in zip(dev_bf16, fp32))
    assert worst <= 2.0 ** -9, f"bf16 weights: {worst:.3%} off the fp32 loss; bf16 {bf16}, fp32 {fp32}"
    mean_bf16, mean_autocast = sum(dev_bf16) / PARITY_STEPS, sum(dev_autocast) / PARITY_STEPS
    print(f"max deviation {worst:.4%}, mean |dloss| bf16 weights {mean_bf16:.4f}, autocast {mean_autocast:.4f}")
    assert mean_bf16 <= 2 * mean_autocast + 1e-3, (mean_bf16, mean_autocast)
