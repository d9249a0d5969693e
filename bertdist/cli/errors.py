"""Turning a subcommand's expected failures (bad input, a scheduler's refusal) into a clear
one-line message and exit status 2, instead of a traceback."""
from __future__ import annotations

import functools
import sys


def exit_2_on(prefix: str, *errors: type[BaseException]):
    """Decorator for a subcommand's ``func(args)``: ``errors`` print ``prefix: message`` and return 2."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(args) -> int:
            try:
                return fn(args)
            except errors as e:
                print(f"{prefix}: {e}", file=sys.stderr)
                return 2

        return wrapped

    return decorate
