"""Per-request observations: counters, recent latencies and round trips, and the controller's feed."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

logger = logging.getLogger(__name__)


class Observation(NamedTuple):
    """One request, as the agent saw it: appended on the hot path (a tuple underneath, immutable), folded
    into `Stats` and the controller by the agent's background task."""

    variant: str
    edge_ms: float
    edge_mj: float
    energy_mj: float
    energy_label: str
    rows: int
    wanted_rows: int  # rows below the threshold (0: no escalation wanted)
    tier: str  # "edge" or "cloud"
    degraded: bool
    reason: str
    # None exactly when nothing was sent (no escalation wanted, or it was skipped: breaker open, rate cap,
    # no time left, round trip too slow); otherwise the round trip, or how long a failure took
    rtt_ms: float | None
    bytes_sent: int
    agreed: bool | None  # the cloud's top-1 equalled the edge's on every escalated row (None: not comparable)
    total_ms: float
    cached: bool
    score: float


def feed_controller(ctl: Any, rec: Observation) -> None:
    """Report one observation to the controller: the inference, the escalation if one was wanted, the request."""
    if rec.cached:
        return
    rtt_ms = rec.rtt_ms
    try:
        ctl.observe_inference(rec.variant, rec.edge_ms, rec.edge_mj, energy_label=rec.energy_label)
        if rec.wanted_rows and (rtt_ms is not None or rec.degraded):
            ok = rec.tier == "cloud"
            # the agent told its link as the escalation ended: the controller takes the request size only
            ctl.observe_escalation(rtt_ms if ok else None, ok, rec.bytes_sent, elapsed_ms=rtt_ms,
                                   attempted=rtt_ms is not None, timeout=rec.reason == "timeout", fed=True)
        ctl.observe_request(bool(rec.wanted_rows), rec.agreed, rec.total_ms, score=rec.score, variant=rec.variant,
                            energy_mj=rec.energy_mj)
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
    cloud_refused: int = 0  # escalations sent and refused by a busy cloud (RESOURCE_EXHAUSTED / UNAVAILABLE)
    # answered escalations whose outputs could be compared (classification), and those where the cloud's
    # top-1 equalled the edge's: the agreement on escalated inputs
    escalations_compared: int = 0
    escalations_agreed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    energy_mj: float = 0.0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=2048))

    def add(self, rec: Observation) -> None:
        self.requests += 1
        self.rows += rec.rows
        self.escalations_wanted += rec.wanted_rows > 0
        self.escalations_sent += rec.rtt_ms is not None
        self.cloud_answers += rec.tier == "cloud"
        self.degraded += rec.degraded
        self.cache_hits += rec.cached
        self.cloud_refused += rec.reason == "cloud_busy" and rec.rtt_ms is not None
        self.energy_mj += rec.energy_mj
        if rec.agreed is not None and not rec.cached:
            self.escalations_compared += 1
            self.escalations_agreed += bool(rec.agreed)
        if rec.reason:
            self.reasons[rec.reason] = self.reasons.get(rec.reason, 0) + 1
        self.latencies.append(rec.total_ms)

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
                "late_replies": self.late_replies, "cloud_refused": self.cloud_refused, "reasons": dict(self.reasons),
                "escalations_compared": self.escalations_compared, "escalations_agreed": self.escalations_agreed,
                "agreement": (self.escalations_agreed / self.escalations_compared
                              if self.escalations_compared else None),
                "energy_mj_per_request": self.energy_mj / self.requests if self.requests else 0.0,
                "p50_ms": q[0], "p95_ms": q[1], "p99_ms": q[2]}
