"""The dynamic batcher against plain Python callables: batch forming, length buckets, item order,
the queue bound, failures confined to their batch, cancellation and draining."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from bertdist.serve.batcher import (Batcher, BatchFailed, Draining, Overloaded, TooManyItems, length_bucket)


@dataclass
class Item:
    length: int
    tag: str


class Job:
    def __init__(self, *items: Item):
        self.items = list(items)

    def finish(self, outputs):
        return list(outputs)


def job(tag: str, length: int = 5) -> Job:
    return Job(Item(length, tag))


class Recorder:
    """A model run that records each batch's tags and answers each item with ``out:TAG``;
    optionally sleeps, blocks until released, or fails on a tag."""

    def __init__(self, sleep: float = 0.0, fail_on: str | None = None, gate: threading.Event | None = None):
        self.batches: list[list[str]] = []
        self.sleep, self.fail_on, self.gate = sleep, fail_on, gate
        self.started = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, items):
        self.threads.add(threading.current_thread().name)
        self.batches.append([it.tag for it in items])
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test never released the model"
        if self.sleep:
            time.sleep(self.sleep)
        if self.fail_on and any(it.tag == self.fail_on for it in items):
            raise RuntimeError(f"cannot run {self.fail_on}")
        return [f"out:{it.tag}" for it in items]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def started(batcher: Batcher) -> Batcher:
    await batcher.start()
    return batcher


async def wait_for_thread_event(ev: threading.Event) -> None:
    for _ in range(1000):
        if ev.is_set():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the model never started")


def test_concurrent_submits_form_batches_within_the_size_limit():
    model = Recorder(sleep=0.01)

    async def main():
        b = await started(Batcher(model, max_batch_size=4, max_wait_ms=20, max_queue=64))
        answers = await asyncio.gather(*(b.submit(job(f"t{i}")) for i in range(22)))
        await b.drain()
        return answers

    answers = run(main())
    assert answers == [[f"out:t{i}"] for i in range(22)]
    sizes = [len(batch) for batch in model.batches]
    assert sum(sizes) == 22 and max(sizes) <= 4 and max(sizes) > 1, sizes
    assert sorted(t for batch in model.batches for t in batch) == sorted(f"t{i}" for i in range(22))
    assert len(model.threads) == 1, f"the model ran on several threads: {model.threads}"
    assert threading.main_thread().name not in model.threads


def test_a_batch_holds_one_length_bucket():
    model = Recorder()
    lengths = {f"s{i}": 3 + i for i in range(6)} | {f"l{i}": 100 + i for i in range(6)}

    async def main():
        b = await started(Batcher(model, max_batch_size=8, max_wait_ms=30, max_queue=64))
        jobs = [Job(Item(n, tag)) for tag, n in lengths.items()]
        answers = await asyncio.gather(*(b.submit(j) for j in jobs))
        await b.drain()
        return answers

    answers = run(main())
    assert answers == [[f"out:{tag}"] for tag in lengths]
    for batch in model.batches:
        assert len({length_bucket(lengths[t]) for t in batch}) == 1, model.batches
    # Everything was queued within the wait: one batch per bucket.
    assert sorted(map(sorted, model.batches)) == [sorted(t for t in lengths if t[0] == "l"),
                                                  sorted(t for t in lengths if t[0] == "s")]


def test_a_jobs_items_keep_their_order_across_buckets_and_batches():
    model = Recorder()
    items = [Item(n, f"i{k}") for k, n in enumerate([4, 300, 7, 60, 2, 300, 9, 33, 1, 120, 5])]

    async def main():
        b = await started(Batcher(model, max_batch_size=2, max_wait_ms=0, max_queue=64))
        answer = await b.submit(Job(*items))
        await b.drain()
        return answer

    assert run(main()) == [f"out:{it.tag}" for it in items]
    assert len(model.batches) > 3 and all(len(batch) <= 2 for batch in model.batches)


def test_the_oldest_waiting_item_goes_first():
    """A full bucket of short texts does not starve an older long text."""
    gate = threading.Event()
    model = Recorder(gate=gate)

    async def main():
        b = await started(Batcher(model, max_batch_size=2, max_wait_ms=0, max_queue=64))
        first = asyncio.ensure_future(b.submit(job("blocker")))
        await wait_for_thread_event(model.started)
        long = asyncio.ensure_future(b.submit(job("long", 200)))
        await asyncio.sleep(0.01)
        shorts = [asyncio.ensure_future(b.submit(job(f"s{i}", 4))) for i in range(4)]
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(first, long, *shorts)
        await b.drain()

    run(main())
    assert model.batches == [["blocker"], ["long"], ["s0", "s1"], ["s2", "s3"]]


def test_a_full_queue_refuses_at_once_and_recovers():
    gate = threading.Event()
    model = Recorder(gate=gate)

    async def main():
        b = await started(Batcher(model, max_batch_size=1, max_wait_ms=0, max_queue=3))
        running = asyncio.ensure_future(b.submit(job("running")))
        await wait_for_thread_event(model.started)  # in flight: no longer counts against the queue
        queued = [asyncio.ensure_future(b.submit(job(f"q{i}"))) for i in range(3)]
        await asyncio.sleep(0.01)
        assert b.queue_depth == 3
        t0 = time.monotonic()
        with pytest.raises(Overloaded) as refused:
            await b.submit(job("extra"))
        assert time.monotonic() - t0 < 0.5
        assert refused.value.retry_after >= 1 and "queue limit 3" in str(refused.value)
        with pytest.raises(TooManyItems):
            await b.submit(Job(*(Item(5, f"big{i}") for i in range(4))))
        gate.set()
        answers = await asyncio.gather(running, *queued)
        after = await b.submit(job("after"))
        await b.drain()
        return answers, after

    answers, after = run(main())
    assert answers == [["out:running"], ["out:q0"], ["out:q1"], ["out:q2"]]
    assert after == ["out:after"]
    assert all(tag != "extra" for batch in model.batches for tag in batch)


def test_a_failed_run_fails_only_the_jobs_of_its_batch():
    model = Recorder(fail_on="bad")

    async def main():
        b = await started(Batcher(model, max_batch_size=4, max_wait_ms=20, max_queue=64))
        # "bad" and "mate" share a bucket (a batch); "split" has one item there too and one in
        # another bucket; the long ones batch apart.
        jobs = [job("bad", 5), job("mate", 6), Job(Item(7, "split-a"), Item(200, "split-b"))]
        jobs += [job(f"long{i}", 100) for i in range(3)]
        answers = await asyncio.gather(*(b.submit(j) for j in jobs), return_exceptions=True)
        later = await b.submit(job("later", 5))
        await b.drain()
        return answers, later

    answers, later = run(main())
    for a in answers[:3]:
        assert isinstance(a, BatchFailed) and "RuntimeError: cannot run bad" in str(a), answers
    assert answers[3:] == [[f"out:long{i}"] for i in range(3)]
    assert later == ["out:later"]
    # The failed job's item in the other bucket was taken off the queue, not run for nothing.
    assert all("split-b" not in batch for batch in model.batches), model.batches


def test_a_wrong_number_of_outputs_fails_the_batch():
    async def main():
        b = await started(Batcher(lambda items: ["one"], max_batch_size=4, max_wait_ms=20))
        answers = await asyncio.gather(b.submit(job("a")), b.submit(job("b")), return_exceptions=True)
        await b.drain()
        return answers

    answers = run(main())
    assert all(isinstance(a, BatchFailed) and "1 outputs for a batch of 2" in str(a) for a in answers), answers


def test_without_batching_each_job_runs_alone_in_arrival_order():
    model = Recorder(sleep=0.002)

    async def main():
        b = await started(Batcher(model, max_batch_size=2, max_wait_ms=50, max_queue=64, batching=False))
        jobs = [Job(Item(5, f"j{i}a"), Item(300, f"j{i}b"), Item(9, f"j{i}c")) for i in range(5)]
        answers = await asyncio.gather(*(b.submit(j) for j in jobs))
        await b.drain()
        return answers

    answers = run(main())
    assert answers == [[f"out:j{i}a", f"out:j{i}b", f"out:j{i}c"] for i in range(5)]
    assert model.batches == [[f"j{i}a", f"j{i}b", f"j{i}c"] for i in range(5)]


def test_a_cancelled_request_leaves_the_queue():
    gate = threading.Event()
    model = Recorder(gate=gate)

    async def main():
        b = await started(Batcher(model, max_batch_size=1, max_wait_ms=0, max_queue=2))
        running = asyncio.ensure_future(b.submit(job("running")))
        await wait_for_thread_event(model.started)
        gone = asyncio.ensure_future(b.submit(Job(Item(5, "gone1"), Item(5, "gone2"))))
        await asyncio.sleep(0.01)
        assert b.queue_depth == 2
        gone.cancel()
        await asyncio.sleep(0.01)
        assert b.queue_depth == 0
        kept = asyncio.ensure_future(b.submit(Job(Item(5, "k1"), Item(5, "k2"))))  # fits again
        gate.set()
        answers = await asyncio.gather(running, kept)
        await b.drain()
        return answers

    assert run(main()) == [["out:running"], ["out:k1", "out:k2"]]
    assert all(not t.startswith("gone") for batch in model.batches for t in batch)


def test_drain_finishes_queued_work_and_refuses_new_jobs():
    model = Recorder(sleep=0.005)

    async def main():
        # A long wait: only draining makes these partial batches run now.
        b = await started(Batcher(model, max_batch_size=8, max_wait_ms=60_000, max_queue=64))
        tasks = [asyncio.ensure_future(b.submit(job(f"d{i}", 5 if i % 2 else 90))) for i in range(10)]
        await asyncio.sleep(0.01)
        assert b.queue_depth == 10
        draining = asyncio.ensure_future(b.drain())
        await asyncio.sleep(0)
        with pytest.raises(Draining):
            await b.submit(job("late"))
        t0 = time.monotonic()
        await draining
        answers = [t.result() for t in tasks]
        return answers, time.monotonic() - t0, b

    answers, seconds, b = run(main())
    assert answers == [[f"out:d{i}"] for i in range(10)]
    assert seconds < 5 and b.queue_depth == 0 and b.in_flight == 0
    assert not b.accepting


def test_stop_waiting_runs_partial_batches_now_and_still_accepts():
    """At shutdown no new requests can come: queued items stop waiting for company."""
    model = Recorder()

    async def main():
        b = await started(Batcher(model, max_batch_size=8, max_wait_ms=60_000, max_queue=64))
        tasks = [asyncio.ensure_future(b.submit(job(f"w{i}"))) for i in range(3)]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks) and b.queue_depth == 3
        b.stop_waiting()
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        late = await asyncio.wait_for(b.submit(job("late")), 5)
        await b.drain()
        return answers, late

    answers, late = run(main())
    assert answers == [["out:w0"], ["out:w1"], ["out:w2"]] and late == ["out:late"]
    assert model.batches == [["w0", "w1", "w2"], ["late"]]


def test_a_failing_answer_fails_its_own_job_only():
    class BadFinish(Job):
        def finish(self, outputs):
            raise KeyError("no label")

    async def main():
        b = await started(Batcher(Recorder(), max_batch_size=4, max_wait_ms=20))
        answers = await asyncio.gather(b.submit(BadFinish(Item(5, "x"))), b.submit(job("y")), return_exceptions=True)
        await b.drain()
        return answers

    bad, good = run(main())
    assert isinstance(bad, BatchFailed) and "KeyError" in str(bad)
    assert good == ["out:y"]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Batcher(Recorder(), max_batch_size=0)
    with pytest.raises(ValueError):
        Batcher(Recorder(), max_queue=0)
    with pytest.raises(ValueError):
        Batcher(Recorder(), bucket_edges=(32, 16))
    with pytest.raises(ValueError, match="workers >= 1"):
        Batcher(Recorder(), workers=0)
    assert [length_bucket(n) for n in (1, 8, 9, 33, 512, 513)] == [0, 0, 1, 7, 22, 23]


def test_requests_take_turns_and_a_batch_is_bounded_in_tokens():
    """A request of many texts does not hold the model: each batch takes one item of each waiting
    request in turn, and its leftovers wait behind requests that have not ridden yet."""
    gate = threading.Event()
    model = Recorder(gate=gate)

    async def main():
        b = await started(Batcher(model, max_batch_size=4, max_wait_ms=0, max_queue=64, max_batch_tokens=40))
        first = asyncio.ensure_future(b.submit(job("blocker")))
        await wait_for_thread_event(model.started)
        big = asyncio.ensure_future(b.submit(Job(*(Item(5, f"big{i}") for i in range(10)))))
        await asyncio.sleep(0.01)
        smalls = [asyncio.ensure_future(b.submit(job(f"s{i}"))) for i in range(3)]
        await asyncio.sleep(0.01)
        long = asyncio.ensure_future(b.submit(Job(*(Item(30, f"long{i}") for i in range(3)))))
        await asyncio.sleep(0.01)
        gate.set()
        got = await asyncio.gather(first, big, *smalls, long)
        await b.drain()
        return got

    got = run(main())
    assert got[1] == [f"out:big{i}" for i in range(10)]  # its answer keeps its order
    assert model.batches[:4] == [["blocker"], ["big0", "s0", "s1", "s2"], ["long0"], ["big1", "big2", "big3", "big4"]]
    assert all(sum(30 if t.startswith("long") else 5 for t in b) <= 40 or len(b) == 1 for b in model.batches)
    assert ["long1"] in model.batches and ["long2"] in model.batches


def test_workers_run_batches_at_once_and_drain_waits_for_all():
    """With two workers a second batch starts while the first still runs (a barrier only two
    concurrent runs can pass); draining waits for both."""
    barrier, release = threading.Barrier(2, timeout=5), threading.Event()
    model = Recorder()

    def run_both(items):
        out = model(items)
        if len(model.batches) <= 2:
            barrier.wait()  # BrokenBarrierError (a failed batch) unless another run is under way
            assert release.wait(5)
        return out

    async def main():
        b = await started(Batcher(run_both, max_batch_size=1, max_wait_ms=0, max_queue=64, workers=2))
        tasks = [asyncio.ensure_future(b.submit(job(f"c{i}"))) for i in range(4)]
        for _ in range(200):
            if len(model.batches) == 2:
                break
            await asyncio.sleep(0.005)
        in_flight = b.in_flight
        release.set()
        await b.drain()
        return [t.result() for t in tasks], in_flight, b

    answers, in_flight, b = run(main())
    assert answers == [[f"out:c{i}"] for i in range(4)]
    assert in_flight == 2 and b.in_flight == 0 and b.queue_depth == 0
    assert len(model.threads) == 2, f"two workers ran on {model.threads}"


def test_one_worker_never_runs_two_batches_at_once():
    running, most = [0], [0]
    lock = threading.Lock()

    def run_one(items):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        return [f"out:{it.tag}" for it in items]

    async def main():
        b = await started(Batcher(run_one, max_batch_size=2, max_wait_ms=0, max_queue=64, workers=1))
        answers = await asyncio.gather(*(b.submit(job(f"o{i}", 3 + 20 * (i % 3))) for i in range(12)))
        await b.drain()
        return answers

    assert run(main()) == [[f"out:o{i}"] for i in range(12)]
    assert most[0] == 1


def test_a_worker_takes_its_next_batch_while_the_event_loop_is_busy():
    """A worker does not wait for the event loop between batches: three queued batches all run
    while the loop is held up (answers are delivered once it is free again)."""
    model = Recorder(sleep=0.01)

    async def main():
        b = await started(Batcher(model, max_batch_size=1, max_wait_ms=0, max_queue=64, workers=1))
        tasks = [asyncio.ensure_future(b.submit(job(f"q{i}"))) for i in range(3)]
        await asyncio.sleep(0)  # the jobs are queued
        time.sleep(0.5)  # the loop is busy: nothing it would have to do for the worker gets done
        ran_meanwhile = len(model.batches)
        answers = await asyncio.gather(*tasks)
        await b.drain()
        return ran_meanwhile, answers

    ran_meanwhile, answers = run(main())
    assert ran_meanwhile == 3, f"only {ran_meanwhile} of 3 batches ran while the loop was busy"
    assert answers == [["out:q0"], ["out:q1"], ["out:q2"]]


def test_a_worker_that_dies_fails_its_batch_and_the_queue_instead_of_leaving_them_hanging():
    """Not an Exception (which fails its batch only): something that ends the worker thread."""
    class Fatal(BaseException):
        pass

    def dies(items):
        raise Fatal("the worker's end")

    async def main():
        b = await started(Batcher(dies, max_batch_size=1, max_wait_ms=0, max_queue=64, workers=1))
        answers = await asyncio.wait_for(asyncio.gather(*(b.submit(job(f"d{i}")) for i in range(3)),
                                                        return_exceptions=True), 5)
        accepting = b.accepting
        await b.drain()
        return answers, accepting

    answers, accepting = run(main())
    assert all(isinstance(a, BatchFailed) and "the worker's end" in str(a) for a in answers), answers
    assert not accepting
