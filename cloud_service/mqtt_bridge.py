"""MQTT v5 request/response onto the same batcher as gRPC (paho-mqtt 2.x).

- Subscribes through the shared subscription `$share/{group}/tierkit/v1/+/escalate` at QoS 1, so
  replicas in one group share escalations.
- A payload is a serialized `ModelInferRequest`; the reply, a `ModelInferResponse`, goes to the
  request's Response Topic with its Correlation Data, at QoS 1 (a refusal on arrival at QoS 0, see
  below). An error reply carries the user properties `tierkit.status` (gRPC status name) and
  `tierkit.error` (message). The Response Topic must lie in the sender's own `tierkit/v1/{device}/`
  subtree, so a device cannot make the service publish into another device's topics.
- Escalations are acknowledged (PUBACK) only after their reply is published: a replica that dies
  mid-request leaves the message unacknowledged in its broker session. Every message taken is
  acknowledged, whatever it holds: a Response Topic that is invalid (wildcards, another device's
  subtree, too long) gets no reply and is counted; a reply paho cannot send is counted.
- One device cannot fill the replica's in-flight window (`receive_maximum`) for all: past
  `device_max_inflight` escalations being answered, or `device_rate_per_s`, its escalations are
  answered RESOURCE_EXHAUSTED at once (`tierkit_refusals_total{surface="mqtt"}` counts them).
- Deadlines: the earlier of the request's `tierkit.deadline_ms` parameter and its MQTT Message Expiry
  Interval. Admission happens on arrival, in paho's network thread, before the request is decoded
  (`cloud_service.arrival`): what the model's queue cannot answer by then is refused at once
  (RESOURCE_EXHAUSTED, with the retry hint as the user property `tierkit.retry_after_ms`), replied to
  and acknowledged from that thread; at most `MqttConfig.max_waiting` escalations wait for the event
  loop, the next is refused. The batcher admits again when the request is queued. Escalations the broker
  holds beyond `receive_maximum` wait in the broker, unseen: their deadline is checked when they arrive.
- Duplicates (same device, boot id and sequence number) are answered from the service's duplicate
  cache (`cloud_service.duplicates`, shared with the gRPC servicer), or join the computation already
  running, instead of being computed again.
- paho's network thread hands every message it admits to the event loop with `call_soon_threadsafe`.
  What it refuses it writes at once (`_refuse`), not after paho's loop has read the escalations behind it,
  and cheaply: a QoS 0 reply encoded to bytes with the escalation's PUBACK behind it, one write on paho's
  connection (`cloud_service.mqtt_packets`), since that one thread also reads every escalation.
- The connection (TCP_NODELAY on every socket, the persistent session, the jittered reconnect, the
  shutdown that closes paho's sockets) is the one MQTT client layer's, `cloud_service.mqtt_client`.
- `clean_start=False` with a configurable Session Expiry Interval (default 0: see
  `MqttConfig.session_expiry_s` for why). `stop()` unsubscribes, answers what it holds, and
  disconnects with a Session Expiry of 0, so the broker queues nothing for a replica that left on
  purpose.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as paho
from google.protobuf.message import DecodeError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud_service import mqtt_client, mqtt_packets
from cloud_service.arrival import ArrivalGate
from cloud_service.config import MqttConfig
from cloud_service.device_limits import DeviceLimited, DeviceLimits
from cloud_service.duplicates import DuplicateCache, request_key
from cloud_service.errors import MessageTooLarge, ServerBusy
from cloud_service.infer import clip, infer, model_label, status_of
from cloud_service.metrics import UNKNOWN_MODEL, Metrics
from cloud_service.mqtt_client import Reconnect
from cloud_service.protocol import CodecError, get_parameters, set_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.repository import ModelRepository
from runtimes.errors import BackendUnavailable

if TYPE_CHECKING:
    from cloud_service.forward import ForwardBackend

log = logging.getLogger(__name__)
_CONNECT_TIMEOUT_S = mqtt_client.CONNECT_TIMEOUT_S
_QUIET_S = 0.1
_MAX_TOPIC_BYTES = 1024
_MAX_CORRELATION = 1024
_TOPIC_FORBIDDEN = set("+#\x00")


def _expiry(message: paho.MQTTMessage) -> float | None:
    """Seconds left of the message's Message Expiry Interval (the broker sends what remains), if set."""
    left = getattr(message.properties, "MessageExpiryInterval", None)
    return float(left) if isinstance(left, int) and left > 0 else None


