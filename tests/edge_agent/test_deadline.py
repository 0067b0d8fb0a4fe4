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
# process was not scheduled, which no timer can help. So: the 90th percentile within budget + SLACK_MS,
# the worst within budget + WORST_MS; the tight bound on the worst case is bench/bench_edge.py's to
# measure on a quiet host.
SLACK_MS = 5.0
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
        walls, preds = [], []
        for i in range(len(x)):
            t = time.perf_counter()
            preds.append(model.predict(x[i]))
            walls.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.005)  # an app's gap between requests (pacing, not waiting for anything)
        agent = model.agent
        stats = model.stats()
    walls_ms = np.array(walls)
    # each was abandoned by the agent's timer, or not sent at all when the learned margin left no time for it
    reasons = [p.reason for p in preds]
    assert all(p.degraded for p in preds)
    assert set(reasons) <= {"timeout", "budget"}, reasons
    assert reasons.count("timeout") >= len(x) // 2, reasons
    assert stats["escalations_sent"] == len(warm) + reasons.count("timeout")
    assert np.median(walls_ms) <= BUDGET_MS, np.sort(walls_ms)
    assert np.percentile(walls_ms, 90) <= BUDGET_MS + SLACK_MS, np.sort(walls_ms)[-5:]
    assert walls_ms.max() <= BUDGET_MS + WORST_MS, np.sort(walls_ms)[-5:]
    # the timer learned how late abandoning runs, and ends that much before the budget
    assert len(agent.lateness) > 0
    assert 0.0 <= agent.lateness.margin_ms() < BUDGET_MS


def test_a_link_back_in_time_answers_from_the_cloud_again(edge_package: ModelPackage, slow_cloud: DelayProxy,
                                                          digits: zoo.Split) -> None:
    slow_cloud.set(up_ms=30, down_ms=30, mode="up")
    with sdk.load(edge_package, cloud=f"grpc://127.0.0.1:{slow_cloud.port}/digits",
                  budget=sdk.Budget(latency_ms=BUDGET_MS), policy=Policy("max_prob", threshold=ALWAYS),
                  options=_options()) as model:
        slow = [model.predict(digits.x_test[i]) for i in range(5)]
        slow_cloud.set(up_ms=1, down_ms=1)
        # until 15 cloud answers, at most 60 predicts: quiet hosts need 15-16; at load average ~20, 11 of the
        # first 20 were answered (the rest timed out in a stalled process), so the count, not the rate, is held
        fast: list[sdk.Prediction] = []
        while len(fast) < 60 and sum(p.tier == "cloud" for p in fast) < 15:
            fast.append(model.predict(digits.x_test[len(fast) % 40]))
    assert all(p.reason == "timeout" for p in slow[1:])  # the first may also be the channel connecting
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
