"""The controller's decision rule, as pure functions a reader can follow.

**The rule.** Of every (variant, threshold, wire encoding) on the grid, take the one with the highest
expected accuracy (`plan.predict`) among those that keep

- the latency budget: the predicted p95 (a mixture of edge time, answered round trips and escalations
  the agent's timer ends at its deadline) at most `latency_headroom` x the budget x what the observed
  windows taught (`budget.BudgetWindows`: a 1-s window whose p95 went over cuts the target by 15 %).
  The p95 is held with about 95 % confidence per window (the bench measures the share of windows over);
- the energy budget: the predicted mean energy per request at most `energy_headroom` x the budget. The
  plan's two terms are calibrated on every request, with or without an energy budget: its inference
  by the observed over the modeled energy of the last 256 inferences, its escalations by what the
  last 256 escalations added to their requests over what the model charges each (its bytes and its
  own round trip), so a model wrong by a share of either is right at every threshold and a budget set
  later starts calibrated (`evidence.PartCalibration`; a ratio of whole requests, learned at one
  threshold, would not carry to another);
- the cap on escalations per second, when one is set;
- and, where a cloud is configured, escalating at least `probe_escalation_rate` (at least
  `down_probe_escalation_rate` while the link is down), so that live escalations keep measuring it.

The wire encodings are those the agent's encoder measured on a real request (`encoding.WireOption`:
its bytes and encode time); each one moves an escalation's round trip by its bytes over the link's
measured bandwidth plus its encode time, and its radio energy by its bytes, so a smaller encoding can
make a higher threshold fit the latency or energy budget. Without an encoder that may choose, the
requests go as built and only the (variant, threshold) grid is searched.

**Ties** (`tied`): a point is as accurate as the best when the accuracy it gives up cannot be told
from no difference. Two thresholds of one (variant, encoding) differ by what escalating the band of
inputs between them gains, and that gain is estimated from the band's validation inputs: it ties when
the difference is within `tie_z` (1) standard errors of that estimate plus `tie_tolerance` (2e-4);
another variant or encoding ties when its best is within `tie_tolerance` of the best. The best here
is the most accurate point every budget but the energy budget allows. Of the points that tie with
it and keep every budget, the rule takes, where escalations are answered, the more faithful encoding
(an exact one, fp32 or zstd, before fp16: `encoding.EXACT`), then the one spending least energy, then the one
escalating least; where none is answered (the link down or too slow), the one with less energy, then
lower p95, then the more faithful encoding. So with escalation free it escalates as far as
escalating still clearly gains (on held-out MNIST, to about fixed-0.99's share), not everything. When
no budget-keeping point ties with the best, the energy budget binds: the rule takes the most accurate
point it allows and, of those within `tie_tolerance`, the one escalating most, so that the budget is
spent (an energy budget names what accuracy is worth). When no point keeps every budget, the one
closest to them (smallest summed relative excess).

**Hysteresis** (`switch_reason`): the controller moves from its current point to the rule's choice only when
(1) the current point breaks a budget by more than `violation_tolerance` (an energy budget at all in the
re-decision after the budget changed: a point chosen under another budget has no claim to stand over the new
one, and the energy target keeps only 1 % of headroom, so 5 % over it is 4 % over the budget the mean is held
to; such a point stood there until the estimates drifted past the tolerance, 202 requests later in
`test_controller_settle`'s stream), or breaks one at all and the choice is as accurate; or (2) the choice is
more accurate by more than the accuracy margin plus the noise of the fitted cloud accuracy (`accuracy_z`
standard errors over the escalations the move adds) plus `gain_z` standard errors of the gain's validation
estimate (the edge's correctness over the band of inputs between two thresholds of one variant: what `tied`
judges ties by; across variants, the two points' own validation error, `evidence.variant_stderr`), the last at
most `gain_hold_max` and none in the first re-decision after a change of the budget or the link, and it fits
the latency target with `switch_headroom` and the energy target with `energy_switch_headroom` to spare (near a
flat optimum, the first decision after a change stands; the gain's evidence separates only near-tied points,
and never holds a point chosen for other conditions); or (3) the choice is as accurate (a tie, as above,
between the two points) and spends `energy_margin` less energy (across variants, on measured figures only,
but for the re-decision as an energy budget is set, where a point chosen without it has no claim to stand; a
move that escalates less is not made within `link_settle_s` of a move of the round trip, so that a loss burst
does not take the escalations away, while one that keeps them, a cheaper encoding as exact, is made at once;
nor while the link is down, when the breaker skips the escalations whatever share is wanted); or (4) the
current point escalates clearly less than the probe floor (under three quarters of it) and the choice, as
accurate, does not; or (5) the choice differs only in its encoding, as accurate, more faithful and with the
spare room of (2); or (6) the current (variant, threshold) in the choice's encoding, as faithful (fp32 and
zstd are both exact) and as accurate, is predicted to take `encoding_margin_ms` less on the wire with no
higher p95 or energy: a move made whatever else the choice differs in (the encoding's own evidence, the link's
bandwidth, is not the gain's), and not back until the other way saves as much, so the encoding does not flip
near the bandwidth where the two tie. Nothing else moves it: the same rule runs when the link goes down or
comes back, when the round trip moves, and when a budget changes.

**The energy estimate's noise.** With an energy budget the controller plans for the target less
`energy_noise_z` relative standard errors of the current point's energy estimate (the window's mean
round trip and the two calibrations' ratios) and judges the current point against the target itself
(`Controller._energy_noise`), so the estimate's noise, narrower than that band, moves nothing. A
calibration moves only by 1 % and beyond its own standard error. Once chosen, the point holds while its
estimate moves by its noise (`switch_reason`'s `energy_se`, `evidence.energy_hold`: the round trips'
mean, the calibrations and the escalation share): it stands over the target by up to `energy_over_z`
(2) standard errors (or `violation_tolerance`, if more), and a more accurate point spending more is
taken only once it is under the plan's target by more than `energy_hold_z` (3) of them (or
`violation_tolerance`), and then, for a threshold of the same variant, for any gain beyond a tie, so that
the budget is spent; not in the re-decision after
the budget changed. Without it the point followed the estimate's noise down and back up (a "round trip
slower" cuts the round trips to the last 32, a spell of spikes).

**The binding constraint** of a decision is the budget the next more accurate point breaks
("latency", "energy", "escalations"), or "none" when the choice is the most accurate point there is.
A decision names its encoding ("" where no encoder may choose: the requests go as the transport
builds them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent.budget import Budget
from edge_agent.encoding import EXACT
from edge_agent.plan import Conditions, Predictions, predict
from edge_agent.profiles import LinkState, VariantProfile
from runtimes.errors import ConfigError

if TYPE_CHECKING:
    from edge_agent.encoding import WireOption

__all__ = ["ControllerConfig", "Decision", "candidate_thresholds", "choose", "encoding_move", "evaluate",
           "switch_reason", "tied"]

ANSWERED_MIN = 0.01  # escalations answered less often than this win nothing worth pricing
_DEFAULT_GRID = tuple(round(x, 3) for x in np.arange(0, 1.0001, 0.01))


@dataclass(frozen=True)
class ControllerConfig:
    """How the controller decides and when it changes its mind.

    Args:
        escalation_grid: escalation rates whose validation thresholds are the candidate thresholds.
        latency_headroom: plan p95 latency at most this share of the budget (noise margin).
        energy_headroom: plan mean energy at most this share of the energy budget.
        accuracy_margin: a move for accuracy must gain this much (or `accuracy_margin_rel` of the
            current error rate, if less, but never less than `accuracy_margin_min`).
        violation_tolerance: the current point is kept while over the budgets by at most this share
            (summed relative excess), unless a feasible point is as accurate.
        tie_tolerance: accuracies closer than this are equal (then less energy wins).
        tie_z: two thresholds of one variant are as accurate when their difference is within this many
            standard errors of what escalating the band between them gains (`tied`); 0: exact ties only.
        switch_headroom: a move for accuracy needs the new point's p95 this share under the target...
        energy_switch_headroom: ...and its mean energy this share under the energy target.
        energy_margin: a move between points as accurate (`tied`) needs this share less energy.
        accuracy_z: ...and its gain to beat this many standard errors of the fitted cloud accuracy
            over the escalations it adds...
        gain_z: ...plus this many standard errors of the gain's validation estimate (the sampling error
            of the edge's correctness over the band of inputs between two thresholds of one variant):
            a difference noise could make is no reason to move, so a flat optimum does not churn. Not
            after a change of the budget or the link (the current point was chosen for other conditions).
        gain_hold_max: the most the gain's evidence (`gain_z`) holds a move: it separates near-tied
            points, and a predicted gain beyond the margin, the cloud's noise and this is clear (a
            validation set of a few hundred inputs has standard errors of several tenths of a point
            over a wide band, which would otherwise hold the controller points away from the best).
        energy_noise_z: with an energy budget, the plan keeps this many relative standard errors of its
            energy estimate below the energy target, and the current point is judged against the target
            itself (`Controller._energy_noise`): a band the estimate's noise does not cross.
        energy_over_z, energy_hold_z: with an energy budget, how far the current point's energy estimate
            may move by its noise alone, in its relative standard errors (`evidence.energy_hold`: the round
            trips' mean, the two calibrations and the escalation share it plans for): a point the estimate
            puts over the energy target by at most `energy_over_z` of them (or `violation_tolerance`, if
            more) stands, and a more accurate point that spends more is not taken while the current point is
            within `energy_hold_z` of them (or `violation_tolerance`) under the plan's target. So the point
            chosen as the budget binds holds while the estimate's noise moves it, and follows a lasting
            move. Neither in the re-decision after the budget changed.
        encoding_margin_ms: a move to another encoding as faithful (fp32 and zstd are both exact) at the same
            (variant, threshold) needs its round trip predicted this much shorter; the way back needs as
            much the other way, so near the bandwidth where the two tie (zstd's bytes saved against its
            encode time) the encoding does not flip with the estimate's noise.
        probe_escalation_rate, down_probe_escalation_rate: the least share escalated while the link is
            up, and while it is down (live escalations keep measuring it).
        min_observations: requests (or samples) before a measured rate or latency is trusted.
        link_settle_s: a move that only saves energy by escalating less waits this long after the link's
            round trip moved (a loss burst shorter than this neither takes the escalations away nor waits to get them
            back), and is made then (a "link settled" re-decision); not after the link went down. Half
            a second: bursts of 0.3 s ride through, and a lasting change is followed within about 50
            requests at 100 a second (the link model marks a partition down after as long).
        redecide_interval_s: re-decide at least this often while requests flow.
        redecide_gap_s: a drift re-decides at most this often (a link event and a budget change at once).
        latency_drift, latency_drift_abs_ms: relative and absolute move of the device speed that re-decides.
        energy_drift: relative move of a measured inference energy that re-decides.
        energy_z: a variant switch on measured energy needs a difference beyond this many standard errors.
        window_s: observed p95 latency is held per window of this many seconds.
        escalation_z: binomial tolerance (standard deviations) on the observed escalation and agreement rates.
        history: decisions kept in `Controller.decisions`.
    """

    escalation_grid: tuple[float, ...] = _DEFAULT_GRID
    latency_headroom: float = 0.9
    energy_headroom: float = 0.99
    accuracy_margin: float = 0.002
    accuracy_margin_rel: float = 0.1
    accuracy_margin_min: float = 5e-4
    violation_tolerance: float = 0.05
    tie_tolerance: float = 2e-4
    tie_z: float = 1.0
    switch_headroom: float = 0.1
    energy_switch_headroom: float = 0.01
    energy_margin: float = 0.1
    accuracy_z: float = 2.0
    gain_z: float = 2.0
    gain_hold_max: float = 0.002
    energy_noise_z: float = 1.0
    energy_hold_z: float = 3.0
    energy_over_z: float = 2.0
    encoding_margin_ms: float = 0.5
    probe_escalation_rate: float = 0.03
    down_probe_escalation_rate: float = 0.1
    min_observations: int = 20
    link_settle_s: float = 0.5
    redecide_interval_s: float = 1.0
    redecide_gap_s: float = 0.25
    latency_drift: float = 0.3
    latency_drift_abs_ms: float = 1.0
    energy_drift: float = 0.25
    energy_z: float = 3.0
    window_s: float = 1.0
    escalation_z: float = 3.0
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
        if not (self.window_s > 0 and self.energy_z >= 0 and self.accuracy_z >= 0 and self.accuracy_margin_rel >= 0
                and self.gain_z >= 0 and self.gain_hold_max >= 0 and self.energy_noise_z >= 0
                and min(self.energy_hold_z, self.energy_over_z) >= 0 and self.encoding_margin_ms >= 0):
            msg = ("ControllerConfig window_s must be > 0, energy_z, accuracy_z, gain_z, gain_hold_max, "
                   "energy_noise_z, energy_hold_z, energy_over_z, encoding_margin_ms and accuracy_margin_rel >= 0")
            raise ConfigError(msg)
        if not (0 <= self.switch_headroom < 1 and 0 <= self.energy_switch_headroom < 1):
            msg = (f"ControllerConfig switch_headroom and energy_switch_headroom must be in [0, 1), got "
                   f"{self.switch_headroom!r}, {self.energy_switch_headroom!r}")
            raise ConfigError(msg)
        if (self.min_observations < 1 or self.history < 1 or self.redecide_interval_s <= 0 or self.redecide_gap_s < 0
                or self.link_settle_s < 0):
            msg = ("ControllerConfig min_observations and history must be >= 1, redecide_interval_s > 0, "
                   f"redecide_gap_s and link_settle_s >= 0; got {self.min_observations!r}, {self.history!r}, "
                   f"{self.redecide_interval_s!r}, {self.redecide_gap_s!r}, {self.link_settle_s!r}")
            raise ConfigError(msg)


@dataclass(frozen=True)
class Decision:
    """One operating point: what to run, what it is predicted to give, and why.

    Energy figures are in millijoules and carry `energy_label` (measured or modeled).
    `shortfall` is 0 when feasible, else the summed relative excess over the violated budgets.
    `edge_accuracy_escalated` is the validation accuracy of the edge on the inputs this point
    escalates (what edge/cloud agreement is compared with). `binding` names the budget that keeps
    a more accurate point out ("none": this is the most accurate point there is).
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
    binding: str = "none"
    encoding: str = ""
    drift: Mapping[str, Any] = field(default_factory=dict)  # the agent's drift flag and the chart that raised it

    @property
    def key(self) -> tuple[str, float]:
        return self.variant, self.threshold

    @property
    def point(self) -> tuple[str, float, str]:
        """The whole operating point: variant, threshold and wire encoding."""
        return self.variant, self.threshold, self.encoding

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["violated"] = list(self.violated)
        doc["inputs"] = dict(self.inputs)
        doc["drift"] = dict(self.drift)
        for k, v in doc.items():
            if isinstance(v, float):
                doc[k] = round(v, 6) if math.isfinite(v) else None
        return doc


def candidate_thresholds(profile: VariantProfile, link: LinkState | None, config: ControllerConfig) -> np.ndarray:
    """The thresholds considered for `profile`: the grid's, or only "never escalate" without a cloud."""
    return profile.thresholds(config.escalation_grid if link is not None else (0.0,))


def targets(budget: Budget, config: ControllerConfig, conditions: Conditions) -> tuple[float, float | None]:
    """The p95 latency and mean energy planned for: the budgets less headroom and what was observed."""
    latency = budget.latency_ms * config.latency_headroom * conditions.latency_scale
    energy = (None if budget.energy_mj is None
              else budget.energy_mj * config.energy_headroom * conditions.energy_scale)
    return latency, energy


def _latency_limit(p: Predictions, budget: Budget, target: float, conditions: Conditions) -> float:
    """The p95 a point may plan for. Where the agent's timer ends every escalation at a deadline inside
    the budget, a tail made of such escalations ends there and needs no further headroom, as long as
    the edge alone keeps its own."""
    if conditions.deadline_guard_ms is None or p.edge_p95_ms > target:
        return target
    return max(target, conditions.deadline_ms(budget))


def _assess(p: Predictions, budget: Budget, config: ControllerConfig,
            conditions: Conditions) -> tuple[np.ndarray, list[list[str]]]:
    """Shortfall (0 = feasible; else summed relative excess) and violated budget names per threshold."""
    target, energy_target = targets(budget, config, conditions)
    checks = [("latency", p.p95_ms, _latency_limit(p, budget, target, conditions))]
    if energy_target is not None:
        checks.append(("energy", p.energy_mj, energy_target))
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
              conditions: Conditions, binding: str = "none", **extra: Any) -> Decision:
    latency_target, energy_target = targets(budget, config, conditions)
    inputs = {"budget": asdict(budget), "latency_target_ms": latency_target, "energy_target_mj": energy_target,
              "latency_limit_ms": _latency_limit(p, budget, latency_target, conditions),
              "deadline_ms": conditions.deadline_ms(budget), "escalations_answered": p.answered,
              # the energy model's terms before calibration (`Conditions.*_energy_scale`): what is observed against
              "energy_model": {"inference_mj": p.inference_mj, "escalation_mj": p.escalation_mj},
              "link": link.to_json() if link is not None else None, "conditions": asdict(conditions),
              "variant": {"id": profile.id, "p50_ms": profile.latency.quantile(0.5),
                          "p95_ms": profile.latency.quantile(0.95), "energy_mj": profile.energy_mj,
                          "energy_label": profile.energy_label, "validation_size": profile.validation_size},
              "wire": (None if p.wire is None else
                       {"encoding": p.wire.encoding, "bytes": p.wire.nbytes, "encode_ms": p.wire.encode_ms,
                        "shift_ms": conditions.wire_shift_ms(link, p.wire) if link is not None else 0.0}),
              **extra}
    return Decision(p.variant, float(p.thresholds[i]), float(p.accuracy[i]), float(p.p95_ms[i]),
                    float(p.energy_mj[i]), float(p.escalation[i]), not violated, tuple(violated), reason,
                    inputs, p.energy_label, float(p.escalations_per_s[i]), float(p.edge_accuracy_escalated[i]),
                    float(shortfall), binding=binding, encoding=p.wire.encoding if p.wire is not None else "")


