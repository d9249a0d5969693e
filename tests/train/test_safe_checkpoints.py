"""Checkpoints load without unpickling code: what the trainer saves reads back with weights_only
(and resumes exactly); a planted pickle is refused at resume, at checkpoint.init_from, in the RNG
file and before a universal conversion; an older checkpoint (pickled RNG states) loads only with
--trust-checkpoint, with a warning."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from bertdist.export.safe_load import UnsafeCheckpointError, deepspeed_globals, trust_checkpoints
from bertdist.train.checkpoint import CheckpointManager, check_safe_to_convert, ensure_universal
from bertdist.train.restore import RestorePlan, new_state, restore
from tests.export.planted import plant
from tests.train.conftest import assert_ok, run_pretrain, tiny_args, tiny_cfg

TAG = "step_00000001"


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 1000, (4, 32), generator=g)
    return ids, torch.ones_like(ids), torch.zeros_like(ids), ids.clone(), torch.zeros(4, dtype=torch.long)


def _train(engine, n: int = 2) -> list[float]:
    """Losses of ``n`` steps on a fixed batch, with dropout (so the RNG states matter)."""
    ids, mask, types, labels, nsp = _batch()
    losses = []
    for _ in range(n):
        loss = engine(ids, mask, types, labels=labels, next_sentence_label=nsp).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _saved_checkpoint(tmp_path, cfg, records):
    """One step of training saved as ``<tmp>/ckpt/step_00000001`` by the trainer's CheckpointManager."""
    engine = _fresh(cfg).engine
    _train(engine, 1)
    state = dataclasses.replace(new_state(cfg, 1, 1), step=1)
    CheckpointManager(tmp_path / "ckpt", keep_last_n=0, rank=0, world_size=1).save(engine, state, cfg)
    return engine, state


def _fresh(cfg):
    from bertdist.train.engine import build_engine

    return build_engine(cfg, RestorePlan("fresh"), 1, 1, "cpu")


def _restore(cfg, tmp_path, state, mode: str = "resume"):
    built = _fresh(cfg)
    plan = RestorePlan(mode, tmp_path / "ckpt", TAG, state)
    restore(built.engine, built.scheduler, plan, cfg, 0, new_state(cfg, 1, 1))
    return built.engine


