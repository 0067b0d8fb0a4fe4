"""A synthetic stream for the controller tests: held-out MNIST behind an 89 % edge model, in simulated time.

The validation scores are calibrated (an input scored s is right with probability s): 55 % are scored
0.99 or more, the rest spread below (mean 0.74). Shared by the decision-rule, encoding and burst tests.
"""

from __future__ import annotations

import numpy as np

from edge_agent.profiles import VariantProfile

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
