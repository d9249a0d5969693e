"""ModernBERT in `bertdist pretrain`: the packed path from the loader's batches, MLM only, exact
resume, export to a ``ModernBertForMaskedLM`` directory, and continued pretraining from
`bertdist import-hf` output as a context-extension phase (the context and global RoPE θ change;
any other architecture change is refused)."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import shutil

import pytest
import torch

from bertdist.config import ConfigError
from bertdist.train.config import load_train_config
from tests.train.conftest import REPO, assert_ok, metrics, run_pretrain

RECIPE = REPO / "configs" / "pretrain" / "modernbert-tiny.yaml"


def _cfg(tmp_path, records, vocab, *overrides):
    from bertdist.data import load_vocab

    cfg = load_train_config(RECIPE, [f"run_dir={tmp_path}", f"data.train_manifest={records}",
                                     f"data.vocab_file={vocab}", "data.prefetch_steps=0", "data.max_seq_length=64",
                                     *overrides])
    return dataclasses.replace(cfg, model=cfg.model.with_vocab(len(load_vocab(vocab))))


def _args(run_dir, records, vocab, *extra):
    return [str(RECIPE), f"run_dir={run_dir}", f"data.train_manifest={records}", f"data.vocab_file={vocab}",
            "data.max_seq_length=64", "logging.progress=none", "eval.at_start=false", "eval.max_sequences=64", *extra]


# The larger recipes' optimizer (the tiny recipe keeps AdamW for the parity benchmark)
STABLE_ADAMW = ("optimizer.name=stable_adamw", "optimizer.lr_independent_weight_decay=true")


def test_a_step_feeds_the_packed_layout_and_matches_the_padded_model(tmp_path, group, train_records, small_vocab):
    """One step through the trainer's runner: the model gets the real tokens back to back (no padding
    reaches the encoder), and its loss is the padded model's on the same masked batch."""
    from bertdist.data import continuation_mask
    from bertdist.model import IGNORE_INDEX, train_flops_per_sequence
    from bertdist.model.flops import modernbert_batch_train_flops
    from bertdist.model.modernbert import packed_inputs
    from bertdist.train.engine import build_engine
    from bertdist.train.loader import LoaderState, PretrainingLoader, open_training_records
    from bertdist.train.restore import RestorePlan, new_state, restore
    from bertdist.train.step import StepRunner, evaluate, step_metrics, train_step

    cfg = _cfg(tmp_path, train_records, small_vocab, "data.global_batch_size=16")
    built = build_engine(cfg, RestorePlan("fresh"), 1, 1, "cpu")
    restore(built.engine, built.scheduler, RestorePlan("fresh"), cfg, 0, new_state(cfg, 1, 1))
    records = open_training_records(str(train_records), cfg.data.vocab_file, cfg.data.max_seq_length)
    loader = PretrainingLoader(records, cfg.data, rank=0, world_size=1, grad_accum=1,
                               continuation=continuation_mask(cfg.data.vocab_file))
    assert loader.has_nsp  # the records carry NSP labels; ModernBERT trains without them
    steps = loader.steps(LoaderState())
    try:
        batch = next(steps)[0]
    finally:
        steps.close()
    mb = batch[0]
    packed = packed_inputs(mb)
    real = int(mb["attention_mask"].sum())
    assert packed["input_ids"].shape == (real,)  # the real tokens only
    assert torch.equal(packed["input_ids"], mb["input_ids"][mb["attention_mask"].bool()])
    assert torch.equal(packed["labels"][packed["masked_positions"]],
                       mb["labels"].reshape(-1)[mb["masked_positions"]])  # the same labels, renumbered
    model = built.engine.module
    with torch.no_grad():
        padded = model(mb["input_ids"], mb["attention_mask"], mb["labels"])
        ours = model(**packed)
    assert torch.allclose(ours.loss, padded.loss, atol=1e-5), (ours.loss, padded.loss)

    runner = StepRunner.for_run(built.engine, cfg, torch.device("cpu"), 1)
    res = train_step(runner, batch, 1, stop_requested=False)
    s = res.sums
    assert s["loss"] == pytest.approx(padded.loss.item(), rel=1e-5) and s["loss"] == s["mlm_loss"]
    assert s["nsp_count"] == 0 and s["nsp_loss"] == 0  # no NSP head
    assert s["mlm_count"] == int((mb["labels"] != IGNORE_INDEX).sum())
    # 30% masking: about 0.3 of the real tokens bar [CLS]/[SEP] (the loader's masking, not the records')
    assert 0.2 < s["mlm_count"] / real < 0.35
    width = mb["input_ids"].shape[1]
    head = 3 * 2 * (64 * 64 + 64 * cfg.model.vocab_size)
    # counted on the real tokens of each segment, not at the padded width
    segments = modernbert_batch_train_flops(cfg.model, mb["cu_seqlens"], torch.tensor(float(s["mlm_count"])))
    assert s["flops"] == pytest.approx(float(segments), rel=1e-5)
    assert s["flops"] <= 16 * train_flops_per_sequence(cfg.model, width, 0) + head * s["mlm_count"]  # = unpadded
    m = step_metrics(res, 1.0, 1, 0.0, 1.0, 0, 0)
    assert "nsp_acc" not in m and 0 <= m["mlm_acc"] <= 1
    ev = evaluate(built.engine, [mb], torch.device("cpu"))
    assert set(ev) == {"mlm_loss", "mlm_acc", "masked_tokens"} and ev["masked_tokens"] == s["mlm_count"]


