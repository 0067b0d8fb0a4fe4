"""Rollout gates: a wave's devices against a control cohort still on the previous release, as sequential tests.

Pure functions over telemetry windows (dicts with device_id, server_ts, requests, window_s, p95_ms,
escalation_rate, agreement, compared, degraded, energy_mj_per_request, crashes and, where the agent audits,
audits, audit_disagreed, audit_rate).

Statistical gates (sequential.py: difference in differences over shared time buckets, an always-valid
confidence sequence), each with a *practically relevant difference* (`Margins`), not a pass/fail ratio:

| gate | per window | margin |
| --- | --- | --- |
| escalation_rate | escalations / inferences | escalation_points |
| degraded_share | degraded answers / inferences | degraded_points |
| agreement | escalations the cloud answered otherwise, per inference (not per escalation, so the arms
  compare alike whatever each escalates) | agreement_points (accuracy points) |
| audit_agreement | where windows carry audits: the whole stream's disagreement with the cloud per inference,
  escalations answered otherwise plus audited confident inputs answered otherwise, each standing for the
  confident inputs it samples (the agent's `agreement_est`): the audit share differs by arm (1 % on control
  devices, 50 % on a small wave), the estimate does not; the errors escalations never see count, a flipped
  class's confident ones too; a window weighs by its audits over its confident share (`_audit_weight`, the
  inverse of its variance) | agreement_points (accuracy points) |
| p95_vs_control | log of the window's p95 | log(1 + p95_ratio) |
| energy_per_request | log of the window's energy per inference | log(1 + energy_ratio) |

A gate **fails** when its (1 - alpha_gate) confidence sequence excludes "no regression" (lower bound > 0) and
the estimate is at least half the margin; it **passes** when its (1 - beta_gate) upper bound is under the
margin; otherwise it is open. alpha_gate = alpha x the wave's share x the gate's weight / 6 gates (`ALPHA_WEIGHTS`,
mean 1: p95 3, energy 1/2, the escalation and degraded rates 1/4, the accuracy gates 1) bounds the
false-rollback rate of the whole rollout by alpha over every look (a union bound): the canary spends
`canary_share` (half) of alpha, where a regression should be stopped on the least evidence, the later waves the
rest evenly (they judge many devices and need little of it). Hard gates (device_verifies, crashes) fail on one
event; p95_budget and cloud_capacity are judged when the wave would pass. Every gate is a JSON-able dict kept in
the decision record (below).

What the statistics need (`evidence_floor`): a good release passes a gate no sooner than its (1 - beta) bound
at an estimate of 0 is under the margin. At the canary's alpha share, on a device of 10 inferences/s in 10 s
windows (escalation 20 %, 10 % of escalations and 1 % of confident answers answered otherwise): escalation rate
494 inferences, degraded share 23, agreement 379, the whole-stream gate 691 with audits at 50 % (about 15,800 at
the agent's 1 %), p95 4.2 windows, energy 3.7 windows; and no gate before MIN_BUCKETS buckets with both arms.
A margin-sized regression fails no sooner than 1,253, 42, 833, 1,473 inferences, 7.7 and 8.0 windows. The old
fixed soak of 200 requests a device is below every floor but the degraded share's: a 2-point margin on a
proportion cannot be bounded from 200 inferences, on either side.

A gate's record:

```json
{"gate": "escalation_rate", "ok": false, "decision": "fail", "wave": 0.27, "control": 0.16,
 "estimate": 0.105, "lower": 0.061, "upper": 0.149, "pass_upper": 0.13, "margin": 0.05, "threshold": 0.0,
 "alpha": 0.0005, "beta": 0.05, "evidence": 1830.0, "buckets": 14, "note": "..."}
```
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cloud_service.fleet.sequential import (
    MIN_BUCKETS,
    Baselines,
    Estimate,
    Obs,
    baseline_se,
    baselines,
    binomial_floor,
    did,
)
from cloud_service.protocol.fleet_docs import TelemetryWindow
from runtimes.errors import ConfigError

STAT_GATES = ("escalation_rate", "degraded_share", "agreement", "audit_agreement", "p95_vs_control",
              "energy_per_request")
HARD_GATES = ("device_verifies", "crashes")
MIN_WINDOW_REQUESTS = 5  # a window's p95 and energy from fewer inferences are too coarse to count
MIN_BASELINE_WINDOWS = 5  # a device with fewer windows before the wave has no baseline (just started or swapped)
# p95 and energy fail only on this many of the wave's windows: a few windows' p95 tell little of their spread.
# A device's slow swings (a minute at 0.5-1.6x on a shared CPU) are in the variance, clustered by device and
# block (sequential.py), not in this count. Looks skipped cost no validity: the confidence sequence holds at
# every look, so it holds at the ones taken.
MIN_FAIL_WINDOWS = 10
# A later wave starts only once its baselines' standard error is at most this share of each gate's margin (the
# last wave's control, the earlier waves' devices, has only the minutes since their swap on the release): a good
# release passes once its estimate is under half the margin with the planned evidence, or its bound under the
# margin, and the baselines' error is an offset that no soak after the start removes. At a sixth of the margin,
# half the margin is three of its standard errors away: about 0.1 % of good releases held open per gate by it.
BASELINE_SE_SHARE = 1 / 6
# A small wave's pre-swap audit phase (rollout_engine.py) runs only where the control's audits alone leave at most
# this share of the limit above (`baseline_errors`' control_se): beyond it, the wave's own baseline would have to
# be near perfect for the sum to get under the limit, and a phase runs to its cap for nothing (a few devices'
# minutes at 1 %).
PRE_SWAP_REACH = 0.75
# A wave's alpha is split over its statistical gates by these weights (their mean is 1, so the union bound over
# gates, waves and looks still spends `Evidence.alpha`), by how much evidence each gate needs to stop a
# margin-sized regression: p95 decides on windows, whose log p95 swings with the device's own load, and needs
# the most canary inferences (+30 % p95: a median of 2,425 canary inferences over 20 simulated runs with an even
# split, 2,102 with these weights); +10 % energy is told on about half of that, and the escalation and degraded
# rates move by 5 points against the 2-point accuracy margins, so their alpha buys little. The accuracy gates
# keep an even share. Weights only move alpha between gates: the false-rollback bound is unchanged.
ALPHA_WEIGHTS: dict[str, float] = {"escalation_rate": 0.25, "degraded_share": 0.25, "agreement": 1.0,
                                   "audit_agreement": 1.0, "p95_vs_control": 3.0, "energy_per_request": 0.5}


@dataclass(frozen=True)
class Margins:
    """Practically relevant differences: a regression this large should be stopped (`tierkit fleet deploy --...`).

    Args:
        p95_ratio: p95 latency 30 % above control's change.
        escalation_points: escalation rate up 5 points.
        agreement_points: 2 points more disagreement with the cloud per inference (accuracy points).
        degraded_points: degraded share up 5 points.
        energy_ratio: energy per inference 10 % up.
        min_requests: inferences on the release a wave needs before it may pass.
    """

    p95_ratio: float = 0.30
    escalation_points: float = 0.05
    agreement_points: float = 0.02
    degraded_points: float = 0.05
    energy_ratio: float = 0.10
    min_requests: int = 50

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value >= 0:
                msg = f"margin {name}={value!r} must be a number >= 0"
                raise ConfigError(msg)


@dataclass(frozen=True)
class Evidence:
    """How the statistical gates weigh evidence.

    Args:
        alpha: false-rollback rate of a whole rollout (every gate, wave and look), split evenly.
        beta: per gate and wave, the chance a release a full margin worse still passes that wave.
        bucket_s: windows are compared with the control's over buckets this long (the telemetry interval).
        baseline_s: each device's baseline: its windows on the previous release this long before the wave.
        warmup_windows: each wave device's first windows on the release are left out (the swap's own window,
            a cold start: not what the release costs once it runs).
        warmup_s: for p95 and energy, so are its windows within this many seconds of its first one on the
            release (the swap's transient: a new session's first runs, the golden check, the old slot's
            teardown, on a shared host every neighbour's too; measured on two shared cores with real agents:
            tests/e2e/test_rollout_fleet.py records it).
        plan: scales each gate's planned evidence (2,500 inferences for rates, 150 audits, 30 windows for p95
            and energy): a gate passes once its upper bound is
            under the margin, or once it has the planned evidence with an estimate under half the margin; a
            wave that reaches its maximum soak first is inconclusive.
        block_s: a device's windows within a block this long are one cluster for the variance (noise that stays
            with a device for a minute, as on agents sharing a CPU, counts once per block, not once a window).
        canary_share: the share of alpha the canary wave spends (the later waves split the rest evenly; a
            one-wave rollout spends all of it). Half: +30 % p95 is stopped at the canary on about a tenth fewer
            inferences than with an even split over four waves, the later waves need a few percent more
            (bench/bench_gates.py --canary-share compares).
    """

    alpha: float = 0.01
    beta: float = 0.05
    bucket_s: float = 10.0
    baseline_s: float = 3600.0
    warmup_windows: int = 2
    warmup_s: float = 30.0
    plan: float = 1.0
    block_s: float = 120.0
    canary_share: float = 0.5

    def __post_init__(self) -> None:
        if not (0 < self.alpha < 0.5 and 0 < self.beta < 0.5):
            msg = f"alpha={self.alpha!r} and beta={self.beta!r} must be error rates in (0, 0.5), e.g. 0.01"
            raise ConfigError(msg)
        if not (self.bucket_s > 0 and self.baseline_s > 0 and self.plan > 0 and self.block_s > 0 and self.warmup_s >= 0
                and self.warmup_windows >= 0):
            msg = (f"bucket_s={self.bucket_s!r}, baseline_s={self.baseline_s!r}, block_s={self.block_s!r} and "
                   f"plan={self.plan!r} must be "
                   f"positive, warmup_s={self.warmup_s!r} and warmup_windows={self.warmup_windows!r} >= 0")
            raise ConfigError(msg)
        if not 0 < self.canary_share < 1:
            msg = f"canary_share={self.canary_share!r} must be a share of alpha in (0, 1), e.g. 0.5"
            raise ConfigError(msg)

    def alpha_gate(self, waves: int, wave: int | None = None, gate: str | None = None) -> float:
        """The error rate of statistical gate `gate` of wave `wave` (0: the canary) of a `waves`-wave rollout;
        `wave` None: the least of any wave's; `gate` None: the mean over the gates (the wave's share / 6)."""
        if waves <= 1:
            share = 1.0
        elif wave == 0:
            share = self.canary_share
        else:
            share = (1 - self.canary_share) / (waves - 1)
            if wave is None:
                share = min(share, self.canary_share)
        weight = ALPHA_WEIGHTS[gate] if gate is not None else 1.0
        return self.alpha * share * weight / len(STAT_GATES)


@dataclass(frozen=True)
class Arms:
    """The windows a wave is judged on: each arm's baseline (before the wave) and its windows since."""

    pre_wave: Sequence[Mapping[str, Any]]
    post_wave: Sequence[Mapping[str, Any]]
    pre_control: Sequence[Mapping[str, Any]]
    post_control: Sequence[Mapping[str, Any]]
    # device -> server time from which its windows count for p95 and energy (its swap's transient is over;
    # rates are not skewed by a transient and count from the start)
    warm: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Cohort:
    """Request-weighted figures of a set of windows (shown beside the tests; not what they decide on)."""

    devices: int
    windows: int
    requests: int
    seconds: float
    p95_ms: float | None
    escalation_rate: float | None
    degraded_share: float | None
    energy_mj_per_request: float | None
    crashes: int

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def cohort(windows: Iterable[Mapping[str, Any]]) -> Cohort:
    ws = list(windows)
    req = sum(int(w.get("requests") or 0) for w in ws)

    def weighted(key: str) -> float | None:
        pairs = [(float(w[key]), float(w.get("requests") or 0)) for w in ws if w.get(key) is not None]
        den = sum(n for _v, n in pairs)
        return sum(v * n for v, n in pairs) / den if den > 0 else None

    return Cohort(
        devices=len({w.get("device_id") for w in ws}), windows=len(ws), requests=req,
        seconds=sum(float(w.get("window_s") or 0) for w in ws), p95_ms=weighted("p95_ms"),
        escalation_rate=weighted("escalation_rate"),
        degraded_share=(sum(int(w.get("degraded") or 0) for w in ws) / req) if req else None,
        energy_mj_per_request=weighted("energy_mj_per_request"), crashes=sum(int(w.get("crashes") or 0) for w in ws))


