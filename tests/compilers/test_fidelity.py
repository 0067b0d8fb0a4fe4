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
    nll,
)
from runtimes.errors import ConfigError
from sdk import zoo


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


def test_guard_verdicts() -> None:
    guard = Guard(max_drop=1.0)
    ok = guard.check({"drop_points": 0.5, "cosine_mean": 0.9}, "classification")
    assert ok.passed
    bad = guard.check({"drop_points": 1.5, "cosine_mean": 0.999, "accuracy": 0.9}, "classification")
    assert not bad.passed
    assert bad.reason == "accuracy drop 1.50 points > 1 allowed"
    emb = guard.check({"cosine_mean": 0.98}, "embedding")
    assert not emb.passed
    assert emb.required == {"min_cosine_mean": 0.99}
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
