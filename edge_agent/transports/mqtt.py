"""Escalation over MQTT v5 request/response (paho-mqtt 2.x), the Open Inference Protocol messages as payloads.

A request is the serialized `ModelInferRequest`, published with QoS 1 on `tierkit/v1/{device}/escalate`
with a Response Topic (`tierkit/v1/{device}/reply`, subscribed with QoS 1) and unique Correlation Data.
The cloud answers on the Response Topic with the serialized `ModelInferResponse` and the same
Correlation Data; an error reply carries the user properties `tierkit.status` (a gRPC status name such
as "NOT_FOUND") and `tierkit.error` (the message). The request also carries its absolute deadline in
the `tierkit.deadline_ms` parameter, since MQTT has none.

How it runs, and why:

- paho's network thread (`loop_start`) does the I/O; its callbacks hand results to the event loop
  with `loop.call_soon_threadsafe`, where futures keyed by correlation data are resolved.
- TCP_NODELAY is set on every new socket (`on_socket_open`): without it a QoS 1 round trip through
  Mosquitto takes ~88 ms instead of ~1.4 ms (Nagle's algorithm against delayed ACKs).
- Persistent session: `clean_start=False` and a Session Expiry Interval, so the reply subscription
  survives reconnects. The client id is the device id, so a broker ACL
  `pattern readwrite tierkit/v1/%c/#` confines a device to its own topics.
- Reconnects use full-jitter exponential backoff: before each wait paho's own (jitter-free) delay is
  set to `uniform(0, min(reconnect_max_s, reconnect_min_s * 2**attempt))` through
  `reconnect_delay_set`, from `on_disconnect` / `on_connect_fail`, which paho calls right before it
  waits. A fleet that loses its broker therefore does not come back in one synchronized storm.
- While disconnected, `escalate` fails at once with `CloudUnavailable` and pending requests fail too:
  paho keeps unacknowledged messages in memory only, so nothing is queued there beyond `max_pending`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import socket
import ssl
import time
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from cloud_service.protocol import inference_pb2, topics
from edge_agent.transports.base import CloudURL, Transport, TransportOptions, escalation_error
from runtimes.errors import CloudTimeout, CloudUnavailable, ConfigError, EscalationError

logger = logging.getLogger(__name__)

STATUS_PROPERTY = "tierkit.status"
ERROR_PROPERTY = "tierkit.error"


def backoff_delay(attempt: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap_s, base_s * 2**attempt)]."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** min(attempt, 62)))


class _ServerNameContext(ssl.SSLContext):
    """An SSL context that verifies `server_name`, when set, instead of the host paho connects to."""

    server_name = ""

    def wrap_socket(self, sock: Any, *args: Any, **kwargs: Any) -> ssl.SSLSocket:  # type: ignore[override]
        if self.server_name:
            kwargs["server_hostname"] = self.server_name
        return super().wrap_socket(sock, *args, **kwargs)


def ssl_context(options: TransportOptions) -> ssl.SSLContext:
    context = _ServerNameContext(ssl.PROTOCOL_TLS_CLIENT)
    context.server_name = options.server_name or ""
    try:
        if options.ca_file:
            context.load_verify_locations(cafile=options.ca_file)
        else:
            context.load_default_certs()
        if options.cert_file and options.key_file:
            context.load_cert_chain(options.cert_file, options.key_file)
    except (OSError, ssl.SSLError) as exc:
        msg = f"cannot load the TLS files {options.ca_file!r} / {options.cert_file!r}: {exc}; check TransportOptions"
        raise ConfigError(msg) from None
    return context


class MqttTransport(Transport):
    """Escalates through an MQTT v5 broker by request/response; also publishes telemetry.

    Args:
        cloud: the parsed `mqtt://` or `mqtts://` URL.
        device_id: this device: the MQTT client id and the `{device}` of its topics.
        boot_id: this boot; sent as the `tierkit.boot_id` parameter.
        options: TLS files, credentials, keepalive, reconnect bounds, session expiry.
        rng: random source of the reconnect jitter (seed it in tests).

    Example:
        >>> async with open_transport("mqtt://broker:1883/digits", device_id="cam-7") as cloud:
        ...     response = await cloud.escalate(request, timeout_s=0.5)
        ...     await cloud.publish(topics.telemetry_topic("cam-7"), b"{...}", qos=1)
    """

    name = "mqtt"

    def __init__(self, cloud: CloudURL, *, device_id: str, boot_id: str | None = None,
                 options: TransportOptions | None = None, rng: random.Random | None = None) -> None:
        if cloud.kind != "mqtt":
            msg = f"MqttTransport needs an mqtt:// or mqtts:// URL, got {cloud.scheme}://"
            raise ConfigError(msg)
        super().__init__(model=cloud.model, device_id=device_id, boot_id=boot_id)
        self.cloud = cloud
        self.options = options or TransportOptions()
        self.host, self.port = cloud.targets[0]
        self.where = f"{cloud.scheme}://{cloud.describe()}"
        self.request_topic = topics.escalate_topic(device_id)
        self.reply_topic = topics.reply_topic(device_id)
        self._rng = rng or random.Random()
        self._attempt = 0
        self._prefix = os.urandom(8)
        self._counter = itertools.count()
        self._pending: dict[bytes, asyncio.Future[inference_pb2.ModelInferResponse]] = {}
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = False
        # asyncio.Event binds to a loop only when first awaited, so creating them here is safe
        self._ready_event = asyncio.Event()
        self._attempted = asyncio.Event()  # set once a connection attempt has ended, either way
        self._subscribe_mid: int | None = None
        self._last_problem = "not connected yet"
        self._closed = False
        self._client = self._make_client()

    def _make_client(self) -> paho.Client:
        options = self.options
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.device_id, protocol=paho.MQTTv5)
        client.connect_timeout = options.connect_timeout_s
        client.max_inflight_messages_set(options.max_pending)
        client.max_queued_messages_set(options.max_pending)
        if options.username is not None:
            client.username_pw_set(options.username, options.password)
        if self.cloud.tls:
            client.tls_set_context(ssl_context(options))
        client.on_socket_open = self._on_socket_open
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_subscribe = self._on_subscribe
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    # --- lifecycle (event loop) ---------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True once connected and subscribed to the reply topic."""
        return self._ready

    def socket(self) -> socket.socket | None:
        """The client's current socket (None while disconnected)."""
        return self._client.socket()  # type: ignore[return-value]

    def _start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.options.session_expiry_s
        self._client.connect_async(self.host, self.port, keepalive=round(self.options.keepalive_s),
                                   clean_start=False, properties=props)
        self._client.loop_start()

    async def wait_connected(self, timeout_s: float, *, first_attempt_only: bool = False) -> bool:
        """Start connecting if needed; True when connected within `timeout_s`.

        With `first_attempt_only`, return as soon as the first connection attempt has failed.
        """
        self._start()
        event = self._attempted if first_attempt_only else self._ready_event
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not self._ready and not (first_attempt_only and event.is_set()):
                    await event.wait()
                    await asyncio.sleep(0)
        return self._ready

    async def __aenter__(self) -> MqttTransport:
        """Connect, waiting up to `connect_timeout_s`; a broker that is down is only logged (retried later)."""
        if not await self.wait_connected(self.options.connect_timeout_s, first_attempt_only=True):
            logger.warning("MQTT broker %s not reachable yet (%s); escalations fail fast until it is",
                           self.where, self._last_problem)
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ready = False
        if self._loop is not None:
            self._client.disconnect()
            # joins the network thread, which may sleep up to 1 s in paho's reconnect wait
            await asyncio.to_thread(self._client.loop_stop)
            # paho closes its wake-up socket pair only in __del__, which a reference cycle through our
            # callbacks delays to a gc pass (ResourceWarning); close it now.
            self._client._reset_sockets(sockpair_only=True)
        self._fail_pending("the transport was closed")

    # --- requests (event loop) ----------------------------------------------------------------------

    def _unavailable(self) -> CloudUnavailable:
        msg = (f"MQTT broker {self.where} is not connected ({self._last_problem}); "
               "the transport reconnects in the background: answer locally and retry later")
        return escalation_error(CloudUnavailable, msg, code="UNAVAILABLE")

    async def escalate(self, request: inference_pb2.ModelInferRequest, *,
                       timeout_s: float) -> inference_pb2.ModelInferResponse:
        if self._closed:
            msg = f"MQTT transport to {self.where} is closed; open a new one"
            raise escalation_error(CloudUnavailable, msg, code="CANCELLED")
        deadline = asyncio.get_running_loop().time() + timeout_s
        if self._loop is None:  # first use without `async with`: connect now, within the deadline
            await self.wait_connected(timeout_s, first_attempt_only=True)
        if not self._ready:
            raise self._unavailable()
        if len(self._pending) >= self.options.max_pending:
            msg = (f"{len(self._pending)} MQTT escalations to {self.where} already await replies "
                   f"(max_pending={self.options.max_pending}); the cloud is not keeping up")
            raise escalation_error(EscalationError, msg, code="RESOURCE_EXHAUSTED")
        correlation = self._prefix + next(self._counter).to_bytes(8, "big")
        deadline_ms = int((time.time() + timeout_s) * 1000)
        payload = self.serialize(request, **{topics.PARAM_DEADLINE_MS: deadline_ms})
        if len(payload) > self.options.max_message_bytes:
            msg = (f"request of {len(payload)} bytes exceeds max_message_bytes={self.options.max_message_bytes} "
                   f"for {self.where}; raise the bound or send a smaller input")
            raise escalation_error(EscalationError, msg, code="RESOURCE_EXHAUSTED")
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = correlation
        future: asyncio.Future[inference_pb2.ModelInferResponse] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = future
        try:
            info = self._client.publish(self.request_topic, payload, qos=1, properties=props)
            if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                self._last_problem = paho.error_string(info.rc)
                raise self._unavailable()
            async with asyncio.timeout_at(deadline):
                return await future
        except TimeoutError:
            msg = (f"MQTT escalation to {self.where} on {self.request_topic} got no reply within {timeout_s:.3f} s; "
                   "check that a cloud replica subscribes to it, or raise the deadline")
            raise escalation_error(CloudTimeout, msg, code="DEADLINE_EXCEEDED") from None
        finally:
            self._pending.pop(correlation, None)

    async def publish(self, topic: str, payload: bytes | str, qos: int = 1, *, retain: bool = False,
                      timeout_s: float = 5.0) -> None:
        """Publish `payload` on `topic` (telemetry, reported state); QoS 1/2 waits for the broker's ack.

        Raises:
            CloudUnavailable: not connected.
            CloudTimeout: no acknowledgement within `timeout_s`.
        """
        if self._closed or not self._ready:
            raise self._unavailable()
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            self._last_problem = paho.error_string(info.rc)
            raise self._unavailable()
        if qos == 0 or info.is_published():
            return
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks[info.mid] = ack
        try:
            async with asyncio.timeout(timeout_s):
                await ack
        except TimeoutError:
            msg = f"MQTT broker {self.where} did not acknowledge a publish on {topic} within {timeout_s:.1f} s"
            raise escalation_error(CloudTimeout, msg, code="DEADLINE_EXCEEDED") from None
        finally:
            self._acks.pop(info.mid, None)

    def _resolve(self, correlation: bytes, payload: bytes, status: str, error: str) -> None:
        future = self._pending.get(correlation)
        if future is None or future.done():
            logger.debug("dropping an MQTT reply that no request awaits (late or from an earlier run)")
            return
        if status and status != "OK":
            msg = f"the cloud behind {self.where} answered {status}: {error or 'no message'}"
            cls = {"UNAVAILABLE": CloudUnavailable, "DEADLINE_EXCEEDED": CloudTimeout}.get(status, EscalationError)
            future.set_exception(escalation_error(cls, msg, code=status))
            return
        try:
            future.set_result(inference_pb2.ModelInferResponse.FromString(payload))
        except Exception as exc:  # protobuf's DecodeError, kept generic across protobuf versions
            msg = f"the cloud behind {self.where} sent a reply that is not a ModelInferResponse: {exc}"
            future.set_exception(escalation_error(EscalationError, msg, code="DATA_LOSS"))

    def _acked(self, mid: int) -> None:
        ack = self._acks.get(mid)
        if ack is not None and not ack.done():
            ack.set_result(None)

    def _set_ready(self, ready: bool) -> None:
        self._attempted.set()
        if ready:
            self._ready_event.set()
        else:
            self._ready_event.clear()
            self._fail_pending(self._last_problem)

    def _fail_pending(self, why: str) -> None:
        msg = f"MQTT connection to {self.where} lost while awaiting the reply ({why})"
        for future in self._pending.values():
            if not future.done():
                future.set_exception(escalation_error(CloudUnavailable, msg, code="UNAVAILABLE"))
        for ack in self._acks.values():
            if not ack.done():
                ack.set_exception(escalation_error(CloudUnavailable, msg, code="UNAVAILABLE"))

    # --- paho callbacks (network thread) ------------------------------------------------------------

    def _call_soon(self, fn: Any, *args: Any) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(fn, *args)

    def _on_socket_open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError) as exc:  # a proxy or websocket wrapper may not expose it
            logger.warning("cannot set TCP_NODELAY on the MQTT socket (%s): replies may take ~40 ms more", exc)

    def _on_connect(self, client: paho.Client, userdata: Any, flags: paho.ConnectFlags, reason: ReasonCode,
                    properties: Properties | None) -> None:
        if reason.is_failure:
            self._last_problem = f"broker refused the connection: {reason}"
            logger.warning("MQTT broker %s refused client %s: %s", self.where, self.device_id, reason)
            self._call_soon(self._set_ready, False)
            return
        _, self._subscribe_mid = client.subscribe(self.reply_topic, options=SubscribeOptions(qos=1, noLocal=True))

    def _on_subscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: list[ReasonCode],
                      properties: Properties | None) -> None:
        if mid != self._subscribe_mid:
            return
        if reasons and reasons[0].is_failure:
            self._last_problem = f"broker refused the subscription to {self.reply_topic}: {reasons[0]}"
            logger.error("MQTT %s; check the broker ACL (pattern readwrite tierkit/v1/%%c/#)", self._last_problem)
            return
        self._attempt = 0
        self._ready = True
        logger.info("MQTT connected to %s as %s", self.where, self.device_id)
        self._call_soon(self._set_ready, True)

    def _schedule_reconnect(self) -> float:
        delay = backoff_delay(self._attempt, base_s=self.options.reconnect_min_s,
                              cap_s=self.options.reconnect_max_s, rng=self._rng)
        self._attempt += 1
        # paho waits `min_delay` next (reconnect_delay_set resets its own doubling), so this is the wait
        self._client.reconnect_delay_set(min_delay=delay, max_delay=max(delay, 1e-3))  # type: ignore[arg-type]
        return delay

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        self._last_problem = f"cannot connect to {self.host}:{self.port}"
        self._call_soon(self._set_ready, False)
        delay = self._schedule_reconnect()
        logger.debug("MQTT connect to %s failed; retrying in %.2f s", self.where, delay)

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode,
                       properties: Properties | None) -> None:
        was_ready, self._ready = self._ready, False
        if not self._closed:
            self._last_problem = f"disconnected: {reason}"
            delay = self._schedule_reconnect()
            if was_ready:
                logger.warning("MQTT connection to %s lost (%s); reconnecting in %.2f s", self.where, reason, delay)
        self._call_soon(self._set_ready, False)

    def _on_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        props = message.properties
        correlation = getattr(props, "CorrelationData", None)
        if message.topic != self.reply_topic or correlation is None:
            logger.debug("ignoring an MQTT message on %s without correlation data", message.topic)
            return
        user = dict(getattr(props, "UserProperty", None) or ())
        self._call_soon(self._resolve, bytes(correlation), message.payload,
                        user.get(STATUS_PROPERTY, ""), user.get(ERROR_PROPERTY, ""))

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int, reason: ReasonCode,
                    properties: Properties) -> None:
        self._call_soon(self._acked, mid)
