"""The accuracy guard: how far a variant's outputs are from the fp32 reference, and whether that is enough.

Figures (all measured on the same validation inputs):

- classifiers: top-1 agreement with the reference, task accuracy and the reference's accuracy when
  labels exist, and the drop in points (accuracy drop with labels, disagreement without);
- every task: cosine similarity per sample (mean and min) and max abs error.

For classifiers it also fits a softmax temperature (calibrated confidence for the edge policy),
the escalation curve (threshold -> escalation rate, accuracy on what stays at the edge), and the
free-energy statistics the agent uses to flag out-of-distribution inputs.

Example:
    >>> guard = Guard(max_drop=1.0)
    >>> fid = measure(reference_logits, variant_logits, labels, task="classification")
    >>> guard.check(fid, "classification").passed
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtimes.errors import ConfigError
from runtimes.spec import Task

DEFAULT_MIN_COSINE = 0.99


def measure(reference: np.ndarray, outputs: np.ndarray, labels: np.ndarray | None, *, task: str) -> dict[str, float]:
    """Fidelity of `outputs` against `reference` (first output of each, samples on axis 0)."""
    ref = np.asarray(reference, dtype=np.float64)
    out = np.asarray(outputs, dtype=np.float64)
    if ref.shape != out.shape:
        msg = f"variant output shape {list(out.shape)} differs from the reference's {list(ref.shape)}"
        raise ConfigError(msg)
    n = len(ref)
    r, o = ref.reshape(n, -1), out.reshape(n, -1)
    norms = np.linalg.norm(r, axis=1) * np.linalg.norm(o, axis=1)
    cos = np.where(norms > 0, (r * o).sum(axis=1) / np.maximum(norms, 1e-30), 1.0)
    fid: dict[str, float] = {
        "samples": float(n),
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "max_abs_error": float(np.abs(r - o).max()) if r.size else 0.0,
    }
    if task == Task.CLASSIFICATION and ref.ndim == 2:
        ref_top, out_top = ref.argmax(axis=1), out.argmax(axis=1)
        fid["top1_agreement"] = float((ref_top == out_top).mean())
        fid["drop_points"] = 100.0 * (1.0 - fid["top1_agreement"])
        if labels is not None:
            y = np.asarray(labels).reshape(-1)
            fid["accuracy"] = float((out_top == y).mean())
            fid["reference_accuracy"] = float((ref_top == y).mean())
            fid["drop_points"] = 100.0 * (fid["reference_accuracy"] - fid["accuracy"])
    return fid


@dataclass(frozen=True)
class Verdict:
    """The guard's answer: passed or not, the limit, and the reason in words with the numbers."""

    passed: bool
    reason: str
    required: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Guard:
    """Limits a variant must meet against the fp32 reference.

    Args:
        max_drop: most accuracy points a classifier may lose (labels) or disagree on (no labels).
        min_cosine: least mean cosine similarity to the reference; the criterion for embeddings and
            regression (default 0.99 there), and an extra one for classifiers when given.
    """

    max_drop: float = 1.0
    min_cosine: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.max_drop <= 100:
            msg = f"max_drop {self.max_drop!r} must be in [0, 100] accuracy points"
            raise ConfigError(msg)
        if self.min_cosine is not None and not -1 <= self.min_cosine <= 1:
            msg = f"min_cosine {self.min_cosine!r} must be in [-1, 1]"
            raise ConfigError(msg)

    def required(self, task: str) -> dict[str, float]:
        if task == Task.CLASSIFICATION:
            req = {"max_drop_points": self.max_drop}
            if self.min_cosine is not None:
                req["min_cosine_mean"] = self.min_cosine
            return req
        return {"min_cosine_mean": self.min_cosine if self.min_cosine is not None else DEFAULT_MIN_COSINE}

    def check(self, fid: dict[str, float], task: str) -> Verdict:
        """Compare measured figures with the limits for `task`."""
        req = self.required(task)
        problems = []
        if "max_drop_points" in req and "drop_points" in fid and fid["drop_points"] > req["max_drop_points"] + 1e-9:
            kind = "accuracy drop" if "accuracy" in fid else "top-1 disagreement with fp32"
            problems.append(f"{kind} {fid['drop_points']:.2f} points > {req['max_drop_points']:g} allowed")
        if "min_cosine_mean" in req and fid["cosine_mean"] < req["min_cosine_mean"]:
            problems.append(f"mean cosine {fid['cosine_mean']:.4f} < {req['min_cosine_mean']:g} required")
        if not problems:
            return Verdict(True, "within limits", req)
        return Verdict(False, "; ".join(problems), req)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    out: np.ndarray = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return out


