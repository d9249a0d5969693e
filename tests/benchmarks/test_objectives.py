"""benchmarks/objectives.py: the equal-FLOP step counts, the budget points and the seed-spread
verdicts (pure helpers; nothing is trained)."""
import json
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def objectives(load_benchmark):
    return load_benchmark("objectives")


def test_equal_flop_steps_spend_the_budget_in_multiples_of_the_points(objectives):
    assert objectives.equal_flop_steps(600 * 100.0, 100.0) == 600
    # a step 25% dearer gets 480 steps; 600 / 1.07 = 560.7 rounds to the nearest multiple of 3, 561
    assert objectives.equal_flop_steps(600 * 100.0, 125.0) == 480
    assert objectives.equal_flop_steps(600 * 100.0, 107.0) == 561
    # never fewer than one step per point
    assert objectives.equal_flop_steps(10.0, 100.0) == 3
    with pytest.raises(ValueError, match="must be positive"):
        objectives.equal_flop_steps(0.0, 100.0)


def test_budget_points_fall_on_whole_steps(objectives):
    assert objectives.budget_points(600) == [200, 400, 600]
    assert objectives.budget_points(477) == [159, 318, 477]
    with pytest.raises(ValueError, match="do not split into 3 equal parts"):
        objectives.budget_points(100)


def test_the_flop_count_is_the_model_files_for_each_objective(objectives):
    from bertdist.model import BertConfig
    from bertdist.model.flops import train_flops_per_sequence
    from bertdist.train.config import PretrainElectraConfig

    bert = BertConfig.from_preset("mini", vocab_size=30522)
    electra = PretrainElectraConfig().model_config(bert)
    assert objectives.predicted_per_sequence(128, 0.15) == 19
    assert objectives.predicted_per_sequence(128, 0.30) == 38
    assert objectives.step_flops(bert, 32, 128, 19) == 32 * train_flops_per_sequence(bert, 128, 19)
    # the second tower costs FLOPs, and 30% masking predicts twice the positions: both get fewer steps
    mlm15, mlm30 = (objectives.step_flops(bert, 32, 128, p) for p in (19, 38))
    rtd = objectives.step_flops(electra, 32, 128, 19)
    assert mlm15 < rtd < mlm30
    budget = 600 * mlm15
    assert objectives.equal_flop_steps(budget, rtd) < 600
    assert objectives.equal_flop_steps(budget, mlm30) < objectives.equal_flop_steps(budget, rtd)


def test_the_arms_plan_uses_the_recipes_models(objectives):
    args = objectives.parse_args(["--out-md", "/tmp/unused.md", "--budget-steps", "600"])
    plan = objectives.plan_arms(args)
    assert plan["mlm_nsp"]["steps"] == 600 and plan["span"]["steps"] == 600
    assert plan["electra"]["steps"] < 600 and plan["mlm30"]["steps"] < plan["electra"]["steps"]
    for p in plan.values():
        assert p["points"][-1] == p["steps"]
        assert abs(p["flops"] - p["budget_flops"]) <= 1.5 * p["flops_per_step"]  # rounding to a multiple of 3


def test_seed_means_need_every_task(objectives):
    per_task = {"sst2": {"1": 80.0, "2": 82.0}, "stsb": {"1": 20.0, "2": 30.0}, "author": {"1": 90.0}}
    assert objectives.seed_means(per_task, ["sst2", "stsb"]) == {"1": 50.0, "2": 56.0}
    assert objectives.seed_means(per_task, ["sst2", "stsb", "author"]) == {"1": 190.0 / 3}
    s = objectives.spread([50.0, 56.0])
    assert (s["mean"], s["min"], s["max"], s["half_range"], s["n"]) == (53.0, 50.0, 56.0, 3.0, 2)


