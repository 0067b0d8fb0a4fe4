"""Sequential change detection: is the edge's world still the one it was tuned on?

Three CUSUM charts (Page's cumulative sum), two without labels and one with the cloud's:

```
ScoreCusum      the edge's own score, in batches of `batch` requests: the mean of a batch against the
                mean and spread of the first `reference` batches (two-sided, reference value k in batch
                standard deviations); no labels needed, so it sees every request
ClassCusum      the edge's predicted classes, in batches: a chi-square distance of the batch's class
                counts from the reference frequencies (a changed class prior moves no score)
AgreementCusum  the audits' disagreement (edge top-1 != cloud top-1 on a confident answer): Bernoulli
                log-likelihood-ratio CUSUM of p1 against the reference rate p0
```

False alarms are stated as an average run length (ARL0: how long an unchanged stream runs, on
average, before a false alarm). For the score chart, batch means are close to normal and Siegmund's
approximation of a normal CUSUM's ARL, ARL(Δ) = (exp(-2Δb) + 2Δb - 1) / (2Δ²) with Δ = δ - k and
b = h + 1.166, gives the decision interval h for a target ARL0 (each side gets twice the target, so
the two sides together meet it). For the Bernoulli chart the decision interval is h = ln(ARL0): a
CUSUM of log-likelihood ratios has ARL0 >= exp(h) (Lorden), whatever p0 is, provided p0 is the true
in-control rate. Both are measured in simulation by `tests/edge_agent/test_drift.py` (A/A on real
scores, with the reference estimated from the stream itself, which costs some of the stated ARL0).

After an alarm, both charts learn a new reference from what follows: the new regime becomes the
baseline, so one shift raises one event, not one per batch nor one per chart.

Example:
    >>> monitor = DriftMonitor(DriftOptions())
    >>> for s in scores: event = monitor.score(s)
    >>> monitor.audit(agreed=False)
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from runtimes.errors import ConfigError

SIEGMUND_SHIFT = 1.166  # the overshoot correction of Siegmund's approximation for a normal CUSUM


def siegmund_arl(delta: float, k: float, h: float) -> float:
    """Siegmund's approximation of a one-sided normal CUSUM's average run length (in observations)
    for a mean shift of `delta` standard deviations, reference value `k` and decision interval `h`."""
    d = delta - k
    b = h + SIEGMUND_SHIFT
    if abs(d) < 1e-9:
        return b * b
    return (math.exp(-2.0 * d * b) + 2.0 * d * b - 1.0) / (2.0 * d * d)


def decision_interval(arl0: float, k: float) -> float:
    """The h whose in-control ARL (Siegmund) is `arl0`, by bisection."""
    lo, hi = 0.0, 50.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if siegmund_arl(0.0, k, mid) < arl0:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class DriftOptions:
    """How the drift charts judge.

    Args:
        score_arl0: average requests between false alarms of the score chart on an unchanged stream.
        score_batch: requests per batch mean.
        score_reference: batches that make the score chart's reference (mean and spread).
        score_k: the score chart's reference value, in batch standard deviations (detects best a shift of 2k).
        audit_arl0: average audits between false alarms of the agreement chart.
        audit_reference: audits that make the agreement chart's reference disagreement rate p0.
        audit_p0_floor: the least p0 (few reference disagreements must not make every later one an alarm).
        audit_p1_factor, audit_p1_min_gap: the alternative p1 = max(factor x p0, p0 + gap), at most 0.5.
        hold: requests a drift event stays flagged (the agent audits and escalates more meanwhile).
        classes_arl0, classes_batch, classes_reference, classes_k: the predicted-class chart's average
            requests between false alarms, requests per batch, reference batches, and reference value.
    """

    score_arl0: float = 200_000.0
    score_batch: int = 25
    score_reference: int = 40
    score_k: float = 0.5
    audit_arl0: float = 1_000.0
    audit_reference: int = 30
    audit_p0_floor: float = 0.02
    audit_p1_factor: float = 3.0
    audit_p1_min_gap: float = 0.1
    hold: int = 2_000
    classes_arl0: float = 1_000_000.0
    classes_batch: int = 50
    classes_reference: int = 20
    classes_k: float = 0.5

    def __post_init__(self) -> None:
        if not (self.score_arl0 > self.score_batch >= 1 and self.score_reference >= 5 and self.score_k > 0
                and self.audit_arl0 > 1 and self.audit_reference >= 5 and 0 < self.audit_p0_floor < 0.5
                and self.audit_p1_factor > 1 and self.audit_p1_min_gap > 0 and self.hold >= 0
                and self.classes_arl0 > self.classes_batch >= 10 and self.classes_reference >= 5
                and self.classes_k > 0):
            msg = (f"DriftOptions out of range: {self!r}; arl0s must exceed 1 (score_arl0 > score_batch), "
                   "references >= 5, k > 0, 0 < audit_p0_floor < 0.5, audit_p1_factor > 1, hold >= 0")
            raise ConfigError(msg)


@dataclass(frozen=True)
class DriftEvent:
    """A change flagged by a chart: which one, at which request, and the evidence."""

    kind: str  # "score" or "classes" (no labels), or "agreement" (audits)
    request: int
    statistic: float
    threshold: float
    reference: float  # the score mean, or the disagreement rate p0, before the change
    ts: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ScoreCusum:
    """Two-sided CUSUM of batch means of a score against a reference learned from the first batches."""

    def __init__(self, arl0_requests: float, batch: int, reference: int, k: float) -> None:
        self.batch, self.reference, self.k = batch, reference, k
        # two sides: each at twice the ARL, so that false alarms of either come once per arl0 on average
        self.h = decision_interval(2.0 * arl0_requests / batch, k)
        self.reset()

    def reset(self) -> None:
        self._sum = 0.0
        self._n = 0
        self._ref: list[float] = []
        self.mean = self.sd = math.nan
        self.up = self.down = 0.0

    @property
    def ready(self) -> bool:
        return not math.isnan(self.mean)

    def add(self, score: float) -> float | None:
        """One score; returns the chart's statistic when a batch closes and it crosses h, else None."""
        self._sum += score
        self._n += 1
        if self._n < self.batch:
            return None
        m = self._sum / self._n
        self._sum, self._n = 0.0, 0
        if not self.ready:
            self._ref.append(m)
            if len(self._ref) >= self.reference:
                n = len(self._ref)
                mu = sum(self._ref) / n
                var = sum((v - mu) ** 2 for v in self._ref) / (n - 1)
                # the reference mean's own error widens the spread a little (it is not known exactly)
                self.mean, self.sd = mu, max(math.sqrt(var * (1.0 + 1.0 / n)), 1e-9)
            return None
        z = (m - self.mean) / self.sd
        self.up = max(0.0, self.up + z - self.k)
        self.down = max(0.0, self.down - z - self.k)
        stat = max(self.up, self.down)
        return stat if stat > self.h else None


