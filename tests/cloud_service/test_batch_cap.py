"""How long a batch may hold its instance: tight requests join it up to its earliest deadline, loose ones (a
journal's drain) only while it is planned within a quarter of the tight budget (`admission.TightBudget`)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import numpy as np

from cloud_service.admission import TightBudget
from cloud_service.config import BatchingConfig
from cloud_service.deadline_queue import DeadlineQueue, NullObserver, Waiter

PER_ROW_S = 0.005  # the measured run time: 5 ms a row, a batch costs rows times one row


def _queue() -> DeadlineQueue:
    """A batching queue (32 rows at most, CoDel interval 100 ms: the old fixed cap was 25 ms, five rows)
    whose model has been measured at 5 ms a row."""
    queue = DeadlineQueue("m", BatchingConfig(max_batch_size=32, queue_interval_ms=100), batched=True,
                          instances=1, observer=NullObserver())
    queue.times.observe(rows=1, seconds=PER_ROW_S)
    return queue


def _put(queue: DeadlineQueue, count: int, budget_s: float) -> None:
    now = time.monotonic()
    for i in range(count):
        queue.put(queue.request({"x": np.full((1, 2), i, np.float32)}, 1, ((2,), "float32"), now + budget_s, Waiter()))


def test_tight_requests_queued_under_load_run_in_a_batch_as_large_as_their_deadlines_allow() -> None:
    """Sixteen requests due in 200 ms: one batch of all sixteen (80 ms planned) ends before the earliest
    deadline. A fixed cap of a quarter of CoDel's interval cut it to five rows (25 ms), and under overload,
    where run times measured on a contended host grow, to one or two: the cost of every row rose exactly
    when capacity mattered most (bench/RESULTS.md)."""
    queue = _queue()
    _put(queue, 16, 0.2)
    batch, dropped = queue.pop_batch()
    assert not dropped
    assert len(batch) == 16


def test_a_batch_still_ends_before_its_earliest_deadline() -> None:
    """Uncapped is not unbounded: sixteen requests left in the queue (admission would have refused some) with
    60 ms to their deadline run as many rows as fit in it."""
    queue = _queue()
    now = time.monotonic()
    for i in range(16):
        queue.budget.observe(now, 0.06)
        queue.items.append(queue.request({"x": np.full((1, 2), i, np.float32)}, 1, ((2,), "float32"), now + 0.06,
                                         Waiter()))
    batch, _ = queue.pop_batch()
    assert 6 <= len(batch) < 12  # 60 ms at 5 ms a row, less what passed since (more than five: no old cap)
    assert len(batch) * PER_ROW_S <= 0.06


def test_loose_requests_behind_tight_traffic_are_capped_at_a_quarter_of_the_tight_budget() -> None:
    """Tight requests (400 ms) arrived a moment ago; now only loose ones (5 s, a journal's drain) wait. Their
    batch may hold the instance for a quarter of the tight budget (100 ms: twenty rows), so a tight request
    arriving meanwhile keeps the rest for its own run."""
    queue = _queue()
    _put(queue, 10, 0.4)
    tight, _ = queue.pop_batch()
    assert len(tight) == 10
    _put(queue, 30, 5.0)
    batch, _ = queue.pop_batch()
    assert len(batch) * PER_ROW_S <= 0.1 + 1e-9
    assert len(batch) >= 18  # about 100 ms of rows, not the floor's five


def test_loose_requests_behind_a_tight_one_join_its_batch_only_up_to_the_loose_cap() -> None:
    """Two tight requests (400 ms) lead; thirty loose ones (5 s) wait behind them. The tight head's deadline
    alone would let the batch take all 32 rows it may (160 ms); loose requests join only while it stays
    within a quarter of the tight budget, so a tight request arriving meanwhile is not kept waiting for a
    drain."""
    queue = _queue()
    _put(queue, 2, 0.4)
    _put(queue, 30, 5.0)
    batch, _ = queue.pop_batch()
    assert batch[0].deadline is not None
    assert batch[0].deadline - batch[0].enqueued < 1  # the tight ones first (earliest deadline first)
    assert len(batch) * PER_ROW_S <= 0.1 + 1e-9
    assert len(batch) >= 18


def test_without_tight_traffic_a_batch_of_requests_without_deadlines_keeps_the_floor() -> None:
    """Nothing with a deadline arrived: requests without one are capped at a quarter of CoDel's interval."""
    queue = _queue()
    for i in range(16):
        queue.put(queue.request({"x": np.full((1, 2), i, np.float32)}, 1, ((2,), "float32"), None, Waiter()))
    batch, _ = queue.pop_batch()
    assert len(batch) == 5  # 25 ms at 5 ms a row


def test_the_tight_budget_is_a_low_quantile_of_recent_arrivals_not_their_minimum() -> None:
    """Under load a few requests reach the queue with almost nothing left (they waited in front of it): they
    must not make every batch loose. The window forgets: after it, no deadline, the floor again."""
    budget = TightBudget(floor_s=0.01)
    for i in range(200):
        budget.observe(now=100.0, budget_s=0.001 if i < 4 else 0.1)  # 2 % nearly spent
    tight = budget.tight_s(100.0)
    assert tight is not None
    assert math.isclose(tight, 0.1)
    assert budget.batch_cap_s(100.0, left_s=0.09) == math.inf
    assert math.isclose(budget.batch_cap_s(100.0, left_s=3.0), 0.025)
    for _ in range(600):  # the arrivals turn looser: the quantile follows within its refresh period
        budget.observe(now=100.01, budget_s=0.3)
    assert budget.tight_s(100.01) == 0.1  # read on every batch and answer, not sorted again for each
    assert budget.tight_s(100.1) == 0.3
    assert budget.tight_s(110.0) is None
    assert budget.batch_cap_s(110.0, left_s=0.09) == 0.01


def test_loose_requests_overtaken_by_tight_ones_do_not_teach_admission_a_lag() -> None:
    """Admission keeps back what recent answers missed their plans by (`AnswerLag`). A journal's drain is
    overtaken by every live request that arrives after it (earliest deadline first), so it is answered
    later than planned with nothing wrong in the plan: learnt from, that lag (up to a second) refused the
    live requests themselves (measured beside a fleet's drain). Only tight requests are fed back."""
    import asyncio

    from cloud_service.batcher import DynamicBatcher

    batches: list[float] = []

    def model(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """y = x, 20 ms a row; records each run's first value."""
        time.sleep(0.02 * len(inputs["x"]))
        batches.append(float(inputs["x"][0, 0]))
        return {"y": inputs["x"]}

    def one(value: float) -> dict[str, np.ndarray]:
        return {"x": np.full((1, 2), value, np.float32)}

    async def main() -> float:
        async with DynamicBatcher("m", [model], BatchingConfig(max_batch_size=1), batched=False) as b:
            loop = asyncio.get_running_loop()
            for _ in range(3):  # measured, and tight traffic seen
                await b.infer(one(0), deadline=loop.time() + 0.5)
            loose = [b.submit(one(1), deadline=loop.time() + 5.0) for _ in range(10)]
            tight = [b.submit(one(2), deadline=loop.time() + 0.5) for _ in range(10)]  # go ahead of the loose
            await asyncio.gather(*tight, *loose)
            return b._queue.lag.margin_s

    margin = asyncio.run(main())
    order = batches[3:]
    assert order.index(2.0) < len(order) - 10  # the tight ones overtook queued loose ones
    assert margin < 0.1, margin  # the loose ones waited about 200 ms past their plans
