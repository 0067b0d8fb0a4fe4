"""A fleet of simulated devices for the rollout gates: telemetry windows as agents publish them, drawn from a
model with per-device levels and noise, uneven traffic and noisy neighbours (shared-load spikes that hit every
device, whichever release it runs), and releases with known regressions.

`Fleet.window(device, t, treated)` gives one window (the agent's format: requests, escalation_rate, agreement,
compared, degraded, p95_ms, energy_mj_per_request, audits ...). `run_rollout` drives the gates in-process
through `gates.evaluate`, wave by wave, the way the engine does, for many A/A and A/B runs in seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cloud_service.fleet.gates import (
    MIN_BASELINE_WINDOWS,
    MIN_WINDOW_REQUESTS,
    PRE_SWAP_REACH,
    STAT_GATES,
    Arms,
    Evidence,
    Margins,
    ObsMemo,
    baseline_errors,
    evaluate,
    failed,
    open_gates,
)
from cloud_service.fleet.rollouts import RolloutOptions, wave_sizes
from testkit.rollout_device import SimDevice

# name -> what the release does on a device that runs it
REGRESSIONS: dict[str, dict[str, float]] = {
    "none": {},
    # 2 points less accurate at the same escalation rate: the extra errors are unsure ones, in escalations
    "accuracy-2": {"esc_disagree": 0.02},
    # one class flipped: 3 points less accurate, 1.25 of them among escalations, 1.75 confident (audits only)
    "flip-class": {"esc_disagree": 0.0125, "conf_disagree": 0.0175},
    "p95+30%": {"p95": 1.30},
    "energy+10%": {"energy": 1.10},
}


@dataclass(frozen=True)
class Model:
    """Args: window_s: telemetry interval; rate_rps: median inferences/s of a device (log-normal, traffic_sd);
    escalation: median escalation rate; disagree: disagreement among escalations; conf_disagree: among
    confident inputs (per device, log-normal with conf_disagree_sd); audit_rate: share of confident inputs
    audited (the agent's default); spike_p / spike: a shared-load spike's chance per window and its p95 factor
    range (it hits every device alike); swing_sd / swing_s: a device's own slow swings (a noisy neighbour on
    its CPU, another app): log p95 wanders with this sd and correlation time (AR(1)), energy per request with a
    third of it. On five agents sharing two cores the canary's p95 against its peers swung 0.4-1.6x over tens of
    seconds (about 0.35 sd on the log, tests/e2e/test_rollout_fleet.py); a device with its own cores swings less:
    0.1 by default, `bench_gates.py --swing-sd 0.35` for the shared host."""

    window_s: float = 10.0
    rate_rps: float = 10.0
    traffic_sd: float = 0.8
    escalation: float = 0.2
    escalation_sd: float = 0.3
    disagree: float = 0.10
    conf_disagree: float = 0.01
    conf_disagree_sd: float = 0.3
    audit_rate: float = 0.01
    degraded: float = 0.003
    p95_ms: float = 5.0
    device_sd: float = 0.3
    window_sd: float = 0.12
    energy_mj: float = 2.0
    spike_p: float = 0.1
    spike: tuple[float, float] = (1.3, 2.5)
    swing_sd: float = 0.1
    swing_s: float = 30.0


@dataclass
class Fleet:
    n: int
    seed: int
    model: Model = field(default_factory=Model)
    regression: str = "none"

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        m = self.model
        self.rng = rng
        self.ids = [f"sim-{self.seed}-{i:04d}" for i in range(self.n)]
        self.rate = m.rate_rps * np.exp(rng.normal(0, m.traffic_sd, self.n))
        logit = math.log(m.escalation / (1 - m.escalation)) + rng.normal(0, m.escalation_sd, self.n)
        self.esc = 1 / (1 + np.exp(-logit))
        self.disagree = np.clip(m.disagree * np.exp(rng.normal(0, 0.2, self.n)), 0, 1)
        self.p95 = m.p95_ms * np.exp(rng.normal(0, m.device_sd, self.n))
        self.noise = m.window_sd * np.exp(rng.normal(0, 0.3, self.n))  # some devices are noisier than others
        self.energy = m.energy_mj * np.exp(rng.normal(0, 0.2, self.n))
        self.conf_disagree = np.clip(m.conf_disagree * np.exp(rng.normal(0, m.conf_disagree_sd, self.n)), 0, 1)
        self._load: dict[int, float] = {}
        self._swing = rng.normal(0, m.swing_sd, self.n)  # each device's swing, at `_swing_t`
        self._swing_t = 0.0
        self._one: dict[int, tuple[float, float]] = {}  # `window`'s per-device swings (device -> (t, value))

    def swing(self, t: float, rng: np.random.Generator) -> np.ndarray:
        """Every device's own swing of log p95 at t (an AR(1) with `swing_s` correlation time; t only grows)."""
        m = self.model
        phi = math.exp(-max(t - self._swing_t, 0.0) / m.swing_s) if m.swing_s > 0 else 0.0
        self._swing = phi * self._swing + math.sqrt(1 - phi * phi) * rng.normal(0, m.swing_sd, self.n)
        self._swing_t = t
        return self._swing

    def swing_one(self, i: int, t: float, rng: np.random.Generator) -> float:
        m = self.model
        last_t, value = self._one.get(i, (t, float(rng.normal(0, m.swing_sd))))
        phi = math.exp(-max(t - last_t, 0.0) / m.swing_s) if m.swing_s > 0 else 0.0
        value = phi * value + math.sqrt(1 - phi * phi) * float(rng.normal(0, m.swing_sd))
        self._one[i] = (t, value)
        return value

    def load(self, t: float) -> float:
        """The shared-load factor of the window ending at t (noisy neighbours, a slow cloud): same for all."""
        k = int(t // self.model.window_s)
        if k not in self._load:
            r = np.random.default_rng((self.seed, k))
            self._load[k] = float(r.uniform(*self.model.spike)) if r.random() < self.model.spike_p else 1.0
        return self._load[k]

    def window(self, i: int, t: float, treated: bool, *, regression: str | None = None,
               rng: np.random.Generator | None = None, audit_rate: float | None = None) -> dict[str, Any]:
        """Device i's window ending at t; `treated`: it runs the release (with `regression`, else the fleet's);
        `audit_rate`: a rollout's raised audit share (else the model's)."""
        m, rng = self.model, rng or self.rng
        audit_rate = m.audit_rate if audit_rate is None else audit_rate
        reg = REGRESSIONS[regression or self.regression] if treated else {}
        s = self.load(t)
        n = int(rng.poisson(self.rate[i] * m.window_s))
        esc = int(rng.binomial(n, self.esc[i]))
        q = min(1.0, self.disagree[i] + reg.get("esc_disagree", 0.0) / self.esc[i])
        dis = int(rng.binomial(esc, q))
        conf = n - esc
        audits = int(rng.binomial(conf, audit_rate))
        cq = min(1.0, self.conf_disagree[i] + reg.get("conf_disagree", 0.0) * n / max(conf, 1))
        degraded = int(rng.binomial(n, min(1.0, m.degraded * (1 + 4 * (s - 1)))))
        sd = self.noise[i] * (1 + 3 / math.sqrt(max(n, 1)))
        own = self.swing_one(i, t, rng)
        p95 = self.p95[i] * s * reg.get("p95", 1.0) * math.exp(rng.normal(0, sd) + own)
        energy = self.energy[i] * (1 + 0.3 * (s - 1)) * reg.get("energy", 1.0) * math.exp(rng.normal(0, sd / 3)
                                                                                          + own / 3)
        return {"device_id": self.ids[i], "device": self.ids[i], "server_ts": t, "ts": t, "window_s": m.window_s,
                "requests": n, "escalation_rate": esc / n if n else 0.0, "compared": esc,
                "tiers": {"edge": n - esc, "cloud": esc},
                "agreement": 1 - dis / esc if esc else None, "degraded": degraded, "p95_ms": p95, "p50_ms": p95 / 2,
                "energy_mj_per_request": energy, "audits": audits, "audit_rate": audit_rate,
                "audit_disagreed": int(rng.binomial(audits, cq)), "crashes": 0}


    def windows(self, t: float, treated: np.ndarray, audit_rate: np.ndarray) -> list[dict[str, Any]]:
        """Every device's window ending at t at once (the draws of `window`, vectorised): `treated` and
        `audit_rate` per device."""
        m, rng, n_dev = self.model, self.rng, self.n
        reg = REGRESSIONS[self.regression]
        on = treated.astype(float)
        s = self.load(t)
        n = rng.poisson(self.rate * m.window_s)
        esc = rng.binomial(n, self.esc)
        dis = rng.binomial(esc, np.minimum(1.0, self.disagree + on * reg.get("esc_disagree", 0.0) / self.esc))
        conf = n - esc
        audits = rng.binomial(conf, audit_rate)
        cq = np.minimum(1.0, self.conf_disagree + on * reg.get("conf_disagree", 0.0) * n / np.maximum(conf, 1))
        degraded = rng.binomial(n, min(1.0, m.degraded * (1 + 4 * (s - 1))))
        sd = self.noise * (1 + 3 / np.sqrt(np.maximum(n, 1)))
        own = self.swing(t, rng)
        p95 = self.p95 * s * np.where(treated, reg.get("p95", 1.0), 1.0) * np.exp(rng.normal(0, 1, n_dev) * sd + own)
        energy = (self.energy * (1 + 0.3 * (s - 1)) * np.where(treated, reg.get("energy", 1.0), 1.0)
                  * np.exp(rng.normal(0, 1, n_dev) * sd / 3 + own / 3))
        audit_dis = rng.binomial(audits, cq)
        cols = zip(self.ids, n.tolist(), esc.tolist(), dis.tolist(), degraded.tolist(), p95.tolist(),
                   energy.tolist(), audits.tolist(), audit_rate.tolist(), audit_dis.tolist(), strict=True)
        return [{"device_id": d, "device": d, "server_ts": t, "ts": t, "window_s": m.window_s, "requests": k,
                 "escalation_rate": e / k if k else 0.0, "compared": e, "tiers": {"edge": k - e, "cloud": e},
                 "agreement": 1 - x / e if e else None, "degraded": g, "p95_ms": p, "p50_ms": p / 2,
                 "energy_mj_per_request": j, "audits": a, "audit_rate": r, "audit_disagreed": ad, "crashes": 0}
                for d, k, e, x, g, p, j, a, r, ad in cols]


@dataclass
class Outcome:
    result: str  # succeeded | rolled_back | held
    wave: int  # the wave that decided (or the last one)
    gates: list[str]  # the gates that failed (or were still open)
    canary_inferences: int  # inferences on the release in the canary wave when it was decided
    wave_inferences: list[int]  # per wave, inferences on the release when it was decided
    looks: int
    old_soak_inferences: list[int] = field(default_factory=list)  # per wave, under the old fixed soak (below)
    wave_windows: list[int] = field(default_factory=list)  # per wave, the windows it soaked before it was decided
    settle_windows: int = 0  # windows the last wave waited for its control's baselines before it started
    # the canary's pre-swap audit phase: its devices on the previous release auditing at the raised rate
    pre_swap_windows: int = 0
    pre_swap_inferences: int = 0  # on the previous release: a cost of the phase, not soak of the release
    pre_swap_audits: int = 0


def run_rollout(fleet: Fleet, *, waves: tuple[str, ...] = ("1", "5%", "25%", "100%"),
                margins: Margins | None = None, evidence: Evidence | None = None, baseline_windows: int = 60,
                max_soak_windows: int = 60, control_max: int | None = None, holdback: int | None = None,
                look_every: int = 1, audit_rate: float | None = None, audit_devices: int | None = None,
                earlier_waves: bool = True, pre_swap_windows: int | None = None) -> Outcome:
    """One rollout over the simulated fleet: waves judged by `gates.evaluate` every window, as the engine does (it
    steps every second and a device's telemetry adds a window every `window_s`; `look_every` > 1 judges every
    that many windows, a sparser schedule than the engine's that decides later by up to that many windows);
    a wave of at most `audit_devices` devices audits at `audit_rate` while it soaks (the rollout's defaults).

    The control, as the engine's: the devices still on the previous release and (`earlier_waves`) the devices
    of earlier waves, each against its own windows on the release before the wave past its swap's warm-up. The
    last wave keeps `holdback` devices back (default: the engine's, `holdback` of the fleet and at least 2) only
    where fewer than that many devices of earlier waves have a baseline to be its control (always, with
    `earlier_waves` False). A wave that audits at the raised rate first audits at it on the previous release, as
    the engine's pre-swap phase, until its audit baseline lets the whole-stream gate pass, for at most
    `pre_swap_windows` (default: the engine's `pre_swap_s`; 0: no such phase)."""
    margins, evidence = margins or Margins(), evidence or Evidence()
    defaults = RolloutOptions()
    audit_rate = defaults.audit_rate if audit_rate is None else audit_rate
    audit_devices = defaults.audit_devices if audit_devices is None else audit_devices
    control_max = defaults.control_max if control_max is None else control_max
    held_back = max(2, math.ceil(defaults.holdback * fleet.n)) if holdback is None else holdback  # as the engine
    ws = fleet.model.window_s
    pre_most = math.ceil(defaults.pre_swap_s / ws) if pre_swap_windows is None else pre_swap_windows
    pre: tuple[int, int, int] = (0, 0, 0)
    memo = ObsMemo()  # every look reads the windows of the looks before it again
    sizes = wave_sizes(waves, fleet.n)
    order = list(fleet.rng.permutation(fleet.n))
    history: dict[int, list[dict[str, Any]]] = {i: [] for i in range(fleet.n)}
    t = 0.0
    base_rate = np.full(fleet.n, fleet.model.audit_rate)
    for _ in range(baseline_windows):
        t += ws
        for i, x in enumerate(fleet.windows(t, np.zeros(fleet.n, dtype=bool), base_rate)):
            history[i].append(x)
    treated: set[int] = set()
    warm: dict[int, float] = {}  # device -> when its windows on the release count (past its swap's warm-up)
    per_wave: list[int] = []
    windows: list[int] = []
    looks = settle = 0
    for w, size in enumerate(sizes):
        last = w == len(sizes) - 1
        new = [i for i in order[:size] if i not in treated]
        promoted = [i for i in order if i in treated] if earlier_waves else []
        # the last wave keeps a control back until it has passed where too few devices of earlier waves have a
        # baseline (windows on the release past their warm-up), as the engine's `_holdback`
        if last and len(_baselined(promoted, history, warm, t, evidence)) < held_back:
            new = new[:max(1, len(new) - held_back)]
        elif last:  # the earlier waves are its control: it starts once their baselines let its gates pass
            settle = _settle(fleet, new, promoted[:control_max], history, warm, t, margins, evidence,
                             max_soak_windows, treated, memo)
            t += settle * ws
        elif len(new) <= audit_devices and audit_rate > 0 and pre_most > 0:  # audits on the previous release first
            pre = _pre_swap(fleet, new, ([i for i in order if i not in treated and i not in new] + promoted)[
                :control_max], history, warm, t, margins, evidence, pre_most, treated, audit_rate, memo)
            t += pre[0] * ws
        start = t
        treated |= set(new)
        warm.update(dict.fromkeys(new, start + (evidence.warmup_windows + 1) * ws))
        raised = set(new) if len(new) <= audit_devices else set()
        waiting = [i for i in order if i not in treated]
        control = (waiting + promoted)[:control_max]
        pre_wave = [x for i in new for x in history[i] if start - evidence.baseline_s <= x["ts"] <= start]
        pre_control = [x for i in control for x in history[i]
                       if max(start - evidence.baseline_s, warm.get(i, -math.inf)) <= x["ts"] <= start]
        cache: dict[Any, Any] = {}
        for step in range(max_soak_windows):
            t += ws
            on = np.isin(np.arange(fleet.n), list(treated))
            rates = np.where(np.isin(np.arange(fleet.n), list(raised)), audit_rate, fleet.model.audit_rate)
            for i, x in enumerate(fleet.windows(t, on, rates)):
                history[i].append(x)
            if (step + 1) % look_every and step + 1 < max_soak_windows:
                continue
            arms = Arms(pre_wave, [x for i in new for x in history[i] if x["ts"] > start],
                        pre_control, [x for i in control for x in history[i] if x["ts"] > start])
            gates = evaluate(arms if control else None, margins=margins, evidence=evidence, waves=len(sizes), wave=w,
                             budget_ms=None, device_failures={}, crashes=0, fleet_request_rate=None,
                             cloud_capacity_rps=None, cache=cache, memo=memo, audited=bool(raised))
            looks += 1
            done = sum(int(x["requests"]) for x in arms.post_wave)
            if failed(gates):
                per_wave.append(done)
                windows.append(step + 1)
                return Outcome("rolled_back", w, failed(gates), per_wave[0], per_wave, looks, wave_windows=windows)
            if not open_gates(gates, audited=bool(raised)) and done >= margins.min_requests:
                break
        else:
            per_wave.append(done)
            windows.append(max_soak_windows)
            return Outcome("held", w, open_gates(gates, audited=bool(raised)), per_wave[0], per_wave, looks,
                           wave_windows=windows)
        per_wave.append(done)
        windows.append(step + 1)
    return Outcome("succeeded", len(sizes) - 1, [], per_wave[0], per_wave, looks,
                   [old_soak(fleet, ws_new) for ws_new in _wave_devices(order, sizes)], windows,
                   settle, *pre)


def _pre_swap(fleet: Fleet, new: list[int], control: list[int], history: dict[int, list[dict[str, Any]]],
              warm: dict[int, float], t: float, margins: Margins, evidence: Evidence, most: int, treated: set[int],
              audit_rate: float, memo: ObsMemo | None = None) -> tuple[int, int, int]:
    """As the engine's pre-swap audit phase: the windows a small wave's devices audit at `audit_rate` on the
    previous release (every window added to `history`) until the whole-stream gate's error from the baselines
    alone is within `gates.BASELINE_SE_SHARE` of its margin, at most `most`. Returns (windows, the wave's
    inferences over them, its audits over them)."""
    ws = fleet.model.window_s
    on = np.isin(np.arange(fleet.n), list(treated))
    rates = np.where(np.isin(np.arange(fleet.n), new), audit_rate, fleet.model.audit_rate)
    inferences = audits = 0
    mine = set(new)
    for k in range(most):
        now = t + k * ws
        pre_wave = [x for i in new for x in history[i] if now - evidence.baseline_s <= x["ts"] <= now]
        pre_control = [x for i in control for x in history[i]
                       if max(now - evidence.baseline_s, warm.get(i, -math.inf)) <= x["ts"] <= now]
        errors = baseline_errors(Arms(pre_wave, [], pre_control, []), margins=margins, evidence=evidence,
                                 audited=True, only=("audit_agreement",), memo=memo)
        ready = bool(errors) and all(g["ok"] for g in errors)
        if ready or (errors and not (errors[0].get("control_se") or math.inf) <= PRE_SWAP_REACH * errors[0]["limit"]):
            return k, inferences, audits
        for i, x in enumerate(fleet.windows(now + ws, on, rates)):
            history[i].append(x)
            if i in mine:
                inferences += int(x["requests"])
                audits += int(x["audits"])
    return most, inferences, audits


def _settle(fleet: Fleet, new: list[int], control: list[int], history: dict[int, list[dict[str, Any]]],
            warm: dict[int, float], t: float, margins: Margins, evidence: Evidence, most: int,
            treated: set[int], memo: ObsMemo | None = None) -> int:
    """As the engine's `_settle`: the windows the last wave waits (its devices still on the previous release, the
    earlier waves' on the release, every window added to `history`) until each gate's error from the baselines
    alone is within `gates.BASELINE_SE_SHARE` of its margin, at most `most`."""
    ws = fleet.model.window_s
    on = np.isin(np.arange(fleet.n), list(treated))
    for k in range(most):
        now = t + k * ws
        pre_wave = [x for i in new for x in history[i] if now - evidence.baseline_s <= x["ts"] <= now]
        pre_control = [x for i in control for x in history[i]
                       if max(now - evidence.baseline_s, warm.get(i, -math.inf)) <= x["ts"] <= now]
        if all(g["ok"] for g in baseline_errors(Arms(pre_wave, [], pre_control, []), margins=margins,
                                                evidence=evidence, memo=memo)):
            return k
        for i, x in enumerate(fleet.windows(now + ws, on, np.full(fleet.n, fleet.model.audit_rate))):
            history[i].append(x)
    return most


def _baselined(devices: list[int], history: dict[int, list[dict[str, Any]]], warm: dict[int, float], t: float,
               evidence: Evidence) -> list[int]:
    """The devices with a baseline at t (MIN_BASELINE_WINDOWS windows of MIN_WINDOW_REQUESTS inferences or more
    within baseline_s, past their warm-up on the release): those that can be a wave's control."""
    since = t - evidence.baseline_s
    return [i for i in devices if sum(
        1 for x in history[i] if max(since, warm.get(i, -math.inf)) <= x["ts"] <= t
        and int(x["requests"]) >= MIN_WINDOW_REQUESTS) >= MIN_BASELINE_WINDOWS]


OLD_SOAK = 200  # requests per device: the fixed soak before the gates were sequential


def _wave_devices(order: list[int], sizes: list[int]) -> list[list[int]]:
    return [order[a:b] for a, b in zip([0, *sizes[:-1]], sizes, strict=True)]


def old_soak(fleet: Fleet, devices: list[int]) -> int:
    """The inferences a wave ran under the old fixed soak: it was judged once every device of it had run 200
    requests on the release, so its slowest device sets the time and the wave's whole traffic over that time is
    the soak (expected counts, window by window)."""
    if not devices:
        return 0
    per_window = fleet.rate[devices] * fleet.model.window_s
    windows = math.ceil(OLD_SOAK / max(float(per_window.min()), 1e-9))
    return int(per_window.sum() * windows)


class ModelDevice(SimDevice):
    """A rollout device double (the swap contract over a real broker, rollout_device.py) whose windows come
    from a `Fleet` model: per-device levels, uneven traffic, shared-load spikes; a release named in
    `REGRESSING` (release digest -> regression) regresses while it runs."""

    model_fleet: Fleet | None = None
    index = 0
    regressing: dict[str, str] = {}  # noqa: RUF012  (shared by every device of a run, set by the bench)

    def figures(self) -> dict[str, Any]:
        fleet = self.model_fleet
        assert fleet is not None
        if not hasattr(self, "_gen"):
            self._gen = np.random.default_rng((fleet.seed, self.index))
        release = self.running or ""
        regression = self.regressing.get(release)
        w = fleet.window(self.index % fleet.n, time.time(), regression is not None, regression=regression,
                         rng=self._gen)
        keep = ("window_s", "requests", "escalation_rate", "compared", "tiers", "agreement", "degraded", "p50_ms",
                "p95_ms", "energy_mj_per_request", "audits", "audit_rate", "audit_disagreed", "crashes")
        return {k: w[k] for k in keep} | {"window_s": self.window_s}


def model_devices(fleet: Fleet, regressing: dict[str, str]) -> Callable[..., SimDevice]:
    """A `RolloutFleet(make_device=...)` factory: device k draws its windows from `fleet`'s device k."""
    counter = iter(range(10**9))

    def make(*args: Any, **kw: Any) -> SimDevice:
        dev = ModelDevice(*args, **kw)
        dev.model_fleet, dev.index, dev.regressing = fleet, next(counter), regressing
        return dev

    return make


def rate_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) two-sided interval of a rate seen k times in n runs: what 1 rollback in 100
    runs says of the false-rollback rate (0.03 % to 5.4 %), and why 300 runs are needed to bound it near 1 %."""
    if n <= 0:
        return 0.0, 1.0
    tail = (1 - level) / 2

    def cdf(p: float, upto: int) -> float:  # P(X <= upto) for X ~ Binomial(n, p)
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(upto + 1))

    def solve(f: Callable[[float], float]) -> float:  # the p in [0, 1] where the decreasing f crosses 0
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda p: cdf(p, k - 1) - (1 - tail))
    upper = 1.0 if k == n else solve(lambda p: cdf(p, k) - tail)
    return lower, upper


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    n = len(outcomes)
    by = {r: sum(o.result == r for o in outcomes) for r in ("succeeded", "rolled_back", "held")}
    canary = sorted(o.canary_inferences for o in outcomes if o.wave == 0 and o.result == "rolled_back")
    lo, hi = rate_interval(by["rolled_back"], n)
    return {"runs": n, **by, "rolled_back_ci95": [round(lo, 5), round(hi, 5)],
            "held_at": sorted(f"wave {o.wave}: {','.join(o.gates)}" for o in outcomes if o.result == "held"),
            "rolled_back_at": sorted(f"wave {o.wave}: {','.join(o.gates)}" for o in outcomes
                                     if o.result == "rolled_back" and o.wave > 0),
            "stopped_at_canary": sum(o.result == "rolled_back" and o.wave == 0 for o in outcomes),
            "canary_inferences_median": int(np.median(canary)) if canary else None,
            "canary_inferences_p90": int(np.percentile(canary, 90)) if canary else None,
            "failed_gates": sorted({g for o in outcomes for g in o.gates if g in STAT_GATES})}
