"""Writing job files readable by their owner only.

Job files can hold --env values, so they are created 0600 (scripts 0700) and the user's
umask can only narrow that. A file is written beside its target and renamed over it, so an
older, wider file at that path never keeps its mode.
"""
from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
SCRIPT_MODE = 0o700


def write_file(path: Path, text: str, mode: int = FILE_MODE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
