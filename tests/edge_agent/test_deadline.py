"""The escalation deadline ends inside the budget: a real gRPC cloud on loopback behind a delay proxy.

Every escalation is delayed past the budget, so each one is abandoned by the agent's own timer; the
caller must get its (degraded) answer no later than the budget plus `SLACK_MS`, measured from outside
around `predict`, whatever gRPC's own deadline does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import sdk
from cloud_service.config import ServerConfig
from compilers.package import ModelPackage
from edge_agent.agent import AgentOptions
from edge_agent.breaker import BreakerConfig
from edge_agent.link import TimerLateness
from edge_agent.policy import Policy
from testkit import zoo
from testkit.cloud_helpers import ServerThread
from testkit.cloud_helpers import make_package as make_cloud_package
from testkit.delay_proxy import DelayProxy
from testkit.packages import make_package

BUDGET_MS = 15.0
# The bounds this test states, from measurement. No predict returns later than the budget plus 5 ms on a
# 2-core host shared with other work at load average ~10 (at most +3.3 and +4.0 ms in two runs of 40
# abandoned escalations, median well inside the budget); on a quiet AMD EPYC host (avx512_bf16), 5 runs of
# 40: at most +0.42 ms (median 13.1-13.8 ms). Before the agent's own timer, every one ended 1.1-8.6 ms
# after the budget. At load average 17-27 (six test runs beside it) one predict of 40 took 43 ms: the
# process was not scheduled, which no timer can help, so the bounds widen by how late the process got a
# core back in the same run (see the test). The tight bound on the worst case is bench/bench_edge.py's to
# measure on a quiet host.
SLACK_MS = 5.0
GAP_S = 0.005
WORST_MS = 60.0
ALWAYS = 2.0


@pytest.fixture(scope="module")
def edge_package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("edge") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


@pytest.fixture(scope="module")
def slow_cloud(digits_cnn_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DelayProxy]:
    """`tierkit serve`'s service with the digits CNN on loopback, behind a proxy adding 30 ms each way."""
    models = tmp_path_factory.mktemp("models")
    make_cloud_package(models / "digits-v1", digits_cnn_onnx)
    server = ServerThread(ServerConfig(models_dir=models, grpc_address="127.0.0.1:0", drain_timeout_s=2)).start()
    host, _, port = server.grpc.rpartition(":")
    proxy = DelayProxy((host, int(port))).start()
    try:
        yield proxy
    finally:
        proxy.stop()
        server.stop()


def _options() -> AgentOptions:
    # every request escalates: the breaker never opens and a round trip that does not fit is tried anyway
    return AgentOptions(breaker=BreakerConfig(failure_threshold=10_000), rtt_probe_s=0.0,
                        telemetry_interval_s=3600.0)


