"""General distillation during pretraining (bertdist/train/distill_objective.py).

- the combined loss against hand computations on tiny tensors (and the task-distillation KL);
- the config section, its errors, and the teacher checks (vocab, width) with every number;
- one step with the student's own weights as teacher (no dropout): KL and cosine are 0, so the
  teacher saw exactly the student's masked batch;
- slow: 2 gloo ranks with an HF-format teacher, SIGKILL after step 23 and --resume auto give
  final weights bitwise equal to an uninterrupted run; the run exports to HF.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from bertdist.config import ConfigError
from bertdist.model import IGNORE_INDEX, BertConfig
from bertdist.model.bert import PreTrainingOutput
from bertdist.train.config import PretrainDistillConfig, load_train_config
from bertdist.train.distill_objective import (
    check_vocab,
    combined_loss,
    hidden_cosine,
    load_teacher,
    mlm_kl,
)
from tests.train.conftest import TINY, assert_ok, metrics, run_pretrain, tiny_args, tiny_cfg


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def _softmax(x: list[float], t: float) -> list[float]:
    e = [math.exp(v / t) for v in x]
    return [v / sum(e) for v in e]


def test_mlm_kl_matches_hand_computation():
    s = [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [9.0, 9.0, 9.0]]
    t = [[2.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 5.0, 0.0]]
    labels = torch.tensor([4, 7, IGNORE_INDEX])  # the third row is not a masked position
    T = 2.0
    hand = T * T * (_kl(_softmax(t[0], T), _softmax(s[0], T)) + _kl(_softmax(t[1], T), _softmax(s[1], T))) / 2
    got = mlm_kl(torch.tensor(s), torch.tensor(t), labels, T)
    assert got.item() == pytest.approx(hand, rel=1e-6)
    # the [B, S, V] layout of the dense head gives the same number
    got3 = mlm_kl(torch.tensor(s).reshape(1, 3, 3), torch.tensor(t).reshape(1, 3, 3), labels.reshape(1, 3), T)
    assert got3.item() == pytest.approx(hand, rel=1e-6)
    # and it is the task distillation's T^2-scaled KL on the kept rows
    from bertdist.distill.losses import soft_kl

    assert got.item() == pytest.approx(soft_kl(torch.tensor(s[:2]), torch.tensor(t[:2]), T).item(), rel=1e-6)
    # no masked row: 0, not NaN
    assert mlm_kl(torch.tensor(s), torch.tensor(t), torch.full((3,), IGNORE_INDEX), T).item() == 0.0


def test_hidden_cosine_matches_hand_computation():
    hs = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [5.0, 5.0]]])
    ht = torch.tensor([[[0.0, 1.0], [2.0, 2.0], [-1.0, 0.0]]])
    mask = torch.tensor([[1, 1, 0]])  # the padding token does not count
    hand = ((1 - 0.0) + (1 - 1.0)) / 2
    assert hidden_cosine(hs, ht, mask).item() == pytest.approx(hand, abs=1e-6)
    all_three = ((1 - 0.0) + (1 - 1.0) + (1 - (-5.0 / math.sqrt(50.0)))) / 3
    assert hidden_cosine(hs, ht, None).item() == pytest.approx(all_three, rel=1e-6)


def test_combined_loss_is_the_weighted_sum():
    s = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    t = torch.tensor([[2.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    labels = torch.tensor([1, 2])
    ce = torch.nn.functional.cross_entropy(s, labels)
    nsp = torch.tensor(0.7)
    hs, ht = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]), torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])
    out = PreTrainingOutput(s, torch.zeros(1, 2), loss=ce + nsp, mlm_loss=ce, nsp_loss=nsp, mlm_labels=labels)
    cfg = PretrainDistillConfig(teacher="x", temperature=3.0, alpha_mlm_kl=5.0, alpha_mlm_ce=2.0,
                                alpha_hidden_cos=1.5, alpha_nsp=0.5)
    kl = 9.0 * (_kl(_softmax(t[0].tolist(), 3.0), _softmax(s[0].tolist(), 3.0))
                + _kl(_softmax(t[1].tolist(), 3.0), _softmax(s[1].tolist(), 3.0))) / 2
    cos = (1.0 + 0.0) / 2
    got = combined_loss(cfg, out, t, hs, ht, torch.ones(1, 2))
    assert got.loss.item() == pytest.approx(5.0 * kl + 2.0 * ce.item() + 1.5 * cos + 0.5 * 0.7, rel=1e-6)
    assert got.mlm_kl.item() == pytest.approx(kl, rel=1e-6) and got.hidden_cos.item() == pytest.approx(cos)
    assert got.mlm_loss is ce and got.prediction_logits is s  # the gold parts stay as the student gave them
    # the cosine is not computed when its weight is 0, and NSP drops out with alpha_nsp 0
    got = combined_loss(dataclasses.replace(cfg, alpha_hidden_cos=0.0, alpha_nsp=0.0), out, t)
    assert got.hidden_cos is None
    assert got.loss.item() == pytest.approx(5.0 * kl + 2.0 * ce.item(), rel=1e-6)


def test_config_section_and_its_errors():
    cfg = load_train_config(TINY, ["distill.teacher=/some/teacher", "distill.temperature=4"])
    assert cfg.distill == PretrainDistillConfig(teacher="/some/teacher", temperature=4.0)
    assert load_train_config(TINY).distill is None
    with pytest.raises(ConfigError, match="distill.teacher is required"):
        load_train_config(TINY, ["distill.temperature=4"])
    with pytest.raises(ConfigError, match="distill.temperature must be positive, got 0"):
        load_train_config(TINY, ["distill.teacher=t", "distill.temperature=0"])
    with pytest.raises(ConfigError, match="not all 0"):
        load_train_config(TINY, ["distill.teacher=t", "distill.alpha_mlm_kl=0", "distill.alpha_mlm_ce=0",
                                 "distill.alpha_nsp=0"])
    with pytest.raises(ConfigError, match="unknown key 'alpha'"):
        load_train_config(TINY, ["distill.teacher=t", "distill.alpha=1"])


def test_vocab_mismatch_lists_both_vocabularies(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\n")
    b.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ndog\n")
    seven = BertConfig.from_preset("tiny", vocab_size=7)
    check_vocab("teacher-dir", seven, a, seven, str(a))  # the same vocab passes
    from bertdist.export.tokenizer import vocab_sha256

    with pytest.raises(ConfigError) as e:
        check_vocab("teacher-dir", seven, b, seven, str(a))
    msg = str(e.value)
    assert vocab_sha256(a) in msg and vocab_sha256(b) in msg and str(a) in msg and str(b) in msg
    with pytest.raises(ConfigError, match=r"student: 7 tokens(.|\n)*teacher: 8 tokens"):
        check_vocab("teacher-dir", BertConfig.from_preset("tiny", vocab_size=8), None, seven, str(a))


def _save_teacher(model, cfg: BertConfig, vocab, out):
    from bertdist.export.hf import write_hf_dir

    return write_hf_dir(out, cfg, model.state_dict(), vocab)


def test_teacher_width_must_match_for_the_cosine(tmp_path, small_vocab):
    from bertdist.data import load_vocab
    from bertdist.model import BertForPreTraining

    wide = BertConfig.from_preset("mini", vocab_size=len(load_vocab(small_vocab)), kernels="reference")
    teacher_dir = _save_teacher(BertForPreTraining(wide, device_type="cpu"), wide, small_vocab, tmp_path / "t")
    cfg = load_train_config(TINY, [f"data.vocab_file={small_vocab}", f"distill.teacher={teacher_dir}",
                                   "distill.alpha_hidden_cos=1"])
    cfg = dataclasses.replace(cfg, model=cfg.model.with_vocab(wide.vocab_size))
    with pytest.raises(ConfigError, match="student hidden_size 128, teacher hidden_size 256"):
        load_teacher(cfg, torch.device("cpu"))
    teacher = load_teacher(dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, alpha_hidden_cos=0.0)),
                           torch.device("cpu"))  # without the cosine, a wider teacher is fine
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())
    assert teacher.config.hidden_size == 256 and teacher.config.sparse_mlm_head == cfg.model.sparse_mlm_head


@pytest.mark.parametrize("zero", [["deepspeed.zero_stage=0"], ["optimizer.name=adamw", "deepspeed.zero_stage=2"]],
                         ids=["zero0-lamb", "zero2-adamw"])
def test_a_teacher_equal_to_the_student_gives_zero_kl_and_cosine(zero, tmp_path, group, sample_records, small_vocab):
    """With no dropout, a teacher holding the student's initial weights predicts exactly what the
    student predicts on the first batch: only possible if it sees the very same masked batch."""
    from bertdist.data import continuation_mask
    from bertdist.train.engine import build_engine
    from bertdist.train.loader import LoaderState, PretrainingLoader, open_training_records
    from bertdist.train.restore import RestorePlan
    from bertdist.train.distill_objective import build_objective
    from bertdist.train.step import StepRunner, step_metrics, train_step

    cfg = tiny_cfg(tmp_path, sample_records, small_vocab, "model.hidden_dropout_prob=0",
                   "model.attention_probs_dropout_prob=0", "data.global_batch_size=16", *zero)
    built = build_engine(cfg, RestorePlan("fresh"), 1, 1, "cpu")
    teacher_dir = _save_teacher(built.engine.module, cfg.model, small_vocab, tmp_path / "teacher")
    cfg = dataclasses.replace(cfg, distill=PretrainDistillConfig(teacher=str(teacher_dir), alpha_hidden_cos=1.0))
    objective, _ = build_objective(cfg, built.engine.module, torch.device("cpu"))
    records = open_training_records(str(sample_records), cfg.data.vocab_file, cfg.data.max_seq_length)
    loader = PretrainingLoader(records, cfg.data, rank=0, world_size=1, grad_accum=1,
                               continuation=continuation_mask(cfg.data.vocab_file))
    runner = StepRunner.for_run(built.engine, cfg, torch.device("cpu"), 1, objective)
    steps = loader.steps(LoaderState())
    try:
        first = train_step(runner, next(steps)[0], 1, stop_requested=False)
        second = train_step(runner, next(steps)[0], 2, stop_requested=False)
    finally:
        steps.close()
    assert abs(first.sums["mlm_kl"]) < 1e-6 and abs(first.sums["hidden_cos"]) < 1e-6, first.sums
    d = cfg.distill
    assert first.sums["loss"] == pytest.approx(d.alpha_mlm_ce * first.sums["mlm_loss"] + first.sums["nsp_loss"]
                                               + d.alpha_mlm_kl * first.sums["mlm_kl"], rel=1e-5)
    assert second.sums["mlm_kl"] > 1e-6 and second.sums["hidden_cos"] > 1e-7  # the student has moved
    m = step_metrics(second, 1.0, 1, 0.0, 1.0, 0, 0)
    assert m["mlm_kl"] == second.sums["mlm_kl"] and m["hidden_cos"] == second.sums["hidden_cos"]


@pytest.fixture(scope="module")
def hf_teacher(tmp_path_factory, small_vocab):
    """A tiny random-weight BERT saved as a Hugging Face directory (the teacher's loading path for
    any HF BertForPreTraining), seeded so every run gets the same teacher."""
    from bertdist.data import load_vocab
    from bertdist.model import BertForPreTraining

    torch.manual_seed(7)
    cfg = BertConfig.from_preset("tiny", vocab_size=len(load_vocab(small_vocab)), kernels="reference")
    return _save_teacher(BertForPreTraining(cfg, device_type="cpu"), cfg, small_vocab,
                         tmp_path_factory.mktemp("hf_teacher"))


def _final_weights(run_dir):
    from bertdist.export.sources import load_pretrained

    return load_pretrained(run_dir / "checkpoints").state_dict


@pytest.mark.slow
def test_two_ranks_kill_and_resume_is_bitwise_exact(tmp_path, hf_teacher, train_records, small_vocab):
    extra = [f"distill.teacher={hf_teacher}", "distill.alpha_hidden_cos=1.0", "schedule.total_steps=30",
             "checkpoint.every_steps=10", "eval.every_steps=0", "eval.max_sequences=64"]
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    assert_ok(run_pretrain(2, tiny_args(ref_dir, train_records, small_vocab, *extra)))
    rows = metrics(ref_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all("mlm_kl" in r and "hidden_cos" in r for r in rows)
    assert rows[-1]["mlm_kl"] < rows[0]["mlm_kl"]  # the student moves towards the teacher
    res = run_pretrain(2, tiny_args(run_dir, train_records, small_vocab, *extra), faults=["--kill-after-step", "13"])
    assert res.returncode != 0
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    assert_ok(run_pretrain(2, [*tiny_args(run_dir, train_records, small_vocab, *extra), "--resume", "auto"]))
    ref, got = _final_weights(ref_dir), _final_weights(run_dir)
    assert ref.keys() == got.keys()
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
    losses = {r["step"]: r["loss"] for r in metrics(ref_dir)}
    resumed = metrics(run_dir)[-20:]
    assert [(r["step"], r["loss"]) for r in resumed] == [(s, losses[s]) for s in range(11, 31)]
    saved = (run_dir / "checkpoints" / "step_00000030" / "bertdist_config.yaml").read_text()
    assert f"teacher: {hf_teacher}" in saved and "alpha_hidden_cos: 1.0" in saved
    # the student exports like any pretrained model
    from bertdist.cli.main import main

    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    from transformers import BertForMaskedLM

    assert BertForMaskedLM.from_pretrained(tmp_path / "hf").config.hidden_size == 128


def test_resume_refuses_a_changed_distill_section(tmp_path):
    from bertdist.config import save_config
    from bertdist.train.checkpoint import CONFIG_FILE
    from bertdist.train.objective import check_checkpoint

    def check_resume(cfg, load_dir, tag):
        check_checkpoint(cfg, load_dir, tag, "resume")

    cfg = load_train_config(TINY, ["distill.teacher=/teachers/a"])
    (tmp_path / "step_00000010").mkdir()
    save_config(cfg, tmp_path / "step_00000010" / CONFIG_FILE)
    check_resume(cfg, tmp_path, "step_00000010")  # the same section resumes
    changed = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, temperature=4.0))
    with pytest.raises(ConfigError, match="distill section differs(.|\n)*'temperature': 2.0(.|\n)*'temperature': 4.0"):
        check_resume(changed, tmp_path, "step_00000010")
    with pytest.raises(ConfigError, match="config None"):
        check_resume(dataclasses.replace(cfg, distill=None), tmp_path, "step_00000010")
    check_resume(cfg, tmp_path, "step_00000099")  # no saved config there: nothing to compare