class AgreementCusum:
    """Bernoulli CUSUM on audit disagreements: log-likelihood ratio of rate p1 against the reference p0."""

    def __init__(self, arl0_audits: float, reference: int, p0_floor: float, factor: float, gap: float) -> None:
        self.h = math.log(arl0_audits)
        self.reference, self.p0_floor, self.factor, self.gap = reference, p0_floor, factor, gap
        self.reset()

    def reset(self) -> None:
        self._seen = self._bad = 0
        self.p0 = self.p1 = math.nan
        self.stat = 0.0
        self._up = self._down = 0.0

    @property
    def ready(self) -> bool:
        return not math.isnan(self.p0)

    def add(self, disagreed: bool) -> float | None:
        if not self.ready:
            self._seen += 1
            self._bad += disagreed
            if self._seen >= self.reference:
                n, k = self._seen, self._bad
                # an upper 90 % (Agresti-Coull) bound: an unlucky quiet reference must not make p0 too low
                z = 1.2816
                nt = n + z * z
                pt = (k + z * z / 2) / nt
                self.p0 = max(self.p0_floor, min(0.45, pt + z * math.sqrt(pt * (1 - pt) / nt)))
                self.p1 = min(0.5, max(self.factor * self.p0, self.p0 + self.gap))
                self._up = math.log(self.p1 / self.p0)
                self._down = math.log((1 - self.p1) / (1 - self.p0))
            return None
        self.stat = max(0.0, self.stat + (self._up if disagreed else self._down))
        return self.stat if self.stat > self.h else None