def window_counts(doc: TelemetryWindow | None) -> dict[str, Any]:
    """The counts a window document carries beside its table columns: escalations compared with the cloud
    (`compared`, else the cloud's answers) and, where the agent audits, audits and audit_disagreed (from the
    agent's `audited` and `audit_agreement`, or given as such)."""
    if doc is None:
        return {"compared": 0}
    out: dict[str, Any] = {"compared": doc.compared if doc.compared is not None else doc.cloud}
    if doc.agreement_est is not None:
        out["agreement_est"] = doc.agreement_est
    if doc.audits and doc.audit_rate is not None:
        out.update(audits=doc.audits, audit_disagreed=doc.audit_disagreed, audit_rate=doc.audit_rate)
    elif doc.audited and doc.audit_agreement is not None:  # the agent's window
        n = doc.audited
        out.update(audits=n, audit_disagreed=round(n * (1 - min(1.0, max(0.0, doc.audit_agreement)))))
    return out


# -- what each gate reads from a window ------------------------------------------------------------

def _n(w: Mapping[str, Any]) -> float:
    return float(w["requests"] or 0)


def _disagreements(w: Mapping[str, Any]) -> float | None:
    """Escalations the cloud answered differently, per inference (comparable whatever each arm escalates)."""
    n = _n(w)
    if n <= 0:
        return None
    compared = float(w.get("compared") or 0)
    agreement = w.get("agreement")
    return ((1 - float(agreement)) * compared if agreement is not None and compared > 0 else 0.0) / n


