"""`tierkit agent`: agent.yaml parsing, a real tritonclient request, desired/reported and telemetry over MQTT."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud_service.protocol import get_parameters, topics
from compilers.package import ModelPackage
from edge_agent.config import load_config, parse_config
from edge_agent.daemon import AgentDaemon
from edge_agent.fleet_sync import model_digest
from runtimes.errors import ConfigError
from testkit import zoo
from testkit.packages import make_package
from testkit.waiting import until


@pytest.fixture(scope="module")
def package(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> ModelPackage:
    return make_package(digits_linear_onnx, tmp_path_factory.mktemp("pkg") / "digits", name="digits",
                        x_val=digits.x_val, y_val=digits.y_val)


def test_config_parses_and_resolves_paths(tmp_path: Path) -> None:
    (tmp_path / "agent.yaml").write_text(
        "model: variants\ndevice_id: cam-7\ncloud: grpc://127.0.0.1:8001/cnn\nlisten: 127.0.0.1:0\n"
        "budget: {latency_ms: 25, energy_mj: 4}\npolicy: {score: margin, target_rate: 0.2, keep: true}\n"
        "breaker: {failure_threshold: 3}\njournal: {path: j.db, max_bytes: 1000000}\nbroker: mqtt://127.0.0.1:1884\n")
    config = load_config(tmp_path / "agent.yaml")
    assert config.model == tmp_path / "variants"
    assert config.listen == ("127.0.0.1", 0)
    assert config.broker == ("127.0.0.1", 1884)
    assert config.budget.latency_ms == 25
    assert config.policy.target_rate == 0.2
    assert config.policy.keep
    assert config.options.device_id == "cam-7"
    assert config.options.breaker.failure_threshold == 3
    assert config.options.journal_path == tmp_path / "j.db"
    assert not config.broker_tls


def test_config_tls_for_the_broker_and_the_fleet(tmp_path: Path) -> None:
    (tmp_path / "agent.yaml").write_text(
        "model: variants\ncloud: mqtts://broker:8883/cnn\nbroker: mqtts://broker:8883\n"
        "tls: {ca_file: ca.pem, cert_file: state/device.pem, key_file: state/device.key, server_name: broker}\n"
        "fleet: {url: 'https://fleet:8080', state_dir: state, ca_file: fleet-ca.pem}\n")
    config = load_config(tmp_path / "agent.yaml")
    assert config.broker_tls
    transport = config.options.transport
    assert transport is not None
    assert (transport.ca_file, transport.cert_file, transport.key_file, transport.server_name) == (
        str(tmp_path / "ca.pem"), str(tmp_path / "state/device.pem"), str(tmp_path / "state/device.key"), "broker")
    assert config.fleet is not None
    assert config.fleet.ca_file == tmp_path / "fleet-ca.pem"


@pytest.mark.parametrize(("doc", "match"), [
    ({}, "model"),
    ({"model": "m", "colud": "x"}, "unknown key"),
    ({"model": "m", "cloud": "http://x/y"}, "must start with"),
    ({"model": "m", "budget": {"latency": 3}}, "unknown key"),
    ({"model": "m", "budget": {"latency_ms": -1}}, "positive"),
    ({"model": "m", "listen": "8500"}, "HOST:PORT"),
    ({"model": "m", "policy": {"score": "confidence"}}, "not one of"),
    ({"model": "m", "broker": "grpc://127.0.0.1:1/x"}, "mqtt://"),
    ({"model": "m", "tls": {"cafile": "x"}}, "'tls' takes ca_file"),
    ({"model": "m", "controller": "yes"}, "true, false or a mapping"),
    ({"model": "m", "controller": {"cloud_acc": 0.9}}, "unknown key"),
    ({"model": "m", "controller": {"cloud_accuracy": 1.5}}, "cloud_accuracy"),
])
def test_config_errors_name_the_problem(doc: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(doc)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_tritonclient_gets_an_edge_answer(package: ModelPackage, digits: zoo.Split) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    config = parse_config({"model": str(package.directory), "listen": "127.0.0.1:0", "device_id": "dev-1"})
    x = digits.x_test[:4]
    with package.open_session() as session:
        local = session.run({"x": x})["logits"]

    def call(port: int) -> tuple[np.ndarray, dict[str, Any], str]:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert client.is_server_live()
            assert client.is_model_ready("digits")
            meta = client.get_model_metadata("digits")
            inp = grpcclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            result = client.infer("digits", [inp], outputs=[grpcclient.InferRequestedOutput("logits")])
            params = get_parameters(result.get_response().parameters)
            bad = grpcclient.InferInput("x", [1, 1, 9, 8], "FP32")
            bad.set_data_from_numpy(np.zeros((1, 1, 9, 8), np.float32))
            try:
                client.infer("digits", [bad])
            except Exception as exc:  # tritonclient's InferenceServerException
                error = str(exc)
            else:
                error = ""
            return result.as_numpy("logits"), {"params": params, "meta": meta}, error
        finally:
            client.close()

    async def main() -> tuple[np.ndarray, dict[str, Any], str]:
        async with AgentDaemon(config) as daemon:
            return await asyncio.to_thread(call, daemon.port)

    logits, info, error = asyncio.run(main())
    np.testing.assert_allclose(logits, local, rtol=1e-6)
    assert info["params"]["tierkit.tier"] == "edge"
    assert info["params"]["tierkit.release"] == model_digest(Path(package.directory))  # no release: its model
    assert info["params"]["tierkit.degraded"] is False
    assert str(info["params"]["tierkit.energy_label"]).startswith("modeled:")
    assert info["meta"].inputs[0].name == "x"
    assert "shape" in error


@pytest.mark.mqtt
def test_desired_state_and_telemetry_over_a_real_broker(package: ModelPackage, digits: zoo.Split,
                                                        broker: Any) -> None:
    import paho.mqtt.client as mqtt

    device = "dev-7"
    config = parse_config({"model": str(package.directory), "listen": "127.0.0.1:0", "device_id": device,
                           "broker": broker.url, "telemetry_interval_s": 0.2})
    received: queue.Queue[tuple[str, bytes]] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="operator", protocol=mqtt.MQTTv5)
    client.on_message = lambda c, u, m: received.put((m.topic, m.payload))
    client.connect(broker.host, broker.port)
    client.subscribe([(topics.telemetry_topic(device), 1), (topics.reported_topic(device), 1)])
    client.loop_start()
    desired = {"budget": {"latency_ms": 25}, "threshold": 0.5}
    client.publish(topics.desired_topic(device), json.dumps(desired), qos=1, retain=True).wait_for_publish(5)

    seen: dict[str, list[dict[str, Any]]] = {}

    def reported_and_counted() -> bool:
        _collect(received, seen)
        reported = seen.get(topics.reported_topic(device), [])
        return bool(reported and reported[-1].get("threshold") == 0.5
                    and any(t["requests"] >= 1 for t in seen.get(topics.telemetry_topic(device), [])))

    async def main() -> tuple[float, float]:
        async with AgentDaemon(config) as daemon:
            await until("the desired state applied", lambda: daemon.desired_applied, timeout=5)
            await daemon.agent.infer(digits.x_test[0])
            await until("the desired threshold reported and a telemetry window counting the request",
                        reported_and_counted, timeout=10)
            return daemon.agent.budget.latency_ms, daemon.agent.threshold

    try:
        latency, threshold = asyncio.run(main())
    finally:
        client.loop_stop()
        client.disconnect()
        client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
    assert (latency, threshold) == (25, 0.5)
    reported = seen[topics.reported_topic(device)][-1]
    assert reported["budget"]["latency_ms"] == 25
    assert reported["threshold"] == 0.5
    assert "error" not in reported
    telemetry = seen[topics.telemetry_topic(device)]
    assert any(t["requests"] >= 1 for t in telemetry)
    assert telemetry[-1]["device"] == device


def _collect(received: queue.Queue[tuple[str, bytes]], seen: dict[str, list[dict[str, Any]]]
             ) -> dict[str, list[dict[str, Any]]]:
    """Move what the operator's client received into `seen`, by topic."""
    while not received.empty():
        topic, payload = received.get()
        seen.setdefault(topic, []).append(json.loads(payload))
    return seen


