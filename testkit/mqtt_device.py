"""A device's MQTT client for tests: paho v5 with the user and password the fleet issued."""

from __future__ import annotations

import json
import queue
import ssl
import threading
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion


class Device:
    """Connect as `user`; `connect()` returns the CONNACK reason; `publish()` the PUBACK reason, or None when
    none came in time or the broker cut the connection first (`cut` counts the connections lost)."""

    def __init__(self, host: str, port: int, user: str, password: str, *, tls: ssl.SSLContext | None = None) -> None:
        self.host, self.port = host, port
        self.messages: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
        self._connack: queue.Queue[Any] = queue.Queue()
        self._pubacks: dict[int, Any] = {}
        self._cond = threading.Condition()
        self.cut = 0
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=user, protocol=paho.MQTTv5)
        c.username_pw_set(user, password)
        if tls is not None:
            c.tls_set_context(tls)
        c.on_connect = lambda _c, _u, _f, rc, _p=None: self._connack.put(rc)
        c.on_message = lambda _c, _u, m: self.messages.put((m.topic, bytes(m.payload), bool(m.retain)))
        c.on_publish = self._on_publish
        c.on_disconnect = self._on_disconnect
        self.client = c

    def _on_publish(self, _c: Any, _u: Any, mid: int, rc: Any, _p: Any) -> None:
        with self._cond:
            self._pubacks[mid] = rc
            self._cond.notify_all()

    def _on_disconnect(self, *_args: Any) -> None:
        with self._cond:
            self.cut += 1
            self._cond.notify_all()

    def connect(self, timeout: float = 10.0) -> Any:
        self.client.connect(self.host, self.port, keepalive=30)
        self.client.loop_start()
        rc = self._connack.get(timeout=timeout)
        if rc.is_failure:
            self.client.loop_stop()
            self.client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
        return rc

    def publish(self, topic: str, payload: bytes | str | dict[str, Any], *, retain: bool = False,
                timeout: float = 10.0) -> Any:
        data = json.dumps(payload).encode() if isinstance(payload, dict) else payload
        with self._cond:
            cut = self.cut
        info = self.client.publish(topic, data, qos=1, retain=retain)
        with self._cond:
            self._cond.wait_for(lambda: info.mid in self._pubacks or self.cut > cut, timeout)
            return self._pubacks.get(info.mid)

    def subscribe(self, topic: str) -> None:
        self.client.subscribe(topic, qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        self.client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc
