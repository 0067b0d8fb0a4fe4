"""The strategies compared with the controller, and the hindsight oracle's choice.

Every strategy runs through the same real agent: a `Scripted` object stands where the controller
goes (the agent reads `current.variant` and `current.threshold` on every request), holding one
fixed (variant, threshold) per phase. Fixed 0.5 (Sedna's default), edge-only and cloud-only use
the same point in every phase; the oracle uses the best static point of each phase, chosen with
hindsight by `hindsight`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

NEVER, ALWAYS = -1.0, 2.0  # max-probability scores lie in [0, 1]


@dataclass(frozen=True)
class Point:
    variant: str
    threshold: float

    @property
    def key(self) -> tuple[str, float]:
        return self.variant, self.threshold


class Scripted:
    """A fixed (variant, threshold) per phase behind the controller interface; it ignores measurements."""

    link = None  # it keeps no view of the link (the agent's own is used for its skip rule)
    deadline_margin_ms: float | None = None

    def __init__(self, points: Sequence[Point]) -> None:
        self.points = list(points)
        self.current = self.points[0]

    def enter_phase(self, index: int) -> None:
        self.current = self.points[min(index, len(self.points) - 1)]

    def observe_inference(self, *args: Any, **kwargs: Any) -> None:
        pass

    def observe_escalation(self, *args: Any, **kwargs: Any) -> None:
        pass

    def observe_request(self, *args: Any, **kwargs: Any) -> None:
        pass

    def maybe_redecide(self) -> None:
        return None

    def deadline_scale(self) -> float:
        return 1.0  # a fixed strategy: escalations get the whole budget less the agent's guard

    def set_budget(self, budget: Any) -> None:
        return None


@dataclass(frozen=True)
class PhaseLatency:
    """What one phase's link did, measured live with cloud-only: extra latency of answered and of
    failed escalations over the edge, the share of escalations the cloud answered, and the mean
    energy an escalation added to a request."""

    answered_extra_ms: np.ndarray
    failed_extra_ms: np.ndarray
    success: float
    extra_mj: float = 0.0


def _p95_of_mixture(parts: Sequence[tuple[np.ndarray, float]]) -> float:
    values = np.concatenate([v for v, _ in parts if v.size])
    weights = np.concatenate([np.full(v.size, w / v.size) for v, w in parts if v.size])
    order = np.argsort(values)
    cdf = np.cumsum(weights[order]) / weights.sum()
    return float(values[order][np.searchsorted(cdf, 0.95 - 1e-12)])


def hindsight(idx: np.ndarray, scores: dict[str, np.ndarray], correct: dict[str, np.ndarray],
              cloud_correct: np.ndarray, edge_ms: dict[str, np.ndarray], link: PhaseLatency,
              latency_budget_ms: float, *, energy_budget_mj: float | None = None,
              edge_mj: dict[str, float] | None = None) -> tuple[Point, dict[str, float]]:
    """The most accurate static point on this phase's inputs whose p95 (and mean energy) fits the budget.

    Energy, when budgeted, is the variant's measured mean edge energy plus the escalated share times
    the energy an escalation added in this phase (both as the agent reported them).

    Accuracy is exact on the phase's inputs (escalations answered with the measured success
    share); p95 is that of the mixture of the measured edge latency of the variant and the
    measured escalation latency of the phase. Thresholds are the phase's own score quantiles.
    """
    grid = np.concatenate([np.arange(0, 0.1, 0.005), np.arange(0.1, 1.0001, 0.025)])
    best: tuple[float, float, Point, dict[str, float]] | None = None
    for v in scores:
        s, ok, cloud = scores[v][idx], correct[v][idx], cloud_correct[idx]
        srt = np.sort(s)
        edge = edge_ms[v]
        med = float(np.median(edge))
        for e in grid:
            k = round(e * s.size)
            t = NEVER if k == 0 else (ALWAYS if k >= s.size else float(srt[k]))
            esc = s < t
            rate = float(esc.mean())
            acc = float(np.where(esc, link.success * cloud + (1 - link.success) * ok, ok).mean())
            parts = [(edge, 1 - rate), (med + link.answered_extra_ms, rate * link.success),
                     (med + link.failed_extra_ms, rate * (1 - link.success))]
            p95 = _p95_of_mixture([(a, w) for a, w in parts if w > 0])
            if p95 > latency_budget_ms:
                continue
            energy = (edge_mj or {}).get(v, 0.0) + rate * link.extra_mj
            if energy_budget_mj is not None and energy > energy_budget_mj:
                continue
            key = (acc, -rate)
            if best is None or key > (best[0], best[1]):
                best = (acc, -rate, Point(v, t), {"accuracy": acc, "p95_ms": p95, "escalation": rate,
                                                  "energy_mj": energy})
    if best is None:  # nothing fits: the fastest variant, never escalating
        v = min(edge_ms, key=lambda k: float(np.quantile(edge_ms[k], 0.95)))
        return Point(v, NEVER), {"accuracy": float(correct[v][idx].mean()),
                                 "p95_ms": float(np.quantile(edge_ms[v], 0.95)), "escalation": 0.0}
    return best[2], best[3]