def probe_floor(link: LinkState | None, config: ControllerConfig) -> float:
    """The least share escalated that keeps the link measured: more while it is down or its timeouts
    run unusually long (slow: the same floor before and after such a spell turns into "down")."""
    if link is None:
        return 0.0
    if link.up and not link.slow:
        return config.probe_escalation_rate
    return max(config.probe_escalation_rate, config.down_probe_escalation_rate) if config.probe_escalation_rate else 0.0


def _binding(acc: np.ndarray, feasible: np.ndarray, names: list[list[str]], best: int, tie: float) -> str:
    """The budget the most accurate point better than `best` breaks; "none" if there is no such point."""
    better = np.flatnonzero(~feasible & (acc > acc[best] + tie))
    if not better.size:
        return "none"
    return " and ".join(names[int(better[np.argmax(acc[better])])]) or "none"


def tied(acc: np.ndarray, gain_var: np.ndarray, group: np.ndarray, pool: np.ndarray,
         config: ControllerConfig) -> np.ndarray:
    """The points of `pool` whose predicted accuracy cannot be told from the best's (the tie rule).

    Within one (variant, encoding) the points nest: a lower threshold escalates a subset of what a
    higher one does, and the accuracy between them differs by what escalating the band between them
    gains, estimated from that band's validation inputs. A point ties with its group's most accurate
    point when that difference is within `tie_z` standard errors of the estimate (the validation
    sampling error of the edge's correctness over the band, `VariantProfile.escalated_variance`)
    plus `tie_tolerance`; groups tie with the most accurate group within `tie_tolerance`.
    """
    top = acc[pool].max()
    out = np.zeros(acc.shape, dtype=bool)
    for g in np.unique(group[pool]):
        members = pool & (group == g)
        idx = np.flatnonzero(members)
        head = idx[np.argmax(acc[idx])]
        if acc[head] < top - config.tie_tolerance:
            continue
        slack = config.tie_z * np.sqrt(np.abs(gain_var[idx] - gain_var[head])) + config.tie_tolerance
        out[idx] = acc[idx] >= acc[head] - slack
    return out


