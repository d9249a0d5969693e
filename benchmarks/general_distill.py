"""General distillation vs pretraining from scratch: the student's held-out MLM loss at equal steps.

On the bundled sample text (data_pipeline/samples, a 4,000-piece vocab trained on it, seq 64,
dynamic masking, NSP), through ``bertdist pretrain`` as a user runs it (one process each):

1. the teacher: the ``mini`` preset (4 layers, hidden 256) pretrained for ``--teacher-steps``;
2. per seed, the same ``tiny`` student (2 layers, hidden 128; same init, data order and masks):
   - *scratch*: plain pretraining;
   - *distilled*: the same run with ``distill.teacher=<the teacher>`` (DistilBERT's weights:
     5 x T^2 KL at T=2, 2 x gold MLM, 1 x NSP; no cosine, the widths differ).

Both students are evaluated on the same fixed held-out masks every ``--eval-every`` steps; the
table gives each arm's held-out MLM loss and accuracy, per seed and the median over seeds, and
the teacher's. ``--markdown PATH`` writes the results file with the command and the raw rows.

    python benchmarks/general_distill.py --work /tmp/gd --markdown benchmarks/results/general_distill_cpu_DATE.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data_pipeline" / "samples"
INPUTS = [f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"]
TINY = REPO / "configs" / "pretrain" / "tiny.yaml"
BUILD = dict(max_seq_length=64, dupe_factor=3, num_shards=4, heldout_fraction=0.1, masking="dynamic")


def sh(cmd: list[str], log: Path | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as f:
        res = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode:
        tail = log.read_text()[-3000:] if log else ""
        raise SystemExit(f"failed ({res.returncode}): {' '.join(cmd)}\n{tail}")


def data(work: Path) -> tuple[Path, Path]:
    vocab, records = work / "vocab.txt", work / "records"
    if not vocab.is_file():
        sh([sys.executable, "-m", "bertdist.cli.main", "data", "vocab", *sum((["--input", i] for i in INPUTS), []),
            "--output", str(vocab), "--size", "4000"])
    if not (records / "manifest.json").is_file():  # the Beam pipeline, in this process
        from data_pipeline import build_records

        build_records(INPUTS, records, vocab, **BUILD)
    return vocab, records / "manifest.json"


def pretrain(run_dir: Path, manifest: Path, vocab: Path, steps: int, eval_every: int, *extra: str) -> list[dict]:
    """One ``bertdist pretrain`` run (reused when its final evaluation exists); its eval rows."""
    if not _evals(run_dir) or _evals(run_dir)[-1]["step"] != steps:
        sh([sys.executable, "-m", "bertdist.cli.pretrain", str(TINY), f"run_dir={run_dir}",
            f"data.train_manifest={manifest}", f"data.vocab_file={vocab}", f"schedule.total_steps={steps}",
            f"schedule.warmup_steps={max(steps // 10, 1)}", f"eval.every_steps={eval_every}",
            "eval.max_sequences=512", "data.micro_batch_size=32", "checkpoint.every_steps=0", "checkpoint.keep_last_n=1",
            "logging.progress=none", "logging.tensorboard=false", *extra], log=run_dir.with_suffix(".log"))
    return _evals(run_dir)


def _evals(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.is_file():
        return []
    return [r for r in map(json.loads, p.read_text().splitlines()) if r["kind"] == "eval"]


def seconds_per_step(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows if r["kind"] == "train")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="working directory (data and runs; reused)")
    ap.add_argument("--teacher-steps", type=int, default=300)
    ap.add_argument("--student-steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    vocab, manifest = data(work)
    teacher_dir = work / "teacher_mini"
    teacher = pretrain(teacher_dir, manifest, vocab, args.teacher_steps, args.teacher_steps, "model.preset=mini")
    arms: dict[str, dict[int, list[dict]]] = {"scratch": {}, "distilled": {}}
    for seed in args.seeds:
        common = (f"seed={seed}", f"data.seed={seed}")
        arms["scratch"][seed] = pretrain(work / f"scratch_{seed}", manifest, vocab, args.student_steps,
                                         args.eval_every, *common)
        arms["distilled"][seed] = pretrain(work / f"distilled_{seed}", manifest, vocab, args.student_steps,
                                           args.eval_every, *common, f"distill.teacher={teacher_dir}")
    lines = report(args, teacher, arms, work, time.time() - t0)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


def report(args, teacher: list[dict], arms: dict, work: Path, seconds: float) -> list[str]:
    steps = [r["step"] for r in arms["scratch"][args.seeds[0]]]

    def at(arm: str, seed: int, step: int, key: str) -> float:
        return next(r[key] for r in arms[arm][seed] if r["step"] == step)

    out = ["| step | scratch: MLM loss | distilled: MLM loss | distilled / scratch | scratch: MLM acc | "
           "distilled: MLM acc |", "|---|---|---|---|---|---|"]
    for step in steps:
        s = statistics.median(at("scratch", k, step, "mlm_loss") for k in args.seeds)
        d = statistics.median(at("distilled", k, step, "mlm_loss") for k in args.seeds)
        sa = statistics.median(at("scratch", k, step, "mlm_acc") for k in args.seeds)
        da = statistics.median(at("distilled", k, step, "mlm_acc") for k in args.seeds)
        out.append(f"| {step} | {s:.4f} | {d:.4f} | {d / s:.3f} | {sa:.3f} | {da:.3f} |")
    final = steps[-1]
    per_seed = [(k, at("scratch", k, final, "mlm_loss"), at("distilled", k, final, "mlm_loss")) for k in args.seeds]
    wins = sum(d < s for _, s, d in per_seed)
    t_last = teacher[-1]
    head = [
        f"# General distillation vs pretraining from scratch: tiny student, mini teacher, CPU "
        f"({time.strftime('%Y-%m-%d')})",
        "",
        f"**Question.** At equal steps, is the held-out MLM loss of a student pretrained with "
        f"`distill.teacher` lower than that of the same student pretrained from scratch?",
        "",
        f"**Answer.** At step {final}, median over seeds {args.seeds}: scratch "
        f"{statistics.median(s for _, s, _ in per_seed):.4f}, distilled "
        f"{statistics.median(d for _, _, d in per_seed):.4f}; the distilled student is lower on {wins} of "
        f"{len(per_seed)} seeds. The teacher's held-out MLM loss is {t_last['mlm_loss']:.4f} "
        f"(acc {t_last['mlm_acc']:.3f}) after {t_last['step']} steps.",
        "",
        "## Setup",
        "",
        "- Device: 2-core CPU VM, shared with other jobs (times are not compared here); "
        f"{platform.python_implementation()} {platform.python_version()}, one process per run, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', '1')}.",
        f"- Command: `python benchmarks/general_distill.py --work {work} --teacher-steps {args.teacher_steps} "
        f"--student-steps {args.student_steps} --eval-every {args.eval_every} --seeds "
        f"{' '.join(map(str, args.seeds))} --markdown {args.markdown}`",
        "- Data: `bertdist data vocab` (4,000 pieces) and `data_pipeline.build_records` (the Beam pipeline) with "
        f"{BUILD} on `data_pipeline/samples` (wiki + books); NSP.",
        f"- Teacher: `configs/pretrain/tiny.yaml model.preset=mini` (4 layers, hidden 256), {args.teacher_steps} "
        "steps, warmup 10%, LAMB 5e-3, global batch 32 (micro 32), fp32.",
        f"- Students: `configs/pretrain/tiny.yaml` (2 layers, hidden 128), {args.student_steps} steps, warmup 10%, "
        "LAMB 5e-3, global batch 32 (micro 32), fp32; `seed` and `data.seed` per seed, the same for both arms (same "
        "initial weights, data order and masks). Distilled: `distill.teacher=<teacher run>` with the defaults "
        "(alpha_mlm_kl 5, T 2, alpha_mlm_ce 2, alpha_nsp 1, alpha_hidden_cos 0).",
        "- Held-out: the build's held-out split, fixed masks (eval.seed), up to 512 sequences, the gold MLM "
        "cross-entropy (the same number for both arms; the distillation terms are not part of it).",
        f"- Median seconds per step (this loaded machine): teacher {seconds_per_step(work / 'teacher_mini'):.3f}, "
        f"scratch {seconds_per_step(work / f'scratch_{args.seeds[0]}'):.3f}, distilled "
        f"{seconds_per_step(work / f'distilled_{args.seeds[0]}'):.3f} (the teacher's forward included); "
        f"whole benchmark {seconds / 60:.1f} min.",
        "",
        "## Held-out MLM, median over seeds",
        "",
    ]
    raw = ["", "## Raw held-out rows (metrics.jsonl, kind eval)", "", "```"]
    raw.append(json.dumps({"run": "teacher", **{k: t_last[k] for k in ("step", "mlm_loss", "mlm_acc")}}))
    for arm in ("scratch", "distilled"):
        for seed in args.seeds:
            for r in arms[arm][seed]:
                raw.append(json.dumps({"run": f"{arm}_{seed}", "step": r["step"], "mlm_loss": r["mlm_loss"],
                                       "mlm_acc": r["mlm_acc"]}))
    raw.append("```")
    return head + out + raw


if __name__ == "__main__":
    sys.exit(main())
