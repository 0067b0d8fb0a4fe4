"""The controller: which variant to run and which escalation threshold to use, as conditions change.

`choose(profiles, link, budget, config)` is the decision, a pure function over the operating-point
model of `edge_agent.plan.predict`: of every (variant, threshold) on the grid it keeps the most
accurate one that meets the p95 latency budget (with headroom), the mean energy budget and the
escalations-per-second cap (ties: less energy, then less latency). When none does, it keeps the
point closest to the budgets and names the budgets it violates.

`Controller` feeds that decision with measurements (edge latency and energy, round trips, cloud
failures, escalation and agreement rates), re-decides when they drift or the budget changes, and
applies hysteresis so that it does not flap: it switches only when the current point violates a
budget, or the new one is more accurate by a margin (or as accurate for clearly less energy).

Example:
    >>> controller = Controller(profiles, Budget(latency_ms=20), link=LinkProfile(rtt_ms=5))
    >>> controller.current.variant, controller.current.threshold
    >>> controller.observe_inference("int8", latency_ms=1.2, energy_mj=0.4)
    >>> controller.observe_request(escalated=False, agreed=None, total_latency_ms=1.9)
    >>> if (decision := controller.maybe_redecide()) is not None:
    ...     apply(decision)
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from edge_agent.budget import Budget, BudgetWindows
from edge_agent.plan import Conditions, Predictions, predict
from edge_agent.profiles import LinkProfile, LinkState, VariantProfile
from runtimes.errors import ConfigError

__all__ = ["Conditions", "Controller", "ControllerConfig", "Decision", "candidate_thresholds", "choose", "evaluate"]

log = logging.getLogger(__name__)

_DEFAULT_GRID = tuple(round(x, 3) for x in (*np.arange(0, 0.1, 0.01), *np.arange(0.1, 0.5, 0.025),
                                             *np.arange(0.5, 1.0001, 0.05)))


@dataclass(frozen=True)
class ControllerConfig:
    """How the controller decides and when it changes its mind.

    Args:
        escalation_grid: escalation rates whose validation thresholds are the candidate thresholds.
        latency_headroom: plan p95 latency at most this share of the budget (noise margin).
        accuracy_margin: switch for accuracy alone only when the new point is better by this much.
        violation_tolerance: the current point is kept while it is predicted over the budgets by at
            most this share (summed relative excess), unless a feasible point is as accurate.
        energy_margin: switch at the same accuracy only when it saves this share of energy or p95.
        tie_tolerance: accuracies closer than this are equal (then less energy wins).
        min_observations: requests (or samples) before a measured rate or latency is trusted.
        redecide_interval_s: re-decide at least this often while requests flow.
        redecide_gap_s: a drift re-decides at most this often (the cloud going down or coming back,
            and a budget change, at once): each re-decision evaluates every variant at every
            threshold, ~10 ms of a core, and one per observation that flags a drift would take the
            interpreter from the event loop the agent's escalation timers run on.
        rtt_drift: relative move of the RTT EWMA or high quantile that triggers a re-decision...
        rtt_drift_abs_ms: ...when it is also at least this many milliseconds.
        rtt_rebase_keep: round trips kept when the RTT EWMA drifted (the rest are forgotten, so
            the p95 model follows a new link within a few escalations rather than hundreds).
        switch_headroom: a switch for accuracy alone (or for energy at the same accuracy) needs the new
            point to fit the planned p95 and energy with this share to spare: with the tolerance on
            the current point, the band between them keeps the controller from flapping between a
            point just over a budget and one just under it as predictions move with the noise.
        latency_drift: relative move of the device speed (edge latency vs its baseline)...
        latency_drift_abs_ms: ...when the edge latency also moved by this many milliseconds.
        energy_drift: relative move of a measured inference energy (modeled figures are a function
            of the measured latency, whose own drift check covers them: they are not evidence).
        energy_headroom: plan mean energy at most this share of the energy budget.
        energy_z: a variant switch for energy alone needs the measured difference to exceed this
            many standard errors (modeled energy never switches a variant on its own).
        accuracy_margin_rel: ...or better by this share of the current error rate, if less...
        accuracy_margin_min: ...but never by less than this (predicted accuracies carry noise).
        accuracy_z: a threshold move for accuracy alone needs its predicted gain to exceed this many
            standard errors of the fitted cloud accuracy over the escalations it adds or removes: a
            refit that moves the cloud by its own noise is not a reason to switch.
        window_s: observed p95 latency and mean energy are held per window of this many seconds.
        escalation_z: binomial tolerance (in standard deviations) on the observed escalation rate
            and on the edge/cloud agreement rate.
        probe_escalation_rate: while a cloud is configured, prefer points that escalate at least
            this share, so the link stays measured (a recovered cloud or a faster link is noticed).
        down_probe_escalation_rate: the same while the cloud is marked down: escalations then cost
            nothing while the breaker is open and little when refused, and asking for more of them
            brings the breaker's probe, and the answers in a row that mark the link up, sooner.
        history: decisions kept in `Controller.decisions`.
    """

    escalation_grid: tuple[float, ...] = _DEFAULT_GRID
    latency_headroom: float = 0.9
    accuracy_margin: float = 0.002
    violation_tolerance: float = 0.05
    energy_margin: float = 0.1
    tie_tolerance: float = 2e-4
    min_observations: int = 20
    redecide_interval_s: float = 1.0
    redecide_gap_s: float = 0.25
    rtt_drift: float = 0.5
    rtt_drift_abs_ms: float = 2.0
    rtt_rebase_keep: int = 32
    switch_headroom: float = 0.1
    latency_drift: float = 0.3
    latency_drift_abs_ms: float = 1.0
    energy_drift: float = 0.25
    energy_headroom: float = 0.92
    energy_z: float = 3.0
    accuracy_margin_rel: float = 0.1
    accuracy_margin_min: float = 5e-4
    accuracy_z: float = 2.0
    window_s: float = 1.0
    escalation_z: float = 3.0
    probe_escalation_rate: float = 0.03
    down_probe_escalation_rate: float = 0.1
    history: int = 256

    def __post_init__(self) -> None:
        grid = tuple(float(e) for e in self.escalation_grid)
        if not grid or any(not 0 <= e <= 1 for e in grid):
            msg = f"ControllerConfig escalation_grid must hold rates in [0, 1], got {self.escalation_grid!r}"
            raise ConfigError(msg)
        object.__setattr__(self, "escalation_grid", grid)
        if not (0 < self.latency_headroom <= 1 and 0 < self.energy_headroom <= 1):
            msg = (f"ControllerConfig latency_headroom and energy_headroom must be in (0, 1], got "
                   f"{self.latency_headroom!r}, {self.energy_headroom!r}")
            raise ConfigError(msg)
        if not (self.window_s > 0 and self.energy_z >= 0 and self.accuracy_z >= 0 and self.accuracy_margin_rel >= 0):
            msg = "ControllerConfig window_s must be > 0, energy_z, accuracy_z and accuracy_margin_rel >= 0"
            raise ConfigError(msg)
        if not (0 <= self.switch_headroom < 1 and self.rtt_rebase_keep >= 0):
            msg = (f"ControllerConfig switch_headroom must be in [0, 1) and rtt_rebase_keep >= 0, got "
                   f"{self.switch_headroom!r}, {self.rtt_rebase_keep!r}")
            raise ConfigError(msg)
        if self.min_observations < 1 or self.history < 1 or self.redecide_interval_s <= 0 or self.redecide_gap_s < 0:
            msg = ("ControllerConfig min_observations and history must be >= 1, redecide_interval_s > 0 and "
                   "redecide_gap_s >= 0")
            raise ConfigError(msg)


@dataclass(frozen=True)
class Decision:
    """One operating point: what to run, what it is predicted to give, and why.

    Energy figures are in millijoules and carry `energy_label` (measured or modeled).
    `shortfall` is 0 when feasible, else the summed relative excess over the violated budgets.
    `edge_accuracy_escalated` is the validation accuracy of the edge on the inputs this point
    escalates (what edge/cloud agreement is compared with).
    """

    variant: str
    threshold: float
    predicted_accuracy: float
    predicted_p95_ms: float
    predicted_energy_mj: float
    predicted_escalation_rate: float
    feasible: bool
    violated: tuple[str, ...]
    reason: str
    inputs: Mapping[str, Any] = field(default_factory=dict)
    energy_label: str = "modeled"
    predicted_escalations_per_s: float = 0.0
    edge_accuracy_escalated: float = 1.0
    shortfall: float = 0.0
    trigger: str = "initial"
    at: float = 0.0

    @property
    def key(self) -> tuple[str, float]:
        return self.variant, self.threshold

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["violated"] = list(self.violated)
        doc["inputs"] = dict(self.inputs)
        for k, v in doc.items():
            if isinstance(v, float):
                doc[k] = round(v, 6) if math.isfinite(v) else None
        return doc



def candidate_thresholds(profile: VariantProfile, link: LinkState | None, config: ControllerConfig) -> np.ndarray:
    """The thresholds considered for `profile`: the grid's, or only "never escalate" without a cloud."""
    return profile.thresholds(config.escalation_grid if link is not None else (0.0,))


