"""What the batcher needs to admit by deadline: the model's measured service time and a standing-queue signal.

- `ServiceTimes` learns how long one run of the model takes at each batch size (per power-of-two bucket
  of rows: a high quantile of the recent runs) and answers "how long does it take to work through N
  queued rows".
  Before the first measurement it knows nothing and every request is admitted.
- `StandingQueue` is CoDel's detector (Nichols and Jacobson, "Controlling Queue Delay"): the queue is
  *standing* once every request taken from it for a whole `interval` had waited longer than `target`.
  A queue that merely absorbs a burst drains below the target within the interval and never counts.
- `RetryHints` sizes a refusal's retry hint from the refusal pressure: callers that honour it come back,
  all of them together, at about a tenth of the model's capacity however many they are, so that refusals
  stay cheap beside the answers instead of outnumbering them. The estimate fades with time as well as with
  refusals (time-constant `RetryHints.tau_s`, 1 s): once refusals stop for `RetryHints.quiet_s` (1.33 s with
  the defaults), the next hint is one refusal's worth again, however large the overload's hints were.

- `AnswerLag` closes the loop on the plan: for each admitted request it learns how much later than
  planned at admission its caller actually had the answer (the caller's thread woken, or the event loop
  reaching the answer), and keeps a high quantile of that lag back from every later admission. What the
  plan cannot see (a hundred handler threads contending for the interpreter, an event loop busy with other
  work, a run slower than its measurement) shows up there as it happens, and admission shrinks until what
  it admits is answered in time; as the lag falls (the idle instance's runs keep measuring), it widens again.

- `TightBudget` keeps a low quantile (the 5th percentile) of the time to deadline requests arrived with over
  the last few seconds: which requests are tight, and how long a batch with a loose one in it may hold its
  instance (`batch_cap_s`), follow from it, so that a tight request arriving while a batch runs still has
  time, and batches of tight requests are as large as their deadlines allow.

All are plain state guarded by the batcher's lock; no threads, no clocks of their own.

Example:
    >>> times = ServiceTimes(max_batch_size=8)
    >>> times.observe(rows=1, seconds=0.015)
    >>> round(times.drain_seconds(rows=16, instances=1), 3)  # 16 rows: two batches of 8, linear guess
    0.24
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

# Refused callers honouring their hints return at this share of the capacity, in all. A refusal costs the front
# end (a gRPC call's handler, an MQTT round trip through the broker) a few tenths of a ms of a core, taken from the
# cores and threads the model's runs use: at a share of 0.5 a server of a model that runs in a ms refused 300-400
# requests a second beside 700-850 answers. Interleaved runs at 128-192 callers: 0.86 of the best on average at 0.5
# (twelve rows, 0.77-1.00), 0.97 at 0.1 (eight rows, 0.90-1.00); three whole-bench runs after had 0.79-0.90 there, where
# rows move by about 0.1 between runs (bench/RESULTS.md, "returning callers at a tenth of the capacity"). The
# admitted callers keep the queue full; the returning ones need only top it up.
_HINT_SHARE = 0.1
_MAX_HINT_S = 5.0  # a hint is at most this (what the agent honours at most, `edge_agent.pushback.MAX_HINT_S`)
_HINT_JITTER = 0.25  # each hint is drawn within this share either side, so a burst refused together spreads
_HINT_TAU_S = 1.0  # time-constant of the remembered hint size's decay while no refusal comes
_ALPHA = 0.2  # weight of a new measurement in the moving averages
_WINDOW = 32  # recent runs per bucket the planning quantile is taken over
_LAG_WINDOW = 128  # recent admitted requests the answer lag's quantile is taken over
LAG_QUANTILE = 0.9  # admission keeps this quantile of the recent answer lags back from a deadline
_LAG_MAX_S = 1.0  # at most this is kept back (a lag of seconds is a stalled host, not a plan to correct)
PLAN_QUANTILE = 0.9  # runs are planned to take this quantile of the recent ones


def _bucket(rows: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...: batch sizes that cost about the same per row."""
    return max(0, rows - 1).bit_length()


@dataclass(slots=True)
class _Average:
    """One bucket's recent run times and the moving average of its rows."""

    rows: float
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    _planned: float | None = None
    _longest: float = 0.0

    def add(self, rows: int, seconds: float) -> None:
        self.recent.append(seconds)
        self.rows += _ALPHA * (rows - self.rows)
        self._planned = None

    @property
    def overshoot(self) -> float:
        """How much longer than planned the longest recent run took (0 with a steady run time), at most half
        the plan: one stall of a loaded host (a run descheduled for a while) must not stop all admission."""
        planned = self.seconds
        return min(self._longest - planned, 0.5 * planned)

    @property
    def seconds(self) -> float:
        """What a run is planned to take: the `PLAN_QUANTILE` quantile of the recent runs (the longest
        while there are few). On a shared, noisy host a batch planned at the mean misses its deadline
        about half the time it is tight, and a request admitted on such a plan is refused late, after
        queueing; work that ends late is work thrown away, while a refusal at once costs only a retry."""
        if self._planned is None:
            ordered = sorted(self.recent)
            self._planned = ordered[max(0, math.ceil(PLAN_QUANTILE * len(ordered)) - 1)]
            self._longest = ordered[-1]
        return self._planned

