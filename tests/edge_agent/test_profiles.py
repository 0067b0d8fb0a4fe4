"""Variant profiles from a real package, and the link profile's estimates."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from compilers.package import ModelPackage
from edge_agent.budget import Budget
from edge_agent.controller import ControllerConfig, choose
from edge_agent.policy import Policy
from edge_agent.profiles import LatencyWindow, LinkProfile, VariantProfile, lognormal_points
from runtimes.errors import ConfigError, PackageError
from testkit import zoo
from testkit.packages import profiled_package


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory, digits_cnn_onnx: Path, digits: zoo.Split) -> ModelPackage:
    written = profiled_package(tmp_path_factory.mktemp("pkg") / "fp32", digits_cnn_onnx, digits)
    return ModelPackage.open(written.directory)


def test_profile_from_a_real_package(package: ModelPackage, digits: zoo.Split) -> None:
    profile = VariantProfile.from_package(package, Policy("max_prob"))
    with np.load(package.directory / "validation.npz") as data:
        logits, labels = data["logits"], data["labels"]
    assert profile.id == "fp32"
    assert profile.validation_size == len(digits.y_val)
    assert profile.accuracy == pytest.approx(zoo.accuracy(logits, labels))
    assert (profile.energy_mj, profile.energy_label) == (1.5, "modeled:test-cpu")
    assert profile.latency.quantile(0.5) == pytest.approx(0.2, rel=0.05)
    # the escalation curve: escalating the least confident inputs leaves the accepted ones more accurate
    thresholds = profile.thresholds((0.0, 0.1, 1.0))
    esc, acc_accepted, acc_escalated = profile.curve(thresholds)
    assert esc.tolist() == pytest.approx([0.0, 0.1, 1.0], abs=0.01)
    assert acc_accepted[1] >= acc_accepted[0] == pytest.approx(profile.accuracy)
    if profile.accuracy < 1.0:
        assert acc_escalated[1] < profile.accuracy
    else:  # the digits CNN is not bit-reproducible across processes and sometimes makes no mistake
        assert acc_escalated[1] == acc_accepted[1] == 1.0
    # the scores are those of the bound scorer the agent uses
    bound = Policy("max_prob").scorer(package.manifest.calibration, "logits")
    assert np.sort(bound.score({"logits": logits})) == pytest.approx(profile.scores)


def test_self_benchmark_replaces_the_manifest_prior(package: ModelPackage, digits: zoo.Split) -> None:
    profile = VariantProfile.from_package(package, Policy("max_prob"))
    with package.open_session() as session:
        x = digits.x_test[:1]
        median = profile.self_benchmark(lambda: session.run({"x": x}), repeats=12)
    assert median > 0
    assert profile.baseline_p50_ms == pytest.approx(profile.latency.quantile(0.5))
    d = choose([profile], LinkProfile(rtt_ms=5).state(), Budget(latency_ms=50), ControllerConfig())
    assert d.variant == "fp32"
    assert d.feasible


def test_package_without_validation_is_refused(tmp_path: Path, digits_cnn_onnx: Path, digits: zoo.Split) -> None:
    pkg = profiled_package(tmp_path / "bare", digits_cnn_onnx, digits, validation=False)
    with pytest.raises(PackageError, match="validation"):
        VariantProfile.from_package(pkg, Policy("max_prob"))


def test_synthetic_profile_checks() -> None:
    with pytest.raises(ConfigError):
        VariantProfile("v", [0.1, 0.2], [True], [1.0], 1.0)
    with pytest.raises(ConfigError):
        VariantProfile("v", [0.1, math.nan], [True, False], [1.0], 1.0)
    p = VariantProfile("v", [0.9, 0.1, 0.5], [True, False, True], [1.0], 2.0)
    esc, acc, acc_esc = p.curve(np.array([0.3]))
    assert (esc[0], acc[0], acc_esc[0]) == pytest.approx((1 / 3, 1.0, 0.0))
    for mj in (4.0,) * 6 + (40.0,) * 3:  # the median ignores a minority of inflated figures
        p.observe_energy(mj, "measured:rapl")
    assert (p.energy_mj, p.energy_label) == (4.0, "measured:rapl")
    for _ in range(300):  # live scores all low: the escalation rate follows them
        p.observe_score(0.0)
    assert p.curve(np.array([0.3]))[0][0] > 0.6


def test_latency_window_and_prior() -> None:
    prior = lognormal_points(10.0, 20.0)
    assert np.median(prior) == pytest.approx(10.0, rel=0.05)
    assert np.quantile(prior, 0.95) == pytest.approx(20.0, rel=0.1)
    w = LatencyWindow(prior, maxlen=16, min_samples=4)
    for v in (1.0, 2.0, 3.0):
        w.add(v)
    assert w.samples().size == prior.size + 3  # prior still blended in
    w.add(4.0)
    assert w.samples().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert w.quantile(0.5) == 2.0
    w.rebase(1)
    assert w.samples().tolist() == [4.0]


def test_link_rtt_availability_and_bytes() -> None:
    link = LinkProfile(rtt_ms=10.0, rtt_high_ms=12.0, bytes_per_escalation=100.0)
    assert link.state().rtt_high_ms == pytest.approx(12.0, rel=0.1)
    for _ in range(30):
        link.observe(2.0, ok=True, bytes_sent=500)
    s = link.state()
    assert s.rtt_ms == pytest.approx(2.0, abs=0.1)
    assert s.rtt_high_ms == pytest.approx(2.0)
    assert s.bytes_per_escalation == pytest.approx(500, rel=0.01)
    assert s.up
    assert s.energy_label.startswith("modeled")
    assert link.observe(None, ok=False) == ()
    assert link.observe(None, ok=False) == ()
    assert link.observe(None, ok=False) == ("down",)
    assert link.state().availability == 0.0
    assert link.observe(3.0, ok=True) == ()  # up again after several answers in a row, not one
    assert link.observe(None, ok=False) == ()
    assert link.observe(3.0, ok=True) == ()
    assert link.observe(3.0, ok=True) == ()
    assert link.observe(3.0, ok=True) == ("up",)
    assert link.state().availability == 1.0
    assert link.state().rtt_samples.tolist() == [3.0, 3.0, 3.0]  # the answers that brought it back


def test_timeouts_count_as_not_answered_in_time() -> None:
    link = LinkProfile(rtt_ms=5.0, down_after=10)
    for _ in range(8):
        link.observe(5.0, ok=True)
    link.observe(None, ok=False, elapsed_ms=19.0, timeout=True)
    link.observe(19.0, ok=False, timeout=True)  # the other convention: the waited time as rtt_ms with ok=False
    link.observe(None, ok=False, elapsed_ms=0.5)  # a refusal: availability prices it, not the round trips
    s = link.state()
    assert s.timely(10.0) == pytest.approx(0.8)
    assert math.isinf(s.rtt_high_ms)
    assert s.failure_latency_ms > 0
    assert s.to_json()["rtt_high_ms"] is None


def test_live_scores_reweight_rates_and_accuracies_together() -> None:
    rng = np.random.default_rng(0)
    scores = rng.random(2000)
    p = VariantProfile("v", scores, rng.random(2000) < scores, [1.0], 1.0)
    for x in rng.random(500) ** 3:  # live inputs are less confident than the validation ones
        p.observe_score(float(x))
    esc, acc_accepted, acc_escalated = p.curve(p.thresholds(np.linspace(0, 1, 11)))
    overall = (1 - esc) * acc_accepted + esc * acc_escalated
    assert np.ptp(overall) < 1e-9  # the edge's accuracy does not depend on where the line is drawn
    assert overall[0] < p.accuracy - 0.1  # ... but it is lower on the drifted stream
    assert esc[5] > 0.6  # the validation median now escalates well over half