def test_separated_means_the_seed_ranges_do_not_overlap(objectives):
    assert objectives.separated([60.0, 61.0], [58.0, 59.5]) == 1
    assert objectives.separated([58.0, 59.5], [60.0, 61.0]) == -1
    assert objectives.separated([60.0, 62.0], [59.0, 60.5]) == 0  # overlap
    assert objectives.separated([60.0, 61.0], [61.0, 62.0]) == 0  # touching is not beyond the spread
    assert objectives.separated([60.0], [50.0, 51.0]) == 0  # one seed: no spread to compare with


def test_target_verdict_needs_the_margin_and_the_separation(objectives):
    met = objectives.target_verdict([63.0, 64.0], [60.0, 61.0])
    assert met["verdict"] == "met" and met["difference"] == pytest.approx(3.0) and met["separated"]
    # 2.5 points apart on average, but the ranges overlap: NOT met
    wide = objectives.target_verdict([60.0, 67.0], [59.0, 63.0])
    assert wide["verdict"] == "NOT met" and not wide["separated"] and "within the seed spread" in wide["why"]
    # separated, but by less than the margin: NOT met
    close = objectives.target_verdict([61.5, 62.0], [60.0, 60.5])
    assert close["verdict"] == "NOT met" and close["separated"] and "< 2.0" in close["why"]
    # the wrong way round: NOT met
    lower = objectives.target_verdict([55.0, 56.0], [60.0, 61.0])
    assert lower["verdict"] == "NOT met" and "the other way" in lower["why"]
    assert objectives.target_verdict([63.0], [60.0, 61.0])["verdict"] == "not evaluable"


def test_pairwise_orders_each_pair_and_flags_the_separated_ones(objectives):
    rows = objectives.pairwise({"mlm_nsp": [60.0, 61.0], "electra": [64.0, 65.0], "span": [60.5, 62.0]})
    by_pair = {(r["higher"], r["lower"]): r for r in rows}
    assert set(by_pair) == {("electra", "mlm_nsp"), ("span", "mlm_nsp"), ("electra", "span")}
    assert by_pair[("electra", "mlm_nsp")]["separated"] and by_pair[("electra", "span")]["separated"]
    assert not by_pair[("span", "mlm_nsp")]["separated"]
    assert by_pair[("span", "mlm_nsp")]["difference"] == pytest.approx(0.75)


def test_summary_and_markdown_from_partial_results(objectives):
    """A run killed after some fine-tunes still summarises and renders what it has."""
    pretrain = {name: {"label": objectives.ARMS[name].label, "recipe": objectives.ARMS[name].recipe,
                       "flops_per_step": 1e11, "steps": 6, "points": [2, 4, 6], "flops": 6e11, "budget_flops": 6e11,
                       "trainer_flops": 6e11, "median_step_s": 0.5, "train_s": 3.0, "wall_s": 10.0,
                       "first_loss": 10.0, "last_loss": 8.0} for name in ("mlm_nsp", "electra")}

    def scores(base):
        return {t: {"1": {"score": base, "wall_s": 1.0}, "2": {"score": base + 1, "wall_s": 1.0}}
                for t in ("sst2", "stsb", "author")}

    results = {"command": "python benchmarks/objectives.py", "date": "today", "machine": "test", "status": "partial",
               "args": {"tasks": ["sst2", "stsb", "author"], "preset": "mini", "batch": 32, "seq": 128, "lr": 1e-3,
                        "warmup_fraction": 0.06, "seeds": 2},
               "data": {"nsp": {"rows": 10, "tokens": 1280, "documents": 1, "build_s": 1.0, "inputs": ["wiki:x"]}},
               "pretrain": pretrain, "finetune_settings": {"learning_rate": 1e-4, "batch_size": 32, "epochs": 2.0,
                                                           "max_seq_length": 64},
               "task_rows": {t: {"train": 100, "dev": 50} for t in ("sst2", "stsb", "author")},
               "finetune": {"electra": {"3/3": scores(70.0)}, "mlm_nsp": {"3/3": scores(60.0)}},
               "finetune_count": 12, "finetune_wall_s": 12.0, "wall_s": 60.0}
    results["summary"] = objectives.summarize(results)
    assert results["summary"]["target"]["verdict"] == "met"
    assert results["summary"]["table"]["electra"]["3/3"]["mean"]["mean"] == pytest.approx(70.5)
    assert results["summary"]["table"]["electra"]["1/3"] == {}
    md = objectives.render_md(results)
    assert "**met**" in md and "1 of 1" in md and "| (d) ELECTRA (RTD, generator 1/4) | 1/3 |" in md
    assert "vocab bert-base-uncased-vocab.txt, seq 128" in md
    results["args"].update(vocab="/w/vocab/wordpiece8192-full.txt", vocab_size=8192)
    assert ("vocab wordpiece8192-full.txt (WordPiece, 8,192 tokens, trained on this text by the pipeline's vocab "
            "trainer), seq 128") in objectives.render_md(results)