def _past_due(message: paho.MQTTMessage, request: pb.ModelInferRequest, arrived: float) -> bool:
    """Whether the escalation's deadline has passed: its `tierkit.deadline_ms` (epoch ms) or its message's
    expiry counted from `arrived` (`time.perf_counter()` on paho's thread)."""
    expiry = _expiry(message)
    if expiry is not None and time.perf_counter() > arrived + expiry:
        return True
    due = get_parameters(request.parameters).get(topics.PARAM_DEADLINE_MS)
    return isinstance(due, int) and time.time() * 1000 > due


class MqttBridge:
    """Answers escalations arriving over MQTT v5 with the server's models.

    Args:
        config: broker URL, group, session, credentials, TLS, duplicate cache.
        repository: the served models.
        metrics: where requests are counted.
        max_message_bytes: largest payload accepted.
        backend: answers requests instead of the local models (`cloud_service.forward`), if given.
        duplicates: the duplicate cache shared with the gRPC servicer (default: one of its own, sized by `config`).
    """

    def __init__(self, config: MqttConfig, repository: ModelRepository, metrics: Metrics, *,
                 max_message_bytes: int, backend: ForwardBackend | None = None,
                 duplicates: DuplicateCache | None = None) -> None:
        self.config = config
        self.backend = backend
        self.repository = repository
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.subscription = topics.shared_escalate_subscription(config.group)
        self._cache = duplicates or DuplicateCache(config.dedupe_ttl_s, config.dedupe_max_entries)
        self._limits = DeviceLimits(config.device_max_inflight, config.device_rate_per_s)
        self._running: dict[tuple[str, str, int], asyncio.Task[pb.ModelInferResponse]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribed: asyncio.Future[None] | None = None
        self._unsubscribed: asyncio.Event | None = None
        self._reconnect = Reconnect()  # up once the subscription is granted (paho's thread)
        self._gate = ArrivalGate(repository, max_waiting=config.max_waiting, is_duplicate=self._duplicate,
                                 forwarding=backend is not None, max_bytes=max_message_bytes,
                                 on_refused=self._refused_on_arrival)
        self._client = self._make_client()

    def _make_client(self) -> paho.Client:
        cfg = self.config
        client = mqtt_client.new_client(cfg.client_id, username=cfg.username, password=cfg.password,
                                        tls=(cfg.tls.context() if cfg.tls else None) if cfg.endpoint[2] else None,
                                        manual_ack=True)
        client.on_connect = self._on_connect
        client.on_subscribe = self._on_subscribe
        client.on_unsubscribe = self._on_unsubscribe
        client.on_disconnect = self._on_disconnect
        client.on_connect_fail = self._on_connect_fail
        client.on_message = self._on_message
        self._next_wait(client)
        return client

    async def start(self) -> None:
        """Connect, subscribe, and return once the broker granted the subscription."""
        self._loop = asyncio.get_running_loop()
        self._subscribed = self._loop.create_future()
        host, port, _ = self.config.endpoint
        mqtt_client.start(self._client, host, port, keepalive_s=self.config.keepalive_s,
                          session_expiry_s=self.config.session_expiry_s, receive_maximum=self.config.receive_maximum)
        try:
            await asyncio.wait_for(asyncio.shield(self._subscribed), _CONNECT_TIMEOUT_S)
        except TimeoutError:
            await asyncio.to_thread(mqtt_client.shutdown, self._client)
            msg = f"MQTT broker {self.config.url} did not accept a connection within {_CONNECT_TIMEOUT_S:.0f} s"
            raise BackendUnavailable(msg) from None
        except BaseException:
            await asyncio.to_thread(mqtt_client.shutdown, self._client)
            raise

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Unsubscribe, answer the escalations already received, then leave and end the session."""
        assert self._loop is not None
        self._unsubscribed = asyncio.Event()
        if self._client.is_connected():
            self._client.unsubscribe(self.subscription)
            try:
                await asyncio.wait_for(self._unsubscribed.wait(), 5.0)
            except TimeoutError:
                log.warning("the MQTT broker did not confirm the unsubscribe")
        # Escalations the broker sent before it processed the unsubscribe may still be arriving:
        # drain until the bridge has been idle for a moment, or the drain timeout.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while loop.time() < deadline:
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=max(0.0, deadline - loop.time()))
            await asyncio.sleep(_QUIET_S)
            if not self._tasks:
                break
        # leave with a Session Expiry of 0 (nothing queued for a replica that left on purpose); close paho's sockets
        await asyncio.to_thread(mqtt_client.shutdown, self._client, end_session=True)

    # -- paho's thread ------------------------------------------------------------------------

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            self._call(self._fail_start, f"MQTT broker {self.config.url} refused the connection: {reason}")
            return
        log.info("connected to %s as %s (session present: %s)", self.config.url, self.config.client_id,
                 flags.session_present)
        mqtt_client.subscribe_all(client, [self.subscription])  # on every (re)connection

    def _on_subscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: list[Any], properties: Any) -> None:
        if reasons and reasons[0].is_failure:
            self._call(self._fail_start, f"MQTT broker {self.config.url} refused the subscription "
                                         f"{self.subscription!r}: {reasons[0]} (check its ACL; the roles of "
                                         "tierkit broker init allow one group: --cloud-group for --mqtt-group)")
        else:
            self._reconnect.up()
            self._call(self._subscribed_ok)

    def _on_unsubscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: list[Any],
                        properties: Any) -> None:
        if self._unsubscribed is not None:
            self._call(self._unsubscribed.set)

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        delay = self._next_wait(client)
        if reason.is_failure:
            log.warning("MQTT connection to %s lost (%s); reconnecting in %.2f s", self.config.url, reason, delay)

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        self._next_wait(client)

    def _next_wait(self, client: paho.Client) -> float:
        """Set paho's next reconnect wait (`mqtt_client.Reconnect`)."""
        return self._reconnect.next_wait(client)

    def _on_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        started = time.perf_counter()
        request, refusal = self._gate.arrive(message)
        if refusal is None:
            self._call(self._dispatch, message, request, started)
            return
        try:  # refused on arrival: answered and acknowledged here, the event loop never sees it
            self._refuse(client, message, request, refusal, started)
        except Exception:
            log.exception("MQTT escalation on %s: the refusal failed", clip(message.topic, 200))
            self._ack(message)

    def _refuse(self, client: paho.Client, message: paho.MQTTMessage, request: pb.ModelInferRequest | None,
                refusal: Exception, started: float) -> None:
        """On paho's thread: count the refusal, and write it (QoS 0) with the escalation's PUBACK at once.

        paho's loop writes only after it has read what the socket holds, up to one packet per message
        it has in flight: under load, tens of ~400 KB escalations. A refusal published from `on_message`
        would wait behind all of them; written here, it leaves at once, encoded without paho's
        per-message machinery (`mqtt_packets`).
        """
        payload, user = self._outcome(request, refusal, started, self._label(request))
        reply_to = self._reply_topic(message)
        packet = b""
        if reply_to is not None:
            packet = mqtt_packets.publish_qos0(reply_to, payload, correlation=self._correlation(message),
                                                 user=user or ())
        if message.qos == 1:
            packet += mqtt_packets.puback(message.mid)
        if packet and not mqtt_packets.write(client, packet):
            log.debug("MQTT refusal on %s not sent: no connection (the broker redelivers)", clip(message.topic, 200))
        if message.qos == 2:
            self._ack(message)

    def _duplicate(self, request: pb.ModelInferRequest, topic: str) -> bool:
        """Whether `request` repeats an escalation being answered or cached (any thread: two lookups)."""
        if topics.PARAM_SEQ not in request.parameters:
            return False
        try:
            device = topics.device_from_topic(topic)
        except ValueError:
            device = ""
        key = request_key(get_parameters(request.parameters), device)
        return key is not None and (key in self._running or self._cache.get(key) is not None)

    def _refused_on_arrival(self, model: str, reason: str) -> None:
        label = self.backend.label(model) if self.backend is not None else model_label(self.repository, model)
        if reason == "expired":
            self.metrics.expired.labels(label).inc()
        else:
            self.metrics.admission_refused.labels(label, reason).inc()

    def _call(self, fn: Any, *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # -- the event loop -----------------------------------------------------------------------

    def _fail_start(self, msg: str) -> None:
        log.error("%s", msg)
        if self._subscribed is not None and not self._subscribed.done():
            self._subscribed.set_exception(BackendUnavailable(msg))

    def _subscribed_ok(self) -> None:
        if self._subscribed is not None and not self._subscribed.done():
            self._subscribed.set_result(None)

    def _dispatch(self, message: paho.MQTTMessage, request: pb.ModelInferRequest | None, arrived: float) -> None:
        assert self._loop is not None
        self._gate.taken(request)
        task = self._loop.create_task(self._handle(message, request, arrived))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, message: paho.MQTTMessage, request: pb.ModelInferRequest | None = None,
                      arrived: float | None = None) -> None:
        try:
            await self._reply(message, request, arrived)
        except Exception:  # a defect here must not cost the acknowledgement
            log.exception("MQTT escalation on %s: the reply failed", clip(message.topic, 200))
        finally:
            # Acknowledge only now, and always: the broker redelivers an escalation whose replica died
            # before replying, and stops delivering anything once `receive_maximum` messages are unacked.
            self._ack(message)

    def _ack(self, message: paho.MQTTMessage) -> None:
        try:
            self._client.ack(message.mid, message.qos)
        except Exception:  # paho raises while a connection is torn down; the broker redelivers
            log.warning("could not acknowledge MQTT message %s", message.mid)

    async def _reply(self, message: paho.MQTTMessage, parsed: pb.ModelInferRequest | None = None,
                     arrived: float | None = None) -> None:
        started = time.perf_counter() if arrived is None else arrived  # latency counts from paho's thread
        asked = bool(getattr(message.properties, "ResponseTopic", None))
        request: pb.ModelInferRequest | None = None
        label = UNKNOWN_MODEL
        try:
            try:
                device = topics.device_from_topic(message.topic)
            except ValueError:
                device = ""
            if asked and self._reply_topic(message, count=False) is None:
                msg = "the request's response topic is invalid; no reply can be sent"
                raise CodecError(msg)
            self._limits.admit(device)
            try:
                request = parsed if parsed is not None else self._parse(message.payload)
                label = self._label(request)  # before answering: what forwarding learns counts from the next
                response = await self._answer(device, request, _expiry(message))
            finally:
                self._limits.release(device)
        except Exception as exc:
            self._send(message, request, exc, started, label)
            return
        if _past_due(message, request, started):  # no reply after the deadline: the caller has given up on it
            self.metrics.answer_dropped(label, "mqtt")
            self.metrics.request_done(label, "mqtt", time.perf_counter() - started, code="DEADLINE_EXCEEDED")
            return
        self._send(message, request, response, started, label)

    def _label(self, request: pb.ModelInferRequest | None) -> str:
        if request is None:
            return UNKNOWN_MODEL
        if self.backend is not None:
            return self.backend.label(request.model_name)
        return model_label(self.repository, request.model_name)

    def _outcome(self, request: pb.ModelInferRequest | None, outcome: pb.ModelInferResponse | Exception,
                 started: float, label: str) -> tuple[bytes, list[tuple[str, str]] | None]:
        """Count the escalation; its reply's payload, and for an error the user properties it carries."""
        code = None
        user = None
        if isinstance(outcome, Exception):
            exc = outcome
            code, text = status_of(exc)
            if isinstance(exc, DeviceLimited):
                self.metrics.refused("mqtt", exc.reason)
            elif isinstance(exc, ServerBusy) and self.backend is not None:  # refused before forwarding
                self.metrics.refused("forward", "busy")
            response = pb.ModelInferResponse(model_name=clip(request.model_name, 256) if request else "",
                                             id=clip(request.id, 256) if request else "")
            user = [(topics.STATUS_PROPERTY, code), (topics.ERROR_PROPERTY, text)]
            retry_after = getattr(exc, "retry_after_ms", None)
            if isinstance(retry_after, int):
                user.append((topics.RETRY_AFTER_PROPERTY, str(retry_after)))
            set_parameters(response.parameters, dict(user))
            log.debug("MQTT escalation failed: %s %s", code, text)
        else:
            response = outcome
        shed = isinstance(outcome, Exception) and getattr(outcome, "queued_s", 0.0) > 0
        self.metrics.request_done(label, "mqtt", time.perf_counter() - started, code=code, shed=shed)
        return response.SerializeToString(), user

    @staticmethod
    def _correlation(message: paho.MQTTMessage) -> bytes | None:
        correlation = getattr(message.properties, "CorrelationData", None)
        if isinstance(correlation, bytes | bytearray) and len(correlation) <= _MAX_CORRELATION:
            return bytes(correlation)
        return None

    def _send(self, message: paho.MQTTMessage, request: pb.ModelInferRequest | None,
              outcome: pb.ModelInferResponse | Exception, started: float, label: str | None = None) -> None:
        """Count the escalation and publish its reply (or error) to its Response Topic (QoS 1); any thread."""
        payload, user = self._outcome(request, outcome, started, self._label(request) if label is None else label)
        reply_to = self._reply_topic(message)
        if reply_to is None:
            return
        out = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        correlation = self._correlation(message)
        if correlation is not None:
            out.CorrelationData = correlation
        if user is not None:
            out.UserProperty = user
        try:
            self._client.publish(reply_to, payload, qos=1, properties=out)
        except Exception as exc:  # paho refuses what the broker would: count it, answer the rest
            self.metrics.refused("mqtt", "reply_unsendable")
            log.warning("MQTT reply to %s could not be sent: %s", clip(reply_to, 200), clip(str(exc), 200))

    def _reply_topic(self, message: paho.MQTTMessage, *, count: bool = True) -> str | None:
        """The request's Response Topic when it is one this service may publish to; else None (counted
        unless `count` is False).

        It must lie in the sender's own `tierkit/v1/{device}/` subtree (so a device cannot make the
        service publish into another device's topics) and be a valid topic name: Mosquitto 2.0
        forwards a Response Topic holding wildcards, which MQTT v5 forbids and paho refuses.
        """
        reply_to = getattr(message.properties, "ResponseTopic", None)
        if not reply_to:
            return None
        try:
            device = topics.device_from_topic(message.topic)
        except ValueError:
            if count:
                self.metrics.refused("mqtt", "bad_request_topic")
            return None
        if (not isinstance(reply_to, str) or len(reply_to.encode()) > _MAX_TOPIC_BYTES
                or not reply_to.startswith(f"{topics.ROOT}/{device}/") or _TOPIC_FORBIDDEN & set(reply_to)):
            if count:
                self.metrics.refused("mqtt", "bad_reply_topic")
            log.debug("MQTT escalation on %s: response topic %s refused", clip(message.topic, 200),
                      clip(repr(reply_to), 200))
            return None
        return reply_to

    def _parse(self, payload: bytes | bytearray) -> pb.ModelInferRequest:
        if len(payload) > self.max_message_bytes:
            msg = f"payload of {len(payload)} bytes exceeds this server's limit of {self.max_message_bytes} bytes"
            raise MessageTooLarge(msg)
        try:
            request: pb.ModelInferRequest = pb.ModelInferRequest.FromString(payload)
        except DecodeError as exc:
            self.metrics.mqtt_garbage.inc()
            msg = f"payload is not a serialized ModelInferRequest ({exc})"
            raise CodecError(msg) from None
        if not request.model_name:
            self.metrics.mqtt_garbage.inc()
            msg = "payload is not a serialized ModelInferRequest (no model_name)"
            raise CodecError(msg)
        return request

    async def _answer(self, device: str, request: pb.ModelInferRequest,
                      expiry_s: float | None = None) -> pb.ModelInferResponse:
        """The answer; by the earlier of the request's deadline parameter and its message's expiry."""
        params = get_parameters(request.parameters)
        loop = asyncio.get_running_loop()
        deadline = None if expiry_s is None else loop.time() + expiry_s
        if isinstance(params.get(topics.PARAM_DEADLINE_MS), int):
            due = loop.time() + int(params[topics.PARAM_DEADLINE_MS]) / 1000 - time.time()
            deadline = due if deadline is None else min(deadline, due)
        if deadline is not None:  # the answer's way back through the broker (`arrival`)
            deadline -= self._gate.reply_margin_s
        key = request_key(params, device)
        if key is None:
            return await self._infer(request, deadline)
        cached = self._cache.message(key)
        if cached is not None:
            self.metrics.mqtt_duplicates.inc()
            return cached
        running = self._running.get(key)
        if running is not None:  # the same escalation, delivered twice while the first is computing
            self.metrics.mqtt_duplicates.inc()
            return await asyncio.shield(running)
        task = asyncio.get_running_loop().create_task(self._infer(request, deadline))
        self._running[key] = task
        try:
            response = await asyncio.shield(task)
        finally:
            self._running.pop(key, None)
        self._cache.put(key, response)
        return response

    async def _infer(self, request: pb.ModelInferRequest, deadline: float | None) -> pb.ModelInferResponse:
        if self.backend is not None:
            return await self.backend.infer(request, deadline=deadline)
        return await infer(self.repository, request, deadline=deadline)
