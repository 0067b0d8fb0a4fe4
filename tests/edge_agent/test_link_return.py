"""A real agent with a controller: after a slow phase the link comes back, and escalations resume.

The cloud (a fake transport on the event loop, right on every input it is sent) answers in 40 ms,
over a 10 ms budget, for 1.5 s at about 100 requests/s; then at once. The controller keeps escalating
escalating while the link is slow (nothing is gained, nothing is lost: each ends at the agent's timer
inside the budget, or the open breaker skips it), the link model marks the unusual
run of timeouts "slower" (and, after twenty, the link down: the breaker then probes every 0.25 s); the
first answers in time after it are "faster" (or "up"), and the controller re-decides at once.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.protocol import decode_inputs, encode_response, inference_pb2
from compilers.package import ModelPackage
from edge_agent.agent import EdgeAgent
from edge_agent.budget import Budget
from edge_agent.controller import Controller
from edge_agent.policy import Policy
from edge_agent.profiles import LinkProfile, VariantProfile
from testkit import zoo
from testkit.fake_transport import FakeTransport
from testkit.packages import make_package

# Measured on the shared 2-core host under load (other test suites running), two runs: the first cloud
# answer 0.20 and 0.29 s after the link returned, the controller's re-decision on it 0.21 and 0.36 s.
# The bound asserted is the 1 s, with that much room for a loaded host.
BOUND_S = 1.0


@pytest.fixture(scope="module")
def package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("pkg") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


def test_a_returned_link_is_used_within_a_second_after_a_slow_phase(package: ModelPackage,
                                                                      digits: zoo.Split) -> None:
    labels = {x.tobytes(): int(y) for x, y in zip(digits.x_test, digits.y_test, strict=True)}
    delay = [0.04]

    async def cloud(request: inference_pb2.ModelInferRequest) -> inference_pb2.ModelInferResponse:
        await asyncio.sleep(delay[0])
        x = decode_inputs(request)["x"]
        logits = np.zeros((len(x), 10), np.float32)
        for i, row in enumerate(x):
            logits[i, labels.get(row.tobytes(), 0)] = 7.0
        return encode_response("digits", {"logits": logits})

    policy = Policy("max_prob")
    profile = VariantProfile.from_package(package, policy, variant_id=package.directory.name)
    budget = Budget(latency_ms=10)
    ctl = Controller([profile], budget, link=LinkProfile(rtt_ms=2.0, cloud_accuracy=0.999))
    xs = digits.x_test

    async def main() -> dict[str, Any]:
        async with EdgeAgent(package, cloud=FakeTransport(cloud), policy=policy, controller=ctl,
                             budget=budget) as agent:
            i, out = 0, {}
            end = time.monotonic() + 1.5
            while time.monotonic() < end:  # the slow phase
                await agent.infer(xs[i % len(xs)])
                i += 1
                await asyncio.sleep(0.01)
            out["slow_events"] = agent.link.event
            delay[0] = 0.0
            back = time.monotonic()
            while time.monotonic() - back < 3.0 and "redecided_s" not in out:
                pred = await agent.infer(xs[i % len(xs)])
                i += 1
                if pred.tier == "cloud" and "first_s" not in out:
                    out["first_s"] = time.monotonic() - back
                news = [d for d in ctl.decisions if d.at >= back and ("cloud up" in d.trigger or "faster" in d.trigger)]
                if news:
                    out["redecided_s"], out["rate"] = news[0].at - back, ctl.current.predicted_escalation_rate
                await asyncio.sleep(0.01)
            return out

    out = asyncio.run(main())
    print(out)
    assert out["slow_events"] in ("slower", "down")  # the slow phase was noticed
    assert out["first_s"] < BOUND_S  # an escalation answered by the returned link
    assert out["redecided_s"] < BOUND_S  # and the controller re-decided on it
    assert out["rate"] >= 0.15  # escalating again: above the 10 % floor while down (the rule takes about 18 % here)
