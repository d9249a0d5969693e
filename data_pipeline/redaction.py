"""Beam options with credentials in them, made safe to log and to record in a manifest.

Runners take secrets as plain options (``--s3_secret_access_key``, ``--s3_session_token``,
``--azure_connection_string``, ...). An option whose name holds one of SECRET_WORDS keeps its
name, so the record still says it was set, and loses its value.
"""
from __future__ import annotations

import re
from typing import Sequence

SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "connection_string", "auth")
REDACTED = "***"
_OPTION = re.compile(r"--?([A-Za-z0-9_.-]+)")


def is_secret_option(name: str) -> bool:
    name = name.lower().lstrip("-").replace("-", "_")
    return any(word in name for word in SECRET_WORDS)


def redact_args(args: Sequence[str]) -> list[str]:
    """``args`` with the value of every secret-named option replaced: ``--name=value`` and the
    two-token ``--name value`` form alike."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        m = _OPTION.match(arg)
        if m and is_secret_option(m.group(1)):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out