def test_a_corpus_vocab_is_trained_once_with_berts_ids(objectives, tmp_path, monkeypatch):
    """--vocab-size: the pipeline's trainer over the pretraining text, BERT's special ids, cached;
    records and the initialisation are named by the vocab they use."""
    books = tmp_path / "books"
    books.mkdir()
    words = "the harbour mill river abbey market bridge forest tower field castle story".split()
    (books / "a.txt").write_text("\n".join(" ".join(words[(i * k) % len(words)] for k in range(1, 9)) + "."
                                           for i in range(400)), encoding="utf-8")
    monkeypatch.setattr(objectives, "corpus_inputs", lambda shared, work, mb: ([f"books:{books}"], "mini"))
    vocab = objectives.corpus_vocab(tmp_path, tmp_path / "w", None, 150)
    tokens = vocab.read_text(encoding="utf-8").split("\n")[:-1]
    assert vocab.name == "wordpiece150-full.txt" and 110 < len(tokens) <= 150
    assert tokens[0] == "[PAD]" and tokens[100:104] == ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert set("harbou") <= set(tokens)
    stamp = vocab.stat().st_mtime_ns
    assert objectives.corpus_vocab(tmp_path, tmp_path / "w", None, 150) == vocab and vocab.stat().st_mtime_ns == stamp
    assert objectives.vocab_tag(objectives.VOCAB) == "" and objectives.vocab_tag(vocab) == "-wordpiece150-full"


def _records(folder, rows):
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({
        "splits": {"train": {"rows": rows}}, "counts": {"tokens": rows * 100, "documents": 3},
        "config": {"inputs": [{"kind": "wiki", "path": "/built/here/wiki"}]}}))
    (folder / "part-0.parquet").write_bytes(b"rows")


def test_a_pack_runs_without_the_shared_data(objectives, tmp_path):
    """--pack copies the vocab, records and task folders; --shared/--work on the pack then find
    them without ../shared, Beam or blingfire; a non-empty destination is refused."""
    shared, work = tmp_path / "shared", tmp_path / "work"
    (shared / "vocab").mkdir(parents=True)
    (shared / "vocab" / objectives.VOCAB_NAME).write_text("[PAD]\nthe\n")
    _records(work / "records" / "nsp-seq128-full", 7)
    task = work / "tasks" / "sst2-train2-devall"
    task.mkdir(parents=True)
    for split in ("train", "dev"):
        (task / f"{split}.tsv").write_text("sentence\tlabel\na b\t1\n")
    args = objectives.parse_args(["--pack", str(tmp_path / "pack"), "--shared", str(shared), "--work", str(work)])
    data = {"nsp": objectives.build_records(shared, work, "nsp", 128, None, args.vocab)}
    tasks = {"sst2": objectives.write_task_data(shared, work, "sst2", 2, None)}
    objectives.pack(tmp_path / "pack", args, data, tasks)

    packed_shared, packed_work = tmp_path / "pack" / "shared", tmp_path / "pack" / "work"
    assert sorted(p.name for p in packed_shared.rglob("*") if p.is_file()) == [objectives.VOCAB_NAME]
    again = objectives.build_records(packed_shared, packed_work, "nsp", 128, None, packed_shared / "vocab" / objectives.VOCAB_NAME)
    assert again["rows"] == 7 and again["inputs"] == ["wiki:/built/here/wiki"]
    assert (Path(again["manifest"]).parent / "part-0.parquet").read_bytes() == b"rows"
    assert objectives.write_task_data(packed_shared, packed_work, "sst2", 2, None).joinpath("dev.tsv").read_text() \
        == "sentence\tlabel\na b\t1\n"
    with pytest.raises(SystemExit, match="not empty"):
        objectives.pack(tmp_path / "pack", args, data, tasks)


