"""The device's one view of the link to the cloud: round trips, timer lateness, bandwidth, up or down.

Every escalation's outcome reaches one `Link`: an answer (its round trip), a timeout (how long the
edge waited), a refusal (the cloud said no, or was not there; a "busy" refusal with its retry hint),
and what the transports time on the wire (bytes and seconds: the bandwidth). Everything that decides
from the link reads this one object:

- the agent's skip rule (a round trip that cannot fit what is left of the budget) and its probes;
- the circuit breaker (its failure runs are the link's, `breaker.CircuitBreaker(link=...)`);
- the wire encoder (bandwidth and base round trip, `encoding.WireEncoder(meter=link)`);
- the controller (`profiles.LinkProfile` is a view over a `Link` plus the cloud's accuracy fit).

Estimates age: round trips older than `horizon_s` no longer count, and with fewer than a few recent
ones the prior fills in (an optimistic round trip, which brings escalations, which measure the link
again). A slow spell is forgotten once it is over even if nothing is sent meanwhile.

Up/down has hysteresis: `down_after` refusals in a row (or a run of timeouts that is news for this
link, `TimeoutRuns`, 1e-4 by chance, and has lasted `down_after_s`, 0.5 s) mark it down; `up_after`
answers since then with no refusal between them mark it up, and the round trips then kept are what came
since the first of those answers, the timeouts between them included (a link that answers now and then is
read at its share, not at that of its answers). Slow and fast: a run of timeouts less
likely than 1 % by chance on this link is "slower" (the run joins the window, it does not replace it); the
first answer in time after it is "faster" (where the run was news, 1e-4 by chance, a stall, its timeouts are
dropped: they describe the link no more; a shorter run stays, as what the link does; the round trips before
the run stay either way), and so is a probe's answer, and a move of the answered round trips' level by half
or more. Each such change bumps `epoch`, which the
controller watches to re-decide at once.

Thread safety: the agent's event loop feeds it; the controller reads it from the thread that folds
observations. Every method takes the link's lock; `view()` returns an immutable snapshot.

Example:
    >>> link = Link(rtt_ms=5.0)
    >>> link.observe_answer(4.2, nbytes=3200)
    >>> link.observe_timeout(9.0)
    >>> view = link.view()
    >>> view.up, view.rtt_ms, view.epoch
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from runtimes.errors import ConfigError

__all__ = ["Bandwidth", "Link", "LinkEstimate", "LinkView", "RoundTrips", "TimeoutRuns", "TimerLateness",
           "lognormal_points"]

_Z95 = 1.6449

DRIFT_SAMPLES = 16  # answered round trips whose median is the level that drift is judged by
COLD_RATIO = 2.0  # a first answer this many times the next one was a cold connection's (`Link.observe_answer`)


def lognormal_points(p50: float, p95: float | None = None, n: int = 64) -> np.ndarray:
    """`n` evenly spaced quantiles of the log-normal with this median and 95th percentile (sorted)."""
    p50 = max(float(p50), 1e-6)
    p95 = max(float(p95 if p95 is not None else p50 * 1.2), p50)
    sigma = math.log(p95 / p50) / _Z95
    z = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    return np.exp(math.log(p50) + sigma * z)


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """A link's bandwidth (bits per second) and round-trip time (seconds)."""

    bandwidth_bps: float
    rtt_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0 or self.rtt_s < 0:
            msg = f"LinkEstimate needs bandwidth_bps > 0 and rtt_s >= 0, got {self.bandwidth_bps}, {self.rtt_s}"
            raise ConfigError(msg)

    def seconds(self, nbytes: int) -> float:
        return self.rtt_s + nbytes * 8 / self.bandwidth_bps


class TimeoutRuns:
    """Whether the deadline timeouts in a row so far are news (a partition), not a slow link's bad luck.

    Where a share p of the recent calls missed their deadline, n more in a row come by chance with
    probability about p**n: a run is news once that is below `odds`, after ceil(log(odds) / log(p))
    timeouts, at least `floor` and at most `cap`. A link that nearly always answers in time is judged
    gone after `floor`; a jittered link where 75 % miss a tight deadline, after 33 (with `odds` 1e-4).

    Args:
        floor, cap: the fewest and the most timeouts in a row that are news.
        odds: how unlikely by chance a run must be.
        window: the recent calls whose share of timeouts is the base rate (the run itself left out).
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
        share = (self._timeouts - self.run + 1) / (before + 2) if before >= self.min_calls else self.prior_share
        n = math.ceil(math.log(self.odds) / math.log(share))
        return max(self.floor, min(self.cap, n))

    def news(self) -> bool:
        return self.run >= self.threshold()

    def unusual(self, odds: float, floor: int) -> bool:
        """Whether the current run is less likely than `odds` by chance (at least `floor` long)."""
        before = len(self._calls) - self.run
        share = (self._timeouts - self.run + 1) / (before + 2) if before >= self.min_calls else self.prior_share
        return self.run >= max(floor, math.ceil(math.log(odds) / math.log(share)))


class TimerLateness:
    """How late an abandoned escalation comes back: the agent's deadline margin, learned from each one.

    The agent abandons an escalation with its own timer; between the moment it is due and the moment
    the degraded answer is ready, time still passes (the loop wakes late, the local answer is built).
    The next timer is set a high quantile of the recent latenesses earlier: of the last `window` ones
    within `max_age_s`, the order statistic a new lateness exceeds with the wanted probability (the
    j-th smallest of n: 1 - j / (n + 1)), but never the largest (one stall of a loaded host does not
    cut every deadline for ten seconds), with the prior standing in for the samples missing to
    `min_samples`.

    Which quantile: a timer that fires later than the margin puts its request over the budget, and the
    budget is a `quantile` of all requests (p95: 5 % may be over). Only the share `r` of requests whose
    timer fires is at risk, so each timer may be late past the margin with probability
    `safety * (1 - quantile) / r`: the margin is the `1 - safety * (1 - quantile) / r` quantile,
    between `floor_quantile` and `1 - safety * (1 - quantile)`. With `safety` ½ the expected share
    over the budget is half what the budget allows (at 100 requests a second, a 1-second window then
    has 2.5 over on average, and, were they independent, more than 5 in about 4 % of windows). `r` is
    timers over requests, both counted with a decay of `max_age_s` (`served`); while the decayed count of
    requests is under `min_requests` (at a steady rate, under two requests a second) it is taken as 1.
    The margin follows `r` as it moves, not only when a timer fires. Where one request in four times
    out (a jittered link under a tight budget) that is the 90th percentile rather than the 95th: every
    millisecond a timer is not cut early is a millisecond more for the round trip (on the jittered phase
    of `bench/controller/run.py --phases binding`, about 17 more escalations in each hundred answered per
    millisecond).

    Example:
        >>> late = TimerLateness()
        >>> late.served(); late.add(2.4)
        >>> deadline_ms = left_ms - late.margin_ms()
    """

    def __init__(self, prior_ms: float = 1.0, *, quantile: float = 0.95, window: int = 256, min_samples: int = 8,
                 max_age_s: float = 10.0, safety: float = 0.5, floor_quantile: float = 0.75, min_requests: float = 20.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (0 < quantile < 1 and 0 < safety <= 1 and 0 <= floor_quantile <= 1 - safety * (1 - quantile)):
            msg = (f"TimerLateness: need 0 < quantile < 1, 0 < safety <= 1 and 0 <= floor_quantile <= "
                   f"1 - safety * (1 - quantile); got {quantile!r}, {safety!r}, {floor_quantile!r}")
            raise ConfigError(msg)
        self.prior_ms, self.quantile, self.min_samples = float(prior_ms), quantile, min_samples
        self.max_age_s, self.clock = max_age_s, clock
        self.safety, self.floor_quantile, self.min_requests = safety, floor_quantile, min_requests
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._margin, self._until, self._level = self.prior_ms, math.inf, 1.0
        self._timers = self._requests = 0.0  # decayed counts (`_decay`), as of `_counted`
        self._counted = clock()

    def _decay(self) -> None:
        now = self.clock()
        if now > self._counted:
            keep = math.exp((self._counted - now) / self.max_age_s)
            self._timers, self._requests, self._counted = self._timers * keep, self._requests * keep, now

    def served(self, n: int = 1) -> None:
        """`n` requests answered (whether or not they escalated): the denominator of the at-risk share."""
        self._decay()
        self._requests += n

    def at_risk(self) -> float:
        """The share of requests whose answer waited for the agent's timer (1 until enough were counted)."""
        self._decay()
        if self._requests < self.min_requests:
            return 1.0
        return min(1.0, self._timers / self._requests)

    def add(self, late_ms: float) -> None:
        """How many milliseconds after its due time an abandoned escalation's answer was ready."""
        value = max(0.0, float(late_ms)) if math.isfinite(late_ms) else self.prior_ms
        self._decay()
        self._timers += 1.0
        self._samples.append((self.clock(), value))
        self._refit()

    def level(self) -> float:
        """The quantile of lateness the margin is read at, for the current at-risk share."""
        tail = self.safety * (1 - self.quantile)
        return max(self.floor_quantile, 1 - tail / max(self.at_risk(), tail))

    def _refit(self) -> None:
        samples, now = self._samples, self.clock()
        while samples and samples[0][0] < now - self.max_age_s:
            samples.popleft()
        if not samples:
            self._margin, self._until = self.prior_ms, math.inf
            return
        s = sorted([v for _, v in samples] + [self.prior_ms] * max(0, self.min_samples - len(samples)))
        # the j-th smallest of n is exceeded by a new draw with probability 1 - j / (n + 1), whatever the
        # distribution: j is chosen so, but never the largest (one stall is not the margin)
        self._level = self.level()
        j = math.ceil(self._level * (len(s) + 1))
        self._margin = s[max(0, min(j - 1, len(s) - 2))]
        self._until = samples[0][0] + self.max_age_s

    def margin_ms(self) -> float:
        """Milliseconds to end the agent's timer before the budget does."""
        if self.clock() >= self._until or (self._samples and abs(self.level() - self._level) > 0.005):
            self._refit()
        return self._margin

    def __len__(self) -> int:
        return len(self._samples)