def _targets(budget: Budget, config: ControllerConfig, conditions: Conditions) -> tuple[float, float | None]:
    """The p95 latency and mean energy planned for: the budgets less headroom and what windows taught."""
    latency = budget.latency_ms * config.latency_headroom * conditions.latency_scale
    energy = (None if budget.energy_mj is None
              else budget.energy_mj * config.energy_headroom * conditions.energy_scale)
    return latency, energy


def _latency_limit(p: Predictions, budget: Budget, target: float, conditions: Conditions) -> float:
    """The p95 a point may plan for. The headroom under the budget is for what the model cannot be
    sure of, the edge's own latency and the round trips. Where the agent's timer ends every
    escalation at a deadline inside the budget (`Conditions.deadline_guard_ms`), an escalation that
    is not answered by then is abandoned and answered locally at that deadline: a tail made of such
    escalations ends there, and it needs no further headroom, as long as the edge alone keeps its own."""
    if conditions.deadline_guard_ms is None or p.edge_p95_ms > target:
        return target
    return max(target, conditions.deadline_ms(budget))


def _assess(p: Predictions, budget: Budget, config: ControllerConfig,
            conditions: Conditions) -> tuple[np.ndarray, list[list[str]]]:
    """Shortfall (0 = feasible; else summed relative excess) and violated budget names per threshold."""
    target, energy_target = _targets(budget, config, conditions)
    checks = [("latency", p.p95_ms, _latency_limit(p, budget, target, conditions))]
    if energy_target is not None:
        checks.append(("energy", p.energy_held_mj, energy_target))
    if budget.max_escalations_per_s is not None:
        checks.append(("escalations", p.escalations_per_s, budget.max_escalations_per_s))
    shortfall = np.zeros_like(p.accuracy)
    names: list[list[str]] = [[] for _ in p.accuracy]
    for name, value, limit in checks:
        over = value > limit * (1 + 1e-9) + 1e-12
        shortfall += np.where(over, (value - limit) / max(limit, 1e-3 if name != "escalations" else 1.0), 0.0)
        for i in np.flatnonzero(over):
            names[i].append(name)
    return shortfall, names


