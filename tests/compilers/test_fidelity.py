"""Fidelity figures, the guard's verdicts, temperature scaling, escalation curves, OOD statistics."""

from __future__ import annotations

import numpy as np
import pytest

from compilers.fidelity import (
    Guard,
    classifier_calibration,
    escalation_curve,
    fit_temperature,
    free_energy,
    measure,
    measure_outputs,
    nll,
)
from runtimes.errors import ConfigError
from testkit import zoo


def test_measure_classifier_with_labels() -> None:
    ref = np.array([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 2.0]])
    out = np.array([[2.0, 0.1], [0.0, 2.0], [0.0, 2.0], [0.0, 2.0]])
    labels = np.array([0, 1, 0, 0])
    fid = measure(ref, out, labels, task="classification")
    assert fid["top1_agreement"] == 0.75
    assert fid["reference_accuracy"] == 0.75
    assert fid["accuracy"] == 0.5
    assert fid["drop_points"] == pytest.approx(25.0)
    assert fid["max_abs_error"] == pytest.approx(2.0)
    assert fid["cosine_min"] < fid["cosine_mean"] < 1.0


def test_measure_without_labels_counts_disagreement() -> None:
    ref = np.eye(4)
    out = np.eye(4)[[0, 1, 2, 0]]
    fid = measure(ref, out, None, task="classification")
    assert fid["drop_points"] == pytest.approx(25.0)
    assert "accuracy" not in fid


def _detections(rng: np.random.Generator, n: int = 16) -> np.ndarray:
    """A YOLOv8-style output: 4 box coordinates in pixels (0-320) then 80 class scores (0-1), over 300 anchors."""
    boxes = rng.uniform(0, 320, (n, 4, 300))
    scores = rng.beta(0.3, 8.0, (n, 80, 300))
    return np.concatenate([boxes, scores], axis=1)


def test_dead_class_scores_are_seen_where_the_mean_cosine_is_blind() -> None:
    rng = np.random.default_rng(0)
    ref = _detections(rng)
    out = ref.copy()
    out[:, :4] += rng.normal(0, 2.0, out[:, :4].shape)  # boxes a couple of pixels off
    out[:, 4:] = 0.0                                     # every class score dead (a shared concat scale)
    fid = measure(ref, out, None, task="regression")
    assert fid["cosine_mean"] > 0.999                    # what the old guard looked at: it passed this
    numeric, where = measure_outputs({"output0": ref}, {"output0": out})
    assert numeric["slice_error_max"] == pytest.approx(1.0, abs=1e-6)
    assert where.startswith("output0[axis 1 = ")
    assert int(where.split("= ")[1].rstrip("]")) >= 4
    verdict = Guard().check({**fid, **numeric}, "regression", where=where)
    assert not verdict.passed
    assert "slice error 1.000 at output0[axis 1" in verdict.reason


def test_healthy_quantization_noise_passes_the_slice_check() -> None:
    rng = np.random.default_rng(1)
    ref = _detections(rng)
    out = ref + rng.normal(0, 1.0, ref.shape) * np.where(np.arange(84) < 4, 1.0, 0.004)[None, :, None]
    numeric, _ = measure_outputs({"output0": ref}, {"output0": out})
    fid = {**measure(ref, out, None, task="regression"), **numeric}
    assert numeric["slice_error_max"] < 0.2
    assert Guard().check(fid, "regression").passed


def test_every_output_is_compared_not_only_the_first() -> None:
    ref = {"prob": np.full((4, 1), 0.5), "state": np.ones((2, 4, 8))}
    out = {"prob": ref["prob"].copy(), "state": np.zeros((2, 4, 8))}
    numeric, where = measure_outputs(ref, out)
    assert numeric["slice_error_max"] == pytest.approx(1.0)
    assert where.startswith("state")
    with pytest.raises(ConfigError, match="no output 'state'"):
        measure_outputs(ref, {"prob": out["prob"]})


def test_fp32_rungs_are_held_to_a_numeric_bound_not_to_accuracy() -> None:
    rng = np.random.default_rng(2)
    ref = rng.normal(0, 5, (64, 10))
    bf16_like = ref * (1 + rng.normal(0, 4e-3, ref.shape))  # bf16 rounding: top-1 unchanged
    fid = {**measure(ref, bf16_like, None, task="classification"), **measure_outputs({"y": ref}, {"y": bf16_like})[0]}
    assert fid["drop_points"] < 1.0
    guard = Guard()
    assert guard.check(fid, "classification").passed        # fine for a lower-precision rung
    verdict = guard.check(fid, "classification", numeric=True)
    assert not verdict.passed
    assert "lower precision" in verdict.reason
    rounding = ref + rng.normal(0, 1e-6, ref.shape)
    exact = measure_outputs({"y": ref}, {"y": rounding})[0]
    assert guard.check(exact, "classification", numeric=True).passed


