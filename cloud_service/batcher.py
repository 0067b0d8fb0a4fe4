"""A Triton-style dynamic batcher: no RPC types inside.

Requests queue per model; each model instance (session) is guarded by a lock. Two kinds of caller:

- `submit()` (coroutines: the MQTT bridge): the request waits for the model's instance threads.
  Each instance has one dedicated thread that takes a batch from the queue (concatenating compatible
  requests along axis 0), runs it there, off the event loop, and answers the batch's futures with one
  event-loop callback.
- `run()` (blocking threads: the gRPC handlers): leader/follower. The caller queues its request,
  then, when an instance is free, takes the batch at the head of the queue (its own request and
  whatever waits with it) and runs it in its own thread; otherwise it waits for an instance thread
  or another leader to answer it. With nothing queued and an instance free, the request runs at
  once without entering the queue. An idle server thus runs a request with no thread hand-off at
  all; a busy one batches what piled up while the instances were busy.

- Admission by deadline (`BatchingConfig.admission`): a request whose deadline cannot be met, given
  the queued work ahead of it and the model's measured run time per batch size
  (`admission.ServiceTimes`), is refused at once with `ServerBusy` (RESOURCE_EXHAUSTED plus a retry
  hint), never queued to expire. A full queue refuses the same way.
- The queue is ordered by deadline (earliest first; a request without one counts as due one CoDel
  interval after it arrived). A batch is formed only from requests that can still be answered in
  time: it grows while it would end before the earliest deadline in it. A queued request whose
  deadline passed, or can no longer be met, is dropped before compute (`CloudTimeout` once passed,
  `ServerBusy` before); a request whose caller went away (cancelled future, or a blocking caller
  past its deadline) is skipped. Whenever a batch ends (and the estimate moves), the queue is
  checked again and every request that can no longer make its deadline is refused then, not
  when it reaches the head.
- Requests without a deadline: while the queue is standing (`admission.StandingQueue`, CoDel) they
  are refused when the wait ahead exceeds the CoDel interval and dropped once they waited that long.
- Requests batch together only when their non-batch dimensions and dtypes agree; the others wait
  for a later batch, in order.
- When a merged batch fails, its requests run one by one, so one poisonous input fails alone.

Example:
    >>> async with DynamicBatcher("digits", [session.run], BatchingConfig(max_batch_size=32),
    ...                           batched=True) as batcher:
    ...     outputs = await batcher.infer({"x": x}, deadline=loop.time() + 0.5)
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from cloud_service.admission import RetryHints, ServiceTimes, StandingQueue
from cloud_service.config import BatchingConfig
from cloud_service.errors import ServerBusy
from runtimes.errors import BackendUnavailable, CloudTimeout, InferenceError, InputError, TierkitError

log = logging.getLogger(__name__)

Arrays = Mapping[str, np.ndarray]
Runner = Callable[[Arrays], Mapping[str, np.ndarray]]
Outcome = dict[str, np.ndarray] | BaseException


class BatchObserver(Protocol):
    """Receives the batcher's measurements (the metrics module implements it), from any thread."""

    def on_queue(self, depth: int) -> None: ...
    def on_batch(self, rows: int, requests: int, seconds: float, queued: float) -> None:
        """One run: rows and requests in it, its run time, and the seconds its requests waited in all."""
    def on_expired(self, count: int) -> None: ...
    def on_refused(self, reason: str) -> None:
        """A request refused at admission: `deadline` (cannot be met), `queue_full` or `standing`."""
    def on_queue_time(self, seconds: float) -> None:
        """A request left the queue (to run, or dropped) after waiting `seconds`."""


class _NullObserver:
    def on_queue(self, depth: int) -> None:
        pass

    def on_batch(self, rows: int, requests: int, seconds: float, queued: float) -> None:
        pass

    def on_expired(self, count: int) -> None:
        pass

    def on_refused(self, reason: str) -> None:
        pass

    def on_queue_time(self, seconds: float) -> None:
        pass


class BatcherClosed(BackendUnavailable):
    """The batcher is closing (its model is being unloaded or swapped): look the model up again."""