def _decision(p: Predictions, i: int, shortfall: float, violated: list[str], reason: str,
              profile: VariantProfile, link: LinkState | None, budget: Budget, config: ControllerConfig,
              conditions: Conditions, **extra: Any) -> Decision:
    latency_target, energy_target = _targets(budget, config, conditions)
    inputs = {"budget": asdict(budget), "latency_target_ms": latency_target, "energy_target_mj": energy_target,
              "latency_limit_ms": _latency_limit(p, budget, latency_target, conditions),
              "deadline_ms": conditions.deadline_ms(budget), "energy_held_mj": float(p.energy_held_mj[i]),
              "escalations_answered": p.answered,
              "link": link.to_json() if link is not None else None, "conditions": asdict(conditions),
              "variant": {"id": profile.id, "p50_ms": profile.latency.quantile(0.5),
                          "p95_ms": profile.latency.quantile(0.95), "energy_mj": profile.energy_mj,
                          "energy_label": profile.energy_label, "validation_size": profile.validation_size},
              **extra}
    return Decision(p.variant, float(p.thresholds[i]), float(p.accuracy[i]), float(p.p95_ms[i]),
                    float(p.energy_mj[i]), float(p.escalation[i]), not violated, tuple(violated), reason,
                    inputs, p.energy_label, float(p.escalations_per_s[i]), float(p.edge_accuracy_escalated[i]),
                    float(shortfall))


ANSWERED_MIN = 0.01  # escalations answered less often than this win nothing worth pricing


def _proven_saving(preds: Sequence[Predictions], near: np.ndarray, best: int) -> int:
    """`best`, or the tied point of its variant that escalates most where escalations answer: a band
    of validation inputs the edge got right is no evidence that it never errs there (a thousand inputs
    cannot show a 0.1 % difference), so escalating less for energy alone is a saving not proven free.
    When escalations win nothing (the cloud down, every answer late) accuracy is equal in fact."""
    start = 0
    for p in preds:
        end = start + p.thresholds.size
        if start <= best < end and p.answered > ANSWERED_MIN:
            tied = np.flatnonzero(near[start:end])
            return start + int(tied[np.argmax(p.escalation[tied])])
        start = end
    return best


