"""A clock a test moves by hand, for code that takes `clock=` (and `sleep=`): a run takes no wall time.

Example:
    >>> clock = ManualClock()
    >>> breaker = CircuitBreaker(BreakerConfig(reset_timeout_s=2.0), clock=clock)
    >>> clock.now += 2.0  # two seconds later
"""

from __future__ import annotations


class ManualClock:
    """`clock()` is `clock.now` (seconds, from `start`); `await clock.sleep(s)` records `s` and moves it on."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
