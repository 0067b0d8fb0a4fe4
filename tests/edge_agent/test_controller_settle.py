"""Settling: after a cold start or a change, the decision stops moving within 100 requests.

Simulated time, a simulated link whose round trips are noisy as on a loaded 2-core host (lognormal
around 4 ms with one in twenty a 10-30 ms spike), the MNIST-like stream of `test_decide`, 100
requests a second. The controller starts cold (the link's prior is 10 ms, no agreement seen) and
the budget is set as a phase begins. Before the rule weighed a move's predicted gain against the
standard error of its validation estimate (`ControllerConfig.gain_z`), it moved between thresholds
whose difference noise alone makes (the bench's free-escalation phase settled after 499 requests).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edge_agent.budget import Budget
from edge_agent.controller import Controller, ControllerConfig
from edge_agent.profiles import LinkProfile
from testkit.score_stream import Clock, profile, stream

REQUESTS = 1500  # 15 s at 100/s
SETTLE = 100  # requests: the check
CLOUD = 0.999  # the cloud's accuracy on what it is sent, as in test_decide


def rtt(rng: np.random.Generator) -> float:
    spike = rng.random() < 0.05
    return float(rng.uniform(10.0, 30.0) if spike else 4.0 * rng.lognormal(0.0, 0.35))


def settle(budget: Budget, seed: int, config: ControllerConfig | None = None) -> tuple[int, Controller, float]:
    """Requests after the budget was set until the decision's last move, the controller, the mean energy."""
    moves, c, energies = run(budget, seed, config)
    return (moves[-1] if moves else 0), c, float(energies.mean())


def run(budget: Budget, seed: int, config: ControllerConfig | None = None, *,
        extra_w: float = 0.0) -> tuple[list[int], Controller, np.ndarray]:
    """`settle`, with every move of the decision (requests after the budget was set) and each request's
    energy after it; `extra_w`: the power the device really draws while an escalation waits beyond what
    the link's model says (0.3 W)."""
    clock = Clock()
    lp = LinkProfile(bytes_per_escalation=1000.0, energy_per_byte_mj=1e-3, wait_power_w=0.3,
                     cloud_accuracy=0.99, clock=clock)
    c = Controller([profile()], Budget(latency_ms=60), link=lp, config=config, clock=clock)
    warm_scores, warm_correct = stream(seed + 1000, 200)
    rng = np.random.default_rng(seed + 50)
    for s, ok in zip(warm_scores, warm_correct, strict=True):  # a warm-up under a loose budget, as the bench's
        step(c, clock, float(s), bool(ok), rng, extra_w)
    c.set_budget(budget)
    scores, correct = stream(seed, REQUESTS)
    moves, point, energies = [], c.current.point, np.zeros(REQUESTS)
    for i, (s, ok) in enumerate(zip(scores, correct, strict=True)):
        energies[i] = step(c, clock, float(s), bool(ok), rng, extra_w)
        if c.current.point != point:
            moves.append(i + 1)
            point = c.current.point
    return moves, c, energies


def step(c: Controller, clock: Clock, s: float, ok: bool, rng: np.random.Generator, extra_w: float = 0.0) -> float:
    """One request through the controller; its energy (1 mJ inference, 1 mJ radio and 0.3 W waiting
    per escalation, plus `extra_w` the link's model does not know of)."""
    escalated = s < c.current.threshold
    c.observe_inference("lr", 1.0, 1.0, energy_label="modeled:test")
    mj = 1.0
    agreed = None
    if escalated:
        r = rtt(rng)
        c.observe_escalation(r, ok=True, bytes_sent=1000)
        mj += 1.0 + (0.3 + extra_w) * r
        agreed = ok == (rng.random() < CLOUD)
    c.observe_request(escalated, agreed, 1.0 + (r if escalated else 0.0), score=s, energy_mj=mj)
    c.maybe_redecide()
    clock.t += 0.01
    return mj


@pytest.mark.parametrize("seed", range(4))
def test_free_escalation_settles_within_100_requests_of_a_cold_start(seed: int) -> None:
    last, c, _ = settle(Budget(latency_ms=60), seed)
    assert last <= SETTLE, [(d.trigger, d.threshold, d.reason[:80]) for d in c.decisions]


def test_without_the_gain_error_the_rule_churns_between_tied_points() -> None:
    """The same runs weighing a move against the fitted cloud's noise alone (`gain_z=0`): the decision
    moves between thresholds whose difference the validation data cannot tell, long after the start
    (measured: seeds 1 and 2 moved after 607 and 1414 requests, for predicted gains of 0.05-0.08 points,
    as the bench's free-escalation phase did after 499)."""
    lasts = [settle(Budget(latency_ms=60), seed, replace(ControllerConfig(), gain_z=0.0))[0] for seed in range(4)]
    assert max(lasts) > 3 * SETTLE, lasts