def choose(profiles: Sequence[VariantProfile], link: LinkState | None, budget: Budget,
           config: ControllerConfig | None = None, *, conditions: Conditions | None = None) -> Decision:
    """The best (variant, threshold) for these profiles, link and budget; pure and deterministic.

    Args:
        profiles: the variants to choose from.
        link: the link snapshot (`LinkProfile.state()`), or None when there is no cloud.
        budget: the budgets to keep.
        config: grid, headroom and tie rules (defaults: `ControllerConfig()`).
        conditions: measured request rate, agent overhead and device slowdown.

    Raises:
        ConfigError: no profiles.
    """
    if not profiles:
        msg = "choose() needs at least one variant profile"
        raise ConfigError(msg)
    config, conditions = config or ControllerConfig(), conditions or Conditions()
    preds = [predict(p, candidate_thresholds(p, link, config), link, budget, conditions) for p in profiles]
    assessed = [_assess(p, budget, config, conditions) for p in preds]
    index = [(v, i) for v, p in enumerate(preds) for i in range(p.thresholds.size)]
    acc = np.concatenate([p.accuracy for p in preds])
    energy = np.concatenate([p.energy_mj for p in preds])
    p95 = np.concatenate([p.p95_ms for p in preds])
    esc = np.concatenate([p.escalation for p in preds])
    short = np.concatenate([a[0] for a in assessed])
    feasible = short == 0
    pool = feasible
    if link is not None and config.probe_escalation_rate > 0:
        probe = config.probe_escalation_rate if link.up else max(config.probe_escalation_rate,
                                                                 config.down_probe_escalation_rate)
        probing = feasible & (esc >= probe - 1e-9)
        pool = probing if probing.any() else feasible
    if pool.any():
        near = pool & (acc >= acc[pool].max() - config.tie_tolerance)
        cands = np.flatnonzero(near)
        best = _proven_saving(preds, near, int(cands[np.lexsort((p95[cands], energy[cands]))[0]]))
    else:
        least = short.min()
        cands = np.flatnonzero(short <= least + 1e-9)
        best = int(cands[np.argmax(acc[cands])])
    v, i = index[best]
    violated = assessed[v][1][i]
    if violated:
        reason = (f"no point meets the {' and '.join(violated)} budget; closest of {len(index)} "
                  f"(shortfall {short[best]:.3g})")
    else:
        latency_target, energy_target = _targets(budget, config, conditions)
        reason = (f"most accurate of {int(feasible.sum())} feasible points out of {len(index)} "
                  f"(p95 <= {latency_target:.3g} ms"
                  + (f", energy <= {energy_target:.3g} mJ" if energy_target is not None else "")
                  + (f", <= {budget.max_escalations_per_s:g} escalations/s"
                     if budget.max_escalations_per_s is not None else "") + ")")
    return _decision(preds[v], i, float(short[best]), violated, reason, profiles[v], link, budget, config,
                     conditions, candidates=len(index), feasible_candidates=int(feasible.sum()))


def evaluate(profile: VariantProfile, threshold: float, link: LinkState | None, budget: Budget,
             config: ControllerConfig | None = None, *, conditions: Conditions | None = None) -> Decision:
    """The predictions for one given (variant, threshold), as a `Decision` record."""
    config, conditions = config or ControllerConfig(), conditions or Conditions()
    p = predict(profile, np.array([threshold]), link, budget, conditions)
    short, names = _assess(p, budget, config, conditions)
    reason = "current point" + (f" violates the {' and '.join(names[0])} budget" if names[0] else " meets the budgets")
    return _decision(p, 0, float(short[0]), names[0], reason, profile, link, budget, config, conditions)