class Bandwidth:
    """Bandwidth and base round trip from timed transfers (no probes of its own).

    The base is the fastest recent small message (its bytes and round trip), or the intercept of elapsed
    time against bytes over messages of different sizes. The bandwidth is the median, over the last
    `recent` large messages, of the bytes each carried beyond the base's over the time it took beyond
    the base's. A time below `resolution_s` cannot be told from none: such a message bounds the
    bandwidth (its bytes over that resolution) instead of reading as an infinite one (a message as fast
    as the base by the jitter of a loaded host read as 29 Gbit/s, so a smaller wire encoding looked
    worthless). A timeout counts as a slow sample. Transfers older than
    `max_age_s` are forgotten, but the last estimate is not: with no large message timed since (an
    outage, or requests sent smaller), it stands, what the link was last seen to carry, until new
    transfers replace it.
    """

    def __init__(self, *, window: int = 16, recent: int = 3, small_bytes: int = 2048, max_age_s: float = 30.0,
                 resolution_s: float = 1e-4, clock: Callable[[], float] = time.monotonic) -> None:
        self._small: deque[tuple[float, int, float]] = deque(maxlen=window)
        self._large: deque[tuple[float, int, float]] = deque(maxlen=window)
        self.recent, self.small_bytes, self.max_age_s, self.clock = recent, small_bytes, max_age_s, clock
        self.resolution_s = resolution_s
        self._last: LinkEstimate | None = None

    def observe(self, nbytes: int, elapsed_s: float) -> None:
        """One transfer: bytes on the wire (both ways) and its round-trip seconds."""
        (self._small if nbytes <= self.small_bytes else self._large).append((self.clock(), int(nbytes), elapsed_s))

    def observe_timeout(self, nbytes: int, waited_s: float) -> None:
        """No answer within `waited_s`: recorded at half the bandwidth the wait bounds it by."""
        if nbytes > self.small_bytes:
            rtt = self.rtt_s()
            self._large.append((self.clock(), nbytes, rtt + 2 * max(waited_s - rtt, 1e-6)))

    def _age(self) -> None:
        horizon = self.clock() - self.max_age_s
        for q in (self._small, self._large):
            while q and q[0][0] < horizon:
                q.popleft()

    def _base(self) -> tuple[int, float]:
        """The base message: (bytes, seconds) of the fastest recent small one, else (0, the intercept)."""
        self._age()
        if self._small:
            _, nbytes, elapsed = min(self._small, key=lambda s: s[2])
            return nbytes, elapsed
        sizes = np.array([b for _, b, _ in self._large], dtype=np.float64)
        if len(sizes) >= 2 and sizes.max() >= 1.3 * sizes.min():
            times = np.array([e for _, _, e in self._large], dtype=np.float64)
            _slope, intercept = np.polyfit(sizes, times, 1)
            return 0, float(np.clip(intercept, 0.0, times.min()))
        return 0, 0.0

    def rtt_s(self) -> float:
        """The base round trip: of a message of no bytes."""
        nbytes, elapsed = self._base()
        bandwidth = self._fit(nbytes, elapsed) if nbytes else None
        return elapsed if bandwidth is None else _empty_rtt(nbytes, elapsed, bandwidth)

    def _fit(self, base_bytes: int, base_s: float) -> float | None:
        """The median of bits beyond the base's over seconds beyond it, of the last `recent` large messages
        that carried at least half of `small_bytes` more than the base (a message barely larger than the
        base says nothing of the bandwidth, only of the jitter); each time at least `resolution_s`."""
        last = [(b - base_bytes, e - base_s) for _, b, e in self._large if b - base_bytes >= self.small_bytes / 2]
        if not last:
            return None
        return float(np.median([8 * b / max(e, self.resolution_s) for b, e in last[-self.recent:]]))

    def estimate(self) -> LinkEstimate | None:
        """The bandwidth and base round trip; the last estimate while no large message was timed recently
        (None until one ever was)."""
        nbytes, elapsed = self._base()
        bandwidth = self._fit(nbytes, elapsed)
        if bandwidth is not None:
            self._last = LinkEstimate(bandwidth, _empty_rtt(nbytes, elapsed, bandwidth))
        return self._last