def test_documents_packed_in_a_row_attend_within_themselves(group):
    """The contract with the data side: ``cu_seqlens`` are attention segments in packed-token order,
    one per document when a row packs several. Splitting a row into two documents changes what its
    tokens see; the packed input of the two documents equals each document run alone."""
    from bertdist.model.modernbert import ModernBertForMaskedLM, packed_inputs
    from bertdist.model.modernbert_config import ModernBertConfig

    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig.from_preset("tiny", vocab_size=100, pad_token_id=0,
                                                               max_position_embeddings=64, local_attention=8)).eval()
    ids = torch.randint(5, 100, (1, 24))
    labels = torch.full_like(ids, -100)
    labels[0, [3, 17]] = ids[0, [3, 17]]
    batch = {"input_ids": ids, "labels": labels, "token_index": torch.arange(24),
             "masked_positions": torch.tensor([3, 17])}
    one = packed_inputs({**batch, "cu_seqlens": torch.tensor([0, 24], dtype=torch.int32), "max_seqlen": 24})
    two = packed_inputs({**batch, "cu_seqlens": torch.tensor([0, 10, 24], dtype=torch.int32), "max_seqlen": 14})
    with torch.no_grad():
        whole, split = model(**one).logits, model(**two).logits
        first = model(ids[:, :10], torch.ones(1, 10, dtype=torch.long), labels[:, :10]).logits
        second = model(ids[:, 10:], torch.ones(1, 14, dtype=torch.long), labels[:, 10:]).logits
    assert torch.allclose(split, torch.cat([first, second]), atol=1e-5)
    assert (split - whole).abs().max() > 1e-4  # across the boundary the tokens saw each other


