"""The permission matrix against the shipped Mosquitto configuration (deploy/mosquitto/), on a real
Mosquitto 2.0 with its dynamic-security plugin: what an enrolled device may subscribe to and publish,
each answered by the broker itself (SUBACK / PUBACK reason codes), and the escalations of another
device all reaching the cloud while one device tries to join the cloud's shared subscription."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from cloud_service import identity
from cloud_service.config import MqttConfig
from cloud_service.protocol import encode_request, topics
from cloud_service.security import MqttTls
from runtimes.errors import ConfigError
from testkit.cloud_helpers import Device, Pki, ServerThread, metric_value
from testkit.deploy_broker import DeployBroker, issue_client_cert, need_mosquitto
from testkit.mqtt_probe import Probe, tls_context

pytestmark = pytest.mark.mqtt


@pytest.fixture
def deploy(tmp_path: Path, pki: Pki) -> Iterator[DeployBroker]:
    need_mosquitto()
    broker = DeployBroker(tmp_path / "broker", pki, devices=("cam-1", "cam-2")).start()
    yield broker
    broker.stop()


@pytest.fixture
def cam1(deploy: DeployBroker, pki: Pki) -> Iterator[Probe]:
    probe = Probe(deploy.port, "cam-1", ctx=tls_context(pki, (pki.client_cert, pki.client_key)))
    yield probe
    probe.close()


SUBSCRIBE = [  # (topic filter, granted?)
    ("tierkit/v1/cam-1/reply", True), ("tierkit/v1/cam-1/desired", True),
    ("$share/tierkit/tierkit/v1/+/escalate", False), ("$share/x/tierkit/v1/cam-2/escalate", False),
    ("tierkit/v1/+/escalate", False), ("tierkit/v1/cam-2/reply", False), ("tierkit/v1/cam-1/#", False),
    ("tierkit/v1/cam-1", False), ("#", False), ("$SYS/#", False), ("$CONTROL/dynamic-security/v1/response", False),
]
ACCEPTED = {"Success": "accepted", "No matching subscribers": "accepted", "Not authorized": "Not authorized"}
PUBLISH = [  # (topic, retain, accepted?)
    ("tierkit/v1/cam-1/escalate", False, True), ("tierkit/v1/cam-1/telemetry", False, True),
    ("tierkit/v1/cam-1/reported", True, True), ("tierkit/v1/cam-1/desired", True, False),
    ("tierkit/v1/cam-1", False, False), ("tierkit/v1/cam-1/reply", False, False),
    ("tierkit/v1/cam-2/escalate", False, False), ("tierkit/v1/cam-2/reply", False, False),
    ("tierkit/v1/cam-2/desired", True, False), ("$CONTROL/dynamic-security/v1", False, False),
]


def test_device_subscribe_matrix(cam1: Probe) -> None:
    got = {topic: cam1.subscribe(topic) for topic, _ in SUBSCRIBE}
    want = {topic: "Granted QoS 1" if ok else "Not authorized" for topic, ok in SUBSCRIBE}
    assert got == want


def test_device_publish_matrix(cam1: Probe) -> None:
    got = {topic: ACCEPTED.get(cam1.publish(topic, retain=retain), "Not authorized?") for topic, retain, _ in PUBLISH}
    want = {topic: "accepted" if ok else "Not authorized" for topic, _, ok in PUBLISH}
    assert got == want


def test_unknown_and_crafted_certificate_names_get_nothing(deploy: DeployBroker, pki: Pki) -> None:
    for cn in ("cam-9", "cam-1/escalate", "+"):  # signed by the CA, never enrolled
        probe = Probe(deploy.port, "x", ctx=tls_context(pki, issue_client_cert(pki, cn)))
        try:
            assert probe.publish("tierkit/v1/cam-1/escalate") == "Not authorized"
            if "+" not in cn:
                assert probe.publish(f"tierkit/v1/{cn}/escalate") == "Not authorized"
            assert probe.subscribe("$share/tierkit/tierkit/v1/+/escalate") == "Not authorized"
        finally:
            probe.close()


def test_devices_cannot_log_in_on_the_password_listener(deploy: DeployBroker, pki: Pki) -> None:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="cam-1", protocol=paho.MQTTv5)
    client.tls_set_context(tls_context(pki, None))
    client.username_pw_set("cam-1", "")
    reasons: queue.Queue[Any] = queue.Queue()
    client.on_connect = lambda c, u, f, rc, p: reasons.put(rc)
    client.connect("127.0.0.1", deploy.cloud_port)
    client.loop_start()
    try:
        assert reasons.get(timeout=5).is_failure
    finally:
        client.loop_stop()
        client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc


def test_issuing_refuses_names_that_are_topics_or_reserved_accounts() -> None:
    for bad in ("cam-1/escalate", "+", "#", "cam 1", "$SYS", "", "Cam-1", "tierkit-cloud", "tierkit-fleet",
                "admin", "a" * 64, "..", "cam\x00", "é"):
        with pytest.raises(ConfigError, match="refused"):
            identity.check_device_id(bad)
    assert identity.check_device_id("cam-1.lab_2") == "cam-1.lab_2"


def test_a_device_cannot_take_another_devices_escalations(
        deploy: DeployBroker, pki: Pki, cam1: Probe, serve: Callable[..., ServerThread], models_dir: Path,
        digits_x: np.ndarray) -> None:
    mqtt = MqttConfig(url=f"mqtts://127.0.0.1:{deploy.cloud_port}", client_id="tierkit-cloud",
                      username="tierkit-cloud", password=deploy.passwords["tierkit-cloud"], tls=MqttTls(ca_file=pki.ca))
    server = serve(models_dir, grpc_address=None, mqtt=mqtt)
    assert cam1.subscribe("$share/tierkit/tierkit/v1/+/escalate") == "Not authorized"
    assert cam1.subscribe("tierkit/v1/+/escalate") == "Not authorized"
    cert2 = issue_client_cert(pki, "cam-2")
    cam2 = Device("127.0.0.1", deploy.port, "cam-2", tls=tls_context(pki, cert2))
    try:
        payload = encode_request("digits", {"x": digits_x[:1]}).SerializeToString()
        for i in range(20):
            cam2.send(payload, b"%d" % i)
        replies = [cam2.replies.get(timeout=10) for _ in range(20)]
        assert sorted(int(r.properties.CorrelationData) for r in replies) == list(range(20))
        assert metric_value(server.metrics_text, "tierkit_requests_total", protocol="mqtt") == 20
        assert cam1.messages.empty()
    finally:
        cam2.close()


def test_dynsec_commands_enroll_a_device_at_run_time(deploy: DeployBroker, pki: Pki) -> None:
    import json

    fleet = Probe(deploy.cloud_port, "tierkit-fleet", ctx=tls_context(pki, None), username="tierkit-fleet",
                  password=deploy.passwords["tierkit-fleet"])
    try:
        assert fleet.subscribe("$CONTROL/dynamic-security/v1/response") == "Granted QoS 1"
        assert fleet.publish("$CONTROL/dynamic-security/v1",
                             json.dumps({"commands": identity.dynsec_commands("cam-7")}).encode()) != "Not authorized"
        answer = json.loads(fleet.messages.get(timeout=5).payload)
        assert all("error" not in r for r in answer["responses"]), answer
    finally:
        fleet.close()
    cam7 = Probe(deploy.port, "cam-7", ctx=tls_context(pki, issue_client_cert(pki, "cam-7")))
    try:
        assert cam7.subscribe(topics.reply_topic("cam-7")) == "Granted QoS 1"
        assert ACCEPTED[cam7.publish(topics.escalate_topic("cam-7"))] == "accepted"
        assert cam7.publish(topics.desired_topic("cam-7"), retain=True) == "Not authorized"
        assert cam7.subscribe("$share/tierkit/tierkit/v1/+/escalate") == "Not authorized"
    finally:
        cam7.close()
