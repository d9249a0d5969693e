"""`bertdist finetune <task>`: fine-tune our model on GLUE, SQuAD, CoNLL NER or SWAG, or train a
retriever (`embed`), a similarity model (`sts`) or a re-ranker (`rerank`)."""
from __future__ import annotations

from bertdist.cli.export import add_trust_flag

EMBED_TASKS = ("embed", "sts", "rerank")  # bertdist.embed.config.TASKS, without importing it here


def cli_overrides(args) -> list[str]:
    """The command line as dotted overrides (both schemas have these keys), then the --set ones."""
    overrides = [f"task={args.task}", f"checkpoint={args.checkpoint}", f"data={args.data}"]
    if args.out:
        overrides.append(f"output_dir={args.out}")
    if args.vocab:
        overrides.append(f"vocab_file={args.vocab}")
    if args.deepspeed:
        overrides.append("deepspeed=true")
    return overrides + list(args.set)


def run(args) -> int:
    if args.task in EMBED_TASKS:
        return run_embed_task(args)
    from bertdist.config import load_config
    from bertdist.export.hf import ExportError
    from bertdist.export.safe_load import trust_checkpoints
    from bertdist.finetune.config import FinetuneConfig
    from bertdist.finetune.errors import DataError
    from bertdist.finetune.tasks import canonical_task
    from bertdist.finetune.train import run_finetune

    try:
        canonical_task(args.task)
    except DataError as e:
        print(f"bertdist finetune: {e}, or one of {list(EMBED_TASKS)} (retriever, similarity model, re-ranker)")
        return 2
    cfg = load_config(FinetuneConfig, args.config, cli_overrides(args))
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


def run_embed_task(args) -> int:
    from bertdist.embed.config import load_embed_config
    from bertdist.embed.train import run_embed
    from bertdist.export.hf import ExportError
    from bertdist.export.safe_load import trust_checkpoints
    from bertdist.finetune.errors import DataError

    cfg = load_embed_config(args.config, cli_overrides(args))
    try:
        with trust_checkpoints(args.trust_checkpoint):
            summary = run_embed(cfg)
    except (DataError, ExportError, FileNotFoundError) as e:
        print(f"bertdist finetune: {e}")
        return 2
    main = summary["main_metric"]
    if summary["initial"] is not None:
        print(f"dev {main}: {summary['initial']['metrics'].get(main, float('nan')):.4f} before training")
    best = summary["best"]
    if best is not None:
        shown = ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in best["metrics"].items())
        print(f"best: step {best['step']} (epoch {best['epoch']}): {shown}")
    print(f"{summary['steps']} steps in {summary['train_seconds']:.1f} s"
          + (" (stopped early)" if summary["stopped_early"] else ""))
    if "model_dir" in summary:
        print(f"wrote {summary['model_dir']}")
    print(f"wrote {cfg.output_dir}/metrics.json")
    return 0


def register(sub) -> None:
    from bertdist.finetune.tasks import TASKS

    p = sub.add_parser("finetune", help="fine-tune on a GLUE task, SQuAD v1.1/v2.0, CoNLL NER or SWAG; train a "
                                        "retriever (embed), a similarity model (sts) or a re-ranker (rerank)")
    p.add_argument("task", help=f"one of {', '.join(TASKS)}; or embed (bi-encoder for retrieval), sts (bi-encoder "
                                "on STS-B scores), rerank (cross-encoder)")
    p.add_argument("--checkpoint", required=True, help="our run / checkpoint dir, an import-hf dir, or an HF dir "
                                                       "(embed, sts, rerank: also a sentence-transformers dir)")
    p.add_argument("--data", required=True, help="the task's data directory (e.g. glue/SST-2; embed, rerank: "
                                                 "train.jsonl and dev.jsonl; sts: STS-B's train.tsv and dev.tsv)")
    p.add_argument("--out", default=None, help="output directory (default: runs/finetune; embed, sts, rerank: "
                                               "runs/embed)")
    p.add_argument("--config", default=None, help="a YAML from configs/finetune/ (embed, sts, rerank: configs/embed/)")
    p.add_argument("--vocab", default=None, help="the data tokenizer's vocab (checked against the checkpoint's)")
    p.add_argument("--deepspeed", action="store_true", help="train under DeepSpeed (launch with torchrun/deepspeed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set learning_rate=2e-5")
    add_trust_flag(p)
    p.set_defaults(func=run)