@pytest.mark.slow
def test_pretrain_resumes_bitwise_exports_and_extends_the_context(tmp_path, train_records, small_vocab):
    """`bertdist pretrain` on one rank with StableAdamW, killed after step 10 (checkpoints at 4 and 8),
    resumed from step 4: steps 5..10 replay exactly and step 8's weights are the same bytes. Its export is a
    ModernBertForMaskedLM directory; `import-hf` of it starts a new phase at a longer context with
    global θ 160,000, and a changed window is refused."""
    from bertdist.cli.main import main
    from bertdist.export.sources import load_pretrained

    run = tmp_path / "run"
    args = _args(run, train_records, small_vocab, *STABLE_ADAMW, "schedule.total_steps=12", "schedule.warmup_steps=2",
                 "checkpoint.every_steps=4", "checkpoint.keep_last_n=0", "eval.every_steps=0", "logging.every_steps=2")
    res = run_pretrain(1, args, faults=["--kill-after-step", "10"])
    assert res.returncode != 0
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_00000008"
    assert "the records carry NSP labels: modernbert has no NSP head, so they are not used" in res.stdout + res.stderr
    killed = {r["step"]: r for r in metrics(run)}
    # the recipe's attention_backend: auto, decided at the start: CPU training runs sdpa (flex has no CPU backward)
    assert [r["backend"] for r in metrics(run, "attention")] == ["sdpa"]
    assert "attention_backend: auto chose sdpa: forward + backward of 1 global + 2 local (+-16) layers" in res.stderr
    assert (run / "attention_decisions.json").is_file()
    first_8 = tmp_path / "first_step_00000008"
    shutil.copytree(ckpt / "step_00000008", first_8)
    assert_ok(run_pretrain(1, [*args, "--resume", str(ckpt / "step_00000004")]))
    rows = metrics(run)
    resumed = rows[[r["step"] for r in rows].index(10) + 1:]
    assert [r["step"] for r in resumed] == list(range(5, 13))
    keys = ("loss", "mlm_loss", "mlm_acc", "grad_norm", "lr")
    diff = [(r["step"], k, r[k], killed[r["step"]][k]) for r in resumed if r["step"] <= 10 for k in keys
            if r[k] != killed[r["step"]][k]]
    assert not diff, diff
    assert "nsp_loss" not in rows[-1] and rows[-1]["loss"] < rows[0]["loss"]
    before, after = load_pretrained(first_8).state_dict, load_pretrained(ckpt / "step_00000008").state_dict
    assert before.keys() == after.keys() and [k for k in before if not torch.equal(before[k], after[k])] == []
    assert {"mlm_loss", "mlm_acc"} <= set(metrics(run, "eval")[-1])

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0, out.getvalue()
        assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "init")]) == 0, out.getvalue()
    assert out.getvalue().count("-> OK") == 2, out.getvalue()
    from transformers import ModernBertForMaskedLM

    hf = ModernBertForMaskedLM.from_pretrained(tmp_path / "hf")
    assert hf.config.max_position_embeddings == 128 and hf.config.local_attention == 32
    # the export carries the WordPiece vocab the records were built with, as BERT tokenizer files
    assert (tmp_path / "hf" / "vocab.txt").read_bytes() == small_vocab.read_bytes()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("The King")["input_ids"][0] == hf.config.cls_token_id

    phase2 = ["phase=2", f"checkpoint.init_from={tmp_path / 'init'}", "checkpoint.init_load_optimizer=false",
              "schedule.total_steps=4", "schedule.warmup_steps=1", "eval.every_steps=0", "eval.at_end=false",
              "checkpoint.every_steps=0"]
    longer = ["model.max_position_embeddings=256", "model.global_rope_theta=160000"]
    refused = run_pretrain(1, _args(tmp_path / "bad", train_records, small_vocab, *phase2, *longer,
                                    "model.local_attention=64"))
    assert refused.returncode != 0
    assert "model.local_attention: checkpoint 32, config 64" in refused.stdout + refused.stderr
    assert_ok(run_pretrain(1, _args(tmp_path / "ctx", train_records, small_vocab, *phase2, *longer)))
    # a new phase from the DeepSpeed checkpoint, its optimizer state loaded, at another peak lr:
    # StableAdamW's lr-independent weight decay is relative to the new peak
    p2 = tmp_path / "p2"
    assert_ok(run_pretrain(1, _args(p2, train_records, small_vocab, *STABLE_ADAMW, "phase=2", "optimizer.lr=1e-3",
                                    f"checkpoint.init_from={ckpt / 'step_00000008'}",
                                    "checkpoint.init_load_optimizer=true", "schedule.total_steps=2",
                                    "schedule.warmup_steps=1", "eval.every_steps=0", "eval.at_end=false",
                                    "checkpoint.every_steps=0")))
    groups = torch.load(p2 / "checkpoints" / "step_00000002" / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)["optimizer"]["param_groups"]
    assert [g["max_lr"] for g in groups] == [1e-3, 1e-3]
    assert all(g["lr_independent_decay"] for g in groups)
    ctx = metrics(tmp_path / "ctx")
    assert [r["step"] for r in ctx] == [1, 2, 3, 4]
    assert ctx[0]["mlm_loss"] < killed[1]["mlm_loss"] - 0.5  # it started from the trained weights (8.0 -> 7.1 seen)
    w = load_pretrained(tmp_path / "ctx")
    assert w.config.global_rope_theta == 160000.0 and w.config.max_position_embeddings == 256


