"""`bertdist` entry point. Each subcommand lives in its own module exposing
``register(subparsers)``; a module is listed here only once its command works."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

# Subcommand modules, in help order, with the commands each registers. Each later capability
# adds its module here.
COMMANDS = {
    "bertdist.cli.info": ("info",),
    "bertdist.cli.model": ("model",),
    "bertdist.cli.data": ("data",),
    "bertdist.cli.pretrain": ("pretrain",),
    "bertdist.cli.export": ("export",),
    "bertdist.cli.serve": ("serve",),
    "bertdist.cli.import_hf": ("import-hf",),
    "bertdist.cli.finetune": ("finetune",),
    "bertdist.cli.distill": ("distill", "pseudo-label"),
    "bertdist.cli.embed": ("embed", "index", "search"),
    "bertdist.cli.submit": ("submit",),
    "bertdist.cli.jobs": ("jobs",),
    "bertdist.cli.bench": ("bench",),
}
SUBCOMMANDS = list(COMMANDS)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the command line ``argv``, only the module of the command it
    names is imported (the modules import what their commands need: fine-tuning tasks, cluster
    renderers... 0.1 s that `data build` would otherwise pay on every run)."""
    parser = argparse.ArgumentParser(
        prog="bertdist", description="Distributed BERT pretraining, from raw text to fine-tuned models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    named = [m for m, commands in COMMANDS.items() if argv and argv[0] in commands]
    for name in named or SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    from bertdist.config import ConfigError

    try:
        rc = int(args.func(args) or 0)
    except ConfigError as e:
        print(f"bertdist: config error: {e}", file=sys.stderr)
        return 2
    _exit_now_if_asked(args, rc)
    return rc


# Set by the program entry points only, so that ``main([...])`` called from Python (tests,
# notebooks) always returns.
_PROGRAM = False


def _exit_now_if_asked(args, rc: int) -> None:
    """A command that sets ``fast_exit`` (`data build`) ends the program here, skipping the
    interpreter's teardown: with Beam's ~1,500 modules loaded that takes about 0.3 s and does
    nothing useful, since every output is closed and committed. Streams and logging handlers are
    flushed first; atexit handlers are skipped, so a command opts in only when none matter."""
    if _PROGRAM and getattr(args, "fast_exit", False):
        import logging

        logging.shutdown()
        _flush_and_exit(rc)


def _flush_and_exit(rc: int) -> NoReturn:
    """Flush the standard streams and end the process now, without the interpreter's teardown."""
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(rc)


def end_program(rc: int) -> NoReturn:
    """Exit the program with ``rc``.

    A process that started a process group skips the interpreter's finalization. The backend's
    worker threads (gloo's) outlive the group and can still be releasing a finished collective's
    tensors; a native thread that re-enters Python while the interpreter finalizes aborts the
    process ("terminate called without an active exception", SIGABRT) after all the work is done
    and saved. So the group is destroyed, the atexit handlers run (logging, multiprocessing,
    weakref finalizers), the streams are flushed, and the process ends with ``os._exit``."""
    ours, dist = sys.modules.get("bertdist.train.distributed"), sys.modules.get("torch.distributed")
    live = dist is not None and dist.is_available() and dist.is_initialized()
    if not live and (ours is None or not ours.group_started()):
        sys.exit(rc)
    import atexit

    if live:
        if ours is not None:  # a DeepSpeed engine built after the group started made one
            ours.release_shm_workspace(wait_for_ranks=False)
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    _flush_and_exit(rc)


def run() -> NoReturn:
    """The ``bertdist`` program (console script and ``python -m bertdist.cli.main``)."""
    global _PROGRAM
    _PROGRAM = True
    end_program(main())


if __name__ == "__main__":
    run()