def test_no_predict_ends_later_than_the_budget_plus_a_few_ms(edge_package: ModelPackage, slow_cloud: DelayProxy,
                                                            digits: zoo.Split) -> None:
    slow_cloud.set(up_ms=0, down_ms=0, mode="up")
    with sdk.load(edge_package, cloud=f"grpc://127.0.0.1:{slow_cloud.port}/digits",
                  budget=sdk.Budget(latency_ms=BUDGET_MS), policy=Policy("max_prob", threshold=ALWAYS),
                  options=_options()) as model:
        x = digits.x_test[:40]
        warm = []
        for i in range(50):  # connects the channel while the link is fast
            warm.append(model.predict(x[i % len(x)]))
            if warm[-1].tier == "cloud":
                break
        assert warm[-1].tier == "cloud", [p.reason for p in warm]
        slow_cloud.set(up_ms=30, down_ms=30)
        walls, lags, preds = [], [], []
        for i in range(len(x)):
            t = time.perf_counter()
            preds.append(model.predict(x[i]))
            walls.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            time.sleep(GAP_S)  # an app's gap between requests (pacing, not waiting for anything)
            lags.append((time.perf_counter() - t - GAP_S) * 1e3)  # how late this process got the core back
        agent = model.agent
        stats = model.stats()
    walls_ms, lag_ms = np.array(walls), np.array(lags)
    # each was abandoned by the agent's timer, or not sent at all when the learned margin left no time for it,
    # or (on a loaded host) answered locally when the loop came back too late to finish it
    reasons = [p.reason for p in preds]
    assert all(p.degraded for p in preds)
    assert set(reasons) <= {"timeout", "budget", "late"}, reasons
    assert reasons.count("timeout") + reasons.count("late") >= len(x) // 2, reasons
    # the abandoned ones were sent, the ones the margin ruled out were not
    warm_cloud = sum(p.tier == "cloud" for p in warm)
    sent = stats["escalations_sent"]
    assert warm_cloud + reasons.count("timeout") <= sent <= len(warm) + len(x) - reasons.count("budget"), reasons
    # From outside, a predict ends later than its timer by however late this process gets a core back, which
    # the gap between predicts measures (`lags`: how late a 5 ms sleep returns). On a quiet host that is ~0.1 ms
    # and the bounds are the budget itself (median) and SLACK_MS (90th percentile). On this 2-core host at load
    # average ~20, two runs: lags p50 0.19 / 0.08 ms, p90 2.05 / 9.38 ms; walls p50 13.2 / 14.7 ms, p90 20.5 /
    # 38.1 ms (2.5x the lag's p90 over budget + SLACK_MS), max 75 / 77 ms (one lag was 137 ms). So the lateness
    # allowed is the lag measured in the same run, three times over at the 90th percentile; the median gets 1 ms
    # and twice the median lag (one suite run beside others had a median of 15.2 ms), still under the 1.1-8.6 ms
    # past the budget every predict took without the agent's timer.
    msg = f"walls {np.sort(walls_ms)[-5:]}, lags p50 {np.median(lag_ms):.2f} p90 {np.percentile(lag_ms, 90):.2f} ms"
    assert np.median(walls_ms) <= BUDGET_MS + 1.0 + 2 * max(0.0, float(np.median(lag_ms))), msg
    assert np.percentile(walls_ms, 90) <= BUDGET_MS + SLACK_MS + 3 * max(0.0, float(np.percentile(lag_ms, 90))), msg
    assert walls_ms.max() <= BUDGET_MS + WORST_MS + max(0.0, float(lag_ms.max())), msg
    # the timer learned how late abandoning runs, and ends that much before the budget: less than the budget on
    # a quiet host; on a loaded one as late as the host makes it (23.5 ms at load average ~20)
    assert len(agent.lateness) > 0
    assert 0.0 <= agent.lateness.margin_ms() < BUDGET_MS + 3 * max(0.0, float(np.percentile(lag_ms, 90))), msg


def test_a_link_back_in_time_answers_from_the_cloud_again(edge_package: ModelPackage, slow_cloud: DelayProxy,
                                                          digits: zoo.Split) -> None:
    slow_cloud.set(up_ms=30, down_ms=30, mode="up")
    with sdk.load(edge_package, cloud=f"grpc://127.0.0.1:{slow_cloud.port}/digits",
                  budget=sdk.Budget(latency_ms=BUDGET_MS), policy=Policy("max_prob", threshold=ALWAYS),
                  options=_options()) as model:
        slow = [model.predict(digits.x_test[i]) for i in range(5)]
        slow_cloud.set(up_ms=1, down_ms=1)
        # until 15 cloud answers, at most 120 predicts: quiet hosts need 15-16; at load average ~20, 11 of the
        # first 20 were answered (the rest timed out in a stalled process), and in a whole suite's run on a slower
        # 2-core host (an AVX2 EPYC), 13 of 60: the count, not the rate, is held
        fast: list[sdk.Prediction] = []
        while len(fast) < 120 and sum(p.tier == "cloud" for p in fast) < 15:
            fast.append(model.predict(digits.x_test[len(fast) % 40]))
    # the slow link answered none: timed out, or (on a loaded host) answered late or not sent on the margin learned
    assert all(p.degraded and p.reason in {"timeout", "late", "budget"} for p in slow[1:]), [p.reason for p in slow]
    assert sum(p.tier == "cloud" for p in fast) >= 15, [p.reason for p in fast]  # the channel stays usable


def test_timer_lateness_learns_a_high_quantile_with_a_floor_until_it_has_data() -> None:
    late = TimerLateness(1.0, min_samples=8)
    late.add(0.2)
    assert late.margin_ms() == 1.0  # the prior is a floor while there are few samples
    for _ in range(20):
        late.add(0.3)
    assert late.margin_ms() == pytest.approx(0.3)
    for _ in range(10):
        late.add(4.0)  # the loop got slower: the high quantile follows within a few abandonments
    assert late.margin_ms() == pytest.approx(4.0)
    late.add(float("nan"))
    assert np.isfinite(late.margin_ms())