def _fidelity(wire: WireOption | None) -> int:
    """0 for an exact encoding (fp32, zstd: the cloud decodes the very tensor) or the requests as built,
    1 for a lossy one: two exact encodings are as faithful, and the cheaper one wins a tie."""
    return 0 if wire is None or wire.exact else 1


def _distinct(wires: Sequence[WireOption], link: LinkState, budget: Budget,
              conditions: Conditions) -> tuple[WireOption, ...]:
    """The encodings worth pricing: without an energy budget, one less faithful than another is kept
    only where it makes escalations faster by more than 0.05 ms (on a fast link the most faithful
    one alone, and the grid is no larger than without encodings)."""
    ordered = sorted(wires, key=lambda w: w.fidelity)
    if budget.energy_mj is not None:
        return tuple(ordered)
    kept: list[WireOption] = []
    for w in ordered:
        shift = conditions.wire_shift_ms(link, w)
        if all(shift < conditions.wire_shift_ms(link, k) - 0.05 for k in kept):
            kept.append(w)
    return tuple(kept)


def choose(profiles: Sequence[VariantProfile], link: LinkState | None, budget: Budget,
           config: ControllerConfig | None = None, *, conditions: Conditions | None = None,
           wires: Sequence[WireOption] = ()) -> Decision:
    """The rule's (variant, threshold, encoding) for these profiles, link, budget and wire encodings
    (none: the requests as built); pure and deterministic.

    Raises:
        ConfigError: no profiles.
    """
    if not profiles:
        msg = "choose() needs at least one variant profile"
        raise ConfigError(msg)
    config, conditions = config or ControllerConfig(), conditions or Conditions()
    options: Sequence[WireOption | None] = (_distinct(wires, link, budget, conditions) if wires and link is not None
                                            else (None,))
    grid = [(p, w) for p in profiles for w in options]
    thresholds = {p.id: candidate_thresholds(p, link, config) for p in profiles}
    preds = [predict(p, thresholds[p.id], link, budget, conditions, w) for p, w in grid]
    assessed = [_assess(p, budget, config, conditions) for p in preds]
    index = [(v, i) for v, p in enumerate(preds) for i in range(p.thresholds.size)]
    fid = np.concatenate([np.full(p.thresholds.size, _fidelity(p.wire)) for p in preds])
    acc, energy, p95, esc = (np.concatenate([getattr(p, k) for p in preds])
                             for k in ("accuracy", "energy_mj", "p95_ms", "escalation"))
    short = np.concatenate([a[0] for a in assessed])
    names = [n for a in assessed for n in a[1]]
    feasible = short == 0
    floor = probe_floor(link, config)

    def probing(mask: np.ndarray) -> np.ndarray:  # the floor of escalations, where a point keeps it
        kept = mask & (esc >= floor - 1e-9)
        return kept if floor > 0 and kept.any() else mask

    pool = probing(feasible)
    answered = np.concatenate([np.full(p.thresholds.size, p.answered) for p in preds])
    how = "most accurate"
    if pool.any():
        group = np.concatenate([np.full(p.thresholds.size, v) for v, p in enumerate(preds)])
        gain_var = np.concatenate([p.gain_variance if p.gain_variance is not None else np.zeros(p.thresholds.size)
                                   for p in preds])
        # ties are judged against the best point every budget but the energy budget allows: a binding
        # energy budget is spent, not left for accuracy that cannot be told from what it buys
        ref = probing(feasible | np.array([n == ["energy"] for n in names], dtype=bool))
        ties = pool & tied(acc, gain_var, group, ref, config)
        if ties.any():  # the cheapest of the points as accurate as the best: where escalations are answered,
            # the most faithful encoding, then least energy, then fewest escalations
            cands = np.flatnonzero(ties)
            how = f"cheapest of {cands.size} as accurate as the best"
            order = (np.lexsort((esc[cands], energy[cands], fid[cands])) if answered[cands].max() > ANSWERED_MIN
                     else np.lexsort((fid[cands], p95[cands], energy[cands])))
        else:  # the energy budget binds: the most accurate point it allows, and of those as accurate
            # (`tie_tolerance`) the one escalating most (each answered escalation gains), the budget spent
            cands = np.flatnonzero(pool & (acc >= acc[pool].max() - config.tie_tolerance))
            order = (np.lexsort((energy[cands], fid[cands], -esc[cands])) if answered[cands].max() > ANSWERED_MIN
                     else np.lexsort((fid[cands], p95[cands], energy[cands])))
        best = int(cands[order[0]])
    else:
        cands = np.flatnonzero(short <= short.min() + 1e-9)
        cands = cands[acc[cands] >= acc[cands].max() - config.tie_tolerance]
        best = int(cands[np.lexsort((fid[cands], p95[cands], energy[cands]))[0]])
    v, i = index[best]
    violated = assessed[v][1][i]
    if violated:
        reason = (f"no point meets the {' and '.join(violated)} budget; closest of {len(index)} "
                  f"(shortfall {short[best]:.3g})")
    else:
        latency_target, energy_target = targets(budget, config, conditions)
        reason = (f"{how} of {int(feasible.sum())} feasible points out of {len(index)} "
                  f"(p95 <= {latency_target:.3g} ms"
                  + (f", energy <= {energy_target:.3g} mJ" if energy_target is not None else "")
                  + (f", <= {budget.max_escalations_per_s:g} escalations/s"
                     if budget.max_escalations_per_s is not None else "") + ")")
    binding = _binding(acc, feasible, names, best, config.tie_tolerance)
    return _decision(preds[v], i, float(short[best]), violated, reason, grid[v][0], link, budget, config,
                     conditions, binding, candidates=len(index), feasible_candidates=int(feasible.sum()))


