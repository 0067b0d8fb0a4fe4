"""MQTT v5 packets the bridge writes itself, on paho's connection, from paho's network thread.

A refusal under overload must cost little on paho's single network thread, which also reads every
escalation: `Client.publish` builds a `Properties` object, an `MQTTMessage` and its
`MQTTMessageInfo` (with a `threading.Condition`) per message, wakes its own loop through a socket pair,
and at QoS 1 holds the message until the broker's PUBACK, which the same thread must read and match.
Here a refusal is encoded straight to bytes (a QoS 0 PUBLISH to the Response Topic, with the
Correlation Data and the user properties the wire contract names) and written with the escalation's
PUBACK in one packet: one `send`, no state kept, nothing to read back.

QoS 0 is enough for a refusal: the PUBACK follows it in the same TCP stream, so a refusal lost with
the connection leaves its escalation unacknowledged, as when a replica dies mid-request (the broker
delivers it again where its session allows); an agent that misses a refusal answers locally at its
deadline, as it does when the cloud is unreachable.

`write` queues the bytes on paho's outgoing packet queue (a record like paho's own `_packet_queue`'s,
so a partial write is finished by paho's loop, in order with everything else paho sends) and writes at
once (the escalations paho's loop would read first may be large: see `MqttBridge._flush`).
Call it only from paho's network thread (`on_message`): only that thread writes to the socket, so
nothing is half-written between the check and the write. It relies on paho 2.x internals
(`Client._out_packet` and its record's keys), pinned by the bridge's tests.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import paho.mqtt.client as paho

_PUBLISH_QOS0 = 0x30
_PUBACK = 0x40
_CORRELATION_DATA = 0x09
_USER_PROPERTY = 0x26
_MAX_VARINT = 268_435_455


def _varint(n: int) -> bytes:
    """MQTT's Variable Byte Integer."""
    if not 0 <= n <= _MAX_VARINT:
        msg = f"{n} does not fit an MQTT variable byte integer (0..{_MAX_VARINT})"
        raise ValueError(msg)
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


def _utf8(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 0xFFFF:
        msg = f"an MQTT string holds at most 65535 bytes, not {len(raw)}"
        raise ValueError(msg)
    return struct.pack("!H", len(raw)) + raw


def publish_qos0(topic: str, payload: bytes, *, correlation: bytes | None = None,
                 user: Sequence[tuple[str, str]] = ()) -> bytes:
    """A QoS 0 MQTT v5 PUBLISH of `payload` on `topic` (a valid topic name: no wildcards), with its
    Correlation Data and User Properties."""
    props = bytearray()
    if correlation is not None:
        if len(correlation) > 0xFFFF:
            msg = f"MQTT correlation data holds at most 65535 bytes, not {len(correlation)}"
            raise ValueError(msg)
        props += bytes((_CORRELATION_DATA,)) + struct.pack("!H", len(correlation)) + correlation
    for key, value in user:
        props += bytes((_USER_PROPERTY,)) + _utf8(key) + _utf8(value)
    body = _utf8(topic) + _varint(len(props)) + props + payload
    return bytes((_PUBLISH_QOS0,)) + _varint(len(body)) + body


def puback(mid: int) -> bytes:
    """The PUBACK (success) of the QoS 1 message `mid`, as paho's `ack` sends it."""
    return struct.pack("!BBH", _PUBACK, 2, mid)


def write(client: paho.Client, packet: bytes) -> bool:
    """On paho's network thread: send `packet` (whole MQTT packets) on `client`'s connection now, after what
    paho has queued; False (nothing sent) when it has no connection."""
    if client._sock is None:
        return False
    # recorded as an acknowledgement: paho then calls no `on_publish` and marks no message info for it
    record: Any = {"command": _PUBACK, "mid": 0, "qos": 0, "pos": 0,
                              "to_process": len(packet), "packet": packet, "info": None}
    client._out_packet.append(record)
    client.loop_write()
    return True