def test_cli_help_mounts_agent() -> None:
    out = subprocess.run([sys.executable, "-m", "sdk.cli", "agent", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--config" in out


@pytest.fixture
def acl_broker(tmp_path: Path) -> Any:
    """A broker where each client may touch only `tierkit/v1/<its client id>/#`, and user `operator` all."""
    from testkit.broker import Broker

    acl = tmp_path / "acl"
    acl.write_text("user operator\ntopic readwrite tierkit/v1/#\n\npattern readwrite tierkit/v1/%c/#\n")
    b = Broker(tmp_path / "acl-broker", extra_conf=f"acl_file {acl}").start()
    yield b
    b.stop()


@pytest.mark.mqtt
def test_mqtt_cloud_link_carries_telemetry_and_desired(package: ModelPackage, digits: zoo.Split,
                                                       acl_broker: Any) -> None:
    """One session under the device's own client id carries telemetry, desired and reported state, so a
    per-device ACL (`pattern readwrite tierkit/v1/%c/#`) admits all of it."""
    import paho.mqtt.client as mqtt

    broker = acl_broker
    device = "dev-8"
    config = parse_config({"model": str(package.directory), "listen": "127.0.0.1:0", "device_id": device,
                           "cloud": f"{broker.url}/digits-cloud", "telemetry_interval_s": 0.2,
                           "policy": {"threshold": -1.0}})
    received: queue.Queue[tuple[str, bytes]] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="operator-2", protocol=mqtt.MQTTv5)
    client.username_pw_set("operator")
    client.on_message = lambda c, u, m: received.put((m.topic, m.payload))
    client.connect(broker.host, broker.port)
    client.subscribe([(topics.telemetry_topic(device), 1), (topics.reported_topic(device), 1)])
    client.loop_start()
    client.publish(topics.desired_topic(device), json.dumps({"threshold": 0.25}), qos=1,
                   retain=True).wait_for_publish(5)

    seen: dict[str, list[dict[str, Any]]] = {}
    both = {topics.telemetry_topic(device), topics.reported_topic(device)}

    async def main() -> float:
        async with AgentDaemon(config) as daemon:
            await until("the desired state applied", lambda: daemon.desired_applied, timeout=5)
            await daemon.agent.infer(digits.x_test[0])
            await until("telemetry and reported state through the one session",
                        lambda: both <= set(_collect(received, seen)), timeout=10)
            return daemon.agent.threshold

    try:
        threshold = asyncio.run(main())
        topics_seen = set(seen)
    finally:
        client.loop_stop()
        client.disconnect()
        client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
    assert threshold == 0.25
    assert topics.telemetry_topic(device) in topics_seen
    assert topics.reported_topic(device) in topics_seen


def test_telemetry_is_journaled_without_a_broker(package: ModelPackage, tmp_path: Path) -> None:
    from edge_agent.journal import Journal

    config = parse_config({"model": str(package.directory), "listen": "127.0.0.1:0", "device_id": "dev-9",
                           "telemetry_interval_s": 0.1, "journal": {"path": "journal.db"}}, base=tmp_path)

    def journaled() -> list[Any]:
        with Journal(tmp_path / "journal.db.telemetry") as journal:
            return journal.pending(10)

    async def main() -> None:
        async with AgentDaemon(config):
            await until("a telemetry window journaled", journaled, timeout=10, interval=0.1)

    asyncio.run(main())
    entries = journaled()
    assert entries
    assert {e.kind for e in entries} == {"telemetry"}
    assert json.loads(entries[0].payload)["device"] == "dev-9"


def test_config_controller_switch_and_priors() -> None:
    assert not parse_config({"model": "m"}).controller
    assert parse_config({"model": "m", "controller": True}).controller
    config = parse_config({"model": "m", "controller": {"cloud_accuracy": 0.97, "config": {"history": 8}}})
    assert config.controller
    assert config.options.adaptive.cloud_accuracy == 0.97
    assert config.options.adaptive.config is not None
    assert config.options.adaptive.config.history == 8


def test_desired_budget_reaches_the_controller(package: ModelPackage, tmp_path: Path) -> None:
    config = parse_config({"model": str(package.directory), "listen": "127.0.0.1:0", "controller": True,
                           "cloud": "grpc://127.0.0.1:1/digits", "policy": {"score": "max_prob"},
                           "budget": {"latency_ms": 200}}, base=tmp_path)

    async def main() -> None:
        async with AgentDaemon(config) as daemon:
            ctl = daemon.agent.controller
            assert ctl is not None
            before = ctl.current
            assert before.predicted_escalation_rate > 0
            daemon.sync.on_desired(topics.desired_topic(daemon.device), json.dumps(
                {"budget": {"max_escalations_per_s": 0.5}}).encode(), None)
            assert daemon.desired_applied == 1
            assert ctl.budget.max_escalations_per_s == 0.5
            assert ctl.budget.latency_ms == 200
            assert ctl.current.key != before.key
            assert ctl.current.trigger == "budget"
            assert daemon.agent.snapshot()["decision"]["threshold"] == pytest.approx(ctl.current.threshold, abs=1e-6)

    asyncio.run(main())
