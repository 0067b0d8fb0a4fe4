"""A real agent over gRPC to a real server on loopback, through a 20 ms link that goes down for a few
seconds (every connection reset, new ones reset at once) and comes back: escalations resume soon after.

The defect this catches: gRPC's reconnect backoff grows while the link is down (1.6x per failed attempt)
and, capped at several seconds, leaves the channel failing every call fast with UNAVAILABLE for seconds
after the link is back; the breaker's probes every 0.25 s then find nothing to use.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from compilers.package import ModelPackage
from edge_agent.agent import EdgeAgent
from edge_agent.budget import Budget
from edge_agent.policy import Policy
from testkit import zoo
from testkit.grpc_cloud import GrpcCloud
from testkit.packages import make_package
from testkit.slowlink import SlowLink

# Measured on the shared 2-core host under load (other suites running): the first cloud answer came
# 0.15-0.3 s after the link returned with the fix; before it, 3-6 s (or not within the 8 s watched).
# The bound leaves room for a loaded host.
BOUND_S = 1.5
OUTAGE_S = 10.0
# Room for a 20 ms link on a loaded host: with 40 ms, at load average ~20 one escalation in 10 s was answered
# (the rest timed out). The defect does not depend on it: the channel fails calls fast, whatever the budget.
BUDGET_MS = 200


@pytest.fixture(scope="module")
def package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("pkg") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


def test_escalations_resume_soon_after_an_outage_over_grpc(package: ModelPackage, digits: zoo.Split) -> None:
    cloud = GrpcCloud()
    xs = digits.x_test

    async def main() -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        async with SlowLink("127.0.0.1", cloud.port, rate_bps=10e6, rtt_s=0.02) as link:
            url = f"grpc://127.0.0.1:{link.port}/digits"
            async with EdgeAgent(package, cloud=url, policy=Policy("max_prob", threshold=2.0),
                                 budget=Budget(latency_ms=BUDGET_MS)) as agent:
                i = 0

                async def phase(seconds: float, *, stop_after: int = 0) -> tuple[int, float | None]:
                    """Predicts for `seconds`, or until `stop_after` cloud answers (then: when the last came)."""
                    nonlocal i
                    started, answered = time.monotonic(), 0
                    while time.monotonic() - started < seconds:
                        pred = await agent.infer(xs[i % len(xs)])
                        i += 1
                        if pred.tier == "cloud":
                            answered += 1
                            if answered == stop_after:
                                return answered, time.monotonic() - started
                        await asyncio.sleep(0.02)
                    return answered, None

                # until 3 cloud answers (0.1 s on a quiet host; none came in 0.5 s at load average ~20), at most 10 s
                out["before"], _ = await phase(10.0, stop_after=3)
                link.cut()
                out["during"], _ = await phase(OUTAGE_S)
                link.restore()
                _, first = await phase(8.0, stop_after=1)
                out["first_s"] = first if first is not None else float("inf")
        return out

    try:
        out = asyncio.run(main())
    finally:
        cloud.stop()
    print(out)
    assert out["before"] >= 3  # the link was used before the outage
    assert out["during"] == 0  # and was really down
    assert out["first_s"] < BOUND_S
