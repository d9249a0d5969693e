"""Dynamic batching of one model's requests.

A request (a *job*) holds one or more items (tokenized texts). Items wait in a bounded queue,
grouped by length bucket so that a batch pads little; a batch is one ``run`` call over up to
``max_batch_size`` items of one bucket, on one of the model's worker threads (``workers`` run
at once). A job's answer is ``job.finish(outputs)`` once all its items are done, whichever
batches they rode in. A worker takes its next batch itself as soon as it has handed over the
last one's outputs; the event loop queues jobs and delivers answers.

When a batch runs: a bucket is ready once it holds ``max_batch_size`` items, or its oldest item
has waited ``max_wait_ms``, or the batcher is draining; among the ready buckets, the one whose
first item has waited longest for a turn goes first, so a rarely used length still gets its turn.

Requests take turns: a batch takes one item of each waiting request in turn (not the first
request's items first), and the items left of the requests that rode in it wait for their next
turn as long as their share of the batch takes to run (from the measured time per token) times
the number of requests waiting, so that each request gets about an equal share of the model. A
request of hundreds of long texts thus shares the model with small ones instead of holding it. A
batch also holds at most ``max_batch_tokens`` tokens (at least one item), so one batch of long
texts is no longer than a batch of short ones.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import math
import threading
import time
from typing import Any, Callable, Protocol, Sequence

log = logging.getLogger(__name__)

# Upper edges (in tokens) of the length buckets, from 16 tokens up at most a quarter of the length
# apart; longer items share one last bucket. A batch costs a fixed cost per call plus its rows x
# its longest row, padding included. With one single-threaded run per core (the server's default)
# the fixed cost of a 3-layer MiniLM is about 4 token-rows, so batches of near-equal lengths, even
# small ones, cost less than fuller batches padded to their longest text.
DEFAULT_BUCKET_EDGES = (8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                        320, 384, 448, 512)


class Refused(Exception):
    """The job was not queued (HTTP 503); ``retry_after`` is a hint in whole seconds."""

    error_type = "Overloaded"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Overloaded(Refused):
    """The queue has no room for the job's items."""


class Draining(Refused):
    """The batcher is shutting down and takes no new work."""

    error_type = "Unhealthy"


class TooManyItems(ValueError):
    """The job has more items than the queue can ever hold (HTTP 413: retrying cannot help)."""


class BatchFailed(RuntimeError):
    """The model's run failed for the batch that held one of the job's items (HTTP 500)."""


class Observer(Protocol):
    """What the batcher reports (bertdist.serve.metrics.ServeMetrics implements it)."""

    def observe_batch(self, model: str, size: int, queue_waits: Sequence[float], run_seconds: float) -> None: ...

    def set_queue_depth(self, model: str, items: int) -> None: ...

    def observe_abandoned(self, model: str, items: int) -> None: ...


def length_bucket(length: int, edges: Sequence[int] = DEFAULT_BUCKET_EDGES) -> int:
    """Index of the bucket for an item of ``length`` tokens: the first edge >= length."""
    return bisect.bisect_left(edges, length)


class _Pending:
    """One submitted job: where its outputs gather, and the future its submitter awaits."""

    __slots__ = ("job", "future", "outputs", "left", "items")

    def __init__(self, job, future: asyncio.Future):
        self.job = job
        self.future = future
        self.outputs: list[Any] = [None] * len(job.items)
        self.left = len(job.items)
        self.items: list[_Item] = []

    @property
    def done(self) -> bool:
        return self.future.done()


class _Item:
    __slots__ = ("pending", "index", "encoded", "bucket", "queued_at", "turn")

    def __init__(self, pending: _Pending, index: int, encoded, bucket: int, queued_at: float):
        self.pending = pending
        self.index = index
        self.encoded = encoded
        self.bucket = bucket
        self.queued_at = queued_at
        self.turn = queued_at  # when its request last rode in a batch, or was queued


