"""Admission fed back by how late admitted requests reach their callers (`admission.AnswerLag`).

The plan behind admission (queued work ahead times the measured run time) cannot see time spent outside
the model: an event loop busy with other work delivers answers late, as do a hundred gRPC handler threads
contending for the interpreter. Admitted on the plan alone, such requests are computed and reach their
callers after their deadlines. With the feedback, admission keeps back what answers have recently been
late by, and what it admits is answered in time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pytest

from cloud_service.admission import AnswerLag
from cloud_service.batcher import DynamicBatcher
from cloud_service.config import BatchingConfig
from cloud_service.errors import ServerBusy
from runtimes.errors import CloudTimeout
from testkit.overload import HostStall

DEADLINE_S = 0.1
BUSY_S = 0.04  # the event loop is blocked this long at a time (another task's work on the same loop)
PER_ROW_S = 0.004  # the model double's run time per row
CALLERS = 24  # closed loops: each keeps a request queued, about 2.5 deadlines' worth of work in all
SECONDS = 2.0
# A host whose threads wake later than this (p90) is too loaded for the test: measured 0.1 ms on 2 cores at a load
# average of 6, 5-11 ms with two busy loops beside, where a run with 11 ms answered 43 in time and 0.19 late
MAX_STALL_S = 0.008


def _model(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """y = x, taking `PER_ROW_S` a row (it sleeps: the interpreter is free meanwhile, as in onnxruntime)."""
    time.sleep(PER_ROW_S * len(inputs["x"]))
    return {"y": inputs["x"]}


@dataclass
class Tally:
    allowance_s: float = 0.0  # lateness the host's own scheduling explains (see `_run`): counted in time
    in_time: int = 0
    late: int = 0  # answered, but the caller had the answer after its deadline
    shed: int = 0  # admitted, then refused after queueing
    expired: int = 0  # admitted, then dropped at its deadline
    refused: int = 0  # refused at once: not admitted

    @property
    def admitted(self) -> int:
        return self.in_time + self.late + self.shed + self.expired

    @property
    def failed_share(self) -> float:
        """The share of the admitted requests whose callers did not have an answer in time."""
        return (self.late + self.shed + self.expired) / max(1, self.admitted)


async def _crowd(batcher: DynamicBatcher, tally: Tally) -> None:
    loop = asyncio.get_running_loop()
    end = time.monotonic() + SECONDS
    x = {"x": np.zeros((1, 2), np.float32)}

    async def busy() -> None:  # blocks the loop BUSY_S at a time, leaving it free 5 ms in between
        while time.monotonic() < end:
            time.sleep(BUSY_S)
            await asyncio.sleep(0.005)

    async def caller() -> None:
        while time.monotonic() < end:
            deadline = loop.time() + DEADLINE_S
            try:
                future = batcher.submit(x, deadline=deadline)
            except ServerBusy as exc:
                tally.refused += 1
                await asyncio.sleep(min(0.05, exc.retry_after_ms / 1000))
                continue
            try:
                await future
            except ServerBusy:
                tally.shed += 1
                continue
            except CloudTimeout:
                tally.expired += 1
                continue
            if loop.time() <= deadline + tally.allowance_s:
                tally.in_time += 1
            else:
                tally.late += 1

    await asyncio.gather(busy(), *(caller() for _ in range(CALLERS)))


def _run(batcher_config: BatchingConfig) -> Tally:
    """The crowd against a batcher. An answer later than its deadline by no more than the host's scheduling
    delay measured in a quiet moment just before (`HostStall`'s p90, ~0 on a quiet host) counts as in time:
    a stall arriving after admission is no plan's to foresee, and on a host that other runs load it is
    what decided this test's outcome rather than admission."""
    with HostStall() as stall:
        time.sleep(0.3)
    tally = Tally(allowance_s=stall.p(90))

    async def main() -> None:
        async with DynamicBatcher("lagged", [_model], batcher_config, batched=True) as batcher:
            x = {"x": np.zeros((1, 2), np.float32)}
            for _ in range(3):  # the run time is measured before the crowd comes
                await batcher.infer(x, deadline=asyncio.get_running_loop().time() + 1.0)
            await asyncio.wait_for(_crowd(batcher, tally), SECONDS + 10)

    asyncio.run(main())
    return tally


def test_requests_admitted_behind_a_busy_event_loop_are_answered_in_time() -> None:
    """The loop delivers answers up to 40 ms late; a batch of 4 runs 16 ms; 24 callers at 100 ms deadlines.
    Planned on the queue alone, admitted requests reached their callers after their deadline: measured on 2
    cores at a load average of 4-6, 0.11-0.71 of them (0.11-0.16 in the runs beside the ones below). With the
    answers' lag fed back: 0.01 in 3 runs at a load average of 6 (479-482 answered in time in the 2 s), 0.04
    with two busy loops beside as well."""
    tally = _run(BatchingConfig(max_batch_size=4))
    summary = f"{tally}; {tally.failed_share:.2f} of the admitted not answered in time"
    print(summary)
    if tally.allowance_s > MAX_STALL_S:
        pytest.skip(f"this host is too loaded to measure admission's lag: a 5 ms sleeper woke "
                    f"{tally.allowance_s * 1000:.1f} ms late (p90) before the crowd ({summary})")
    assert tally.refused > 0, summary  # the crowd is past what the model and the loop can answer in time
    assert tally.failed_share <= 0.1, summary
    # admission did not just refuse everything: the model answered a good part of what it could (a batch
    # of 4 in 16 ms is 250 rows/s at most; the blocked loop lets the batcher refill it part of the time)
    assert tally.in_time >= 0.2 * 250 * SECONDS, summary


def test_answer_lag_keeps_back_its_quantile_of_recent_lags_and_forgets_old_ones() -> None:
    lag = AnswerLag(window=10, quantile=0.9)
    assert lag.margin_s == 0.0  # nothing observed: the plan alone
    for took in (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.30):
        lag.observe(planned_s=0.01, took_s=took)
    assert lag.margin_s == pytest.approx(0.08)  # the 9th of 10 lags (0.00 ... 0.29)
    lag.observe(planned_s=0.05, took_s=0.01)  # early answers count as no lag, never as negative
    for _ in range(10):  # the window moves on: a drained queue brings the margin down with it
        lag.observe(planned_s=0.02, took_s=0.021)
    assert lag.margin_s == pytest.approx(0.001)
    lag.observe(planned_s=0.0, took_s=60.0)  # a stalled host's minute counts as the cap, not a minute
    assert AnswerLag().max_s >= lag.margin_s
    with pytest.raises(ValueError, match="quantile"):
        AnswerLag(quantile=0.0)