def _confident_disagreements(w: Mapping[str, Any]) -> float | None:
    """Confident inputs the cloud would answer otherwise, per inference: the confident share times the share of
    their audits answered otherwise (the agent's `agreement_est` less its escalations' part where the window has
    one). None where confident inputs went unaudited (their share is unknown; which windows hold audits does not
    depend on the answers, so leaving them out biases neither arm)."""
    n = _n(w)
    escalated = _disagreements(w)
    if n <= 0 or escalated is None:
        return None
    if w.get("agreement_est") is not None:
        return max(0.0, 1.0 - float(w["agreement_est"]) - escalated)
    confident = n * (1 - float(w.get("escalation_rate") or 0))
    audits = float(w.get("audits") or 0)
    if confident > 0 and audits <= 0:
        return None
    return confident / n * float(w.get("audit_disagreed") or 0) / audits if audits > 0 else 0.0


def _audit_weight(w: Mapping[str, Any]) -> float:
    """A window's weight in the whole-stream gate: its audits over its confident share, the inverse of its
    estimate's variance up to a constant (confident share x q(1 - q) / audits, q the share answered otherwise), so
    the binomial floor of the per-inference rate holds per unit of it. Windows audited at 1 % and at 50 % then
    weigh by what they tell: an hour of a device at 1 % (about 290 audits) and a minute at 50 % weigh alike, where
    weighing by inferences gave the minute a fiftieth."""
    audits = float(w.get("audits") or 0)
    if audits <= 0:
        return 0.0
    return audits / max(1.0 - float(w.get("escalation_rate") or 0), 1e-3)


