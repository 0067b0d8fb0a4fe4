"""The accuracy guard: how far a variant's outputs are from the fp32 reference, and whether that is enough.

Figures (all measured on the same validation inputs):

- classifiers: top-1 agreement with the reference, task accuracy and the reference's accuracy when
  labels exist, and the drop in points (accuracy drop with labels, disagreement without);
- sequences (`[N, T, C]` read through a decoder, `compilers.sequence`): the share of rows whose decoded
  sequence is unchanged and the character error rate;
- segmentation maps (`[N, C, H, W]`, `compilers.maps`): per image, the IoU of the regions (a one-channel
  probability map thresholded, a class map's argmax) against the reference's, the worst and the mean;
- every task: cosine similarity per sample (mean and min) and max abs error;
- every output, not only the first (`measure_outputs`): the max error relative to that output's
  scale (max |reference|), which is what an fp32 rung is held to (`FP32_BOUND`), and the worst
  slice error: along the channel-like axes (axis 1 and the last axis, where they have at most
  `SLICE_AXIS_MAX` entries: the channels of NCHW maps, the rows of a YOLO-style [N, 4+C, anchors]
  output, the fields of [N, anchors, 4+C]; not spatial axes, whose near-empty rows make noise look
  large), each slice's RMS error relative to that slice's own RMS. A part of an output whose
  values are small beside the rest (class scores concatenated with box coordinates in pixels)
  cannot die unseen: all-zero scores give a slice error of 1.0 however good the mean cosine is;
- a user metric (`--metric module:function`), compared with the reference's value on the same data.

For classifiers it also fits a softmax temperature (calibrated confidence for the edge policy),
the escalation curve (threshold -> escalation rate, accuracy on what stays at the edge), and the
free-energy statistics the agent uses to flag out-of-distribution inputs.

Example:
    >>> guard = Guard(max_drop=1.0)
    >>> fid = measure(reference_logits, variant_logits, labels, task="classification")
    >>> guard.check(fid, "classification").passed
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compilers.maps import DEFAULT_MAP_MIN_COSINE, DEFAULT_MIN_MAP_IOU, measure_maps
from compilers.sequence import DEFAULT_DECODER, DEFAULT_MIN_ROWS_UNCHANGED, measure_sequences
from runtimes.errors import ConfigError
from runtimes.spec import Task

DEFAULT_MIN_COSINE = 0.99
# An fp32 rung (the same graph, another runtime or fused) may differ from the reference by rounding
# only: max |variant - reference| / max |reference| per output. Measured on the third-party zoo
# (bench/RESULTS.md): OpenVINO f32 and fused onnxruntime graphs 3e-10 to 5.8e-5. bf16 arithmetic is off
# by 1e-3 to 1e-2 in absolute terms on small models (FACTS.md), far past the bound.
FP32_BOUND = 1e-4
# Per task, where the elementwise bound measures something else than what the user reads. A sequence
# model's output is per-step probabilities after a softmax over thousands of symbols (an error e in a
# logit moves a probability by up to e / 4), and the max over N x T x C values grows with the validation
# set. OpenVINO f32 reorders float sums (legitimately) and measured 4.2e-5 on 32 rendered lines of
# PP-OCRv4's recognizer and 1.19e-4 on 128, with every decoded line unchanged; bf16 on the same
# recognizer measured cosine 0.998 (FACTS.md), an RMS error near 6 % of the output. So an fp32 rung of a
# sequence task is held to every decoded row unchanged (what the user reads, exactly) and 1e-3 of the
# scale (still far below lower-precision arithmetic).
FP32_BOUNDS: dict[str, float] = {Task.SEQUENCE.value: 1e-3}
FP32_ROWS_UNCHANGED = 1.0
# Lower precisions: the worst slice's RMS error relative to its own RMS; a part that collapsed to zero
# measures 1.0, one that lost its sign or scale more.
DEFAULT_MAX_SLICE_ERROR = 0.35
SLICE_AXIS_MAX = 256
_SCALE_FLOOR = 1e-6  # slices whose RMS is below this share of the output's max are judged on that floor


def measure_outputs(reference: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], *,
                    judged_by_task: str | None = None,
                    sample_axes: Mapping[str, int | None] | None = None) -> tuple[dict[str, float], str]:
    """Numeric fidelity over every output: `max_rel_error` and `slice_error_max`, and where the worst slice is.

    Outputs are compared by name; each must have the reference's shape (samples on axis 0).
    `judged_by_task` names a classifier's logits, which the task's accuracy judges: they count toward
    `max_rel_error` but not the slice check (a pruned classifier's logits move while its answers hold).
    `sample_axes` names outputs whose samples are not on axis 0 (a recurrent state `[layers, N, hidden]`):
    they are moved first, so that the slice axes are the same for every layout.
    """
    fid = {"max_rel_error": 0.0, "slice_error_max": 0.0}
    where = ""
    for name, ref_value in reference.items():
        if name not in outputs:
            msg = f"variant has no output {name!r}; the reference has {sorted(reference)}"
            raise ConfigError(msg)
        axis = (sample_axes or {}).get(name, 0)
        ref, out = np.asarray(ref_value), np.asarray(outputs[name])
        if axis and ref.ndim > axis and out.ndim > axis:
            ref, out = np.moveaxis(ref, axis, 0), np.moveaxis(out, axis, 0)
        if ref.shape != out.shape:
            msg = f"output {name!r}: variant shape {list(out.shape)} differs from the reference's {list(ref.shape)}"
            raise ConfigError(msg)
        if not ref.size:
            continue
        sums = _ErrorSums.of(ref.reshape(1) if ref.ndim == 0 else ref, out.reshape(1) if out.ndim == 0 else out)
        if sums is None:
            return {"max_rel_error": float("inf"), "slice_error_max": float("inf")}, f"{name}: non-finite values"
        fid["max_rel_error"] = max(fid["max_rel_error"], sums.max_err / max(sums.scale, 1e-30))
        if name == judged_by_task:
            continue
        worst, at = sums.worst_slice()
        if worst > fid["slice_error_max"]:
            fid["slice_error_max"], where = worst, f"{name}{at}"
    return fid, where


# Elements per float64 block when comparing outputs: a recognizer's [128, 40, 6625] probabilities are 34 M
# values, 271 MB as float64 at once; in blocks of rows the comparison is one pass through the cache.
_BLOCK = 1 << 20


def _row_blocks(n: int, row_size: int) -> list[slice]:
    """Slices of `n` rows of `row_size` elements each, about `_BLOCK` elements a slice."""
    step = max(1, _BLOCK // max(row_size, 1))
    return [slice(start, min(n, start + step)) for start in range(0, n, step)]


@dataclass
class _ErrorSums:
    """Squared error and power per slice of the channel-like axes, gathered over blocks of samples."""

    shape: tuple[int, ...]
    axes: dict[int, tuple[np.ndarray, np.ndarray]]  # axis -> (sum of err², sum of ref²) per entry
    err2: float = 0.0
    ref2: float = 0.0
    max_err: float = 0.0
    scale: float = 0.0

    @classmethod
    def of(cls, ref: np.ndarray, out: np.ndarray) -> _ErrorSums | None:
        """Sums over `ref` and `out` (samples first, same shape); None when `out` has a non-finite value."""
        axes = [a for a in (sorted({1, ref.ndim - 1}) if ref.ndim > 1 else ()) if ref.shape[a] <= SLICE_AXIS_MAX]
        sums = cls(ref.shape, {a: (np.zeros(ref.shape[a]), np.zeros(ref.shape[a])) for a in axes})
        for rows in _row_blocks(len(ref), ref[0].size):
            r, o = ref[rows].astype(np.float64), out[rows].astype(np.float64)
            if not np.isfinite(o).all():
                return None
            err2 = np.square(o - r)
            ref2 = np.square(r)
            sums.max_err = max(sums.max_err, float(np.sqrt(err2.max())))
            sums.scale = max(sums.scale, float(np.abs(r).max()))
            for a, (err_sums, ref_sums) in sums.axes.items():
                others = tuple(i for i in range(r.ndim) if i != a)
                np.add(err_sums, err2.sum(axis=others), out=err_sums)
                np.add(ref_sums, ref2.sum(axis=others), out=ref_sums)
            sums.err2 += float(err2.sum())
            sums.ref2 += float(ref2.sum())
        return sums

    def worst_slice(self) -> tuple[float, str]:
        """The largest slice RMS error relative to its RMS, and where (`[axis a = i]`, or "" for the whole)."""
        floor = max(self.scale * _SCALE_FLOOR, 1e-30)
        size = int(np.prod(self.shape))
        worst, where = 0.0, ""
        for a, (e, p) in self.axes.items():
            count = size / self.shape[a]
            rel = np.sqrt(e / count) / np.maximum(np.sqrt(p / count), floor)
            i = int(rel.argmax())
            if rel[i] > worst:
                worst, where = float(rel[i]), f"[axis {a} = {i}]"
        if len(self.shape) == 1 or not self.axes:
            whole = float(np.sqrt(self.err2 / size) / max(float(np.sqrt(self.ref2 / size)), floor))
            if whole > worst:
                worst, where = whole, ""
        return worst, where


def measure(reference: np.ndarray, outputs: np.ndarray, labels: np.ndarray | None, *, task: str,
            decoder: str = DEFAULT_DECODER) -> dict[str, float]:
    """Fidelity of `outputs` against `reference` (first output of each, samples on axis 0).

    A sequence task's `[N, T, C]` output is also decoded with `decoder` (`compilers.sequence`).
    """
    ref_in, out_in = np.asarray(reference), np.asarray(outputs)
    if ref_in.shape != out_in.shape:
        msg = f"variant output shape {list(out_in.shape)} differs from the reference's {list(ref_in.shape)}"
        raise ConfigError(msg)
    n = len(ref_in)
    r_all, o_all = ref_in.reshape(n, -1), out_in.reshape(n, -1)
    dots, r2, o2 = np.zeros(n), np.zeros(n), np.zeros(n)
    max_abs = 0.0
    for rows in _row_blocks(n, r_all.shape[1]):
        r, o = r_all[rows].astype(np.float64), o_all[rows].astype(np.float64)
        dots[rows], r2[rows], o2[rows] = (np.einsum("ij,ij->i", a, b) for a, b in ((r, o), (r, r), (o, o)))
        if r.size:
            max_abs = max(max_abs, float(np.abs(r - o).max()))
    norms = np.sqrt(r2) * np.sqrt(o2)
    cos = np.where(norms > 0, dots / np.maximum(norms, 1e-30), 1.0)
    fid: dict[str, float] = {
        "samples": float(n),
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "max_abs_error": max_abs,
    }
    if task == Task.CLASSIFICATION and ref_in.ndim == 2:
        ref_top, out_top = ref_in.argmax(axis=1), out_in.argmax(axis=1)
        fid["top1_agreement"] = float((ref_top == out_top).mean())
        fid["drop_points"] = 100.0 * (1.0 - fid["top1_agreement"])
        if labels is not None:
            y = np.asarray(labels).reshape(-1)
            fid["accuracy"] = float((out_top == y).mean())
            fid["reference_accuracy"] = float((ref_top == y).mean())
            fid["drop_points"] = 100.0 * (fid["reference_accuracy"] - fid["accuracy"])
    if task == Task.SEQUENCE and ref_in.ndim == 3:
        fid.update(measure_sequences(ref_in, out_in, decoder))
    if task == Task.SEGMENTATION and ref_in.ndim == 4:
        fid.update(measure_maps(ref_in, out_in))
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
        max_slice_error: most RMS error of any slice of any output relative to that slice's RMS
            (see `measure_outputs`), for every precision below fp32.
        fp32_bound: most max error relative to each output's scale for an fp32 rung of the same graph;
            an fp32 rung is held to this bound, not to accuracy (None: `FP32_BOUNDS` for the task, else
            `FP32_BOUND`; an fp32 rung of a sequence task must also leave every decoded row unchanged).
        max_metric_drop: most the user metric may fall below the reference's value (its own units).
        min_rows_unchanged: sequences: least share of rows whose decoded sequence equals the reference's.
        max_char_error: sequences: most character error rate against the reference's decoded sequences
            (None: not bounded beyond `min_rows_unchanged`).
        min_map_iou: segmentation maps: least IoU of the regions against the reference's, on every image
            (`compilers.maps`); the judged map is held to this and a loose mean cosine
            (`DEFAULT_MAP_MIN_COSINE`, or `min_cosine`), not to the slice check.
    """

    max_drop: float = 1.0
    min_cosine: float | None = None
    max_slice_error: float = DEFAULT_MAX_SLICE_ERROR
    fp32_bound: float | None = None
    max_metric_drop: float = 0.01
    min_rows_unchanged: float = DEFAULT_MIN_ROWS_UNCHANGED
    max_char_error: float | None = None
    min_map_iou: float = DEFAULT_MIN_MAP_IOU

    def __post_init__(self) -> None:
        if not 0 <= self.max_drop <= 100:
            msg = f"max_drop {self.max_drop!r} must be in [0, 100] accuracy points"
            raise ConfigError(msg)
        if self.min_cosine is not None and not -1 <= self.min_cosine <= 1:
            msg = f"min_cosine {self.min_cosine!r} must be in [-1, 1]"
            raise ConfigError(msg)
        if self.max_slice_error <= 0 or (self.fp32_bound is not None and self.fp32_bound <= 0) \
                or self.max_metric_drop < 0:
            msg = (f"max_slice_error {self.max_slice_error!r} and fp32_bound {self.fp32_bound!r} must be > 0, "
                   f"max_metric_drop {self.max_metric_drop!r} >= 0")
            raise ConfigError(msg)
        if not 0 <= self.min_rows_unchanged <= 1 or (self.max_char_error is not None and self.max_char_error < 0):
            msg = (f"min_rows_unchanged {self.min_rows_unchanged!r} must be in [0, 1] and max_char_error "
                   f"{self.max_char_error!r} >= 0")
            raise ConfigError(msg)
        if not 0 <= self.min_map_iou <= 1:
            msg = f"min_map_iou {self.min_map_iou!r} must be in [0, 1]"
            raise ConfigError(msg)

    def required(self, task: str, *, numeric: bool = False) -> dict[str, float]:
        """The limits for `task`; `numeric` for an fp32 rung of the reference graph (held to `fp32_bound`)."""
        if numeric:
            bound = self.fp32_bound if self.fp32_bound is not None else FP32_BOUNDS.get(str(task), FP32_BOUND)
            if task == Task.SEQUENCE:
                return {"max_rel_error": bound, "min_sequence_rows_unchanged": FP32_ROWS_UNCHANGED}
            return {"max_rel_error": bound}
        req: dict[str, float]
        if task == Task.CLASSIFICATION:
            req = {"max_drop_points": self.max_drop}
            if self.min_cosine is not None:
                req["min_cosine_mean"] = self.min_cosine
        elif task == Task.SEQUENCE:
            req = {"min_sequence_rows_unchanged": self.min_rows_unchanged}
            if self.max_char_error is not None:
                req["max_char_error_rate"] = self.max_char_error
            if self.min_cosine is not None:
                req["min_cosine_mean"] = self.min_cosine
        elif task == Task.SEGMENTATION:
            req = {"min_map_iou": self.min_map_iou,
                   "min_cosine_mean": self.min_cosine if self.min_cosine is not None else DEFAULT_MAP_MIN_COSINE}
        else:
            req = {"min_cosine_mean": self.min_cosine if self.min_cosine is not None else DEFAULT_MIN_COSINE}
        req["max_slice_error"] = self.max_slice_error
        return req

    def check(self, fid: dict[str, float], task: str, *, numeric: bool = False, where: str = "") -> Verdict:
        """Compare measured figures with the limits for `task` (`where`: the worst slice, for the reason)."""
        req = self.required(task, numeric=numeric)
        problems = []
        if "max_rel_error" in req and fid.get("max_rel_error", 0.0) > req["max_rel_error"]:
            problems.append(f"fp32 rung differs from the reference by {fid['max_rel_error']:.2e} of the output's "
                            f"scale > {req['max_rel_error']:g} allowed (computing in a lower precision?)")
        if "max_drop_points" in req and "drop_points" in fid and fid["drop_points"] > req["max_drop_points"] + 1e-9:
            kind = "accuracy drop" if "accuracy" in fid else "top-1 disagreement with fp32"
            problems.append(f"{kind} {fid['drop_points']:.2f} points > {req['max_drop_points']:g} allowed")
        if "min_cosine_mean" in req and fid["cosine_mean"] < req["min_cosine_mean"]:
            problems.append(f"mean cosine {fid['cosine_mean']:.4f} < {req['min_cosine_mean']:g} required")
        problems += _sequence_problems(fid, req)
        if "min_map_iou" in req and fid.get("map_iou_min", 0.0) < req["min_map_iou"] - 1e-12:
            problems.append(f"map regions moved: IoU {fid.get('map_iou_min', 0.0):.3f} on the worst of "
                            f"{int(fid.get('map_images', 0))} images (mean {fid.get('map_iou_mean', 0.0):.3f}) "
                            f"< {req['min_map_iou']:g} required")
        if "max_slice_error" in req and fid.get("slice_error_max", 0.0) > req["max_slice_error"]:
            at = f" at {where}" if where else ""
            problems.append(f"slice error {fid['slice_error_max']:.3f}{at} > {req['max_slice_error']:g} allowed "
                            "(part of an output lost its values)")
        if not numeric and "metric" in fid:
            req["max_metric_drop"] = self.max_metric_drop
            drop = fid["reference_metric"] - fid["metric"]
            if drop > self.max_metric_drop + 1e-12:
                problems.append(f"metric {fid['metric']:.4f} is {drop:.4f} below the reference's "
                                f"{fid['reference_metric']:.4f} > {self.max_metric_drop:g} allowed")
        if not problems:
            return Verdict(True, "within limits", req)
        return Verdict(False, "; ".join(problems), req)


def _sequence_problems(fid: dict[str, float], req: dict[str, float]) -> list[str]:
    problems = []
    if "min_sequence_rows_unchanged" in req:
        unchanged = fid.get("sequence_rows_unchanged", 0.0)
        if unchanged < req["min_sequence_rows_unchanged"] - 1e-12:
            rows = int(fid.get("sequence_rows", 0))
            changed = round((1 - unchanged) * rows)
            problems.append(f"decoded sequences changed on {100 * (1 - unchanged):.1f}% of rows ({changed} of {rows}; "
                            f"char error {100 * fid.get('char_error_rate', 0.0):.2f}%) > "
                            f"{100 * (1 - req['min_sequence_rows_unchanged']):g}% allowed")
    if "max_char_error_rate" in req and fid.get("char_error_rate", 0.0) > req["max_char_error_rate"]:
        problems.append(f"character error rate {100 * fid['char_error_rate']:.2f}% > "
                        f"{100 * req['max_char_error_rate']:g}% allowed")
    return problems


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
