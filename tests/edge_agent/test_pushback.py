"""The cloud's "busy, retry after": the agent holds escalations back for the hint and paces its journal's drain."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.protocol import decode_inputs, encode_response, get_parameters, topics
from cloud_service.protocol.fleet_docs import parse_telemetry
from compilers.package import ModelPackage
from edge_agent.agent import AgentOptions, EdgeAgent
from edge_agent.breaker import BreakerConfig
from edge_agent.fleet_sync import TelemetryWindows
from edge_agent.policy import Policy
from edge_agent.pushback import DrainPace, Pushback, retry_hint_s
from edge_agent.transports.base import escalation_error
from runtimes.errors import EscalationError
from testkit import zoo
from testkit.clock import ManualClock
from testkit.fake_transport import FakeTransport
from testkit.packages import make_package
from testkit.waiting import until


def busy(hint_s: float) -> EscalationError:
    return escalation_error(EscalationError, "model 'digits' is overloaded", code="RESOURCE_EXHAUSTED",
                            retry_after_s=hint_s)


def test_only_a_refusal_with_a_hint_is_busy() -> None:
    assert retry_hint_s(busy(0.2)) == 0.2
    assert retry_hint_s(busy(60.0)) == 5.0  # capped: the agent probes again by then
    assert retry_hint_s(escalation_error(EscalationError, "x", code="NOT_FOUND", retry_after_s=0.2)) is None
    assert retry_hint_s(escalation_error(EscalationError, "x", code="RESOURCE_EXHAUSTED")) is None
    clock = ManualClock()
    pushback = Pushback(clock=clock)
    assert pushback.note(busy(0.3))
    assert pushback.active()
    clock.now += 0.31
    assert not pushback.active()
    assert pushback.refusals == 1


def test_drain_pace_halves_on_refusals_and_recovers_on_answers() -> None:
    clock = ManualClock()
    pace = DrainPace(20.0, min_rate_per_s=1.0, step_per_s=1.0, clock=clock, sleep=clock.sleep)

    async def take(n: int) -> float:
        start = clock.now
        for _ in range(n):
            await pace.take()
        return clock.now - start

    assert asyncio.run(take(21)) == pytest.approx(1.0, abs=0.06)  # 20/s, one token in hand
    for _ in range(3):
        pace.on_busy()
    assert pace.rate == 2.5
    assert asyncio.run(take(5)) == pytest.approx(2.0, abs=0.45)
    for _ in range(30):
        pace.on_answer()
    assert pace.rate == 20.0
    for _ in range(10):
        pace.on_busy()
    assert pace.rate == 1.0  # never below the floor


@pytest.fixture(scope="module")
def package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("pkg") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


class BusyCloud:
    """Refuses the first `refusals` calls with a retry hint, answers class 1 after; records call times."""

    def __init__(self, refusals: int, hint_s: float) -> None:
        self.refusals, self.hint_s = refusals, hint_s
        self.calls: list[tuple[float, bool]] = []  # (time, answered)
        self.answered: list[int] = []

    def __call__(self, request: Any) -> Any:
        if len([c for c in self.calls if not c[1]]) < self.refusals:
            self.calls.append((time.monotonic(), False))
            raise busy(self.hint_s)
        self.calls.append((time.monotonic(), True))
        self.answered.append(int(get_parameters(request.parameters)[topics.PARAM_SEQ]))
        logits = np.zeros((len(decode_inputs(request)["x"]), 10), np.float32)
        logits[:, 1] = 5
        return encode_response("digits", {"logits": logits})


def test_a_busy_refusal_degrades_and_holds_escalations_back_for_the_hint(package: ModelPackage,
                                                                          digits: zoo.Split) -> None:
    # A 1 s hint: the checks right after the refusal fall inside it even when a loaded host stalls the test for
    # a few hundred ms (with 0.3 s, a 0.1 s stall failed the hold's check and a 0.3 s one let the second through).
    cloud = BusyCloud(refusals=1, hint_s=1.0)

    async def main() -> None:
        agent = EdgeAgent(package, cloud=FakeTransport(cloud), policy=Policy(threshold=2.0),
                          options=AgentOptions(breaker=BreakerConfig(failure_threshold=3)))
        async with agent:
            first = await agent.infer(digits.x_test[0])
            # the link model (read by the skip rule, breaker and controller) saw a busy refusal with its hint
            assert agent.link.refusals == 1
            assert 0.5 < agent.link.view().hold_until - time.monotonic() <= 1.0
            held = await agent.infer(digits.x_test[1])
            assert (first.degraded, first.reason) == (True, "cloud_busy")
            assert (held.degraded, held.reason) == (True, "cloud_busy")
            assert len(cloud.calls) == 1  # the second was not sent: the cloud asked for 1 s
            assert agent.breaker.consecutive_failures == 1  # a refusal, counted for the breaker's rule
            await until("the hint to pass", lambda: time.monotonic() >= agent.link.view().hold_until, timeout=5)
            after = await agent.infer(digits.x_test[2])
            assert (after.tier, after.degraded) == ("cloud", False)
            # the telemetry window counts the escalation the cloud refused (not the one held back unsent)
            window = TelemetryWindows("boot").window({"device": "d", **agent.snapshot()})
            assert (window["cloud_refused"], parse_telemetry(window).cloud_refused) == (1, 1)

    asyncio.run(main())


def test_the_journal_drain_is_paced_and_pauses_for_refusals(package: ModelPackage, digits: zoo.Split,
                                                            tmp_path: Path) -> None:
    cloud = BusyCloud(refusals=0, hint_s=0.2)
    opts = AgentOptions(journal_path=tmp_path / "journal.db", drain_interval_s=0.05, drain_rate_per_s=50.0,
                        breaker=BreakerConfig(failure_threshold=1, reset_timeout_s=0.05))

    async def main() -> None:
        agent = EdgeAgent(package, cloud=FakeTransport(cloud), policy=Policy(threshold=2.0), options=opts)
        async with agent:
            cloud.refusals = 10**6  # down for the live ones: journaled
            preds = [await agent.infer(x, keep=True) for x in digits.x_test[:40]]
            assert all(p.degraded for p in preds)
            assert agent.journal is not None
            assert agent.journal.count() == 40
            cloud.calls.clear()
            cloud.refusals = 3  # busy for three more calls, then answers
            refusals_before = agent.link.refusals
            await until("the journal to drain", lambda: agent.journal.count() == 0, timeout=10, interval=0.025)
            assert sorted(cloud.answered) == sorted(p.seq for p in preds)  # none lost
            assert agent.link.refusals - refusals_before == 3  # the drain's busy refusals reached the link

    asyncio.run(main())
    refused = [t for t, ok in cloud.calls if not ok]
    answered = [t for t, ok in cloud.calls if ok]
    assert len(refused) == 3
    for t in refused:  # nothing was sent within a refusal's hint
        assert not [c for c, _ in cloud.calls if t < c < t + 0.19]
    rate = (len(answered) - 1) / (answered[-1] - answered[0])
    assert rate <= 50.0 * 1.2, rate  # at most the configured pace (after the refusals: less)