def _log(key: str) -> Callable[[Mapping[str, Any]], float | None]:
    def value(w: Mapping[str, Any]) -> float | None:
        v = w.get(key)
        return math.log(float(v)) if v and float(v) > 0 and _n(w) >= MIN_WINDOW_REQUESTS else None
    return value


@dataclass(frozen=True)
class _Spec:
    name: str
    value: Callable[[Mapping[str, Any]], float | None]
    per_window: bool  # weight 1 per window (log figures) or its inferences (rates)
    weight: Callable[[Mapping[str, Any]], float]
    margin: Callable[[Margins], float]  # on the tested scale
    t_star: float  # the planned evidence
    note: str
    fail_at: float  # the evidence at which a margin-sized regression is typically clear: the failing bound is
    pass_at: float  # tightest there; and the passing bound where a good release typically shows it is no worse


# fail_at / pass_at tune each bound's mixture (rho) to the evidence where it decides (measured in simulation,
# bench/bench_gates.py): a 2-point rate regression is clear after ~1,000-2,000 inferences of the canary, a good
# release shows it is within the margin after a few hundred; p95 and energy after ~20-30 windows. The agreement
# gate's failing bound is tuned to 2,000: a 2-point regression of it decided at a median of 2,166 canary inferences
# tuned to 1,000, 2,072 tuned to 2,000, every other figure of the simulated run unchanged (judged every other
# window); judged every window, as the engine does, 1,846 (1,753 over 25 runs). The whole-stream
# gate weighs audits (`_audit_weight`): its figures are the rates' at a small wave's 50 % audit share, in audits.
SPECS = (
    _Spec("escalation_rate", lambda w: float(w.get("escalation_rate") or 0) if _n(w) else None, False, _n,
          lambda m: m.escalation_points, 2500, "escalation rate, points", 1000, 500),
    _Spec("degraded_share", lambda w: float(w.get("degraded") or 0) / _n(w) if _n(w) else None, False, _n,
          lambda m: m.degraded_points, 2500, "degraded answers per inference, points", 1000, 500),
    _Spec("agreement", _disagreements, False, _n, lambda m: m.agreement_points, 2500,
          "escalations answered otherwise by the cloud, per inference, points", 2000, 500),
    _Spec("audit_agreement", _confident_disagreements, False, _audit_weight, lambda m: m.agreement_points, 1250,
          "whole-stream disagreement with the cloud per inference (escalations and audits), points", 750, 250),
    _Spec("p95_vs_control", _log("p95_ms"), True, lambda w: 1.0, lambda m: math.log1p(m.p95_ratio), 30,
          "p95 latency ratio (difference of log p95, wave change / control change)", 30, 15),
    _Spec("energy_per_request", _log("energy_mj_per_request"), True, lambda w: 1.0,
          lambda m: math.log1p(m.energy_ratio), 30, "energy per inference ratio (difference of logs)", 30, 15),
)

