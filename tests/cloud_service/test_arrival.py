"""Admission of MQTT escalations on arrival (paho's thread): the deadline less the answer's way back, and the
bound on escalations waiting for the event loop. Real messages as paho builds them; no broker needed."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers

from cloud_service.arrival import ArrivalGate
from cloud_service.config import ServerConfig
from cloud_service.errors import ServerBusy
from cloud_service.protocol import encode_request, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.repository import ModelRepository
from runtimes.errors import CloudTimeout


def _message(*, sent_ago_s: float, left_s: float, model: str = "digits") -> paho.MQTTMessage:
    now = time.time()
    request = encode_request(model, {"x": np.zeros((1, 4), np.float32)},
                             parameters={topics.PARAM_SENT_MS: int((now - sent_ago_s) * 1000),
                                         topics.PARAM_DEADLINE_MS: int((now + left_s) * 1000)})
    message = paho.MQTTMessage(topic=b"tierkit/v1/cam-1/escalate")
    message.payload = request.SerializeToString()
    return message


def test_the_answers_way_back_is_kept_from_the_deadline(tmp_path: Path) -> None:
    refused: list[tuple[str, str]] = []
    gate = ArrivalGate(ModelRepository(ServerConfig(models_dir=tmp_path)),
                       on_refused=lambda m, r: refused.append((m, r)))
    for _ in range(5):  # escalations that took ~30 ms to arrive
        request, refusal = gate.arrive(_message(sent_ago_s=0.03, left_s=0.07))
        assert request is not None
        assert request.model_name == "digits"
        assert refusal is None  # an unknown model: the event loop answers it with the precise error
        gate.taken(request)
    assert 0.025 < gate.reply_margin_s < 0.045
    # 20 ms left is not enough for an answer to travel back: refused on arrival, not computed
    _, refusal = gate.arrive(_message(sent_ago_s=0.03, left_s=0.02))
    assert isinstance(refusal, CloudTimeout)
    assert "travel back" in str(refusal)
    _, late = gate.arrive(_message(sent_ago_s=0.03, left_s=-0.01))
    assert isinstance(late, CloudTimeout)
    assert "after its deadline" in str(late)
    assert refused == [("digits", "expired"), ("digits", "expired")]
    # a skewed device clock (sent "an hour ago") counts at most half the budget
    for _ in range(200):
        gate.taken(gate.arrive(_message(sent_ago_s=3600, left_s=0.1))[0])
    assert gate.reply_margin_s <= 0.5 * 3600.1


def test_escalations_waiting_for_the_event_loop_are_bounded(tmp_path: Path) -> None:
    gate = ArrivalGate(ModelRepository(ServerConfig(models_dir=tmp_path)), max_waiting=3)
    for _ in range(3):
        assert gate.arrive(_message(sent_ago_s=0.001, left_s=1.0))[1] is None
    _, refusal = gate.arrive(_message(sent_ago_s=0.001, left_s=1.0))
    assert isinstance(refusal, ServerBusy)
    assert refusal.retry_after_ms > 0
    gate.taken(None)
    assert gate.arrive(_message(sent_ago_s=0.001, left_s=1.0))[1] is None
    assert gate.waiting == 3


class _Recorder:
    """Stands in for the bridge's paho client: records what is published, queued and written."""

    on_publish = None
    _sock = object()  # connected

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._out_packet: collections.deque[dict[str, Any]] = collections.deque()
        self.written: list[bytes] = []

    def publish(self, topic: str, payload: bytes, qos: int = 0, properties: object = None) -> None:
        self.calls.append(f"publish {topic}")

    def ack(self, mid: int, qos: int) -> None:
        self.calls.append("ack")

    def loop_write(self) -> None:
        self.calls.append("write")
        while self._out_packet:
            self.written.append(bytes(self._out_packet.popleft()["packet"]))


def _read_publish(packet: bytes) -> tuple[int, str, Properties, bytes, bytes]:
    """(fixed header byte, topic, properties, payload, what follows the packet) of one MQTT v5 PUBLISH."""
    length, size = VariableByteIntegers.decode(packet[1:])  # type: ignore[no-untyped-call]
    body, rest = packet[1 + size:1 + size + length], packet[1 + size + length:]
    topic_len = int.from_bytes(body[:2], "big")
    props, props_len = Properties(PacketTypes.PUBLISH).unpack(body[2 + topic_len:])  # type: ignore[no-untyped-call]
    return packet[0], body[2:2 + topic_len].decode(), props, body[2 + topic_len + props_len:], rest


def test_a_refusal_on_arrival_is_written_at_once_not_after_paho_reads_the_escalations_behind_it(
        tmp_path: Path) -> None:
    """paho's loop writes only after reading what its socket holds (under load, tens of ~400 KB escalations):
    the bridge writes a refusal made on paho's thread itself, with its escalation's PUBACK behind it, in one
    packet encoded without paho's per-message machinery; the reply is what the wire contract says."""
    from cloud_service.config import MqttConfig
    from cloud_service.metrics import Metrics
    from cloud_service.mqtt_bridge import MqttBridge

    bridge = MqttBridge(MqttConfig(url="mqtt://127.0.0.1:1", client_id="cloud-test"),
                        ModelRepository(ServerConfig(models_dir=tmp_path)), Metrics(), max_message_bytes=1 << 20)
    client = _Recorder()
    bridge._client = client  # type: ignore[assignment]
    message = _message(sent_ago_s=0.03, left_s=-0.01)  # past its deadline: refused on arrival
    message.qos, message.mid = 1, 4242
    message.properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    message.properties.ResponseTopic = "tierkit/v1/cam-1/reply"
    message.properties.CorrelationData = b"\x00req-17"
    bridge._on_message(client, None, message)  # type: ignore[arg-type]
    assert client.calls == ["write"]  # neither paho's publish nor its ack: one packet, written at once
    assert len(client.written) == 1
    header, topic, props, payload, rest = _read_publish(client.written[0])
    assert header == 0x30  # PUBLISH, QoS 0, no retain
    assert topic == "tierkit/v1/cam-1/reply"
    assert getattr(props, "CorrelationData", None) == b"\x00req-17"
    user = dict(getattr(props, "UserProperty", ()))
    assert user[topics.STATUS_PROPERTY] == "DEADLINE_EXCEEDED"
    assert "after its deadline" in user[topics.ERROR_PROPERTY]
    reply = pb.ModelInferResponse.FromString(payload)
    assert reply.model_name == "digits"
    assert reply.parameters[topics.STATUS_PROPERTY].string_param == "DEADLINE_EXCEEDED"
    assert rest == bytes([0x40, 2]) + (4242).to_bytes(2, "big")  # the escalation's PUBACK, after its reply


def test_a_refused_escalation_without_a_response_topic_is_only_acknowledged(tmp_path: Path) -> None:
    from cloud_service.config import MqttConfig
    from cloud_service.metrics import Metrics
    from cloud_service.mqtt_bridge import MqttBridge

    bridge = MqttBridge(MqttConfig(url="mqtt://127.0.0.1:1", client_id="cloud-test"),
                        ModelRepository(ServerConfig(models_dir=tmp_path)), Metrics(), max_message_bytes=1 << 20)
    client = _Recorder()
    bridge._client = client  # type: ignore[assignment]
    message = _message(sent_ago_s=0.03, left_s=-0.01)
    message.qos, message.mid = 1, 9
    bridge._on_message(client, None, message)  # type: ignore[arg-type]
    assert client.written == [bytes([0x40, 2, 0, 9])]
