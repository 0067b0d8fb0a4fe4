"""Escalation over gRPC: `inference.GRPCInferenceService/ModelInfer` (Open Inference Protocol) with grpc.aio.

Channel settings, and why:

- One channel per transport, created on the first call inside the running event loop (grpc.aio binds a
  channel to its loop) and kept: connection setup is paid once.
- Every call carries a deadline (`timeout=timeout_s`), so a cloud that accepts connections and then
  hangs costs at most the deadline.
- Retries of UNAVAILABLE come from the service config (`retryPolicy`) under a throttling budget
  (`retryThrottling`): when many calls fail, retries stop instead of multiplying the load on a
  struggling cloud. The retries stay inside the call's deadline.
- Several targets become one `ipv4:`/`ipv6:` target list balanced by `round_robin`; one DNS name is
  balanced over all its addresses (a Kubernetes headless service).
- Keepalive: a default gRPC server (no keepalive options) answers pings sent more often than every
  5 minutes while it is not sending data with a "ping strike", and after 2 strikes sends GOAWAY
  "too_many_pings"; with no calls in flight it tolerates none at all. So the channel pings only while
  calls are in flight (`keepalive_permit_without_calls=0`), at most every `keepalive_s` (>= 10 s), and
  at most 2 pings without data (`http2.max_pings_without_data=2`, the gRPC default), which stays under
  the 2-strike limit. Our calls are short, so pings are rare; a dead connection is found by the deadline.
  Checked against a default grpcio 1.85 server: a 45 s call with keepalive_s=10 sent 2 pings, drew no
  strike and no GOAWAY, and ended with DEADLINE_EXCEEDED at 45.0 s.
- Reconnect backoff: gRPC's own starts at 1 s and grows 1.6x per failed attempt up to 2 minutes, and
  while it waits the channel fails every call at once with UNAVAILABLE. After a 10 s outage the next
  attempt came seconds after the cloud was back, so every escalation (and every breaker probe) failed
  for that long. The backoff starts at `reconnect_min_s` and is capped at `RECONNECT_CAP_S` (0.5 s, or
  `reconnect_max_s` if smaller; gRPC adds ±20 % jitter), shorter than MQTT's 1 s after a session that
  was up because a channel cannot tell a recent outage from an old one: a returned cloud is reconnected
  to within 0.6 s, and a refused attempt costs the cloud a SYN and a reset. One attempt may take
  `connect_timeout_s` (`grpc.min_reconnect_backoff_ms`, gRPC's minimum connect deadline, 20 s by
  default), so a connection that hangs in its handshake (a partition) is given up within that long.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import grpc
import grpc.aio

from cloud_service.protocol import inference_pb2, topics
from cloud_service.protocol.memory import keep_freed_memory
from cloud_service.protocol.wire import Request, as_message, wire_size
from edge_agent.encoding import WireEncoder
from edge_agent.transports.base import (
    CloudURL,
    Transport,
    TransportOptions,
    escalation_error,
    is_ip_literal,
)
from edge_agent.transports.tls import grpc_credentials
from runtimes.errors import CloudTimeout, CloudUnavailable, ConfigError, EscalationError

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
MODEL_INFER = f"/{SERVICE}/ModelInfer"
RECONNECT_CAP_S = 0.5  # the most a channel waits between connection attempts (see the module docstring)


def _seconds(value: float) -> str:
    return f"{value:.3f}s"  # protobuf Duration JSON


def service_config(options: TransportOptions) -> dict[str, Any]:
    """The gRPC service config: round_robin, retries of UNAVAILABLE, and a retry throttling budget."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if options.retry_max_attempts > 1:
        config["methodConfig"] = [{
            "name": [{"service": SERVICE}],
            "retryPolicy": {
                "maxAttempts": options.retry_max_attempts,
                "initialBackoff": _seconds(options.retry_initial_backoff_s),
                "maxBackoff": _seconds(max(options.retry_max_backoff_s, options.retry_initial_backoff_s)),
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }]
        # maxTokens must be in (0, 1000]; tokenRatio keeps 3 decimals
        config["retryThrottling"] = {"maxTokens": min(int(options.retry_max_tokens) or 1, 1000),
                                     "tokenRatio": round(options.retry_token_ratio, 3) or 0.001}
    return config


def channel_target(cloud: CloudURL) -> str:
    """The gRPC target string: `ipv4:a:p,b:q` for IP literals, `dns:///host:port` for one name."""
    hosts = [h for h, _ in cloud.targets]
    if all(is_ip_literal(h) and ":" not in h for h in hosts):
        return "ipv4:" + ",".join(f"{h}:{p}" for h, p in cloud.targets)
    if all(is_ip_literal(h) and ":" in h for h in hosts):
        return "ipv6:" + ",".join(f"[{h}]:{p}" for h, p in cloud.targets)
    if len(cloud.targets) == 1:
        host, port = cloud.targets[0]
        return f"dns:///{host}:{port}"
    msg = (f"cloud URL targets {cloud.describe()} mix names and addresses, or list several names; give IP "
           "addresses of one family, or one DNS name that resolves to every replica")
    raise ConfigError(msg)


def channel_options(options: TransportOptions) -> list[tuple[str, Any]]:
    keepalive_ms = int(options.keepalive_s * 1000)
    result: list[tuple[str, Any]] = [
        ("grpc.service_config", json.dumps(service_config(options))),
        ("grpc.enable_retries", 1 if options.retry_max_attempts > 1 else 0),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", min(keepalive_ms, 10_000)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 2),
        ("grpc.initial_reconnect_backoff_ms", max(1, int(options.reconnect_min_s * 1000))),
        ("grpc.max_reconnect_backoff_ms", max(1, int(min(options.reconnect_max_s, RECONNECT_CAP_S) * 1000))),
        ("grpc.min_reconnect_backoff_ms", max(1, int(options.connect_timeout_s * 1000))),
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.max_receive_message_length", options.max_message_bytes),
    ]
    if options.server_name:
        result.append(("grpc.ssl_target_name_override", options.server_name))
    return result


def _retry_after_s(exc: grpc.aio.AioRpcError) -> float | None:
    """A refusal's retry hint: the `retry-after-ms` trailer (or gRPC's `grpc-retry-pushback-ms`), in seconds."""
    for key, value in exc.trailing_metadata() or ():
        if key in (topics.RETRY_AFTER_METADATA, "grpc-retry-pushback-ms"):
            try:
                return max(0.0, int(value) / 1000)
            except (TypeError, ValueError):
                return None
    return None


class GrpcTransport(Transport):
    """Escalates with a unary `ModelInfer` call over one grpc.aio channel.

    Args:
        cloud: the parsed `grpc://` or `grpcs://` URL.
        device_id: this device; sent as the `tierkit.device_id` parameter.
        boot_id: this boot; sent as `tierkit.boot_id`.
        options: TLS files, retries, keepalive, message size.

    Example:
        >>> cloud = GrpcTransport(parse_cloud_url("grpc://127.0.0.1:8001/digits"), device_id="cam-7")
        >>> async with cloud:
        ...     response = await cloud.escalate(request, timeout_s=0.2)
    """

    name = "grpc"

    def __init__(self, cloud: CloudURL, *, device_id: str, boot_id: str | None = None,
                 options: TransportOptions | None = None) -> None:
        if cloud.kind != "grpc":
            msg = f"GrpcTransport needs a grpc:// or grpcs:// URL, got {cloud.scheme}://"
            raise ConfigError(msg)
        super().__init__(model=cloud.model, device_id=device_id, boot_id=boot_id)
        self.cloud = cloud
        self.options = options or TransportOptions()
        self.target = channel_target(cloud)
        keep_freed_memory(self.options.kept_memory_bytes)  # large payloads: no page faults per copy
        self.encoder = WireEncoder(self.options.wire_encoding) if self.options.wire_encoding != "fp32" else None
        self._channel_options = channel_options(self.options)
        # read certificate files now: a wrong path fails at construction, not on the first escalation
        self._credentials = grpc_credentials(self.options) if cloud.tls else None
        self._channel: grpc.aio.Channel | None = None
        self._infer: grpc.aio.UnaryUnaryMultiCallable | None = None
        self._closed = False

    def _call(self) -> grpc.aio.UnaryUnaryMultiCallable:
        if self._infer is None:
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self.target, self._credentials, options=self._channel_options)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._channel_options)
            self._infer = self._channel.unary_unary(
                MODEL_INFER,
                request_serializer=self.serialize,
                response_deserializer=inference_pb2.ModelInferResponse.FromString,
            )
        return self._infer

    async def escalate(self, request: Request, *, timeout_s: float) -> inference_pb2.ModelInferResponse:
        where = f"{self.cloud.scheme}://{self.cloud.describe()}"
        if self._closed:
            msg = f"gRPC transport to {where} is closed; open a new one"
            raise escalation_error(CloudUnavailable, msg, code="CANCELLED")
        if self.encoder is not None:
            request = self.encoder.prepare(as_message(request), timeout_s)
        started = time.perf_counter()
        try:
            response: inference_pb2.ModelInferResponse = await self._call()(request, timeout=timeout_s)
            if time.perf_counter() - started > timeout_s:  # answered in time, but this loop resumed too late
                msg = (f"gRPC ModelInfer on {where} was answered, but this event loop resumed after the "
                       f"{timeout_s:.3f} s deadline; the answer is not used (the host is overloaded)")
                raise escalation_error(CloudTimeout, msg, code="DEADLINE_EXCEEDED")
            if self.encoder is not None:
                self.encoder.observe(wire_size(request) + response.ByteSize(), time.perf_counter() - started)
            return response
        except grpc.aio.AioRpcError as exc:
            if self.encoder is not None and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.encoder.observe_timeout(wire_size(request), time.perf_counter() - started)
            raise self._map_error(exc, where, timeout_s) from exc

    def _map_error(self, exc: grpc.aio.AioRpcError, where: str, timeout_s: float) -> EscalationError:
        code = exc.code()
        details = exc.details() or ""
        model = self.model or "(named in the request)"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            msg = (f"gRPC ModelInfer on {where} (model {model}) got no answer within {timeout_s:.3f} s; "
                   "the cloud is slow or unreachable: raise the deadline or check its load")
            return escalation_error(CloudTimeout, msg, code=code.name)
        if code == grpc.StatusCode.UNAVAILABLE:
            msg = (f"gRPC ModelInfer on {where} (model {model}) is unavailable: {details}; "
                   "check that the cloud service runs and the address is right")
            return escalation_error(CloudUnavailable, msg, code=code.name, retry_after_s=_retry_after_s(exc))
        msg = f"gRPC ModelInfer on {where} (model {model}) failed with {code.name}: {details}"
        return escalation_error(EscalationError, msg, code=code.name, retry_after_s=_retry_after_s(exc))

    async def aclose(self) -> None:
        self._closed = True
        channel, self._channel, self._infer = self._channel, None, None
        if channel is not None:
            await channel.close()
