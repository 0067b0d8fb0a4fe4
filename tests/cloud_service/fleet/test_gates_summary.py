"""The simulator's summary of many rollouts: the false-rollback rate comes with its exact 95 % interval, and
each held or late-rolled-back run says where it stopped and on which gates."""

from __future__ import annotations

import pytest

from testkit.gate_sim import Outcome, rate_interval, summary


@pytest.mark.parametrize(("k", "n", "lower", "upper"), [
    (1, 100, 0.000253, 0.054459),  # one false rollback in 100 runs: the rate may well be 5 %
    (0, 300, 0.0, 0.012221),  # none in 300: under 1.22 %
    (5, 50, 0.033275, 0.218135),
    (10, 10, 0.691503, 1.0),
])
def test_the_rate_interval_is_the_exact_binomial_one(k: int, n: int, lower: float, upper: float) -> None:
    got = rate_interval(k, n)
    assert got == pytest.approx((lower, upper), abs=2e-6)


def test_the_summary_names_where_runs_held_or_rolled_back_late() -> None:
    runs = [Outcome("succeeded", 3, [], 2000, [2000, 3000, 5000, 9000], 20),
            Outcome("held", 3, ["p95_vs_control"], 2100, [2100, 3100, 5100, 90000], 60),
            Outcome("rolled_back", 2, ["energy_per_request"], 1900, [1900, 2500, 400], 30),
            Outcome("rolled_back", 0, ["agreement"], 1500, [1500], 9)]
    got = summary(runs)
    assert (got["succeeded"], got["held"], got["rolled_back"], got["stopped_at_canary"]) == (1, 1, 2, 1)
    assert got["held_at"] == ["wave 3: p95_vs_control"]
    assert got["rolled_back_at"] == ["wave 2: energy_per_request"]
    assert got["rolled_back_ci95"] == [round(v, 5) for v in rate_interval(2, 4)]