def _cpu_fp16() -> bool:
    """DeepSpeed's CPU accelerator takes fp16 only where oneDNN has fp16 kernels for this CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


_FP16 = pytest.mark.skipif(not _cpu_fp16(), reason="this CPU has no oneDNN fp16 support: DeepSpeed refuses fp16 on it")


@pytest.mark.parametrize("opt,stage,precision", [("lamb", 0, "fp32"), pytest.param("adamw", 1, "fp16", marks=_FP16),
                                                  ("adamw", 2, "bf16"), ("adamw", 3, "fp32")])
def test_trainer_checkpoints_load_without_pickle_and_resume_exactly(group, tmp_path, train_records, small_vocab, opt,
                                                                     stage, precision):
    from bertdist.export.deepspeed_ckpt import consolidate

    cfg = tiny_cfg(tmp_path, train_records, small_vocab, f"optimizer.name={opt}", f"deepspeed.zero_stage={stage}",
                   f"deepspeed.precision={precision}")
    engine, state = _saved_checkpoint(tmp_path, cfg, train_records)
    tdir = tmp_path / "ckpt" / TAG
    assert (tdir / "rng_state_rank0.json").is_file() and not (tdir / "rng_state_rank0.pt").exists()
    for f in tdir.glob("*.pt"):  # exactly the allowlist, nothing pickled beyond it
        with torch.serialization.safe_globals(deepspeed_globals()):
            torch.load(f, map_location="cpu", weights_only=True)
    expected = _train(engine)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no trusted (pickle) load happened
        resumed = _restore(cfg, tmp_path, state)
    assert _train(resumed) == expected  # bitwise: weights, optimizer state and dropout RNG all restored
    if stage > 0:  # export reads ZeRO checkpoints through DeepSpeed's zero_to_fp32, safely too
        assert set(consolidate(tmp_path / "ckpt").state_dict) >= {"bert.embeddings.word_embeddings.weight"}


@pytest.mark.parametrize("mode", ["resume", "init"])
def test_planted_model_states_are_refused_at_resume_and_init_from(group, tmp_path, train_records, small_vocab, mode):
    cfg = tiny_cfg(tmp_path, train_records, small_vocab)
    _, state = _saved_checkpoint(tmp_path, cfg, train_records)
    marker = tmp_path / "ran"
    evil = plant(tmp_path / "ckpt" / TAG / "mp_rank_00_model_states.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match="--trust-checkpoint") as e:
        _restore(cfg, tmp_path, state, mode)
    assert str(evil) in str(e.value)
    assert not marker.exists()


def test_planted_rng_file_is_refused(group, tmp_path, train_records, small_vocab):
    cfg = tiny_cfg(tmp_path, train_records, small_vocab)
    _, state = _saved_checkpoint(tmp_path, cfg, train_records)
    tdir = tmp_path / "ckpt" / TAG
    (tdir / "rng_state_rank0.json").unlink()
    marker = tmp_path / "ran"
    evil = plant(tdir / "rng_state_rank0.pt", marker)  # where older checkpoints kept it
    with pytest.raises(UnsafeCheckpointError, match="--trust-checkpoint") as e:
        _restore(cfg, tmp_path, state)
    assert str(evil) in str(e.value)
    assert not marker.exists()


def _make_old_format(tdir):
    """The checkpoint as an older bertdist wrote it: the RNG states pickled (numpy arrays)."""
    (tdir / "rng_state_rank0.json").unlink()
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(old, tdir / "rng_state_rank0.pt")
    return old


def test_old_checkpoint_loads_only_with_trust_and_warns(group, tmp_path, train_records, small_vocab):
    cfg = tiny_cfg(tmp_path, train_records, small_vocab)
    _, state = _saved_checkpoint(tmp_path, cfg, train_records)
    tdir = tmp_path / "ckpt" / TAG
    old = _make_old_format(tdir)
    with pytest.raises(UnsafeCheckpointError, match="--trust-checkpoint") as e:
        _restore(cfg, tmp_path, state)
    assert str(tdir / "rng_state_rank0.pt") in str(e.value)
    with trust_checkpoints(), pytest.warns(UserWarning, match=str(tdir / "rng_state_rank0.pt")):
        _restore(cfg, tmp_path, state)
    assert torch.equal(torch.get_rng_state(), old["torch"])
    assert random.getstate() == old["python"]


def test_universal_conversion_refuses_planted_file_before_deepspeed_reads_it(tmp_path):
    marker = tmp_path / "ran"
    tdir = tmp_path / "ckpt" / TAG
    evil = plant(tdir / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match=str(evil)):
        check_safe_to_convert(tdir)
    with pytest.raises(UnsafeCheckpointError):
        ensure_universal(tmp_path / "ckpt", TAG, 0)
    assert not marker.exists() and not (tmp_path / "ckpt" / "universal" / TAG).exists()


@pytest.mark.slow
def test_pretrain_cli_refuses_planted_checkpoint_and_trusts_old_one_on_request(group, tmp_path, train_records,
                                                                              small_vocab):
    overrides = ("schedule.total_steps=2", "schedule.warmup_steps=1", "data.global_batch_size=16",
                 "eval.at_start=false", "eval.every_steps=0", "eval.at_end=false")
    cfg = tiny_cfg(tmp_path, train_records, small_vocab, *overrides)
    _saved_checkpoint(tmp_path, cfg, train_records)
    tdir = tmp_path / "ckpt" / TAG
    _make_old_format(tdir)
    args = tiny_args(tmp_path / "run", train_records, small_vocab, *overrides)
    res = run_pretrain(1, [*args, "--resume", str(tdir)])
    assert res.returncode == 2 and str(tdir / "rng_state_rank0.pt") in res.stderr, res.stderr[-3000:]
    assert "--trust-checkpoint" in res.stderr
    res = run_pretrain(1, [*args, "--resume", str(tdir), "--trust-checkpoint"])
    assert_ok(res)
    assert f"{tdir / 'rng_state_rank0.pt'}: loading with full pickle" in res.stderr, res.stderr[-3000:]
    marker = tmp_path / "ran"
    plant(tdir / "mp_rank_00_model_states.pt", marker)
    res = run_pretrain(1, [*args, "--resume", str(tdir)])
    assert res.returncode == 2 and str(tdir / "mp_rank_00_model_states.pt") in res.stderr, res.stderr[-3000:]
    assert not marker.exists()
