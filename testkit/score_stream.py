"""A synthetic stream for the controller tests: held-out MNIST behind an 89 % edge model, in simulated time.

The validation scores are calibrated (an input scored s is right with probability s): 55 % are scored
0.99 or more, the rest spread below (mean 0.74). Shared by the decision-rule, encoding and burst tests.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edge_agent.budget import Budget
from edge_agent.controller import Controller
from edge_agent.profiles import LinkProfile, VariantProfile

N = 2000  # the validation split's size


class Clock:
    """A clock the test moves by hand (`clock.t += 0.01`), so a run takes no wall time."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def stream(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` scores and whether the edge answer is right for each, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    sure = rng.random(n) < 0.55
    scores = np.where(sure, 0.99 + 0.01 * rng.random(n), 0.99 * rng.beta(3.0, 1.0, n))
    return scores, rng.random(n) < scores


def profile() -> VariantProfile:
    """The edge model's profile from the validation stream (seed 0): 1 ms and 1 mJ a request, modeled."""
    scores, correct = stream(0, N)
    return VariantProfile("lr", scores, correct, np.full(16, 1.0), 1.0, "modeled:test")


def twins(clock: Clock) -> tuple[Controller, VariantProfile, VariantProfile]:
    """A controller over two variants alike in accuracy, "hot" and "cool" (the validation stream of seed 0, each
    benchmarked at 1 ms and 1 mJ, modeled), on a 4-ms link to a 0.999 cloud, with a 60-ms budget."""
    scores, correct = stream(0, N)
    hot = VariantProfile("hot", scores, correct, np.full(16, 1.0), 1.0, "modeled:test")
    cool = VariantProfile("cool", scores, correct, np.full(16, 1.0), 1.0, "modeled:test")
    lp = LinkProfile(rtt_ms=4.0, bytes_per_escalation=1000.0, energy_per_byte_mj=1e-3, wait_power_w=0.3,
                     cloud_accuracy=0.999, clock=clock)
    return Controller([hot, cool], Budget(latency_ms=60), link=lp, clock=clock), hot, cool


def run_twins(c: Controller, clock: Clock, *, edge_ms: float, edge_mj: float,
              each: Callable[[int], None] | None = None) -> None:
    """300 requests of the stream of seed 7 through `twins`' controller, the serving variant taking `edge_ms` and
    `edge_mj` (modeled) an inference, each escalation a 4-ms round trip answered by a 0.999 cloud (1 mJ of radio
    and 0.3 W while waiting); `each(i)` runs before each re-decision."""
    rng = np.random.default_rng(1)
    for i, (s, ok) in enumerate(zip(*stream(7, 300), strict=True)):
        escalated = s < c.current.threshold
        c.observe_inference(c.current.variant, edge_ms, edge_mj, energy_label="modeled:test")
        if escalated:
            c.observe_escalation(4.0, ok=True, bytes_sent=1000)
        agreed = bool(ok) == (rng.random() < 0.999) if escalated else None
        c.observe_request(escalated, agreed, edge_ms + 4.0 if escalated else edge_ms, score=float(s),
                          energy_mj=edge_mj + (1.0 + 0.3 * 4.0) * escalated)
        if each is not None:
            each(i)
        c.maybe_redecide()
        clock.t += 0.01


def serve(c: Controller, score: float, correct: bool, rng: np.random.Generator, *, rtt_ms: float,
          lost_ms: float | None = None, lost_total_ms: float = 0.0, radio_mj: float = 0.0,
          cloud: float = 0.999) -> bool:
    """One request through controller `c` on a simulated link (1 ms on the edge): escalated when `score` is
    under the threshold; answered after `rtt_ms` (right with probability `cloud`), or, with `lost_ms`, timed
    out after it, the request taking `lost_total_ms`; energy 1 mJ plus `radio_mj` per escalation. Whether it
    escalated."""
    escalated = bool(score < c.current.threshold)
    c.observe_inference("lr", 1.0, 1.0, energy_label="modeled:test")
    agreed, total = None, 1.0
    if escalated and lost_ms is not None:
        c.observe_escalation(None, ok=False, elapsed_ms=lost_ms, timeout=True)
        total = lost_total_ms
    elif escalated:
        c.observe_escalation(rtt_ms, ok=True, bytes_sent=1000)
        total, agreed = rtt_ms + 1.0, bool(correct) == (rng.random() < cloud)
    c.observe_request(escalated, agreed, total, score=float(score), energy_mj=1.0 + radio_mj * escalated)
    c.maybe_redecide()
    return escalated
