"""The edge agent with a fake cloud: edge vs cloud, per-row escalation, degraded answers, breaker, cache."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from cloud_service.protocol import decode_inputs, encode_response, get_parameters, inference_pb2, topics
from compilers.package import ModelPackage
from edge_agent.agent import AgentOptions, EdgeAgent
from edge_agent.breaker import BreakerConfig
from edge_agent.budget import Budget
from edge_agent.policy import Policy
from edge_agent.prediction import Prediction
from runtimes.energy import EnergyMeter, RaplSource
from runtimes.errors import CloudUnavailable, InputError
from runtimes.session import SessionOptions
from testkit import zoo
from testkit.fake_transport import FakeTransport
from testkit.packages import make_package
from testkit.waiting import until

ALWAYS, NEVER = 2.0, -1.0  # thresholds: every score is in [0, 1]
# How far past its budget an abandoned escalation may return: the agent's timer fires at the deadline, and a
# loaded host runs it late. Measured +17.7 ms at most (100 ms budget) with two runs of these tests beside
# each other at load average ~9, where a bound of +15 failed; the slow clouds below answer 100+ ms after
# the budget or never, so a request that waited for them still fails.
LATE_MS = 50.0


@pytest.fixture(scope="module")
def package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("pkg") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


def cloud_answer(model: str = "digits", *, value: float = 7.0) -> Callable[[Any], Any]:
    """A cloud that answers class 3 with logit `value` for each row it gets."""

    def handler(request: inference_pb2.ModelInferRequest) -> inference_pb2.ModelInferResponse:
        x = decode_inputs(request)["x"]
        logits = np.zeros((len(x), 10), np.float32)
        logits[:, 3] = value
        return encode_response(model, {"logits": logits})

    return handler


def run(package: ModelPackage, x: Any, *, handler: Any = None, threshold: float = ALWAYS,
        budget: Budget | None = None, n: int = 1, **kw: Any) -> tuple[list[Prediction], EdgeAgent, FakeTransport]:
    fake = FakeTransport(handler or cloud_answer())
    policy = kw.pop("policy", None) or Policy("max_prob", threshold=threshold)

    async def main() -> list[Prediction]:
        async with EdgeAgent(package, cloud=fake, policy=policy, budget=budget, **kw) as agent:
            out = [await agent.infer(x) for _ in range(n)]
            run.agent = agent  # type: ignore[attr-defined]
            return out

    preds = asyncio.run(main())
    return preds, run.agent, fake  # type: ignore[attr-defined]


def test_confident_is_answered_at_the_edge(package: ModelPackage, digits: zoo.Split) -> None:
    (pred,), agent, fake = run(package, digits.x_test[0], threshold=NEVER)
    assert pred.tier == "edge"
    assert not pred.degraded
    assert not fake.requests
    assert pred.outputs["logits"].shape == (10,)  # a single sample in, no batch axis out
    assert 0.0 <= pred.score <= 1.0
    assert pred.energy_label.startswith("modeled:")
    assert pred.energy_mj > 0
    assert agent.stats.requests == 1


def test_unsure_goes_to_the_cloud_with_metadata(package: ModelPackage, digits: zoo.Split) -> None:
    (pred,), _, fake = run(package, digits.x_test[:1], budget=Budget(latency_ms=500))
    assert pred.tier == "cloud"
    assert not pred.degraded
    assert pred.outputs["logits"].shape == (1, 10)
    assert pred.outputs["logits"].argmax() == 3
    assert pred.cloud_rows.tolist() == [True]
    (request,) = fake.requests
    params = get_parameters(request.parameters)
    assert request.model_name == "digits"
    assert params[topics.PARAM_SEQ] == pred.seq
    assert params[topics.PARAM_DEVICE] == AgentOptions().device_id
    assert params[topics.PARAM_DEADLINE_MS] > time.time() * 1e3
    assert params[topics.PARAM_VARIANT] == pred.variant


def test_batch_sends_only_the_unsure_rows(package: ModelPackage, digits: zoo.Split) -> None:
    x = digits.x_test[:5]
    unsure = {1, 3}
    policy = Policy(lambda out: np.array([0.0 if i in unsure else 1.0 for i in range(len(out["logits"]))]),
                    threshold=0.5)
    (pred,), _, fake = run(package, x, policy=policy)
    (request,) = fake.requests
    assert decode_inputs(request)["x"].shape == (2, 1, 8, 8)
    np.testing.assert_array_equal(decode_inputs(request)["x"], x[[1, 3]])
    assert pred.cloud_rows.tolist() == [False, True, False, True, False]
    labels = pred.outputs["logits"].argmax(axis=1)
    assert labels[1] == labels[3] == 3
    with zoo_session(package) as session:
        local = session.run({"x": x})["logits"]
    np.testing.assert_array_equal(pred.outputs["logits"][[0, 2, 4]], local[[0, 2, 4]])


def zoo_session(package: ModelPackage) -> Any:
    return package.open_session()


def test_cloud_raising_gives_the_local_answer_degraded(package: ModelPackage, digits: zoo.Split) -> None:
    def down(request: Any) -> Any:
        msg = "connection refused"
        raise CloudUnavailable(msg)

    (pred,), agent, _ = run(package, digits.x_test[0], handler=down)
    assert pred.tier == "edge"
    assert pred.degraded
    assert pred.reason == "unavailable"
    with zoo_session(package) as session:
        local = session.run({"x": digits.x_test[:1]})["logits"][0]
    np.testing.assert_array_equal(pred.outputs["logits"], local)
    assert agent.stats.degraded == 1


def _wrong_model(request: Any) -> Any:
    return encode_response("other", {"logits": np.zeros((1, 10), np.float32)})


def _wrong_shape(request: Any) -> Any:
    return encode_response("digits", {"logits": np.zeros((1, 9), np.float32)})


def _wrong_name(request: Any) -> Any:
    return encode_response("digits", {"probs": np.zeros((1, 10), np.float32)})


def _garbled(request: Any) -> Any:
    response = encode_response("digits", {"logits": np.zeros((1, 10), np.float32)})
    response.raw_output_contents[0] = b"\x00" * 7
    return response


@pytest.mark.parametrize("handler", [_wrong_model, _wrong_shape, _wrong_name, _garbled])
def test_bad_replies_are_ignored_counted_and_degraded(package: ModelPackage, digits: zoo.Split,
                                                      handler: Any) -> None:
    (pred,), agent, fake = run(package, digits.x_test[0], handler=handler)
    assert len(fake.requests) == 1
    assert pred.degraded
    assert pred.tier == "edge"
    assert pred.reason == "bad_reply"
    assert agent.stats.reasons == {"bad_reply": 1}


def test_open_breaker_makes_no_call(package: ModelPackage, digits: zoo.Split) -> None:
    def down(request: Any) -> Any:
        msg = "refused"
        raise CloudUnavailable(msg)

    opts = AgentOptions(breaker=BreakerConfig(failure_threshold=2, reset_timeout_s=60))
    preds, agent, fake = run(package, digits.x_test[0], handler=down, n=5, options=opts)
    assert len(fake.requests) == 2
    assert [p.reason for p in preds] == ["unavailable"] * 2 + ["breaker_open"] * 3
    assert all(p.degraded for p in preds)
    assert agent.breaker.state == "open"


def test_hung_cloud_costs_at_most_the_deadline(package: ModelPackage, digits: zoo.Split) -> None:
    async def hang(request: Any) -> Any:
        await asyncio.sleep(30)  # a cloud that never answers in time (the behaviour under test)

    budget = Budget(latency_ms=60)
    t = time.perf_counter()
    preds, _, _ = run(package, digits.x_test[0], handler=hang, budget=budget, n=3)
    assert time.perf_counter() - t < 5
    for p in preds:
        assert p.degraded
        assert p.reason in {"timeout", "rtt"}
        assert p.latency_ms < budget.latency_ms + LATE_MS, p.latency_ms


def test_slow_link_is_skipped_then_probed(package: ModelPackage, digits: zoo.Split) -> None:
    async def slow(request: Any) -> Any:
        await asyncio.sleep(0.03)  # the slow link's round trip (the behaviour under test)
        return cloud_answer()(request)

    opts = AgentOptions(rtt_probe_s=60)
    preds, _, fake = run(package, digits.x_test[0], handler=slow, budget=Budget(latency_ms=20), n=5, options=opts)
    assert preds[0].reason == "timeout"
    # a timeout is a censored round trip (longer than the wait): on a quiet host the first one already says the
    # link does not fit; with another test run loading both cores the edge's own part of the budget grows, the
    # agent waits less before it gives up, and a second timeout was once needed to tell (2 sent of 5)
    assert {p.reason for p in preds} <= {"timeout", "rtt"}
    assert [p.reason for p in preds[-3:]] == ["rtt"] * 3  # the observed round trip does not fit
    assert len(fake.requests) <= 2


def test_wrong_input_fails_before_anything_runs(package: ModelPackage, digits: zoo.Split) -> None:
    async def main() -> None:
        fake = FakeTransport(cloud_answer())
        async with EdgeAgent(package, cloud=fake, policy=Policy(threshold=ALWAYS)) as agent:
            with pytest.raises(InputError, match="dtype"):
                await agent.infer(digits.x_test[:2].astype(np.float64))
            with pytest.raises(InputError, match="shape"):
                await agent.infer(np.zeros((2, 1, 9, 8), np.float32))
            with pytest.raises(InputError, match="unknown input"):
                await agent.infer({"image": digits.x_test[:1]})
            with pytest.raises(InputError, match="missing input"):
                await agent.infer({})
            assert not fake.requests
            assert agent.snapshot()["requests"] == 0

    asyncio.run(main())


def test_cache_answers_recurring_inputs(package: ModelPackage, digits: zoo.Split) -> None:
    preds, agent, fake = run(package, digits.x_test[0], policy=Policy(threshold=ALWAYS, cache_size=4), n=3)
    assert len(fake.requests) == 1
    assert [p.cached for p in preds] == [False, True, True]
    assert preds[2].tier == "cloud"
    np.testing.assert_array_equal(preds[2].outputs["logits"], preds[0].outputs["logits"])
    assert agent.snapshot()["cache_hits"] == 2


def test_rate_cap_limits_cloud_calls(package: ModelPackage, digits: zoo.Split) -> None:
    preds, _, fake = run(package, digits.x_test[0], budget=Budget(latency_ms=500, max_escalations_per_s=1), n=4)
    assert len(fake.requests) == 1
    assert [p.reason for p in preds[1:]] == ["rate"] * 3


def test_strict_mode_raises(package: ModelPackage, digits: zoo.Split) -> None:
    def down(request: Any) -> Any:
        msg = "refused"
        raise CloudUnavailable(msg)

    with pytest.raises(CloudUnavailable):
        run(package, digits.x_test[0], handler=down, options=AgentOptions(strict=True))


class FakeController:
    """Records observations and decides a fixed (variant, threshold)."""

    def __init__(self, variant: str, threshold: float) -> None:
        self.current = SimpleNamespace(variant=variant, threshold=threshold)
        self.link = None
        self.deadline_margin_ms: float | None = None
        self.seen: list[tuple[str, Any]] = []
        self.attempted: list[bool | None] = []
        self.redecided = 0

    def observe_inference(self, variant: str, latency_ms: float, energy_mj: float | None = None, *,
                          energy_label: str | None = None) -> None:
        self.seen.append(("inference", variant))

    def observe_escalation(self, rtt_ms: float | None, ok: bool, bytes_sent: int = 0, *,
                           elapsed_ms: float | None = None, attempted: bool | None = None,
                           timeout: bool = False, fed: bool = False) -> None:
        self.seen.append(("escalation", ok))
        self.attempted.append(attempted)

    def observe_request(self, escalated: bool, agreed: bool | None, total_latency_ms: float, *,
                        score: float | None = None, variant: str | None = None,
                        energy_mj: float | None = None) -> None:
        self.seen.append(("request", escalated))

    def set_budget(self, budget: Budget) -> None:
        self.seen.append(("budget", budget.latency_ms))

    def deadline_scale(self) -> float:
        return 1.0

    def maybe_redecide(self) -> None:
        self.redecided += 1


def test_controller_decides_and_observes(package: ModelPackage, digits: zoo.Split) -> None:
    ctl = FakeController(package.directory.name, ALWAYS)
    preds, agent, fake = run(package, digits.x_test[0], threshold=NEVER, controller=ctl, n=2)
    assert [p.tier for p in preds] == ["cloud", "cloud"]  # the controller's threshold, not the policy's
    assert len(fake.requests) == 2
    assert ("inference", package.directory.name) in ctl.seen
    assert ("escalation", True) in ctl.seen
    assert ("request", True) in ctl.seen
    assert ctl.redecided >= 1
    agent.set_budget(Budget(latency_ms=42))
    assert ("budget", 42) in ctl.seen


def test_prediction_is_a_complete_frozen_dataclass(package: ModelPackage, digits: zoo.Split) -> None:
    import dataclasses

    (pred,), _, _ = run(package, digits.x_test[0], threshold=NEVER)
    assert set(vars(pred)) == {f.name for f in dataclasses.fields(Prediction)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        pred.tier = "cloud"  # type: ignore[misc]


def test_real_controller_drives_the_agent(package: ModelPackage, digits: zoo.Split) -> None:
    from edge_agent.controller import Controller
    from edge_agent.profiles import LinkProfile, VariantProfile

    policy = Policy("margin")
    profile = VariantProfile.from_package(package, policy, variant_id=package.directory.name)
    ctl = Controller([profile], Budget(latency_ms=200), link=LinkProfile(rtt_ms=2.0))
    preds, agent, fake = run(package, digits.x_test[:1], policy=policy, controller=ctl, n=30,
                             budget=Budget(latency_ms=200))
    assert all(p.variant == ctl.current.variant for p in preds)
    assert agent.threshold == ctl.current.threshold
    assert len(fake.requests) == sum(p.tier == "cloud" for p in preds)
    assert not any(p.degraded for p in preds)


def test_edge_only_marks_unsure_rows_without_degrading(package: ModelPackage, digits: zoo.Split) -> None:
    async def main() -> Prediction:
        async with EdgeAgent(package, policy=Policy(threshold=ALWAYS)) as agent:
            return await agent.infer(digits.x_test[0])

    pred = asyncio.run(main())
    assert (pred.tier, pred.degraded, pred.reason) == ("edge", False, "no_cloud")


def test_link_recovery_is_noticed_at_the_first_probe(package: ModelPackage, digits: zoo.Split) -> None:
    delay = [0.03]

    async def link(request: Any) -> Any:
        await asyncio.sleep(delay[0])  # the link's round trip (the behaviour under test)
        return cloud_answer()(request)

    async def main() -> list[Prediction]:
        # a probe every 0.5 s: the skip right after the timeout stays a skip however slowly a loaded host runs
        # the two requests (at 0.05 s, 50 ms between them would make the second one a probe)
        opts = AgentOptions(rtt_probe_s=0.5)
        async with EdgeAgent(package, cloud=FakeTransport(link), policy=Policy("max_prob", threshold=ALWAYS),
                             budget=Budget(latency_ms=20), options=opts) as agent:
            out = [await agent.infer(digits.x_test[0]) for _ in range(2)]  # a timeout, then skipped
            delay[0] = 0.0
            await until("the probe to be due", lambda: time.monotonic() - agent.link.last_attempt >= opts.rtt_probe_s,
                        timeout=5)
            out += [await agent.infer(digits.x_test[0]) for _ in range(3)]  # the probe, then no skipping
            return out

    preds = asyncio.run(main())
    assert [p.reason for p in preds] == ["timeout", "rtt", "", "", ""]
    assert [p.tier for p in preds[2:]] == ["cloud"] * 3


def test_with_a_controller_a_slow_link_is_not_second_guessed(package: ModelPackage, digits: zoo.Split) -> None:
    async def slow(request: Any) -> Any:
        await asyncio.sleep(0.6)  # the slow link's round trip (the behaviour under test)
        return cloud_answer()(request)

    # A budget of 300 ms: the skip rule compares the time left with a share of the median round trip seen
    # (~the deadline), and a loaded host's slower edge call and learned timer margin eat into the time left
    # though nothing is wrong: at 20 ms ['timeout', 'rtt', 'rtt'] at load average ~20; at 100 ms
    # ['timeout', 'timeout', 'rtt'] once in two runs side by side at load average ~8.
    ctl = FakeController(package.directory.name, ALWAYS)
    budget = Budget(latency_ms=300)
    preds, _, fake = run(package, digits.x_test[0], handler=slow, budget=budget, n=3, controller=ctl,
                         options=AgentOptions(rtt_probe_s=60))
    # the round trips seen so far end near the deadline: not clearly too long, so the controller's choice stands
    assert [p.reason for p in preds] == ["timeout"] * 3
    assert len(fake.requests) == 3
    assert all(p.latency_ms < budget.latency_ms + LATE_MS for p in preds), [p.latency_ms for p in preds]  # the deadline
    assert ctl.attempted == [True] * 3


def test_skips_are_reported_as_not_attempted(package: ModelPackage, digits: zoo.Split) -> None:
    def down(request: Any) -> Any:
        msg = "refused"
        raise CloudUnavailable(msg)

    opts = AgentOptions(breaker=BreakerConfig(failure_threshold=1, reset_timeout_s=60))
    ctl = FakeController(package.directory.name, ALWAYS)
    preds, _, _ = run(package, digits.x_test[0], handler=down, n=3, options=opts, controller=ctl)
    assert [p.reason for p in preds] == ["unavailable", "breaker_open", "breaker_open"]
    assert ctl.attempted == [True, False, False]

    ctl = FakeController(package.directory.name, ALWAYS)
    preds, _, _ = run(package, digits.x_test[0], budget=Budget(latency_ms=500, max_escalations_per_s=1), n=3,
                      controller=ctl)
    assert [p.reason for p in preds] == ["", "rate", "rate"]
    assert ctl.attempted == [True, False, False]

    ctl = FakeController(package.directory.name, ALWAYS)
    preds, _, _ = run(package, digits.x_test[0], budget=Budget(latency_ms=0.01), n=2, controller=ctl)
    assert [p.reason for p in preds] == ["budget", "budget"]
    assert ctl.attempted == [False, False]


def test_real_controller_learns_nothing_about_the_link_from_skips(package: ModelPackage,
                                                                   digits: zoo.Split) -> None:
    def down(request: Any) -> Any:
        msg = "refused"
        raise CloudUnavailable(msg)

    opts = AgentOptions(breaker=BreakerConfig(failure_threshold=1, reset_timeout_s=60))

    async def main() -> EdgeAgent:
        async with EdgeAgent(package, cloud=FakeTransport(down), policy=Policy("max_prob"), controller=True,
                             options=opts) as agent:
            ctl = agent.controller
            assert ctl is not None
            ctl.current = dataclasses.replace(ctl.current, threshold=ALWAYS)  # every request wants the cloud
            for _ in range(6):
                await agent.infer(digits.x_test[0])
            return agent

    agent = asyncio.run(main())
    assert agent.stats.reasons == {"unavailable": 1, "breaker_open": 5}
    assert agent.controller is not None
    assert agent.controller.link is not None
    # the one escalation sent failed: availability drops once (EWMA, alpha 0.2); the 5 skips do not count
    assert agent.controller.link.state().availability == pytest.approx(0.8)


def test_telemetry_carries_the_controllers_decision(package: ModelPackage, digits: zoo.Split) -> None:
    docs: list[dict[str, Any]] = []

    async def publish(doc: dict[str, Any]) -> None:
        docs.append(doc)

    async def main() -> None:
        opts = AgentOptions(telemetry_interval_s=0.05)
        async with EdgeAgent(package, cloud=FakeTransport(cloud_answer()), policy=Policy("max_prob"),
                             controller=True, options=opts, telemetry=publish) as agent:
            await agent.infer(digits.x_test[0])
            await until("a telemetry window carrying the decision", lambda: docs and agent.decision is not None
                        and (docs[-1].get("decision") or {}).get("variant") == agent.decision.variant, timeout=5)

    asyncio.run(main())
    doc = docs[-1]["decision"]
    assert doc["threshold"] is not None
    assert doc["reason"]
    assert {"budget", "link", "variant"} <= set(doc["inputs"])
    assert json.loads(json.dumps(docs[-1]))["decision"] == doc


class EnergyRecorder(FakeController):
    """Also records the (energy, label) pairs the agent hands the controller."""

    def __init__(self, variant: str, threshold: float) -> None:
        super().__init__(variant, threshold)
        self.energy: list[tuple[float | None, str | None]] = []

    def observe_inference(self, variant: str, latency_ms: float, energy_mj: float | None = None, *,
                          energy_label: str | None = None) -> None:
        super().observe_inference(variant, latency_ms, energy_mj, energy_label=energy_label)
        self.energy.append((energy_mj, energy_label))


def test_the_controller_never_gets_modeled_energy_labelled_measured(package: ModelPackage, digits: zoo.Split,
                                                                   tmp_path: Path) -> None:
    """With a measuring meter (a RAPL counter in a sysfs-shaped tree), the figure that travels with
    `measured:rapl` is the measured one, not the power profile's busy watts x edge time."""
    zone = tmp_path / "powercap" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text("0\n")
    (zone / "max_energy_range_uj").write_text(f"{10**12}\n")
    meter = EnergyMeter(RaplSource(tmp_path / "powercap"))
    ctl = EnergyRecorder(package.directory.name, NEVER)

    async def main() -> list[Prediction]:
        async with EdgeAgent(package, policy=Policy("max_prob", threshold=NEVER), controller=ctl,
                             meter=meter) as agent:
            for _ in range(10):
                await agent.infer(digits.x_test[0])
            (zone / "energy_uj").write_text(f"{10**6}\n")  # 1 J over these 10 requests: 100 mJ each
            # the meter is read once a second
            await until("the meter's first reading", lambda: agent._measured_mj is not None, timeout=5, interval=0.01)
            out = [await agent.infer(digits.x_test[0]) for _ in range(5)]
            agent.fold()
            return out

    preds = asyncio.run(main())
    assert all(p.energy_label == "measured:rapl" for p in preds)
    measured = [(mj, label) for mj, label in ctl.energy if label == "measured:rapl"]
    assert len(measured) == 5
    assert all(mj == pytest.approx(100.0) for mj, _ in measured), measured
    assert all(label == "modeled:generic-cpu" for _, label in ctl.energy[:10])


