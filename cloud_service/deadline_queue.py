"""The batcher's queue and its plan: what is queued, in which order, what is admitted, what is given up.

`DeadlineQueue` holds the queued requests (earliest deadline first; one without a deadline counts as due
one CoDel interval after it arrived), the model's measured run time (`admission.ServiceTimes`), CoDel's
standing-queue detector and the retry hints, and answers the questions `batcher.DynamicBatcher` asks
of it: would this request be answered in time (else its refusal, with a hint), which batch runs next
(formed only from requests that can still make it), which queued requests became hopeless. It is
plain state: every method is called with the batcher's lock held, and it runs nothing and starts no
thread (the batcher's instance threads and leaders run what it plans, and answer what it gives up).

Also here: the queued request (`Request`), a blocking caller's answer slot (`Waiter`), and the
observer the batcher reports its measurements to (`BatchObserver`).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cloud_service.admission import AnswerLag, RetryHints, ServiceTimes, StandingQueue, TightBudget
from cloud_service.config import BatchingConfig
from cloud_service.errors import ServerBusy
from runtimes.errors import CloudTimeout

Arrays = Mapping[str, np.ndarray]
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


class NullObserver:
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


class Waiter:
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
class Request:
    inputs: Arrays
    rows: int
    key: tuple[Any, ...]
    deadline: float | None  # time.monotonic()
    enqueued: float  # time.monotonic()
    future: asyncio.Future[dict[str, np.ndarray]] | Waiter
    order: tuple[float, int] = (0.0, 0)  # (deadline, or arrival plus the CoDel interval; arrival number)
    planned: float | None = None  # seconds from `enqueued` to its answer, as admission planned (None: not planned)


class DeadlineQueue:
    """Queued requests in deadline order, and the plan that admits, batches and gives them up.

    Args:
        name: the model's name, for messages.
        config: batching limits, admission, CoDel's target and interval.
        batched: whether requests are concatenated into batches (else each runs alone).
        instances: model instances working through the queue.
        observer: told of refusals, queue times and drops.
    """

    def __init__(self, name: str, config: BatchingConfig, *, batched: bool, instances: int,
                 observer: BatchObserver) -> None:
        self.name = name
        self.config = config
        self.batched = batched
        self.instances = instances
        self.items: list[Request] = []  # sorted by `order`: earliest deadline first
        self.rows = 0
        self.times = ServiceTimes(config.max_batch_size if batched else 1)
        self.standing = StandingQueue(config.queue_target_ms / 1000, config.queue_interval_ms / 1000)
        self.lag = AnswerLag()  # how much later than planned admitted requests reach their callers
        # per instance: (start, planned end) of the batch it runs, None while idle
        self.running_span: list[tuple[float, float] | None] = [None] * instances
        self._observer = observer
        self._hints = RetryHints()
        self._arrivals = itertools.count()
        # A batch holds its instance for its whole run: requests with plenty of time (a journal's drain)
        # must not form one so long that a tight request arriving meanwhile misses its deadline behind it.
        # A loose request joins a batch only while it is planned within a quarter of the tight budget (TightBudget).
        self.budget = TightBudget(floor_s=config.queue_interval_ms / 4000)

    def __len__(self) -> int:
        return len(self.items)

    def request(self, inputs: Arrays, rows: int, key: tuple[Any, ...], due: float | None,
                future: asyncio.Future[dict[str, np.ndarray]] | Waiter) -> Request:
        """A request to queue, stamped with its arrival and its place in the order."""
        now = time.monotonic()
        order = (due if due is not None else now + self.standing.interval_s, next(self._arrivals))
        return Request(inputs, rows, key, due, now, future, order)

    def put(self, request: Request) -> None:
        """Queue `request`, or raise `ServerBusy` when the queue is full or (admission on, the run time
        known) its deadline cannot be met behind the work ahead of it."""
        now = time.monotonic()
        if request.deadline is not None:
            self.budget.observe(now, request.deadline - now)
        if len(self.items) >= self.config.max_queue_size:
            self._observer.on_refused("queue_full")
            why = f"queue full ({self.config.max_queue_size} requests waiting)"
            raise self.busy(why, self.finish_in(now, self.rows, 0))
        if self.config.admission and self.times.known:
            refusal = self.refusal(request.rows, request.deadline, request.order, now, plan=request)
            if refusal is not None:
                self._observer.on_refused("deadline" if request.deadline is not None else "standing")
                raise refusal
        bisect.insort(self.items, request, key=_order)
        self.rows += request.rows

    def clear(self) -> list[Request]:
        """Empty the queue; what it held."""
        held, self.items, self.rows = self.items, [], 0
        return held

    def refusal(self, rows: int, deadline: float | None, order: tuple[float, int], now: float, *,
                waiting_rows: int = 0, plan: Request | None = None) -> ServerBusy | None:
        """The refusal of a request of `rows` rows due at `deadline`, or None when it can be answered in
        time (the lock held); when admitted, `plan` (the request being queued) records what was planned.

        The work ahead of it is every queued request due before it (the queue is served earliest
        deadline first), the `waiting_rows` a front end let through but has not queued yet, plus what
        the busy instances have left, with the measured slack of a run past its plan
        (`ServiceTimes.headroom_s`) and what recent plans missed their answers by (`AnswerLag`);
        requests without a deadline are held to the CoDel interval while the queue is standing.
        """
        live = [queued for queued in self.items if _live(queued, now)]  # not abandoned, not expired
        if not live and not waiting_rows and any(span is None for span in self.running_span):
            if plan is not None:
                plan.planned = self.times.batch_seconds(rows)
            return None  # an idle instance takes it now: run it, and measure (see `_run_now`)
        limit = deadline
        if limit is None:
            if not self.standing.standing:
                return None
            limit = now + self.standing.interval_s
        ahead = waiting_rows
        for queued in live:  # what was left behind (callers gone, deadlines passed) is no work ahead
            if queued.order > order:
                break
            ahead += queued.rows
        done = self.finish_in(now, ahead, rows)
        if plan is not None:
            plan.planned = done
        if deadline is not None:  # what plans have missed by: a run's overshoot, or the answers' measured lag
            done += max(self.times.headroom_s(), self.lag.margin_s)
        if now + done <= limit:
            return None
        left = max(0.0, limit - now) * 1000
        why = (f"the queue ahead and the model's run time need about {done * 1000:.1f} ms, "
               f"the deadline leaves {left:.1f} ms")
        return self.busy(why, now + done - limit)

    def finish_in(self, now: float, ahead_rows: int, rows: int) -> float:
        """Seconds until a request of `rows` rows behind `ahead_rows` queued rows would be answered."""
        # No instance free: the first to finish. A run past its planned end is not about to end: on a
        # loaded host it often takes as long again, so half its plan is still counted.
        spans = [span for span in self.running_span if span is not None]
        wait = 0.0
        if len(spans) == len(self.running_span):
            wait = min(max(end - now, (end - start) / 2) for start, end in spans)
        return wait + self.times.drain_seconds(ahead_rows + rows, self.instances)

    def busy(self, why: str, over_s: float, queued_s: float = 0.0) -> ServerBusy:
        """The refusal (the lock held): why, and a hint of when to retry: no sooner than the queue is
        shorter by the excess, and spread by the refusal pressure (`admission.RetryHints`)."""
        floor = max(over_s, self.times.batch_seconds(1), 0.001)
        hint = self._hints.hint_s(time.monotonic(), floor, self.times.rows_per_s(self.instances))
        msg = f"model {self.name!r} is overloaded: {why}; not queued, retry after the hinted delay or add replicas"
        return ServerBusy(msg, retry_after_ms=min(5000, math.ceil(hint * 1000)), queued_s=queued_s)

    def expired(self, request: Request, now: float) -> Outcome:
        waited = (now - request.enqueued) * 1000
        msg = f"model {self.name!r}: request expired after {waited:.1f} ms in the queue; not computed"
        return CloudTimeout(msg)

    def shed_hopeless(self, now: float) -> list[tuple[Request, Outcome]]:
        """Take out of the queue (its lock held) every request with a deadline that the queue ahead of it
        (earliest deadline first) and the measured run time can no longer answer in time, with its refusal.

        Run whenever a batch ends and the estimate moves, so that a request that became hopeless is
        refused then, not when it reaches the head of the queue: a refusal never waits for compute it
        will not get. A lone queued request is left to run (its measurement corrects the estimate).
        """
        if len(self.items) <= 1:
            return []
        kept: list[Request] = []
        shed: list[tuple[Request, Outcome]] = []
        ahead = 0
        for request in self.items:
            if request.deadline is not None and not request.future.done():
                done = self.finish_in(now, ahead, request.rows)
                if now + done > request.deadline:
                    outcome = self.expired(request, now) if now >= request.deadline else self.busy(
                        f"queued {(now - request.enqueued) * 1000:.1f} ms, the queue ahead and the model's run time "
                        f"need {done * 1000:.1f} ms more, its deadline leaves {(request.deadline - now) * 1000:.1f} ms",
                        now + done - request.deadline, now - request.enqueued)
                    shed.append((request, outcome))
                    continue
            kept.append(request)
            if not request.future.done():
                ahead += request.rows
        if shed:
            self.items[:] = kept
            self.rows = sum(r.rows for r in kept)
            for request, _ in shed:
                self._observer.on_queue_time(now - request.enqueued)
                self.standing.observe(now, now - request.enqueued)
        return shed

    def hopeless(self, request: Request, now: float, admission: bool) -> Outcome | None:
        """Why a queued request is dropped before compute, or None when it can still be answered in time."""
        if request.deadline is not None and now >= request.deadline:
            return self.expired(request, now)
        if not admission:
            return None
        if request.deadline is not None:
            need = self.times.batch_seconds(request.rows)
            if now + need > request.deadline:
                return self.busy(f"queued {(now - request.enqueued) * 1000:.1f} ms, its deadline can no longer "
                                  f"be met by a {need * 1000:.1f} ms run", need - (request.deadline - now),
                                  now - request.enqueued)
        elif self.standing.standing and now - request.enqueued > self.standing.interval_s:
            return self.busy(f"queued {(now - request.enqueued) * 1000:.1f} ms without a deadline while the queue "
                              "is standing", self.standing.interval_s, now - request.enqueued)
        return None

    def ready_rows(self, head: Request) -> int:
        rows = 0
        for request in self.items:
            if request.key == head.key:
                rows += request.rows
                if rows >= self.config.max_batch_size:
                    break
        return rows

    def pop_batch(self) -> tuple[list[Request], list[tuple[Request, Outcome]]]:
        """Take the next batch (the lock held): drop what can no longer be answered in time, then take
        compatible requests in deadline order while the batch still ends before the earliest deadline in it.

        Returns the batch (empty when every request looked at was dropped) and the dropped requests to
        answer, with their outcomes (the caller answers them once the lock is released).
        """
        now = time.monotonic()
        # a lone request runs unless its deadline passed: the measurement corrects a stale estimate
        admission = self.config.admission and len(self.items) > 1
        shed: list[Request] = []
        shed_outcomes: list[Outcome] = []
        batch: list[Request] = []
        rows, limit, size = 0, math.inf, self.config.max_batch_size if self.batched else 1
        head_key: tuple[Any, ...] | None = None
        kept: list[Request] = []
        for request in self.items:
            if batch and (rows >= size or (head_key is not None and request.key != head_key)):
                kept.append(request)
                continue
            if request.future.done():  # a caller that left: nothing to answer
                shed.append(request)
                shed_outcomes.append(CloudTimeout("abandoned"))
                continue
            outcome = self.hopeless(request, now, admission)
            if outcome is not None:
                shed.append(request)
                shed_outcomes.append(outcome)
                continue
            due = limit if request.deadline is None else min(limit, request.deadline)
            planned = self.times.batch_seconds(rows + request.rows)
            own = None if request.deadline is None else request.deadline - now  # a loose one is capped
            fits = rows + request.rows <= size and (
                not admission or not batch or (now + planned <= due and planned <= self.budget.batch_cap_s(now, own)))
            if not fits:
                kept.append(request)
                continue
            batch.append(request)
            rows += request.rows
            limit, head_key = due, request.key
        self.items[:] = kept
        self.rows = sum(r.rows for r in kept)
        for request in (*batch, *shed):
            self._observer.on_queue_time(now - request.enqueued)
            self.standing.observe(now, now - request.enqueued)
        answered = [(r, o) for r, o in zip(shed, shed_outcomes, strict=True) if not r.future.done()]
        if answered:
            self._observer.on_expired(len(answered))
        return batch, answered


def answer(request: Request, outcome: Outcome) -> None:
    """Set a request's outcome once, whichever kind of caller it has (on the loop for futures)."""
    future = request.future
    if isinstance(future, Waiter):
        future.set(outcome)
    elif not future.done():
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _live(request: Request, now: float) -> bool:
    """Whether a queued request will still be computed: its caller waits and its deadline has not passed."""
    return not request.future.done() and (request.deadline is None or request.deadline > now)


def _order(request: Request) -> tuple[float, int]:
    return request.order