def test_a_new_phase_may_change_only_the_context_and_the_global_rope_base(tmp_path, train_records, small_vocab):
    from bertdist.config import save_config
    from bertdist.train.checkpoint import CONFIG_FILE
    from bertdist.train.objective import check_checkpoint
    from bertdist.train.restore import check_compatible, new_state

    cfg = _cfg(tmp_path, train_records, small_vocab)
    (tmp_path / "step_00000010").mkdir()
    save_config(cfg, tmp_path / "step_00000010" / CONFIG_FILE)
    saved = new_state(cfg, 1, 1)
    extended = dataclasses.replace(cfg, phase=2, model=dataclasses.replace(
        cfg.model, max_position_embeddings=8192, global_rope_theta=160_000.0))
    check_compatible(saved, extended, "start a new phase")
    check_checkpoint(extended, tmp_path, "step_00000010", "init")
    with pytest.raises(ConfigError, match=r"model.global_rope_theta: checkpoint 10000.0, config 160000.0"):
        check_compatible(saved, dataclasses.replace(extended, phase=1), "resume")  # a resume keeps θ
    for field, value in (("local_attention", 64), ("local_rope_theta", 20_000.0), ("global_attn_every_n_layers", 2),
                         ("hidden_size", 128)):
        other = dataclasses.replace(extended, model=dataclasses.replace(extended.model, **{field: value}))
        with pytest.raises(ConfigError, match=f"model.{field}: checkpoint .*, config {value}"):
            check_compatible(saved, other, "start a new phase")
        with pytest.raises(ConfigError, match=f"cannot start a new phase .*{field}: checkpoint"):
            check_checkpoint(other, tmp_path, "step_00000010", "init")
    bert = load_train_config(REPO / "configs" / "pretrain" / "tiny.yaml")
    with pytest.raises(ConfigError, match="model.model_type: checkpoint 'modernbert', config 'bert'"):
        check_compatible(saved, bert, "start a new phase")
    with pytest.raises(ConfigError, match="it holds a ModernBERT.* this config trains a BERT"):
        check_checkpoint(bert, tmp_path, "step_00000010", "init")


def test_the_tiny_recipe_takes_a_few_steps_on_its_schedule(tmp_path, group, train_records, small_vocab):
    """modernbert-tiny.yaml as shipped (but the records' seq 64): four steps on CPU through the
    trainer's runner, on its warmup-stable-decay schedule."""
    import math

    from tests.train.conftest import run_steps

    cfg = _cfg(tmp_path, train_records, small_vocab, "data.global_batch_size=16")
    assert cfg.schedule.decay == "wsd" and cfg.schedule.decay_steps == 10  # the last quarter of 40 steps
    results, _ = run_steps(cfg, train_records, 4)
    assert [r.lr for r in results] == pytest.approx([2e-3 * k / 4 for k in (1, 2, 3, 4)])  # the warmup
    assert all(math.isfinite(r.sums["loss"]) and r.sums["mlm_count"] > 0 for r in results)
    assert results[-1].sums["mlm_loss"] < results[0].sums["mlm_loss"]


