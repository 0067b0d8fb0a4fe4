"""The cloud said it is busy: hold escalations back for its hint, and pace the journal's drain.

A cloud at capacity refuses at once with RESOURCE_EXHAUSTED (or UNAVAILABLE) and a retry hint (gRPC's
`retry-after-ms` trailer, MQTT's `tierkit.retry_after_ms` user property); the transports put the hint
on the error as `retry_after_s`. Such a refusal means "busy", not "gone":

- `Pushback` remembers until when the cloud asked not to be called; meanwhile the agent answers locally
  (degraded, reason `cloud_busy`) without sending. The refusal still counts for the breaker as a
  refusal (not a timeout), so a cloud that keeps refusing opens it.
- `DrainPace` is a token bucket for the journal's drain after an outage, with additive increase and
  multiplicative decrease (TCP's rule): each refusal halves the rate, each answer adds a little back.
  A fleet that reconnects at once thus converges on what the cloud can answer instead of flooding it;
  the cloud's admission refuses the excess cheaply meanwhile.

Example:
    >>> pushback = Pushback()
    >>> pushback.note(error)          # True for a refusal with a hint; escalations wait for it
    >>> pace = DrainPace(rate_per_s=20.0)
    >>> await pace.take()             # before each journaled send
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

BUSY_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})
MAX_HINT_S = 5.0  # a hint longer than this is capped: the agent probes again by then


def retry_hint_s(error: BaseException) -> float | None:
    """The retry hint of a busy refusal (seconds), or None when `error` is not one."""
    hint = getattr(error, "retry_after_s", None)
    if not isinstance(hint, int | float) or getattr(error, "code", None) not in BUSY_CODES:
        return None
    return min(MAX_HINT_S, max(0.0, float(hint)))


class Pushback:
    """Until when the cloud asked not to be called. Not thread-safe: the agent's event loop uses it.

    Args:
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until = 0.0
        self.refusals = 0

    def note(self, error: BaseException) -> bool:
        """Record a refusal's hint; True when `error` was a busy refusal."""
        hint = retry_hint_s(error)
        if hint is None:
            return False
        self.refusals += 1
        self._until = max(self._until, self._clock() + hint)
        return True

    def remaining_s(self) -> float:
        return max(0.0, self._until - self._clock())

    def active(self) -> bool:
        return self._clock() < self._until


class DrainPace:
    """A token bucket whose rate adapts to refusals (halved) and answers (raised by `step_per_s`).

    Args:
        rate_per_s: starting and highest rate.
        min_rate_per_s: the rate never falls below this.
        step_per_s: added to the rate per answered send.
        clock, sleep: injectable for tests.
    """

    def __init__(self, rate_per_s: float, *, min_rate_per_s: float = 0.5, step_per_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], asyncio.Future[None] | object] = asyncio.sleep) -> None:
        self.max_rate = float(rate_per_s)
        self.min_rate = min(float(min_rate_per_s), self.max_rate)
        self.step = float(step_per_s)
        self.rate = self.max_rate
        self._clock, self._sleep = clock, sleep
        self._tokens = 1.0
        self._last = clock()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(max(1.0, self.rate), self._tokens + (now - self._last) * self.rate)
        self._last = now

    async def take(self) -> None:
        """Wait for a token."""
        async with self._lock:  # concurrent senders (the drain's window) queue for tokens one at a time
            self._refill()
            if self._tokens < 1.0:
                await self._sleep((1.0 - self._tokens) / self.rate)  # type: ignore[misc]
                self._refill()
                self._tokens = max(self._tokens, 1.0)  # it slept for exactly this token (rounding aside)
            self._tokens -= 1.0

    def on_busy(self) -> None:
        self.rate = max(self.min_rate, self.rate / 2)
        self._tokens = min(self._tokens, 0.0)

    def on_answer(self) -> None:
        self.rate = min(self.max_rate, self.rate + self.step)
