"""Secrets kept out of what we print, log and record.

A value is treated as secret by its name: an option or variable whose name holds one of
SECRET_WORDS (``--s3_secret_access_key``, ``--azure_connection_string``, ``HF_TOKEN``, ...).
The data build redacts Beam options in its log and manifest; the cluster layer refuses such
variables where they would be visible and hides them in what a dry run prints. Imports nothing
heavy: Beam's driver and the job renderers both use it.
"""
from __future__ import annotations

import re
from typing import Sequence

SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "connection_string")
REDACTED = "<hidden>"
_OPTION = re.compile(r"--?([A-Za-z0-9_.-]+)")
_ASSIGNMENT = re.compile(r"^(\s*(?:export\s+)?)([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.M)


def is_secret_name(name: str) -> bool:
    """Whether an option's or a variable's name says its value is a secret."""
    name = name.lower().lstrip("-").replace("-", "_")
    return any(word in name for word in SECRET_WORDS)


def redact_args(args: Sequence[str]) -> list[str]:
    """Command-line options with the value of every secret-named one replaced: ``--name=value``
    and the two-token ``--name value`` form alike. The name stays, so the record says it was set."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        m = _OPTION.match(arg)
        if m and is_secret_name(m.group(1)):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


def hide_secret_values(text: str) -> str:
    """``text`` (a script or env file) with the value of every secret-named ``NAME=value`` line
    hidden: what a dry run prints may end up in a terminal log."""
    return _ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}='{REDACTED}'" if is_secret_name(m.group(2))
                           else m.group(0), text)