def evaluate(profile: VariantProfile, threshold: float, link: LinkState | None, budget: Budget,
             config: ControllerConfig | None = None, *, conditions: Conditions | None = None,
             wire: WireOption | None = None) -> Decision:
    """The predictions for one given (variant, threshold, encoding), as a `Decision` record."""
    config, conditions = config or ControllerConfig(), conditions or Conditions()
    p = predict(profile, np.array([threshold]), link, budget, conditions, wire if link is not None else None)
    short, names = _assess(p, budget, config, conditions)
    reason = "current point" + (f" violates the {' and '.join(names[0])} budget" if names[0] else " meets the budgets")
    return _decision(p, 0, float(short[0]), names[0], reason, profile, link, budget, config, conditions)


def spare(cand: Decision, config: ControllerConfig) -> bool:
    """Whether `cand` fits the planned p95 with `switch_headroom` and the planned energy with
    `energy_switch_headroom` to spare (a tail the agent's timer ends needs no spare room)."""
    latency, energy = (float(cand.inputs.get(k) or math.inf) for k in ("latency_target_ms", "energy_target_mj"))
    limit = float(cand.inputs.get("latency_limit_ms") or 0.0)
    fits_latency = (cand.predicted_p95_ms <= latency * (1 - config.switch_headroom) + 1e-9
                    or (limit > latency and cand.predicted_p95_ms <= limit + 1e-9))
    return fits_latency and cand.predicted_energy_mj <= energy * (1 - config.energy_switch_headroom) + 1e-9