class Batcher:
    """Batches the items of submitted jobs into calls of ``run(list_of_items) -> list_of_outputs``.

    ``run`` is blocking. Up to ``workers`` batches run at once, each on its own worker thread, so
    ``run`` must be thread-safe when ``workers`` > 1 (an ONNX Runtime session's ``run`` is). With
    ``batching=False`` every job runs alone (its items as one batch), in arrival order, under the
    same queue bound: the baseline for comparing batching.
    """

    def __init__(self, run: Callable[[list], list], *, name: str = "model", max_batch_size: int = 32,
                 max_wait_ms: float = 0.0, max_queue: int = 256, batching: bool = True,
                 max_batch_tokens: int | None = None, workers: int = 1,
                 bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES, observer: Observer | None = None):
        if max_batch_size < 1 or max_queue < 1 or max_wait_ms < 0 or workers < 1:
            raise ValueError(f"need max_batch_size >= 1, max_queue >= 1, max_wait_ms >= 0, workers >= 1; got "
                             f"{max_batch_size}, {max_queue}, {max_wait_ms}, {workers}")
        if list(bucket_edges) != sorted(set(bucket_edges)):
            raise ValueError(f"bucket edges must increase strictly: {list(bucket_edges)}")
        self._run = run
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.batching = batching
        self.workers = workers
        self.bucket_edges = tuple(bucket_edges)
        self._observer = observer
        self._buckets: dict[int, collections.deque[_Item]] = {}  # batching: items by bucket
        self._jobs: collections.deque[_Pending] = collections.deque()  # no batching: whole jobs
        self._queued = 0  # items waiting (not in flight)
        self._in_flight = 0  # items in the batches now running
        self._batch_seconds = 0.05  # moving average of a batch's run, for Retry-After
        self._token_seconds = 1e-4  # moving average of a batch's run per token, for turns
        self._accepting = False
        self._closing = False
        self._no_wait = False  # stopping: run partial batches at once
        # The queue is shared with the worker threads, which take their next batch themselves the
        # moment they finish one, without waiting for the event loop's turn: under load the loop
        # is busy, and a worker that waited for it would idle with work queued.
        self._lock = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._alive = 0  # worker threads not yet returned
        self._stopped: asyncio.Future | None = None  # done once every worker has returned

    # -- state ----------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Items waiting for a batch (the bound ``max_queue`` applies to these)."""
        return self._queued

    @property
    def in_flight(self) -> int:
        """Items in the batches now running."""
        return self._in_flight

    @property
    def accepting(self) -> bool:
        return self._accepting

    def retry_after(self) -> int:
        """Seconds until the queue has likely emptied: whole batches ahead times a batch's run,
        shared among the workers."""
        batches = math.ceil((self._queued + self._in_flight) / self.max_batch_size) + 1
        return max(1, math.ceil(batches * self._batch_seconds / self.workers))

    # -- life cycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the worker threads, delivering to the running event loop."""
        if self._loop is not None:
            raise RuntimeError(f"batcher {self.name!r} already started")
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._alive = self.workers
        for i in range(self.workers):
            t = threading.Thread(target=self._work, name=f"serve-{self.name}_{i}", daemon=True)
            self._threads.append(t)
            t.start()
        self._accepting = True

    def stop_waiting(self) -> None:
        """Runs queued items without waiting for batches to fill, from now on: the server is
        stopping, no new connections will come, and accepted requests should not wait out
        ``max_wait_ms`` for company that cannot arrive. Jobs are still accepted."""
        with self._lock:
            self._no_wait = True
            self._lock.notify_all()

    async def drain(self) -> None:
        """Graceful stop: refuse new jobs at once, finish every queued and running one, then
        stop the worker threads."""
        self._accepting = False
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._stopped is None:
            return
        await asyncio.shield(self._stopped)
        for t in self._threads:
            t.join()

    # -- submitting -----------------------------------------------------------------------------

    def check_fits(self, n: int) -> None:
        """Raises what ``submit`` would for a job of ``n`` items, before the job is built."""
        if not self._accepting:
            raise Draining(f"model {self.name!r} is shutting down (or not started)", self.retry_after())
        if n > self.max_queue:
            raise TooManyItems(f"the request holds {n} items; this server queues at most {self.max_queue} "
                               f"per model (send fewer per request)")
        if self._queued + n > self.max_queue:
            raise Overloaded(f"model {self.name!r} is overloaded: {self._queued} items queued, {n} more do not fit "
                             f"(queue limit {self.max_queue})", self.retry_after())

    async def submit(self, job) -> Any:
        """Queues the job's items and returns ``job.finish(outputs)`` once all are done.

        Raises at once (nothing queued): ``Draining`` after ``drain()``, ``Overloaded`` when the
        queue has no room for all the job's items, ``TooManyItems`` when it never could.
        Raises ``BatchFailed`` when a batch holding one of its items failed.
        """
        pending = self.enqueue(job)
        try:
            return await pending.future
        except asyncio.CancelledError:
            self.abandon(pending)
            raise

    def enqueue(self, job) -> _Pending:
        """Queues the job's items (raising as ``submit`` does); its answer comes in ``.future``."""
        n = len(job.items)
        self.check_fits(n)
        pending = _Pending(job, asyncio.get_running_loop().create_future())
        if n == 0:
            pending.future.set_result(job.finish([]))
            return pending
        now = time.monotonic()
        items = [_Item(pending, i, enc, length_bucket(enc.length, self.bucket_edges), now)
                 for i, enc in enumerate(job.items)]
        pending.items = items
        with self._lock:
            if self.batching:
                for item in items:
                    self._buckets.setdefault(item.bucket, collections.deque()).append(item)
            else:
                self._jobs.append(pending)
            self._queued += n
            self._lock.notify()
        self._report_depth()
        return pending

    def abandon(self, pending: _Pending) -> None:
        """The caller went away (client disconnect, shutdown): its waiting items leave the queue
        unrun, counted; an item already running finishes and is dropped."""
        removed = self._withdraw(pending)
        if removed and self._observer is not None:
            self._observer.observe_abandoned(self.name, removed)
        if not pending.future.done():
            pending.future.cancel()

    def _withdraw(self, pending: _Pending) -> int:
        """Removes the job's still-queued items from the queue; returns how many."""
        with self._lock:
            removed = self._withdraw_locked(pending)
        self._report_depth()
        return removed

    def _withdraw_locked(self, pending: _Pending) -> int:
        if self.batching:
            removed = 0
            for bucket in {it.bucket for it in pending.items}:
                q = self._buckets.get(bucket)
                if q:
                    kept = collections.deque(it for it in q if it.pending is not pending)
                    removed += len(q) - len(kept)
                    self._buckets[bucket] = kept
        else:
            removed = len(pending.items) if pending in self._jobs else 0
            if removed:
                self._jobs.remove(pending)
        self._queued -= removed
        return removed

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            jobs = {id(it.pending): it.pending for q in self._buckets.values() for it in q}
            jobs.update({id(p): p for p in self._jobs})
            self._buckets.clear()
            self._jobs.clear()
            self._queued = 0
        self._report_depth()
        for p in jobs.values():
            if not p.done:
                p.future.set_exception(err)

    # -- the batching loop ----------------------------------------------------------------------

    def _work(self) -> None:
        """A worker thread: takes the next batch as soon as it is ready, runs it, and hands the
        outputs to the event loop; returns once the batcher is draining and nothing is queued."""
        batch = None
        try:
            while True:
                batch = None
                with self._lock:
                    batch = self._next_batch()
                    if batch is None:
                        return
                    self._in_flight += len(batch)
                start = time.monotonic()
                outputs, err = None, None
                try:
                    outputs = self._run([it.encoded for it in batch])
                    if len(outputs) != len(batch):
                        raise RuntimeError(f"the model returned {len(outputs)} outputs for a batch of {len(batch)} items")
                except Exception as e:  # noqa: BLE001 - one failed batch must not stop the model's service
                    err = e
                seconds = time.monotonic() - start
                with self._lock:
                    if err is not None:  # the failed jobs' other items leave the queue before the next take
                        for pending in {id(it.pending): it.pending for it in batch}.values():
                            self._withdraw_locked(pending)
                    self._in_flight -= len(batch)
                    self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * seconds
                    tokens = sum(it.encoded.length for it in batch)
                    if tokens:
                        self._token_seconds = 0.8 * self._token_seconds + 0.2 * seconds / tokens
                self._to_loop(self._deliver, batch, outputs, err, start, seconds)
        except BaseException as e:  # a bug: no job may hang on it, queued or in this batch; logged there
            self._to_loop(self._worker_failed, e, batch)
        finally:
            with self._lock:
                self._alive -= 1
                last = self._alive == 0
            if last:
                self._to_loop(self._all_stopped)

    def _next_batch(self) -> list[_Item] | None:
        """(Under the lock.) The next ready batch, waiting for one; None once draining with
        nothing queued."""
        while True:
            now = time.monotonic()
            batch = self._take_batch(now)
            if batch is not None:
                return batch
            if self._closing and self._queued == 0:
                return None
            deadline = self._next_deadline()
            self._lock.wait(None if deadline is None else max(0.0, deadline - now))

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is left to answer
            pass

    def _worker_failed(self, e: BaseException, batch: list[_Item] | None) -> None:
        self._accepting = False
        log.error("a worker of the batcher of model %s failed: %r", self.name, e, exc_info=e)
        err = BatchFailed(f"the batcher of model {self.name!r} failed: {e!r}")
        if batch:
            self._fail_batch(batch, err)
        self._fail_all(err)

    def _all_stopped(self) -> None:
        if not self._stopped.done():
            self._stopped.set_result(None)

    def _take_batch(self, now: float) -> list[_Item] | None:
        """The next batch to run, taken off the queue; None when no bucket is ready yet."""
        if not self.batching:
            if not self._jobs:
                return None
            pending = self._jobs.popleft()
            self._queued -= len(pending.items)
            return list(pending.items)
        best = None
        for bucket, q in self._buckets.items():
            if not q:
                continue
            head = q[0].turn
            ready = (len(q) >= self.max_batch_size or now - q[0].queued_at >= self.max_wait or self._closing
                     or self._no_wait)
            if ready and (best is None or head < self._buckets[best][0].turn):
                best = bucket
        if best is None:
            return None
        q = self._buckets[best]
        batch = self._take_turns(q)
        self._queued -= len(batch)
        # Weighted fair turns: a request's next turn comes as much later as its share of this batch
        # takes to run, times the requests waiting, so each gets about an equal share of the model:
        # one that just took thousands of tokens waits behind requests of a few.
        used: dict[int, int] = {}
        for it in batch:
            used[id(it.pending)] = used.get(id(it.pending), 0) + it.encoded.length
        waiting = {id(it.pending) for b in self._buckets.values() for it in b} | set(used)
        rest = list(q)
        for it in rest:
            if id(it.pending) in used:
                it.turn = now + used[id(it.pending)] * self._token_seconds * len(waiting)
        rest.sort(key=lambda it: it.turn)  # stable: each request's items keep their order
        self._buckets[best] = collections.deque(rest)
        return batch

    def _take_turns(self, q: collections.deque) -> list[_Item]:
        """Up to ``max_batch_size`` items (and ``max_batch_tokens`` tokens) off ``q``, one of each
        waiting request in turn, in the order the requests' turns came."""
        jobs: dict[int, collections.deque] = {}
        for it in q:
            jobs.setdefault(id(it.pending), collections.deque()).append(it)
        batch, tokens = [], 0
        while jobs and len(batch) < self.max_batch_size:
            for key in list(jobs):
                it = jobs[key][0]
                if batch and self.max_batch_tokens and tokens + it.encoded.length > self.max_batch_tokens:
                    jobs.clear()
                    break
                batch.append(jobs[key].popleft())
                tokens += it.encoded.length
                if not jobs[key]:
                    del jobs[key]
                if len(batch) == self.max_batch_size:
                    break
        taken = {id(it) for it in batch}
        q_rest = [it for it in q if id(it) not in taken]
        q.clear()
        q.extend(q_rest)
        return batch

    def _next_deadline(self) -> float | None:
        heads = [q[0].queued_at for q in self._buckets.values() if q]
        return min(heads) + self.max_wait if heads else None

    def _deliver(self, batch: list[_Item], outputs: list | None, err: Exception | None, start: float,
                 seconds: float) -> None:
        """(On the event loop.) A batch's outputs to their jobs, or its failure to every job in it."""
        if self._observer is not None:
            self._observer.observe_batch(self.name, len(batch), [start - it.queued_at for it in batch], seconds)
        self._report_depth()
        if err is not None:
            log.warning("model %s: a batch of %d items failed: %s: %s", self.name, len(batch), type(err).__name__, err)
            self._fail_batch(batch, BatchFailed(f"inference failed: {type(err).__name__}: {err}"))
            return
        for it, out in zip(batch, outputs):
            pending = it.pending
            if pending.done:  # withdrawn or failed meanwhile
                continue
            pending.outputs[it.index] = out
            pending.left -= 1
            if pending.left == 0:
                try:
                    pending.future.set_result(pending.job.finish(pending.outputs))
                except Exception as e:  # noqa: BLE001 - a bad answer fails its own job only
                    log.warning("model %s: building an answer failed: %s: %s", self.name, type(e).__name__, e)
                    pending.future.set_exception(BatchFailed(f"building the answer failed: {type(e).__name__}: {e}"))

    def _fail_batch(self, batch: list[_Item], err: Exception) -> None:
        """Fails every job with an item in the batch, and takes their other items off the queue."""
        for pending in {id(it.pending): it.pending for it in batch}.values():
            self._withdraw(pending)
            if not pending.done:
                pending.future.set_exception(err)

    def _report_depth(self) -> None:
        if self._observer is not None:
            self._observer.set_queue_depth(self.name, self._queued)