def test_pretraining_past_its_timeout_is_killed_and_reported(objectives, tmp_path):
    plan = {"steps": 3, "points": [1, 2, 3]}
    job = {"name": "electra", "plan": plan, "run_dir": tmp_path / "run", "done": False,
           "cmd": [sys.executable, "-c", "import time; time.sleep(60)"]}
    t = time.time()
    stopped = objectives.run_pretraining([job], concurrent=True, timeout_s=1.0)
    assert time.time() - t < 30 and stopped == {"electra": "killed at the 1 s pretraining timeout"}
    result = objectives.pretrain_result(job, stopped, True)
    assert result["points_done"] == [] and result["stopped"] and result["median_step_s"] is None
    assert objectives.finetune_jobs({"electra": result}, None) == []


def test_a_failing_pretraining_run_ends_the_script_with_its_log(objectives, tmp_path):
    job = {"name": "span", "plan": {"steps": 3, "points": [1, 2, 3]}, "run_dir": tmp_path / "run", "done": False,
           "cmd": [sys.executable, "-c", "print('bad config: model.preset=huge'); raise SystemExit(3)"]}
    with pytest.raises(SystemExit, match="(?s)pretraining span failed \\(exit 3\\).*bad config"):
        objectives.run_pretraining([job], concurrent=False, timeout_s=None)


def test_finetunes_stop_at_the_deadline_and_a_failure_does_not_stop_the_rest(objectives, monkeypatch):
    calls = []

    def fake(checkpoint, task, data, seed, out, args):
        calls.append(seed)
        if seed == 2:
            raise RuntimeError("CUDA out of memory")
        return {"score": 50.0 + seed, "wall_s": 0.1}

    monkeypatch.setattr(objectives, "finetune", fake)
    args = objectives.parse_args(["--out-md", "/tmp/unused.md"])
    jobs = [{"arm": "mlm_nsp", "point": "3/3", "task": "sst2", "seed": s, "checkpoint": "c", "data": "d", "out": "o"}
            for s in (1, 2, 3)]
    done = []
    left = objectives.run_finetunes(jobs, args, None, lambda job, res: done.append((job["seed"], res["score"])))
    assert done == [(1, 51.0), (3, 53.0)] and [(j["seed"], j["why"]) for j in left] == [(2, "RuntimeError: CUDA out of memory")]
    calls.clear()
    left = objectives.run_finetunes(jobs, args, time.time() - 1, lambda job, res: None)
    assert calls == [] and {j["why"] for j in left} == {"not started: past the deadline"} and len(left) == 3


def test_the_squad_task_is_split_by_article_and_cut_by_questions(objectives, tmp_path):
    def article(a, questions):
        return {"title": f"t{a}", "paragraphs": [{"context": "ctx", "qas": [
            {"id": f"{a}-{q}", "question": "q?", "answers": [{"text": "c", "answer_start": 0}]} for q in range(n)]}
            for n in questions]}

    src = tmp_path / "squad" / "dev-v1.1.json"
    src.parent.mkdir()
    src.write_text(json.dumps({"version": "1.1", "data": [article(a, [2, 3]) for a in range(4)]}))
    folder = objectives.write_task_data(tmp_path, tmp_path / "w", "squad", 4, None)
    train, dev = (json.loads((folder / f"{s}.json").read_text())["data"] for s in ("train", "dev"))
    assert [a["title"] for a in train] == ["t0"] and [a["title"] for a in dev] == ["t1", "t3"]
    assert [len(p["qas"]) for p in train[0]["paragraphs"]] == [2, 2]  # the first 4 questions of the even articles
    assert objectives.task_rows("squad", folder) == {"train": 4, "dev": 10}
    assert objectives.finetune_settings(objectives.parse_args(["--out-md", "x.md", "--squad-seq", "384"]), "squad")[
        "doc_stride"] == 96