def accuracy_margin(cur: Decision, config: ControllerConfig) -> float:
    """How much more accurate a point must be predicted to be worth a move (before the fit's noise)."""
    return max(min(config.accuracy_margin, config.accuracy_margin_rel * (1 - cur.predicted_accuracy)),
               min(config.accuracy_margin_min, config.accuracy_margin), config.tie_tolerance)


def switch_reason(cur: Decision, cand: Decision, config: ControllerConfig, *, noise: float = 0.0,
                  gain_noise: float = 0.0, energy_evidence: bool = True, floor: float = 0.0,
                  tie: float = 0.0, tolerance: float | None = None, energy_se: float = 0.0) -> str:
    """Why to move from `cur` to `cand` (the rule's choice), or "" to stay: the hysteresis of the rule.

    `noise` is how much the two may differ in predicted accuracy by the fitted cloud accuracy's own
    uncertainty (`accuracy_z` standard errors over the escalations the move adds). `gain_noise`: how much
    they may differ by the sampling error of the gain's validation estimate (`gain_z` standard errors;
    0 after a change of the budget or the link); it holds a move only up to `gain_hold_max`, so it keeps
    near-tied points from churning but never holds a clear gain. `energy_evidence`:
    whether their energy difference is evidence (a threshold move always; across variants, measured
    figures that differ beyond `energy_z` standard errors: modeled noise never moves a variant).
    `floor` is the least share escalated that keeps the link measured (`probe_floor`). `tie`: how much
    less accurate `cand` may be predicted and still be as accurate (`tied`: `tie_z` standard errors of
    the gain of the band between them, for two thresholds of one variant; 0 otherwise). `tolerance`: how far
    over the budgets the current point may stand (default `violation_tolerance`; the controller passes 0 for
    a point over a new energy budget: chosen under another budget, it has no claim to stand over this one).
    `energy_se`: the relative standard error of the current point's energy estimate (`evidence.energy_hold`;
    0 without an energy budget or after it changed): a point over the energy target by at most
    `energy_over_z` of them (or `violation_tolerance`, if more) stands; a more accurate point spending more
    energy is not taken while the current point is within `energy_hold_z` of them (or `violation_tolerance`)
    under the plan's target (`_energy_held`), and is taken, when it is a threshold of the same variant more
    accurate beyond a tie, once the current point is further under: so the point neither follows the
    estimate's noise down and back up nor leaves the budget unspent."""
    if cand.point == cur.point:
        return ""
    over = " and ".join(cur.violated)
    over_hold, energy_hold = config.energy_over_z * energy_se, config.energy_hold_z * energy_se
    noise_only = energy_se > 0 and cur.violated == ("energy",) and cur.shortfall <= over_hold
    limit = config.violation_tolerance if tolerance is None else tolerance
    if not cur.feasible and cur.shortfall > (max(limit, over_hold) if cur.violated == ("energy",) else limit):
        if cand.feasible:
            return f"current point violates the {over} budget"
        return "closer to the budgets" if cand.shortfall < cur.shortfall - 1e-9 else ""
    if not cand.feasible:
        return ""
    margin = accuracy_margin(cur, config)
    if not cur.feasible and not noise_only and cand.predicted_accuracy >= cur.predicted_accuracy - margin:
        return f"current point is over the {over} budget (within tolerance)"
    # clearly under it: predicted rates move with the live scores, and a point at the floor must not flap
    if (cur.predicted_escalation_rate < 0.75 * floor - 1e-9 and cand.predicted_escalation_rate >= floor - 1e-9
            and cand.predicted_accuracy >= cur.predicted_accuracy - margin):
        return f"escalate at least {floor:.0%} to probe the link"
    if (saved := _faster_wire(cur, cand, config)) > 0:
        return f"as accurate and as faithful, {saved:.2g} ms less on the wire: {cur.encoding} -> {cand.encoding}"
    if not spare(cand, config):
        return ""
    if (cand.predicted_accuracy > cur.predicted_accuracy + margin + noise + min(gain_noise, config.gain_hold_max)
            and not _energy_held(cur, cand, energy_hold, config)):
        return f"accuracy {cur.predicted_accuracy:.4f} -> {cand.predicted_accuracy:.4f}"
    if (energy_hold > 0 and cand.binding == "energy" and cand.variant == cur.variant
            and cand.predicted_accuracy > cur.predicted_accuracy + config.tie_tolerance + tie
            and cand.predicted_energy_mj > cur.predicted_energy_mj
            and not _energy_held(cur, cand, energy_hold, config)):
        return (f"the energy budget left unspent: {cur.predicted_energy_mj:.3g} mJ, beyond {energy_hold:.1%} "
                f"under the target {float(cand.inputs['energy_target_mj']):.3g}")
    if (energy_evidence and cand.predicted_accuracy >= cur.predicted_accuracy - config.tie_tolerance - tie
            and cand.predicted_energy_mj < cur.predicted_energy_mj * (1 - config.energy_margin)):
        return f"as accurate, energy {cur.predicted_energy_mj:.3g} -> {cand.predicted_energy_mj:.3g} mJ"
    if (cand.key == cur.key and cand.predicted_accuracy >= cur.predicted_accuracy - config.tie_tolerance
            and _rank(cand.encoding) < _rank(cur.encoding)):
        return f"as accurate, more faithful encoding {cur.encoding} -> {cand.encoding}"
    return ""


