"""One device sending hostile escalations over MQTT must not hurt another device's answers.

Each case: what the hostile device gets (or that it gets nothing), the refusal counter, and that a
second device's valid escalation is still answered within its deadline afterwards.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from cloud_service.config import BatchingConfig, ModelOptions, MqttConfig
from cloud_service.protocol import decode_outputs, encode_request, topics
from cloud_service.protocol import inference_pb2 as pb
from testkit.cloud_helpers import Device, ServerThread, metric_value
from testkit.waiting import wait_for

pytestmark = pytest.mark.mqtt
WINDOW = 8  # the replica's receive_maximum: hostile messages past it would stall an unacknowledging bridge
DEADLINE_S = 5.0


@pytest.fixture
def server(broker, serve: Callable[..., ServerThread], models_dir: Path) -> ServerThread:  # type: ignore[no-untyped-def]
    mqtt = MqttConfig(url=broker.url, client_id="cloud-sec", receive_maximum=WINDOW, device_rate_per_s=1000.0)
    return serve(models_dir, grpc_address=None, mqtt=mqtt)


@pytest.fixture
def devices(server: ServerThread, broker) -> Iterator[tuple[Device, Device]]:  # type: ignore[no-untyped-def]
    hostile, honest = Device(broker.host, broker.port, "cam-evil"), Device(broker.host, broker.port, "cam-good")
    yield hostile, honest
    hostile.close()
    honest.close()


def _status(message) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    user = dict(getattr(message.properties, "UserProperty", None) or ())
    return user.get(topics.STATUS_PROPERTY, ""), user.get(topics.ERROR_PROPERTY, "")


def _honest_answered(honest: Device, x: np.ndarray, tag: bytes) -> None:
    started = time.monotonic()
    reply = honest.ask(encode_request("digits", {"x": x}).SerializeToString(), tag, timeout=DEADLINE_S)
    assert reply is not None, "another device's escalation went unanswered"
    assert time.monotonic() - started < DEADLINE_S
    assert _status(reply) == ("", "")
    assert decode_outputs(pb.ModelInferResponse.FromString(reply.payload))["logits"].shape == (1, 10)


def _metric_at_least(server: ServerThread, name: str, want: float, timeout: float = 10.0, **labels: str) -> float:
    wait_for(f"{name}{labels} to reach {want:g}", lambda: metric_value(server.metrics_text, name, **labels) >= want,
             timeout, interval=0.05)
    return metric_value(server.metrics_text, name, **labels)


BAD_REPLY_TOPICS = ("tierkit/v1/cam-evil/#", "tierkit/v1/cam-evil/+/x", "tierkit/v1/cam-good/reply",
                    "elsewhere/reply", "tierkit/v1/cam-evil/" + "r" * 2000)


def test_invalid_response_topics_are_refused_counted_and_acknowledged(
        server: ServerThread, devices: tuple[Device, Device], digits_x: np.ndarray) -> None:
    hostile, honest = devices
    payload = encode_request("digits", {"x": digits_x[:1]}).SerializeToString()
    sent = 3 * WINDOW  # three windows' worth: unacknowledged messages would stall the replica
    for i in range(sent):
        hostile.send(payload, b"%d" % i, reply_to=BAD_REPLY_TOPICS[i % len(BAD_REPLY_TOPICS)])
    _honest_answered(honest, digits_x[:1], b"after")
    assert _metric_at_least(server, "tierkit_refusals_total", sent, surface="mqtt", reason="bad_reply_topic") == sent
    assert honest.replies.empty()  # the hostile device's replies never reached another device


def test_an_error_reply_too_large_for_mqtt_is_bounded_and_acknowledged(
        server: ServerThread, devices: tuple[Device, Device], digits_x: np.ndarray) -> None:
    hostile, honest = devices
    huge = encode_request("m" * 70_000, {"x": digits_x[:1]}).SerializeToString()  # NOT_FOUND echoes the name
    for i in range(2 * WINDOW):
        hostile.send(huge, b"%d" % i)
    _honest_answered(honest, digits_x[:1], b"after")
    reply = hostile.ask(huge, b"last", timeout=DEADLINE_S)
    assert reply is not None
    code, text = _status(reply)
    assert code == "NOT_FOUND"
    assert len(text) < 2048
    assert "more characters" in text
    assert _metric_at_least(server, "tierkit_request_failures_total", 2 * WINDOW + 1, protocol="mqtt",
                     code="NOT_FOUND") == 2 * WINDOW + 1


def test_per_device_rate_limit_answers_at_once_and_spares_others(
        broker, serve: Callable[..., ServerThread], models_dir: Path, digits_x: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    mqtt = MqttConfig(url=broker.url, client_id="cloud-rate", receive_maximum=WINDOW, device_rate_per_s=5.0)
    server = serve(models_dir, grpc_address=None, mqtt=mqtt)
    hostile, honest = Device(broker.host, broker.port, "cam-evil"), Device(broker.host, broker.port, "cam-good")
    try:
        payload = encode_request("digits", {"x": digits_x[:1]}).SerializeToString()
        sent = 40
        for i in range(sent):
            hostile.send(payload, b"%d" % i)
        deadline, replies = time.monotonic() + DEADLINE_S, []
        while len(replies) < sent and time.monotonic() < deadline:  # every message is answered, none lost
            replies.append(hostile.replies.get(timeout=max(0.01, deadline - time.monotonic())))
        assert len(replies) == sent
        refused = [r for r in replies if _status(r)[0] == "RESOURCE_EXHAUSTED"]
        limited = metric_value(server.metrics_text, "tierkit_refusals_total", surface="mqtt", reason="device_rate")
        assert len(refused) == limited
        assert sent // 2 <= limited <= sent - 4  # the bucket holds one second's worth (5), refills at 5/s
        assert "per second" in _status(refused[0])[1]
        _honest_answered(honest, digits_x[:1], b"after")
    finally:
        hostile.close()
        honest.close()


def test_per_device_in_flight_limit(broker, serve: Callable[..., ServerThread], models_dir: Path,  # type: ignore[no-untyped-def]
                                    digits_x: np.ndarray) -> None:
    # A queue delay keeps requests in flight long enough for a burst to pass the per-device bound.
    mqtt = MqttConfig(url=broker.url, client_id="cloud-inflight", device_max_inflight=2, device_rate_per_s=1e6)
    waits = ModelOptions(batching=BatchingConfig(max_queue_delay_us=300_000, preferred_batch_sizes=(32,)))
    server = serve(models_dir, grpc_address=None, mqtt=mqtt, defaults=waits)
    hostile = Device(broker.host, broker.port, "cam-evil")
    try:
        payload = encode_request("digits", {"x": digits_x[:1]}).SerializeToString()
        for i in range(12):
            hostile.send(payload, b"%d" % i)
        assert _metric_at_least(server, "tierkit_refusals_total", 1, surface="mqtt", reason="device_inflight") >= 1
        replies = [hostile.replies.get(timeout=DEADLINE_S) for _ in range(12)]
        statuses = [_status(r) for r in replies]
        assert any(code == "" for code, _ in statuses)
        assert any(code == "RESOURCE_EXHAUSTED" and "being answered" in text for code, text in statuses)
    finally:
        hostile.close()


def test_fuzzed_payloads_over_mqtt_each_get_one_bounded_answer(
        server: ServerThread, devices: tuple[Device, Device], digits_x: np.ndarray) -> None:
    from hypothesis import HealthCheck, given, settings

    from testkit.fuzz import ANSWERABLE, MAX_DETAILS, requests

    hostile, honest = devices
    payloads: list[bytes] = []

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests())
    def collect(p: bytes) -> None:
        payloads.append(p)

    collect()
    valid = encode_request("digits", {"x": digits_x[:1]}).SerializeToString()
    for i, payload in enumerate(payloads):
        mutated = bytearray(valid)
        mutated[(i * 7919) % len(mutated)] ^= 0xFF  # and one byte flipped in a valid request
        hostile.send(payload, b"s%d" % i)
        hostile.send(bytes(mutated), b"m%d" % i)
    deadline, replies = time.monotonic() + 30, {}
    while len(replies) < 2 * len(payloads) and time.monotonic() < deadline:
        try:
            message = hostile.replies.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        replies[bytes(message.properties.CorrelationData)] = message
    assert len(replies) == 2 * len(payloads)  # every message answered once, none lost
    allowed = {c.name for c in ANSWERABLE} | {""}
    for message in replies.values():
        code, text = _status(message)
        assert code in allowed, (code, text[:200])
        assert len(text) <= MAX_DETAILS
    _honest_answered(honest, digits_x[:1], b"after")