_AGREEMENT = next(s for s in SPECS if s.name == "agreement")

def _one(spec: _Spec, w: Mapping[str, Any]) -> Obs | None:
    """The gate's observation of one window (None where the window says nothing of it)."""
    v = spec.value(w)
    return None if v is None or not math.isfinite(v) else Obs(w["device_id"], w["server_ts"], spec.weight(w), v)


def _obs(spec: _Spec, windows: Iterable[Mapping[str, Any]], memo: ObsMemo | None = None) -> list[Obs]:
    if memo is not None:
        return memo.obs(spec, windows)
    return [o for w in windows if (o := _one(spec, w)) is not None]


class ObsMemo:
    """Each window's observation for each gate, read once: for a caller that judges the same windows look after
    look (the gate simulator judges every look of a rollout over windows it keeps, and a pre-swap or settle phase
    reads the same hour of baselines every window). It holds each window it has read, so that a window's id stays
    its own while the memo lives; the observations are those `_obs` reads, in the same order."""

    def __init__(self) -> None:
        self._by_gate: dict[str, dict[int, tuple[Mapping[str, Any], Obs | None]]] = {}

    def obs(self, spec: _Spec, windows: Iterable[Mapping[str, Any]]) -> list[Obs]:
        memo = self._by_gate.setdefault(spec.name, {})
        out = []
        for w in windows:
            hit = memo.get(id(w))
            if hit is None:
                memo[id(w)] = hit = (w, _one(spec, w))
            if hit[1] is not None:
                out.append(hit[1])
        return out

    def forget(self, windows: Iterable[Mapping[str, Any]]) -> None:
        """Forget these windows (a caller that drops windows it held)."""
        ids = [id(w) for w in windows]
        for memo in self._by_gate.values():
            for k in ids:
                memo.pop(k, None)


def _estimate(spec: _Spec, arms: Arms, evidence: Evidence,
              cache: dict[Any, Any] | None, memo: ObsMemo | None = None) -> tuple[Estimate | None, bool]:
    """The spec's difference in differences, and whether it is due (both arms have windows from devices with a
    baseline: too few time buckets yet, rather than none to judge). `cache` keeps what does not change between
    looks (the observations before the wave and the baselines)."""
    def obs(windows: Sequence[Mapping[str, Any]]) -> list[Obs]:
        if cache is None:
            return _obs(spec, windows, memo)
        key = (spec.name, id(windows), len(windows))
        if key not in cache:
            cache[key] = _obs(spec, windows, memo)
        return list(cache[key])

    pw, pc = obs(arms.pre_wave), obs(arms.pre_control)
    qw, qc = _obs(spec, arms.post_wave, memo), _obs(spec, arms.post_control, memo)
    if spec.per_window and arms.warm:
        qw = [o for o in qw if o.ts >= arms.warm.get(o.device, -math.inf)]
    floor = None if spec.per_window else binomial_floor()
    key = (spec.name, "baselines", id(arms.pre_wave), len(arms.pre_wave), id(arms.pre_control), len(arms.pre_control))
    base: Baselines | None = cache.get(key) if cache is not None else None
    if base is None:
        base = baselines(pw, pc, MIN_BASELINE_WINDOWS, floor, evidence.bucket_s, evidence.block_s)
        if cache is not None:
            cache[key] = base
    est = did(pw, qw, pc, qc, bucket_s=evidence.bucket_s, floor=floor, min_baseline=MIN_BASELINE_WINDOWS, base=base,
              block_s=evidence.block_s)
    if est is not None:
        return est, True
    # it holds the wave wherever the control has devices with a baseline and the wave has either devices with a
    # baseline or windows on the release (a canary's first seconds, p95 within its warm-up, a wave whose devices
    # all swapped too recently to have a baseline: not judged yet is not passed; a wave left open so follows its
    # on_inconclusive policy at its maximum soak); the audits only where the wave sent some and its devices have
    # an audit baseline (a fleet that does not audit is not held by them, nor is a wave whose devices audited too
    # few windows before it: at the agent's 1 % a device needs minutes of traffic for five audited windows, and
    # a wave held on audits it can never be judged on only waits for its maximum soak)
    if spec.name == "audit_agreement":
        return None, bool(base.wave) and bool(base.control) and bool(qw)
    return None, (bool(base.wave) or bool(qw)) and bool(base.control)


