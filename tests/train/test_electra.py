"""ELECTRA replaced-token detection (bertdist/model/electra.py, bertdist/train/electra_objective.py).

- the loss against a hand computation on a tiny batch with fixed sampled tokens, one of them equal
  to the original (which counts as original), and padding (which does not count);
- sampling: no gradient reaches the generator through the samples; both samplers draw from
  softmax(logits / T); the RNG's state survives the checkpoint's JSON;
- the embeddings are one set of parameters, shared by both towers and the generator's output layer;
- the unpadded encoder and the dense generator head give the same outputs;
- the config section, its errors (every number), the resume / new-phase checks, FLOPs and
  parameter counts of both towers, `--plan` of the three recipes;
- one optimizer step under ZeRO 0 (LAMB, fp32) and ZeRO 3 (AdamW, bf16), with the logged metrics
  and an export of the ZeRO-3 checkpoint;
- slow: 2 gloo ranks on the bundled samples, SIGKILL after step 19 and --resume from step 8:
  losses, metrics, sampling-RNG states and step-16 weights equal the killed run's bitwise; the
  run exports to transformers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import shutil

import pytest
import torch

from bertdist.config import ConfigError
from bertdist.model import IGNORE_INDEX, ElectraConfig
from bertdist.model.electra import ElectraForPreTraining, sample_tokens
from bertdist.train.config import PretrainElectraConfig, load_train_config
from bertdist.train.electra_objective import combined_loss
from bertdist.train.objective import check_checkpoint
from tests.train.conftest import REPO, assert_ok, metrics, run_pretrain, tiny_args, tiny_cfg

ELECTRA_TINY = REPO / "configs" / "pretrain" / "electra-tiny.yaml"


def _config(**kw) -> ElectraConfig:
    base = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                kernels="reference", embedding_size=8, generator_hidden_size=12, generator_num_hidden_layers=1,
                generator_num_attention_heads=1, generator_intermediate_size=24)
    return ElectraConfig(preset="custom", **{**base, **kw})


def _batch():
    """Two rows, the second padded; the originals, the masked input and the labels."""
    original = torch.tensor([[2, 11, 12, 13, 14, 3], [2, 21, 22, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    labels = torch.full_like(original, IGNORE_INDEX)
    for r, c in ((0, 1), (0, 3), (1, 2)):
        labels[r, c] = original[r, c]
    masked = original.clone()
    masked[0, 1] = masked[1, 2] = 4  # [MASK]; (0, 3) is a predicted position kept as it was
    return original, masked, mask, labels


class FixedSampler:
    def __init__(self, tokens):
        self.tokens, self.seen = torch.tensor(tokens), None

    def __call__(self, logits):
        self.seen = logits
        return self.tokens


def _log_softmax(row: list[float], i: int) -> float:
    m = max(row)
    return row[i] - m - math.log(sum(math.exp(v - m) for v in row))


def test_the_discriminator_learns_replacements_it_can_tell_apart():
    """The labels line up with the corrupted input: with replacements drawn from tokens the text
    never holds (ids 20-39 into text of ids 5-19), a tiny discriminator finds nearly all of them in
    a few dozen steps. (With the generator's own samples, a plausible word for the context, it
    needs far longer: docs/pretraining.md, "Which objective to choose".)"""
    torch.manual_seed(0)
    model = ElectraForPreTraining(_config(max_position_embeddings=32), device_type="cpu")
    model.sampler = lambda logits: torch.randint(20, 40, (logits.shape[0],))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        start = torch.randint(5, 20, (32, 1))
        text = 5 + (start + torch.arange(24)) % 15  # each row counts up through ids 5-19
        labels = torch.where(torch.rand(text.shape) < 0.15, text, torch.full_like(text, IGNORE_INDEX))
        masked = torch.where(labels != IGNORE_INDEX, torch.full_like(text, 4), text)
        out = model(masked, torch.ones_like(text), torch.zeros_like(text), labels)
        opt.zero_grad()
        (out.mlm_loss + 50 * out.disc_loss).backward()
        opt.step()
    found = (out.discriminator_logits > 0) & out.replaced
    accuracy = ((out.discriminator_logits > 0) == out.replaced).float().mean().item()
    base = 1 - out.replaced.float().mean().item()
    assert found.sum() >= 0.9 * out.replaced.sum() and accuracy > base + 0.1, (accuracy, base)


def test_loss_matches_hand_computation():
    torch.manual_seed(0)
    model = ElectraForPreTraining(_config(), device_type="cpu").eval()
    original, masked, mask, labels = _batch()
    # masked positions in flat order: (0, 1), (0, 3), (1, 2); the second sample equals the original
    model.sampler = FixedSampler([30, 13, 25])
    with torch.no_grad():
        out = model(masked, mask, torch.zeros_like(masked), labels)
        gen_logits = model.generator(masked, mask)
        corrupted = torch.tensor([[2, 30, 12, 13, 14, 3], [2, 21, 25, 3, 0, 0]])
        disc_logits = model.discriminator(corrupted, mask)
    assert torch.equal(out.corrupted_ids, corrupted)
    expected = torch.zeros(2, 6, dtype=torch.bool)
    expected[0, 1] = expected[1, 2] = True  # (0, 3) sampled its original: not replaced
    assert torch.equal(out.replaced, expected)
    assert torch.equal(out.real, mask.bool())
    positions = [(0, 1), (0, 3), (1, 2)]
    rows = [gen_logits[r, c].tolist() for r, c in positions]
    assert torch.allclose(out.prediction_logits, torch.tensor(rows), atol=1e-6)
    assert not model.sampler.seen.requires_grad and model.sampler.seen.dtype == torch.float32
    mlm = -sum(_log_softmax(row, int(original[r, c])) for row, (r, c) in zip(rows, positions)) / 3
    z = disc_logits.tolist()
    bce = [math.log1p(math.exp(-z[r][c])) if expected[r, c] else math.log1p(math.exp(z[r][c]))
           for r in range(2) for c in range(6) if mask[r, c]]
    disc = sum(bce) / 10  # ten real tokens; the two padding positions do not count
    assert out.mlm_loss.item() == pytest.approx(mlm, rel=1e-5)
    assert out.disc_loss.item() == pytest.approx(disc, rel=1e-5)
    assert torch.allclose(out.discriminator_logits, disc_logits, atol=1e-6)
    loss = combined_loss(PretrainElectraConfig(), out).loss  # the paper's 1 x MLM + 50 x BCE
    assert loss.item() == pytest.approx(mlm + 50 * disc, rel=1e-5)
    weighted = combined_loss(PretrainElectraConfig(gen_weight=2.0, disc_weight=7.0), out).loss
    assert weighted.item() == pytest.approx(2 * mlm + 7 * disc, rel=1e-5)


def test_no_gradient_reaches_the_generator_through_the_samples():
    torch.manual_seed(1)
    model = ElectraForPreTraining(_config(), device_type="cpu")
    _, masked, mask, labels = _batch()
    model.sampler.generator = torch.Generator().manual_seed(3)
    out = model(masked, mask, None, labels)
    combined_loss(PretrainElectraConfig(gen_weight=0.0, disc_weight=1.0), out).loss.backward()
    gen_only = {n: p for n, p in model.generator.named_parameters() if "embeddings." not in n}
    assert gen_only and all(p.grad is None or not p.grad.any() for p in gen_only.values())
    assert model.embeddings.word_embeddings.weight.grad.any()  # shared: the discriminator trains them
    assert all(p.grad is not None and p.grad.any() for n, p in model.discriminator.named_parameters()
               if "embeddings_project" in n or "dense_prediction" in n)


@pytest.mark.parametrize("method", ["gumbel", "multinomial"])
def test_samplers_draw_from_the_tempered_softmax(method):
    logits = torch.tensor([[2.0, 0.0, -1.0]]).repeat(20000, 1)
    for t in (1.0, 2.0):
        g = torch.Generator().manual_seed(0)
        freq = torch.bincount(sample_tokens(logits, t, method, g), minlength=3).float() / 20000
        assert torch.allclose(freq, torch.softmax(logits[0] / t, -1), atol=0.015), (t, freq)
    a = sample_tokens(logits[:50], 1.0, method, torch.Generator().manual_seed(5))
    b = sample_tokens(logits[:50], 1.0, method, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    assert sample_tokens(logits[:0], 1.0, method).shape == (0,)


def test_the_sampling_rng_survives_the_checkpoint_json():
    from bertdist.train.checkpoint import rng_state, seed_generators, set_rng_state

    g = torch.Generator()
    seed_generators({"electra_sampling": g}, 42, 1, 0)
    torch.rand(7, generator=g)
    state = json.loads(json.dumps(rng_state({"electra_sampling": g})))
    expected = torch.rand(5, generator=g)
    fresh = torch.Generator()
    assert set_rng_state(state, {"electra_sampling": fresh, "other": torch.Generator()}) == ["other"]
    assert torch.equal(torch.rand(5, generator=fresh), expected)
    other = torch.Generator()
    seed_generators({"electra_sampling": other}, 42, 0, 0)  # another rank: another stream
    seed_generators({"electra_sampling": g}, 42, 1, 0)
    assert not torch.equal(torch.rand(5, generator=other), torch.rand(5, generator=g))


def test_embeddings_are_one_set_of_parameters():
    model = ElectraForPreTraining(_config(), device_type="cpu")
    d, g = model.discriminator.electra, model.generator.electra
    assert d.embeddings is g.embeddings
    assert g.embeddings.word_embeddings.weight is model.generator.generator_lm_head.weight
    names = [n for n, _ in model.named_parameters()]
    assert sum("word_embeddings" in n for n in names) == 1 and not any(n.startswith("generator.electra.embeddings.")
                                                                       for n in names)
    assert d.embeddings_project.weight.shape == (16, 8) and g.embeddings_project.weight.shape == (12, 8)
    assert d.embeddings_project.weight is not g.embeddings_project.weight
    # one optimizer step moves the shared table once, seen the same from every place that reads it
    _, masked, mask, labels = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    combined_loss(PretrainElectraConfig(), model(masked, mask, None, labels)).loss.backward()
    before = d.embeddings.word_embeddings.weight.detach().clone()
    opt.step()
    sd = model.state_dict()
    assert not torch.equal(before, sd["discriminator.electra.embeddings.word_embeddings.weight"])
    for key in ("generator.electra.embeddings.word_embeddings.weight", "generator.generator_lm_head.weight"):
        assert torch.equal(sd[key], sd["discriminator.electra.embeddings.word_embeddings.weight"])


def test_unpadded_encoder_and_dense_head_match_the_padded_sparse_model():
    torch.manual_seed(2)
    base = ElectraForPreTraining(_config(), device_type="cpu").eval()
    _, masked, mask, labels = _batch()
    outs = []
    for kw in ({}, {"unpad": True}, {"sparse_mlm_head": False}):
        model = ElectraForPreTraining(_config(**kw), device_type="cpu").eval()
        model.load_state_dict(base.state_dict())
        model.sampler.generator = torch.Generator().manual_seed(9)
        with torch.no_grad():
            outs.append(model(masked, mask, None, labels))
    for o in outs[1:]:
        assert torch.allclose(o.prediction_logits, outs[0].prediction_logits, atol=1e-5)
        assert torch.equal(o.sampled_ids, outs[0].sampled_ids)
        assert torch.allclose(o.discriminator_logits[mask.bool()], outs[0].discriminator_logits[mask.bool()],
                              atol=1e-5)


def test_config_section_and_its_errors():
    small = load_train_config(REPO / "configs" / "pretrain" / "electra-small.yaml").model_config
    assert (small.hidden_size, small.num_attention_heads, small.intermediate_size, small.embedding_width) == \
        (256, 4, 1024, 128)
    assert (small.generator_hidden_size, small.generator_num_attention_heads, small.generator_intermediate_size,
            small.generator_num_hidden_layers) == (64, 1, 256, 12)
    base = load_train_config(REPO / "configs" / "pretrain" / "electra-base.yaml").model_config
    assert (base.generator_hidden_size, base.generator_num_attention_heads, base.generator_intermediate_size,
            base.embedding_width) == (256, 4, 1024, 768)
    tiny = load_train_config(ELECTRA_TINY, ["electra.generator_hidden_size=48", "electra.generator_num_hidden_layers=1"])
    assert (tiny.model_config.generator_hidden_size, tiny.model_config.generator_num_hidden_layers,
            tiny.model_config.generator_intermediate_size) == (48, 1, 192)
    assert load_train_config(REPO / "configs" / "pretrain" / "tiny.yaml").electra is None
    with pytest.raises(ConfigError, match=r"generator's hidden size 40 .* not divisible by its 3 heads .* 40 / 3 = "
                                          r"13.333"):
        load_train_config(ELECTRA_TINY, ["electra.generator_hidden_size=40", "electra.generator_num_attention_heads=3"])
    with pytest.raises(ConfigError, match=r"round\(0.001 x 128\) = 0"):
        load_train_config(ELECTRA_TINY, ["electra.generator_size_ratio=0.001"])
    with pytest.raises(ConfigError, match="distill and electra are both set"):
        load_train_config(ELECTRA_TINY, ["distill.teacher=t"])
    with pytest.raises(ConfigError, match=r"not all 0, got \{'gen_weight': 0.0, 'disc_weight': 0.0\}"):
        load_train_config(ELECTRA_TINY, ["electra.gen_weight=0", "electra.disc_weight=0"])
    with pytest.raises(ConfigError, match="electra.temperature must be positive, got 0"):
        load_train_config(ELECTRA_TINY, ["electra.temperature=0"])
    with pytest.raises(ConfigError, match="unknown key 'lambda'"):
        load_train_config(ELECTRA_TINY, ["electra.lambda=50"])
    with pytest.raises(ConfigError, match=r"not one of \['multinomial', 'gumbel'\]"):
        load_train_config(ELECTRA_TINY, ["electra.sampling=argmax"])


def test_resume_and_new_phase_checks(tmp_path):
    from bertdist.config import save_config
    from bertdist.train.checkpoint import CONFIG_FILE

    cfg = load_train_config(ELECTRA_TINY)
    (tmp_path / "step_00000010").mkdir()
    save_config(cfg, tmp_path / "step_00000010" / CONFIG_FILE)
    check_checkpoint(cfg, tmp_path, "step_00000010", "resume")
    changed = dataclasses.replace(cfg, electra=dataclasses.replace(cfg.electra, disc_weight=20.0))
    with pytest.raises(ConfigError, match=r"electra section differs(.|\n)*'disc_weight': 50.0(.|\n)*'disc_weight': 20.0"):
        check_checkpoint(changed, tmp_path, "step_00000010", "resume")
    check_checkpoint(changed, tmp_path, "step_00000010", "init")  # a new phase may change the weights ...
    wider = load_train_config(ELECTRA_TINY, ["electra.generator_size_ratio=0.5"])
    with pytest.raises(ConfigError, match="generator hidden 32, .* this config trains ELECTRA .* generator hidden 64"):
        check_checkpoint(wider, tmp_path, "step_00000010", "init")  # ... not the model
    bert = load_train_config(REPO / "configs" / "pretrain" / "tiny.yaml")
    with pytest.raises(ConfigError, match="it holds ELECTRA .* this config trains a BERT"):
        check_checkpoint(bert, tmp_path, "step_00000010", "init")
    with pytest.raises(ConfigError, match="config None"):
        check_checkpoint(bert, tmp_path, "step_00000010", "resume")


def test_flops_and_parameters_count_both_towers():
    from bertdist.model import forward_flops_per_sequence, train_flops_per_sequence
    from bertdist.model.bert import count_parameters
    from bertdist.train.memory import bert_parameter_count

    cfg = _config()
    seq, p = 6, 3
    f = forward_flops_per_sequence(cfg, seq, p)
    assert f["discriminator_encoder_gemm"] == 2 * 2 * seq * (4 * 16 * 16 + 2 * 16 * 32)
    assert f["generator_encoder_gemm"] == 1 * 2 * seq * (4 * 12 * 12 + 2 * 12 * 24)
    assert f["discriminator_attention"] == 2 * 2 * 2 * seq * seq * 16
    assert f["generator_attention"] == 1 * 2 * 2 * seq * seq * 12
    assert f["discriminator_head"] == 2 * seq * (16 * 16 + 16)
    assert f["generator_mlm_head"] == 2 * p * (12 * 8 + 8 * 40)
    assert f["embeddings_project"] == 2 * seq * 8 * 16 + 2 * seq * 8 * 12
    assert f["total"] == sum(v for k, v in f.items() if k != "total")
    assert train_flops_per_sequence(cfg, seq, p) == 3 * f["total"]
    assert forward_flops_per_sequence(cfg.without_generator(), seq)["total"] < f["total"]
    for c in (cfg, cfg.without_generator(), _config(embedding_size=None)):
        assert bert_parameter_count(c) == count_parameters(ElectraForPreTraining(c, device_type="cpu"))


@pytest.mark.parametrize("recipe", ["electra-tiny", "electra-small", "electra-base"])
def test_plan_of_the_recipes(recipe):
    from bertdist.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["pretrain", str(REPO / "configs" / "pretrain" / f"{recipe}.yaml"), "--plan", "--json",
                     "--device-profile", "h100"]) == 0
    plan = json.loads(out.getvalue())
    cfg = load_train_config(REPO / "configs" / "pretrain" / f"{recipe}.yaml").model_config
    m = plan["model"]
    assert m["type"] == "electra" and m["embedding_size"] == cfg.embedding_width
    assert m["generator"] == {"layers": cfg.generator_num_hidden_layers, "hidden_size": cfg.generator_hidden_size,
                              "heads": cfg.generator_num_attention_heads,
                              "intermediate_size": cfg.generator_intermediate_size}
    from bertdist.train.memory import electra_parameter_count

    vocab = plan["vocab_size"]["value"]
    assert plan["memory"]["parameters"] == electra_parameter_count(dataclasses.replace(cfg, vocab_size=vocab))
    assert plan["recipe_config"]["electra"]["disc_weight"] == 50.0
    assert 0 < plan["memory"]["total_checkpointed_gib"] <= plan["memory"]["total_gib"]


@pytest.mark.parametrize("setup", [["deepspeed.zero_stage=0"],
                                   ["optimizer.name=adamw", "deepspeed.zero_stage=3", "deepspeed.precision=bf16"]],
                         ids=["zero0-lamb-fp32", "zero3-adamw-bf16"])
def test_one_step_and_an_export_of_the_checkpoint(setup, tmp_path, group, sample_records, small_vocab):
    from bertdist.data import continuation_mask
    from bertdist.export.sources import load_pretrained
    from bertdist.model import train_flops_per_sequence
    from bertdist.train.checkpoint import CheckpointManager
    from bertdist.train.electra_objective import ReplacedTokenDetection
    from bertdist.train.engine import build_engine
    from bertdist.train.loader import LoaderState, PretrainingLoader, open_training_records
    from bertdist.train.restore import RestorePlan, new_state, restore
    from bertdist.train.step import StepRunner, evaluate, step_metrics, train_step

    cfg = tiny_cfg(tmp_path, sample_records, small_vocab, "model.hidden_dropout_prob=0",
                   "model.attention_probs_dropout_prob=0", "electra.embedding_size=64", *setup)
    built = build_engine(cfg, RestorePlan("fresh"), 1, 1, "cpu")
    module = built.engine.module
    objective = ReplacedTokenDetection(cfg, module, torch.device("cpu"))
    restore(built.engine, built.scheduler, RestorePlan("fresh"), cfg, 0, new_state(cfg, 1, 1), objective.generators)
    records = open_training_records(str(sample_records), cfg.data.vocab_file, cfg.data.max_seq_length)
    loader = PretrainingLoader(records, cfg.data, rank=0, world_size=1, grad_accum=1,
                               continuation=continuation_mask(cfg.data.vocab_file))
    model_cfg = cfg.model_config
    runner = StepRunner.for_run(built.engine, cfg, torch.device("cpu"), 1, objective)
    steps = loader.steps(LoaderState())
    try:
        batch = next(steps)[0]
    finally:
        steps.close()
    rng_before = objective.generator.get_state()
    res = train_step(runner, batch, 1, stop_requested=False)
    assert not torch.equal(objective.generator.get_state(), rng_before)  # the samples came from its stream
    s = res.sums
    assert s["loss"] == pytest.approx(s["mlm_loss"] + 50 * s["disc_loss"], rel=1e-5)
    assert s["nsp_count"] == 0 and s["disc_count"] == int(batch[0]["attention_mask"].sum())
    assert 0 < s["replaced_count"] <= s["mlm_count"]
    m = step_metrics(res, 1.0, 1, 0.0, 1.0, 0, 0)
    assert 0 < m["replaced_rate"] <= s["mlm_count"] / s["disc_count"] < 0.2  # at most the masked share
    assert 0 <= m["disc_acc"] <= 1 and m["disc_loss"] == s["disc_loss"]
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    width = batch[0]["input_ids"].shape[1]
    gen_head = 3 * 2 * (32 * 64 + 64 * model_cfg.vocab_size)
    assert s["flops"] == pytest.approx(16 * train_flops_per_sequence(model_cfg, width, 0) + gen_head * s["mlm_count"])
    assert s["flops"] > 16 * train_flops_per_sequence(cfg.model, width, 0)
    stream = objective.generator.get_state()
    ev = evaluate(built.engine, [batch[0]], torch.device("cpu"), objective)
    assert torch.equal(objective.generator.get_state(), stream)  # evaluation draws from its own seeded stream
    assert evaluate(built.engine, [batch[0]], torch.device("cpu"), objective) == ev  # the same every time
    assert {"mlm_loss", "mlm_acc", "disc_loss", "disc_acc", "replaced_rate"} <= set(ev)
    ckpt = CheckpointManager(tmp_path / "ckpt", 0, 0, 1)
    state = dataclasses.replace(new_state(cfg, 1, 1), step=1)
    tag = ckpt.save(built.engine, state, cfg, objective.generators)
    saved = json.loads((tmp_path / "ckpt" / tag / "rng_state_rank0.json").read_text())
    assert "electra_sampling" in saved["generators"]
    w = load_pretrained(tmp_path / "ckpt")
    assert isinstance(w.config, ElectraConfig) and w.config.generator_hidden_size == 32
    reference = ElectraForPreTraining(dataclasses.replace(w.config, kernels="reference"), device_type="cpu")
    reference.load_state_dict(w.state_dict, strict=True)  # every key, the shared ones under both names


@pytest.mark.slow
def test_two_ranks_kill_and_resume_is_bitwise_exact(tmp_path, train_records, small_vocab):
    """One run killed after step 19 (checkpoints at 8 and 16), resumed from step 8: it replays steps
    9..19 exactly as the killed run took them, sampling included, and writes the same step 16."""
    extra = ["schedule.total_steps=24", "checkpoint.every_steps=8", "checkpoint.keep_last_n=0", "eval.every_steps=0",
             "eval.at_start=false", "eval.max_sequences=64"]
    args = [str(ELECTRA_TINY), *tiny_args(tmp_path, train_records, small_vocab, *extra)[1:]]
    res = run_pretrain(2, args, faults=["--kill-after-step", "19"])
    assert res.returncode != 0
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_00000016"
    killed = {r["step"]: r for r in metrics(tmp_path)}
    assert set(range(1, 20)) <= set(killed)
    first_16 = tmp_path / "first_step_00000016"
    shutil.copytree(ckpt / "step_00000016", first_16)
    assert_ok(run_pretrain(2, [*args, "--resume", str(ckpt / "step_00000008")]))
    rows = metrics(tmp_path)
    resumed = rows[[r["step"] for r in rows].index(19) + 1:]
    assert [r["step"] for r in resumed] == list(range(9, 25))  # no replayed or skipped step
    keys = ("loss", "mlm_loss", "mlm_acc", "disc_loss", "disc_acc", "replaced_rate", "grad_norm", "lr")
    diff = [(r["step"], k, r[k], killed[r["step"]][k]) for r in resumed if r["step"] <= 19 for k in keys
            if r[k] != killed[r["step"]][k]]
    assert not diff, diff
    assert all(0 < r["replaced_rate"] < 0.2 for r in rows)
    for rank in (0, 1):  # the sampling RNG (and every other) saved at step 16 is the same state
        name = f"rng_state_rank{rank}.json"
        assert json.loads((ckpt / "step_00000016" / name).read_text()) == json.loads((first_16 / name).read_text())
    from bertdist.export.sources import load_pretrained

    before, after = load_pretrained(first_16).state_dict, load_pretrained(ckpt / "step_00000016").state_dict
    assert before.keys() == after.keys() and [k for k in before if not torch.equal(before[k], after[k])] == []
    evals = metrics(tmp_path, "eval")
    assert evals and {"disc_loss", "disc_acc", "replaced_rate"} <= set(evals[-1])
    assert list((tmp_path / "tensorboard").glob("events.*"))
    # the run exports: the discriminator for transformers, the generator beside it
    from bertdist.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["export", str(tmp_path), "--out", str(tmp_path / "hf")]) == 0, out.getvalue()
    assert "-> OK" in out.getvalue()
    from transformers import ElectraForMaskedLM, ElectraForPreTraining as HFElectra

    disc, info = HFElectra.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    gen, info = ElectraForMaskedLM.from_pretrained(tmp_path / "hf" / "generator", output_loading_info=True)
    assert not any(info.values()), info
    assert disc.config.embedding_size == 64 and gen.config.hidden_size == 32
