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

The queue itself, its order and its plan (admission, batch forming, giving up) are
`deadline_queue.DeadlineQueue`'s, called with this batcher's lock held; this module runs what it plans.

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
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from cloud_service.admission import ServiceTimes
from cloud_service.config import BatchingConfig
from cloud_service.deadline_queue import (
    Arrays,
    BatchObserver,
    DeadlineQueue,
    NullObserver,
    Outcome,
    Request,
    Waiter,
    answer,
)
from cloud_service.errors import ServerBusy
from runtimes.errors import BackendUnavailable, CloudTimeout, InferenceError, InputError, TierkitError

__all__ = ["BatchObserver", "BatcherClosed", "DynamicBatcher"]

log = logging.getLogger(__name__)

Runner = Callable[[Arrays], Mapping[str, np.ndarray]]


class BatcherClosed(BackendUnavailable):
    """The batcher is closing (its model is being unloaded or swapped): look the model up again."""


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
        self._observer: BatchObserver = observer or NullObserver()
        self._queue = DeadlineQueue(name, config, batched=self.batched, instances=len(self._runners),
                                    observer=self._observer)
        self._ready = threading.Condition(threading.Lock())
        self._instances = [threading.Lock() for _ in self._runners]  # held while a session runs
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._finished: list[asyncio.Future[None]] = []
        self._running: dict[int, list[Request]] = {}  # instance -> the batch it is computing
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

    @property
    def service_times(self) -> ServiceTimes:
        """The measured run times admission plans with (read them; the batcher updates them)."""
        return self._queue.times

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
            stranded = [*self._queue.clear(), *(r for batch in self._running.copy().values() for r in batch)]
        for request in stranded:
            msg = f"model {self.name!r} was unloaded before this request was answered; retry"
            answer(request, BackendUnavailable(msg))
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
        waiter = Waiter()
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
        assert outcome is not None
        self._answered([request], [outcome])  # in the caller's own thread, woken: what the caller waited
        if isinstance(outcome, BaseException):
            raise outcome
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
                need = self._queue.times.batch_seconds(rows)
                started, begun = time.perf_counter(), time.monotonic()
                self._queue.running_span[index] = (begun, begun + need)
                outcome = self._call(self._runners[index], inputs, rows)
                self._queue.running_span[index] = None
                self._ran(rows, 1, time.perf_counter() - started, 0.0)
                if self.config.admission and not isinstance(outcome, BaseException):
                    with self._ready:
                        self._queue.lag.observe(need, time.monotonic() - begun)
            finally:
                lock.release()
            if self._queue:  # requests that queued while this one ran: wake a thread for them
                with self._ready:
                    self._ready.notify()
            return outcome
        return None

    def _enqueue(self, inputs: Arrays, due: float | None, future: asyncio.Future[dict[str, np.ndarray]] | Waiter,
                 *, wake: bool) -> Request:
        if self._closed:
            msg = f"model {self.name!r} is not accepting requests (unloading); retry"
            raise BatcherClosed(msg)
        rows, key = self._shape_key(inputs)
        request = self._queue.request(inputs, rows, key, due, future)
        with self._ready:
            self._queue.put(request)  # raises ServerBusy when refused
            if wake:
                self._ready.notify()
        self._observer.on_queue(len(self._queue))
        return request

    def admissible(self, rows: int, timeout: float | None, *, waiting_rows: int = 0) -> ServerBusy | None:
        """Whether a request of `rows` rows with `timeout` seconds left would be admitted now: None, or
        the refusal it would get (counted). For a front end that refuses before decoding a request
        (the MQTT bridge on its network thread, the gRPC servicer); the request is admitted again when
        it is queued. `waiting_rows`: rows the front end let through and has not queued yet (work ahead).
        """
        if not self.config.admission or not self._queue.times.known or self._closed:
            return None
        if self.batched and rows > self.config.max_batch_size:  # too large to batch: its decoding answers
            return None  # with the precise error
        rows = rows if self.batched else 1
        now = time.monotonic()
        due = None if timeout is None else now + timeout
        order = (due if due is not None else now + self._queue.standing.interval_s, -1)
        with self._ready:
            refusal = self._queue.refusal(rows, due, order, now, waiting_rows=waiting_rows)
        if refusal is not None:
            self._observer.on_refused("deadline" if due is not None else "standing")
        return refusal

    def busy_hint_ms(self) -> int:
        """A retry hint for a refusal made in front of the queue (the MQTT bridge's full hand-off)."""
        with self._ready:
            return self._queue.busy("", 0.0).retry_after_ms

    def _pop_batch(self) -> list[Request]:
        """The next batch (the lock held); the requests dropped on the way are answered."""
        batch, dropped = self._queue.pop_batch()
        if dropped:
            self._reply([r for r, _ in dropped], [o for _, o in dropped])
        return batch

    def _lead(self, request: Request) -> bool:
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

    def _deliver(self, requests: list[Request], outcomes: list[Outcome]) -> None:
        for request, outcome in zip(requests, outcomes, strict=True):
            answer(request, outcome)
        self._answered(requests, outcomes)  # on the event loop: its own lag is part of what callers wait

    def _answered(self, requests: list[Request], outcomes: list[Outcome]) -> None:
        """Feed admission's plan back (`admission.AnswerLag`): how long after it was queued each admitted
        tight request's answer reached its caller, against what admission planned. A refusal after
        queueing is no answer; an expiry counts (its lag is at least what it shows). A loose request (a
        journal's drain, seconds to spare; `admission.TightBudget`) is not fed back: the tight requests
        arriving after it go ahead of it by design, so it is answered later than planned without any
        error in the plan, and a margin learnt from it would refuse the live requests it makes way for."""
        now = time.monotonic()
        with self._ready:
            budget = self._queue.budget
            for request, outcome in zip(requests, outcomes, strict=True):
                if request.planned is None or isinstance(outcome, ServerBusy):
                    continue
                left = None if request.deadline is None else request.deadline - request.enqueued
                if budget.is_tight(now, left):
                    self._queue.lag.observe(request.planned, now - request.enqueued)

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

    def _serve(self, index: int, runner: Runner, batch: list[Request]) -> None:
        """Run `batch` on instance `index` (its lock held) and answer every request in it."""
        now = time.monotonic()
        done: list[Request] = []
        outcomes: list[Outcome] = []
        live: list[Request] = []
        for request in batch:
            if request.future.done():  # the caller gave up (cancelled, or a blocking caller past its deadline)
                continue
            if request.deadline is not None and now >= request.deadline:
                done.append(request)
                outcomes.append(self._queue.expired(request, now))
            else:
                live.append(request)
        if done:
            self._observer.on_expired(len(done))
        if live:
            rows = sum(r.rows for r in live)
            self._running[index] = live  # one dict store: atomic; aclose() copies before reading
            self._queue.running_span[index] = (now, now + self._queue.times.batch_seconds(rows))
            started = time.perf_counter()
            outcomes += self._run(runner, live)
            self._queue.running_span[index] = None  # free again: the re-check in `_ran` counts no wait for it
            self._ran(rows, len(live), time.perf_counter() - started, sum(now - r.enqueued for r in live))
            done += live
        self._observer.on_queue(len(self._queue))
        self._reply(done, outcomes)
        if live:
            self._running.pop(index, None)

    def _reply(self, requests: list[Request], outcomes: list[Outcome]) -> None:
        """Answer requests from any thread: blocking callers at once, futures on the event loop."""
        later: list[tuple[Request, Outcome]] = []
        for request, outcome in zip(requests, outcomes, strict=True):
            if isinstance(request.future, Waiter):
                request.future.set(outcome)
            else:
                later.append((request, outcome))
        if later and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed while this batch ran
                self._loop.call_soon_threadsafe(self._deliver, [r for r, _ in later], [o for _, o in later])

    def _ran(self, rows: int, requests: int, seconds: float, queued: float) -> None:
        """Account one run: the service-time model behind admission and the retry hint, and the observer;
        then refuse at once the queued requests the updated estimate says can no longer be answered."""
        with self._ready:
            self._queue.times.observe(rows, seconds)
            shed = self._queue.shed_hopeless(time.monotonic()) if self.config.admission else []
        if shed:
            self._observer.on_expired(len(shed))
            self._reply([r for r, _ in shed], [o for _, o in shed])
            self._observer.on_queue(len(self._queue))
        self._observer.on_batch(rows, requests, seconds, queued)

    def _take(self) -> list[Request] | None:
        delay = self.config.max_queue_delay_us / 1e6
        with self._ready:
            while True:
                if not self._queue:
                    if self._closed:
                        return None
                    self._queue.standing.emptied()
                    self._ready.wait()
                    continue
                head = self._queue.items[0]
                if (not self.batched or self._closed or delay == 0
                        or self._queue.ready_rows(head) >= self.config.target_rows):
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

    def _take_now(self) -> list[Request] | None:
        """The batch to run now, or None when the queue is empty or its head should wait for more."""
        with self._ready:
            while self._queue:
                head = self._queue.items[0]
                delay = self.config.max_queue_delay_us / 1e6
                if (self.batched and not self._closed and delay > 0
                        and self._queue.ready_rows(head) < self.config.target_rows
                        and head.enqueued + delay > time.monotonic()):
                    return None
                batch = self._pop_batch()
                if batch:
                    return batch
            self._queue.standing.emptied()
            return None

    # -- in the instance's thread --------------------------------------------------------------

    def _run(self, runner: Runner, batch: list[Request]) -> list[Outcome]:
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


def _finish(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
