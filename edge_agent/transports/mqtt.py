"""Escalation over MQTT v5 request/response (paho-mqtt 2.x), the Open Inference Protocol messages as payloads.

A request is the serialized `ModelInferRequest`, published with QoS 1 on `tierkit/v1/{device}/escalate`
with the Response Topic `tierkit/v1/{device}/reply` (subscribed with QoS 1) and unique Correlation Data.
The cloud answers there with the serialized `ModelInferResponse` and the same Correlation Data; an error
reply carries the user properties `tierkit.status` (a gRPC status name such as "NOT_FOUND") and
`tierkit.error` (the message). MQTT has no deadlines, so the request carries its absolute deadline in
the `tierkit.deadline_ms` parameter and the cloud drops it once past.

The client id is the device id. The broker confines a device to its own topics by a role of its own
(Mosquitto's dynamic-security plugin, as `deploy/` ships it: publish `escalate`, `telemetry`, `reported`;
subscribe to `reply` and `desired`), under its username: the device id for a password login, the
certificate's subject `CN=<device id>` for a certificate login. Connection handling (TCP_NODELAY,
persistent session, jittered reconnects) is in `mqtt_session`. While disconnected, `escalate` fails at
once with `CloudUnavailable`, and requests awaiting replies fail too, rather than piling up in paho's
memory.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import socket
import time

from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud_service.protocol import inference_pb2, topics
from cloud_service.protocol.memory import keep_freed_memory
from cloud_service.protocol.wire import Request, as_message
from edge_agent.encoding import WireEncoder
from edge_agent.transports.base import CloudURL, Transport, TransportOptions, escalation_error
from edge_agent.transports.mqtt_session import MessageHandler, MqttSession, backoff_delay
from runtimes.errors import CloudTimeout, CloudUnavailable, ConfigError, EscalationError

logger = logging.getLogger(__name__)

__all__ = ["ERROR_PROPERTY", "STATUS_PROPERTY", "MqttTransport", "backoff_delay"]

STATUS_PROPERTY = topics.STATUS_PROPERTY  # error replies: a gRPC status name ...
ERROR_PROPERTY = topics.ERROR_PROPERTY  # ... and the message, as MQTT v5 user properties
_STATUS_ERRORS: dict[str, type[EscalationError]] = {"UNAVAILABLE": CloudUnavailable, "DEADLINE_EXCEEDED": CloudTimeout}


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
        self.where = f"{cloud.scheme}://{cloud.describe()}"
        keep_freed_memory(self.options.kept_memory_bytes)  # large payloads: no page faults per copy
        self.encoder = WireEncoder(self.options.wire_encoding) if self.options.wire_encoding != "fp32" else None
        self.request_topic = topics.escalate_topic(device_id)
        self.reply_topic = topics.reply_topic(device_id)
        self._prefix = os.urandom(8)  # correlation data: unique across restarts of the same device
        self._counter = itertools.count()
        self._pending: dict[bytes, asyncio.Future[inference_pb2.ModelInferResponse]] = {}
        self._listeners: dict[str, MessageHandler] = {}
        self._closed = False
        host, port = cloud.targets[0]
        self.session = MqttSession(host, port, client_id=device_id, subscribe=self.reply_topic, tls=cloud.tls,
                                   options=self.options, on_message=self._on_reply, on_down=self._fail_pending,
                                   rng=rng)

    @property
    def connected(self) -> bool:
        """True while connected and subscribed to the reply topic."""
        return self.session.up

    def socket(self) -> socket.socket | None:
        """The client's current socket (None while disconnected)."""
        return self.session.socket()

    async def wait_connected(self, timeout_s: float) -> bool:
        """Start connecting if needed; True when connected within `timeout_s`."""
        return await self.session.wait_up(timeout_s)

    async def __aenter__(self) -> MqttTransport:
        """Connect, waiting up to `connect_timeout_s`; a broker that is down is only logged (retried later)."""
        if not await self.session.wait_up(self.options.connect_timeout_s, first_attempt_only=True):
            logger.warning("MQTT broker %s not reachable yet (%s); escalations fail fast until it is",
                           self.where, self.session.problem)
        return self

    async def aclose(self) -> None:
        self._closed = True
        await self.session.close()

    def _unavailable(self) -> CloudUnavailable:
        msg = (f"MQTT broker {self.where} is not connected ({self.session.problem}); "
               "the transport reconnects in the background: answer locally and retry later")
        return escalation_error(CloudUnavailable, msg, code="UNAVAILABLE")

    async def escalate(self, request: Request, *, timeout_s: float) -> inference_pb2.ModelInferResponse:
        if self._closed:
            msg = f"MQTT transport to {self.where} is closed; open a new one"
            raise escalation_error(CloudUnavailable, msg, code="CANCELLED")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # first use without `async with`: connect now, inside the deadline; later, never wait for the broker
        if not self.session.up and not await self.session.wait_up(timeout_s, first_attempt_only=True):
            raise self._unavailable()
        if len(self._pending) >= self.options.max_pending:
            msg = (f"{len(self._pending)} MQTT escalations to {self.where} already await replies "
                   f"(max_pending={self.options.max_pending}); the cloud is not keeping up")
            raise escalation_error(EscalationError, msg, code="RESOURCE_EXHAUSTED")
        if self.encoder is not None:
            request = self.encoder.prepare(as_message(request), timeout_s)
        now = time.time()
        payload = self.serialize(request, **{topics.PARAM_DEADLINE_MS: int((now + timeout_s) * 1000),
                                             topics.PARAM_SENT_MS: int(now * 1000)})
        if len(payload) > self.options.max_message_bytes:
            msg = (f"request of {len(payload)} bytes exceeds max_message_bytes={self.options.max_message_bytes} "
                   f"for {self.where}; raise the bound or send a smaller input")
            raise escalation_error(EscalationError, msg, code="RESOURCE_EXHAUSTED")
        correlation = self._prefix + next(self._counter).to_bytes(8, "big")
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = self.reply_topic
        props.CorrelationData = correlation
        future: asyncio.Future[inference_pb2.ModelInferResponse] = loop.create_future()
        self._pending[correlation] = future
        try:
            info = self.session.publish(self.request_topic, payload, qos=1, properties=props)
            if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                raise self._unavailable()
            started = time.perf_counter()
            async with asyncio.timeout_at(deadline):
                response = await future
            if loop.time() > deadline:  # the reply came, but this loop resumed past the deadline: too late to use
                raise TimeoutError
            if self.encoder is not None:
                self.encoder.observe(len(payload) + response.ByteSize(), time.perf_counter() - started)
            return response
        except TimeoutError:
            if self.encoder is not None:
                self.encoder.observe_timeout(len(payload), timeout_s)
            msg = (f"MQTT escalation to {self.where} on {self.request_topic} got no reply within {timeout_s:.3f} s; "
                   "check that a cloud replica subscribes to it, or raise the deadline")
            raise escalation_error(CloudTimeout, msg, code="DEADLINE_EXCEEDED") from None
        finally:
            self._pending.pop(correlation, None)

    async def publish(self, topic: str, payload: bytes | str, qos: int = 1, *, retain: bool = False,
                      timeout_s: float = 5.0) -> None:
        """Publish `payload` on `topic` (telemetry, reported state); QoS 1/2 waits for the broker's ack.

        Raises:
            CloudUnavailable: not connected, or the connection dropped before the ack.
            CloudTimeout: no acknowledgement within `timeout_s`.
        """
        if self._closed or not self.session.up:
            raise self._unavailable()
        info = self.session.publish(topic, payload, qos=qos, retain=retain)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise self._unavailable()
        if qos == 0:
            return
        try:
            await self.session.acknowledged(info, timeout_s)
        except TimeoutError:
            msg = f"MQTT broker {self.where} did not acknowledge a publish on {topic} within {timeout_s:.1f} s"
            raise escalation_error(CloudTimeout, msg, code="DEADLINE_EXCEEDED") from None
        except ConnectionError as exc:
            msg = f"MQTT connection to {self.where} dropped before the publish on {topic} was acknowledged ({exc})"
            raise escalation_error(CloudUnavailable, msg, code="UNAVAILABLE") from None

    def listen(self, topic: str, handler: MessageHandler) -> None:
        """Deliver messages on `topic` (e.g. the device's retained `desired` config) to `handler` on the loop.

        The subscription shares this transport's session and login, so the device's one broker role covers
        escalations, telemetry and configuration.
        """
        self._listeners[topic] = handler
        self.session.add_subscription(topic)

    def _on_reply(self, topic: str, payload: bytes, props: Properties | None) -> None:
        listener = self._listeners.get(topic)
        if listener is not None:
            listener(topic, payload, props)
            return
        correlation = getattr(props, "CorrelationData", None)
        future = self._pending.get(bytes(correlation)) if topic == self.reply_topic and correlation else None
        if future is None or future.done():
            logger.debug("dropping an MQTT message on %s that no request awaits (late, or from an earlier run)", topic)
            return
        user = dict(getattr(props, "UserProperty", None) or ())
        status = user.get(STATUS_PROPERTY, "")
        if status and status != "OK":
            msg = f"the cloud behind {self.where} answered {status}: {user.get(ERROR_PROPERTY) or 'no message'}"
            hint = user.get(topics.RETRY_AFTER_PROPERTY, "")
            retry_after_s = int(hint) / 1000 if hint.isdigit() else None
            future.set_exception(escalation_error(_STATUS_ERRORS.get(status, EscalationError), msg, code=status,
                                                  retry_after_s=retry_after_s))
            return
        try:
            future.set_result(inference_pb2.ModelInferResponse.FromString(payload))
        except Exception as exc:  # protobuf's DecodeError; its module path differs between protobuf versions
            msg = f"the cloud behind {self.where} sent a reply that is not a ModelInferResponse: {exc}"
            future.set_exception(escalation_error(EscalationError, msg, code="DATA_LOSS"))

    def _fail_pending(self, why: str) -> None:
        msg = f"MQTT connection to {self.where} lost while awaiting the reply ({why}); answer locally"
        for future in self._pending.values():
            if not future.done():
                future.set_exception(escalation_error(CloudUnavailable, msg, code="UNAVAILABLE"))
