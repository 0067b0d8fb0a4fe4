"""Baselines of unequal spans: a control device on the release for a few windows (an earlier wave's) beside wave
devices with an hour before the wave. Shared load that one of the short baseline's windows saw must not become
an effect of the release."""

from __future__ import annotations

import math

import numpy as np

from cloud_service.fleet.gates import SPECS, Arms, Evidence, Margins, baseline_errors, judge
from cloud_service.fleet.sequential import Obs, baseline_se, baselines, did

BUCKET_S = 10.0
SPIKE = math.log(2.0)  # a shared-load spike: every device's p95 doubles for one window


def _log_p95(seed: int, *, spike_at: int, wave: int = 20, control: int = 5, hour: int = 60, short: int = 6,
             post: int = 30, sd: float = 0.02) -> tuple[list[Obs], list[Obs], list[Obs], list[Obs]]:
    """(pre_wave, post_wave, pre_control, post_control) log p95 windows of an A/A: device levels differ, the
    spike hits every device in window `spike_at` (counted from the first window of the hour), and the control's
    baselines are only the last `short` windows before the wave."""
    rng = np.random.default_rng(seed)
    level = rng.normal(1.6, 0.3, wave + control)

    def obs(i: int, k: int) -> Obs:
        return Obs(f"d{i}", (k + 1) * BUCKET_S, 1.0, float(level[i] + (SPIKE if k == spike_at else 0.0)
                                                         + rng.normal(0, sd)))

    pre_w = [obs(i, k) for i in range(wave) for k in range(hour)]
    pre_c = [obs(i, k) for i in range(wave, wave + control) for k in range(hour - short, hour)]
    post_w = [obs(i, k) for i in range(wave) for k in range(hour, hour + post)]
    post_c = [obs(i, k) for i in range(wave, wave + control) for k in range(hour, hour + post)]
    return pre_w, post_w, pre_c, post_c


def test_a_spike_in_a_short_control_baseline_is_not_an_effect() -> None:
    """The spike falls in the control's six baseline windows (and in the wave's hour, where it is one of 60):
    with raw means as baselines the estimate is about log 2 x (1/6 - 1/60) = 0.104 (1.11x p95), an A/A bias
    that more windows since the wave never remove."""
    pre_w, post_w, pre_c, post_c = _log_p95(1, spike_at=57)
    est = did(pre_w, post_w, pre_c, post_c, bucket_s=BUCKET_S)
    assert est is not None
    assert abs(est.delta) < 0.02, est
    assert abs(est.delta) < 3 * est.se, est


def test_the_p95_gate_passes_an_equal_release_whose_control_saw_a_spike() -> None:
    """The same through the p95 gate, as the last wave of a rollout meets it: it passes, it is not held open."""
    spec = next(s for s in SPECS if s.name == "p95_vs_control")
    rows = _log_p95(2, spike_at=55, sd=0.05)

    def windows(obs: list[Obs]) -> list[dict[str, object]]:
        return [{"device_id": o.device, "server_ts": o.ts, "requests": 100, "p95_ms": math.exp(o.value)}
                for o in obs]

    arms = Arms(*(windows(r) for r in rows))
    got = judge(spec, arms, margins=Margins(), evidence=Evidence(bucket_s=BUCKET_S, baseline_s=1e9),
                alpha_gate=0.01 / 24)
    assert got["decision"] == "pass", got
    assert abs(got["estimate"] - 1.0) < 0.03, got


def test_spread_without_a_spike_is_unchanged_by_the_fit() -> None:
    """No shared load: the fitted levels are the devices' own means, the estimate is the plain one."""
    pre_w, post_w, pre_c, post_c = _log_p95(3, spike_at=-1)
    est = did(pre_w, post_w, pre_c, post_c, bucket_s=BUCKET_S)
    assert est is not None
    assert abs(est.delta) < 3 * est.se, est