def judge(spec: _Spec, arms: Arms, *, margins: Margins, evidence: Evidence, alpha_gate: float,
          cache: dict[Any, Any] | None = None, memo: ObsMemo | None = None) -> dict[str, Any]:
    """One statistical gate: its estimate, confidence bounds and decision (pass / fail / open / None).
    The whole-stream gate is the sum of two: escalations answered otherwise (the agreement gate's figure) and
    confident inputs answered otherwise (from audits), each against its own baselines (a device's escalations
    tell its level well, its 1 % of audits do not: the cohort's does), their variances added."""
    est, due = _estimate(spec, arms, evidence, cache, memo)
    if spec.name == "audit_agreement" and est is not None:
        escalated, due = _estimate(_AGREEMENT, arms, evidence, cache, memo)
        est = None if escalated is None else est.plus(escalated)
    margin = spec.margin(margins)
    if est is None:
        out = _record(spec, None, None, margin, alpha_gate, evidence.beta, None,
                      "not judged yet: too few time buckets with both arms" if due else
                      "not judged: no figure with a baseline in one arm (a device new to the fleet, or none sent)")
        return {**out, "decision": "open" if due else None}
    r_fail = est.radius(alpha_gate, spec.fail_at, one_sided=True)
    r_pass = est.radius(evidence.beta, spec.pass_at, one_sided=True)
    lower, upper, pass_upper = est.delta - r_fail, est.delta + r_fail, est.delta + r_pass
    plan = spec.t_star * evidence.plan
    info = est.weight
    early = spec.per_window and est.wave_n < MIN_FAIL_WINDOWS
    if lower > 0 and est.delta >= margin / 2 and not early:
        decision, note = "fail", "a regression: the confidence sequence excludes none"
    elif lower > 0 and est.delta >= margin / 2:
        decision, note = "open", f"a regression, if it holds past {MIN_FAIL_WINDOWS} of the wave's windows"
    elif pass_upper < margin:
        decision, note = "pass", "no regression as large as the margin"
    elif info >= plan and est.delta < margin / 2:
        decision, note = "pass", f"no regression found in the planned evidence ({plan:g})"
    else:
        decision, note = "open", f"collecting evidence ({info:.0f} of {plan:g} planned)"
    out = _record(spec, est, decision, margin, alpha_gate, evidence.beta, (lower, upper, pass_upper),
                  f"{spec.note}: {note}")
    return {**out, "plan": plan, "block_s": evidence.block_s}


def baseline_errors(arms: Arms, *, margins: Margins, evidence: Evidence, audited: bool = False,
                    only: Iterable[str] | None = None, share: float = BASELINE_SE_SHARE,
                    memo: ObsMemo | None = None) -> list[dict[str, Any]]:
    """Before a wave starts (`arms.pre_wave`: the devices it would take, `arms.pre_control`: its control; no windows
    since): each statistical gate's standard error from the baselines alone (`sequential.baseline_se`), against
    `share` (BASELINE_SE_SHARE) of its margin (`ok`). Gates with no baseline in an arm are left out (not judged). The
    whole-stream audit gate counts only for a wave that audits at the raised rate (`audited`: elsewhere it never
    holds a wave up), its error that of its two parts, escalations and audits, added as the gate adds them.
    `only`: these gates alone. `memo`: windows read before are not read again (`ObsMemo`)."""
    out = []
    keep = None if only is None else set(only)
    ses: dict[str, float] = {}
    for spec in SPECS:
        if (spec.name == "audit_agreement" and not audited) or (keep is not None and spec.name not in keep
                                                                 and not (spec.name == "agreement" and audited)):
            continue
        pw, pc = _obs(spec, arms.pre_wave, memo), _obs(spec, arms.pre_control, memo)
        floor = None if spec.per_window else binomial_floor()
        base = baselines(pw, pc, MIN_BASELINE_WINDOWS, floor, evidence.bucket_s, evidence.block_s)
        if not base.wave or not base.control:
            continue
        se = ses[spec.name] = baseline_se(pw, pc, base, evidence.bucket_s, floor)
        extra: dict[str, Any] = {}
        if spec.name == "audit_agreement":
            se = math.sqrt(se * se + ses.get("agreement", 0.0) ** 2)
            # what the control's audits alone leave: where it is over the limit, no richer baseline of the wave's
            # own (a pre-swap audit phase) brings the error under it
            rest = baseline_se(pw, pc, base, evidence.bucket_s, floor, wave_scale=1e6)
            extra["control_se"] = round(rest, 6) if math.isfinite(rest) else None
        if keep is not None and spec.name not in keep:
            continue
        limit = spec.margin(margins) * share
        out.append({"gate": spec.name, "ok": se <= limit, "se": round(se, 6) if math.isfinite(se) else None,
                    "limit": round(limit, 6), **extra})
    return out


