"""The agent timer's margin is the lateness quantile the budget needs, given how many requests wait on a timer.

A request goes over the budget only where its escalation's timer fired and the answer came later than the
margin. The budget (p95) lets 5 % of all requests be over; the margin keeps the expected share over at
`safety` x that, so it reads a lower quantile of lateness where fewer requests time out."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.link import Link, TimerLateness
from runtimes.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stream(late: TimerLateness, clock: Clock, rng: np.random.Generator, timeout_share: float, seconds: float,
            rate: float = 100.0) -> tuple[int, int]:
    """Requests at `rate` a second; a share of them time out with a lateness drawn from a lognormal (median
    1 ms, a long tail, as a loaded host's timers). The margin in force when each timer fires decides
    whether that request is over. Returns (requests, requests over the budget)."""
    n = over = 0
    for _ in range(int(seconds * rate)):
        clock.now += 1.0 / rate
        n += 1
        late.served()
        if rng.random() < timeout_share:
            ms = float(rng.lognormal(0.0, 0.6))
            over += ms > late.margin_ms()
            late.add(ms)
    return n, over


@pytest.mark.parametrize("share", [0.05, 0.25, 0.6, 1.0])
def test_the_share_over_the_budget_stays_at_safety_times_what_the_budget_allows(share: float) -> None:
    clock, rng = Clock(), np.random.default_rng(7)
    late = TimerLateness(1.0, clock=clock)
    _stream(late, clock, rng, share, 5.0)  # warm up
    n, over = _stream(late, clock, rng, share, 60.0)
    assert late.at_risk() == pytest.approx(share, abs=0.05 + 0.1 * share)
    expected = late.safety * (1 - late.quantile)  # 2.5 % of requests, whatever the share that times out
    if share * (1 - late.floor_quantile) > expected:  # the floor does not bind
        assert over / n == pytest.approx(expected, abs=0.008)
    else:
        assert over / n <= expected + 0.008


def test_fewer_timeouts_read_a_lower_quantile_so_the_margin_shrinks() -> None:
    """One escalation in four timing out (a jittered link under a tight budget) reads the 90th percentile;
    every request timing out, the 97.5th: the same latenesses give a smaller margin to the first."""
    margins = {}
    for share in (0.25, 1.0):
        clock, rng = Clock(), np.random.default_rng(3)
        late = TimerLateness(1.0, clock=clock)
        _stream(late, clock, rng, share, 10.0)
        margins[share] = late.margin_ms()
        assert late.level() == pytest.approx(1 - 0.025 / share, abs=0.02)
    assert margins[0.25] < 0.85 * margins[1.0]


def test_the_share_is_unknown_until_enough_requests_were_counted_and_forgets_with_age() -> None:
    clock = Clock()
    late = TimerLateness(1.0, clock=clock)
    late.add(2.0)
    assert late.at_risk() == 1.0  # no requests counted: all at risk
    assert late.level() == pytest.approx(0.975)
    for _ in range(400):
        clock.now += 0.01
        late.served()
    assert late.at_risk() == pytest.approx(1 / 400, rel=0.5)
    assert late.level() == late.floor_quantile  # almost nothing at risk: the floor
    clock.now += 60.0  # a minute of nothing: the counts have decayed away
    assert late.at_risk() == 1.0


def test_the_link_counts_what_it_serves_and_the_margin_follows() -> None:
    clock = Clock()
    link = Link(rtt_ms=2.0, timer_lateness_ms=0.5, clock=clock)
    for i in range(400):
        clock.now += 0.01
        link.observe_served()
        if i % 10 == 0:
            link.observe_lateness(0.1 * (i // 10 % 40))  # 0.0 .. 3.9 ms, evenly
    assert link.lateness.at_risk() == pytest.approx(0.1, abs=0.02)
    assert 2.7 <= link.margin_ms() <= 3.3  # the 75th-80th percentile, not the 95th (3.7)
    assert link.view().lateness_ms == link.margin_ms()


def test_a_margin_rule_that_cannot_hold_the_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="floor_quantile"):
        TimerLateness(1.0, floor_quantile=0.99)
    with pytest.raises(ConfigError, match="safety"):
        TimerLateness(1.0, safety=0.0)


def test_the_margin_follows_the_share_between_timers() -> None:
    """Timers that fired while every request waited on one set a high margin; once most requests are answered
    without a timer, the next escalation's deadline reads the lower quantile, before any timer fires again."""
    clock = Clock()
    late = TimerLateness(1.0, clock=clock)
    for i in range(100):
        clock.now += 0.01
        late.served()
        late.add(0.05 * i)  # 0 .. 4.95 ms, every request timed out
    high = late.margin_ms()
    for _ in range(600):
        clock.now += 0.01
        late.served()  # answered in time or kept local: no timer fired; the latenesses are 6 s old, still in
    assert late.at_risk() == pytest.approx(0.11, abs=0.01)
    assert late.level() < 0.8
    assert late.margin_ms() < 0.85 * high