class Controller:
    """Keeps the most accurate (variant, threshold) inside the budgets as measurements arrive.

    The agent reports every inference, escalation and request, and calls `maybe_redecide()` after
    each request; that is cheap unless a drift was detected or `config.redecide_interval_s` passed.
    Not thread-safe: call it from the agent's event loop.

    Args:
        profiles: one profile per variant of the ladder.
        budget: the budgets to keep; change them with `set_budget`.
        link: the link to the cloud, or None for an edge-only device.
        config: thresholds of the drift checks and of the hysteresis.
        clock: monotonic seconds (injectable for tests).

    Example:
        >>> c = Controller(profiles, Budget(latency_ms=20), link=LinkProfile(rtt_ms=5))
        >>> c.observe_escalation(rtt_ms=61.0, ok=True, bytes_sent=300)
        >>> c.maybe_redecide()      # a Decision when the operating point changed, else None
    """

    def __init__(self, profiles: Sequence[VariantProfile], budget: Budget, *, link: LinkProfile | None = None,
                 config: ControllerConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.profiles = tuple(profiles)
        self._by_id = {p.id: p for p in self.profiles}
        if not self.profiles or len(self._by_id) != len(self.profiles):
            msg = f"Controller needs at least one profile and unique variant ids, got {[p.id for p in profiles]}"
            raise ConfigError(msg)
        self.config = config or ControllerConfig()
        self.budget, self.link, self._clock = budget, link, clock
        self.decisions: deque[Decision] = deque(maxlen=self.config.history)
        self._pending: dict[str, None] = {}
        self._ratios: deque[float] = deque(maxlen=32)
        self._overheads: deque[float] = deque(maxlen=64)
        self._arrivals: deque[float] = deque(maxlen=256)
        self._last_inference_ms: float | None = None
        self._rtt_seen = 0  # answered escalations since the last decision
        self._redecided_at, self.redecisions = -math.inf, 0
        # set by an agent whose timer abandons escalations this long before the deadline (`Conditions`)
        self.deadline_guard_ms: float | None = None
        # observed p95 latency and mean energy per window, against the budgets (`budget.BudgetWindows`)
        self.latency_windows = BudgetWindows("p95", window_s=self.config.window_s, calm=20)
        # energy is planned from a model of it (modeled figures, priors of variants not run yet): a cut made by
        # its error comes back after a few calm windows, by the room they left
        self.energy_windows = BudgetWindows("mean", window_s=self.config.window_s, calm=3, max_loosen=1.25)
        self.current = self._commit(self._choose(), "initial")

    # -- measurements ----------------------------------------------------------------------------
    def observe_inference(self, variant: str, latency_ms: float, energy_mj: float | None = None, *,
                          energy_label: str | None = None) -> None:
        """One edge inference of `variant`: its latency and energy (labelled measured or modeled)."""
        p = self._by_id.get(variant)
        if p is None:
            return
        p.observe_latency(latency_ms)
        if energy_mj is not None and math.isfinite(energy_mj):
            p.observe_energy(energy_mj, energy_label)
        self._last_inference_ms = latency_ms
        if variant != self.current.variant:
            return
        # device speed: this variant's latency against its baseline (the prior or the warm-up benchmark)
        self._ratios.append(latency_ms / max(p.baseline_p50_ms, 1e-9))
        if len(self._ratios) < min(self._ratios.maxlen or 1, self._min_obs):
            return
        speed = statistics.median(self._ratios)
        if math.isnan(self._ref["slowdown"]):  # first samples after a switch of variant set the reference
            self._ref["slowdown"] = speed
        elif (abs(speed / self._ref["slowdown"] - 1) > self.config.latency_drift
              and abs(speed - self._ref["slowdown"]) * p.baseline_p50_ms > self.config.latency_drift_abs_ms):
            self._flag("device speed")
            p.latency.rebase(len(self._ratios))
        # a modeled figure is the measured latency times a fixed power: the latency checks cover it,
        # and its noise is no evidence that the energy moved
        if (_measured(p.energy_label)
                and abs(p.energy_mj / max(self._ref["energy"], 1e-12) - 1) > self.config.energy_drift):
            self._flag("inference energy")

    def observe_escalation(self, rtt_ms: float | None, ok: bool, bytes_sent: int = 0, *,
                           elapsed_ms: float | None = None, attempted: bool | None = None,
                           timeout: bool = False) -> None:
        """One escalation: its round trip (None when it failed or timed out) and request size.

        Args:
            rtt_ms: the round trip of an answered escalation; None for a failure or timeout (or,
                with ok=False, how long the edge waited before giving up).
            ok: the cloud answered in time.
            bytes_sent: request size.
            elapsed_ms: how long a failed escalation made the edge wait (improves the latency model).
            attempted: False when the agent did not send it (breaker open, no time left, rate cap):
                that says nothing new about the link and is ignored. By default a failure with no
                round trip, no wait and no bytes counts as not sent.
            timeout: the failure was the deadline passing (a slow link), not the cloud refusing.
        """
        if self.link is None:
            return
        if attempted is None:
            attempted = ok or rtt_ms is not None or elapsed_ms is not None or bytes_sent > 0
        if not attempted:
            return
        for event in self.link.observe(rtt_ms, ok, bytes_sent, elapsed_ms, timeout=timeout):
            self._flag(f"cloud {event}")
        if not ok or rtt_ms is None:
            return
        self._rtt_seen += 1
        cfg, ewma = self.config, self.link.rtt.ewma
        if abs(ewma - self._ref["rtt"]) > max(cfg.rtt_drift * self._ref["rtt"], cfg.rtt_drift_abs_ms):
            self._flag("round trip")
            # the last `rtt_rebase_keep` round trips stay: with a handful, the high quantile would be
            # the largest of them, so one load spike would read as a slow link and flip the decision
            self.link.rebase(cfg.rtt_rebase_keep)
        # the high quantile is judged once enough round trips came since the last decision
        high = self.link.rtt.quantile(self.link.high_quantile)
        if (self._rtt_seen >= self._min_obs and len(self.link.rtt) >= self._min_obs
                and abs(high - self._ref["rtt_high"]) > max(cfg.rtt_drift * self._ref["rtt_high"],
                                                           cfg.rtt_drift_abs_ms)):
            self._flag("round-trip high quantile")

    def observe_request(self, escalated: bool, agreed: bool | None, total_latency_ms: float, *,
                        score: float | None = None, variant: str | None = None,
                        energy_mj: float | None = None) -> None:
        """One finished request.

        Args:
            escalated: the policy asked for the cloud (whether or not the cloud answered).
            agreed: on an answered escalation, whether the cloud's answer equals the edge's.
            total_latency_ms: end-to-end latency of the request.
            score: the policy's score of the edge output (lets the escalation curve follow drift).
            variant: the variant that answered (default: the current one). A request of another known
                variant (run before a switch, reported after it) credits its score to that variant
                and is left out of the checks of the current operating point.
            energy_mj: the request's energy (inference, radio, waiting), for the per-window budget.
        """
        now = self._clock()
        self._arrivals.append(now)
        # every request counts for the windows, whichever variant answered: that is what the device spent
        if self.latency_windows.add(now, total_latency_ms, self.budget.latency_ms):
            self._flag("observed p95 over budget" if self.latency_windows.scale < self._scales[0]
                       else "observed p95 back under budget")
        if (energy_mj is not None and self.budget.energy_mj is not None
                and self.energy_windows.add(now, energy_mj, self.budget.energy_mj)):
            self._flag("observed energy over budget" if self.energy_windows.scale < self._scales[1]
                       else "observed energy back under budget")
        if not escalated and self._last_inference_ms is not None:
            self._overheads.append(max(0.0, total_latency_ms - self._last_inference_ms))
        owner = variant if variant is not None and variant in self._by_id else self.current.variant
        if score is not None:
            self._by_id[owner].observe_score(score)
        if owner != self.current.variant:
            return
        self._n += 1
        self._n_esc += bool(escalated)
        if escalated and agreed is not None and self.link is not None:
            # the edge's validation accuracy at this input's score, where known: what agreement is compared with
            edge = (self._by_id[owner].accuracy_at(score) if score is not None
                    else self.current.edge_accuracy_escalated)
            self.link.observe_agreement(agreed, edge)
            self._n_agree += 1
            self._k_agree += bool(agreed)
        m, z = self._min_obs, self.config.escalation_z
        if self._n >= m and _outside(self._n_esc, self._n, self.current.predicted_escalation_rate, z):
            self._flag("escalation rate")
        if self._n_agree >= m and _outside(self._k_agree, self._n_agree, self._ref["agreement"], z):
            self._flag("agreement")

    # -- decisions -------------------------------------------------------------------------------
    def set_budget(self, budget: Budget) -> Decision | None:
        """Change the budgets now; returns the new decision when the operating point changed."""
        if self.link is not None and budget.latency_ms > self.budget.latency_ms:
            self.link.forget_unanswered()  # cut at the old deadline: no evidence against the new one
        self.budget = budget
        for held in (self.latency_windows, self.energy_windows):  # what windows taught was about the old budget
            held.reset()
            held.scale = 1.0
        self._flag("budget")
        return self._redecide()

    def maybe_redecide(self) -> Decision | None:
        """Re-decide if a drift was flagged or the interval passed; the new decision if it changed."""
        now = self._clock()
        if self._pending:
            urgent = any(r.startswith("cloud ") for r in self._pending)
            if not urgent and now - self._redecided_at < self.config.redecide_gap_s:
                return None
        elif self._n == 0 or now - self.current.at < self.config.redecide_interval_s:
            return None
        return self._redecide()

    def conditions(self) -> Conditions:
        """The measured request rate, agent overhead and device slowdown in force now."""
        span = self._arrivals[-1] - self._arrivals[0] if len(self._arrivals) > 1 else 0.0
        rate = (len(self._arrivals) - 1) / span if len(self._arrivals) >= self._min_obs and span > 0 else None
        overhead = float(np.mean(self._overheads)) if self._overheads else 0.0
        slowdown = statistics.median(self._ratios) if len(self._ratios) >= 5 else 1.0
        current = getattr(self, "current", None)
        shift = 1.0
        if current is not None and (p := self._by_id[current.variant]).live_scores:
            live = float(p.curve(np.array([-np.inf]))[1][0])  # reweighted accuracy, nothing escalated
            shift = min(max((1 - live) / max(1 - p.accuracy, 1e-6), 0.25), 4.0)
        return Conditions(request_rate=rate, edge_overhead_ms=overhead, slowdown=slowdown,
                          current_variant=current.variant if current is not None else None,
                          shift_error_scale=shift, latency_scale=self.latency_windows.scale,
                          energy_scale=self.energy_windows.scale, deadline_guard_ms=self.deadline_guard_ms,
                          window_requests=rate * self.config.window_s if rate is not None else None)

    def deadline_scale(self) -> float:
        """The share of the latency budget the agent's escalation deadline is cut from: below 1 after
        observed windows went over the budget (the plan and the timer tighten together)."""
        return self.latency_windows.scale

    @property
    def _min_obs(self) -> int:
        return self.config.min_observations

    def _flag(self, reason: str) -> None:
        self._pending.setdefault(reason, None)

    def _choose(self) -> Decision:
        link = self.link.state() if self.link is not None else None
        return choose(self.profiles, link, self.budget, self.config, conditions=self.conditions())

    def _redecide(self) -> Decision | None:
        self._redecided_at, self.redecisions = self._clock(), self.redecisions + 1
        trigger = ", ".join(self._pending) or "periodic"
        self._pending.clear()
        link = self.link.state() if self.link is not None else None
        cond = self.conditions()
        cand = choose(self.profiles, link, self.budget, self.config, conditions=cond)
        cur = evaluate(self._by_id[self.current.variant], self.current.threshold, link, self.budget, self.config,
                       conditions=cond)
        why = self._why_switch(cur, cand)
        if not why and cand.feasible and cand.key != cur.key and not self._spare(cand):
            # the best point is too close to a budget to move to for accuracy alone: the best one that
            # leaves the headroom may still beat the current point
            keep = 1 - self.config.switch_headroom
            tight = replace(cond, latency_scale=cond.latency_scale * keep, energy_scale=cond.energy_scale * keep)
            alt = choose(self.profiles, link, self.budget, self.config, conditions=tight)
            alt = evaluate(self._by_id[alt.variant], alt.threshold, link, self.budget, self.config, conditions=cond)
            if alt.feasible and (alt_why := self._why_switch(cur, alt)):
                note = (f"the best point with {self.config.switch_headroom:.0%} of the budgets to spare "
                        f"(the best, {cand.variant}@{cand.threshold:.4g}, is closer)")
                cand, why = replace(alt, reason=note), alt_why
        chosen = cand if why else replace(cur, reason=f"kept: {cur.reason}; best alternative "
                                          f"{cand.variant}@{cand.threshold:.4g} acc {cand.predicted_accuracy:.4f}")
        if why:
            chosen = replace(chosen, reason=f"{why}; {chosen.reason}")
            log.info("controller: %s@%.4g -> %s@%.4g (%s: %s)", cur.variant, cur.threshold, chosen.variant,
                     chosen.threshold, trigger, why)
        changed = chosen.key != self.current.key
        self._commit(chosen, trigger, record=changed or trigger != "periodic")
        return self.current if changed else None

    def _why_switch(self, cur: Decision, cand: Decision) -> str:
        cfg = self.config
        if cand.key == cur.key:
            return ""
        if not cur.feasible and cur.shortfall > cfg.violation_tolerance:
            if cand.feasible:
                return f"current point violates the {' and '.join(cur.violated)} budget"
            return "closer to the budgets" if cand.shortfall < cur.shortfall - 1e-9 else ""
        if not cand.feasible:
            return ""
        probe = max(cfg.probe_escalation_rate, cfg.down_probe_escalation_rate)
        cloud_down = self.link is not None and not self.link.up
        if (cloud_down and cur.predicted_escalation_rate < probe - 1e-9
                and cand.predicted_escalation_rate > cur.predicted_escalation_rate + 1e-9):
            # down, every point predicts the same accuracy and the current one would be kept: but only
            # escalations bring the answers in a row that mark the cloud up again
            return "the cloud is down: probe it more"
        if cloud_down and cand.predicted_escalation_rate < min(probe, cur.predicted_escalation_rate) - 1e-9:
            return ""  # under the probes the rule above would ask for again at the next re-decision
        if not cur.feasible and cand.predicted_accuracy >= cur.predicted_accuracy - cfg.accuracy_margin:
            return f"current point is over the {' and '.join(cur.violated)} budget (within tolerance)"
        if not self._spare(cand):
            return ""
        margin = max(min(cfg.accuracy_margin, cfg.accuracy_margin_rel * (1 - cur.predicted_accuracy)),
                     min(cfg.accuracy_margin_min, cfg.accuracy_margin), cfg.tie_tolerance)
        if cand.predicted_accuracy > cur.predicted_accuracy + margin + self._cloud_noise(cur, cand):
            return f"accuracy {cur.predicted_accuracy:.4f} -> {cand.predicted_accuracy:.4f}"
        if cand.predicted_accuracy < cur.predicted_accuracy - cfg.tie_tolerance:
            return ""
        if (cand.variant == cur.variant and cand.predicted_escalation_rate < cur.predicted_escalation_rate
                and float(cand.inputs.get("escalations_answered", 0.0)) > ANSWERED_MIN):
            return ""  # escalating less for energy alone: not proven free (`_proven_saving`)
        # the cloud down: escalations win nothing and every point is as accurate in fact; one that
        # escalates well beyond what probing needs gives way at once (near the probe rate, where the
        # predicted rates move with the live scores, the margin still keeps it from flapping)
        down = (cloud_down and cand.variant == cur.variant
                and cur.predicted_escalation_rate > 1.5 * probe >= cand.predicted_escalation_rate)
        if (cand.predicted_energy_mj < cur.predicted_energy_mj * (1 - (0.0 if down else cfg.energy_margin))
                and self._energy_evidence(cur.variant, cand.variant)):
            return f"same accuracy, energy {cur.predicted_energy_mj:.3g} -> {cand.predicted_energy_mj:.3g} mJ"
        if cand.predicted_p95_ms < cur.predicted_p95_ms * (1 - cfg.energy_margin):
            return f"same accuracy, p95 {cur.predicted_p95_ms:.3g} -> {cand.predicted_p95_ms:.3g} ms"
        return ""

    def _cloud_noise(self, cur: Decision, cand: Decision) -> float:
        """How much two thresholds of one variant may differ in predicted accuracy by the fitted cloud
        accuracy's own uncertainty alone: `accuracy_z` standard errors (its agreements and prior) over
        the escalations one point adds to the other, the share the cloud answers in time."""
        link = cand.inputs.get("link")
        if cand.variant != cur.variant or self.link is None or not link:
            return 0.0
        c, n = float(link["cloud_accuracy"]), float(link["agreement_n"]) + self.link.cloud_prior_strength
        moved = abs(cand.predicted_escalation_rate - cur.predicted_escalation_rate)
        answered = float(cand.inputs.get("escalations_answered", 0.0))
        return self.config.accuracy_z * moved * answered * math.sqrt(c * (1 - c) / max(n, 1.0))

    def _spare(self, cand: Decision) -> bool:
        """Whether `cand` fits the planned p95 latency and energy with `switch_headroom` to spare."""
        keep = 1 - self.config.switch_headroom
        latency, energy = (float(cand.inputs.get(k) or math.inf) for k in ("latency_target_ms", "energy_target_mj"))
        # a tail the agent's timer ends (the limit above the target) is not noise: it needs no spare room
        enforced = float(cand.inputs.get("latency_limit_ms") or 0.0) > latency
        return ((cand.predicted_p95_ms <= latency * keep + 1e-9
                 or (enforced and cand.predicted_p95_ms <= float(cand.inputs["latency_limit_ms"]) + 1e-9))
                and (cand.inputs.get("energy_target_mj") is None or cand.predicted_energy_mj <= energy * keep + 1e-9))

    def _energy_evidence(self, current: str, other: str) -> bool:
        """Whether an energy difference between two variants may switch between them: on the same
        variant (a threshold move) always; across variants only on measured figures whose difference
        beats `energy_z` standard errors."""
        if current == other:
            return True
        a, b = self._by_id[current], self._by_id[other]
        if not (_measured(a.energy_label) and _measured(b.energy_label)):
            return False
        se = math.hypot(a.energy_stderr(), b.energy_stderr())
        return math.isfinite(se) and abs(a.energy_mj - b.energy_mj) > self.config.energy_z * se

    def _commit(self, decision: Decision, trigger: str, *, record: bool = True) -> Decision:
        decision = replace(decision, trigger=trigger, at=self._clock())
        if self.decisions and decision.variant != self.current.variant:
            self._ratios.clear()  # ratios of another variant are not comparable (fixed per-request costs)
            self._by_id[self.current.variant].live_scores.clear()  # they will be stale when it runs again
        self.current = decision
        self._scales = (self.latency_windows.scale, self.energy_windows.scale)
        if record:
            self.decisions.append(decision)
        self._n = self._n_esc = self._n_agree = self._k_agree = self._rtt_seen = 0
        link = decision.inputs.get("link") or {}
        p = self._by_id[decision.variant]
        self._ref = {"rtt": self.link.rtt.ewma if self.link else 0.0,
                     "rtt_high": self.link.rtt.quantile(self.link.high_quantile) if self.link else 0.0,
                     # at start the baseline itself is the reference; after a switch, the new variant's first samples
                     "slowdown": (statistics.median(self._ratios) if len(self._ratios) >= 5
                                  else 1.0 if trigger == "initial" else math.nan),
                     "energy": p.energy_mj,
                     "agreement": float(link.get("cloud_accuracy") or 1.0)
                     * (1 - (1 - decision.edge_accuracy_escalated) * float(link.get("edge_error_scale") or 1))}
        return decision


def _outside(k: int, n: int, p: float, z: float) -> bool:
    """Whether k successes in n trials are further than z binomial standard deviations from rate p."""
    p = min(max(p, 0.0), 1.0)
    return abs(k / n - p) > z * math.sqrt(max(p * (1 - p), 0.25 / n) / n) + 0.5 / n


def _measured(label: str) -> bool:
    return str(label).startswith("measured")
