"""The MQTT v5 bridge against a real Mosquitto on a free loopback port."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from cloud_service.config import MqttConfig
from cloud_service.protocol import decode_outputs, encode_request, get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from compilers.package import ModelPackage
from testkit.cloud_helpers import Device, ServerThread, metric_value
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt


@pytest.fixture
def server(broker, serve: Callable[..., ServerThread], models_dir: Path) -> ServerThread:  # type: ignore[no-untyped-def]
    return serve(models_dir, grpc_address=None, mqtt=MqttConfig(url=broker.url, client_id="cloud-test"))


@pytest.fixture
def device(server: ServerThread, broker) -> Iterator[Device]:  # type: ignore[no-untyped-def]
    d = Device(broker.host, broker.port, "cam-1")
    yield d
    d.close()


def _status(message) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    user = dict(getattr(message.properties, "UserProperty", None) or ())
    return user.get(topics.STATUS_PROPERTY, ""), user.get(topics.ERROR_PROPERTY, "")


def test_escalation_round_trip_equals_direct_onnxruntime(device: Device, models_dir: Path,
                                                         digits_x: np.ndarray) -> None:
    x = digits_x[:5]
    reply = device.ask(encode_request("digits", {"x": x}, request_id="r1").SerializeToString(), b"corr-1")
    assert reply is not None
    assert reply.topic == topics.reply_topic("cam-1")
    assert reply.properties.CorrelationData == b"corr-1"
    assert reply.qos == 1
    assert _status(reply) == ("", "")
    response = pb.ModelInferResponse.FromString(reply.payload)
    assert response.id == "r1"
    with ModelPackage.open(models_dir / "digits-v1").open_session() as session:
        expected = session.run({"x": x})["logits"]
    np.testing.assert_allclose(decode_outputs(response)["logits"], expected, rtol=1e-5, atol=1e-5)


def test_duplicates_are_answered_from_the_cache(server: ServerThread, device: Device, digits_x: np.ndarray) -> None:
    params = {topics.PARAM_DEVICE: "cam-1", topics.PARAM_BOOT: "boot-a", topics.PARAM_SEQ: 41}
    payload = encode_request("digits", {"x": digits_x[:1]}, parameters=params).SerializeToString()
    first = pb.ModelInferResponse.FromString(device.ask(payload, b"a").payload)
    again = pb.ModelInferResponse.FromString(device.ask(payload, b"b").payload)
    other_boot = encode_request("digits", {"x": digits_x[:1]}, parameters={**params, topics.PARAM_BOOT: "boot-b"})
    fresh = pb.ModelInferResponse.FromString(device.ask(other_boot.SerializeToString(), b"c").payload)
    assert topics.PARAM_CACHED not in first.parameters
    assert get_parameters(again.parameters)[topics.PARAM_CACHED] is True
    assert topics.PARAM_CACHED not in fresh.parameters
    np.testing.assert_array_equal(decode_outputs(first)["logits"], decode_outputs(again)["logits"])
    text = server.metrics_text
    assert metric_value(text, "tierkit_mqtt_duplicates_total") == 1
    assert metric_value(text, "tierkit_batch_size_count", model="digits") == 2
    stats = server.service.repository.get("digits").stats.to_proto("digits", "1")
    assert stats.inference_stats.success.count == 2  # the duplicate never reached the model


def test_garbage_and_bad_requests_are_answered_counted_and_others_keep_working(
        server: ServerThread, device: Device, digits_x: np.ndarray) -> None:
    garbage = device.ask(b"\xff\xfe this is not protobuf", b"g1")
    assert _status(garbage)[0] == "INVALID_ARGUMENT"
    assert "not a serialized ModelInferRequest" in _status(garbage)[1]
    empty = device.ask(b"", b"g2")
    assert _status(empty)[0] == "INVALID_ARGUMENT"
    device.send(b"\x00garbage without a response topic", b"g3", reply_to=None)
    unknown = device.ask(encode_request("nope", {"x": digits_x[:1]}).SerializeToString(), b"u")
    assert _status(unknown)[0] == "NOT_FOUND"
    assert get_parameters(pb.ModelInferResponse.FromString(unknown.payload).parameters)[
        topics.STATUS_PROPERTY] == "NOT_FOUND"
    nan = digits_x[:1].copy()
    nan[0, 0, 3, 3] = np.nan
    assert _status(device.ask(encode_request("digits", {"x": nan}).SerializeToString(), b"n"))[0] == "INVALID_ARGUMENT"
    ok = device.ask(encode_request("digits", {"x": digits_x[:1]}).SerializeToString(), b"ok")
    assert _status(ok) == ("", "")
    text = server.metrics_text
    assert metric_value(text, "tierkit_mqtt_garbage_total") == 3
    assert metric_value(text, "tierkit_request_failures_total", model="_unknown", protocol="mqtt",
                        code="INVALID_ARGUMENT") == 3
    assert metric_value(text, "tierkit_request_failures_total", model="digits", code="INVALID_ARGUMENT") == 1


def test_oversize_payload_is_refused(broker, serve: Callable[..., ServerThread], models_dir: Path) -> None:  # type: ignore[no-untyped-def]
    serve(models_dir, grpc_address=None, max_message_bytes=4096, mqtt=MqttConfig(url=broker.url, client_id="c2"))
    device = Device(broker.host, broker.port, "cam-9")
    try:
        big = encode_request("digits", {"x": np.zeros((20, 1, 8, 8), np.float32)}).SerializeToString()
        status, message = _status(device.ask(big, b"big"))
        assert status == "RESOURCE_EXHAUSTED"
        assert "exceeds this server's limit of 4096 bytes" in message
    finally:
        device.close()


def test_reply_topic_outside_the_devices_subtree_is_not_used(server: ServerThread, broker, digits_x) -> None:  # type: ignore[no-untyped-def]
    victim = Device(broker.host, broker.port, "cam-2")
    attacker = Device(broker.host, broker.port, "cam-3")
    try:
        payload = encode_request("digits", {"x": digits_x[:1]}).SerializeToString()
        attacker.send(payload, b"x", reply_to=topics.reply_topic("cam-2"))
        wait_for("the server to refuse the attacker's request", lambda: metric_value(
            server.metrics_text, "tierkit_request_failures_total", code="INVALID_ARGUMENT") >= 1, timeout=10)
        # the victim's own request is a barrier: a reply sent to it for the attacker's request would come first
        victim.send(payload, b"own")
        assert victim.replies.get(timeout=10).properties.CorrelationData == b"own"
        assert metric_value(server.metrics_text, "tierkit_request_failures_total", code="INVALID_ARGUMENT") == 1
    finally:
        victim.close()
        attacker.close()


def test_expired_deadline_is_not_computed(server: ServerThread, device: Device, digits_x: np.ndarray) -> None:
    past = int(time.time() * 1000) - 1000
    request = encode_request("digits", {"x": digits_x[:1]}, parameters={topics.PARAM_DEADLINE_MS: past})
    assert _status(device.ask(request.SerializeToString(), b"late"))[0] == "DEADLINE_EXCEEDED"
    assert metric_value(server.metrics_text, "tierkit_requests_expired_total", model="digits") == 1


def test_escalations_refused_on_arrival_are_each_answered_and_acknowledged(
        broker, serve: Callable[..., ServerThread], models_dir: Path, digits_x: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    """A refusal on arrival is written by the bridge itself, its escalation's PUBACK behind it: with the broker
    allowed 3 unacknowledged escalations in flight, ten refusals in a row and then an answer still come back."""
    serve(models_dir, grpc_address=None, mqtt=MqttConfig(url=broker.url, client_id="cloud-ack", receive_maximum=3))
    device = Device(broker.host, broker.port, "cam-9")
    try:
        past = int(time.time() * 1000) - 1000
        late = encode_request("digits", {"x": digits_x[:1]}, parameters={topics.PARAM_DEADLINE_MS: past})
        for i in range(10):
            reply = device.ask(late.SerializeToString(), f"late-{i}".encode())
            assert reply is not None, f"refusal {i} never came back"
            assert _status(reply)[0] == "DEADLINE_EXCEEDED"
            assert reply.qos == 0
            assert pb.ModelInferResponse.FromString(reply.payload).model_name == "digits"
        answer = device.ask(encode_request("digits", {"x": digits_x[:1]}).SerializeToString(), b"fine")
        assert answer is not None
        assert _status(answer) == ("", "")
    finally:
        device.close()


def test_qos1_round_trip_is_fast_with_tcp_nodelay(device: Device, digits_x: np.ndarray) -> None:
    payload = encode_request("digits", {"x": digits_x[:1]}).SerializeToString()
    device.ask(payload, b"warm")
    times = []
    for i in range(30):
        started = time.perf_counter()
        assert device.ask(payload, str(i).encode()) is not None
        times.append(time.perf_counter() - started)
    # ~88 ms when Nagle meets delayed ACKs; a few ms with TCP_NODELAY on every hop
    assert statistics.median(times) < 0.03, times
