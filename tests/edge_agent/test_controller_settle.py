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
    clock = Clock()
    lp = LinkProfile(bytes_per_escalation=1000.0, energy_per_byte_mj=1e-3, wait_power_w=0.3,
                     cloud_accuracy=0.99, clock=clock)
    c = Controller([profile()], Budget(latency_ms=60), link=lp, config=config, clock=clock)
    warm_scores, warm_correct = stream(seed + 1000, 200)
    rng = np.random.default_rng(seed + 50)
    for s, ok in zip(warm_scores, warm_correct, strict=True):  # a warm-up under a loose budget, as the bench's
        step(c, clock, float(s), bool(ok), rng)
    c.set_budget(budget)
    scores, correct = stream(seed, REQUESTS)
    last, point, energy = 0, c.current.point, 0.0
    for i, (s, ok) in enumerate(zip(scores, correct, strict=True)):
        energy += step(c, clock, float(s), bool(ok), rng)
        if c.current.point != point:
            last, point = i + 1, c.current.point
    return last, c, energy / REQUESTS


def step(c: Controller, clock: Clock, s: float, ok: bool, rng: np.random.Generator) -> float:
    """One request through the controller; its energy (1 mJ inference, 1 mJ radio and 0.3 W waiting
    per escalation)."""
    escalated = s < c.current.threshold
    c.observe_inference("lr", 1.0, 1.0, energy_label="modeled:test")
    mj = 1.0
    agreed = None
    if escalated:
        r = rtt(rng)
        c.observe_escalation(r, ok=True, bytes_sent=1000)
        mj += 1.0 + 0.3 * r
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


def test_a_binding_energy_budget_is_held_on_a_noisy_link() -> None:
    """An energy budget that binds, on the same noisy link: the mean is held and spent. The plan keeps
    `energy_noise_z` standard errors of its energy estimate below the target. Measured over seeds 0-5:
    the mean 0.92-0.99 of the budget; two runs settled at once, four moved again 870-1340 requests
    after the budget was set (the 100-request settling is not met with an energy budget that binds:
    a wider band settles more runs but spends less than 95 % of the budget in `test_decide`)."""
    budget = Budget(latency_ms=60, energy_mj=2.2)
    for seed in range(6):
        _, c, energy = settle(budget, seed)
        assert c.current.binding == "energy"
        assert 0.9 * 2.2 <= energy <= 2.2