class _Waiter:
    """A blocking caller's answer slot: set once, by whichever thread answers the request.

    A held lock, released by `set`, rather than a `threading.Event` (a Python-level condition):
    in the common case the caller answers itself and never blocks.
    """

    __slots__ = ("_done", "_lock", "outcome")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self.outcome: Outcome | None = None

    def done(self) -> bool:
        return self._done

    def set(self, outcome: Outcome) -> None:
        if self._done:
            return
        self._done = True
        self.outcome = outcome
        with contextlib.suppress(RuntimeError):  # a racing second answer finds it released
            self._lock.release()

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """The outcome; None when `timeout` seconds passed first."""
        if not self._done and not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return None
        return self.outcome


@dataclass(eq=False, slots=True)
class _Request:
    inputs: Arrays
    rows: int
    key: tuple[Any, ...]
    deadline: float | None  # time.monotonic()
    enqueued: float  # time.monotonic()
    future: asyncio.Future[dict[str, np.ndarray]] | _Waiter
    order: tuple[float, int] = (0.0, 0)  # (deadline, or arrival plus the CoDel interval; arrival number)


class DynamicBatcher:
    """Queue, batch and run requests for one model.

    Args:
        name: model name, for messages and thread names.
        runners: one blocking `run(inputs) -> outputs` per model instance.
        config: batching limits.
        batched: whether inputs may be concatenated along axis 0 (every input and output has a
            dynamic batch axis). When False each request runs alone, still bounded by the queue.
        observer: receives queue depth, batch sizes and drops (called from the threads that run batches).
    """

    def __init__(self, name: str, runners: Sequence[Runner], config: BatchingConfig, *, batched: bool,
                 observer: BatchObserver | None = None) -> None:
        if not runners:
            msg = f"model {name!r}: at least one model instance is needed"
            raise InferenceError(msg)
        self.name = name
        self.config = config
        self.batched = batched and config.max_batch_size > 1
        # A request may run the moment an instance is free unless it should wait for company
        # (a queue delay with batching: Triton holds it up to the delay, idle instance or not).
        self._eager = not self.batched or config.max_queue_delay_us == 0
        self._runners = list(runners)
        self._observer: BatchObserver = observer or _NullObserver()
        self._queue: list[_Request] = []  # sorted by `order`: earliest deadline first
        self._queued_rows = 0
        self._arrivals = itertools.count()
        self._times = ServiceTimes(config.max_batch_size if self.batched else 1)
        self._standing = StandingQueue(config.queue_target_ms / 1000, config.queue_interval_ms / 1000)
        self._hints = RetryHints()
        # per instance: (start, planned end) of the batch it runs, None while idle
        self._running_span: list[tuple[float, float] | None] = [None] * len(self._runners)
        # A batch holds its instance for its whole run: requests with plenty of time (a journal's drain)
        # must not form one so long that a tight request arriving meanwhile misses its deadline behind it.
        self._batch_cap_s = config.queue_interval_ms / 4000
        self._ready = threading.Condition(threading.Lock())
        self._instances = [threading.Lock() for _ in self._runners]  # held while a session runs
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._finished: list[asyncio.Future[None]] = []
        self._running: dict[int, list[_Request]] = {}  # instance -> the batch it is computing
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> DynamicBatcher:
        self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        for i, runner in enumerate(self._runners):
            # One thread per instance: the backend call blocks, and a session is used by one thread.
            finished: asyncio.Future[None] = loop.create_future()
            thread = threading.Thread(target=self._main, args=(i, runner, finished), name=f"tierkit-{self.name}-{i}",
                                      daemon=True)
            self._finished.append(finished)
            self._threads.append(thread)
            thread.start()

    async def aclose(self, timeout: float | None = None) -> None:
        """Stop taking requests, finish the queued ones (up to `timeout`), stop the threads."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        started = time.monotonic()
        if self._finished:
            await asyncio.wait(self._finished, timeout=timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        await asyncio.to_thread(self._quiesce, left)  # leaders still running a batch finish it
        with self._ready:  # threads still busy after the timeout: answer, never strand a caller
            stranded = [*self._queue, *(r for batch in self._running.copy().values() for r in batch)]
            self._queue.clear()
            self._queued_rows = 0
        for request in stranded:
            msg = f"model {self.name!r} was unloaded before this request was answered; retry"
            _answer(request, BackendUnavailable(msg))
        self._finished.clear()

    def _quiesce(self, timeout: float | None) -> None:
        """Wait (up to `timeout` in all) until no thread is running a session."""
        end = None if timeout is None else time.monotonic() + timeout
        for lock in self._instances:
            wait = -1.0 if end is None else max(0.0, end - time.monotonic())
            if lock.acquire(timeout=wait):
                lock.release()

    def submit(self, inputs: Arrays, *, deadline: float | None = None) -> asyncio.Future[dict[str, np.ndarray]]:
        """Queue one request; its future resolves to the outputs. Raises at once when refused.

        Args:
            inputs: validated input arrays.
            deadline: absolute time on the event loop's clock (`loop.time()`) after which the
                request is dropped instead of computed.
        """
        loop = self._loop
        if loop is None:
            msg = f"model {self.name!r} is not started; retry"
            raise BackendUnavailable(msg)
        future: asyncio.Future[dict[str, np.ndarray]] = loop.create_future()
        due = None if deadline is None else time.monotonic() + (deadline - loop.time())
        self._enqueue(inputs, due, future, wake=True)
        return future

    def run(self, inputs: Arrays, *, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Blocking: queue one request and return its outputs (see the module doc: leader/follower).

        Args:
            inputs: validated input arrays.
            timeout: seconds after which the request is dropped instead of computed (None: never).

        Raises:
            BatcherClosed, ServerBusy, InputError, CloudTimeout, InferenceError.
        """
        if self._eager and not self._queue and not self._closed:
            outcome = self._run_now(inputs, timeout)
            if isinstance(outcome, BaseException):
                raise outcome
            if outcome is not None:
                return outcome
        waiter = _Waiter()
        due = None if timeout is None else time.monotonic() + timeout
        request = self._enqueue(inputs, due, waiter, wake=False)  # it tries to run it itself first
        if not self._lead(request):
            with self._ready:  # no instance free: an instance thread (or the next leader) answers it
                self._ready.notify()
        # Wait no longer than the deadline: the caller has gone then, and this thread (a gRPC worker)
        # is free again at once; the request is skipped if it has not run yet.
        outcome = waiter.wait(None if due is None else due - time.monotonic())
        if outcome is None:
            msg = f"model {self.name!r}: request expired: no answer within its deadline (dropped unless it was running)"
            waiter.set(CloudTimeout(msg))
            outcome = waiter.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome

    def _run_now(self, inputs: Arrays, timeout: float | None) -> Outcome | None:
        """Nothing queued and an instance free: run here without queueing (what the queue would do
        when requests may not wait for company: `_eager`).

        Returns None when every instance is busy or a request queued meanwhile: queue then.
        """
        for index, lock in enumerate(self._instances):
            if not lock.acquire(blocking=False):
                continue
            try:
                if self._queue:  # someone queued first: keep the order
                    return None
                rows, _ = self._shape_key(inputs)
                if timeout is not None and timeout <= 0:
                    self._observer.on_expired(1)
                    msg = f"model {self.name!r}: request expired before it ran; not computed"
                    return CloudTimeout(msg)
                # An idle instance runs it whatever the estimate says: refusing here would stop the
                # measurements that correct an estimate a burst of load left too high.
                need = self._times.batch_seconds(rows)
                started = time.perf_counter()
                self._running_span[index] = (time.monotonic(), time.monotonic() + need)
                outcome = self._call(self._runners[index], inputs, rows)
                self._running_span[index] = None
                self._ran(rows, 1, time.perf_counter() - started, 0.0)
            finally:
                lock.release()
            if self._queue:  # requests that queued while this one ran: wake a thread for them
                with self._ready:
                    self._ready.notify()
            return outcome
        return None

    def _enqueue(self, inputs: Arrays, due: float | None, future: asyncio.Future[dict[str, np.ndarray]] | _Waiter,
                 *, wake: bool) -> _Request:
        if self._closed:
            msg = f"model {self.name!r} is not accepting requests (unloading); retry"
            raise BatcherClosed(msg)
        rows, key = self._shape_key(inputs)
        now = time.monotonic()
        order = (due if due is not None else now + self._standing.interval_s, next(self._arrivals))
        request = _Request(inputs, rows, key, due, now, future, order)
        with self._ready:
            if len(self._queue) >= self.config.max_queue_size:
                self._observer.on_refused("queue_full")
                why = f"queue full ({self.config.max_queue_size} requests waiting)"
                raise self._busy(why, self._finish_in(now, self._queued_rows, 0))
            if self.config.admission and self._times.known:
                self._admit(request, now)
            bisect.insort(self._queue, request, key=_order)
            self._queued_rows += rows
            if wake:
                self._ready.notify()
        self._observer.on_queue(len(self._queue))
        return request

    def _admit(self, request: _Request, now: float) -> None:
        """Raise `ServerBusy` when `request` cannot be answered by its deadline (its lock held)."""
        refusal = self._refusal(request.rows, request.deadline, request.order, now)
        if refusal is not None:
            self._observer.on_refused("deadline" if request.deadline is not None else "standing")
            raise refusal

    def _refusal(self, rows: int, deadline: float | None, order: tuple[float, int], now: float) -> ServerBusy | None:
        """The refusal of a request of `rows` rows due at `deadline`, or None when it can be answered in
        time (the lock held).

        The work ahead of it is every queued request due before it (the queue is served earliest
        deadline first) plus what the busy instances have left, with the measured slack of a run past
        its plan (`ServiceTimes.headroom_s`); requests without a deadline are held to the CoDel
        interval while the queue is standing.
        """
        if not self._queue and any(span is None for span in self._running_span):
            return None  # an idle instance takes it now: run it, and measure (see `_run_now`)
        limit = deadline
        if limit is None:
            if not self._standing.standing:
                return None
            limit = now + self._standing.interval_s
        ahead = 0
        for queued in self._queue:
            if queued.order > order:
                break
            ahead += queued.rows
        done = self._finish_in(now, ahead, rows) + (self._times.headroom_s() if deadline is not None else 0.0)
        if now + done <= limit:
            return None
        left = max(0.0, limit - now) * 1000
        why = (f"the queue ahead and the model's run time need about {done * 1000:.1f} ms, "
               f"the deadline leaves {left:.1f} ms")
        return self._busy(why, now + done - limit)

    def admissible(self, rows: int, timeout: float | None) -> ServerBusy | None:
        """Whether a request of `rows` rows with `timeout` seconds left would be admitted now: None, or
        the refusal it would get (counted). For a front end that refuses before decoding a request
        (the MQTT bridge on its network thread); the request is admitted again when it is queued.
        """
        if not self.config.admission or not self._times.known or self._closed:
            return None
        rows = rows if self.batched else 1
        now = time.monotonic()
        due = None if timeout is None else now + timeout
        order = (due if due is not None else now + self._standing.interval_s, -1)
        with self._ready:
            refusal = self._refusal(rows, due, order, now)
        if refusal is not None:
            self._observer.on_refused("deadline" if due is not None else "standing")
        return refusal

    def _finish_in(self, now: float, ahead_rows: int, rows: int) -> float:
        """Seconds until a request of `rows` rows behind `ahead_rows` queued rows would be answered."""
        # No instance free: the first to finish. A run past its planned end is not about to end: on a
        # loaded host it often takes as long again, so half its plan is still counted.
        spans = [span for span in self._running_span if span is not None]
        wait = 0.0
        if len(spans) == len(self._running_span):
            wait = min(max(end - now, (end - start) / 2) for start, end in spans)
        return wait + self._times.drain_seconds(ahead_rows + rows, len(self._runners))

    def _busy(self, why: str, over_s: float) -> ServerBusy:
        """The refusal (the lock held): why, and a hint of when to retry: no sooner than the queue is
        shorter by the excess, and spread by the refusal pressure (`admission.RetryHints`)."""
        floor = max(over_s, self._times.batch_seconds(1), 0.001)
        hint = self._hints.hint_s(time.monotonic(), floor, self._times.rows_per_s(len(self._runners)))
        msg = f"model {self.name!r} is overloaded: {why}; not queued, retry after the hinted delay or add replicas"
        return ServerBusy(msg, retry_after_ms=min(5000, math.ceil(hint * 1000)))

    def busy_hint_ms(self) -> int:
        """A retry hint for a refusal made in front of the queue (the MQTT bridge's full hand-off)."""
        with self._ready:
            return self._busy("", 0.0).retry_after_ms

    def _lead(self, request: _Request) -> bool:
        """Run batches in this thread while an instance is free and `request` is unanswered."""
        for index, lock in enumerate(self._instances):
            if not lock.acquire(blocking=False):
                continue
            try:
                while not request.future.done() and (batch := self._take_now()) is not None:
                    self._serve(index, self._runners[index], batch)
            finally:
                lock.release()
            if self._queue:
                with self._ready:
                    self._ready.notify()
            return request.future.done()
        return False

    async def infer(self, inputs: Arrays, *, deadline: float | None = None) -> dict[str, np.ndarray]:
        """Queue one request and wait for its outputs."""
        return await self.submit(inputs, deadline=deadline)

    def _shape_key(self, inputs: Arrays) -> tuple[int, tuple[Any, ...]]:
        if not self.batched:
            return 1, ()
        if len(inputs) == 1:  # the common case, without the set and the sort
            ((name, array),) = inputs.items()
            if array.ndim and array.shape[0] <= self.config.max_batch_size:
                return int(array.shape[0]), ((name, array.dtype.str, array.shape[1:]),)
        rows = {int(a.shape[0]) if a.ndim else -1 for a in inputs.values()}
        if len(rows) != 1 or -1 in rows:
            msg = f"model {self.name!r}: all inputs must share axis 0 (the batch), got {sorted(rows)}"
            raise InputError(msg)
        (n,) = rows
        if n > self.config.max_batch_size:
            msg = f"model {self.name!r}: batch of {n} rows exceeds max_batch_size {self.config.max_batch_size}"
            raise InputError(msg)
        return n, tuple((k, a.dtype.str, a.shape[1:]) for k, a in sorted(inputs.items()))

    # -- on the event loop, called from the instance threads ------------------------------------

    @staticmethod
    def _deliver(requests: list[_Request], outcomes: list[Outcome]) -> None:
        for request, outcome in zip(requests, outcomes, strict=True):
            _answer(request, outcome)

    # -- in the instance's thread --------------------------------------------------------------

    def _main(self, index: int, runner: Runner, finished: asyncio.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        try:
            while (batch := self._take()) is not None:
                with self._instances[index]:
                    self._serve(index, runner, batch)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop closed first
                loop.call_soon_threadsafe(_finish, finished)

    def _serve(self, index: int, runner: Runner, batch: list[_Request]) -> None:
        """Run `batch` on instance `index` (its lock held) and answer every request in it."""
        now = time.monotonic()
        done: list[_Request] = []
        outcomes: list[Outcome] = []
        live: list[_Request] = []
        for request in batch:
            if request.future.done():  # the caller gave up (cancelled, or a blocking caller past its deadline)
                continue
            if request.deadline is not None and now >= request.deadline:
                done.append(request)
                outcomes.append(self._expired(request, now))
            else:
                live.append(request)
        if done:
            self._observer.on_expired(len(done))
        if live:
            rows = sum(r.rows for r in live)
            self._running[index] = live  # one dict store: atomic; aclose() copies before reading
            self._running_span[index] = (now, now + self._times.batch_seconds(rows))
            started = time.perf_counter()
            outcomes += self._run(runner, live)
            self._running_span[index] = None  # free again: the re-check in `_ran` counts no wait for it
            self._ran(rows, len(live), time.perf_counter() - started, sum(now - r.enqueued for r in live))
            done += live
        self._observer.on_queue(len(self._queue))
        self._reply(done, outcomes)
        if live:
            self._running.pop(index, None)

    def _reply(self, requests: list[_Request], outcomes: list[Outcome]) -> None:
        """Answer requests from any thread: blocking callers at once, futures on the event loop."""
        later: list[tuple[_Request, Outcome]] = []
        for request, outcome in zip(requests, outcomes, strict=True):
            if isinstance(request.future, _Waiter):
                request.future.set(outcome)
            else:
                later.append((request, outcome))
        if later and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed while this batch ran
                self._loop.call_soon_threadsafe(self._deliver, [r for r, _ in later], [o for _, o in later])

    def _expired(self, request: _Request, now: float) -> Outcome:
        waited = (now - request.enqueued) * 1000
        msg = f"model {self.name!r}: request expired after {waited:.1f} ms in the queue; not computed"
        return CloudTimeout(msg)

    def _ran(self, rows: int, requests: int, seconds: float, queued: float) -> None:
        """Account one run: the service-time model behind admission and the retry hint, and the observer;
        then refuse at once the queued requests the updated estimate says can no longer be answered."""
        with self._ready:
            self._times.observe(rows, seconds)
            shed = self._shed_hopeless(time.monotonic()) if self.config.admission else []
        if shed:
            self._observer.on_expired(len(shed))
            self._reply([r for r, _ in shed], [o for _, o in shed])
            self._observer.on_queue(len(self._queue))
        self._observer.on_batch(rows, requests, seconds, queued)

    def _shed_hopeless(self, now: float) -> list[tuple[_Request, Outcome]]:
        """Take out of the queue (its lock held) every request with a deadline that the queue ahead of it
        (earliest deadline first) and the measured run time can no longer answer in time, with its refusal.

        Run whenever a batch ends and the estimate moves, so that a request that became hopeless is
        refused then, not when it reaches the head of the queue: a refusal never waits for compute it
        will not get. A lone queued request is left to run (its measurement corrects the estimate).
        """
        if len(self._queue) <= 1:
            return []
        kept: list[_Request] = []
        shed: list[tuple[_Request, Outcome]] = []
        ahead = 0
        for request in self._queue:
            if request.deadline is not None and not request.future.done():
                done = self._finish_in(now, ahead, request.rows)
                if now + done > request.deadline:
                    outcome = self._expired(request, now) if now >= request.deadline else self._busy(
                        f"queued {(now - request.enqueued) * 1000:.1f} ms, the queue ahead and the model's run time "
                        f"need {done * 1000:.1f} ms more, its deadline leaves {(request.deadline - now) * 1000:.1f} ms",
                        now + done - request.deadline)
                    shed.append((request, outcome))
                    continue
            kept.append(request)
            if not request.future.done():
                ahead += request.rows
        if shed:
            self._queue[:] = kept
            self._queued_rows = sum(r.rows for r in kept)
            for request, _ in shed:
                self._observer.on_queue_time(now - request.enqueued)
                self._standing.observe(now, now - request.enqueued)
        return shed

    def _take(self) -> list[_Request] | None:
        delay = self.config.max_queue_delay_us / 1e6
        with self._ready:
            while True:
                if not self._queue:
                    if self._closed:
                        return None
                    self._standing.emptied()
                    self._ready.wait()
                    continue
                head = self._queue[0]
                if (not self.batched or self._closed or delay == 0
                        or self._ready_rows(head) >= self.config.target_rows):
                    batch = self._pop_batch()
                    if batch:
                        return batch
                    continue  # everything at the head was dropped: look again
                wait = head.enqueued + delay - time.monotonic()
                if wait <= 0:
                    batch = self._pop_batch()
                    if batch:
                        return batch
                    continue
                self._ready.wait(wait)

    def _take_now(self) -> list[_Request] | None:
        """The batch to run now, or None when the queue is empty or its head should wait for more."""
        with self._ready:
            while self._queue:
                head = self._queue[0]
                delay = self.config.max_queue_delay_us / 1e6
                if (self.batched and not self._closed and delay > 0 and self._ready_rows(head) < self.config.target_rows
                        and head.enqueued + delay > time.monotonic()):
                    return None
                batch = self._pop_batch()
                if batch:
                    return batch
            self._standing.emptied()
            return None

    def _ready_rows(self, head: _Request) -> int:
        rows = 0
        for request in self._queue:
            if request.key == head.key:
                rows += request.rows
                if rows >= self.config.max_batch_size:
                    break
        return rows

    def _pop_batch(self) -> list[_Request]:
        """Take the next batch (the lock held): drop what can no longer be answered in time, then take
        compatible requests in deadline order while the batch still ends before the earliest deadline in it.

        Returns an empty list when every request looked at was dropped.
        """
        now = time.monotonic()
        # a lone request runs unless its deadline passed: the measurement corrects a stale estimate
        admission = self.config.admission and len(self._queue) > 1
        shed: list[_Request] = []
        shed_outcomes: list[Outcome] = []
        batch: list[_Request] = []
        rows, limit, size = 0, math.inf, self.config.max_batch_size if self.batched else 1
        head_key: tuple[Any, ...] | None = None
        kept: list[_Request] = []
        for request in self._queue:
            if batch and (rows >= size or (head_key is not None and request.key != head_key)):
                kept.append(request)
                continue
            if request.future.done():  # a caller that left: nothing to answer
                shed.append(request)
                shed_outcomes.append(CloudTimeout("abandoned"))
                continue
            outcome = self._hopeless(request, now, admission)
            if outcome is not None:
                shed.append(request)
                shed_outcomes.append(outcome)
                continue
            due = limit if request.deadline is None else min(limit, request.deadline)
            planned = self._times.batch_seconds(rows + request.rows)
            fits = rows + request.rows <= size and (
                not admission or not batch or (now + planned <= due and planned <= self._batch_cap_s))
            if not fits:
                kept.append(request)
                continue
            batch.append(request)
            rows += request.rows
            limit, head_key = due, request.key
        self._queue[:] = kept
        self._queued_rows = sum(r.rows for r in kept)
        for request in (*batch, *shed):
            self._observer.on_queue_time(now - request.enqueued)
            self._standing.observe(now, now - request.enqueued)
        answered = [(r, o) for r, o in zip(shed, shed_outcomes, strict=True) if not r.future.done()]
        if answered:
            self._observer.on_expired(len(answered))
            self._reply([r for r, _ in answered], [o for _, o in answered])
        return batch

    def _hopeless(self, request: _Request, now: float, admission: bool) -> Outcome | None:
        """Why a queued request is dropped before compute, or None when it can still be answered in time."""
        if request.deadline is not None and now >= request.deadline:
            return self._expired(request, now)
        if not admission:
            return None
        if request.deadline is not None:
            need = self._times.batch_seconds(request.rows)
            if now + need > request.deadline:
                return self._busy(f"queued {(now - request.enqueued) * 1000:.1f} ms, its deadline can no longer "
                                  f"be met by a {need * 1000:.1f} ms run", need - (request.deadline - now))
        elif self._standing.standing and now - request.enqueued > self._standing.interval_s:
            return self._busy(f"queued {(now - request.enqueued) * 1000:.1f} ms without a deadline while the queue "
                              "is standing", self._standing.interval_s)
        return None

    # -- in the instance's thread --------------------------------------------------------------

    def _run(self, runner: Runner, batch: list[_Request]) -> list[Outcome]:
        if len(batch) == 1:
            return [self._call(runner, batch[0].inputs, batch[0].rows)]
        merged = {name: np.concatenate([r.inputs[name] for r in batch]) for name in batch[0].inputs}
        total = sum(r.rows for r in batch)
        out = self._call(runner, merged, total)
        if isinstance(out, BaseException):
            # Isolate the request that broke the batch; the others still get answers.
            return [self._call(runner, r.inputs, r.rows) for r in batch]
        results: list[Outcome] = []
        start = 0
        for request in batch:
            stop = start + request.rows
            results.append({name: array[start:stop] for name, array in out.items()})
            start = stop
        return results

    def _call(self, runner: Runner, inputs: Arrays, rows: int) -> Outcome:
        try:
            out = {name: np.asarray(value) for name, value in runner(inputs).items()}
        except TierkitError as exc:
            return exc
        except Exception as exc:
            log.warning("model %r failed on a batch of %d rows: %s", self.name, rows, exc)
            msg = f"model {self.name!r} failed while running: {type(exc).__name__}: {exc}"
            error = InferenceError(msg)
            error.__cause__ = exc
            return error
        if self.batched:
            bad = {name: list(a.shape) for name, a in out.items() if a.ndim == 0 or a.shape[0] != rows}
            if bad:
                msg = f"model {self.name!r}: outputs {bad} do not have the batch's {rows} rows on axis 0"
                return InferenceError(msg)
        return out


def _answer(request: _Request, outcome: Outcome) -> None:
    """Set a request's outcome once, whichever kind of caller it has (on the loop for futures)."""
    future = request.future
    if isinstance(future, _Waiter):
        future.set(outcome)
    elif not future.done():
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _order(request: _Request) -> tuple[float, int]:
    return request.order


def _finish(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
