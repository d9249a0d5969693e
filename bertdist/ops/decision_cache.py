"""Where ``kernels: auto`` keeps its decisions: one JSON file in the user's cache folder.

``$BERTDIST_CACHE_DIR/kernel_decisions.json`` (default ``$XDG_CACHE_HOME/bertdist`` or
``~/.cache/bertdist``). Decisions are grouped by *environment*: device name, torch version
(with its CUDA and cuDNN versions), a hash of the loaded ``bertdist._C`` and the selection's
own version. A change of any of these is a different environment, so its decisions are
measured afresh; the old ones stay in the file (``bertdist info`` lists them per device).

Writes are read-modify-write under an exclusive ``fcntl`` lock and an atomic rename, so
processes sharing the folder (several ranks on a node) never corrupt it. A file that is not
valid JSON is moved aside (``*.corrupt-<time>``, nothing is deleted) with a warning.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import warnings
from pathlib import Path

CACHE_ENV = "BERTDIST_CACHE_DIR"
FILE_NAME = "kernel_decisions.json"
FORMAT = 1


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bertdist"


def environment_key(env: dict) -> str:
    """A readable key for an environment dict (``kernel_plan.environment``)."""
    return " | ".join(f"{k} {env[k]}" for k in sorted(env))


class DecisionCache:
    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else cache_dir() / FILE_NAME

    @contextlib.contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {"format": FORMAT, "environments": {}}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("environments"), dict):
                raise ValueError(f"not a format-{FORMAT} decision file")
            return data
        except ValueError as e:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            warnings.warn(f"kernel decision cache {self.path} unreadable ({e}); moved to {aside}, measuring afresh",
                          RuntimeWarning, stacklevel=3)
            return {"format": FORMAT, "environments": {}}

    def load(self, env: dict) -> dict[str, dict]:
        """The cached decisions (case key -> decision dict) of ``env``."""
        with self._locked():
            return dict(self._read()["environments"].get(environment_key(env), {}).get("decisions", {}))

    def store(self, env: dict, decisions: dict[str, dict]) -> None:
        """Add or replace ``decisions`` of ``env``; other environments are kept."""
        with self._locked():
            data = self._read()
            entry = data["environments"].setdefault(environment_key(env), {"environment": env, "decisions": {}})
            entry["environment"] = env
            entry["decisions"].update(decisions)
            entry["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)

    def environments(self) -> dict[str, dict]:
        """Every environment in the file: key -> {"environment", "decisions", "updated"}."""
        if not self.path.is_file():
            return {}
        with self._locked():
            return self._read()["environments"]
