"""A paho MQTT v5 connection kept up in paho's network thread and reported to the asyncio event loop.

- paho's network thread (`loop_start`) does the I/O; callbacks reach the event loop through
  `loop.call_soon_threadsafe`, so everything the caller sees runs on the loop.
- TCP_NODELAY on every new socket (`on_socket_open`): without it a QoS 1 round trip through Mosquitto
  takes ~88 ms instead of ~1.4 ms (Nagle's algorithm against delayed ACKs).
- A connection that is not up (CONNACK and SUBACK in) within `connect_timeout_s` of its socket opening is
  shut down, so that paho tries again: paho bounds only the TCP connect, and an attempt that met a
  network cut (TCP accepted, packets dropped) would otherwise wait out the keepalive after the link is back.
- Persistent session: `clean_start=False` and a Session Expiry Interval, so subscriptions survive
  reconnects. The session counts as up only once its subscription is acknowledged, so that no reply
  can arrive before it is listened for.
- Full-jitter exponential backoff between connection attempts. paho's own reconnect delay doubles
  without jitter; paho calls `on_disconnect` / `on_connect_fail` right before it waits, and there we
  set the next wait with `reconnect_delay_set(d, d)` (which also resets paho's doubling), where
  `d = uniform(0, min(cap, reconnect_min_s * 2**attempt))`. A fleet that loses its broker therefore
  does not reconnect in one synchronized storm. The cap is `reconnect_max_s`, except within
  `RECENT_S` of the session last being up, when it is `RECENT_CAP_S` (a broker restart or a dropped
  connection: be back within about a second, not after a doubling wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge_agent.transports.base import TransportOptions
from edge_agent.transports.tls import ssl_context

logger = logging.getLogger(__name__)

MessageHandler = Callable[[str, bytes, Properties | None], None]
RECENT_S = 60.0
RECENT_CAP_S = 1.0


def backoff_delay(attempt: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap_s, base_s * 2**attempt)]."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, 62)))


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
        self._rng = rng or random.Random()
        self._attempt = 0
        self._last_up = -math.inf  # monotonic time the session was last up (paho's thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._up = False  # written by the network thread, read by the loop (a bool: atomic under the GIL)
        # asyncio.Event binds to a loop only when first awaited, so creating them here is safe
        self._up_event = asyncio.Event()
        self._attempted = asyncio.Event()  # set once a connection attempt has ended, either way
        self._subscribe_mid: int | None = None
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._closed = False
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        client.connect_timeout = options.connect_timeout_s
        # paho holds unacknowledged messages in memory only: bound them
        client.max_inflight_messages_set(options.max_pending)
        client.max_queued_messages_set(options.max_pending)
        if options.username is not None:
            client.username_pw_set(options.username, options.password)
        if tls:
            client.tls_set_context(ssl_context(options))
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
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = self.options.session_expiry_s
        self.client.connect_async(self.host, self.port, keepalive=round(self.options.keepalive_s),
                                  clean_start=False, properties=props)
        self.client.loop_start()

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
            self.client.disconnect()
            # joins the network thread, which may sleep up to 1 s in paho's reconnect wait
            await asyncio.to_thread(self.client.loop_stop)
            # paho closes its wake-up socket pair only in __del__, which the reference cycle through our
            # callbacks delays to a gc pass (a ResourceWarning then); and a connection that completed while
            # the thread was being stopped is never closed by paho at all: close both now
            self.client._reset_sockets()
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
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError) as exc:  # a proxy or websocket wrapper may not expose it
            logger.warning("cannot set TCP_NODELAY on the MQTT socket (%s): replies may take ~40 ms more", exc)

    def _on_connect(self, client: paho.Client, userdata: Any, flags: paho.ConnectFlags, reason: ReasonCode,
                    properties: Properties | None) -> None:
        if reason.is_failure:
            self.problem = f"broker refused the connection: {reason}"
            logger.warning("MQTT broker %s refused the connection: %s", self.where, reason)
            self._call_soon(self._set_up, False)
            return
        _, self._subscribe_mid = client.subscribe(self.subscribe, options=SubscribeOptions(qos=1, noLocal=True))
        for topic in self.extra_subscriptions:
            client.subscribe(topic, options=SubscribeOptions(qos=1, noLocal=True))

    def add_subscription(self, topic: str) -> None:
        """Also subscribe to `topic` (QoS 1), now if connected and again on every reconnection."""
        if topic in self.extra_subscriptions or topic == self.subscribe:
            return
        self.extra_subscriptions.append(topic)
        if self.client.is_connected():  # else _on_connect subscribes it
            self.client.subscribe(topic, options=SubscribeOptions(qos=1, noLocal=True))

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
        self._attempt, self._last_up = 0, time.monotonic()
        self._up = True
        logger.info("MQTT connected to %s", self.where)
        self._call_soon(self._set_up, True)

    def _next_wait(self) -> float:
        cap = self.options.reconnect_max_s
        if time.monotonic() - self._last_up < RECENT_S:
            cap = min(cap, RECENT_CAP_S)
        delay = backoff_delay(self._attempt, base_s=self.options.reconnect_min_s, cap_s=cap, rng=self._rng)
        self._attempt += 1
        # paho's next wait is `min_delay` (reconnect_delay_set resets its doubling); max_delay must be > 0
        self.client.reconnect_delay_set(min_delay=delay, max_delay=max(delay, 1e-3))  # type: ignore[arg-type]
        return delay

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
