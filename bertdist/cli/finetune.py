"""`bertdist finetune <task>`: fine-tune our model on GLUE, SQuAD, CoNLL NER or SWAG."""
from __future__ import annotations

from bertdist.cli.export import add_trust_flag


def run(args) -> int:
    from bertdist.config import load_config
    from bertdist.export.hf import ExportError
    from bertdist.export.safe_load import trust_checkpoints
    from bertdist.finetune.config import FinetuneConfig
    from bertdist.finetune.errors import DataError
    from bertdist.finetune.train import run_finetune

    overrides = [f"task={args.task}", f"checkpoint={args.checkpoint}", f"data={args.data}"]
    if args.out:
        overrides.append(f"output_dir={args.out}")
    if args.vocab:
        overrides.append(f"vocab_file={args.vocab}")
    if args.deepspeed:
        overrides.append("deepspeed=true")
    cfg = load_config(FinetuneConfig, args.config, overrides + list(args.set))
    try:
        with trust_checkpoints(args.trust_checkpoint):
            summary = run_finetune(cfg)
    except (DataError, ExportError, FileNotFoundError) as e:
        print(f"bertdist finetune: {e}")
        return 2
    best = summary["best"]
    print(f"best: lr={best['lr']:g} seed={best['seed']} epoch={best['epoch']}")
    for split, m in best["metrics"].items():
        shown = ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())
        print(f"  {split}: {shown}")
    print(f"wrote {cfg.output_dir}/metrics.json")
    return 0


def register(sub) -> None:
    from bertdist.finetune.tasks import TASKS

    p = sub.add_parser("finetune", help="fine-tune on a GLUE task, SQuAD v1.1/v2.0, CoNLL NER or SWAG")
    p.add_argument("task", help=f"one of {', '.join(TASKS)}")
    p.add_argument("--checkpoint", required=True, help="our run / checkpoint dir, an import-hf dir, or an HF dir")
    p.add_argument("--data", required=True, help="the task's data directory (e.g. glue/SST-2)")
    p.add_argument("--out", default=None, help="output directory (default: runs/finetune)")
    p.add_argument("--config", default=None, help="a YAML from configs/finetune/")
    p.add_argument("--vocab", default=None, help="the data tokenizer's vocab (checked against the checkpoint's)")
    p.add_argument("--deepspeed", action="store_true", help="train under DeepSpeed (launch with torchrun/deepspeed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set learning_rate=2e-5")
    add_trust_flag(p)
    p.set_defaults(func=run)
