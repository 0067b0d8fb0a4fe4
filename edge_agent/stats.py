"""Per-request observations: counters, recent latencies and round trips, and the controller's feed."""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class RttEstimator:
    """Recent escalation round trips: a quantile of them predicts whether the next one fits.

    Only the samples of the last `max_age_s` seconds count (at most `window` of them), so a slow
    phase is forgotten once it is over, however few escalations are sent meanwhile. An answer that
    came in time although the estimate said it would not (a probe sent while escalations were being
    skipped) drops the older samples at once: the link is fast again and the slow tail is stale.

    Args:
        quantile: the quantile `predicted_ms` returns by default.
        window: the most samples kept.
        max_age_s: samples older than this many seconds are forgotten.
        clock: monotonic seconds (injectable for tests).

    Example:
        >>> rtt = RttEstimator(0.9)
        >>> rtt.add(4.2)
        >>> rtt.predicted_ms() <= left_ms
    """

    def __init__(self, quantile: float, window: int = 64, *, max_age_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.quantile = quantile
        self.max_age_s = max_age_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.last_attempt = -math.inf

    def add(self, rtt_ms: float, *, probe: bool = False) -> None:
        """One round trip, or for a timeout how long the edge waited (a lower bound).

        Args:
            rtt_ms: milliseconds.
            probe: an answer that came in time although the estimate said it would not: the older
                samples no longer describe the link and are dropped.
        """
        if probe:
            self._samples.clear()
        self._samples.append((self.clock(), float(rtt_ms)))

    def predicted_ms(self, quantile: float | None = None) -> float:
        """The `quantile` (default: the estimator's) of the recent round trips; 0.0 when none is recent."""
        samples = self._samples
        horizon = self.clock() - self.max_age_s
        while samples and samples[0][0] < horizon:
            samples.popleft()
        if not samples:
            return 0.0
        s = sorted(ms for _, ms in samples)
        q = self.quantile if quantile is None else quantile
        return s[min(len(s) - 1, int(q * len(s)))]

    def __len__(self) -> int:
        return len(self._samples)


class TimerLateness:
    """How late an abandoned escalation comes back, learned from each one: the agent's deadline margin.

    The agent abandons an escalation with its own timer, whatever the transport's deadline does
    (gRPC's fires 2-3 ms late on a loaded host). Between the moment the timer is due and the moment
    the degraded answer is ready, time still passes: the event loop wakes late (epoll rounds its
    timeout up to a millisecond, other tasks run first) and the local answer is built. Each
    abandonment reports that lateness; the timer of the next escalation is set that much earlier
    (a high quantile of the recent ones), so the answer still comes within the budget.

    Samples older than `max_age_s` are forgotten, and the agent caps the margin at a quarter of the
    latency budget: a margin learned in a burst of load must not stay so large that escalations are
    skipped for want of time, which would teach nothing new.

    Args:
        prior_ms: the lateness assumed until `min_samples` were observed (a floor before that).
        quantile: the quantile of the recent samples `margin_ms` returns.
        window: the most samples kept.
        min_samples: samples before the prior stops being a floor.
        max_age_s: samples older than this many seconds are forgotten.
        clock: monotonic seconds (injectable for tests).

    Example:
        >>> late = TimerLateness()
        >>> late.add(2.4)
        >>> deadline_ms = left_ms - late.margin_ms()
    """

    def __init__(self, prior_ms: float = 1.0, *, quantile: float = 0.95, window: int = 64, min_samples: int = 8,
                 max_age_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.prior_ms, self.quantile, self.min_samples = float(prior_ms), quantile, min_samples
        self.max_age_s, self.clock = max_age_s, clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._margin, self._until = self.prior_ms, math.inf

    def add(self, late_ms: float) -> None:
        """How many milliseconds after its due time an abandoned escalation's answer was ready."""
        value = max(0.0, float(late_ms)) if math.isfinite(late_ms) else self.prior_ms
        self._samples.append((self.clock(), value))
        self._refit()

    def _refit(self) -> None:
        samples = self._samples
        now = self.clock()
        while samples and samples[0][0] < now - self.max_age_s:
            samples.popleft()
        if not samples:
            self._margin, self._until = self.prior_ms, math.inf
            return
        s = sorted(v for _, v in samples)
        q = s[min(len(s) - 1, int(self.quantile * len(s)))]
        self._margin = q if len(s) >= self.min_samples else max(q, self.prior_ms)
        self._until = samples[0][0] + self.max_age_s

    def margin_ms(self) -> float:
        """Milliseconds to end the agent's timer before the budget does."""
        if self.clock() >= self._until:
            self._refit()
        return self._margin

    def __len__(self) -> int:
        return len(self._samples)


class TimeoutRuns:
    """Whether the deadline timeouts in a row so far are news (a partition), not a slow link's bad luck.

    Where a share p of the recent calls missed their deadline, n more in a row come by chance with
    probability about p**n: a run is news once that is below `odds`, after ceil(log(odds) / log(p))
    timeouts, at least `floor` and at most `cap`. A link that nearly always answers in time is judged
    gone after `floor` (load bursts make several in a row late, and a link that just changed is
    judged by a share that lags); a jittered link where 75 % miss a tight deadline, after 33 (with
    `odds` 1e-4), where a fixed count of 20 comes by chance every few hundred calls and stops a
    link that still answers a quarter of them.

    Args:
        floor, cap: the fewest and the most timeouts in a row that are news.
        odds: how unlikely by chance a run must be.
        window: the recent calls (answered or timed out) whose share of timeouts is the base rate;
            the run being judged is left out of it.
        min_calls: calls before the run needed to trust that share; `prior_share` until then.

    Example:
        >>> runs = TimeoutRuns(floor=20, cap=64)
        >>> runs.record(timeout=True)
        >>> partitioned = runs.news()
    """

    def __init__(self, floor: int, cap: int, *, odds: float = 1e-4, window: int = 200, min_calls: int = 20,
                 prior_share: float = 0.5) -> None:
        self.floor, self.cap = min(floor, cap), cap
        self.odds, self.min_calls, self.prior_share = odds, min_calls, prior_share
        self._calls: deque[bool] = deque(maxlen=window)
        self._timeouts = 0
        self.run = 0

    def record(self, *, timeout: bool) -> None:
        """One call answered (False) or abandoned at its deadline (True)."""
        if len(self._calls) == self._calls.maxlen:
            self._timeouts -= self._calls[0]
        self._calls.append(timeout)
        self._timeouts += timeout
        self.run = self.run + 1 if timeout else 0

    def threshold(self) -> int:
        """The timeouts in a row that are news on this link now."""
        before = len(self._calls) - self.run
        # the share before the run, with Laplace's rule: never 0 nor 1
        share = (self._timeouts - self.run + 1) / (before + 2) if before >= self.min_calls else self.prior_share
        n = math.ceil(math.log(self.odds) / math.log(share))
        return max(self.floor, min(self.cap, n))

    def news(self) -> bool:
        """Whether the current run of timeouts is too long to be the link's usual misses."""
        return self.run >= self.threshold()


# An observation, one per request, in this order (a plain tuple: the hot path appends it):
# variant, edge_ms, edge_mj, energy_mj, energy_label, rows, wanted_rows, tier, degraded, reason, rtt_ms,
# bytes_sent, agreed, total_ms, cached, score
# `rtt_ms` is None exactly when nothing was sent (no escalation wanted, or it was skipped: breaker open,
# rate cap, no time left, round trip too slow); otherwise the round trip, or how long a failure took.


def feed_controller(ctl: Any, rec: tuple[Any, ...]) -> None:
    """Report one observation to the controller: the inference, the escalation if one was wanted, the request."""
    (variant, edge_ms, edge_mj, energy_mj, label, _n, wanted, tier, degraded, reason, rtt_ms, nbytes, agreed,
     total_ms, cached, score) = rec
    if cached:
        return
    try:
        ctl.observe_inference(variant, edge_ms, edge_mj, energy_label=label)
        if wanted and (rtt_ms is not None or degraded):
            ok = tier == "cloud"
            ctl.observe_escalation(rtt_ms if ok else None, ok, nbytes, elapsed_ms=rtt_ms,
                                   attempted=rtt_ms is not None, timeout=reason == "timeout")
        ctl.observe_request(bool(wanted), agreed, total_ms, score=score, variant=variant, energy_mj=energy_mj)
    except Exception:
        logger.exception("the controller rejected an observation; it is dropped")


def top1_agreed(edge: np.ndarray, cloud: np.ndarray) -> bool | None:
    """Whether the cloud's top-1 equals the edge's on every row of an answered escalation; None where the
    output is not a classification (no class axis of at least two scores: a scalar or one value per row)."""
    if edge.ndim == 0 or edge.shape[-1] < 2 or edge.shape != cloud.shape:
        return None
    return bool((edge.argmax(axis=-1) == cloud.argmax(axis=-1)).all())


@dataclass
class Stats:
    """Counters since the agent started, and a window of recent latencies."""

    requests: int = 0
    rows: int = 0
    escalations_wanted: int = 0
    escalations_sent: int = 0
    cloud_answers: int = 0
    degraded: int = 0
    cache_hits: int = 0
    journaled: int = 0
    late_replies: int = 0
    # answered escalations whose outputs could be compared (classification), and those where the cloud's
    # top-1 equalled the edge's: the agreement on escalated inputs
    escalations_compared: int = 0
    escalations_agreed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    energy_mj: float = 0.0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=2048))

    def add(self, rec: tuple[Any, ...]) -> None:
        (_v, _edge_ms, _edge_mj, energy, _label, n, wanted, tier, degraded, reason, rtt_ms, _nb, agreed, total_ms,
         cached, _score) = rec
        self.requests += 1
        self.rows += n
        self.escalations_wanted += wanted > 0
        self.escalations_sent += rtt_ms is not None
        self.cloud_answers += tier == "cloud"
        self.degraded += degraded
        self.cache_hits += cached
        self.energy_mj += energy
        if agreed is not None and not cached:
            self.escalations_compared += 1
            self.escalations_agreed += bool(agreed)
        if reason:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.latencies.append(total_ms)

    def recent_latencies(self, n: int) -> np.ndarray:
        """The last `n` request latencies (ms), newest first; at most the 2048 kept."""
        k = max(0, min(n, len(self.latencies)))
        return np.fromiter(itertools.islice(reversed(self.latencies), k), dtype=np.float64, count=k)

    def snapshot(self) -> dict[str, Any]:
        lat = np.fromiter(self.latencies, dtype=np.float64)
        q = np.percentile(lat, [50, 95, 99]).tolist() if len(lat) else [0.0, 0.0, 0.0]
        return {"requests": self.requests, "rows": self.rows, "escalations_wanted": self.escalations_wanted,
                "escalations_sent": self.escalations_sent, "cloud_answers": self.cloud_answers,
                "degraded": self.degraded, "cache_hits": self.cache_hits, "journaled": self.journaled,
                "late_replies": self.late_replies, "reasons": dict(self.reasons),
                "escalations_compared": self.escalations_compared, "escalations_agreed": self.escalations_agreed,
                "agreement": (self.escalations_agreed / self.escalations_compared
                              if self.escalations_compared else None),
                "energy_mj_per_request": self.energy_mj / self.requests if self.requests else 0.0,
                "p50_ms": q[0], "p95_ms": q[1], "p99_ms": q[2]}
