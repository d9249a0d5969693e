"""Checks for the values that go into rendered jobs (scripts, command lines, file names).

A value that reaches a shell is either quoted by its renderer or checked here against a set
that no shell reads specially. Every check raises SubmitError naming the key, the value and
what to do instead.
"""
from __future__ import annotations

import re

from bertdist.redaction import REDACTED, is_secret_name
from cluster.errors import SubmitError

# Job names become file names under jobs/ and SLURM job names.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# Host names, IPv4 addresses, IPv6 addresses (bare or in brackets); never a leading '-'.
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*|[0-9A-Fa-f]*:[0-9A-Fa-f:.]*|\[[0-9A-Fa-f:.]+\]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What DeepSpeed's pdsh launcher may paste unquoted into the remote shell command.
PDSH_SAFE = re.compile(r"[A-Za-z0-9_./:,=@%+-]*")


def shown(name: str, value: str) -> str:
    """``value`` as an error message may show it: hidden when ``name`` looks like a secret's."""
    return f"'{REDACTED}'" if is_secret_name(name) else repr(value)


def one_line(key: str, value: str) -> str:
    """Refuse line breaks (and NUL): in a script they would start a line of their own."""
    if any(c in value for c in "\n\r\0"):
        raise SubmitError(f"{key} {value!r}: newlines, carriage returns and NUL bytes are not allowed "
                          "in a value that goes into a job script; rename or move it")
    return value


def job_name(value: str, key: str = "--name") -> str:
    """A job name: it names files under jobs/, so no '/', no '..', nothing a shell reads."""
    if not _NAME.fullmatch(value) or ".." in value:
        raise SubmitError(f"{key} {value!r}: a job name may hold only letters, digits, '.', '_' and '-' "
                          "(starting with a letter or digit, no '..'); pass e.g. --name bertdist-run1")
    return value


def host_name(value: str, key: str = "--hosts") -> str:
    """A node to ssh to: a host name or address, never something ssh could read as an option."""
    if not _HOST.fullmatch(value):
        raise SubmitError(f"{key}: {value!r} is not a host name or address (letters, digits, '.', '-', '_'; "
                          "IPv6 with ':'; it must not start with '-')")
    return value


def env_name(value: str, key: str = "--env") -> str:
    if not _ENV_NAME.fullmatch(value):
        raise SubmitError(f"{key} {value!r}: not a valid environment variable name "
                          "(letters, digits and '_', not starting with a digit)")
    return value


def pdsh_word(key: str, value: str, name: str = "") -> str:
    """A value DeepSpeed's pdsh launcher puts unquoted into the remote shell command."""
    if not PDSH_SAFE.fullmatch(value):
        raise SubmitError(
            f"{key} {shown(name, value)}: the pdsh launcher passes this unquoted through a remote shell, "
            "so only letters, digits and _./:,=@%+- are allowed; use --ds-launcher ssh, which quotes "
            "every value, or change the value")
    return value


# A SLURM job id: 123, an array task 123_4, a step 123.batch.
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?(\.[A-Za-z0-9]+)?")


def slurm_job_id(value: str, key: str = "job id") -> str:
    if not _JOB_ID.fullmatch(value):
        raise SubmitError(f"{key} {value!r} is not a SLURM job id (e.g. 1234, 1234_5 or 1234.batch)")
    return value