@dataclass(slots=True)
class ServiceTimes:
    """Measured run time of one batch, by batch size.

    Args:
        max_batch_size: the largest batch the model runs (1 when it does not batch).
    """

    max_batch_size: int
    _buckets: dict[int, _Average] = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return bool(self._buckets)

    def observe(self, rows: int, seconds: float) -> None:
        """One run of `rows` rows took `seconds`."""
        bucket = self._buckets.get(_bucket(rows))
        if bucket is None:
            self._buckets[_bucket(rows)] = bucket = _Average(float(rows))
        bucket.add(rows, seconds)

    def batch_seconds(self, rows: int) -> float:
        """The expected run time of one batch of `rows` rows (0 before any measurement).

        From the measurement of the same bucket, scaled by rows; a bucket not measured yet is
        extrapolated from the nearest smaller one at its cost per row (conservative on CPUs, where a
        batch costs about rows times a single row), or from the nearest larger one as is.
        """
        if rows <= 0 or not self._buckets:
            return 0.0
        b = _bucket(rows)
        own = self._buckets.get(b)
        if own is not None:
            return own.seconds * max(1.0, rows / own.rows) if rows > own.rows else own.seconds
        smaller = [k for k in self._buckets if k < b]
        if smaller:
            near = self._buckets[max(smaller)]
            return near.seconds * rows / near.rows
        return self._buckets[min(self._buckets)].seconds

    def headroom_s(self) -> float:
        """Slack kept at admission beyond the plan: the largest recent overshoot of a run past its plan.

        A request admitted with exactly its plan's worth of time is refused later, after queueing,
        whenever a run ahead of it takes longer than planned (one in ten, at the planning quantile);
        that refusal arrives late, having spent the caller's budget. Admitting only what fits with this
        slack keeps such late refusals rare; on a steady host the slack is small and costs nothing.
        """
        return max((bucket.overshoot for bucket in self._buckets.values()), default=0.0)

    def rows_per_s(self, instances: int) -> float:
        """The rows per second the instances answer at the best measured batch size (0 before any run)."""
        best = max((bucket.rows / bucket.seconds for bucket in self._buckets.values() if bucket.seconds > 0),
                   default=0.0)
        return best * max(1, instances)

    def drain_seconds(self, rows: int, instances: int) -> float:
        """Time to work through `rows` queued rows in full batches, spread over `instances`."""
        if rows <= 0:
            return 0.0
        full, rest = divmod(rows, self.max_batch_size)
        work = full * self.batch_seconds(self.max_batch_size) + self.batch_seconds(rest)
        return work / max(1, instances)


@dataclass(slots=True)
class AnswerLag:
    """How much later than planned admitted requests are answered, as feedback for admission.

    `observe(planned_s, took_s)`: a request planned at admission to be answered `planned_s` after it was
    queued had its answer in its caller's hands after `took_s`. `margin_s` is the `quantile` of the recent
    `window` lags (`took_s - planned_s`, none below 0), at most `max_s`: admission adds it to its plan, so a
    request is admitted only when the plan plus what plans have recently missed by fits its deadline.

    It is a feedback loop, not a constant: admitting too much lengthens the lag (every admitted request
    shares the same contended threads), which raises the margin and admits less; a queue that drains
    brings the lag down with it. Before the first observation the margin is 0.

    Example:
        >>> lag = AnswerLag(window=4)
        >>> for took in (0.020, 0.030, 0.025, 0.060):
        ...     lag.observe(planned_s=0.020, took_s=took)
        >>> round(lag.margin_s, 3)
        0.04
    """

    window: int = _LAG_WINDOW
    quantile: float = LAG_QUANTILE
    max_s: float = _LAG_MAX_S
    _recent: deque[float] = field(default_factory=deque)
    _margin: float | None = 0.0

    def __post_init__(self) -> None:
        if self.window < 1 or not 0 < self.quantile <= 1:
            msg = (f"AnswerLag: window must be >= 1 and quantile in (0, 1], got window={self.window!r}, "
                   f"quantile={self.quantile!r}")
            raise ValueError(msg)
        self._recent = deque(maxlen=self.window)

    def observe(self, planned_s: float, took_s: float) -> None:
        """An admitted request planned to take `planned_s` took `took_s` to reach its caller."""
        self._recent.append(min(self.max_s, max(0.0, took_s - planned_s)))
        self._margin = None

    @property
    def margin_s(self) -> float:
        """Seconds admission keeps back beyond its plan (see the class doc)."""
        if self._margin is None:
            ordered = sorted(self._recent)
            self._margin = ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)] if ordered else 0.0
        return self._margin


