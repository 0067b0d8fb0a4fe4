"""How much of a measured difference is noise: the statistics that guard the controller's switches.

`Controller` (edge_agent/controller.py) moves the operating point only on evidence. This module holds
the estimates it weighs a move against: the energy plan's calibrations (observed over modeled energy of
an inference and of what an escalation adds, fed on every request) and their standard errors, the
noise band of the planned energy, the standard error of what a threshold move gains, the cloud
accuracy's own uncertainty, whether two variants' energies differ beyond their errors, and whether an
observed rate left its prediction's binomial band.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from edge_agent.decide import Decision
from edge_agent.profiles import LinkState, VariantProfile
from runtimes.errors import ConfigError

SE_BLOCK = 32  # consecutive values a block of `series_stderr` (8 blocks in a calibration's window of 256)

__all__ = ["EnergyParts", "PartCalibration", "cloud_noise", "energy_evidence", "energy_hold", "energy_noise",
           "gain_stderr", "measured", "outside", "series_stderr", "variant_stderr"]


class PartCalibration:
    """Observed over modeled energy of one part of a request (its inference, or what an escalation adds
    to it), the ratio of their sums over the last `window` pairs, clamped to [0.25, 4]. Fed on every
    request that has the part, with or without an energy budget, so a budget set later starts
    calibrated; the plan scales that part's term by it (`plan.Conditions`), so a ratio learned at one
    threshold carries to every other. It moves only by 1 % or more and beyond one standard error of
    the ratio (`noise`), and forgets: after a change of the part's cost, the window's pairs turn over.

    Example:
        >>> cal = PartCalibration()
        >>> if cal.add(observed_mj=17.2, modeled_mj=14.7):
        ...     replan(escalation_energy_scale=cal.scale)
    """

    def __init__(self, window: int = 256, min_pairs: int = 50) -> None:
        if not 2 <= min_pairs <= window:
            msg = f"PartCalibration needs 2 <= min_pairs <= window, got {min_pairs!r}, {window!r}"
            raise ConfigError(msg)
        self._pairs: deque[tuple[float, float]] = deque(maxlen=window)
        self._sums = (0.0, 0.0)
        self._min, self._added = min_pairs, 0
        self.scale = 1.0

    def add(self, observed_mj: float, modeled_mj: float) -> bool:
        """One request's observed and modeled energy of the part; True when the scale moved (re-plan).
        A part the model prices at nothing (an escalation skipped while the link is down) says nothing."""
        if not (modeled_mj > 0 and math.isfinite(modeled_mj) and math.isfinite(observed_mj)):
            return False
        if len(self._pairs) == self._pairs.maxlen:
            old = self._pairs[0]
            self._sums = (self._sums[0] - old[0], self._sums[1] - old[1])
        self._pairs.append((observed_mj, modeled_mj))
        self._sums = (self._sums[0] + observed_mj, self._sums[1] + modeled_mj)
        self._added += 1
        if self._added % len(self._pairs) == 0:  # once a window, summed afresh: no rounding builds up
            self._sums = (math.fsum(o for o, _ in self._pairs), math.fsum(m for _, m in self._pairs))
        if len(self._pairs) < self._min:
            return False
        scale = self.ratio()
        if abs(scale / self.scale - 1) > 0.01 and abs(scale / self.scale - 1) > self.noise():
            self.scale = scale
            return True
        return False

    def ratio(self) -> float:
        """The window's observed over modeled energy, clamped (1 before `min_pairs`)."""
        if len(self._pairs) < self._min:
            return 1.0
        return min(max(self._sums[0] / max(self._sums[1], 1e-12), 0.25), 4.0)

    def noise(self) -> float:
        """The relative standard error of the window's ratio (0 before `min_pairs`): the standard error of
        each pair's observed energy about the ratio times its modeled one (`series_stderr`: spells count),
        over the modeled mean."""
        n = len(self._pairs)
        if n < self._min:
            return 0.0
        pairs = np.array(self._pairs, dtype=float)
        ratio = self._sums[0] / max(self._sums[1], 1e-12)
        se = series_stderr(pairs[:, 0] - ratio * pairs[:, 1]) / max(float(np.mean(pairs[:, 1])), 1e-12)
        return se / max(ratio, 1e-12)