class ClassCusum:
    """Upper CUSUM of a batch's chi-square distance between its predicted-class counts and the reference.

    Per batch of B requests with counts n_c, G = 2 Σ n_c ln(n_c / (B p_c)) (the multinomial likelihood
    ratio of the batch's own frequencies against the reference p, learned from the first batches with
    add-one smoothing, divided by 1 + B/N_ref for the reference's own error) is about χ²(K-1) while nothing
    changes; its Wilson-Hilferty transform z is close to a standard normal and feeds a normal CUSUM whose h
    comes from Siegmund's approximation for the target ARL0. `tests/edge_agent/test_drift.py` measures the
    false alarms (A/A) and the delay on a class-prior shift.
    """

    def __init__(self, arl0_requests: float, batch: int, reference: int, k: float) -> None:
        self.batch, self.reference, self.k = batch, reference, k
        self.h = decision_interval(arl0_requests / batch, k)
        self.reset()

    def reset(self) -> None:
        self._counts: dict[int, int] = {}
        self._n = 0
        self._ref: dict[int, int] = {}
        self._ref_batches = 0
        self.p: dict[int, float] = {}
        self._unseen, self._dof, self._ref_n = 0.0, 1, 1.0
        self.stat = 0.0

    @property
    def ready(self) -> bool:
        return bool(self.p)

    def add(self, top: int) -> float | None:
        """One request's predicted class; the statistic when a batch closes and crosses h, else None."""
        self._counts[top] = self._counts.get(top, 0) + 1
        self._n += 1
        if self._n < self.batch:
            return None
        counts, n = self._counts, self._n
        self._counts, self._n = {}, 0
        if not self.ready:
            for c, m in counts.items():
                self._ref[c] = self._ref.get(c, 0) + m
            self._ref_batches += 1
            if self._ref_batches >= self.reference:
                k = max(len(self._ref), 2)
                total = sum(self._ref.values()) + k + 1  # add-one, and room for a class never seen
                self.p = {c: (m + 1) / total for c, m in self._ref.items()}
                self._unseen = 1 / total
                self._ref_n = float(total)
                self._dof = k - 1
            return None
        g = 2.0 * sum(m * math.log(m / (n * self.p.get(c, self._unseen))) for c, m in counts.items())
        g /= 1.0 + n / self._ref_n  # the reference's own sampling error inflates G by about this much
        d = self._dof  # Wilson-Hilferty: (G/d)^(1/3) is close to normal, so Siegmund's h holds for z
        z = ((max(g, 0.0) / d) ** (1.0 / 3.0) - (1.0 - 2.0 / (9.0 * d))) / math.sqrt(2.0 / (9.0 * d))
        self.stat = max(0.0, self.stat + z - self.k)
        return self.stat if self.stat > self.h else None


class DriftMonitor:
    """Both charts, the request clock, and the drift flag with its hold.

    Not thread-safe: one caller at a time (the agent feeds it from its fold).
    """

    def __init__(self, options: DriftOptions | None = None) -> None:
        self.options = o = options or DriftOptions()
        self.scores = ScoreCusum(o.score_arl0, o.score_batch, o.score_reference, o.score_k)
        self.agreement = AgreementCusum(o.audit_arl0, o.audit_reference, o.audit_p0_floor, o.audit_p1_factor,
                                        o.audit_p1_min_gap)
        self.classes = ClassCusum(o.classes_arl0, o.classes_batch, o.classes_reference, o.classes_k)
        self.requests = 0
        self.count = 0  # events since start (`events` keeps the last 32)
        self.events: list[DriftEvent] = []
        self._until = -1

    @property
    def flagged(self) -> bool:
        """Whether a drift event is recent (within `hold` requests)."""
        return self.requests <= self._until

    @property
    def last(self) -> DriftEvent | None:
        return self.events[-1] if self.events else None

    def score(self, value: float) -> DriftEvent | None:
        """One request's edge score (the configured one, whatever decides the escalation)."""
        self.requests += 1
        if not math.isfinite(value):
            return None
        stat = self.scores.add(value)
        if stat is None:
            return None
        return self._raise("score", stat, self.scores.h, self.scores.mean)

    def top_class(self, top: int) -> DriftEvent | None:
        """One request's predicted class (no labels: a changed class prior shows here first)."""
        stat = self.classes.add(top)
        if stat is None:
            return None
        return self._raise("classes", stat, self.classes.h, float(len(self.classes.p)))

    def audit(self, *, agreed: bool) -> DriftEvent | None:
        """One audit's outcome (the cloud's top-1 against the edge's on a confident answer)."""
        stat = self.agreement.add(not agreed)
        if stat is None:
            return None
        return self._raise("agreement", stat, self.agreement.h, self.agreement.p0)

    def _raise(self, kind: str, stat: float, h: float, ref: float) -> DriftEvent:
        event = DriftEvent(kind, self.requests, float(stat), float(h), float(ref), time.time())
        self.events = [*self.events[-31:], event]  # bounded
        self.count += 1
        self._until = self.requests + self.options.hold
        # both charts learn the new regime: one shift is one event, whichever chart saw it first
        self.scores.reset()
        self.agreement.reset()
        self.classes.reset()
        return event

    def to_json(self) -> dict[str, Any]:
        last = self.last
        return {"flagged": self.flagged, "events": self.count, "last": last.to_json() if last else None,
                "score_ready": self.scores.ready, "score_statistic": max(self.scores.up, self.scores.down),
                "score_threshold": self.scores.h, "agreement_ready": self.agreement.ready,
                "agreement_statistic": self.agreement.stat, "agreement_threshold": self.agreement.h,
                "classes_ready": self.classes.ready, "classes_statistic": self.classes.stat,
                "classes_threshold": self.classes.h}