@dataclass(slots=True)
class StandingQueue:
    """CoDel's standing-queue detector.

    Args:
        target_s: queueing time that is acceptable (a batch or two of waiting).
        interval_s: how long queueing time must stay above the target before the queue counts as standing.
    """

    target_s: float
    interval_s: float
    standing: bool = False
    _above_since: float | None = None

    def observe(self, now: float, sojourn_s: float) -> None:
        """A request left the queue at `now` after waiting `sojourn_s`."""
        if sojourn_s <= self.target_s:
            self._above_since, self.standing = None, False
        elif self._above_since is None:
            self._above_since = now
        elif now - self._above_since >= self.interval_s:
            self.standing = True

    def emptied(self) -> None:
        """The queue ran empty: whatever stood has drained."""
        self._above_since, self.standing = None, False


@dataclass(slots=True)
class RetryHints:
    """Retry hints sized so that the refused callers that honour them come back at `share` of capacity.

    The callers waiting out a hint are a population; by Little's law it is about the refusals given
    during the last hint (each one a caller now waiting). They return at that population divided by
    the hint, so a hint of `population / (share x capacity)` brings them back at `share` of what the
    model answers: under deep overload refusals stay a fraction of the answers, and the CPU they take
    (a gRPC call, an MQTT round trip through the broker) stays small beside the model's. The estimate
    converges from the first refusals upwards (a short hint counts few callers, so the next is longer)
    and falls back to `floor_s` once refusals stop. Each hint is drawn within +-`jitter` of the size, so
    callers refused in one burst do not return in one. Callers that ignore hints cannot raise the
    rate of answers they get; they lengthen the hints others get, up to `max_s`.

    The remembered size (the window refusals are counted over) decays as exp(-gap / `tau_s`) over the gap
    since the previous refusal. Under sustained overload refusals come every 1 / (share x capacity) (10-30 ms
    for models answering 300-1,000/s, 100-330 ms for models answering 30-100/s), so it shrinks by 1-28 % and
    the next refusals restore it (in the simulated crowds of `tests/cloud_service/test_admission.py`, a model
    answering 200/s, the returning callers settled at 0.09-0.12 of its capacity); once the load has gone, a
    refusal after a quiet of `quiet_s`
    counts no refusal of the overload (its window is shorter than the quiet), so its hint is one refusal's
    worth: at most (1 + jitter) x max(floor_s, 1 / (share x capacity)) for a `floor_s` below `quiet_s`.
    Without the decay the window stayed as long as the overload's last hint, and a lone caller refused
    seconds after the crowd left was told to wait seconds more, counted among the crowd's refusals.

    Args:
        share: the returning callers' rate, as a share of the model's capacity.
        max_s: the longest hint.
        jitter: the spread of each hint, as a share of its size.
        tau_s: the time-constant of the remembered size's decay between refusals.
        seed: the jitter's random seed.
    """

    share: float = _HINT_SHARE
    max_s: float = _MAX_HINT_S
    jitter: float = _HINT_JITTER
    tau_s: float = _HINT_TAU_S
    seed: int | None = None
    _given: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    _size: float = 0.0
    _last: float | None = None
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not self.tau_s > 0:
            msg = f"RetryHints: tau_s must be > 0 seconds (the decay's time-constant), got {self.tau_s!r}"
            raise ValueError(msg)
        if self.seed is not None:
            self._rng.seed(self.seed)

    @property
    def quiet_s(self) -> float:
        """The quiet after which the next hint is one refusal's worth: the shortest T with
        max_s x exp(-T / tau_s) < T (a window decayed from the longest hint no longer reaches back T)."""
        low, high = 0.0, self.max_s
        for _ in range(50):
            mid = (low + high) / 2
            low, high = (mid, high) if self.max_s * math.exp(-mid / self.tau_s) >= mid else (low, mid)
        return high

    def hint_s(self, now: float, floor_s: float, capacity_per_s: float) -> float:
        """The hint for one refusal at `now` (it is counted): at least `floor_s` (when the queue has
        room again), sized by the refusals of the last hint against `capacity_per_s` (0: unknown)."""
        given = self._given
        given.append(now)
        if self._last is not None:
            self._size *= math.exp(-max(0.0, now - self._last) / self.tau_s)
        self._last = now
        window = max(self._size, floor_s)
        while given and given[0] < now - window:
            given.popleft()
        pressure = len(given) / (self.share * capacity_per_s) if capacity_per_s > 0 else 0.0
        self._size = min(self.max_s, max(floor_s, pressure))
        drawn = self._size * self._rng.uniform(1 - self.jitter, 1 + self.jitter)
        return max(floor_s, min(self.max_s, drawn))


