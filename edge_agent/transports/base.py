"""The transport interface: send one Open Inference Protocol request to the cloud, get its response.

```
open_transport("grpc://10.0.0.5:8001,10.0.0.6:8001/digits", device_id="cam-7")  -> GrpcTransport
open_transport("mqtts://broker:8883/digits", device_id="cam-7", options=...)      -> MqttTransport
testkit.fake_transport.FakeTransport(handler)                                    (tests only)
```

Every transport raises only the escalation errors of `runtimes.errors`:

```
EscalationError         any other failure; `.code` holds the server's status name ("NOT_FOUND", ...)
  CloudUnavailable      cannot connect, connection lost, or the server said UNAVAILABLE
  CloudTimeout          no answer before the deadline
```
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from types import TracebackType
from typing import Self, TypeVar
from urllib.parse import urlsplit

from cloud_service.protocol import inference_pb2, topics
from cloud_service.protocol.wire import RAW_INPUT_FIELD, RawRequest, Request, join_fields
from runtimes.errors import ConfigError, EscalationError

SCHEMES: dict[str, tuple[str, bool]] = {  # scheme -> (kind, tls)
    "grpc": ("grpc", False), "grpcs": ("grpc", True), "mqtt": ("mqtt", False), "mqtts": ("mqtt", True),
}
DEFAULT_PORTS = {"grpc": 8001, "grpcs": 8001, "mqtt": 1883, "mqtts": 8883}

E = TypeVar("E", bound=EscalationError)


def escalation_error(cls: type[E], msg: str, *, code: str, retry_after_s: float | None = None) -> E:
    """An escalation error carrying the protocol status name as `.code` (aiomqtt `MqttCodeError.rc` style)
    and, for a refusal that said when to retry, the hint as `.retry_after_s` (`edge_agent.pushback`)."""
    err = cls(msg)
    err.code = code  # type: ignore[attr-defined]
    err.retry_after_s = retry_after_s  # type: ignore[attr-defined]
    return err


@dataclass(frozen=True, slots=True)
class CloudURL:
    """A parsed cloud URL: `grpc://HOST:PORT[,HOST:PORT...]/MODEL`, `grpcs://`, `mqtt://`, `mqtts://`.

    Example:
        >>> parse_cloud_url("grpc://127.0.0.1:8001,127.0.0.1:8002/digits").targets
        (('127.0.0.1', 8001), ('127.0.0.1', 8002))
    """

    scheme: str
    targets: tuple[tuple[str, int], ...]
    model: str

    @property
    def kind(self) -> str:
        return SCHEMES[self.scheme][0]

    @property
    def tls(self) -> bool:
        return SCHEMES[self.scheme][1]

    def describe(self) -> str:
        """`HOST:PORT,...` for error messages."""
        return ",".join(_host_port(h, p) for h, p in self.targets)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_target(text: str, scheme: str, url: str) -> tuple[str, int]:
    # urlsplit handles brackets for IPv6 literals and validates the port range
    try:
        parts = urlsplit(f"//{text}")
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        msg = f"cloud URL {url!r}: bad target {text!r} ({exc}); write HOST:PORT"
        raise ConfigError(msg) from None
    if not host:
        msg = f"cloud URL {url!r}: target {text!r} has no host; write HOST:PORT"
        raise ConfigError(msg)
    return host, port or DEFAULT_PORTS[scheme]


def parse_cloud_url(url: str) -> CloudURL:
    """Parse a cloud URL; raises ConfigError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        msg = f"cloud URL {url!r} must start with one of {', '.join(s + '://' for s in SCHEMES)}"
        raise ConfigError(msg)
    netloc, _, model = rest.partition("/")
    model = model.strip("/")
    if not netloc:
        msg = f"cloud URL {url!r} names no host; write {scheme}://HOST:PORT/MODEL"
        raise ConfigError(msg)
    if "/" in model or "?" in model or "#" in model:
        msg = f"cloud URL {url!r}: model {model!r} must be a single name after the host"
        raise ConfigError(msg)
    targets = tuple(_parse_target(t.strip(), scheme, url) for t in netloc.split(","))
    if len(targets) > 1 and SCHEMES[scheme][0] == "mqtt":
        msg = f"cloud URL {url!r}: MQTT takes one broker; balance replicas behind it with a shared subscription"
        raise ConfigError(msg)
    return CloudURL(scheme, targets, model)


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class TransportOptions:
    """Connection settings shared by the transports; each reads the fields that apply to it.

    Args:
        ca_file: PEM CA bundle that signs the server (TLS); None uses the system roots.
        cert_file: client certificate (PEM) for mutual TLS; needs `key_file`.
        key_file: client private key (PEM) for mutual TLS.
        server_name: TLS host name to verify instead of the URL's host (certificates issued for a DNS name).
        username: MQTT user name.
        password: MQTT password.
        keepalive_s: MQTT keepalive; gRPC keepalive ping interval while calls are in flight (>= 10 s).
        connect_timeout_s: TCP + TLS connect timeout of one attempt.
        reconnect_min_s: first reconnect delay cap (full jitter: the delay is uniform in [0, cap]).
        reconnect_max_s: largest reconnect delay cap.
        retry_max_attempts: gRPC attempts of a call that failed with UNAVAILABLE (1 disables retries).
        retry_initial_backoff_s: gRPC retry backoff before the first retry.
        retry_max_backoff_s: gRPC retry backoff cap.
        retry_max_tokens: gRPC retry throttling bucket; retries stop while it is below half.
        retry_token_ratio: tokens a success gives back to the bucket (a failure takes 1).
        max_message_bytes: largest request or response accepted.
        session_expiry_s: how long the broker keeps the MQTT session (subscriptions, queued replies).
        max_pending: MQTT requests awaiting a reply at once; more fail fast with RESOURCE_EXHAUSTED.
        kept_memory_bytes: freed memory malloc keeps for the next large payload instead of unmapping it
            (`cloud_service.protocol.memory.keep_freed_memory`, process-wide); 0 leaves the allocator alone.
        wire_encoding: "fp32" sends requests as built; "fp16", "zstd", "fp16+zstd" re-encode fp32 inputs;
            "auto" picks per escalation from the measured link and the deadline (`edge_agent.encoding`).
            Anything but "fp32" needs a cloud that lists the `tierkit.encodings` extension (tierkit's own).

    Example:
        >>> TransportOptions(ca_file="ca.pem", cert_file="dev.pem", key_file="dev.key", keepalive_s=60)
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None
    username: str | None = None
    password: str | None = None
    keepalive_s: float = 30.0
    connect_timeout_s: float = 5.0
    reconnect_min_s: float = 0.1
    reconnect_max_s: float = 10.0
    retry_max_attempts: int = 3
    retry_initial_backoff_s: float = 0.02
    retry_max_backoff_s: float = 0.5
    retry_max_tokens: float = 10.0
    retry_token_ratio: float = 0.1
    max_message_bytes: int = 64 * 1024 * 1024
    session_expiry_s: int = 3600
    max_pending: int = 256
    kept_memory_bytes: int = 64 << 20
    wire_encoding: str = "fp32"

    def __post_init__(self) -> None:
        positive = {
            "keepalive_s": self.keepalive_s, "connect_timeout_s": self.connect_timeout_s,
            "reconnect_min_s": self.reconnect_min_s, "reconnect_max_s": self.reconnect_max_s,
            "retry_initial_backoff_s": self.retry_initial_backoff_s,
            "retry_max_backoff_s": self.retry_max_backoff_s, "retry_max_tokens": self.retry_max_tokens,
            "retry_token_ratio": self.retry_token_ratio, "max_message_bytes": self.max_message_bytes,
            "max_pending": self.max_pending,
        }
        for name, value in positive.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                msg = f"TransportOptions.{name} must be a positive number, got {value!r}"
                raise ConfigError(msg)
        if self.keepalive_s < 10:
            msg = f"TransportOptions.keepalive_s must be >= 10 s (servers reject faster pings), got {self.keepalive_s}"
            raise ConfigError(msg)
        if self.reconnect_max_s < self.reconnect_min_s:
            msg = (f"TransportOptions.reconnect_max_s ({self.reconnect_max_s}) must be >= "
                   f"reconnect_min_s ({self.reconnect_min_s})")
            raise ConfigError(msg)
        if not 1 <= self.retry_max_attempts <= 5:
            msg = f"TransportOptions.retry_max_attempts must be 1-5 (gRPC caps it at 5), got {self.retry_max_attempts}"
            raise ConfigError(msg)
        if (self.cert_file is None) != (self.key_file is None):
            msg = "TransportOptions: mutual TLS needs both cert_file and key_file; give both or neither"
            raise ConfigError(msg)
        if self.session_expiry_s < 0:
            msg = f"TransportOptions.session_expiry_s must be >= 0, got {self.session_expiry_s}"
            raise ConfigError(msg)


class Transport:
    """Base class of the escalation transports: `async with`, `escalate`, `aclose`.

    `escalate` fills what the request leaves empty: `model_name` (from the URL) and the
    `tierkit.device_id` / `tierkit.boot_id` parameters. It does so by appending protobuf fields to the
    serialized request (a later field wins, map entries merge), never by copying the tensors.

    Example:
        >>> async with open_transport("grpc://127.0.0.1:8001/digits", device_id="cam-7") as cloud:
        ...     response = await cloud.escalate(request, timeout_s=0.2)
    """

    name: str = "transport"

    def __init__(self, *, model: str = "", device_id: str = "", boot_id: str | None = None) -> None:
        if device_id:
            try:
                topics.check_device_id(device_id)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        self.model = model
        self.device_id = device_id
        self.boot_id = boot_id

    async def escalate(self, request: Request, *, timeout_s: float) -> inference_pb2.ModelInferResponse:
        """Send `request`, return the cloud's response within `timeout_s` seconds.

        `request` is a `ModelInferRequest`, or a `RawRequest` whose tensors travel beside the message
        (`cloud_service.protocol.wire`): those are written to the wire with one copy each.

        `timeout_s` is the deadline the transport passes on (gRPC deadline, MQTT message expiry); the
        caller does not rely on it firing on time. The agent ends each call with its own timer by
        cancelling it, so an implementation must accept cancellation at any await: clean up what the
        call left pending (a reply future, a correlation entry) and raise nothing else. A reply that
        arrives after that is dropped; the agent journals the request when asked to keep it.

        Raises:
            CloudTimeout: no response before the deadline.
            CloudUnavailable: the cloud cannot be reached, or it refused.
            EscalationError: any other failure; `.code` names the server's status.
        """
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release connections. Idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def stamp(self, request: Request, **extra: str | int) -> bytes:
        """Serialized fields to append to `request`'s bytes: the missing model name and device ids, and `extra`."""
        if isinstance(request, RawRequest):
            request = request.message
        patch = inference_pb2.ModelInferRequest()
        if not request.model_name and self.model:
            patch.model_name = self.model
        params: dict[str, str | int] = {}
        if self.device_id and topics.PARAM_DEVICE not in request.parameters:
            params[topics.PARAM_DEVICE] = self.device_id
        if self.boot_id and topics.PARAM_BOOT not in request.parameters:
            params[topics.PARAM_BOOT] = self.boot_id
        params.update(extra)
        for key, value in params.items():
            if isinstance(value, int):
                patch.parameters[key].int64_param = value
            else:
                patch.parameters[key].string_param = value
        return bytes(patch.SerializeToString())

    def serialize(self, request: Request, **extra: str | int) -> bytes:
        """`request`'s bytes as if `stamp` were appended, built with one copy of the tensors.

        `request.SerializeToString() + stamp` copied the whole payload a second time (0.1-0.5 ms for a
        600 KB image); instead the stamp's fields are set on `request` for the one serialization and
        taken off again, so the caller's message is left as it was. A `RawRequest`'s message (no
        tensors in it) is stamped so, and its tensors joined after it: the bytes protobuf would write.
        """
        if isinstance(request, RawRequest):
            return join_fields(self.serialize(request.message, **extra), RAW_INPUT_FIELD, request.raw)
        patch = inference_pb2.ModelInferRequest.FromString(self.stamp(request, **extra))
        params = request.parameters
        saved = {key: params[key].SerializeToString() for key in patch.parameters if key in params}
        set_model = bool(patch.model_name)
        if set_model:
            request.model_name = patch.model_name
        for key, value in patch.parameters.items():
            params[key].CopyFrom(value)
        try:
            return bytes(request.SerializeToString())
        finally:
            if set_model:
                request.model_name = ""
            for key in patch.parameters:
                if key in saved:
                    params[key].ParseFromString(saved[key])
                else:
                    del params[key]


def open_transport(url: str, *, device_id: str, boot_id: str | None = None,
                   options: TransportOptions | None = None) -> Transport:
    """The transport for a cloud URL; `transport.model` is the URL's MODEL part.

    Nothing connects here: gRPC connects on the first call, MQTT when entered or on the first call.

    Raises:
        ConfigError: bad URL, device id or options.
    """
    cloud = parse_cloud_url(url)
    if not device_id:
        msg = "open_transport needs a device_id (the MQTT client id and the tierkit.device_id parameter)"
        raise ConfigError(msg)
    options = options or TransportOptions()
    if cloud.kind == "grpc":
        from edge_agent.transports.grpc import GrpcTransport

        return GrpcTransport(cloud, device_id=device_id, boot_id=boot_id, options=options)
    from edge_agent.transports.mqtt import MqttTransport

    return MqttTransport(cloud, device_id=device_id, boot_id=boot_id, options=options)