def _empty_rtt(nbytes: int, elapsed_s: float, bandwidth_bps: float) -> float:
    """The round trip of a message of no bytes, from one of `nbytes` that took `elapsed_s` at `bandwidth_bps`."""
    return max(elapsed_s - nbytes * 8 / bandwidth_bps, 0.0)


class RoundTrips:
    """Recent round trips (ms), each with its time; an escalation not answered in time is kept with how
    long the edge waited, and reads +inf in `samples()` (never answered in time) but the wait itself in
    `waits()` (a lower bound of its round trip, what the skip rule judges by).

    Only those of the last `horizon_s` count; with fewer than `min_samples` of them, the prior's
    points fill in. `ewma` follows answered round trips.
    """

    def __init__(self, prior: np.ndarray, *, maxlen: int = 256, min_samples: int = 3, alpha: float = 0.2,
                 horizon_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._prior = np.sort(np.asarray(prior, dtype=float))
        self._window: deque[tuple[float, float, bool]] = deque(maxlen=maxlen)
        self._min, self._alpha, self.horizon_s, self._clock = min_samples, alpha, horizon_s, clock
        self.ewma = float(np.median(self._prior))
        self._ewma_at = -math.inf
        self.count = 0

    def add(self, value: float, *, restart: bool = False, answered: bool = True) -> float:
        """A round trip, or with `answered=False` how long the edge waited for none (inf: unknown); the
        time it is recorded at."""
        now = self._clock()
        self._window.append((now, float(value), answered and math.isfinite(value)))
        self.count += 1
        if answered and math.isfinite(value):
            # an EWMA that has seen nothing for a horizon starts again from the new value
            fresh = restart or now - self._ewma_at > self.horizon_s
            self.ewma = value if fresh else self.ewma + self._alpha * (value - self.ewma)
            self._ewma_at = now
        return now

    def last_answered(self, k: int) -> list[float]:
        """The last `k` answered round trips (fewer if the window holds fewer), newest first."""
        out: list[float] = []
        for _, v, ok in reversed(self._window):
            if ok:
                out.append(v)
                if len(out) >= k:
                    break
        return out

    def recent(self, *, waits: bool = False) -> np.ndarray:
        horizon = self._clock() - self.horizon_s
        w = self._window
        while w and w[0][0] < horizon:
            w.popleft()
        return np.fromiter((v if ok or waits else math.inf for _, v, ok in w), dtype=float, count=len(w))

    def samples(self, min_samples: int | None = None, *, waits: bool = False) -> np.ndarray:
        """The recent round trips, sorted (+inf, or with `waits` the wait, for those not answered in time);
        the prior's points join them while fewer than `min_samples` (default: the window's)."""
        s = self.recent(waits=waits)
        return np.sort(s if s.size >= (self._min if min_samples is None else min_samples)
                       else np.concatenate([s, self._prior]))

    def quantile(self, q: float, min_samples: int | None = None, *, waits: bool = False) -> float:
        s = self.samples(min_samples, waits=waits)
        return float(s[min(s.size - 1, int(q * s.size))])

    def current_ewma(self) -> float:
        """The EWMA, or the prior's median when no answer came within the horizon."""
        return self.ewma if self._clock() - self._ewma_at <= self.horizon_s else float(np.median(self._prior))

    def drop_unanswered(self, since: float) -> None:
        """Forget the escalations not answered in time from `since` on (a run of timeouts now over)."""
        self._window = deque((x for x in self._window if x[2] or x[0] < since), maxlen=self._window.maxlen)

    def drop(self, at: float, value: float) -> None:
        """Forget the answered round trip `value` recorded at time `at`."""
        self._window = deque((x for x in self._window if not (x[0] == at and x[1] == value and x[2])),
                             maxlen=self._window.maxlen)

    def keep_since(self, since: float) -> None:
        """Forget what was recorded before `since`."""
        self._window = deque((x for x in self._window if x[0] >= since), maxlen=self._window.maxlen)

    def drop_infinite(self) -> None:
        self._window = deque((x for x in self._window if x[2]), maxlen=self._window.maxlen)

    def rebase(self, keep: int) -> None:
        """Forget all but the last `keep` samples (after a change of the link)."""
        kept = list(self._window)[-keep:] if keep > 0 else []
        self._window = deque(kept, maxlen=self._window.maxlen)

    def __len__(self) -> int:
        return self.recent().size


@dataclass(frozen=True)
class LinkView:
    """An immutable snapshot of a `Link`, what one decision is computed from."""

    up: bool
    rtt_ms: float
    rtt_p50_ms: float
    rtt_high_ms: float
    availability: float
    failure_latency_ms: float
    lateness_ms: float
    bandwidth: LinkEstimate | None
    epoch: int
    event: str
    recent: int
    hold_until: float
    rtt_samples: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False, compare=False)
    slow: bool = False  # a run of timeouts unusual for this link is going on