def test_span_against_whole_words_on_squad_is_judged_no_worse(objectives):
    assert objectives.no_worse_verdict([60.0, 61.0], [60.5, 62.0])["verdict"] == "met"  # lower, within the spread
    assert objectives.no_worse_verdict([58.0, 59.0], [60.0, 61.0])["verdict"] == "NOT met"
    assert objectives.no_worse_verdict([61.0], [60.0, 61.0])["verdict"] == "not evaluable"
    pretrain = {a: {"label": objectives.ARMS[a].label} for a in ("span", "wwm")}
    results = {"args": {"tasks": ["squad"]}, "pretrain": pretrain,
               "finetune": {"span": {"3/3": {"squad": {"1": {"score": 40.0}, "2": {"score": 41.0}}}},
                            "wwm": {"3/3": {"squad": {"1": {"score": 43.0}, "2": {"score": 44.0}}}}}}
    assert objectives.summarize(results)["span_target"]["verdict"] == "NOT met"
    assert "span_target" not in objectives.summarize({**results, "args": {"tasks": ["sst2"]}})
    # No worse than a whole-word model that pretraining has not helped says nothing.
    assert objectives.no_worse_verdict([8.4, 9.1], [8.3, 9.9], init=[9.2, 9.8])["verdict"] == "not evaluable"
    assert objectives.no_worse_verdict([8.4, 9.1], [8.3, 9.9], init=[8.0, 8.4])["verdict"] == "met"
    init = {"init": {"0": {"squad": {"1": {"score": 45.0}, "2": {"score": 46.0}}}}}
    verdict = objectives.summarize({**results, "finetune": {**results["finetune"], **init}})["span_target"]
    assert verdict["verdict"] == "not evaluable" and "45.50" in verdict["why"]


def test_one_after_another_no_run_starts_past_the_timeout(objectives, tmp_path):
    jobs = [{"name": name, "plan": {"steps": 3, "points": [1, 2, 3]}, "run_dir": tmp_path / name, "done": False,
             "cmd": [sys.executable, "-c", "import time; time.sleep(60)"]} for name in ("mlm_nsp", "span")]
    stopped = objectives.run_pretraining(jobs, concurrent=False, timeout_s=1.0)
    assert stopped == {"mlm_nsp": "killed at the 1 s pretraining timeout",
                       "span": "not started: past the 1 s pretraining timeout"}
    assert not (tmp_path / "span").exists()


