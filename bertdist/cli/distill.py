"""`bertdist distill TASK`: a fine-tuned teacher into a smaller student, by task distillation on
pseudo-labelled unlabelled text; `bertdist pseudo-label TASK`: the labelling job alone."""
from __future__ import annotations

from bertdist.cli.export import add_trust_flag


def _overrides(args, *, labelling: bool) -> list[str]:
    out = [f"task={args.task}", f"teacher={args.teacher}", f"data={args.data}"]
    out.append("unlabeled=[" + ",".join(f'"{p}"' for p in args.unlabeled) + "]")
    if args.out:
        out.append(f"{'labels_dir' if labelling else 'output_dir'}={args.out}")
    if not labelling:
        out.append(f"student={args.student}")
        if args.labels:
            out.append(f"labels_dir={args.labels}")
        if args.baseline:
            out.append(f"baseline={args.baseline}")
    if args.deepspeed:
        out.append("train.deepspeed=true")
    return out + list(args.set)


def run(args) -> int:
    from bertdist.distill.config import load_distill_config
    from bertdist.distill.train import run_distill
    from bertdist.export.hf import ExportError
    from bertdist.export.safe_load import trust_checkpoints
    from bertdist.finetune.errors import DataError

    cfg = load_distill_config(args.config, _overrides(args, labelling=False))
    try:
        with trust_checkpoints(args.trust_checkpoint):
            report = run_distill(cfg)
    except (DataError, ExportError, FileNotFoundError) as e:
        print(f"bertdist distill: {e}")
        return 2
    if report is not None:  # rank 0
        from bertdist.distill.report import format_report

        print(format_report(report))
        print(f"student: {report['student']['model_dir']}\nwrote {cfg.output_dir}/report.md, report.json")
    return 0


def run_label(args) -> int:
    from bertdist.distill.config import load_distill_config
    from bertdist.distill.train import run_pseudo_label
    from bertdist.export.hf import ExportError
    from bertdist.export.safe_load import trust_checkpoints
    from bertdist.finetune.errors import DataError

    cfg = load_distill_config(args.config, _overrides(args, labelling=True))
    try:
        with trust_checkpoints(args.trust_checkpoint):
            m = run_pseudo_label(cfg)
    except (DataError, ExportError, FileNotFoundError) as e:
        print(f"bertdist pseudo-label: {e}")
        return 2
    if "shards" in m:
        stats = m["last_run"]
        print(f"{m['rows']} rows in {m['num_shards']} shards ({stats['shards_labelled']} labelled now, "
              f"{stats['shards_reused']} already there) -> {cfg.labels_dir}/manifest.json")
    return 0


def _common(p) -> None:
    p.add_argument("task", help="a GLUE task, stsb, ner, squad or squad2")
    p.add_argument("--teacher", required=True, help="a fine-tuned task model directory (finetune save_model, or HF)")
    p.add_argument("--data", required=True, help="the task's directory (dev scores the student; train rows are the labelled rows)")
    p.add_argument("--unlabeled", nargs="+", default=[], metavar="PATH",
                   help="unlabelled text: plain text, JSONL, or files in the task's layout (labels ignored)")
    p.add_argument("--config", default=None, help="a YAML from configs/distill/")
    p.add_argument("--deepspeed", action="store_true", help="DeepSpeed data parallel (launch with torchrun)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set temperature=4 --set train.learning_rate=5e-5")
    add_trust_flag(p)


def register(sub) -> None:
    p = sub.add_parser("distill", help="distil a fine-tuned teacher into a smaller student on pseudo-labelled text")
    _common(p)
    p.add_argument("--student", default="layers:6",
                   help="layers:K (K of the teacher's layers), preset:NAME (random), or a checkpoint/HF dir")
    p.add_argument("--out", default=None, help="output directory (default: runs/distill)")
    p.add_argument("--labels", default=None, help="the pseudo-label set to reuse or make (default: OUT/pseudo_labels)")
    p.add_argument("--baseline", choices=["none", "direct"], default=None,
                   help="direct: also fine-tune the same student on the labelled rows alone")
    p.set_defaults(func=run)
    q = sub.add_parser("pseudo-label", help="label unlabelled text with a teacher: Parquet shards + manifest, resumable")
    _common(q)
    q.add_argument("--out", required=True, help="the pseudo-label directory")
    q.set_defaults(func=run_label)