def test_the_baselines_error_is_what_the_short_overlap_leaves() -> None:
    """`baseline_se`: the spread of an A/A estimate whose post-wave noise is negligible (100 windows since the wave)
    is the baselines' error, and with levels net of shared load the arms' levels are compared only over the
    control's few windows on the release, not over the wave's hour: the per-device error (1/n each) understates
    it by a third here. The predicted error matches the measured spread over 80 draws, shrinks as the control's
    baseline lengthens, and `baseline_errors` holds a wave whose error is over a sixth of a gate's margin."""
    deltas, predicted = [], []
    for seed in range(80):
        pre_w, post_w, pre_c, post_c = _log_p95(seed, spike_at=-1, wave=3, control=3, short=8, post=100, sd=0.1)
        base = baselines(pre_w, pre_c, 5, None, BUCKET_S)
        est = did(pre_w, post_w, pre_c, post_c, bucket_s=BUCKET_S, base=base)
        assert est is not None
        deltas.append(est.delta)
        predicted.append(baseline_se(pre_w, pre_c, base, BUCKET_S))
    spread, se = float(np.std(deltas)), float(np.median(predicted))
    assert 0.8 * spread < se < 1.6 * spread, (spread, se)
    naive = 0.1 * math.sqrt(1 / (3 * 8) + 1 / (3 * 60))  # sd 0.1 a window; 8 and 60 windows a device; 3 an arm
    assert se > 1.2 * naive, (se, naive)
    longer = _log_p95(0, spike_at=-1, wave=3, control=3, short=32, post=0, sd=0.1)
    assert baseline_se(longer[0], longer[2], baselines(longer[0], longer[2], 5, None, BUCKET_S), BUCKET_S) < se

    def windows(obs: list[Obs]) -> list[dict[str, object]]:
        return [{"device_id": o.device, "server_ts": o.ts, "requests": 100, "p95_ms": math.exp(o.value)}
                for o in obs]

    short = _log_p95(0, spike_at=-1, wave=3, control=3, short=8, post=0, sd=0.4)
    got = {g["gate"]: g for g in baseline_errors(Arms(windows(short[0]), [], windows(short[2]), []),
                                                  margins=Margins(), evidence=Evidence(bucket_s=BUCKET_S))}
    assert got["p95_vs_control"]["ok"] is False, got  # 0.4 a window over 8 windows: more than a sixth of log 1.3
    assert got["p95_vs_control"]["limit"] == round(math.log1p(0.3) / 6, 6)


def test_the_evidence_floor_is_where_the_bound_crosses_the_margin() -> None:
    """`evidence_floor`: a good release's pass bound is under the margin from the floor on and not below it; at
    the canary every accuracy and rate gate but the degraded share needs more than the old default's 200
    inferences, and audits at 1 % need twenty times as many as at 50 %."""
    from cloud_service.fleet.gates import evidence_floor
    from cloud_service.fleet.sequential import Estimate

    m, ev = Margins(), Evidence()
    p = 0.2 * 0.1
    f = evidence_floor("agreement", p * (1 - p), margins=m, evidence=ev, waves=4)
    spec = next(s for s in SPECS if s.name == "agreement")

    def bound(w: float) -> float:
        est = Estimate(delta=0.0, weight=w, var_post=p * (1 - p) * w, var_base=0.0, unit_var=p * (1 - p), buckets=6,
                       wave_n=w, control_n=math.inf, wave_mean=0.0, control_mean=0.0)
        return est.radius(ev.beta, spec.pass_at, one_sided=True)

    assert bound(f["pass"]) < m.agreement_points <= bound(0.99 * f["pass"])
    assert 200 < f["pass"] < f["fail"]
    assert f["alpha_gate"] == ev.alpha_gate(4, 0, "agreement")
    esc = evidence_floor("escalation_rate", 0.16, margins=m, evidence=ev, waves=4)
    assert esc["pass"] > 200
    q = 0.8 * 0.01
    half = evidence_floor("audit_agreement", q * (1 - q) + p * (1 - p) * 0.5, margins=m, evidence=ev, waves=4)
    one = evidence_floor("audit_agreement", q * (1 - q) + p * (1 - p) * 0.01, margins=m, evidence=ev, waves=4)
    assert half["pass"] / 0.5 > 200
    assert one["pass"] / 0.01 > 20 * half["pass"] / 0.5
