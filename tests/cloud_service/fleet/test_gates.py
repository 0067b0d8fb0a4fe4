"""The rollout gates' error rates in simulation: A/A false alarms over many looks stay under alpha; A/B
regressions of the margin's size are caught at the canary. Windows come from testkit/gate_sim.py
(per-device levels and noise, uneven traffic, shared-load spikes hitting both arms)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from cloud_service.fleet.gates import SPECS, Arms, Evidence, Margins, evaluate, failed, judge, open_gates, window_counts
from cloud_service.fleet.sequential import Obs, did
from cloud_service.protocol.fleet_docs import parse_telemetry
from runtimes.errors import ConfigError
from testkit.gate_sim import Fleet, Model, run_rollout

SPEC = {s.name: s for s in SPECS}


def _looks(fleet: Fleet, gates: list[str], *, alpha: float, windows: int = 40, every: int = 2,
           baseline: int = 30, block_s: float = Evidence().block_s) -> dict[str, int | None]:
    """Device 0 is the wave (from window `baseline` on), the rest the control: the first look (window count)
    at which each gate failed, None if never."""
    ev = Evidence(bucket_s=fleet.model.window_s, baseline_s=1e9, block_s=block_s)
    hist: list[list[dict[str, Any]]] = [[] for _ in range(fleet.n)]
    first: dict[str, int | None] = dict.fromkeys(gates)
    pre_w: list[dict[str, Any]] = []
    pre_c: list[dict[str, Any]] = []
    cache: dict[Any, list[Obs]] = {}
    for k in range(baseline + windows):
        t = (k + 1) * fleet.model.window_s
        for i in range(fleet.n):
            hist[i].append(fleet.window(i, t, i == 0 and k >= baseline))
        if k == baseline - 1:
            pre_w, pre_c = hist[0][:], [x for h in hist[1:] for x in h]
        if k < baseline or (k - baseline + 1) % every:
            continue
        arms = Arms(pre_w, hist[0][baseline:], pre_c, [x for h in hist[1:] for x in h[baseline:]])
        for g in gates:
            if first[g] is None and judge(SPEC[g], arms, margins=Margins(), evidence=ev, alpha_gate=alpha,
                                          cache=cache)["decision"] == "fail":
                first[g] = k - baseline + 1
    return first


def test_aa_false_alarms_over_many_looks_stay_under_alpha() -> None:
    """100 A/A canaries, 10 looks each, a generous alpha = 0.05 per gate so that the rate is measurable."""
    alpha, runs = 0.05, 100
    gates = ["escalation_rate", "agreement", "p95_vs_control", "energy_per_request"]
    alarms = dict.fromkeys(gates, 0)
    for seed in range(runs):
        got = _looks(Fleet(12, seed), gates, alpha=alpha, every=4)
        for g in gates:
            alarms[g] += got[g] is not None
    assert all(a / runs <= alpha for a in alarms.values()), alarms


@pytest.mark.parametrize(("regression", "gate", "windows"), [
    ("p95+30%", "p95_vs_control", 90), ("energy+10%", "energy_per_request", 60), ("accuracy-2", "agreement", 60)])
def test_ab_a_margin_sized_regression_is_caught_at_the_canary(regression: str, gate: str, windows: int) -> None:
    """At the rollout's own alpha per gate (0.01 over 6 gates x 4 waves), within 60 windows of a 20/s canary
    (p95 and energy fail on 10 windows at the earliest; a device's own slow swings cost p95 more: 90), at least
    80 % of 30 runs, with 20 minutes of baseline (a device's level before the wave is as unsure as its swings)."""
    alpha = Evidence().alpha_gate(4)
    model = Model(rate_rps=20, traffic_sd=0.0)
    runs, caught, at = 30, 0, []
    for seed in range(runs):
        got = _looks(Fleet(12, 100 + seed, model, regression), [gate], alpha=alpha, windows=windows,
                     baseline=120)[gate]
        caught += got is not None
        at += [got] if got is not None else []
    assert caught / runs >= 0.8, (caught, at)


def test_a_device_swinging_on_its_own_is_not_a_regression() -> None:
    """Devices whose p95 swings on its own for tens of seconds (0.35 sd on the log, 30 s: five agents on two
    shared cores): A/A canaries stay under alpha once a device's windows within two minutes are one cluster;
    counted window by window, as if independent, they alarm several times as often."""
    alpha, runs = 0.05, 40
    model = Model(rate_rps=20, traffic_sd=0.0, swing_sd=0.35, swing_s=30.0)
    gates = ["p95_vs_control", "energy_per_request"]
    alarms = {"clustered": 0, "each window alone": 0}
    for seed in range(runs):
        for name, block in (("clustered", Evidence().block_s), ("each window alone", 1.0)):
            got = _looks(Fleet(12, 500 + seed, model), gates, alpha=alpha, every=4, block_s=block)
            alarms[name] += any(v is not None for v in got.values())
    assert alarms["clustered"] <= alpha * runs, alarms
    assert alarms["each window alone"] >= 3 * max(1, alarms["clustered"]), alarms


def test_a_flipped_class_is_stopped_at_the_audited_canary() -> None:
    """A release whose extra errors are mostly confident (one class flipped: 1.75 of its 3 points never
    escalate) is stopped in the canary wave, which audits half its confident answers: the whole-stream gate
    (escalations plus audits against the control's 1 %) holds the wave until it passes or fails."""
    model = Model(rate_rps=30, traffic_sd=0.3)
    for seed in range(3):
        out = run_rollout(Fleet(40, 300 + seed, model, "flip-class"), waves=("1", "25%", "100%"), max_soak_windows=60)
        assert (out.result, out.wave) == ("rolled_back", 0), out


def test_shared_load_and_device_levels_cancel() -> None:
    """A spike hitting every device and a canary twice as slow as the fleet: no effect is estimated."""
    def obs(dev: str, ts: float, v: float) -> Obs:
        return Obs(dev, ts, 1.0, math.log(v))

    spike = {t: (3.0 if t % 7 == 0 else 1.0) for t in range(60)}
    pre_w = [obs("w", t, 10.0 * (1 + 0.01 * (t % 3))) for t in range(30)]
    post_w = [obs("w", t, 10.0 * spike[t] * (1 + 0.01 * (t % 3))) for t in range(30, 60)]
    pre_c = [obs(f"c{i}", t, 5.0 * (1 + 0.01 * ((t + i) % 3))) for i in range(5) for t in range(30)]
    post_c = [obs(f"c{i}", t, 5.0 * spike[t] * (1 + 0.01 * ((t + i) % 3))) for i in range(5) for t in range(30, 60)]
    est = did(pre_w, post_w, pre_c, post_c, bucket_s=1.0)
    assert est is not None
    assert abs(est.delta) < 0.01
    assert est.radius(0.001, 30) < math.log(1.1)
    pooled = (sum(math.exp(o.value) for o in post_w) / len(post_w)) / (
        sum(math.exp(o.value) for o in post_c) / len(post_c))
    assert pooled > 1.9  # what a ratio of pooled figures would have called a regression


def test_the_record_keeps_each_tests_statistic_evidence_and_threshold() -> None:
    fleet = Fleet(30, 7, Model(rate_rps=30, traffic_sd=0.0), "p95+30%")
    out = run_rollout(fleet, waves=("1", "100%"), max_soak_windows=40)
    assert out.result == "rolled_back"
    assert out.wave == 0
    assert out.gates == ["p95_vs_control"]
    arms = Arms([], [], [], [])
    gates = evaluate(arms, margins=Margins(), evidence=Evidence(), waves=4, budget_ms=None, device_failures={},
                     crashes=0, fleet_request_rate=None, cloud_capacity_rps=None)
    assert {g["gate"]: g["decision"] for g in gates}["escalation_rate"] is None  # no data: not judged, not open


def test_aa_rollouts_complete_and_regressions_stop_at_the_canary() -> None:
    model = Model(rate_rps=30, traffic_sd=0.3)
    aa = [run_rollout(Fleet(40, s, model), waves=("1", "25%", "100%"), max_soak_windows=50) for s in range(4)]
    assert [o.result for o in aa] == ["succeeded"] * 4, aa
    bad = run_rollout(Fleet(40, 11, model, "accuracy-2"), waves=("1", "25%", "100%"), max_soak_windows=50)
    assert (bad.result, bad.wave) == ("rolled_back", 0), bad
    assert "agreement" in bad.gates


def test_hard_gates_and_window_counts() -> None:
    gates = evaluate(None, margins=Margins(), evidence=Evidence(), waves=4, budget_ms=25.0,
                     device_failures={"d1": "refused: bad signature"}, crashes=1, fleet_request_rate=None,
                     cloud_capacity_rps=None)
    assert set(failed(gates)) == {"device_verifies", "crashes"}
    assert all(g["decision"] is None for g in gates if g["gate"] in SPEC)  # no control: not judged
    def counts(**doc: object) -> dict[str, object]:
        return window_counts(parse_telemetry({"device": "d", "boot_id": "b", "seq": 1, "ts": 0.0, **doc}))

    assert counts(tiers={"edge": 80, "cloud": 20}) == {"compared": 20}
    assert counts(compared=15, audits=4, audit_disagreed=1, audit_rate=0.05) == {
        "compared": 15, "audits": 4, "audit_disagreed": 1, "audit_rate": 0.05}
    assert window_counts(None) == {"compared": 0}  # a stored document that no longer parses
    assert counts(compared=3, audited=10, audit_agreement=0.8) == {"compared": 3, "audits": 10, "audit_disagreed": 2}
    with pytest.raises(ConfigError, match="alpha"):
        Evidence(alpha=0.0)
    with pytest.raises(ConfigError, match="margin"):
        replace(Margins(), p95_ratio=-1.0)
    with pytest.raises(ConfigError, match="canary_share"):
        Evidence(canary_share=1.0)


def test_alpha_is_spent_half_at_the_canary_and_never_over_the_whole_rollout() -> None:
    ev, gates = Evidence(), len(SPECS)
    per_wave = [ev.alpha_gate(4, w) * gates for w in range(4)]
    assert per_wave[0] == pytest.approx(ev.alpha / 2)  # the canary, where a regression should be stopped
    assert per_wave[1] == per_wave[2] == per_wave[3] == pytest.approx(ev.alpha / 6)
    assert sum(per_wave) == pytest.approx(ev.alpha)  # the union bound over every gate and wave
    assert ev.alpha_gate(1, 0) * gates == pytest.approx(ev.alpha)  # one wave spends all of it
    assert ev.alpha_gate(4) == min(ev.alpha_gate(4, w) for w in range(4))  # no wave named: the least
    assert Evidence(canary_share=0.25).alpha_gate(4, 0) == pytest.approx(Evidence(canary_share=0.25).alpha_gate(4, 3))
    # within a wave, split over the gates by the evidence each needs: p95 the most, the 5-point rates the least
    for w in range(4):
        assert sum(ev.alpha_gate(4, w, g) for g in SPEC) == pytest.approx(per_wave[w])
    assert ev.alpha_gate(4, 0, "p95_vs_control") == pytest.approx(3 * ev.alpha_gate(4, 0))
    assert ev.alpha_gate(4, 0, "escalation_rate") == pytest.approx(ev.alpha_gate(4, 0) / 4)
    recorded = evaluate(None, margins=Margins(), evidence=ev, waves=4, wave=0, budget_ms=None, device_failures={},
                        crashes=0, fleet_request_rate=None, cloud_capacity_rps=None)
    assert sum(g["alpha"] for g in recorded if g["gate"] in SPEC) == pytest.approx(ev.alpha / 2)


def test_rollout_show_prints_the_capacity_the_gate_was_judged_against() -> None:
    from cloud_service.fleet.rollout_cli import format_rollout

    gates = evaluate(None, margins=Margins(), evidence=Evidence(), waves=2, budget_ms=None, device_failures={},
                     crashes=0, fleet_request_rate=100.0, cloud_capacity_rps=400.0)
    shown = {"id": 3, "state": "running", "release": "sha256:ab", "previous": None, "selector": "*",
             "states": {"assigned": 1}, "reason": "", "decisions": [],
             "options": {"soak": {"requests": 50}, "max_soak": {"seconds": 1800}, "cloud_capacity_rps": None,
                         "evidence": {"alpha": 0.01}},
             "waves": [{"idx": 0, "spec": "1", "size": 1, "state": "soaking", "devices": {"assigned": 1},
                        "gates": gates, "figures": {"control_kind": None}}]}
    text = format_rollout(shown)
    assert "cloud capacity 400 escalations/s" in text  # the fleet's --cloud-capacity, as the gate judged it
    assert "alpha 0.01 per rollout" in text


def test_a_wave_with_no_windows_yet_is_held_not_passed() -> None:
    """A canary soaked its requests before its first window on the release arrived: every statistical gate is
    open (it holds the wave), not unjudged (which would let the wave pass on its soak alone)."""
    fleet = Fleet(6, 3)
    pre = [fleet.window(i, 10.0 * (k + 1), False) for k in range(20) for i in range(6)]
    arms = Arms([w for w in pre if w["device_id"] == fleet.ids[0]], [],
                [w for w in pre if w["device_id"] != fleet.ids[0]], [])
    gates = evaluate(arms, margins=Margins(), evidence=Evidence(), waves=4, budget_ms=None, device_failures={},
                     crashes=0, fleet_request_rate=None, cloud_capacity_rps=None)
    decisions = {g["gate"]: g["decision"] for g in gates if g["gate"] in SPEC}
    assert decisions == {**dict.fromkeys(SPEC, "open"), "audit_agreement": None}, decisions
    assert open_gates(gates) == [g for g in SPEC if g != "audit_agreement"]


def test_a_wave_whose_devices_have_no_baseline_is_held_not_passed() -> None:
    """Every device of the wave took the previous release too recently to have a baseline on it (fewer windows
    than a baseline needs): the wave's windows on the release cannot be judged against anything, so each
    statistical gate is open and the wave follows its on_inconclusive policy at its maximum soak, instead of
    passing on its soak alone."""
    fleet = Fleet(6, 3)
    canary = fleet.ids[0]
    pre = [fleet.window(i, 10.0 * (k + 1), False) for k in range(20) for i in range(6)]
    post = [fleet.window(i, 200.0 + 10.0 * (k + 1), i == 0) for k in range(30) for i in range(6)]
    arms = Arms([w for w in pre if w["device_id"] == canary][-2:], [w for w in post if w["device_id"] == canary],
                [w for w in pre if w["device_id"] != canary], [w for w in post if w["device_id"] != canary])
    gates = evaluate(arms, margins=Margins(), evidence=Evidence(), waves=4, budget_ms=None, device_failures={},
                     crashes=0, fleet_request_rate=None, cloud_capacity_rps=None)
    decisions = {g["gate"]: g["decision"] for g in gates if g["gate"] in SPEC}
    # the audits alone are not judged: a wave without an audit baseline could never be, and an audited one
    # would wait on them for its whole maximum soak (the whole-stream figure is then the agreement gate's)
    assert decisions == {**dict.fromkeys(SPEC, "open"), "audit_agreement": None}, decisions
    assert set(open_gates(gates, audited=True)) == set(SPEC) - {"audit_agreement"}