_BUDGET_WINDOW_S = 5.0  # how long an arrival's time to deadline counts towards the tight budget
_BUDGET_SAMPLES = 512  # the most recent arrivals it is taken over
_BUDGET_QUANTILE = 0.05  # "tight": this quantile of the recent times to deadline
_BUDGET_REFRESH_S = 0.05  # the quantile is taken again at most this often
# A loose request joins a batch only while it is planned within this share of the tight budget: with live
# escalations of about 100 ms that is the old fixed cap (a quarter of CoDel's 100 ms interval), which a
# journal's drain beside live traffic was measured with (tests/e2e/test_fleet_drain.py)
CAP_SHARE = 0.25


@dataclass(slots=True)
class TightBudget:
    """How much time to their deadline the tight requests arrive with (a low quantile over the recent
    arrivals), and the cap on a batch's run time that follows from it.

    A batch holds its instance for its whole run; a tight request arriving just after it started waits
    for all of it. A loose request (a journal's drain: seconds to spare), whose deadline is more than twice
    the tight budget away, joins a batch only while the batch is planned to run for at most `share` of
    that budget (never less than `floor_s`), so the tight request arriving meanwhile keeps the rest for
    its own run. Tight requests join as long as the batch ends before the earliest deadline in it (the
    batcher never plans a batch past it): under overload, when every queued request is tight, batches
    grow to what the deadlines allow, where a fixed cap planned on a contended host's run times cut them
    to a row or two and raised the cost of every row when capacity matters most. Without any request with
    a deadline in the window the cap is `floor_s` for every request.

    The tight budget is a low quantile, not the minimum: under load the time a request spends in front
    of the queue (the transport, the interpreter) varies, and a few arrive with almost nothing left.

    Example:
        >>> budget = TightBudget(floor_s=0.01)
        >>> for i in range(100):
        ...     budget.observe(now=10.0, budget_s=0.1 if i % 2 else 5.0)
        >>> budget.batch_cap_s(now=11.0, left_s=4.0)  # a loose request: a quarter of the tight budget
        0.025
        >>> budget.batch_cap_s(now=11.0, left_s=0.08)  # a tight one: the batch's earliest deadline bounds it
        inf
        >>> budget.batch_cap_s(now=20.0, left_s=0.08)  # nothing with a deadline in the last 5 s: the floor
        0.01
    """

    floor_s: float
    window_s: float = _BUDGET_WINDOW_S
    quantile: float = _BUDGET_QUANTILE
    share: float = CAP_SHARE
    _recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_BUDGET_SAMPLES))
    _tight: float | None = None
    _dirty: bool = False
    _sorted_at: float = -math.inf

    def observe(self, now: float, budget_s: float) -> None:
        """A request arrived at `now` with `budget_s` seconds left to its deadline."""
        self._recent.append((now, budget_s))
        self._dirty = True

    def tight_s(self, now: float) -> float | None:
        """The tight budget: the `quantile` of the budgets requests arrived with in the window (None when
        none had a deadline). Taken again at most every `_BUDGET_REFRESH_S` (a sort of up to 512 budgets,
        about 15 us: read on every batch and every answer, it is not redone for each)."""
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
            self._dirty = True
        if not self._recent:
            self._tight = None
        elif self._dirty and (self._tight is None or now - self._sorted_at >= _BUDGET_REFRESH_S):
            ordered = sorted(budget for _, budget in self._recent)
            self._tight = ordered[int(self.quantile * (len(ordered) - 1))]
            self._dirty, self._sorted_at = False, now
        return self._tight

    def is_tight(self, now: float, left_s: float | None) -> bool:
        """Whether a request with `left_s` seconds to its deadline (None: no deadline) counts as tight now."""
        tight = self.tight_s(now)
        return left_s is not None and tight is not None and left_s <= 2 * tight

    def batch_cap_s(self, now: float, left_s: float | None) -> float:
        """The longest a batch may be planned to run with a request `left_s` seconds from its deadline
        (None: no deadline) in it: unbounded for a tight one (its deadline bounds the batch), else the cap."""
        if self.is_tight(now, left_s):
            return math.inf
        tight = self.tight_s(now)
        return self.floor_s if tight is None else max(self.floor_s, self.share * tight)
