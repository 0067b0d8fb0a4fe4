"""The controller where budgets bind: windows held, energy headroom, a learned cloud, stable link state."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.budget import Budget, BudgetWindows
from edge_agent.controller import Controller, ControllerConfig, evaluate
from edge_agent.profiles import LinkProfile, VariantProfile
from runtimes.errors import ConfigError

SCORES = np.arange(100) / 100
GRID = (0.0, 0.1, 0.3, 0.5)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def twins(energy: float = 1.0) -> list[VariantProfile]:
    """Two variants with the same validation answers and latency: only energy could tell them apart."""
    ok = SCORES >= 0.1
    return [VariantProfile(v, SCORES, ok, np.full(16, 2.0), energy, "modeled:test") for v in ("a", "b")]


def test_budget_windows_tighten_at_once_and_loosen_only_after_calm_windows() -> None:
    held = BudgetWindows("p95", window_s=1.0, calm=3)
    for i in range(10):  # one window over the budget
        assert not held.add(i / 10, 12.0, 10.0)
    assert held.add(1.0, 5.0, 10.0)  # the next window opens: the last one is judged
    assert held.scale == pytest.approx(0.85)
    changes = [held.add(1 + i / 10, 5.0, 10.0) for i in range(1, 41)]  # four calm windows
    assert sum(changes) == 1
    assert held.scale == pytest.approx(0.85 * 1.05)
    mean = BudgetWindows("mean", window_s=1.0)
    for i in range(11):
        mean.add(i * 0.1, 3.0 if i % 2 else 1.0, 1.9)  # mean 2.0 > 1.9 though half the values are under
    assert mean.scale < 1
    with pytest.raises(ConfigError, match="p95"):
        BudgetWindows("median")


def test_an_observed_window_over_the_budget_tightens_the_plan_and_a_new_budget_resets_it() -> None:
    clock = Clock()
    profile = VariantProfile("v", SCORES, SCORES >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    c = Controller([profile], Budget(latency_ms=10), link=LinkProfile(rtt_ms=2.0, rtt_high_ms=3.0),
                   config=ControllerConfig(escalation_grid=GRID, probe_escalation_rate=0.0), clock=clock)
    target = c.current.inputs["latency_target_ms"]
    for _ in range(22):  # the model says 3 ms round trips; requests took 14 ms
        c.observe_request(escalated=True, agreed=None, total_latency_ms=14.0)
        clock.t += 0.1
    c.maybe_redecide()
    assert any("observed p95 over budget" in d.trigger for d in c.decisions)
    assert c.current.inputs["latency_target_ms"] < target
    c.set_budget(Budget(latency_ms=10))
    assert c.current.inputs["latency_target_ms"] == pytest.approx(target)


def test_energy_is_planned_with_headroom() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0, bytes_per_escalation=1000.0, energy_per_byte_mj=1e-3)  # 1 mJ per escalation
    cfg = ControllerConfig(escalation_grid=GRID, probe_escalation_rate=0.0)
    c = Controller([profile], Budget(latency_ms=50, energy_mj=1.32), link=link, config=cfg, clock=Clock())
    # 30 % escalation would spend 1.30 mJ, inside the budget but not inside its 8 % headroom
    assert c.current.predicted_energy_mj <= 1.32 * cfg.energy_headroom
    assert c.current.predicted_escalation_rate == pytest.approx(0.1)


def test_modeled_energy_noise_never_switches_the_variant_and_a_measured_difference_does() -> None:
    clock = Clock()
    c = Controller(twins(), Budget(latency_ms=50), link=None,
                   config=ControllerConfig(escalation_grid=GRID, min_observations=5), clock=clock)
    first = c.current.variant
    other = "b" if first == "a" else "a"
    rng = np.random.default_rng(0)
    for _ in range(200):  # modeled figures (15 W x a noisy latency): the other variant looks 30 % cheaper
        for v, mean in ((first, 1.0), (other, 0.7)):
            c.observe_inference(v, 2.0, float(mean * rng.lognormal(0, 0.3)), energy_label="modeled:15W")
        c.observe_request(escalated=False, agreed=None, total_latency_ms=2.0, variant=first)
        clock.t += 0.05
        assert c.maybe_redecide() is None
    assert c.current.variant == first
    for _ in range(64):  # measured, steady: the other variant really spends 30 % less
        for v, mean in ((first, 1.0), (other, 0.7)):
            c.observe_inference(v, 2.0, float(mean * rng.normal(1, 0.02)), energy_label="measured:rapl")
        c.observe_request(escalated=False, agreed=None, total_latency_ms=2.0, variant=c.current.variant)
        clock.t += 0.05
        c.maybe_redecide()
    assert c.current.variant == other


def test_timeouts_mark_the_link_down_only_when_they_persist() -> None:
    link = LinkProfile(rtt_ms=5.0)
    events = [link.observe(None, ok=False, elapsed_ms=10.0, timeout=True) for _ in range(19)]
    assert link.up
    assert not any(events)
    assert link.observe(None, ok=False, elapsed_ms=10.0, timeout=True) == ("down",)
    fast = LinkProfile(rtt_ms=5.0)
    assert [fast.observe(None, ok=False, elapsed_ms=0.5) for _ in range(3)][-1] == ("down",)


def test_agreement_overrides_the_cloud_prior_within_a_few_hundred_escalations() -> None:
    clock = Clock()
    profile = VariantProfile("v", SCORES, SCORES >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0, cloud_accuracy=0.95)
    c = Controller([profile], Budget(latency_ms=50), link=link,
                   config=ControllerConfig(escalation_grid=GRID, probe_escalation_rate=0.0), clock=clock)
    rng = np.random.default_rng(1)
    for _ in range(300):  # escalated inputs the edge gets right; the cloud agrees on all but ~0.3 %
        c.observe_request(escalated=True, agreed=bool(rng.random() > 0.003), total_latency_ms=4.0,
                          score=float(rng.uniform(0.2, 0.99)))
    learned = link.state().cloud_accuracy
    assert learned > 0.99  # the 0.95 prior is gone
    # ...and a cloud that is wrong on a tenth of the inputs the edge is right on (2,000 validation inputs say so)
    many = np.linspace(0, 1, 2000, endpoint=False)
    profile = VariantProfile("v", many, many >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    c2 = Controller([profile], Budget(latency_ms=50), link=LinkProfile(rtt_ms=2.0, cloud_accuracy=0.999),
                    config=ControllerConfig(escalation_grid=GRID, probe_escalation_rate=0.0), clock=clock)
    for _ in range(300):
        c2.observe_request(escalated=True, agreed=bool(rng.random() > 0.1), total_latency_ms=4.0,
                           score=float(rng.uniform(0.2, 0.99)))
    assert c2.link is not None
    assert 0.85 < c2.link.state().cloud_accuracy < 0.96


def test_while_the_cloud_is_down_the_controller_asks_for_more_probes() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0)
    cfg = ControllerConfig(escalation_grid=(0.0, 0.05, 0.1, 0.3), probe_escalation_rate=0.03)
    c = Controller([profile], Budget(latency_ms=50), link=link, config=cfg, clock=Clock())
    for _ in range(3):  # refused at once: the cloud is down
        c.observe_escalation(None, ok=False, elapsed_ms=0.3)
    c.maybe_redecide()
    assert not link.up
    assert c.current.predicted_escalation_rate == pytest.approx(0.1)  # nothing gained, so the least that probes
    # a point that escalates less, kept from before the cloud went down, gives way to one that probes
    c2 = Controller([profile], Budget(latency_ms=50), link=LinkProfile(rtt_ms=2.0), config=cfg, clock=Clock())
    c2.current = c2._commit(evaluate(profile, profile.thresholds((0.0,))[0], c2.link.state(), c2.budget, cfg), "test")
    assert c2.current.predicted_escalation_rate == 0.0
    for _ in range(3):
        c2.observe_escalation(None, ok=False, elapsed_ms=0.3)
    d = c2.maybe_redecide()
    assert d is not None
    assert d.predicted_escalation_rate == pytest.approx(0.1)
    assert "probe" in d.reason


def test_escalations_cut_at_a_tight_deadline_do_not_price_a_looser_one() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=5.0)
    cfg = ControllerConfig(escalation_grid=GRID, probe_escalation_rate=0.0)
    c = Controller([profile], Budget(latency_ms=8), link=link, config=cfg, clock=Clock())
    for i in range(60):  # a jittered link: a third answered in 5 ms, the rest cut at the 8 ms deadline
        if i % 3:
            c.observe_escalation(None, ok=False, elapsed_ms=7.0, timeout=True)
        else:
            c.observe_escalation(5.0, ok=True, bytes_sent=100)
    assert link.up
    assert link.state().timely(50.0) < 0.5  # cut escalations count as never answered...
    loose, t = Budget(latency_ms=50), profile.thresholds((0.1,))[0]
    before = evaluate(profile, t, link.state(), loose, cfg).predicted_accuracy
    c.set_budget(loose)
    # ...until the deadline grows: they say nothing about 50 ms, and escalating the edge's errors pays more
    assert link.state().timely(50.0) == 1.0
    assert evaluate(profile, t, link.state(), loose, cfg).predicted_accuracy > before + 0.01
    assert c.current.predicted_escalation_rate == pytest.approx(0.1)


def test_one_slow_round_trip_on_a_steady_link_does_not_flip_the_decision() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.3, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0)
    cfg = ControllerConfig(escalation_grid=GRID, probe_escalation_rate=0.0)
    clock = Clock()
    c = Controller([profile], Budget(latency_ms=10), link=link, config=cfg, clock=clock)
    for _ in range(100):
        c.observe_escalation(2.0, ok=True, bytes_sent=100)
    c.maybe_redecide()
    first = c.current.key
    assert c.current.predicted_escalation_rate == pytest.approx(0.3)
    c.observe_escalation(30.0, ok=True, bytes_sent=100)  # a load spike: the EWMA moves, the window keeps it small
    for _ in range(40):
        c.maybe_redecide()
        assert c.current.key == first
        c.observe_escalation(2.0, ok=True, bytes_sent=100)
        clock.t += 0.05


def test_a_switch_up_keeps_headroom_and_takes_the_best_point_that_has_it() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.5, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0, bytes_per_escalation=1000.0, energy_per_byte_mj=1e-3)
    cfg = ControllerConfig(escalation_grid=GRID, probe_escalation_rate=0.0)
    clock = Clock()
    c = Controller([profile], Budget(latency_ms=50), link=link, config=cfg, clock=clock)
    per_escalation = (c.current.predicted_energy_mj - 1.0) / c.current.predicted_escalation_rate
    # an energy budget the most accurate point (half escalated) meets with less than 10 % to spare
    budget = Budget(latency_ms=50, energy_mj=(1.0 + 0.5 * per_escalation) / 0.92 / 0.97)
    c.set_budget(Budget(latency_ms=50, energy_mj=1.0 / 0.92))  # nothing but the edge fits
    assert c.current.predicted_escalation_rate == 0.0
    c.set_budget(budget)
    # not the best point, too close to the budget to move to for accuracy alone, but the best with room
    assert c.current.predicted_escalation_rate == pytest.approx(0.3)
    assert "to spare" in c.current.reason
    assert c.current.predicted_energy_mj <= 0.9 * c.current.inputs["energy_target_mj"]