def _energy_held(cur: Decision, cand: Decision, hold: float, config: ControllerConfig) -> bool:
    """Whether a move to the more accurate `cand` waits for evidence: it spends more energy than `cur`, and
    `cur`'s energy estimate is within `hold` (a share) under `cand`'s energy target (the plan's) or over it.
    The estimate that says `cur` has room to spend more has moved by its noise alone, and the point it would
    take is the one the next move of that noise takes back."""
    target = cand.inputs.get("energy_target_mj")
    if hold <= 0 or target is None or cand.predicted_energy_mj <= cur.predicted_energy_mj:
        return False
    return cur.predicted_energy_mj >= float(target) * (1 - max(hold, config.violation_tolerance))


def encoding_move(cur: Decision, cand: Decision, why: str, price: Callable[[Decision, str], Decision],
                  reason: Callable[[Decision, Decision], str], config: ControllerConfig) -> tuple[Decision, str]:
    """The encoding's own hysteresis, where the rule's choice `cand` is in another encoding than `cur`; `why`
    is the reason to move to `cand` ("" to stay), `price(d, encoding)` evaluates `d`'s (variant, threshold) in
    `encoding`, `reason` is the controller's `switch_reason`. Returns the point to move to and why.

    Staying: the current (variant, threshold) in the choice's encoding, a move the bandwidth decides, which
    the gain's hysteresis on the rest of the choice does not hold (`switch_reason`'s rule 6). Moving for
    another reason to a point in an encoding as faithful that saves less than `encoding_margin_ms` on the
    wire: that point in the current encoding, where it keeps the budgets as accurately (so the encoding does
    not flip near a tie with each move of the threshold)."""
    if not why:
        wire = price(cur, cand.encoding)
        if why := reason(cur, wire):
            cand = replace(wire, binding=cand.binding, reason=f"the rule's choice {cand.variant}@"
                           f"{cand.threshold:.4g}/{cand.encoding} held; its encoding taken")
        return cand, why
    saved = _wire_saved(cand)
    if _rank(cand.encoding) != _rank(cur.encoding) or abs(saved) > config.encoding_margin_ms:
        return cand, why
    kept = price(cand, cur.encoding)
    if kept.feasible and kept.predicted_accuracy >= cand.predicted_accuracy - config.tie_tolerance:
        return replace(kept, binding=cand.binding, reason=f"{cand.reason}; encoding {cur.encoding} kept "
                       f"({cand.encoding} saves {saved:.2g} ms)"), why
    return cand, why


