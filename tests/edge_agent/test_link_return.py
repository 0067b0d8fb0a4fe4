"""A real agent with a controller: after a slow phase the link comes back, and escalations resume.

The cloud (a fake transport on the event loop, right on every input it is sent) answers in 40 ms, over a
10 ms budget, for 1.5 s at about 100 requests/s (longer on a loaded host, until the link model marked
it); then at once. The controller keeps escalating while the link is slow (nothing is gained, nothing is
lost: each ends at the agent's timer inside the budget, or the open breaker skips it), the link model
marks the unusual run of timeouts "slower" (and, after twenty, the link down: the breaker then probes
every 0.25 s); the first answers in time after it are "faster" (or "up"), and the controller re-decides
at once; once the link is up, it takes the rule's share of escalations again.
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
# A link marked down is up again after three answers in a row; at the outage's floor (10 % of about 70
# requests/s) they took 0.42-0.82 s after the return on the loaded host (load average 15): 2 s for a
# busier one.
BOUND_UP_S = 2.0
SLOW_S, SLOW_MAX_S = 1.5, 8.0  # the slow phase: 1.5 s, longer until the link model marked it


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
            end, hard = time.monotonic() + SLOW_S, time.monotonic() + SLOW_MAX_S
            # the slow phase, until the link model has marked it (on a loaded host fewer requests run,
            # and the first run of timeouts to be news is seven long on a link with no history)
            while time.monotonic() < end or (agent.link.event not in ("slower", "down") and time.monotonic() < hard):
                await agent.infer(xs[i % len(xs)])
                i += 1
                await asyncio.sleep(0.01)
            out["slow_events"] = agent.link.event
            delay[0] = 0.0
            back = time.monotonic()
            while time.monotonic() - back < 4.0 and "up_s" not in out:
                pred = await agent.infer(xs[i % len(xs)])
                i += 1
                if pred.tier == "cloud" and "first_s" not in out:
                    out["first_s"] = time.monotonic() - back
                news = [d for d in ctl.decisions if d.at >= back and ("cloud up" in d.trigger or "faster" in d.trigger)]
                if news and "redecided_s" not in out:
                    out["redecided_s"] = news[0].at - back
                # a link marked down is up again after three answers: decisions before that still see no
                # escalation answered (the floor is all they can choose)
                if ups := [d for d in news if (d.inputs.get("link") or {}).get("up")]:
                    out["up_s"], out["rate"] = ups[0].at - back, ups[0].predicted_escalation_rate
                await asyncio.sleep(0.01)
            return out

    out = asyncio.run(main())
    print(out)
    out["trail"] = [(round(d.at - ctl.decisions[0].at, 3), d.trigger, round(d.predicted_escalation_rate, 3),
                     d.reason[:120]) for d in ctl.decisions]
    assert out["slow_events"] in ("slower", "down"), out  # the slow phase was noticed
    assert out["first_s"] < BOUND_S, out  # an escalation answered by the returned link
    assert out["redecided_s"] < BOUND_S, out  # and the controller re-decided on it
    assert out["up_s"] < BOUND_UP_S, out  # the link is up again in its model
    # and the controller escalates the rule's share again (about 18 % here), not the floor of the slow
    # spell or the outage (10 %), as it did while a move back had to beat two standard errors of its gain
    assert out["rate"] >= 0.15, out
