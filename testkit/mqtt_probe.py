"""A raw MQTT v5 client whose SUBACK and PUBACK reason codes a test reads, for the broker permission tests."""

from __future__ import annotations

import queue
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.subscribeoptions import SubscribeOptions

from testkit.cloud_helpers import Pki


class Probe:
    """A raw MQTT v5 client whose SUBACK and PUBACK reason codes the test reads."""

    def __init__(self, port: int, client_id: str, *, ctx: ssl.SSLContext, username: str | None = None,
                 password: str | None = None) -> None:
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        self.client.tls_set_context(ctx)
        if username is not None:
            self.client.username_pw_set(username, password)
        self.subacks: dict[int, str] = {}
        self.pubacks: dict[int, str] = {}
        self.messages: queue.Queue[Any] = queue.Queue()
        self.connected = threading.Event()
        self.client.on_connect = lambda c, u, f, rc, p: self.connected.set()
        self.client.on_subscribe = lambda c, u, mid, rcs, p: self.subacks.__setitem__(mid, str(rcs[0]))
        self.client.on_publish = lambda c, u, mid, rc, p: self.pubacks.__setitem__(mid, str(rc))
        self.client.on_message = lambda c, u, m: self.messages.put(m)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert self.connected.wait(10), f"{client_id} could not connect"

    def _wait(self, table: dict[int, str], mid: int) -> str:
        deadline = time.monotonic() + 5
        while mid not in table and time.monotonic() < deadline:
            time.sleep(0.01)
        return table.get(mid, "no answer")

    def subscribe(self, topic: str) -> str:
        return self._wait(self.subacks, self.client.subscribe(topic, options=SubscribeOptions(qos=1))[1])

    def publish(self, topic: str, payload: bytes = b"x", *, retain: bool = False) -> str:
        return self._wait(self.pubacks, self.client.publish(topic, payload, qos=1, retain=retain).mid)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        self.client._reset_sockets()  # paho leaves its socket pair (and a late connection) to gc


def tls_context(pki: Pki, cert: tuple[Path, Path] | None) -> ssl.SSLContext:
    """Trust the PKI's CA; present `cert` (certificate, key) when given."""
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx
