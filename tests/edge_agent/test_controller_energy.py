"""The energy plan's part calibrations (`evidence.PartCalibration`): observed over modeled energy of what
an escalation adds, learned on every request, moved only beyond its standard error, and forgotten as
the part's cost changes.

Each pair is one escalation: modeled 2 mJ of radio plus 0.3 W over a lognormal round trip around 5 ms
(one in twenty 10-30 ms), observed as the same escalation at the device's real waiting power and with
5 % measurement noise. Simulated, 100 seeds each (the statistics are stated where they are asserted).
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.evidence import PartCalibration, series_stderr
from runtimes.errors import ConfigError

SEEDS = 100


def pairs(rng: np.random.Generator, n: int, real_w: float) -> tuple[np.ndarray, np.ndarray]:
    spike = rng.random(n) < 0.05
    rtt = np.where(spike, rng.uniform(10, 30, n), 5.0 * rng.lognormal(0.0, 0.35, n))
    modeled = 2.0 + 0.3 * rtt
    observed = (2.0 + real_w * rtt) * rng.normal(1.0, 0.05, n)
    return observed, modeled


def feed(cal: PartCalibration, observed: np.ndarray, modeled: np.ndarray) -> tuple[np.ndarray, int]:
    """The scale after each pair, and how many times it moved."""
    scales, moves = np.empty(observed.size), 0
    for i, (o, m) in enumerate(zip(observed, modeled, strict=True)):
        moves += cal.add(float(o), float(m))
        scales[i] = cal.scale
    return scales, moves


def test_a_right_model_is_left_alone() -> None:
    """A/A: the model prices escalations right. Over 100 seeds of 2,000 escalations the scale moves a
    few times (measured: 0-5, 1.0 a run on average, each a re-plan) and never more than 3 % from 1
    (measured: at most 1.9 %, 1.4 % in 95 of 100): the noise rule keeps the window's noise from moving
    the plan far."""
    moves, worst = [], 0.0
    for seed in range(SEEDS):
        scales, n = feed(PartCalibration(), *pairs(np.random.default_rng(seed), 2000, 0.3))
        moves.append(n)
        worst = max(worst, float(np.abs(scales - 1).max()))
    assert worst < 0.03, worst
    assert np.mean(moves) < 2.0, np.mean(moves)


def test_a_model_wrong_by_a_fixed_power_is_learned_within_a_hundred_escalations_and_followed_when_it_changes() -> None:
    """A/B: the device draws 0.45 W more while waiting than modeled (the ratio about 1.7 on this link).
    In every seed the scale is within 5 % of the true ratio by the 100th escalation (power: 100 of 100,
    measured at most 3.7 % off; the first estimate comes at the 50th), and when the extra power goes
    away the scale is back within 5 % of 1 one window (256 escalations) later (measured: after 239
    escalations at the median, 248 at most)."""
    for seed in range(SEEDS):
        rng = np.random.default_rng(seed)
        (o1, m1), (o2, m2) = pairs(rng, 400, 0.75), pairs(rng, 400, 0.3)
        truth = float(o1.sum() / m1.sum())
        cal = PartCalibration()
        scales, _ = feed(cal, o1, m1)
        assert abs(scales[99] / truth - 1) < 0.05, (seed, scales[99], truth)
        assert abs(scales[-1] / truth - 1) < 0.05, (seed, scales[-1], truth)
        after, _ = feed(cal, o2, m2)
        assert abs(after[256] - 1) < 0.05, (seed, after[256])


def test_a_part_the_model_prices_at_nothing_says_nothing() -> None:
    cal = PartCalibration(window=8, min_pairs=2)
    for _ in range(8):
        assert not cal.add(0.0, 0.0)  # an escalation the breaker skipped
    assert cal.scale == 1.0
    assert cal.ratio() == 1.0
    with pytest.raises(ConfigError, match="min_pairs"):
        PartCalibration(window=8, min_pairs=9)


def test_a_spell_of_slow_inferences_widens_the_calibrations_standard_error() -> None:
    """A host slowed for a spell makes its inferences alike: the window's ratio swings with the spells, far
    beyond what independent values would let it. The standard error is the batch-means one then (blocks of
    32 consecutive pairs), about 4.8x the independent-values one here (measured 4.5-5.0 over these seeds); on
    independent values it stays near it (its median ratio 1.0, at most 1.56 over these seeds: eight blocks
    estimate a spread with seven degrees of freedom)."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        noise = rng.lognormal(0.0, 0.1, 256)
        iid = float(np.std(noise, ddof=1)) / np.sqrt(256)
        assert iid <= series_stderr(noise) <= 1.75 * iid
        spells = np.repeat(rng.permutation([1.0, 1.3] * 2), 64) * noise  # four spells of 64, two slow
        iid = float(np.std(spells, ddof=1)) / np.sqrt(256)
        assert series_stderr(spells) > 3 * iid
        cal = PartCalibration()
        for o in spells:
            cal.add(float(o) * 2.0, 2.0)
        assert cal.noise() > 3 * iid / float(np.mean(spells))