def test_the_edge_sessions_do_not_spin_between_requests(digits_cnn_onnx: Path, digits: zoo.Split,
                                                         tmp_path: Path) -> None:
    """onnxruntime's intra-op threads busy-wait for work by default: an agent serving a small CNN 100 times a second
    kept a core busy. The agent's sessions do not spin unless asked. (The digits logistic regression is one Gemm,
    which onnxruntime runs without its thread pool: 0.08-0.09 cores spinning or not, so the CNN.)"""
    package = make_package(digits_cnn_onnx, tmp_path / "cnn", name="digits", x_val=digits.x_val, y_val=digits.y_val)

    def serve(options: AgentOptions) -> tuple[str, float]:
        async def main() -> tuple[str, float]:
            async with EdgeAgent(package, policy=Policy("max_prob"), options=options) as agent:
                session = agent.variants[agent.variant].session
                try:
                    spins = session.session_options.get_session_config_entry("session.intra_op.allow_spinning")
                except RuntimeError:  # not set: onnxruntime's default, which spins
                    spins = "default"
                for row in digits.x_test[:20]:  # warm
                    await agent.infer(row)
                t0, c0 = time.perf_counter(), os.times()
                for row in digits.x_test[:100]:  # 100 a second for a second
                    await agent.infer(row)
                    await asyncio.sleep(0.01)
                c1 = os.times()
                return spins, (c1.user + c1.system - c0.user - c0.system) / (time.perf_counter() - t0)

        return asyncio.run(main())

    spins, cores = serve(AgentOptions())
    assert spins == "0"
    assert cores < 0.5, cores  # 0.05 on a 2-core AMD EPYC, where the spinning pool took 1.04-1.05
    asked, _ = serve(AgentOptions(session=SessionOptions(spin=True)))
    assert asked == "1"  # asked for, it spins
