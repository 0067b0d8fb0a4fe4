"""Telemetry windows carry their own latency quantiles and histogram, not those of the agent's recent past."""

from __future__ import annotations

from edge_agent.fleet_sync import LATENCY_BOUNDS_MS, TelemetryWindows
from edge_agent.stats import Observation, Stats


def _requests(stats: Stats, latencies_ms: list[float]) -> None:
    for ms in latencies_ms:
        stats.add(Observation("v", ms, 0.0, 0.0, "modeled", 1, 0, "edge", False, "", None, 0, None, ms, False, 0.9))


def test_a_fast_window_after_a_slow_one_reports_its_own_p95() -> None:
    stats, windows = Stats(), TelemetryWindows("boot")
    _requests(stats, [50.0] * 300)
    slow = windows.window({"device": "d", **stats.snapshot()}, stats.recent_latencies)
    _requests(stats, [1.5] * 100)
    snap = {"device": "d", **stats.snapshot()}
    assert snap["p95_ms"] == 50.0  # the agent's quantiles span its recent requests, both windows
    fast = windows.window(snap, stats.recent_latencies)
    assert slow["p95_ms"] == 50.0
    assert fast["p95_ms"] == 1.5
    assert fast["requests"] == 100
    hist = fast["latency_hist"]
    assert hist["bounds_ms"] == list(LATENCY_BOUNDS_MS)
    assert len(hist["counts"]) == len(LATENCY_BOUNDS_MS) + 1
    assert hist["counts"][1] == 100  # 1.5 ms: above 1, at most 2
    assert sum(slow["latency_hist"]["counts"]) == 300
    assert slow["latency_hist"]["counts"][LATENCY_BOUNDS_MS.index(50)] == 300  # at most 50 ms: the 50 ms bucket


def test_a_window_without_requests_has_no_histogram_and_without_latencies_falls_back() -> None:
    stats, windows = Stats(), TelemetryWindows("boot")
    _requests(stats, [3.0] * 10)
    windows.window({"device": "d", **stats.snapshot()}, stats.recent_latencies)
    empty = windows.window({"device": "d", **stats.snapshot()}, stats.recent_latencies)
    assert empty["requests"] == 0
    assert empty["latency_hist"] is None
    _requests(stats, [7.0] * 10)
    plain = windows.window({"device": "d", **stats.snapshot()})
    assert plain["latency_hist"] is None
    assert plain["p95_ms"] == stats.snapshot()["p95_ms"]


def test_a_window_carries_the_controllers_decision_with_its_binding_constraint() -> None:
    import numpy as np

    from edge_agent.budget import Budget
    from edge_agent.controller import choose
    from edge_agent.profiles import LinkProfile, VariantProfile

    scores = np.arange(100) / 100
    profile = VariantProfile("v", scores, scores >= 0.1, np.full(16, 1.0), 1.0, "modeled:test")
    link = LinkProfile(rtt_ms=2.0, bytes_per_escalation=1000.0, energy_per_byte_mj=1e-3)
    decision = choose([profile], link.state(), Budget(latency_ms=50, energy_mj=1.2))
    stats, windows = Stats(), TelemetryWindows("boot")
    _requests(stats, [3.0] * 10)
    doc = windows.window({"device": "d", **stats.snapshot(), "decision": decision.to_json()})
    carried = doc["decision"]
    assert carried["binding"] == "energy"
    assert carried["threshold"] == decision.threshold
    assert carried["inputs"]["energy_target_mj"] == decision.inputs["energy_target_mj"]
    assert carried["inputs"]["link"]["up"] is True
    assert windows.window({"device": "d", **stats.snapshot(), "decision": None})["decision"] is None