def test_a_binding_energy_budget_settles_and_is_held_on_a_noisy_link() -> None:
    """An energy budget that binds, on the same noisy link: the point chosen as the budget is set stands
    (settled within 100 requests), and the mean is held and spent. The plan keeps `energy_noise_z`
    standard errors of its energy estimate below the target; the point then moves only when its estimate
    leaves a band of `energy_hold_z` (3) standard errors of that estimate and of its escalation share
    (`evidence.energy_hold`). Before, every re-decision judged the point by the estimate of the moment: a
    "round trip slower" cut the round trips to the last 32 (a spell of spikes) and the point moved down,
    then back up with the next "faster": seeds 0, 2, 3 and 4 moved again 361-1213 requests after the budget
    was set, as the bench's energy phase settled after 307 and 627. Measured over seeds 0-19: 19 runs never
    moved after the budget's decision (one after 599 requests); the means 0.92-1.015 of the budget, 0.97
    over the twenty (seeds 0-5: 0.925-1.006, 0.98). A run's mean is held within 3 % (1.4 standard errors of
    a 1,500-request mean here), the six runs' within the budget."""
    budget = Budget(latency_ms=60, energy_mj=2.2)
    means = []
    for seed in range(6):
        moves, c, energies = run(budget, seed)
        assert not moves or moves[-1] <= SETTLE, (seed, moves, [(d.trigger, d.threshold) for d in c.decisions])
        assert c.current.binding == "energy"
        means.append(float(energies.mean()))
        assert 0.9 * 2.2 <= means[-1] <= 1.03 * 2.2, (seed, means)
    assert np.mean(means) <= 2.2, means


def test_an_energy_budget_set_after_a_warm_up_starts_calibrated_when_the_model_misprices_escalations() -> None:
    """The device draws 0.45 W more while an escalation waits than the link's model says (as the
    bench's host did: an escalated request 17.2 mJ against a modeled 14.7), and the energy budget is
    set only after a warm-up without one. What each escalation adds is calibrated against what the
    model charges it on every request, budget or not, so the budget starts calibrated: the decision
    settles as the budget is set, and the point it chose holds for more than 300 requests (the old
    calibration of the whole request, fed only under a budget, moved it at its 200th request in every
    seed and again after 360-960). The mean energy is within the budget: per run within 3 % (1.4
    standard errors of a 1,500-request mean here), over the six runs within it. Measured over seeds
    0-5: the first move after 506-1308 requests or none (two runs); these later moves follow the noisy
    link's round trips ('round trip slower', the window's mean round trip), as they do with the model
    right; the means 0.95-1.02 of the budget, 0.99 over the six. Seeds 6-19: first moves after 378
    requests or more (seven runs none), means 0.92-1.02. Since a point moves only when its estimate leaves
    the band its noise makes (`ControllerConfig.energy_over_z`, `energy_hold_z`), none of seeds 0-5 moves
    after the budget is set (seeds 0-11: one, after 1122 requests); the means 0.91-1.032, 0.99 over the six:
    per run within 4 % (2 standard errors of a 1,500-request mean), over the six within the budget."""
    budget = Budget(latency_ms=60, energy_mj=2.2)
    means = []
    for seed in range(6):
        moves, c, energies = run(budget, seed, extra_w=0.45)
        assert not moves or moves[0] > 3 * SETTLE, (seed, moves, [(d.trigger, d.threshold) for d in c.decisions])
        assert c.current.binding == "energy"
        assert 1.8 < c._energy.escalation.scale < 2.0  # (1 + 0.75 W x 5 ms) / (1 + 0.3 W x 5 ms): about 1.9
        means.append(float(energies.mean()))
        assert means[-1] <= 1.04 * 2.2, (seed, means)
    assert np.mean(means) <= 2.2, means


@pytest.mark.parametrize("seed", range(3))
def test_a_budget_set_just_under_the_current_point_moves_it_inside_at_once(seed: int) -> None:
    """An energy budget set 3 % under what the point chosen without one spends: within the 5 % a point may
    stand over a budget it was chosen under (`violation_tolerance`, against the estimate's noise). A point
    chosen under another budget has no such claim: the decision moves inside the new budget as it is set.
    Before, it stood over it until the estimate drifted past the tolerance: in `run`'s seed 2 under a budget 3 %
    under the mean energy spent without one, 202 requests, the first hundred spending 1.10 of the budget."""
    clock = Clock()
    lp = LinkProfile(bytes_per_escalation=1000.0, energy_per_byte_mj=1e-3, wait_power_w=0.3,
                     cloud_accuracy=0.99, clock=clock)
    c = Controller([profile()], Budget(latency_ms=60), link=lp, clock=clock)
    rng = np.random.default_rng(seed + 50)
    for s, ok in zip(*stream(seed + 1000, 300), strict=True):
        step(c, clock, float(s), bool(ok), rng)
    free = c.current
    budget = Budget(latency_ms=60, energy_mj=0.97 * free.predicted_energy_mj)
    c.set_budget(budget)
    assert c.current.key != free.key, c.current.reason
    assert c.current.predicted_energy_mj <= budget.energy_mj, c.current.reason
    assert c.current.binding == "energy"
