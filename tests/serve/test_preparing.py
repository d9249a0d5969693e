"""The preparing thread: calls of one loop turn go over together, results and errors reach their
callers, a long call does not hold back the results done before it."""
import asyncio
import threading
import time

import pytest

from bertdist.serve.preparing import PreparingThread


def test_the_calls_of_one_turn_run_in_one_hand_over_off_the_loop():
    async def main():
        prep = PreparingThread()
        handed = []
        original = prep._executor.submit
        prep._executor.submit = lambda fn, loop, group: (handed.append(len(group)), original(fn, loop, group))[1]
        loop_thread = threading.get_ident()
        try:
            got = await asyncio.gather(*(prep.run(lambda i=i: (i * i, threading.get_ident())) for i in range(5)))
            assert [g[0] for g in got] == [0, 1, 4, 9, 16]
            assert all(g[1] != loop_thread for g in got)  # not on the event loop's thread
            assert handed == [5]
            assert await prep.run(lambda: "alone") == "alone"
            assert handed == [5, 1]
        finally:
            prep.shutdown()

    asyncio.run(main())


def test_an_error_reaches_its_own_caller_only():
    def fail():
        raise ValueError("bad body")

    async def main():
        prep = PreparingThread()
        try:
            results = await asyncio.gather(prep.run(lambda: 1), prep.run(fail), prep.run(lambda: 3),
                                           return_exceptions=True)
            assert results[0] == 1 and results[2] == 3
            assert isinstance(results[1], ValueError) and str(results[1]) == "bad body"
        finally:
            prep.shutdown()

    asyncio.run(main())


def test_a_result_goes_back_without_waiting_for_the_rest_of_its_group():
    async def main():
        prep = PreparingThread()
        try:
            t0 = time.perf_counter()

            async def timed(fn):
                await prep.run(fn)
                return time.perf_counter() - t0

            quick, slow = await asyncio.gather(timed(lambda: None), timed(lambda: time.sleep(0.5)))
            assert slow >= 0.5 and quick < 0.4, (quick, slow)
        finally:
            prep.shutdown()

    asyncio.run(main())


def test_a_cancelled_caller_is_skipped():
    ran = []

    async def main():
        prep = PreparingThread()
        try:
            blocker = asyncio.ensure_future(prep.run(lambda: time.sleep(0.2)))
            await asyncio.sleep(0.05)  # the blocker's group is in the thread
            late = asyncio.ensure_future(prep.run(lambda: ran.append("late")))
            await asyncio.sleep(0)  # joined the next group
            late.cancel()
            await blocker
            with pytest.raises(asyncio.CancelledError):
                await late
            assert await prep.run(lambda: "next") == "next"
        finally:
            prep.shutdown()

    asyncio.run(main())
    assert ran == []
