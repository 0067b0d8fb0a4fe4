"""The controller where budgets bind: windows held, energy headroom, a learned cloud, stable link state."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.budget import Budget, BudgetWindows
from edge_agent.controller import Conditions, Controller, ControllerConfig, Decision, choose, evaluate
from edge_agent.decide import switch_reason
from edge_agent.plan import predict
from edge_agent.profiles import LinkProfile, VariantProfile
from runtimes.errors import ConfigError

# 100 validation inputs cannot tell these rates apart (`decide.tied`, one standard error): the configs
# here judge ties exactly (`tie_z=0`), so that the known optima are the most accurate points
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
                   config=ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0), clock=clock)
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
    cfg = ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0)
    c = Controller([profile], Budget(latency_ms=50, energy_mj=1.32), link=link, config=cfg, clock=Clock())
    # 30 % escalation would spend 1.30 mJ, inside the budget but not inside its 1 % headroom
    assert c.current.predicted_energy_mj <= 1.32 * cfg.energy_headroom
    assert c.current.predicted_escalation_rate == pytest.approx(0.1)


def test_modeled_energy_noise_never_switches_the_variant_and_a_measured_difference_does() -> None:
    clock = Clock()
    c = Controller(twins(), Budget(latency_ms=50), link=None,
                   config=ControllerConfig(escalation_grid=GRID, tie_z=0.0, min_observations=5), clock=clock)
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


def test_timeouts_mark_the_link_down_only_when_they_are_news() -> None:
    clock = Clock()

    def timeout(lp: LinkProfile) -> tuple[str, ...]:  # one every 30 ms: twenty last the 0.5 s a partition needs
        clock.t += 0.03
        return lp.observe(None, ok=False, elapsed_ms=10.0, timeout=True)

    link = LinkProfile(rtt_ms=5.0, clock=clock)
    for _ in range(100):
        link.observe(4.0, ok=True)
    events = [timeout(link) for _ in range(19)]
    assert link.up
    assert not any(events)
    assert timeout(link) == ("down",)
    # a jittered link where three escalations in four miss the deadline: 25 in a row are its bad luck
    jittered = LinkProfile(rtt_ms=5.0, clock=clock)
    for i in range(200):
        jittered.observe(9.0 if i % 4 == 3 else None, ok=i % 4 == 3, elapsed_ms=10.0, timeout=i % 4 != 3)
    assert not any(timeout(jittered) for _ in range(25))
    assert jittered.up
    # down, it comes back after three answers, not necessarily in a row; a refusal restarts the count
    for ok in (True, False, True, False):
        link.observe(4.0 if ok else None, ok=ok, elapsed_ms=10.0, timeout=not ok)
    assert not link.up
    assert link.observe(4.0, ok=True) == ("up",)
    fast = LinkProfile(rtt_ms=5.0)
    assert [fast.observe(None, ok=False, elapsed_ms=0.5) for _ in range(3)][-1] == ("down",)
    for _ in range(2):
        fast.observe(4.0, ok=True)
    fast.observe(None, ok=False, elapsed_ms=0.5)  # refused again
    assert [fast.observe(4.0, ok=True) for _ in range(3)] == [(), (), ("up",)]


def test_agreement_overrides_the_cloud_prior_within_a_few_hundred_escalations() -> None:
    clock = Clock()
    profile = VariantProfile("v", SCORES, SCORES >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0, cloud_accuracy=0.95)
    c = Controller([profile], Budget(latency_ms=50), link=link,
                   config=ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0), clock=clock)
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
                    config=ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0), clock=clock)
    for _ in range(300):
        c2.observe_request(escalated=True, agreed=bool(rng.random() > 0.1), total_latency_ms=4.0,
                           score=float(rng.uniform(0.2, 0.99)))
    assert c2.link is not None
    assert 0.85 < c2.link.state().cloud_accuracy < 0.96


def test_while_the_cloud_is_down_the_controller_asks_for_more_probes() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0)
    cfg = ControllerConfig(escalation_grid=(0.0, 0.05, 0.1, 0.3), tie_z=0.0, probe_escalation_rate=0.03)
    c = Controller([profile], Budget(latency_ms=50), link=link, config=cfg, clock=Clock())
    for _ in range(3):  # refused at once: the cloud is down
        c.observe_escalation(None, ok=False, elapsed_ms=0.3)
    c.maybe_redecide()
    assert not link.up
    assert c.current.predicted_escalation_rate >= 0.1  # nothing gained by moving, and it probes
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
    cfg = ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0)
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
    assert c.current.predicted_escalation_rate == pytest.approx(0.5)


def test_one_slow_round_trip_on_a_steady_link_does_not_flip_the_decision() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.3, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0)
    cfg = ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0)
    clock = Clock()
    c = Controller([profile], Budget(latency_ms=10), link=link, config=cfg, clock=clock)
    for _ in range(100):
        c.observe_escalation(2.0, ok=True, bytes_sent=100)
    c.maybe_redecide()
    first = c.current.key
    assert c.current.predicted_escalation_rate == pytest.approx(0.5)
    c.observe_escalation(30.0, ok=True, bytes_sent=100)  # a load spike: the EWMA moves, the window keeps it small
    for _ in range(40):
        c.maybe_redecide()
        assert c.current.key == first
        c.observe_escalation(2.0, ok=True, bytes_sent=100)
        clock.t += 0.05


def test_a_switch_up_keeps_headroom_and_takes_the_best_point_that_has_it() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.5, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0, bytes_per_escalation=1000.0, energy_per_byte_mj=1e-3)
    cfg = ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0)
    clock = Clock()
    c = Controller([profile], Budget(latency_ms=50), link=link, config=cfg, clock=clock)
    per_escalation = (c.current.predicted_energy_mj - 1.0) / c.current.predicted_escalation_rate
    # an energy budget the most accurate point (half escalated) meets with less than 1 % to spare
    budget = Budget(latency_ms=50, energy_mj=(1.0 + 0.5 * per_escalation) / 0.99 / 0.995)
    c.set_budget(Budget(latency_ms=50, energy_mj=1.0 / 0.99))  # nothing but the edge fits
    assert c.current.predicted_escalation_rate == 0.0
    c.set_budget(budget)
    # not the best point, too close to the budget to move to for accuracy alone, but the best with room
    assert c.current.predicted_escalation_rate == pytest.approx(0.3)
    assert "to spare" in c.current.reason
    assert c.current.predicted_energy_mj <= 0.99 * c.current.inputs["energy_target_mj"]


def test_escalations_the_agents_timer_ends_inside_the_budget_need_no_headroom() -> None:
    """On a jittered link where 40 % of escalations miss a 15 ms budget, the agent abandons them at its own
    deadline (budget less a 1 ms guard): the tail they make ends there, so escalating every edge error stays
    inside the budget, and more. Priced at the whole budget with no timer, the same link allows only a tenth."""
    profile = VariantProfile("v", SCORES, SCORES >= 0.3, np.full(16, 0.5), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=6.0)
    for i in range(100):
        if i % 5 < 2:
            link.observe(None, ok=False, elapsed_ms=14.0, timeout=True)
        else:
            link.observe(6.0 + i % 3, ok=True, bytes_sent=100)
    assert link.up
    cfg, budget = ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0), Budget(latency_ms=15)
    paper = choose([profile], link.state(), budget, cfg)
    assert paper.predicted_escalation_rate == pytest.approx(0.1)
    timed = choose([profile], link.state(), budget, cfg, conditions=Conditions(deadline_guard_ms=1.0))
    assert timed.predicted_escalation_rate == pytest.approx(0.5)
    assert timed.feasible
    assert timed.inputs["deadline_ms"] == pytest.approx(14.0)
    assert timed.predicted_p95_ms <= 14.0 + 1e-9
    assert timed.predicted_accuracy > paper.predicted_accuracy + 0.05
    # windows over the budget tighten the timer with the plan
    tight = choose([profile], link.state(), budget, cfg, conditions=Conditions(deadline_guard_ms=1.0,
                                                                              latency_scale=0.8))
    assert tight.inputs["deadline_ms"] == pytest.approx(11.0)
    assert tight.predicted_p95_ms <= 11.0 + 1e-9


def test_a_variant_not_run_yet_is_priced_at_the_edge_time_predicted_for_it() -> None:
    """Its benchmark timed the bare session (0.04 ms, 0.6 mJ at 15 W); the agent's figures for the variant
    running now include its own overhead (0.16 ms): the prior is scaled to the same edge time."""
    fresh = VariantProfile("b", SCORES, SCORES >= 0.1, np.full(16, 0.04), 15 * 0.04, "modeled:test")
    cond = Conditions(edge_overhead_ms=0.16)
    p = predict(fresh, np.array([0.0]), None, Budget(latency_ms=50), cond)
    assert p.energy_mj[0] == pytest.approx(15 * 0.2, rel=1e-6)
    for _ in range(8):  # once it ran, its own figures stand
        fresh.observe_energy(2.5, "modeled:test")
    assert predict(fresh, np.array([0.0]), None, Budget(latency_ms=50), cond).energy_mj[0] == pytest.approx(2.5)


def test_energy_windows_cut_by_a_model_error_come_back_by_the_room_calm_windows_leave() -> None:
    held = BudgetWindows("mean", window_s=1.0, calm=3, max_loosen=1.25)
    t = 0.0
    for value in (12.0, 12.0, 5.0, 5.0, 5.0, 5.0):  # two windows over a budget of 8, then calm ones at 5
        for _ in range(10):
            held.add(t, value, 8.0)
            t += 0.1
    assert held.scale == pytest.approx(0.85 * 0.85 * 1.25)  # the room (0.9 x 8 / 5 = 1.44) capped at 1.25
    for _ in range(40):
        held.add(t, 5.0, 8.0)
        t += 0.1
    assert held.scale == 1.0
    slow = BudgetWindows("mean", window_s=1.0, calm=3)  # without max_loosen: the fixed 5 % step
    for value in (12.0, 5.0, 5.0, 5.0, 5.0):
        for _ in range(10):
            slow.add(t, value, 8.0)
            t += 0.1
    assert slow.scale == pytest.approx(0.85 * 1.05)


def test_the_p95_bisection_finds_what_a_full_cdf_table_finds() -> None:
    from edge_agent.plan import _mixture_quantile

    rng = np.random.default_rng(3)
    for _ in range(100):  # mixtures of an edge CDF with two escalation CDFs, at 40 escalation rates each
        edge, ok_ms, late_ms = (np.sort(rng.lognormal(m, s, rng.integers(3, n)))
                                for m, s, n in ((0.0, 0.4, 200), (2.0, 0.6, 400), (3.0, 0.1, 50)))
        share = float(rng.random())
        points = np.unique(np.concatenate([edge, ok_ms, late_ms]))
        f, g = (np.searchsorted(np.sort(p), points, side="right") / p.size for p in (edge, ok_ms))
        g = share * g + (1 - share) * np.searchsorted(late_ms, points, side="right") / late_ms.size
        w = np.concatenate([[0.0, 1.0], rng.random(38)])
        table = (1 - w)[:, None] * f[None, :] + w[:, None] * g[None, :]
        expected = points[np.argmax(table >= 0.95 - 1e-9, axis=1)]
        found = _mixture_quantile((edge, ok_ms, late_ms), (share, 1 - share), w, 0.95 - 1e-9)
        np.testing.assert_array_equal(found, expected)


def test_drifts_redecide_at_most_once_per_gap_but_the_cloud_going_down_at_once() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    clock = Clock()
    cfg = ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0, redecide_gap_s=0.25)
    c = Controller([profile], Budget(latency_ms=50), link=LinkProfile(rtt_ms=2.0), config=cfg, clock=clock)
    c._flag("round trip")
    c.maybe_redecide()
    assert c.redecisions == 1
    clock.t = 0.1
    c._flag("round trip")  # a drift 0.1 s later waits for the gap...
    c.maybe_redecide()
    assert c.redecisions == 1
    clock.t = 0.3
    c.maybe_redecide()  # ...and is decided once it has passed
    assert c.redecisions == 2
    clock.t = 0.35
    for _ in range(3):  # refusals: the cloud is down, which is decided at once
        c.observe_escalation(None, ok=False, elapsed_ms=0.3)
    c.maybe_redecide()
    assert c.redecisions == 3
    with pytest.raises(ConfigError, match="redecide_gap_s"):
        ControllerConfig(redecide_gap_s=-1.0)


def test_a_threshold_move_for_accuracy_must_beat_the_noise_of_the_fitted_cloud() -> None:
    profile = VariantProfile("v", SCORES, SCORES >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0, cloud_accuracy=0.95)
    cfg = ControllerConfig(escalation_grid=GRID, tie_z=0.0, probe_escalation_rate=0.0)
    budget = Budget(latency_ms=50)
    c = Controller([profile], budget, link=link, config=cfg, clock=Clock())

    def wide_and_narrow() -> tuple[Decision, Decision]:
        state = link.state()
        return evaluate(profile, 0.5, state, budget, cfg), evaluate(profile, 0.1, state, budget, cfg)

    wide, narrow = wide_and_narrow()
    # escalating forty more inputs the edge gets right gains little (the cloud's errors are where the
    # edge's are): 0.3 points; but the prior's 30 pseudo-observations leave the cloud's accuracy uncertain
    # by 4 points, 3 points over the forty escalations: the move is not made on that evidence
    assert wide.predicted_accuracy - narrow.predicted_accuracy == pytest.approx(0.0033, abs=5e-4)
    assert switch_reason(narrow, wide, cfg, noise=c._cloud_noise(narrow, wide)) == ""
    assert switch_reason(narrow, wide, cfg).startswith("accuracy")  # without the noise it would be
    with pytest.raises(ConfigError, match="accuracy_z"):
        ControllerConfig(accuracy_z=-1.0)
