"""A paho MQTT v5 connection kept up in paho's network thread and reported to the asyncio event loop.

- paho's network thread (`loop_start`) does the I/O; callbacks reach the event loop through
  `loop.call_soon_threadsafe`, so everything the caller sees runs on the loop.
- The connection itself (TCP_NODELAY, the persistent session, the jittered reconnect, the shutdown that
  closes paho's sockets) is the one MQTT client layer's, `cloud_service.mqtt_client`.
- A connection that is not up (CONNACK and SUBACK in) within `connect_timeout_s` of its socket opening is
  shut down, so that paho tries again: paho bounds only the TCP connect, and an attempt that met a
  network cut (TCP accepted, packets dropped) would otherwise wait out the keepalive after the link is back.
- Persistent session: `clean_start=False` and a Session Expiry Interval, so subscriptions survive
  reconnects. The session counts as up only once its subscription is acknowledged, so that no reply
  can arrive before it is listened for.
- Full-jitter exponential backoff between connection attempts (`mqtt_client.Reconnect`), from
  `reconnect_min_s` up to `reconnect_max_s`, capped at about a second while the session was up recently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from cloud_service import mqtt_client
from cloud_service.mqtt_client import RECENT_CAP_S, RECENT_S, Reconnect, backoff_delay
from edge_agent.transports.base import TransportOptions
from edge_agent.transports.tls import ssl_context

logger = logging.getLogger(__name__)

MessageHandler = Callable[[str, bytes, Properties | None], None]
__all__ = ["RECENT_CAP_S", "RECENT_S", "MessageHandler", "MqttSession", "backoff_delay"]


class MqttSession:
    """One MQTT v5 client id, kept connected and subscribed to `subscribe`, reporting on the event loop.

    Args:
        host: broker host.
        port: broker port.
        client_id: the MQTT client id (the device id, for per-device broker ACLs).
        subscribe: topic subscribed with QoS 1 on every connection (more with `add_subscription`).
        tls: connect with TLS.
        options: credentials, keepalive, reconnect bounds, session expiry, in-flight bound.
        on_message: called on the loop with (topic, payload, properties) of each message received.
        on_down: called on the loop with a reason whenever the session stops being usable.
        rng: random source of the reconnect jitter.
    """

    def __init__(self, host: str, port: int, *, client_id: str, subscribe: str, tls: bool,
                 options: TransportOptions, on_message: MessageHandler, on_down: Callable[[str], None],
                 rng: random.Random | None = None) -> None:
        self.host, self.port, self.subscribe, self.options = host, port, subscribe, options
        self.extra_subscriptions: list[str] = []
        self.where = f"{'mqtts' if tls else 'mqtt'}://{host}:{port}"
        self.problem = "not connected yet"
        self._on_message_cb, self._on_down_cb = on_message, on_down
        self._reconnect = Reconnect(base_s=options.reconnect_min_s, cap_s=options.reconnect_max_s, rng=rng)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._up = False  # written by the network thread, read by the loop (a bool: atomic under the GIL)
        # asyncio.Event binds to a loop only when first awaited, so creating them here is safe
        self._up_event = asyncio.Event()
        self._attempted = asyncio.Event()  # set once a connection attempt has ended, either way
        self._subscribe_mid: int | None = None
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._closed = False
        client = mqtt_client.new_client(client_id, username=options.username, password=options.password,
                                        tls=ssl_context(options) if tls else None, max_inflight=options.max_pending,
                                        max_queued=options.max_pending, connect_timeout_s=options.connect_timeout_s)
        client.on_socket_open = self._on_socket_open
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_subscribe = self._on_subscribe
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        self.client = client

    @property
    def up(self) -> bool:
        """Connected and subscribed."""
        return self._up and not self._closed

    def socket(self) -> socket.socket | None:
        return self.client.socket()  # type: ignore[return-value]

    def start(self) -> None:
        """Begin connecting in paho's thread (idempotent); must run on the event loop that will use it."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        mqtt_client.start(self.client, self.host, self.port, keepalive_s=self.options.keepalive_s,
                          session_expiry_s=self.options.session_expiry_s)

    async def wait_up(self, timeout_s: float, *, first_attempt_only: bool = False) -> bool:
        """Start if needed; True once up within `timeout_s`. `first_attempt_only`: stop after a failed attempt."""
        self.start()
        event = self._attempted if first_attempt_only else self._up_event
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not self.up and not (first_attempt_only and event.is_set()):
                    await event.wait()
                    await asyncio.sleep(0)  # a stale set() is cleared by a callback already queued
        return self.up

    def publish(self, topic: str, payload: bytes | str, *, qos: int, retain: bool = False,
                properties: Properties | None = None) -> paho.MQTTMessageInfo:
        return self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)

    async def acknowledged(self, info: paho.MQTTMessageInfo, timeout_s: float) -> None:
        """Wait for the broker's PUBACK of a QoS 1 publish; TimeoutError past `timeout_s`, ConnectionError if down."""
        if info.is_published():
            return
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks[info.mid] = ack
        try:
            async with asyncio.timeout(timeout_s):
                await ack
        finally:
            self._acks.pop(info.mid, None)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            # joins the network thread, which may sleep up to 1 s in paho's reconnect wait
            await asyncio.to_thread(mqtt_client.shutdown, self.client)
        self._went_down("the transport was closed")

    # --- on the event loop --------------------------------------------------------------------------

    def _set_up(self, up: bool) -> None:
        self._attempted.set()
        if up:
            self._up_event.set()
        else:
            self._up_event.clear()
            self._went_down(self.problem)

    def _went_down(self, why: str) -> None:
        for ack in self._acks.values():
            if not ack.done():
                ack.set_exception(ConnectionError(why))
        self._on_down_cb(why)

    def _watch_handshake(self, sock: Any) -> None:
        assert self._loop is not None
        self._loop.call_later(self.options.connect_timeout_s, self._handshake_overdue, sock)

    def _handshake_overdue(self, sock: Any) -> None:
        if self._up or self._closed or self.client.socket() is not sock:
            return
        logger.info("MQTT broker %s did not complete the handshake within %.1f s; retrying", self.where,
                    self.options.connect_timeout_s)
        shutdown = getattr(sock, "shutdown", None)  # a proxy or websocket wrapper may not have it
        if shutdown is not None:
            with contextlib.suppress(OSError):
                shutdown(socket.SHUT_RDWR)  # paho's thread sees the error and reconnects

    def _acked(self, mid: int) -> None:
        ack = self._acks.get(mid)
        if ack is not None and not ack.done():
            ack.set_result(None)

    # --- paho callbacks, in its network thread ------------------------------------------------------

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting any more
                self._loop.call_soon_threadsafe(fn, *args)

    def _on_socket_open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        self._call_soon(self._watch_handshake, sock)
        mqtt_client.set_nodelay(sock)

    def _on_connect(self, client: paho.Client, userdata: Any, flags: paho.ConnectFlags, reason: ReasonCode,
                    properties: Properties | None) -> None:
        if reason.is_failure:
            self.problem = f"broker refused the connection: {reason}"
            logger.warning("MQTT broker %s refused the connection: %s", self.where, reason)
            self._call_soon(self._set_up, False)
            return
        # every (re)connection restores the subscriptions; the session is up once the first is granted
        self._subscribe_mid = mqtt_client.subscribe_all(client, [self.subscribe, *self.extra_subscriptions],
                                                        no_local=True)[0]

    def add_subscription(self, topic: str) -> None:
        """Also subscribe to `topic` (QoS 1), now if connected and again on every reconnection."""
        if topic in self.extra_subscriptions or topic == self.subscribe:
            return
        self.extra_subscriptions.append(topic)
        if self.client.is_connected():  # else _on_connect subscribes it
            mqtt_client.subscribe_all(self.client, [topic], no_local=True)

    def _on_subscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: list[ReasonCode],
                      properties: Properties | None) -> None:
        if mid != self._subscribe_mid:
            return
        if reasons and reasons[0].is_failure:
            self.problem = f"broker refused the subscription to {self.subscribe}: {reasons[0]}"
            logger.error("MQTT %s; check the device's broker role (it may subscribe to its own "
                         "tierkit/v1/DEVICE/reply and desired)", self.problem)
            self._call_soon(self._set_up, False)
            return
        self._reconnect.up()
        self._up = True
        logger.info("MQTT connected to %s", self.where)
        self._call_soon(self._set_up, True)

    def _next_wait(self) -> float:
        return self._reconnect.next_wait(self.client)

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        self.problem = f"cannot connect to {self.host}:{self.port}"
        delay = self._next_wait()
        logger.debug("MQTT connect to %s failed; retrying in %.2f s", self.where, delay)
        self._call_soon(self._set_up, False)

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode,
                       properties: Properties | None) -> None:
        was_up, self._up = self._up, False
        if not self._closed:
            self.problem = f"disconnected: {reason}"
            delay = self._next_wait()
            if was_up:
                logger.warning("MQTT connection to %s lost (%s); reconnecting in %.2f s", self.where, reason, delay)
        self._call_soon(self._set_up, False)

    def _on_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        self._call_soon(self._on_message_cb, message.topic, message.payload, message.properties)

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int, reason: ReasonCode,
                    properties: Properties) -> None:
        self._call_soon(self._acked, mid)
