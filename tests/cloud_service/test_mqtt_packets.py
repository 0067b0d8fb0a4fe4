"""The MQTT v5 packets the bridge encodes itself, read back with paho's own decoders."""

from __future__ import annotations

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers

from cloud_service import mqtt_packets


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152, 268_435_455])
def test_variable_byte_integers_read_back_as_paho_reads_them(n: int) -> None:
    raw = mqtt_packets._varint(n)
    assert VariableByteIntegers.decode(raw + b"\xff") == (n, len(raw))  # type: ignore[no-untyped-call]


def test_a_value_past_the_largest_variable_byte_integer_is_refused() -> None:
    with pytest.raises(ValueError, match="268435455"):
        mqtt_packets._varint(268_435_456)


def test_a_publish_with_a_long_payload_reads_back_whole() -> None:
    """A payload past 16 KB takes a three-byte remaining length; several user properties in order."""
    payload = bytes(range(256)) * 80
    topic = "tierkit/v1/" + "d" * 120 + "/reply"
    user = [("tierkit.status", "RESOURCE_EXHAUSTED"), ("tierkit.error", "busy: é"), ("tierkit.status", "x")]
    packet = mqtt_packets.publish_qos0(topic, payload, correlation=b"\x00\x01", user=user)
    assert packet[0] == 0x30
    length, size = VariableByteIntegers.decode(packet[1:])  # type: ignore[no-untyped-call]
    assert size == 3
    assert len(packet) == 1 + size + length
    body = packet[1 + size:]
    topic_len = int.from_bytes(body[:2], "big")
    assert body[2:2 + topic_len].decode() == topic
    props, props_len = Properties(PacketTypes.PUBLISH).unpack(body[2 + topic_len:])  # type: ignore[no-untyped-call]
    assert getattr(props, "CorrelationData", None) == b"\x00\x01"
    assert getattr(props, "UserProperty", None) == user
    assert body[2 + topic_len + props_len:] == payload


def test_a_publish_without_properties_has_an_empty_property_block() -> None:
    assert mqtt_packets.publish_qos0("a/b", b"x") == bytes([0x30, 7, 0, 3]) + b"a/b" + b"\x00x"