def test_the_modernbert_arm_gets_the_bert_presets_sizes_and_an_equal_flop_budget(objectives, tmp_path):
    """ModernBERT beside BERT: its encoder has the preset's depth, width and heads and a GeGLU MLP
    with BERT's MLP parameters; its step is counted by the ModernBERT FLOP formula (30% of positions
    predicted) and its steps spend the budget of the MLM + NSP arm's."""
    from bertdist.model.flops import train_flops_per_sequence
    from bertdist.model.modernbert_config import ModernBertConfig
    from bertdist.train import load_train_config

    vocab = tmp_path / objectives.VOCAB_NAME
    vocab.write_text("".join(f"t{i}\n" for i in range(1000)))
    args = objectives.parse_args(["--out-md", str(tmp_path / "r.md"), "--budget-steps", "600", "--preset", "mini",
                                  "--arms", "mlm_nsp,modernbert"])
    args.vocab = vocab
    arm = objectives.ARMS["modernbert"]
    cfg = load_train_config(objectives.RECIPES / arm.recipe, objectives.arm_overrides(arm, args, 600, "m.json"))
    model = cfg.model_config
    assert isinstance(model, ModernBertConfig)
    assert (model.num_hidden_layers, model.hidden_size, model.num_attention_heads, model.intermediate_size) == \
        (4, 256, 4, 682)
    assert model.max_position_embeddings == 128 and cfg.data.mask_prob == 0.3
    assert cfg.data.max_predictions_per_seq == 38  # objectives.predicted_per_sequence(128, 0.30)
    mlp_bert, mlp_modern = 2 * 256 * 1024, 3 * 256 * 682  # BERT's two matrices; GeGLU's value, gate and output
    assert abs(mlp_modern - mlp_bert) / mlp_bert < 0.01
    plan = objectives.plan_arms(args)
    per_step = args.batch * train_flops_per_sequence(
        ModernBertConfig(**{**vars(model), "vocab_size": 1000}), 128, 38)
    assert plan["modernbert"]["flops_per_step"] == per_step
    assert plan["modernbert"]["steps"] == objectives.equal_flop_steps(plan["mlm_nsp"]["flops"], per_step)
    assert plan["modernbert"]["steps"] != plan["mlm_nsp"]["steps"]
    assert abs(plan["modernbert"]["flops"] - plan["mlm_nsp"]["flops"]) <= 1.5 * per_step


@pytest.mark.slow
def test_a_cpu_smoke_run_trains_and_fine_tunes_modernbert_beside_bert(objectives, tmp_path, small_vocab):
    """The benchmark end to end on the bundled text at a budget of 6 mini steps: packed records for
    the ModernBERT arm, NSP records for BERT's, both pretrained at equal FLOPs, each checkpoint
    fine-tuned on a tiny SST-2, and the report lists both arms."""
    import shutil

    from tests.conftest import SAMPLES

    shared = tmp_path / "shared"
    (shared / "vocab").mkdir(parents=True)
    shutil.copyfile(small_vocab, shared / "vocab" / objectives.VOCAB_NAME)
    (shared / "wiki").symlink_to(SAMPLES / "wiki")
    (shared / "books").symlink_to(SAMPLES / "books")
    sst2 = shared / "glue" / "SST-2"
    sst2.mkdir(parents=True)
    lines = [ln.strip() for ln in (SAMPLES / "books" / "shakespeare-macbeth.txt").read_text(encoding="utf-8")
             .splitlines() if len(ln.split()) >= 4][:80]
    rows = "".join(f"{ln}\t{int('the' in ln.lower().split())}\n" for ln in lines)
    for split in ("train", "dev"):
        (sst2 / f"{split}.tsv").write_text("sentence\tlabel\n" + rows, encoding="utf-8")
    out = tmp_path / "report.md"
    assert objectives.main(["--smoke", "--arms", "mlm_nsp,modernbert", "--tasks", "sst2", "--seeds", "1",
                            "--no-init-baseline", "--shared", str(shared), "--work", str(tmp_path / "work"),
                            "--out-md", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    pre = results["pretrain"]
    assert set(pre) == {"mlm_nsp", "modernbert"}
    assert pre["modernbert"]["records"] == "packed" and pre["modernbert"]["points_done"] == pre["modernbert"]["points"]
    assert abs(pre["modernbert"]["flops"] - pre["mlm_nsp"]["flops"]) <= 1.5 * pre["modernbert"]["flops_per_step"]
    assert pre["modernbert"]["last_loss"] < pre["modernbert"]["first_loss"] + 1.0  # finite, trained
    scores = results["finetune"]["modernbert"]["3/3"]["sst2"]["1"]
    assert 0.0 <= scores["score"] <= 100.0
    assert "(f) ModernBERT, MLM 30%, packed rows" in out.read_text()