class Link:
    """The one model of the link to the cloud, fed by every escalation, timeout, refusal and probe.

    Args:
        rtt_ms, rtt_high_ms: prior median and high round trip, used while few recent ones are known.
        horizon_s: round trips older than this stop counting (time-decayed estimates).
        high_quantile: the quantile `view().rtt_high_ms` reports.
        down_after, up_after: refusals in a row that mark the link down; answers since then, with no
            refusal between them, that mark it up again.
        down_after_timeouts: the most timeouts in a row that mark it down (fewer when the run is news).
        down_after_s: a run of timeouts marks it down only once it has lasted this long: at a hundred
            requests a second, a 0.3-s loss burst is thirty timeouts in a row, news by count, but a burst,
            not a partition (the link is "slower" meanwhile, and the controller waits `link_settle_s`,
            as long, before it gives the escalations up). Longer spells are down within 0.5 s.
        drift, drift_abs_ms: a move of the answered round trips' level (`_level`: the median of the last
            `DRIFT_SAMPLES`) by this share of the reference
            and this many milliseconds is an event ("slower", "faster"): the older samples are dropped
            but the last `rebase_keep` (so that one load spike among them does not read as a slow
            link), and `epoch` moves.
        timer_lateness_ms: the prior of the agent timer's lateness (`TimerLateness`).
        clock: monotonic seconds.
    """

    def __init__(self, *, rtt_ms: float = 10.0, rtt_high_ms: float | None = None, horizon_s: float = 5.0,
                 high_quantile: float = 0.95, window: int = 256, alpha: float = 0.2, down_after: int = 3,
                 up_after: int = 3, down_after_timeouts: int = 64, down_after_s: float = 0.5, drift: float = 0.5,
                 drift_abs_ms: float = 2.0,
                 rebase_keep: int = 32, timer_lateness_ms: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (rtt_ms > 0 and horizon_s > 0 and 0 < high_quantile < 1 and down_after >= 1 and up_after >= 1
                and down_after_timeouts >= down_after and down_after_s >= 0):
            msg = (f"Link: need rtt_ms > 0, horizon_s > 0, 0 < high_quantile < 1, down_after >= 1, up_after >= 1, "
                   f"down_after_timeouts >= down_after, down_after_s >= 0; got {rtt_ms!r}, {horizon_s!r}, "
                   f"{high_quantile!r}, {down_after!r}, {up_after!r}, {down_after_timeouts!r}, {down_after_s!r}")
            raise ConfigError(msg)
        self._lock = threading.RLock()
        self._clock = clock
        self.rtt = RoundTrips(lognormal_points(rtt_ms, rtt_high_ms or rtt_ms * 1.3, 32), maxlen=window,
                              alpha=alpha, horizon_s=horizon_s, clock=clock)
        self.lateness = TimerLateness(timer_lateness_ms, clock=clock)
        self.bandwidth = Bandwidth(clock=clock)
        self.timeouts = TimeoutRuns(min(max(20, down_after), down_after_timeouts), down_after_timeouts)
        self.high_quantile, self._alpha = high_quantile, alpha
        self.up, self.down_after, self.up_after = True, down_after, up_after
        self.drift, self.drift_abs_ms, self.rebase_keep = drift, drift_abs_ms, rebase_keep
        self.failures = self.refusals = 0  # in a row: every failure, and those that were not timeouts
        self.down_after_s = down_after_s
        self._failing_since = math.inf  # when the failures in a row began
        self._oks = 0  # answers since the link went down (no refusal between them)
        self._oks_since = math.inf  # when the first of them was recorded
        self.availability, self.failure_latency_ms = 1.0, 0.0
        self.epoch, self.event = 0, ""
        self.slow = False  # a run of timeouts unusual for this link is going on (`slow_odds`)
        self._slow_since = math.inf  # when that run began
        self.slow_odds, self.slow_floor = 0.01, 3
        self._ref_ms = self.rtt.ewma
        self.hold_until = -math.inf  # a busy cloud's retry hint (monotonic seconds)
        self.last_attempt = -math.inf
        self._cold: tuple[float, float] | None = None  # (when, ms) of a first answer on an empty record

    # -- feeding -----------------------------------------------------------------------------
    def attempted(self) -> None:
        """An escalation (or probe) is being sent now."""
        with self._lock:
            self.last_attempt = self._clock()

    def observe_answer(self, rtt_ms: float, *, probe: bool = False) -> None:
        """An answer within the deadline after `rtt_ms`. `probe`: sent although the view said it
        would not fit; answered in time, the older round trips no longer describe the link.

        The first answer on a link up with nothing in its record (a new link, or one nothing was sent
        on for `horizon_s`) may be a cold one: a fresh connection's first call pays its setup, several
        times a warm round trip. Alone in the record it would be the skip rule's every quantile, and
        escalations would wait for a probe (`rtt_probe_s`) to be sent again; so the skip rule leaves it
        out (`quantile`), and so does the drift check, until the next answer, which drops it from the
        record where it took more than `COLD_RATIO` times as long (and `drift_abs_ms` more)."""
        with self._lock:
            self.failures = self.refusals = 0
            self._failing_since = math.inf
            self._oks += 1
            burst = self.timeouts.news()  # the run of timeouts this answer ends was news, not the link's luck
            self.timeouts.record(timeout=False)
            cold, self._cold = self._cold, None
            warm = cold is not None and rtt_ms * COLD_RATIO < cold[1] and cold[1] - rtt_ms > self.drift_abs_ms
            if warm and cold is not None:
                self.rtt.drop(*cold)  # a cold first call's setup: it describes the link no more
            first = cold is None and self.up and not self.slow and not probe and not len(self.rtt)
            after_run = self.slow
            if after_run:  # answered in time after an unusual run of timeouts
                self.slow = False
                if burst:  # a run that was news (a stall, a partition's start) describes the link no more; the
                    # answers and timeouts before it still do (dropping them all read as a link that answers everything)
                    self.rtt.drop_unanswered(self._slow_since)
                # a shorter run stays, as what the link does: on a link that misses a tight deadline often such runs
                # are its luck, and dropping each read the link as answering in time far more than it did
            if probe and self.up:  # while down, what came since the first answer is kept as it comes up (below)
                self.rtt.rebase(0)
            at = self.rtt.add(rtt_ms, restart=probe or after_run or warm)
            if first:
                self._cold = (at, float(rtt_ms))
            if not self.up and self._oks == 1:
                self._oks_since = at
            if not self.up and self._oks >= self.up_after:
                self.up, self.availability = True, 1.0
                # what came since the first of the answers that brought it back describes it now: those answers
                # and the timeouts between them (keeping the answers alone read a link that answers one
                # escalation in thirty in time as one that answers all, until timeouts refilled the record)
                self.rtt.keep_since(self._oks_since)
                self._bump("up")
                self._ref_ms = self._level()
                return
            self.availability += self._alpha * (1.0 - self.availability)
            if not first:  # a level is judged once the next answer says whether the first was cold
                self._drift(probe or after_run)

    def observe_timeout(self, waited_ms: float | None = None) -> None:
        """No answer before the deadline: the link is slower than what was left (the round trips learn it)."""
        with self._lock:
            now = self._clock()
            self._failing_since = min(self._failing_since, now)
            self.failures += 1
            self.refusals = 0
            self._oks = 0 if self.up else self._oks
            self.timeouts.record(timeout=True)
            if waited_ms is not None:
                self.rtt.add(waited_ms, answered=False)
            if not self.slow and self.timeouts.unusual(self.slow_odds, self.slow_floor):
                # the run joins the window of round trips, which it does not replace: a link that misses the
                # deadline now and then reads as such, not as one that answers nothing (a plan made in a run's
                # last moments gave the escalations up); a link gone for good is marked down
                self.slow, self._slow_since = True, self._failing_since
                self._bump("slower")
            if (self.up and self.failures > self.refusals and self.failures >= self.timeouts.threshold()
                    and now - self._failing_since >= self.down_after_s):
                self._down()

    def observe_refusal(self, waited_ms: float | None = None, *, busy: bool = False,
                        retry_after_s: float | None = None) -> None:
        """The cloud said no or was not there. `busy`: it is there but shedding load (RESOURCE_EXHAUSTED):
        that lowers availability and, with `retry_after_s`, holds escalations back until then, but does
        not mark the link down."""
        with self._lock:
            self._failing_since = min(self._failing_since, self._clock())
            self.failures += 1
            self.refusals += 1
            self._oks, self._oks_since = 0, math.inf
            if waited_ms is not None:  # availability prices a refusal: the round trips are of answers and timeouts
                self.failure_latency_ms += self._alpha * (float(waited_ms) - self.failure_latency_ms)
            self.availability -= self._alpha * self.availability
            if busy:
                if retry_after_s is not None and retry_after_s > 0:
                    self.hold_until = max(self.hold_until, self._clock() + retry_after_s)
                return
            if self.up and self.refusals >= self.down_after:
                self._down()

    def observe_transfer(self, nbytes: int, elapsed_s: float, *, timed_out: bool = False) -> None:
        """What a transport timed on the wire: bytes both ways and seconds (the bandwidth learns it)."""
        with self._lock:
            (self.bandwidth.observe_timeout if timed_out else self.bandwidth.observe)(nbytes, elapsed_s)

    def observe_lateness(self, late_ms: float) -> None:
        """How late past its due time an abandoned escalation's answer was ready."""
        with self._lock:
            self.lateness.add(late_ms)

    def observe_served(self, n: int = 1) -> None:
        """`n` requests answered, escalated or not (the share whose timer fires sets the margin's quantile)."""
        with self._lock:
            self.lateness.served(n)

    # -- reading -----------------------------------------------------------------------------
    def margin_ms(self) -> float:
        with self._lock:
            return self.lateness.margin_ms()

    def quantile(self, q: float) -> float:
        """The `q` quantile of the recent round trips (a timeout at the time it waited, a lower bound), or
        of the prior when none is recent: what the skip rule judges the next escalation by. A first
        answer on an empty record counts only once another came (`observe_answer`)."""
        with self._lock:
            return self.rtt.quantile(q, min_samples=2 if self._cold is not None else 1, waits=True)

    def estimate(self) -> LinkEstimate | None:
        """Bandwidth and base round trip for the wire encoder (None until a large transfer was timed)."""
        with self._lock:
            return self.bandwidth.estimate()

    def view(self) -> LinkView:
        with self._lock:
            samples = self.rtt.samples()
            high = float(samples[min(samples.size - 1, int(self.high_quantile * samples.size))])
            return LinkView(self.up, self.rtt.current_ewma(), float(np.median(samples)), high,
                            self.availability if self.up else 0.0, self.failure_latency_ms, self.lateness.margin_ms(),
                            self.bandwidth.estimate(), self.epoch, self.event, len(self.rtt), self.hold_until,
                            samples, self.slow)

    # -- upkeep ------------------------------------------------------------------------------
    def forget_unanswered(self) -> None:
        """Forget the unanswered escalations (after the deadline grew: they were cut at the old one)."""
        with self._lock:
            self.rtt.drop_infinite()

    def rebase(self, keep: int) -> None:
        with self._lock:
            self.rtt.rebase(keep)

    def _down(self) -> None:
        self.up, self._oks, self._oks_since = False, 0, math.inf
        self._bump("down")

    def _bump(self, event: str) -> None:
        self.epoch += 1
        self.event = event

    def _level(self) -> float:
        """The round trip's level that drift is judged by: the median of the last `DRIFT_SAMPLES` answered
        round trips (the EWMA before any). On a loaded host one round trip in twenty is a spike of several
        times the median: it moves an EWMA past the drift threshold, and each such false "slower" cut the
        window to `rebase_keep` samples, so the estimates planned from it swung; a median of sixteen moves
        only when half of them did, a few escalations after a real change."""
        recent = self.rtt.last_answered(DRIFT_SAMPLES)
        return float(np.median(recent)) if recent else self.rtt.ewma

    def _drift(self, probe: bool) -> None:
        level, ref = self._level(), self._ref_ms
        if probe or abs(level - ref) > max(self.drift * ref, self.drift_abs_ms):
            if not probe:
                self.rtt.rebase(self.rebase_keep)
            self._bump("faster" if probe or level < ref else "slower")
            self._ref_ms = level