def _faster_wire(cur: Decision, cand: Decision, config: ControllerConfig) -> float:
    """The round trip (ms) `cand` saves over `cur` where it differs only in an encoding as faithful, as
    accurate, with no higher p95 or energy, and saves more than `encoding_margin_ms`; else 0. A
    decision's wire shift is against the encoding the round trips were measured with (the current one's)."""
    if cand.key != cur.key or not cand.encoding or not cur.encoding or _rank(cand.encoding) != _rank(cur.encoding):
        return 0.0
    saved = _wire_saved(cand)
    no_worse = (cand.predicted_accuracy >= cur.predicted_accuracy - config.tie_tolerance
                and cand.predicted_p95_ms <= cur.predicted_p95_ms + 1e-9
                and cand.predicted_energy_mj <= cur.predicted_energy_mj + 1e-9)
    return saved if no_worse and saved > config.encoding_margin_ms else 0.0


def _wire_saved(d: Decision) -> float:
    """The round trip (ms) `d`'s encoding saves against the one the round trips were measured with."""
    return -float((d.inputs.get("wire") or {}).get("shift_ms") or 0.0)


def _rank(encoding: str) -> int:
    """As `_fidelity`, by name: exact (fp32, zstd) before lossy, and any planned encoding before none ("")."""
    return 2 if not encoding else 0 if encoding in EXACT else 1
