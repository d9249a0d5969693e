"""build_engine, restore, train_step and evaluate in this process (a one-process gloo group; no
torchrun): the pieces run_pretraining is made of."""
from __future__ import annotations

import math

import pytest
import torch

from tests.train.conftest import run_steps, tiny_cfg


def test_steps_are_deterministic_and_carry_every_statistic(group, tmp_path, train_records, small_vocab):
    from bertdist.train.step import STEP_FIELDS, step_metrics

    cfg = tiny_cfg(tmp_path, train_records, small_vocab)
    first, _ = run_steps(cfg, train_records, 3)
    again, _ = run_steps(cfg, train_records, 3)
    assert [r.sums["loss"] for r in first] == [r.sums["loss"] for r in again]  # same seed, same bits
    for r in first:
        assert set(r.sums) == set(STEP_FIELDS)
        assert r.sums["sequences"] == 16 and r.sums["nsp_count"] == 16
        assert 0 < r.sums["real_tokens"] <= r.sums["padded_tokens"] <= 16 * 64
        assert 0 <= r.sums["mlm_correct"] <= r.sums["mlm_count"] > 0 and r.sums["flops"] > 0
        assert math.isfinite(r.grad_norm) and r.grad_norm > 0 and r.skipped == 0
        assert r.sums["nonfinite"] == 0 and r.sums["stop"] == 0
    assert [r.lr for r in first] == pytest.approx([5e-3 / 4, 5e-3 / 2, 5e-3 * 3 / 4])  # warmup over 4 steps
    m = step_metrics(first[-1], 2.0, 1, 1e12, 1.0, 0, 0)
    assert m["seq_per_s"] == 8.0 and m["mlm_acc"] == first[-1].sums["mlm_correct"] / first[-1].sums["mlm_count"]
    assert "nsp_acc" in m and m["loss"] == first[-1].sums["loss"]


def test_activation_checkpointing_changes_memory_not_results(group, tmp_path, train_records, small_vocab):
    plain, _ = run_steps(tiny_cfg(tmp_path, train_records, small_vocab), train_records, 2)
    ckpt, engine = run_steps(tiny_cfg(tmp_path, train_records, small_vocab, "deepspeed.activation_checkpointing=torch"),
                              train_records, 2)
    assert [r.sums["loss"] for r in ckpt] == [r.sums["loss"] for r in plain]
    assert [r.grad_norm for r in ckpt] == [r.grad_norm for r in plain]
    layer = engine.module.bert.encoder.layer[0]
    assert "forward" in vars(layer)  # routed through the checkpoint function, from outside the model


def test_a_nonfinite_loss_stops_the_run_before_the_update_is_saved(group, tmp_path, train_records, small_vocab):
    from bertdist.train.step import NonFiniteLossError

    def poison(engine):
        with torch.no_grad():
            engine.module.cls.seq_relationship.bias.fill_(float("nan"))

    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 1 \\(fp32\\); the update was not saved"):
        run_steps(tiny_cfg(tmp_path, train_records, small_vocab), train_records, 1, fault=poison)


def test_evaluate_sums_held_out_statistics(group, tmp_path, train_records, small_vocab):
    from bertdist.data import continuation_mask
    from bertdist.train.loader import eval_batches, open_training_records
    from bertdist.train.step import evaluate

    cfg = tiny_cfg(tmp_path, train_records, small_vocab)
    _, engine = run_steps(cfg, train_records, 1)
    held = open_training_records(str(train_records), str(small_vocab), 64, split="heldout")
    batches = eval_batches(held, cfg.data, continuation_mask(small_vocab), rank=0, world_size=1,
                           micro_batch_size=32, max_sequences=64, seed=1)
    res = evaluate(engine, batches, torch.device("cpu"))
    assert set(res) == {"mlm_loss", "mlm_acc", "masked_tokens", "nsp_acc", "nsp_loss", "sequences"}
    assert res["sequences"] == sum(b["input_ids"].shape[0] for b in batches)
    assert 0 < res["mlm_loss"] < 20 and 0 <= res["mlm_acc"] <= 1 and res["masked_tokens"] > 0
    assert engine.module.training  # evaluation hands the engine back in training mode


def test_a_single_process_skips_deepspeeds_gradient_all_reduce_with_itself(group, tmp_path, train_records,
                                                                          small_vocab):
    _, engine = run_steps(tiny_cfg(tmp_path, train_records, small_vocab), train_records, 1)
    assert engine.enable_backward_allreduce is False  # nothing to reduce alone (engine.py)
    _, engine = run_steps(tiny_cfg(tmp_path, train_records, small_vocab, "optimizer.name=adamw",
                                   "deepspeed.zero_stage=1"), train_records, 1)
    assert engine.enable_backward_allreduce is True  # ZeRO's own reduction path stays


def test_the_flat_optimizer_steps_inside_the_trainer_and_logs_its_own_norm(group, tmp_path, train_records,
                                                                          small_vocab):
    """optimizer.implementation=flat: the parameters are views of its buffer, its gradients stay
    views after DeepSpeed's step, and the logged norm is the one it clipped with."""
    results, engine = run_steps(tiny_cfg(tmp_path, train_records, small_vocab, "optimizer.implementation=flat"),
                                train_records, 3)
    opt = engine.optimizer
    assert type(opt).__name__ == "FlatLamb" and opt.max_grad_norm == 1.0
    flat = opt.flat_params
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in engine.module.parameters())
    assert all(p.grad is not None for p in engine.module.parameters())  # the views came back
    assert all(math.isfinite(r.grad_norm) and r.grad_norm > 0 for r in results)
    assert results[-1].grad_norm == pytest.approx(float(opt.grad_norm), rel=1e-6)