def test_fp32_bound_is_per_task_and_a_sequence_keeps_every_decoded_row() -> None:
    """OpenVINO f32 on the OCR recognizer: 1.19e-4 of the probabilities' scale over 128 lines, every line the same."""
    guard = Guard()
    assert guard.required("classification", numeric=True) == {"max_rel_error": 1e-4}
    assert guard.required("sequence", numeric=True) == {"max_rel_error": 1e-3, "min_sequence_rows_unchanged": 1.0}
    fid = {"max_rel_error": 1.19e-4, "sequence_rows_unchanged": 1.0, "char_error_rate": 0.0, "sequence_rows": 128.0}
    assert guard.check(fid, "sequence", numeric=True).passed
    assert not guard.check(fid, "classification", numeric=True).passed
    one_line = guard.check({**fid, "sequence_rows_unchanged": 127 / 128}, "sequence", numeric=True)
    assert not one_line.passed
    assert "1 of 128" in one_line.reason
    assert not guard.check({**fid, "max_rel_error": 2e-3}, "sequence", numeric=True).passed  # bf16-like error
    assert Guard(fp32_bound=1e-4).required("sequence", numeric=True)["max_rel_error"] == 1e-4  # one bound for all


def test_user_metric_below_the_reference_fails_the_guard() -> None:
    fid = {"drop_points": 0.0, "cosine_mean": 1.0, "metric": 0.60, "reference_metric": 0.70}
    verdict = Guard(max_metric_drop=0.05).check(fid, "classification")
    assert not verdict.passed
    assert "metric 0.6000 is 0.1000 below" in verdict.reason
    assert Guard(max_metric_drop=0.2).check(fid, "classification").passed


def test_guard_verdicts() -> None:
    guard = Guard(max_drop=1.0)
    ok = guard.check({"drop_points": 0.5, "cosine_mean": 0.9}, "classification")
    assert ok.passed
    bad = guard.check({"drop_points": 1.5, "cosine_mean": 0.999, "accuracy": 0.9}, "classification")
    assert not bad.passed
    assert bad.reason == "accuracy drop 1.50 points > 1 allowed"
    emb = guard.check({"cosine_mean": 0.98}, "embedding")
    assert not emb.passed
    assert emb.required == {"min_cosine_mean": 0.99, "max_slice_error": 0.35}
    assert Guard(min_cosine=0.95).check({"cosine_mean": 0.98}, "embedding").passed
    with pytest.raises(ConfigError, match="min_cosine 2"):
        Guard(min_cosine=2)


def test_temperature_fit_lowers_validation_nll(digits_linear, digits: zoo.Split) -> None:  # type: ignore[no-untyped-def]
    logits = zoo.predict(digits_linear, digits.x_val) * 4.0  # an over-confident classifier that makes mistakes
    t = fit_temperature(logits, digits.y_val)
    assert t > 1.0
    assert nll(logits, digits.y_val, t) < 0.8 * nll(logits, digits.y_val)
    for other in (t * 0.8, t * 1.25):  # a minimum, not just an improvement
        assert nll(logits, digits.y_val, t) <= nll(logits, digits.y_val, other) + 1e-9


def test_escalation_curve_trades_coverage_for_accuracy(digits_cnn, digits: zoo.Split) -> None:  # type: ignore[no-untyped-def]
    logits = zoo.predict(digits_cnn, digits.x_val)
    curve = escalation_curve(logits, digits.y_val, 1.0)
    assert curve[0]["threshold"] == 0.0
    assert curve[0]["escalation_rate"] == 0.0
    assert curve[0]["accuracy_accepted"] == pytest.approx(zoo.accuracy(logits, digits.y_val))
    rates = [p["escalation_rate"] for p in curve]
    assert rates == sorted(rates)
    assert all(p["coverage"] == pytest.approx(1 - p["escalation_rate"]) for p in curve)
    assert curve[-1]["accuracy_accepted"] >= curve[0]["accuracy_accepted"]


def test_free_energy_and_calibration_bundle(digits_cnn, digits: zoo.Split) -> None:  # type: ignore[no-untyped-def]
    logits = zoo.predict(digits_cnn, digits.x_val)
    np.testing.assert_allclose(free_energy(logits, 1.0), -np.log(np.exp(logits).sum(axis=1)), rtol=1e-6)
    noise = zoo.predict(digits_cnn, np.random.default_rng(0).uniform(0, 1, digits.x_val.shape).astype(np.float32))
    cal = classifier_calibration(logits, logits, None, logits)
    assert cal["temperature_fit_on"] == "reference_argmax"
    # in-distribution inputs have lower (more negative) free energy than uniform noise, on average
    assert cal["ood"]["energy_mean"] < free_energy(noise, cal["temperature"]).mean()