def series_stderr(values: np.ndarray, block: int = SE_BLOCK) -> float:
    """The standard error of the mean of a series in time order: the larger of the one for independent values
    and the batch-means one (the spread of the means of consecutive blocks of `block`, given 4 blocks or
    more). A host slowed for a second makes the inference times of that second alike: the window's mean then
    swings by far more than independent values would let it, and only the blocks' spread shows it (in the
    energy phase of `bench/controller/run.py --phases binding` the inference calibration moved by 19 % within
    5 s, past two of its independent-values standard errors, and the point chosen under the budget with it)."""
    n = values.size
    if n < 2:
        return 0.0
    se = float(np.std(values, ddof=1)) / math.sqrt(n)
    k = n // block
    if k >= 4:
        means = values[n - k * block:].reshape(k, block).mean(axis=1)
        se = max(se, float(np.std(means, ddof=1)) / math.sqrt(k))
    return se


class EnergyParts:
    """The energy plan's two part calibrations (`PartCalibration`) and what the request being folded has
    reported of its parts so far: `inference` (observed inference energy against the model's inference
    term, the variant's live median) and `escalation` (what an escalation added to its request against
    what the model charges that very escalation: its bytes, its round trip or wait).

    Example:
        >>> parts = EnergyParts()
        >>> parts.inferred("fp32", 2.0); parts.charged(14.7)
        >>> moved = parts.add(17.9, escalated=True, variant="fp32", modeled_inference_mj=2.0, measured=True)
    """

    def __init__(self) -> None:
        self.inference, self.escalation = PartCalibration(), PartCalibration()
        self._inferred: tuple[str, float] | None = None  # (variant, mJ) of the inference just reported
        self._charged: float | None = None  # what the model charges the escalation just reported

    def inferred(self, variant: str, energy_mj: float | None) -> None:
        """The request's inference on `variant` spent `energy_mj` (None: not measured)."""
        self._inferred = None if energy_mj is None else (variant, float(energy_mj))

    def charged(self, model_mj: float | None) -> None:
        """The model charges the request's escalation `model_mj` (None: not sent)."""
        self._charged = model_mj

    def add(self, energy_mj: float, escalated: bool, variant: str, modeled_inference_mj: float, *,
            measured: bool) -> bool:
        """Feed the whole request's energy on `variant` (the current one) and forget what it reported;
        `modeled_inference_mj` is the model's inference term, `measured` whether it is the variant's live
        median (a prior calibrates nothing). True when either scale moved."""
        last, charge = self._inferred, self._charged
        self._inferred = self._charged = None
        inference = last[1] if last is not None and last[0] == variant else None
        moved = inference is not None and measured and self.inference.add(inference, modeled_inference_mj)
        if escalated and charge is not None:
            spent = inference if inference is not None else modeled_inference_mj
            moved = self.escalation.add(energy_mj - spent, charge) or moved
        return moved

    def forget(self) -> None:
        """The request was not the current variant's: what it reported calibrates nothing."""
        self._inferred = self._charged = None


def energy_noise(cur: Decision, link: LinkState | None, z: float, *, inference: PartCalibration | None = None,
                 escalation: PartCalibration | None = None) -> float:
    """`z` relative standard errors of the current point's planned energy (call it with an energy budget):
    the mean round trip of the window prices each escalation's waiting energy (its standard error times
    the waiting power, as calibrated, over the escalations planned) and the two part calibrations' ratios
    (each over its term's share of the energy). At most 0.25."""
    if cur.predicted_energy_mj <= 0:
        return 0.0
    model = cur.inputs.get("energy_model") or {}
    cond = cur.inputs.get("conditions") or {}
    inference_mj = float(model.get("inference_mj", 0.0)) * float(cond.get("inference_energy_scale", 1.0))
    x_scale = float(cond.get("escalation_energy_scale", 1.0))
    rel = 0.0
    if link is not None and link.up:
        answered = link.rtt_samples[np.isfinite(link.rtt_samples)]
        if answered.size >= 2:
            se_ms = float(np.std(answered, ddof=1)) / math.sqrt(answered.size)
            rel = se_ms * link.wait_power_w * x_scale * cur.predicted_escalation_rate / cur.predicted_energy_mj
    inference_share = min(inference_mj / cur.predicted_energy_mj, 1.0)
    parts = math.hypot(inference.noise() * inference_share if inference is not None else 0.0,
                       escalation.noise() * (1 - inference_share) if escalation is not None else 0.0)
    return min(z * math.hypot(rel, parts), 0.25)


