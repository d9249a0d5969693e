"""`bertdist` entry point. Each subcommand lives in its own module exposing
``register(subparsers)``; a module is listed here only once its command works."""
from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in help order. Each later capability adds its module here.
SUBCOMMANDS = [
    "bertdist.cli.info",
    "bertdist.cli.model",
    "bertdist.cli.data",
    "bertdist.cli.pretrain",
    "bertdist.cli.export",
    "bertdist.cli.import_hf",
    "bertdist.cli.finetune",
    "bertdist.cli.submit",
    "bertdist.cli.jobs",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bertdist", description="Distributed BERT pretraining, from raw text to fine-tuned models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bertdist.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"bertdist: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
