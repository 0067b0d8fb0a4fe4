"""A circuit breaker for cloud calls: stop calling a cloud that keeps failing, probe it now and then.

Its failure counts are the link's (`link.Link`: failures and refusals in a row, the timeout runs that
are news): the breaker holds only its gate (open, half-open, when to let a probe through). Given the
agent's link, the agent feeds the link and the breaker reads it; without one, it keeps a private link
that `record_success`/`record_failure` feed.

```
closed --N consecutive failures--> open --reset_timeout_s--> half_open --probe ok--> closed
                                     ^                           |
                                     '--------probe failed-------'
```

Pure state, no I/O and no asyncio: the caller asks `allow()` before a call and reports the outcome with
`record_success()` / `record_failure()`. The clock is injectable so tests need no sleeps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from edge_agent.link import Link
from runtimes.errors import ConfigError

logger = logging.getLogger(__name__)

State = Literal["closed", "open", "half_open"]
TIMEOUT_FLOOR = 20  # timeouts in a row that are news even after a link that answered every call in time


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """When a `CircuitBreaker` opens and how it recovers.

    Args:
        failure_threshold: consecutive failures that open the breaker.
        reset_timeout_s: how long it stays open before letting a probe through. A failed probe
            opens it again for as long, so a link that comes back is found within about this long
            (plus the wait for the next request that escalates): a quarter of a second by default, so
            that a returned link is used again within a second even when the first probe meets a
            connection still being set up.
        half_open_max_calls: probes allowed at once while half-open.
        timeout_threshold, timeout_odds: when the failures in a row include deadline timeouts
            (`record_failure(timeout=True)`), it opens once such a run is news (`link.TimeoutRuns`):
            less likely than `timeout_odds` by chance given the share of timeouts among the recent
            calls, and at most `timeout_threshold` in a row. A call abandoned at its deadline says the
            link was slower than what was left of the budget, not that the cloud is gone: on a
            jittered link where 75 % miss a tight deadline, it takes 33 in a row (a fixed 20 come by
            chance every few hundred calls there); after a link that answered nearly every call, or
            one that just changed (the share lags), 20 do; never fewer than `failure_threshold`,
            nor more than `timeout_threshold`.

    Example:
        >>> BreakerConfig(failure_threshold=3, reset_timeout_s=5.0)
    """

    failure_threshold: int = 5
    reset_timeout_s: float = 0.25
    half_open_max_calls: int = 1
    timeout_threshold: int = 64
    timeout_odds: float = 1e-4

    def __post_init__(self) -> None:
        if not (isinstance(self.failure_threshold, int) and self.failure_threshold >= 1):
            msg = f"BreakerConfig.failure_threshold must be an integer >= 1, got {self.failure_threshold!r}"
            raise ConfigError(msg)
        if not (math.isfinite(self.reset_timeout_s) and self.reset_timeout_s > 0):
            msg = f"BreakerConfig.reset_timeout_s must be a positive number, got {self.reset_timeout_s!r}"
            raise ConfigError(msg)
        if not (isinstance(self.half_open_max_calls, int) and self.half_open_max_calls >= 1):
            msg = f"BreakerConfig.half_open_max_calls must be an integer >= 1, got {self.half_open_max_calls!r}"
            raise ConfigError(msg)
        if not (isinstance(self.timeout_threshold, int) and self.timeout_threshold >= 1):
            msg = f"BreakerConfig.timeout_threshold must be an integer >= 1, got {self.timeout_threshold!r}"
            raise ConfigError(msg)
        if not (0 < self.timeout_odds < 1):
            msg = f"BreakerConfig.timeout_odds must be in (0, 1), got {self.timeout_odds!r}"
            raise ConfigError(msg)


class CircuitBreaker:
    """Tracks consecutive cloud failures and decides whether the next call may go out.

    Not thread-safe: use it from one thread (the agent's event loop).

    Args:
        config: thresholds; defaults to `BreakerConfig()`.
        clock: monotonic seconds; inject a fake one in tests.

    Example:
        >>> breaker = CircuitBreaker(BreakerConfig(failure_threshold=3))
        >>> if breaker.allow():
        ...     try:
        ...         reply = await transport.escalate(request, timeout_s=0.2)
        ...     except EscalationError:
        ...         breaker.record_failure()
        ...     else:
        ...         breaker.record_success()
    """

    def __init__(self, config: BreakerConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic, link: Link | None = None) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._state: State = "closed"
        cfg = self.config
        self._owns_link = link is None
        self.link = link or Link(down_after=max(cfg.failure_threshold, 1), up_after=1,
                                 down_after_timeouts=max(cfg.timeout_threshold, cfg.failure_threshold), clock=clock)
        if self._owns_link:
            self.link.timeouts.odds = cfg.timeout_odds
        self._opened_at = 0.0
        self._probes = 0
        self._probe_started = 0.0
        self.times_opened = 0

    @property
    def state(self) -> State:
        """"closed", "open" or "half_open" (an open breaker past its timeout reads "half_open")."""
        if self._state == "open" and self._clock() - self._opened_at >= self.config.reset_timeout_s:
            self._enter_half_open()
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self.link.failures

    def retry_after_s(self) -> float:
        """Seconds until an open breaker lets a probe through; 0 when not open."""
        if self.state != "open":
            return 0.0
        return max(0.0, self._opened_at + self.config.reset_timeout_s - self._clock())

    def allow(self) -> bool:
        """True when a call may go out now. In half-open state, each True is a probe slot taken."""
        state = self.state
        if state == "closed":
            return True
        if state == "open":
            return False
        # A probe whose outcome never came back (its caller was cancelled) must not wedge the breaker
        # half-open forever: after another reset timeout, its slot is given again.
        if self._clock() - self._probe_started >= self.config.reset_timeout_s:
            self._probes = 0
        if self._probes < self.config.half_open_max_calls:
            if self._probes == 0:
                self._probe_started = self._clock()
            self._probes += 1
            return True
        return False

    def record_success(self) -> None:
        """The call succeeded (the agent told its link first): a successful probe closes the breaker."""
        state = self.state
        if state == "half_open":
            logger.info("circuit breaker closed: a probe to the cloud succeeded")
            self._state = "closed"
            self._probes = 0
        if self._owns_link and state != "open":
            self.link.observe_answer(0.0)
        # A late success of a call sent before the breaker opened leaves it open: the calls after it failed.

    def record_failure(self, *, timeout: bool = False) -> None:
        """The call failed: count it; a failed probe opens the breaker, and so do `failure_threshold`
        failures in a row, or `timeout_threshold` when `timeout` (the call's deadline passed) was among them."""
        state = self.state
        if state == "half_open":
            self._open("a probe to the cloud failed")
        elif state == "closed":
            link = self.link
            if self._owns_link:
                (link.observe_timeout if timeout else link.observe_refusal)()
            cap = max(self.config.timeout_threshold, self.config.failure_threshold)
            runs = max(min(max(TIMEOUT_FLOOR, self.config.failure_threshold), cap), min(cap, link.timeouts.threshold()))
            if (link.refusals >= self.config.failure_threshold
                    or (link.refusals < link.failures and link.failures >= runs)):
                self._open(f"{link.failures} consecutive cloud failures")
        # A late failure while open does not extend the timeout.

    def _open(self, why: str) -> None:
        self._state = "open"
        self._opened_at = self._clock()
        self._probes = 0
        self.times_opened += 1
        logger.warning("circuit breaker open for %.1f s: %s", self.config.reset_timeout_s, why)

    def _enter_half_open(self) -> None:
        self._state = "half_open"
        self._probes = 0
        self._probe_started = self._clock()
