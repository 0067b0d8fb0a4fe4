"""Store and forward: kept escalations are journaled while the cloud is down and sent once it is back."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.protocol import decode_inputs, encode_response, get_parameters, topics
from compilers.package import ModelPackage
from edge_agent.agent import AgentOptions, EdgeAgent
from edge_agent.breaker import BreakerConfig
from edge_agent.budget import Budget
from edge_agent.journal import Journal
from edge_agent.policy import Policy
from runtimes.errors import CloudUnavailable
from testkit import zoo
from testkit.fake_transport import FakeTransport
from testkit.grpc_cloud import GrpcCloud
from testkit.packages import make_package
from testkit.ports import free_port
from testkit.waiting import until


@pytest.fixture(scope="module")
def package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("pkg") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


class FlakyCloud:
    """Refuses while `down`, answers class 1 otherwise; counts what it answered, by (boot, seq)."""

    def __init__(self) -> None:
        self.down = True
        self.answered: list[tuple[str, int]] = []

    def __call__(self, request: Any) -> Any:
        if self.down:
            msg = "refused"
            raise CloudUnavailable(msg)
        params = get_parameters(request.parameters)
        self.answered.append((str(params[topics.PARAM_BOOT]), int(params[topics.PARAM_SEQ])))
        logits = np.zeros((len(decode_inputs(request)["x"]), 10), np.float32)
        logits[:, 1] = 5
        return encode_response("digits", {"logits": logits})


def options(tmp_path: Path, **kw: Any) -> AgentOptions:
    return AgentOptions(journal_path=tmp_path / "journal.db", drain_interval_s=0.05,
                        breaker=BreakerConfig(failure_threshold=1, reset_timeout_s=0.1), **kw)


def test_kept_escalations_are_sent_once_when_the_cloud_returns(package: ModelPackage, digits: zoo.Split,
                                                              tmp_path: Path) -> None:
    cloud = FlakyCloud()
    late: list[int] = []

    async def main() -> None:
        agent = EdgeAgent(package, cloud=FakeTransport(cloud), policy=Policy(threshold=2.0),
                          options=options(tmp_path), on_late_reply=lambda seq, out: late.append(seq))
        async with agent:
            preds = [await agent.infer(x, keep=True) for x in digits.x_test[:6]]
            assert all(p.degraded for p in preds)
            assert agent.journal is not None
            assert agent.journal.count() == 6
            cloud.down = False
            journal = agent.journal
            await until("the journal to drain once the cloud answers", lambda: journal.count() == 0, timeout=5)
            assert sorted(late) == sorted(p.seq for p in preds)

    asyncio.run(main())
    assert len(cloud.answered) == len(set(cloud.answered)) == 6


def test_unkept_escalations_are_not_journaled(package: ModelPackage, digits: zoo.Split, tmp_path: Path) -> None:
    async def main() -> int:
        async with EdgeAgent(package, cloud=FakeTransport(FlakyCloud()), policy=Policy(threshold=2.0),
                             options=options(tmp_path)) as agent:
            await agent.infer(digits.x_test[0])
            return agent.journal.count()  # type: ignore[union-attr]

    assert asyncio.run(main()) == 0


def test_policy_keep_and_full_journal(package: ModelPackage, digits: zoo.Split, tmp_path: Path) -> None:
    # A budget a loaded host's fsync fits in: with the default 100 ms, the journal-ahead of the first
    # escalation took what was left of it in a suite run at a load average of 11-18, and the escalation,
    # journaled, was not sent ("budget"); this test is about what the journal holds, not about time.
    async def main() -> list[str]:
        async with EdgeAgent(package, cloud=FakeTransport(FlakyCloud()), policy=Policy(threshold=2.0, keep=True),
                             budget=Budget(latency_ms=5000), options=options(tmp_path, journal_max_bytes=700)) as agent:
            return [(await agent.infer(x)).reason for x in digits.x_test[:3]]

    reasons = asyncio.run(main())
    assert reasons[0] in {"unavailable", "breaker_open"}, reasons  # journaled ahead, then sent and refused
    assert reasons[1:] == ["journal_full", "journal_full"], reasons
    with Journal(tmp_path / "journal.db") as journal:  # the one record that fit, kept for the drain
        assert journal.count() == 1


def test_corrupt_journal_is_moved_aside(package: ModelPackage, digits: zoo.Split, tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "journal.db").write_bytes(b"this is not a database" * 100)

    async def main() -> dict[str, Any]:
        async with EdgeAgent(package, cloud=FakeTransport(FlakyCloud()), policy=Policy(threshold=2.0),
                             options=options(tmp_path)) as agent:
            await agent.infer(digits.x_test[0], keep=True)
            return agent.snapshot()

    with caplog.at_level(logging.WARNING):
        snap = asyncio.run(main())
    assert "corrupt" in caplog.text
    assert snap["journal_recovered_from"]
    assert Path(snap["journal_recovered_from"]).exists()
    with Journal(tmp_path / "journal.db") as journal:
        assert journal.count() == 1


def test_an_escalation_in_flight_is_already_journaled(package: ModelPackage, digits: zoo.Split,
                                                      tmp_path: Path) -> None:
    """Write-ahead: while the cloud works on a kept escalation, the journal holds it (a kill -9 now loses
    nothing); once answered it is cleared, and it reached the cloud once."""
    cloud = GrpcCloud()
    cloud.servicer.go.clear()  # the cloud takes its time
    path = tmp_path / "journal.db"

    async def main() -> tuple[list[int], Any]:
        async with EdgeAgent(package, cloud=cloud.url(), policy=Policy("max_prob", threshold=2.0),
                             budget=Budget(latency_ms=10_000), options=AgentOptions(journal_path=path)) as agent:
            task = asyncio.create_task(agent.infer(digits.x_test[0], keep=True))
            assert await asyncio.to_thread(cloud.servicer.arrived.wait, 10)
            with Journal(path) as other:  # what a restarted agent would find
                held = [e.seq for e in other.pending()]
            cloud.servicer.go.set()
            pred = await task
            journal = agent.journal
            assert journal is not None
            await until("the answered entry to be cleared (in the background)", lambda: not journal.count(), timeout=2)
            return held, pred

    try:
        held, pred = asyncio.run(main())
    finally:
        cloud.stop()
    assert held == [pred.seq]
    assert pred.tier == "cloud"
    with Journal(path) as journal:
        assert journal.count() == 0
    assert [seq for _, seq in cloud.servicer.seen] == [pred.seq]


def test_the_drain_starts_when_the_cloud_answers_not_when_the_breaker_reopens(package: ModelPackage,
                                                                              digits: zoo.Split,
                                                                              tmp_path: Path) -> None:
    port = free_port()
    opts = AgentOptions(journal_path=tmp_path / "journal.db", drain_interval_s=0.2,
                        breaker=BreakerConfig(failure_threshold=1, reset_timeout_s=60.0))

    async def main() -> tuple[float, list[int], GrpcCloud]:
        async with EdgeAgent(package, cloud=f"grpc://127.0.0.1:{port}/digits", options=opts,
                             policy=Policy("max_prob", threshold=2.0), budget=Budget(latency_ms=500)) as agent:
            preds = [await agent.infer(digits.x_test[i], keep=True) for i in range(5)]
            assert all(p.degraded for p in preds)
            assert agent.breaker.state == "open"  # and stays so for a minute
            cloud = GrpcCloud(port=port)
            t = time.monotonic()
            journal = agent.journal
            assert journal is not None
            await until("the journal to drain after the cloud came back", lambda: not journal.count(), timeout=20,
                        interval=0.05)
            return time.monotonic() - t, [p.seq for p in preds], cloud

    took, seqs, cloud = asyncio.run(main())
    cloud.stop()
    assert sorted(seq for _, seq in cloud.servicer.seen) == seqs
    assert took < 3.0, f"the journal drained {took:.1f} s after the cloud came back"