def _record(spec: _Spec, est: Estimate | None, decision: str | None, margin: float, alpha: float, beta: float,
            bounds: tuple[float, float, float] | None, note: str) -> dict[str, Any]:
    def r(v: float | None) -> float | None:
        return None if v is None or not math.isfinite(v) else round(v, 6)

    def shown(v: float | None) -> float | None:  # log figures are shown as ratios
        return None if v is None else (math.exp(v) if spec.per_window else v)

    out: dict[str, Any] = {
        "gate": spec.name, "ok": {"pass": True, "fail": False}.get(decision or ""), "decision": decision,
        "margin": r(shown(margin)), "threshold": 1.0 if spec.per_window else 0.0, "alpha": alpha, "beta": beta,
        "scale": "ratio" if spec.per_window else "points", "note": note}
    if est is not None and bounds is not None:
        out.update(estimate=r(shown(est.delta)), lower=r(shown(bounds[0])), upper=r(shown(bounds[1])),
                   pass_upper=r(shown(bounds[2])), se=r(est.se), evidence=r(est.weight),
                   information=r(est.information),
                   buckets=est.buckets,
                   wave=r(math.exp(est.wave_mean) if spec.per_window else est.wave_mean),
                   control=r(math.exp(est.control_mean) if spec.per_window else est.control_mean),
                   wave_n=r(est.wave_n), control_n=r(est.control_n))
    return out


def evaluate(arms: Arms | None, *, margins: Margins, evidence: Evidence, waves: int, budget_ms: float | None,
             device_failures: Mapping[str, str], crashes: int, fleet_request_rate: float | None,
             cloud_capacity_rps: float | None, cache: dict[Any, Any] | None = None,
             wave: int | None = None, memo: ObsMemo | None = None, audited: bool = True) -> list[dict[str, Any]]:
    """Every gate of wave `wave` (0: the canary; None: judged at the least alpha of any wave) of a `waves`-wave
    rollout. `arms` None: no control cohort (the statistical gates are not judged). `audited`: the wave audits at
    the rollout's raised rate, where an open whole-stream gate holds it and so says whether it can pass
    (`holds`, `audits_can_pass`); elsewhere `open_gates` does not read that, and it is not computed."""
    on = cohort(arms.post_wave if arms else [])
    gates = [
        _hard("device_verifies", not device_failures, len(device_failures),
              "swap not refused, golden inputs reproduce, no device rollback"
              + (": " + "; ".join(f"{d}: {e}" for d, e in sorted(device_failures.items())[:5])
                 if device_failures else "")),
        _hard("crashes", crashes + on.crashes == 0, crashes + on.crashes, "no crash on the release"),
    ]
    for spec in SPECS:
        alpha_gate = evidence.alpha_gate(waves, wave, spec.name)
        if arms is None:
            gates.append(_record(spec, None, None, spec.margin(margins), alpha_gate, evidence.beta, None,
                                 "not judged: no control cohort"))
        else:
            gates.append(judge(spec, arms, margins=margins, evidence=evidence, alpha_gate=alpha_gate, cache=cache,
                               memo=memo))
            if spec.name == "audit_agreement" and audited and gates[-1]["decision"] == "open":
                gates[-1]["holds"] = audits_can_pass(arms, margins=margins, evidence=evidence, cache=cache, memo=memo)
    gates.append(_hard("p95_budget", None if budget_ms is None or on.p95_ms is None else on.p95_ms <= budget_ms,
                       on.p95_ms, f"p95 within the release's latency budget {budget_ms:g} ms" if budget_ms
                       else "the release sets no latency budget", limit=budget_ms))
    projected = (fleet_request_rate * on.escalation_rate
                 if fleet_request_rate is not None and on.escalation_rate is not None else None)
    gates.append(_hard("cloud_capacity", None if cloud_capacity_rps is None or projected is None
                       else projected <= cloud_capacity_rps, projected,
                       "escalations/s fleet-wide (targeted devices' request rate x the wave's escalation rate) "
                       "within the cloud's capacity" if cloud_capacity_rps else "no cloud capacity given",
                       limit=cloud_capacity_rps))
    return gates


