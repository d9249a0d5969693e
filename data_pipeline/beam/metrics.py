"""Beam metrics for the data build: counters and distributions in the ``data_pipeline`` namespace,
logged events for skipped or repaired input, and a periodic progress line per worker."""
from __future__ import annotations

import logging
import os
import time

from apache_beam.metrics import Metrics

NS = "data_pipeline"
log = logging.getLogger("data_pipeline")
_counters: dict[object, object] = {}


def count(name: str, n: int = 1) -> None:
    c = _counters.get(name)
    if c is None:
        c = _counters[name] = Metrics.counter(NS, name)
    c.inc(n)


def distribution(name: str, value: int) -> None:
    d = _counters.get(("dist", name))
    if d is None:
        d = _counters[("dist", name)] = Metrics.distribution(NS, name)
    d.update(value)


def event(name: str, where: str) -> None:
    count(name)
    if name.startswith(("skipped_", "truncated_")) or name == "repaired_truncated_enormous_document":
        log.warning("%s: %s", name, where)


class Progress:
    """A log line per worker every ``every`` seconds, so a long run shows it is moving."""

    def __init__(self, what: str, every: float = 15.0):
        self.what, self.every, self.n, self.last = what, every, 0, time.monotonic()

    def tick(self, n: int = 1):
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            log.info("progress [pid %d]: %s %d", os.getpid(), self.what, self.n)
