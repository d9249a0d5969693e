"""The preparing thread: parsing and tokenizing requests off the event loop, handed over in groups.

Handing a call to a thread pool costs more than parsing and tokenizing a sentence: a queue, a lock
and a condition per call, a wake-up of the thread, and two futures chained across threads. Under
load, requests arrive in clusters (the answers of one batch go out together, and their clients
send again together), so the calls made in one turn of the loop go over as one group: one
hand-over and one wake-up. Each result goes back as soon as it is done (the loop's wake-ups from
other threads coalesce), so a large request does not hold back the small ones beside it.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


class PreparingThread:
    """``await run(fn, *args)``: ``fn(*args)`` on the one preparing thread."""

    def __init__(self, name: str = "serve-prepare"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._group: list[tuple[Callable, tuple, asyncio.Future]] = []

    async def run(self, fn: Callable, *args) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._group:
            loop.call_soon(self._hand_over, loop)  # after the other calls of this turn joined
        self._group.append((fn, args, future))
        return await future

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        group, self._group = self._group, []
        self._executor.submit(_run_group, loop, group)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _run_group(loop: asyncio.AbstractEventLoop, group: list) -> None:
    for fn, args, future in group:
        if future.cancelled():  # its request was cut off meanwhile
            continue
        try:
            result = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - the caller's to raise, in its own task
            result = (False, e)
        loop.call_soon_threadsafe(_settle, future, *result)


def _settle(future: asyncio.Future, ok: bool, value) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