def energy_hold(cur: Decision, link: LinkState | None, profile: VariantProfile, z: float, *,
                inference: PartCalibration | None = None, escalation: PartCalibration | None = None) -> float:
    """`z` relative standard errors of the current point's planned energy, as `energy_noise` (the window's mean
    round trip, the two calibrations) and the escalation share it plans for: a binomial estimate over the
    variant's live scores (its validation scores before any), which each escalation's part of the energy
    moves with. The controller passes z = 1: `decide.switch_reason`'s `energy_se`, the unit of how far the
    estimate may move by noise alone before the point moves. At most 0.25."""
    e, total = cur.predicted_escalation_rate, cur.predicted_energy_mj
    share = 0.0
    if total > 0 and 0 < e < 1:
        n = len(profile.live_scores) or profile.scores.size
        model, cond = cur.inputs.get("energy_model") or {}, cur.inputs.get("conditions") or {}
        spent = float(model.get("inference_mj", 0.0)) * float(cond.get("inference_energy_scale", 1.0))
        share = math.sqrt(e * (1 - e) / max(n, 1)) / e * max(total - spent, 0.0) / total
    parts = energy_noise(cur, link, 1.0, inference=inference, escalation=escalation)
    return min(z * math.hypot(parts, share), 0.25)


def gain_stderr(profile: VariantProfile, cur: Decision, cand: Decision) -> float:
    """The standard error of the predicted accuracy difference between two thresholds of one variant
    (`profile`'s): the validation sampling error of the edge's correctness over the band of inputs one
    escalates and the other does not, times the share of escalations answered (0 across variants)."""
    if cand.variant != cur.variant:
        return 0.0
    var = profile.escalated_variance(np.array([cur.threshold, cand.threshold]))
    answered = float(cand.inputs.get("escalations_answered") or 0.0)
    return answered * math.sqrt(abs(float(var[0] - var[1])))


def variant_stderr(cur_profile: VariantProfile, cand_profile: VariantProfile, cur: Decision, cand: Decision) -> float:
    """The standard error of the predicted accuracy difference between points of two variants: each
    point's edge-sampling error (its accepted inputs, and its escalated ones as far as the cloud does
    not answer them, from its variant's validation set), taken as independent; 0 for one variant
    (`gain_stderr` covers that). On a validation set of a few hundred inputs, a few tenths of a point."""
    if cand.variant == cur.variant:
        return 0.0
    total = 0.0
    for profile, d in ((cur_profile, cur), (cand_profile, cand)):
        every, escalated = (float(v) for v in profile.escalated_variance(np.array([np.inf, d.threshold])))
        missed = 1.0 - float(d.inputs.get("escalations_answered") or 0.0)
        total += max(every - escalated, 0.0) + missed ** 2 * escalated
    return math.sqrt(total)


def cloud_noise(cur: Decision, cand: Decision, profile: VariantProfile, prior_strength: float, z: float) -> float:
    """How much two points of one variant (`profile`'s) may differ in predicted accuracy by the fitted
    cloud accuracy's own uncertainty alone. A threshold move gains the edge's error on the inputs it
    moves times (1 - rho), rho the cloud's error over the edge's (`plan._cloud_accuracy`): its
    uncertainty is the gain times sd(rho) / (1 - rho), sd(rho) from the cloud accuracy's binomial
    spread over its agreements and prior (`prior_strength`); `z` of those."""
    link = cand.inputs.get("link")
    if cand.variant != cur.variant or not link:
        return 0.0
    c, n = float(link["cloud_accuracy"]), float(link["agreement_n"]) + prior_strength
    ref = link.get("cloud_reference_accuracy")
    edge_error = max(1 - float(ref if ref is not None else profile.accuracy), 1e-3)
    rho, sd = (1 - c) / edge_error, math.sqrt(c * (1 - c) / max(n, 1.0)) / edge_error
    gain = abs(cand.predicted_accuracy - cur.predicted_accuracy)
    return z * gain * sd / max(1 - rho, 0.05)


def energy_evidence(a: VariantProfile, b: VariantProfile, z: float, *, budget_set: bool = False) -> bool:
    """Whether two variants' measured energies differ by more than `z` standard errors (a modeled figure
    is no evidence: its noise would move the controller between them and back); a variant against itself
    always is, and so are any figures in the re-decision as a budget is set that holds an energy budget
    (`budget_set`): the point chosen under another budget has no claim to stand, and one move cannot flap."""
    if a.id == b.id or budget_set:
        return True
    if not (measured(a.energy_label) and measured(b.energy_label)):
        return False
    se = math.hypot(a.energy_stderr(), b.energy_stderr())
    return math.isfinite(se) and abs(a.energy_mj - b.energy_mj) > z * se


def outside(k: int, n: int, p: float, z: float) -> bool:
    """Whether k successes in n trials are further than z binomial standard deviations from rate p."""
    p = min(max(p, 0.0), 1.0)
    return abs(k / n - p) > z * math.sqrt(max(p * (1 - p), 0.25 / n) / n) + 0.5 / n


def measured(label: str) -> bool:
    """Whether an energy label names a measurement (not a model)."""
    return str(label).startswith("measured")
