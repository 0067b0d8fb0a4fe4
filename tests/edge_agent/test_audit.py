"""Audits of confident answers and the whole-stream agreement estimate, on the real digits model.

The cloud is a label oracle (it answers each image's true digit), so agreement with it is accuracy
and the truth of every estimate is known. The stream mixes clean digits with rotated, brightened
ones that the edge answers confidently and wrongly: the confident region's agreement (~0.15) is far
from the escalated region's (~0.82), which is the case a selection-blind estimate gets wrong.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest

import sdk
from cloud_service.protocol import get_parameters, topics
from compilers.package import ModelPackage
from edge_agent.agent import AgentOptions
from edge_agent.audit import AuditOptions, estimate_agreement, window_fields
from edge_agent.fleet_sync import TelemetryWindows
from edge_agent.policy import Policy
from testkit import zoo
from testkit.fake_transport import FakeTransport
from testkit.oracle import oracle
from testkit.packages import make_package
from testkit.waiting import wait_for

THRESHOLD = 0.999  # max_prob: most clean digits escalate, the rotated ones are confidently wrong


@pytest.fixture(scope="module")
def package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("pkg") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


def shifted_stream(digits: zoo.Split) -> tuple[np.ndarray, np.ndarray]:
    """Clean held-out digits, then half as many rotated a quarter turn and brightened (shuffled together)."""
    x = np.concatenate([digits.x_val, digits.x_test])
    y = np.concatenate([digits.y_val, digits.y_test])
    n = len(x) // 2
    rotated = (np.rot90(x[:n], 1, axes=(2, 3)) * 2).astype(np.float32)
    xs, ys = np.concatenate([x, rotated]), np.concatenate([y, y[:n]])
    order = np.random.default_rng(0).permutation(len(xs))
    return np.ascontiguousarray(xs[order]), ys[order]


def test_audits_are_never_answered_nor_counted_as_escalations(package: ModelPackage, digits: zoo.Split,
                                                              tmp_path: Path) -> None:
    xs = digits.x_test[:60]
    fake = FakeTransport(oracle(xs, digits.y_test[:60], answer=3))  # the cloud always says 3
    options = AgentOptions(device_id="audited", journal_path=tmp_path / "journal.db",
                           audit=AuditOptions(rate=1.0, seed=0, max_inflight=64))
    with sdk.load(package, cloud=fake, policy=Policy("max_prob", threshold=-1.0), options=options) as model:
        preds = [model.predict(x, keep=True) for x in xs]
        wait_for("every audit compared", lambda: model.stats()["audits_compared"] >= len(xs))
        stats = model.stats()
        session = model.agent.variants[model.agent.variant].session
        local = session.run({"x": xs})["logits"]
    # every answer is the edge's own, unchanged by the cloud's "3"
    assert all(p.tier == "edge" and not p.degraded and not p.cloud_rows.any() for p in preds)
    np.testing.assert_allclose(np.stack([p.outputs["logits"] for p in preds]), local, rtol=1e-6, atol=1e-6)
    # the cloud saw each one, as an audit; none counted as an escalation, none journaled
    assert len(fake.requests) == len(xs)
    assert all(get_parameters(r.parameters).get(topics.PARAM_AUDIT) for r in fake.requests)
    assert stats["escalations_wanted"] == stats["escalations_sent"] == stats["cloud_answers"] == 0
    assert stats["journaled"] == 0
    assert stats["journal_pending"] == 0
    assert stats["audit"]["audited"] == len(xs)
    expected = float(np.mean(local.argmax(axis=1) == 3))
    assert stats["audit"]["audit_agreement"] == pytest.approx(expected)


def test_the_agreement_estimate_weighs_audits_by_their_inclusion_probability(package: ModelPackage,
                                                                             digits: zoo.Split) -> None:
    xs, ys = shifted_stream(digits)
    fake = FakeTransport(oracle(xs, ys))
    # no learned rule: it would (rightly) start escalating the confidently wrong inputs mid-stream. Which
    # requests are audited is fixed by (seed, request number), whatever the timing; seed 7 draws a typical
    # sample (its estimate within half an interval of the truth, and so with one audit more or less agreeing):
    # unbiasedness and coverage over many samples are `test_the_estimate_is_unbiased...`'s.
    options = AgentOptions(device_id="estimate", audit=AuditOptions(rate=0.1, seed=7, max_inflight=64, router=None))
    windows = TelemetryWindows("boot")
    # a generous budget: a loaded host must not degrade escalations (that would move the selection-blind figures)
    with sdk.load(package, cloud=fake, policy=Policy("max_prob", threshold=THRESHOLD), options=options,
                  budget=sdk.Budget(latency_ms=5000)) as model:
        preds = [model.predict(x) for x in xs]
        wait_for("the audits in flight", lambda: (s := model.stats())["audits_sent"] == s["audits_compared"]
                 + s["audits_failed"])
        stats = model.stats()
        session = model.agent.variants[model.agent.variant].session
        local = session.run({"x": xs})["logits"].argmax(axis=1)
        window = windows.window(stats)
    truth = float(np.mean(local == ys))  # edge vs the cloud over the whole stream
    escalated = np.array([p.tier == "cloud" for p in preds])
    assert 0.6 < escalated.mean() < 0.9
    est = stats["audit"]
    # within 1.5 half-widths of the 95 % interval (~3 standard errors)
    half = (est["agreement_high"] - est["agreement_low"]) / 2
    assert abs(est["agreement_est"] - truth) <= 1.5 * half, (truth, est)
    assert abs(est["agreement_est"] - truth) < 0.06, (truth, est)
    # what ignoring the selection would say: agreement on escalations alone, or pooled with the audits
    only_escalated = stats["agreement"]
    pooled = ((stats["escalations_agreed"] + stats["audits_agreed"])
              / (stats["escalations_compared"] + stats["audits_compared"]))
    assert abs(only_escalated - truth) > 0.1, (truth, only_escalated)
    assert abs(pooled - truth) > 0.1, (truth, pooled)
    # the telemetry window over the same requests carries the same figures
    assert window["audited"] == est["audited"]
    assert window["agreement_est"] == pytest.approx(est["agreement_est"])
    assert window["data_drift"] is False


def test_the_estimate_is_unbiased_and_its_interval_covers_in_simulation() -> None:
    """Counters drawn as the agent draws them: escalations (some lost) and Poisson-sampled audits (some lost)."""
    rng = np.random.default_rng(1)
    n, share_e, agree_e, agree_c, pi, lost = 5000, 0.25, 0.9, 0.6, 0.03, 0.2
    truth, ests, covered = share_e * agree_e + (1 - share_e) * agree_c, [], 0
    for _ in range(2000):
        n_e = rng.binomial(n, share_e)
        cmp_e = rng.binomial(n_e, 1 - lost)
        drawn = rng.binomial(n - n_e, pi)
        cmp_c = rng.binomial(drawn, 1 - lost)
        agr_c = rng.binomial(cmp_c, agree_c)
        w = 1 / pi
        counts = {"requests": n, "escalations_wanted": n_e, "escalations_compared": cmp_e,
                  "escalations_agreed": rng.binomial(cmp_e, agree_e), "audit_w": cmp_c * w, "audit_wa": agr_c * w,
                  "audit_w2": cmp_c * w * w, "audit_pi_w": cmp_c}
        e = estimate_agreement(counts)
        est, low, high = e["agreement_est"], e["agreement_low"], e["agreement_high"]
        assert est is not None
        assert low is not None
        assert high is not None
        ests.append(est)
        covered += low <= truth <= high
    mean, se = float(np.mean(ests)), float(np.std(ests) / math.sqrt(len(ests)))
    assert abs(mean - truth) < 3 * se + 1e-3, (mean, truth, se)
    assert 0.92 <= covered / len(ests) <= 0.99, covered


def test_no_estimate_without_comparisons_and_window_fields_difference_counters() -> None:
    assert estimate_agreement({"requests": 10, "escalations_wanted": 2})["agreement_est"] is None
    prev = {"requests": 100, "escalations_wanted": 10, "escalations_compared": 10, "escalations_agreed": 9,
            "audits_compared": 2, "audits_agreed": 2, "audit_w": 200, "audit_wa": 200, "audit_w2": 20000,
            "audit_pi_w": 2, "drift": {"events": 1}}
    snap = {"requests": 200, "escalations_wanted": 30, "escalations_compared": 30, "escalations_agreed": 19,
            "audits_compared": 4, "audits_agreed": 3, "audit_w": 400, "audit_wa": 300, "audit_w2": 40000,
            "audit_pi_w": 4, "drift": {"events": 2, "flagged": True}}
    w = window_fields(snap, prev)
    assert w["audited"] == 2
    assert w["audit_agreement"] == 0.5
    assert w["agreement_est"] == pytest.approx((20 * 0.5 + 80 * 0.5) / 100)
    assert w["data_drift"] is True
    assert w["drift_events"] == 1


def test_audits_skip_while_the_link_is_down_and_respect_the_rate_cap(package: ModelPackage,
                                                                     digits: zoo.Split) -> None:
    xs = digits.x_test[:40]
    fake = FakeTransport(oracle(xs, digits.y_test[:40]))
    options = AgentOptions(device_id="capped", audit=AuditOptions(rate=1.0, seed=0, max_inflight=64))
    budget = sdk.Budget(latency_ms=100, max_escalations_per_s=5.0)
    with sdk.load(package, cloud=fake, policy=Policy("max_prob", threshold=-1.0), budget=budget,
                  options=options) as model:
        t0 = time.monotonic()
        for x in xs:
            model.predict(x)
        wait_for("every audit sent or skipped", lambda: (s := model.stats())["audits_drawn"] == len(xs)
                 and s["audits_sent"] + s["audits_skipped"] == len(xs))
        elapsed = time.monotonic() - t0
        sent = model.stats()["audits_sent"]
        assert sent <= 5.0 * (elapsed + 1.0), (sent, elapsed)  # the bucket starts full: at most cap x (t + 1)
        assert model.stats()["audit"]["skipped"].get("rate", 0) > 0
        for _ in range(model.agent.link.down_after):  # refusals in a row: the link is down, audits wait for it
            model.agent.link.observe_refusal()
        assert not model.agent.link.up
        before = model.stats()["audits_sent"]
        for x in xs[:10]:
            model.predict(x)
        wait_for("the audits skipped", lambda: (s := model.stats())["audits_skipped"] + s["audits_sent"]
                 == len(xs) + 10)
        assert model.stats()["audits_sent"] == before
        assert model.stats()["audit"]["skipped"].get("link", 0) >= 10


def test_which_requests_are_audited_depends_on_the_seed_and_request_number_only() -> None:
    from edge_agent.audit import Draws

    draws, again = Draws(7), Draws(7)
    u = np.array([draws(seq) for seq in range(1, 20_001)])
    # the same (seed, seq) draws the same number whatever was drawn before (timing, other requests)
    assert [again(seq) for seq in (19_999, 5, 4_097, 12)] == [u[19_998], u[4], u[4_096], u[11]]
    assert abs(float((u < 0.1).mean()) - 0.1) < 0.006  # ~4.5 standard errors of a Bernoulli(0.1) mean
    assert abs(float(np.corrcoef(u[:-1], u[1:])[0, 1])) < 0.03
    assert float(np.mean(np.array([Draws(8)(seq) for seq in range(1, 2_001)]) == u[:2_000])) == 0.0
