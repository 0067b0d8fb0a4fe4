"""`sdk.load` / `TieredModel`: sync and asyncio faces of one agent, on a real package and a fake cloud."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sdk
from cloud_service.protocol import decode_inputs, encode_response
from compilers.package import ModelPackage
from compilers.variants import VariantSet
from edge_agent.adaptive import AdaptiveOptions
from edge_agent.agent import AgentOptions
from edge_agent.controller import Controller, ControllerConfig, Decision
from edge_agent.policy import Policy
from runtimes import open_session
from runtimes.errors import CloudUnavailable, ConfigError, InputError
from testkit import zoo
from testkit.cloud_helpers import metric_value
from testkit.fake_transport import FakeTransport
from testkit.packages import make_package


@pytest.fixture(scope="module")
def package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("pkg") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


def cloud(request: Any) -> Any:
    x = decode_inputs(request)["x"]
    logits = np.zeros((len(x), 10), np.float32)
    logits[:, 5] = 9.0
    return encode_response("digits", {"logits": logits})


def test_predict_edge_only(package: ModelPackage, digits: zoo.Split) -> None:
    with sdk.load(package.directory, policy="margin") as model:
        preds = [model.predict(x) for x in digits.x_test[:50]]
        batch = model.predict(digits.x_test[:50])
        assert {p.tier for p in preds} == {"edge"}
        assert not any(p.degraded for p in preds)
        labels = np.array([p.outputs["logits"].argmax() for p in preds])
        np.testing.assert_array_equal(labels, batch.outputs["logits"].argmax(axis=1))
        assert batch.scores.shape == (50,)
        assert model.stats()["requests"] == 51
        with pytest.raises(InputError):
            model.predict(np.zeros((3, 3), np.float32))


def test_predict_and_apredict_escalate(package: ModelPackage, digits: zoo.Split) -> None:
    fake = FakeTransport(cloud)
    model = sdk.load(package, cloud=fake, budget=sdk.Budget(latency_ms=500), policy=Policy(threshold=2.0))
    with model:
        pred = model.predict(digits.x_test[0])
        assert pred.tier == "cloud"
        assert pred.outputs["logits"].argmax() == 5

        async def main() -> list[sdk.Prediction]:
            async with model:
                return list(await asyncio.gather(*(model.apredict(x) for x in digits.x_test[:8])))

        preds = asyncio.run(main())
    assert [p.tier for p in preds] == ["cloud"] * 8
    assert len(fake.requests) == 9


def test_predict_from_many_threads(package: ModelPackage, digits: zoo.Split, digits_cnn_onnx: Path,
                                   tmp_path: Path) -> None:
    """Four threads share one model whose escalations go to a real cloud on loopback (the CNN): every
    cloud answer is the CNN's answer to that thread's own input, and every request is counted once."""
    from cloud_service.config import ServerConfig
    from testkit.cloud_helpers import ServerThread
    from testkit.cloud_helpers import make_package as make_cloud_package

    make_cloud_package(tmp_path / "models" / "digits-v1", digits_cnn_onnx)
    server = ServerThread(ServerConfig(models_dir=tmp_path / "models", grpc_address="127.0.0.1:0",
                                       drain_timeout_s=1.0)).start()
    policy = Policy(lambda out: (np.abs(out["logits"]).sum(axis=1) % 2 > 1).astype(float), threshold=0.5)
    results: list[tuple[int, sdk.Prediction]] = []
    try:
        with sdk.load(package, cloud=f"grpc://{server.grpc}/digits", budget=sdk.Budget(latency_ms=2000),
                      policy=policy) as model:
            def worker(rows: range) -> None:
                results.extend((i, model.predict(digits.x_test[i])) for i in rows)

            threads = [threading.Thread(target=worker, args=(range(i, 160, 4),)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            stats = model.stats()
        served = metric_value(server.metrics_text, "tierkit_requests_total", model="digits", protocol="grpc")
    finally:
        server.stop()
    assert len(results) == 160
    assert stats["requests"] == 160
    cloud_answered = [(i, p) for i, p in results if p.tier == "cloud"]
    assert 0 < len(cloud_answered) < 160
    assert stats["cloud_answers"] == len(cloud_answered)
    # the server also answers the audits of a few confident answers (never returned, never counted as escalations)
    assert 0 <= served - len(cloud_answered) <= stats["audits_drawn"]
    assert len({p.seq for _, p in results}) == 160
    with open_session(digits_cnn_onnx) as cnn:
        expected = cnn.run({"x": digits.x_test[:160]})["logits"]
    for i, p in cloud_answered:
        np.testing.assert_allclose(p.outputs["logits"], expected[i], rtol=1e-4, atol=1e-4)


def test_cloud_down_is_not_an_exception(package: ModelPackage, digits: zoo.Split) -> None:
    def down(request: Any) -> Any:
        msg = "refused"
        raise CloudUnavailable(msg)

    with sdk.load(package, cloud=FakeTransport(down), policy=Policy(threshold=2.0)) as model:
        pred = model.predict(digits.x_test[:3])
    assert pred.degraded
    assert pred.tier == "edge"
    assert pred.outputs["logits"].shape == (3, 10)


def test_load_rejects_bad_arguments(package: ModelPackage, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        sdk.load(package, cloud="http://example/x")
    with pytest.raises(ConfigError):
        sdk.load(package, policy="confidence")
    with pytest.raises(sdk.TierkitError):
        sdk.load(tmp_path)
    with pytest.raises(ConfigError):
        sdk.load(package, options=AgentOptions(device_id="a/b"))


def test_load_with_controller_true_builds_one(digits_ladder: VariantSet, digits: zoo.Split,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    open_session = ModelPackage.open_session

    def counting(self: ModelPackage, *args: Any, **kwargs: Any) -> Any:
        opened.append(self.directory.name)
        return open_session(self, *args, **kwargs)

    monkeypatch.setattr(ModelPackage, "open_session", counting)
    with sdk.load(digits_ladder.directory, cloud=FakeTransport(cloud), budget=sdk.Budget(latency_ms=200),
                  policy="max_prob", controller=True) as model:
        assert sorted(opened) == ["cnn", "linear"]  # one session per variant: the benchmark reuses them
        ctl = model.agent.controller
        assert isinstance(ctl, Controller)
        assert [p.id for p in ctl.profiles] == ["linear", "cnn"]
        assert all(p.energy_label == "modeled:generic-cpu" for p in ctl.profiles)
        assert ctl.link is not None
        assert ctl.link.energy_label == "modeled:generic-cpu"
        assert ctl.link.wait_power_w == 3.0
        assert ctl.link.cloud_prior == 0.99  # LinkProfile's default prior
        decision = model.decision
        assert isinstance(decision, Decision)
        preds = [model.predict(x) for x in digits.x_test[:20]]
        assert {p.variant for p in preds} == {decision.variant}
        doc = model.stats()["decision"]
        now = model.decision  # the controller may re-decide between two reads (its own thread)
        assert isinstance(now, Decision)
        assert any(doc["variant"] == d.variant and doc["threshold"] == pytest.approx(d.threshold, abs=1e-6)
                   for d in (decision, now))
        assert doc["reason"]
        assert doc["inputs"]["budget"]["latency_ms"] == 200
    with sdk.load(digits_ladder.directory, controller=None) as plain:
        assert plain.decision is None
        assert plain.stats()["decision"] is None


def test_budget_change_moves_the_controllers_decision(digits_ladder: VariantSet) -> None:
    opts = AgentOptions(adaptive=AdaptiveOptions(cloud_accuracy=0.999, rtt_ms=10.0))
    with sdk.load(digits_ladder, cloud=FakeTransport(cloud), budget=sdk.Budget(latency_ms=200), policy="max_prob",
                  controller=True, options=opts) as model:
        roomy = model.decision
        assert roomy is not None
        assert roomy.feasible
        # a 10 ms round trip fits, but the digits CNN is so rarely wrong that escalating more gains nothing
        # its validation data can tell apart (`decide.tied`): the cheapest such point, at least the floor
        # of escalations that keeps the link measured
        assert roomy.predicted_escalation_rate >= ControllerConfig().probe_escalation_rate - 1e-9
        assert roomy.binding == "none"
        model.set_budget(sdk.Budget(latency_ms=200, max_escalations_per_s=0.5))  # a cloud-cost cap
        capped = model.decision
        assert capped is not None
        assert capped.key != roomy.key
        assert "budget" in capped.trigger
        assert capped.feasible
        assert capped.predicted_escalations_per_s <= 0.5
        # the cap cannot buy accuracy; points within the controller's tie tolerance count as equal (when
        # the digits CNN happens to make no validation mistake, escalating to a 0.999 cloud ties with not)
        assert capped.predicted_accuracy <= roomy.predicted_accuracy + ControllerConfig().tie_tolerance
        assert model.stats()["decision"]["threshold"] == pytest.approx(capped.threshold, abs=1e-6)
        assert model.agent.threshold == capped.threshold


def test_controller_true_without_a_cloud_never_escalates(package: ModelPackage, digits: zoo.Split) -> None:
    with sdk.load(package, policy="max_prob", controller=True) as model:
        decision = model.decision
        assert decision is not None
        assert decision.predicted_escalation_rate == 0
        assert model.agent.controller is not None
        assert model.agent.controller.link is None
        pred = model.predict(digits.x_test[0])
    assert pred.tier == "edge"
    assert pred.variant == package.directory.name
