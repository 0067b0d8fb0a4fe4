"""Escalation policies on known logits, and thresholds derived from a target rate or accuracy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_agent.policy import (
    Calibrated,
    CustomScore,
    EnergyOOD,
    Entropy,
    Margin,
    MaxProb,
    MinOf,
    Policy,
    Weighted,
    as_scorer,
    scorer_names,
    threshold_for_accuracy,
    threshold_for_rate,
)
from runtimes.errors import ConfigError

LOGITS = np.array([[10.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
OUT = {"logits": LOGITS}


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_max_prob_matches_softmax() -> None:
    np.testing.assert_allclose(MaxProb().score(OUT), _softmax(LOGITS.astype(np.float64)).max(axis=1))


def test_temperature_flattens_the_scores() -> None:
    assert (MaxProb(2.0).score(OUT)[:2] < MaxProb(1.0).score(OUT)[:2]).all()


def test_margin_is_zero_on_a_tie_and_near_one_when_sure() -> None:
    s = Margin().score(OUT)
    assert s[0] > 0.99
    assert s[1] == pytest.approx(0.0)
    assert s[2] == pytest.approx(0.0)


def test_entropy_is_one_minus_normalised_entropy() -> None:
    s = Entropy().score(OUT)
    assert s[0] > 0.99
    assert s[2] == pytest.approx(0.0, abs=1e-12)
    p = _softmax(LOGITS[1:2].astype(np.float64))[0]
    assert s[1] == pytest.approx(1 + (p * np.log(p)).sum() / math.log(3))


def test_calibrated_uses_the_manifest_temperature() -> None:
    bound = Calibrated().bind({"temperature": 2.0}, "logits")
    np.testing.assert_allclose(bound.score(OUT), MaxProb(2.0).score(OUT))


def test_energy_ood_is_one_in_range_and_falls_outside() -> None:
    ood = EnergyOOD(k=1.0).bind({"ood": {"energy_p99": -5.0, "energy_std": 1.0}}, "logits")
    s = ood.score(OUT)  # energies: about -10, -1.86, -1.10
    assert s[0] == 1.0
    assert s[1] == 0.0
    assert s[2] == 0.0
    assert EnergyOOD().bind({}, "logits").score(OUT).tolist() == [1.0, 1.0, 1.0]


def test_min_of_and_weighted_combine() -> None:
    combo = MinOf(MaxProb(), Margin())
    np.testing.assert_allclose(combo.score(OUT), np.minimum(MaxProb().score(OUT), Margin().score(OUT)))
    w = Weighted((MaxProb(), 3.0), (Margin(), 1.0))
    np.testing.assert_allclose(w.score(OUT), 0.75 * MaxProb().score(OUT) + 0.25 * Margin().score(OUT))


def test_custom_callable_and_names() -> None:
    scorer = as_scorer(lambda out: out["logits"][:, 0])
    assert isinstance(scorer, CustomScore)
    assert scorer.score(OUT).tolist() == [10.0, 1.0, 0.0]
    assert {"max_prob", "margin", "entropy", "calibrated", "ood", "calibrated+ood"} <= set(scorer_names())
    with pytest.raises(ConfigError, match="not one of"):
        as_scorer("confidence")


def test_threshold_for_rate_escalates_that_fraction() -> None:
    scores = np.linspace(0, 1, 101)
    for rate in (0.0, 0.1, 0.25, 0.5, 1.0):
        t = threshold_for_rate(scores, rate)
        assert np.mean(scores < t) == pytest.approx(rate, abs=0.01)
    with pytest.raises(ConfigError):
        threshold_for_rate(scores, 1.5)


def test_threshold_for_accuracy_escalates_the_fewest_rows() -> None:
    scores = np.array([0.1, 0.2, 0.3, 0.9, 0.95, 0.99])
    correct = np.array([0, 0, 1, 1, 1, 1], dtype=bool)
    t = threshold_for_accuracy(scores, correct, 1.0)
    assert np.sum(scores < t) == 2  # the two wrong rows, nothing more
    assert threshold_for_accuracy(scores, correct, 0.5) == -math.inf
    # a cap that makes the target unreachable keeps the cap
    t = threshold_for_accuracy(scores, correct, 1.0, max_rate=1 / 6)
    assert np.sum(scores < t) == 1
    # an imperfect cloud: escalating wrong rows still helps, by its accuracy
    t = threshold_for_accuracy(scores, correct, 0.8, cloud_accuracy=0.5)
    assert np.sum(scores < t) == 2


def test_policy_bind_from_validation_data() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(400, 10)).astype(np.float32)
    labels = logits.argmax(axis=1)
    labels[:40] = (labels[:40] + 1) % 10
    bound = Policy("max_prob", target_rate=0.2).bind({}, (logits, labels), "logits")
    _, mask = bound.decide({"logits": logits})
    assert mask.mean() == pytest.approx(0.2, abs=0.01)
    bound = Policy("margin", target_accuracy=0.97).bind({}, (logits, labels), "logits")
    _, mask = bound.decide({"logits": logits})
    tiered = np.where(mask, True, logits.argmax(axis=1) == labels).mean()
    assert tiered >= 0.97
    assert bound.decide({"logits": logits}, threshold=-1.0)[1].sum() == 0


def test_policy_validation() -> None:
    with pytest.raises(ConfigError, match="one of"):
        Policy(threshold=0.5, target_rate=0.2)
    with pytest.raises(ConfigError, match="validation"):
        Policy(target_rate=0.2).bind({}, None)
    assert Policy().bind({}).threshold == 0.9
    ood = Policy("margin", ood=True).scorer({"ood": {"energy_p99": -5.0, "energy_std": 1.0}}, "logits")
    assert isinstance(ood, MinOf)