def nll(logits: np.ndarray, targets: np.ndarray, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of `targets` under softmax(logits / temperature)."""
    logp = _log_softmax(np.asarray(logits, np.float64) / temperature)
    return float(-logp[np.arange(len(targets)), np.asarray(targets, np.int64)].mean())


def fit_temperature(logits: np.ndarray, targets: np.ndarray, *, lo: float = 0.05, hi: float = 20.0) -> float:
    """The temperature T minimizing validation NLL of softmax(logits / T).

    NLL is convex in 1/T, so a golden-section search over log T finds the optimum.
    """
    a, b = np.log(lo), np.log(hi)
    ratio = (np.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = nll(logits, targets, np.exp(c)), nll(logits, targets, np.exp(d))
    for _ in range(60):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = nll(logits, targets, np.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = nll(logits, targets, np.exp(d))
    return float(np.exp((a + b) / 2))


def softmax_confidence(logits: np.ndarray, temperature: float) -> np.ndarray:
    out: np.ndarray = np.exp(_log_softmax(np.asarray(logits, np.float64) / temperature).max(axis=1))
    return out


def escalation_curve(logits: np.ndarray, targets: np.ndarray, temperature: float,
                     thresholds: np.ndarray | None = None) -> list[dict[str, float]]:
    """For each threshold on the calibrated max-probability: escalation rate and accuracy kept at the edge.

    Inputs scoring below the threshold escalate; `accuracy_accepted` is the accuracy (against labels,
    or the reference's argmax) on the rest, and `coverage` the share that stays at the edge.
    """
    score = softmax_confidence(logits, temperature)
    correct = np.asarray(logits).argmax(axis=1) == np.asarray(targets)
    if thresholds is None:
        thresholds = np.unique(np.round(np.concatenate([np.linspace(0.0, 0.95, 20), [0.97, 0.98, 0.99, 0.995, 0.999],
                                                        np.quantile(score, np.linspace(0.05, 0.95, 19))]), 4))
    curve = []
    for t in thresholds:
        accepted = score >= t
        coverage = float(accepted.mean())
        curve.append({"threshold": float(t), "escalation_rate": 1.0 - coverage,
                      "accuracy_accepted": float(correct[accepted].mean()) if accepted.any() else 1.0,
                      "coverage": coverage})
    return curve


def free_energy(logits: np.ndarray, temperature: float) -> np.ndarray:
    """-T · logsumexp(logits / T) per sample (lower means more in-distribution)."""
    z = np.asarray(logits, np.float64) / temperature
    m = z.max(axis=1, keepdims=True)
    out: np.ndarray = -temperature * (m[:, 0] + np.log(np.exp(z - m).sum(axis=1)))
    return out


def ood_stats(logits: np.ndarray, temperature: float) -> dict[str, float]:
    e = free_energy(logits, temperature)
    return {"energy_mean": float(e.mean()), "energy_std": float(e.std()),
            "energy_p01": float(np.quantile(e, 0.01)), "energy_p99": float(np.quantile(e, 0.99))}


def classifier_calibration(val_logits: np.ndarray, reference_logits: np.ndarray, labels: np.ndarray | None,
                           calib_logits: np.ndarray) -> dict[str, Any]:
    """Temperature, escalation curve and OOD statistics of one classifier variant."""
    targets = labels if labels is not None else np.asarray(reference_logits).argmax(axis=1)
    t = fit_temperature(val_logits, targets)
    return {"temperature": t, "temperature_fit_on": "labels" if labels is not None else "reference_argmax",
            "nll_before": nll(val_logits, targets), "nll_after": nll(val_logits, targets, t),
            "escalation_curve": escalation_curve(val_logits, targets, t),
            "ood": ood_stats(calib_logits, t)}
