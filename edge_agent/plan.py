"""The operating-point model and what-if planning: predict, compare, plot.

`predict(profile, thresholds, link, budget, conditions)` is the model every decision uses. For one
variant at each threshold it predicts

- the p95 end-to-end latency, as the 95th percentile of a mixture (not a sum of p95s): accepted
  inputs take the edge latency; escalations answered in time take edge + RTT (the link's recent
  round trips, so a few escalations sit in the tail and many shift the body); the others end at
  the budget's deadline (timeouts) or after the failure latency (cloud down, fast fail);
- the mean energy per request: inference plus, per escalation, radio bytes and waiting power (for the
  mean round trip of the window's answered escalations: a mean over many, as the budget is), each of
  the two terms scaled by what the device measured against it (`Conditions.inference_energy_scale`,
  `escalation_energy_scale`);
- for a wire encoding (`encoding.WireOption`), escalations whose round trips move by its bytes'
  difference over the link's measured bandwidth plus its encode time's difference, against the
  encoding the round trips were measured with (`Conditions.wire_ref_bytes`), and whose radio energy
  is its own bytes;
- the expected tiered accuracy (1 − e)·acc_accepted + e·(s·cloud + (1 − s)·acc_escalated), where s
  is the share of escalations the cloud answers in time (availability × timely), the edge's
  accuracies are read per score bin (shrunk towards its overall accuracy), and the cloud's error on
  the escalated set is in proportion to the edge's there (`_cloud_accuracy`);
- the escalations per second, checked against the optional cloud-cost cap.

`what_if` runs the controller's choice on stored profiles and an assumed link, and returns the
chosen point with the Pareto frontier (accuracy vs p95 latency vs energy); `plot_frontier` draws it.

Example:
    >>> report = what_if(profiles, LinkProfile(rtt_ms=20).state(), Budget(latency_ms=30))
    >>> report.decision.variant, len(report.frontier)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent.budget import Budget
from edge_agent.profiles import LinkState, VariantProfile

if TYPE_CHECKING:
    from edge_agent.decide import ControllerConfig, Decision
    from edge_agent.encoding import WireOption

__all__ = ["Conditions", "PlanReport", "Predictions", "format_table", "pareto_front", "plot_frontier",
           "predict", "what_if"]

AUDIT_CAP_SHARE = 0.25  # the most of max_escalations_per_s the plan keeps for audits


@dataclass(frozen=True)
class Conditions:
    """Measured runtime conditions a decision also depends on (besides profiles and link).

    Args:
        request_rate: requests per second (None: assume a closed loop, one request after another).
        edge_overhead_ms: agent time around inference (pre/post-processing, scoring, scheduling).
        slowdown: how much slower the device runs than when the profiles' baselines were taken.
        current_variant: the variant running now, whose profile sees the live inputs' scores.
        shift_error_scale: how much more (> 1) or less the current variant errs on the live
            inputs than on validation; applied to the other variants, which see no live scores,
            so that all are compared on the same inputs.
        latency_scale, energy_scale: the share of the latency and energy budgets to plan for: below 1
            after observed windows went over the latency budget (`budget.BudgetWindows`), and by the
            energy estimate's noise band (`Controller._energy_noise`).
        deadline_guard_ms: None when nothing ends an escalation before the budget (a plan on paper:
            an escalation not answered in time is priced at the whole budget). A number when the
            agent's own timer abandons every escalation that long before the (scaled) budget ends,
            its margin plus the timer lateness it measured: escalations then end by that point,
            answered or not, whatever the link does.
        wire_ref_bytes, wire_ref_encode_ms: the request bytes and encode time of the wire encoding the
            link's round trips were measured with (None: the link's mean request size, no encode time).
        audit_rate: the share of the answers not escalated that are also sent to the cloud to compare
            (`edge_agent.audit`): off the latency path, but their radio bytes and waiting count in the energy plan
            and they count with the escalations against `max_escalations_per_s`, of which they are
            planned to take at most `AUDIT_CAP_SHARE`.
        inference_energy_scale, escalation_energy_scale: observed over modeled energy of an inference
            and of what an escalation adds to a request (`evidence.PartCalibration`): the plan's two
            terms are scaled by them, so a model wrong by a fixed share of either is right at every
            threshold.
    """

    request_rate: float | None = None
    edge_overhead_ms: float = 0.0
    slowdown: float = 1.0
    current_variant: str | None = None
    shift_error_scale: float = 1.0
    latency_scale: float = 1.0
    energy_scale: float = 1.0
    deadline_guard_ms: float | None = None
    wire_ref_bytes: float | None = None
    wire_ref_encode_ms: float = 0.0
    audit_rate: float = 0.0
    inference_energy_scale: float = 1.0
    escalation_energy_scale: float = 1.0

    def wire_shift_ms(self, link: LinkState, wire: WireOption | None) -> float:
        """How much longer (ms; < 0: shorter) an escalation's round trip is in `wire` than in the
        encoding its round trips were measured with: bytes over the measured bandwidth (unknown: no
        difference) plus encode time."""
        if wire is None:
            return 0.0
        ref = link.bytes_per_escalation if self.wire_ref_bytes is None else self.wire_ref_bytes
        transfer = (wire.nbytes - ref) * 8e3 / link.bandwidth_bps if link.bandwidth_bps else 0.0
        return transfer + wire.encode_ms - self.wire_ref_encode_ms

    def deadline_ms(self, budget: Budget) -> float:
        """When an escalation ends at the latest, answered or not (ms after the request began)."""
        if self.deadline_guard_ms is None:
            return budget.latency_ms
        return max(budget.latency_ms * self.latency_scale - self.deadline_guard_ms, 0.0)


@dataclass(frozen=True)
class Predictions:
    """Predictions for one variant, one entry per threshold (energy in mJ, labelled)."""

    variant: str
    energy_label: str
    thresholds: np.ndarray
    escalation: np.ndarray
    accuracy: np.ndarray
    p95_ms: np.ndarray
    energy_mj: np.ndarray
    escalations_per_s: np.ndarray  # escalations and audits: both count against max_escalations_per_s
    edge_accuracy_escalated: np.ndarray
    edge_p95_ms: float = 0.0
    answered: float = 0.0  # the share of escalations the cloud answers in time (0 without a link)
    wire: WireOption | None = None  # the wire encoding priced (None: the requests as the link saw them)
    # per threshold, the validation sampling variance of the accuracy escalating gains (`decide.tied`)
    gain_variance: np.ndarray | None = None
    # the energy model's own terms, before the calibration's scales: what observed energy is compared with
    inference_mj: float = 0.0  # one inference
    escalation_mj: float = 0.0  # what one escalation adds to a request


_RTT_POINTS = 64  # round-trip quantiles the answered escalations' latency is drawn from


def _quantiles(s: np.ndarray, q: np.ndarray | float) -> np.ndarray:
    """`np.quantile(s, q)` (linear interpolation) of a sorted array, without its overhead."""
    pos = np.asarray(q, dtype=float) * (s.size - 1)
    lo = np.floor(pos).astype(np.intp)
    hi = np.minimum(lo + 1, s.size - 1)
    return np.asarray(s[lo] + (s[hi] - s[lo]) * (pos - lo), dtype=float)


def predict(profile: VariantProfile, thresholds: np.ndarray, link: LinkState | None, budget: Budget,
            conditions: Conditions, wire: WireOption | None = None) -> Predictions:
    """Predicted accuracy, p95 latency, energy and escalations of `profile` at each threshold, with
    escalations sent in `wire` (None: as the link saw them)."""
    t = np.atleast_1d(np.asarray(thresholds, dtype=float))
    esc, acc_acc, validation_acc_esc = profile.curve(t, smoothed=True)
    scale = link.edge_error_scale if link else 1.0  # > 1 when agreement says the edge errs more than validation
    if conditions.current_variant is not None and profile.id != conditions.current_variant:
        scale *= conditions.shift_error_scale
    acc_acc, acc_esc = (np.clip(1 - (1 - a) * scale, 0, 1) for a in (acc_acc, validation_acc_esc))
    ratio = profile.latency.quantile(0.5) / max(profile.baseline_p50_ms, 1e-9)
    speed = min(max(conditions.slowdown / max(ratio, 1e-9), 0.25), 8.0)
    edge = profile.latency.samples() * speed + conditions.edge_overhead_ms
    deadline = conditions.deadline_ms(budget)
    med = float(_quantiles(edge, 0.5))
    ok_rtt = np.zeros(1)
    if link is None:
        avail = timely = fail_ms = rtt_mean = radio = wait = 0.0
    else:
        avail, wait, fail_ms = link.availability, link.wait_power_w, min(link.failure_latency_ms, deadline)
        shift = conditions.wire_shift_ms(link, wire)
        timely = link.timely(deadline - med - shift)
        samples = np.maximum(link.rtt_samples + shift, 0.0)
        in_time = samples[samples <= deadline - med]
        ok_rtt = in_time if in_time.size else np.array([min(max(link.rtt_high_ms + shift, 0.0), deadline)])
        if ok_rtt.size > _RTT_POINTS:  # sorted: evenly spaced quantiles stand for them
            ok_rtt = ok_rtt[((np.arange(_RTT_POINTS) + 0.5) / _RTT_POINTS * ok_rtt.size).astype(np.intp)]
        # the mean of the answered round trips in the window, not the EWMA: the energy budget is a mean
        # over many requests, and an EWMA of a few recent ones on a loaded host swings by half
        rtt_mean = (float(np.mean(in_time)) if in_time.size
                    else min(max(link.rtt_ms + shift, 0.0), deadline) if math.isfinite(link.rtt_ms)
                    else float(np.mean(ok_rtt)))
        radio = (link.bytes_per_escalation if wire is None else wire.nbytes) * link.energy_per_byte_mj

    def capped(extra: np.ndarray | float) -> np.ndarray:
        return np.maximum(edge, np.minimum(edge + extra, deadline))

    # answered escalations: edge latency plus a round trip, both drawn from their distributions
    # (32 edge quantiles x at most 64 RTT quantiles), so the p95 of a mixture escalating much is not overstated
    edge_q = _quantiles(edge, (np.arange(32) + 0.5) / 32)
    answered = np.maximum(np.minimum(edge_q[:, None] + np.ravel(ok_rtt)[None, :], deadline), edge_q[:, None]).ravel()
    # each part sorted (the edge samples are, and the late and failed ones are monotone in them)
    parts = (edge, np.sort(answered), np.maximum(edge, deadline), capped(fail_ms))
    weights = (avail * timely, avail * (1 - timely), 1 - avail)
    p95 = _mixture_quantile(parts, weights, esc, 0.95 - 1e-9)
    per_escalation = (avail * timely * (radio + rtt_mean * wait)
                      + avail * (1 - timely) * (radio + max(deadline - med, 0.0) * wait)
                      + (1 - avail) * ((radio if fail_ms > 0 else 0.0) + fail_ms * wait))
    success = avail * timely
    accuracy = (1 - esc) * acc_acc + esc * (success * _cloud_accuracy(profile, link, validation_acc_esc)
                                            + (1 - success) * acc_esc)
    if conditions.request_rate is not None:
        rate = np.full_like(esc, conditions.request_rate)
    else:  # closed loop: the next request starts when this one ends
        mean_ms = float(np.mean(edge)) + esc * (success * rtt_mean + avail * (1 - timely) * (deadline - med)
                                               + (1 - avail) * fail_ms)
        rate = 1000.0 / np.maximum(mean_ms, 1e-3)
    # audits (not sent while the link is down) take at most their share of the escalation cap: the auditor
    # sends them only from what escalations leave over, so a larger demand is cut, not the escalations
    audits_per_s = conditions.audit_rate * (1 - esc) * avail * rate
    if budget.max_escalations_per_s is not None:
        audits_per_s = np.minimum(audits_per_s, AUDIT_CAP_SHARE * budget.max_escalations_per_s)
    inference_mj = _inference_mj(profile, med)
    # an audit is a round trip the device waits out as it does an answered escalation's (the agent charges it so)
    per_audit = radio + (rtt_mean * wait if link is not None else 0.0)
    energy = (conditions.inference_energy_scale * inference_mj + conditions.escalation_energy_scale
              * (esc * per_escalation + audits_per_s / np.maximum(rate, 1e-9) * per_audit))
    label = profile.energy_label if link is None else f"{profile.energy_label} + radio {link.energy_label}"
    return Predictions(profile.id, label, t, esc, accuracy, p95, energy, esc * rate + audits_per_s,
                       validation_acc_esc, float(_quantiles(edge, 0.95)), float(success), wire,
                       success ** 2 * profile.escalated_variance(t), inference_mj, float(per_escalation))


def _cloud_accuracy(profile: VariantProfile, link: LinkState | None, edge_esc: np.ndarray) -> np.ndarray:
    """The cloud's accuracy on the inputs each threshold escalates. The cloud errs where the edge errs
    most (hard inputs are hard for both): its error on a set is taken in proportion to the edge's
    validation error there, at the ratio measured where the cloud's accuracy was fitted (its
    escalations' edge accuracy, or, before any, the edge's accuracy on everything against the prior,
    the cloud's accuracy on everything). So escalating a band gains the edge's error there times
    (1 - that ratio): never nothing while the cloud is the better model."""
    if link is None:
        return np.zeros_like(edge_esc)
    ref = link.cloud_reference_accuracy if link.cloud_reference_accuracy is not None else profile.accuracy
    ratio = (1 - link.cloud_accuracy) / max(1 - ref, 1e-3)
    return np.clip(1 - ratio * (1 - edge_esc), 0.0, 1.0)


def _mixture_quantile(parts: tuple[np.ndarray, ...], weights: tuple[float, ...], w: np.ndarray,
                      level: float) -> np.ndarray:
    """For each escalation share w_i, the `level` quantile of the latency mixture (1 - w_i) F_0 + w_i G, G the
    mixture of parts[1:] weighted by `weights` (each part sorted): the first of the parts' pooled values where
    the mixture's CDF reaches `level`. The CDFs are evaluated once on the pooled values; then a bisection
    per share, all at once, in log2(len) steps rather than a table of len(w) x len."""
    points = np.sort(np.concatenate(parts))
    cdf = [np.searchsorted(p, points, side="right") / p.size for p in parts]
    f, g = cdf[0], np.zeros(points.size)
    for k, c in zip(weights, cdf[1:], strict=True):
        g += k * c
    lo, hi = np.zeros(w.shape, dtype=np.intp), np.full(w.shape, f.size - 1, dtype=np.intp)
    while np.any(lo < hi):
        mid = (lo + hi) // 2
        ok = (1 - w) * f[mid] + w * g[mid] >= level
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid + 1)
    return np.asarray(points[lo], dtype=float)


def _inference_mj(profile: VariantProfile, edge_ms: float) -> float:
    """The energy of one inference of `profile` on this device now.

    A measured figure, or a modeled one the agent reported for this variant (power x its live time,
    overheads included), stands. A variant that has not run yet has only its self-benchmark's
    modeled figure (power x the bare session time): it is scaled to the edge time predicted for it
    here (device slowdown and the agent's overhead included), as the agent will model it, so that
    it is not favoured over the running variant by what the benchmark left out.
    """
    if profile.energy_observed or str(profile.energy_label).startswith("measured"):
        return profile.energy_mj
    base = profile.baseline_p50_ms
    return profile.energy_mj * (edge_ms / base) if base > 0 and math.isfinite(edge_ms) else profile.energy_mj


def rows(predictions: Sequence[Predictions]) -> list[dict[str, Any]]:
    """One dict per (variant, threshold): the table the frontier and the plot are drawn from."""
    out = []
    for p in predictions:
        for i, t in enumerate(p.thresholds):
            out.append({"variant": p.variant, "threshold": float(t), "escalation_rate": float(p.escalation[i]),
                        "accuracy": float(p.accuracy[i]), "p95_ms": float(p.p95_ms[i]),
                        "energy_mj": float(p.energy_mj[i]), "energy_label": p.energy_label,
                        "escalations_per_s": float(p.escalations_per_s[i])})
    return out


def pareto_front(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points no other point beats on accuracy, p95 latency and energy at once (best accuracy first)."""
    acc = np.array([p["accuracy"] for p in points])
    lat = np.array([p["p95_ms"] for p in points])
    eng = np.array([p["energy_mj"] for p in points])
    keep = []
    for i in range(len(points)):
        no_worse = (acc >= acc[i]) & (lat <= lat[i]) & (eng <= eng[i])
        better = (acc > acc[i]) | (lat < lat[i]) | (eng < eng[i])
        if not (no_worse & better).any():
            keep.append(i)
    # identical points: keep one
    seen: set[tuple[float, float, float]] = set()
    front = []
    for i in sorted(keep, key=lambda i: (-acc[i], lat[i], eng[i])):
        sig = (round(acc[i], 6), round(lat[i], 4), round(eng[i], 4))
        if sig not in seen:
            seen.add(sig)
            front.append(points[i])
    return front


def format_table(points: Sequence[dict[str, Any]], chosen: Decision | None = None) -> str:
    """A fixed-width text table of `points`; the chosen point is marked with `*`."""
    head = f"  {'variant':<16} {'thresh':>9} {'esc %':>6} {'acc %':>7} {'p95 ms':>8} {'energy mJ':>10} {'esc/s':>7}"
    lines = [head]
    for p in points:
        mark = "*" if chosen is not None and (p["variant"], p["threshold"]) == chosen.key else " "
        lines.append(f"{mark} {p['variant']:<16} {p['threshold']:>9.4g} {100 * p['escalation_rate']:>6.1f} "
                     f"{100 * p['accuracy']:>7.2f} {p['p95_ms']:>8.2f} {p['energy_mj']:>10.3f} "
                     f"{p['escalations_per_s']:>7.1f}")
    labels = sorted({p["energy_label"] for p in points})
    lines.append(f"energy: {', '.join(labels)}")
    return "\n".join(lines)


def plot_frontier(points: Sequence[dict[str, Any]], front: Sequence[dict[str, Any]], path: str | Path, *,
                  chosen: Decision | None = None, budget: Budget | None = None, title: str = "") -> Path:
    """Write a PNG: accuracy vs p95 latency (colour = energy), the frontier, the budget and the choice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    try:
        sc = ax.scatter([p["p95_ms"] for p in points], [100 * p["accuracy"] for p in points],
                        c=[p["energy_mj"] for p in points], s=12, cmap="viridis", alpha=0.7)
        label = ", ".join(sorted({p["energy_label"] for p in points}))
        fig.colorbar(sc, ax=ax, label=f"energy per request, mJ ({label})")
        ax.scatter([p["p95_ms"] for p in front], [100 * p["accuracy"] for p in front], s=40, facecolors="none",
                   edgecolors="tab:red", lw=0.8, label="Pareto (accuracy, p95, energy)")
        best, xs, ys = -1.0, [], []  # the accuracy-vs-latency staircase
        for p in sorted(points, key=lambda p: (p["p95_ms"], -p["accuracy"])):
            if p["accuracy"] > best:
                best = p["accuracy"]
                xs.append(p["p95_ms"])
                ys.append(100 * best)
        ax.step(xs, ys, where="post", color="tab:red", lw=1, label="best accuracy within a latency")
        if budget is not None:
            ax.axvline(budget.latency_ms, color="gray", ls="--", lw=1, label=f"budget {budget.latency_ms:g} ms")
        if chosen is not None:
            ax.scatter([chosen.predicted_p95_ms], [100 * chosen.predicted_accuracy], marker="*", s=220,
                       color="tab:red", edgecolor="k", zorder=5,
                       label=f"chosen: {chosen.variant} @ {chosen.threshold:.3g}")
        ax.set_xlabel("predicted p95 end-to-end latency (ms)")
        ax.set_ylabel("predicted tiered accuracy (%)")
        ax.set_title(title or "tierkit plan: operating points")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


@dataclass(frozen=True)
class PlanReport:
    """What `what_if` found: the controller's choice, every point, and the Pareto frontier."""

    decision: Decision
    points: list[dict[str, Any]]
    frontier: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        def clean(row: dict[str, Any]) -> dict[str, Any]:
            return {k: (round(v, 6) if math.isfinite(v) else None) if isinstance(v, float) else v
                    for k, v in row.items()}

        return {"decision": self.decision.to_json(), "frontier": [clean(r) for r in self.frontier],
                "points": len(self.points)}


def what_if(profiles: Sequence[VariantProfile], link: LinkState | None, budget: Budget, *,
            config: ControllerConfig | None = None, conditions: Conditions | None = None) -> PlanReport:
    """The point the controller would choose under `budget` and `link`, and the frontier around it."""
    from edge_agent.decide import ControllerConfig, candidate_thresholds, choose

    config = config or ControllerConfig()
    conditions = conditions or Conditions()
    decision = choose(profiles, link, budget, config, conditions=conditions)
    preds = [predict(p, candidate_thresholds(p, link, config), link, budget, conditions) for p in profiles]
    points = rows(preds)
    return PlanReport(decision, points, pareto_front(points))