def test_pretrain_on_packed_tokenizer_json_records(tmp_path, packed_records, small_bpe_tokenizer):
    """The pipeline's packed MLM-only rows (1,024 tokens, several documents a row, a byte-level BPE
    tokenizer.json, 30% masking) train ModernBERT end to end: one attention segment per document,
    and the held-out loss is measured on the same layout. BERT is refused on them."""
    from bertdist.data import load_manifest

    manifest = load_manifest(packed_records)
    args = [str(RECIPE), f"run_dir={tmp_path}", f"data.train_manifest={packed_records}",
            f"data.vocab_file={small_bpe_tokenizer}", "data.max_seq_length=1024", "model.max_position_embeddings=1024",
            "data.micro_batch_size=2",
            "data.global_batch_size=4", "data.mask_prob=0.3", "schedule.total_steps=6", "logging.progress=none",
            "eval.at_start=true", "eval.max_sequences=4", "eval.micro_batch_size=2", "checkpoint.every_steps=0"]
    res = run_pretrain(1, args)
    assert_ok(res)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) for r in rows)
    evals = metrics(tmp_path, "eval")
    assert len(evals) == 2 and all(math.isfinite(e["mlm_loss"]) for e in evals), evals
    assert manifest["records"]["packing"]["documents"]  # the rows hold several documents each
    bert = [str(REPO / "configs" / "pretrain" / "tiny.yaml"), *args[1:], f"run_dir={tmp_path / 'bert'}"]
    refused = run_pretrain(1, bert)
    assert refused.returncode != 0 and "are packed" in refused.stderr + refused.stdout


@pytest.mark.slow  # three two-rank torchrun runs
def test_two_rank_kill_and_resume_on_packed_records_is_bitwise_exact(tmp_path, packed_records, small_bpe_tokenizer):
    """The tiny recipe with StableAdamW on packed rows (several documents a row, one attention
    segment each) on two ranks: SIGKILLed after step 7 (the last checkpoint at 4), then ``--resume auto``. Steps 5-12
    repeat the uninterrupted run's losses and gradient norms bitwise, and step 12's weights,
    optimizer state and schedule are the same bytes. The run's export (it trained on a
    tokenizer.json) carries the tokenizer and matches transformers."""
    from bertdist.cli.main import main
    from bertdist.export.sources import load_pretrained

    def args(run):
        return [str(RECIPE), f"run_dir={run}", f"data.train_manifest={packed_records}",
                f"data.vocab_file={small_bpe_tokenizer}", "data.max_seq_length=1024",
                "model.max_position_embeddings=1024", "data.micro_batch_size=2", "data.global_batch_size=4",
                "schedule.total_steps=12", "schedule.warmup_steps=2", "checkpoint.every_steps=4",
                "checkpoint.keep_last_n=0", "eval.every_steps=0", "eval.at_end=false", "logging.every_steps=1",
                "logging.progress=none", *STABLE_ADAMW]

    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    assert_ok(run_pretrain(2, args(ref_dir)))
    keys = ("loss", "mlm_loss", "mlm_acc", "grad_norm", "lr")
    ref = {r["step"]: tuple(r[k] for k in keys) for r in metrics(ref_dir)}
    assert sorted(ref) == list(range(1, 13)) and metrics(ref_dir, "run")[0]["world_size"] == 2
    res = run_pretrain(2, args(run_dir), faults=["--kill-after-step", "7"])
    assert res.returncode != 0  # rank 0 was SIGKILLed
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert_ok(run_pretrain(2, [*args(run_dir), "--resume", "auto"]))
    rows = metrics(run_dir)
    resumed = rows[[r["step"] for r in rows].index(7) + 1:]
    got = [(r["step"], tuple(r[k] for k in keys)) for r in resumed]
    assert got == [(s, ref[s]) for s in range(5, 13)]
    assert [r["backend"] for r in metrics(run_dir, "attention")] == ["sdpa", "sdpa"]  # the same on resume

    tag = "checkpoints/step_00000012"
    a, b = load_pretrained(ref_dir / tag).state_dict, load_pretrained(run_dir / tag).state_dict
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    x, y = (torch.load(d / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
            for d in (ref_dir, run_dir))
    for part in ("module", "optimizer", "lr_scheduler", "global_steps", "bertdist"):  # ZeRO 0: all in one file
        assert _tensors_equal(x[part], y[part]), part
    # the run trained on a tokenizer.json: its export carries the tokenizer, and transformers agrees
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0, out.getvalue()
    assert "tokenizer.json" in out.getvalue() and "-> OK" in out.getvalue(), out.getvalue()
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == small_bpe_tokenizer.read_bytes()


def _tensors_equal(x, y) -> bool:
    """Nested checkpoint contents equal, tensors bitwise."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_tensors_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_tensors_equal(a, b) for a, b in zip(x, y))
    return x == y