def control_futile(errors: Sequence[Mapping[str, Any]]) -> bool:
    """From `baseline_errors(..., only=("audit_agreement",))`: whether the control's audits alone leave the
    whole-stream gate's baseline error over `PRE_SWAP_REACH` of its limit, where no evidence of the wave's own
    (a pre-swap phase, a longer soak) brings the gate's error under it."""
    return bool(errors) and not (errors[0].get("control_se") or math.inf) <= PRE_SWAP_REACH * errors[0]["limit"]


def audits_can_pass(arms: Arms, *, margins: Margins, evidence: Evidence, cache: dict[Any, Any] | None = None,
                    memo: ObsMemo | None = None) -> bool:
    """Whether the whole-stream gate can pass a good release of this wave, so may hold it while open
    (`open_gates`): not where its control's audits are too few (`control_futile`: a small fleet whose control is
    a few devices auditing 1 %, about 0.6 audits a second between four of them). There it stops the wave where its
    evidence is clear, as in a wide wave, and the escalations' agreement gate stands for it, instead of holding
    every release of that fleet at the canary until its maximum soak."""
    key = ("audits_can_pass", id(arms.pre_wave), len(arms.pre_wave), id(arms.pre_control), len(arms.pre_control))
    if cache is not None and key in cache:
        return bool(cache[key])
    ok = not control_futile(baseline_errors(arms, margins=margins, evidence=evidence, audited=True,
                                            only=("audit_agreement",), memo=memo))
    if cache is not None:
        cache[key] = ok
    return ok


def _hard(name: str, ok: bool | None, value: Any, note: str, *, limit: Any = 0) -> dict[str, Any]:
    v = round(value, 6) if isinstance(value, float) else value
    return {"gate": name, "ok": ok, "decision": {True: "pass", False: "fail"}.get(ok) if ok is not None else None,
            "wave": v, "limit": limit, "note": note}


def failed(gates: Iterable[Mapping[str, Any]], names: Iterable[str] | None = None) -> list[str]:
    keep = None if names is None else set(names)
    return [g["gate"] for g in gates if g["ok"] is False and (keep is None or g["gate"] in keep)]


def open_gates(gates: Iterable[Mapping[str, Any]], *, audited: bool = False) -> list[str]:
    """Statistical gates still collecting evidence (neither passed nor failed, with data to come).

    `audited`: the wave audits at the rollout's raised rate (a small wave), so the whole-stream gate holds it
    until it passes too: a small wave is where confident errors (a flipped class) must be seen, before
    the release reaches devices that audit at 1 %; unless its control's audits are too few for it ever to pass
    (`holds` False, `audits_can_pass`). Elsewhere audits are sparse, and that gate stops a wave when its
    evidence is clear but never holds one up."""
    return [g["gate"] for g in gates if g["gate"] in STAT_GATES and g["decision"] == "open"
            and (g["gate"] != "audit_agreement" or (audited and g.get("holds", True)))]


def evidence_floor(gate: str, unit_var: float, *, margins: Margins, evidence: Evidence, waves: int,
                   wave: int = 0) -> dict[str, float]:
    """The least evidence (the gate's units of weight: inferences for the rates, audits over the confident share
    for the whole-stream gate, windows for p95 and energy) at which gate `gate` of wave `wave` CAN decide, from
    the confidence sequence's width (`Estimate.radius`) at a variance of `unit_var` per unit of weight, with no
    baseline error and the control's noise left out (a floor: real data only add to it):

    - "pass": a release exactly as good (estimate 0) passes, its (1 - beta) upper bound under the margin;
    - "plan": or it passes on the planned evidence with an estimate under half the margin;
    - "fail": a regression as large as the margin fails, its (1 - alpha_gate) lower bound over 0.

    A good release cannot pass on less than min(pass, plan); `bench/bench_gates.py` prints it per gate at the
    canary beside the soak it measured."""
    spec = next(s for s in SPECS if s.name == gate)
    margin = spec.margin(margins)
    alpha_gate = evidence.alpha_gate(waves, wave, gate)

    def least(ok: Callable[[Estimate], bool]) -> float:
        lo, hi = 1.0, 1e9
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            est = Estimate(delta=0.0, weight=mid, var_post=unit_var * mid, var_base=0.0, unit_var=unit_var,
                           buckets=MIN_BUCKETS, wave_n=mid, control_n=math.inf, wave_mean=0.0, control_mean=0.0)
            lo, hi = (lo, mid) if ok(est) else (mid, hi)
        return hi

    return {"pass": least(lambda e: e.radius(evidence.beta, spec.pass_at, one_sided=True) < margin),
            "plan": spec.t_star * evidence.plan,
            "fail": least(lambda e: margin - e.radius(alpha_gate, spec.fail_at, one_sided=True) > 0),
            "alpha_gate": alpha_gate, "margin": margin}
