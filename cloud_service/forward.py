"""Forwarding MQTT escalations to any Open Inference Protocol server (Triton, KServe, another tierkit).

    tierkit serve --mqtt mqtt://broker:1883 --forward grpc://triton:8001

The MQTT bridge keeps what it does for every escalation (the device's topic checks, the duplicate
cache, per-request metrics, acknowledging after the reply) and, instead of running a local model,
hands the request to a `ForwardBackend`: one grpc.aio channel and, by default (`mode="unary"`), one
`ModelInfer` per request with the remaining deadline as the gRPC deadline. `mode="stream"` carries the
requests over long-lived `ModelStreamInfer` streams instead, answers matched by id
(`cloud_service.forward_stream`); measured against Triton on two cores it was no faster. The request's
remaining deadline bounds the wait for its answer (a late answer is dropped). An error answer on a
stream carries only a message, so that request is asked again as one unary `ModelInfer`, whose status
the device gets; the requests a broken stream held unanswered are asked again by unary calls within
their deadlines, and the stream is reopened; an upstream without the stream RPC (UNIMPLEMENTED, or a
stream that fails before any answer) is served by unary calls from then on. The upstream's status is
passed back to the device as its status name, with its retry hint when it refused (RESOURCE_EXHAUSTED or
UNAVAILABLE with a `retry-after-ms` / `grpc-retry-pushback-ms` trailer). Admission: while the upstream's
hint lasts, and for a request whose deadline leaves less than the upstream's typical answer time, the
bridge refuses at once (RESOURCE_EXHAUSTED with a hint) instead of forwarding.
Requests in a tierkit wire encoding (fp16, zstd) are decoded to plain tensors first, since a stock
server does not know them; a raw frame is refused, as only a package's manifest says how to
preprocess it.

Metrics label a request by its model name once the upstream has answered that name; other names
share the unknown-model label, so a device cannot grow the label set without bound.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import ClassVar

import grpc
import grpc.aio

from cloud_service.config import split_forward_url
from cloud_service.errors import ServerBusy
from cloud_service.forward_stream import StreamBroken, StreamForwarder, StreamUnimplemented
from cloud_service.metrics import UNKNOWN_MODEL
from cloud_service.protocol import CodecError, decode_inputs, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol.encoding import encode_input, encoding_of
from runtimes.errors import CloudTimeout, TierkitError

log = logging.getLogger(__name__)

__all__ = ["FORWARD_MODES", "ForwardBackend", "UpstreamError"]

FORWARD_MODES = ("stream", "unary")

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"
DEFAULT_TIMEOUT_S = 30.0  # requests that carry no deadline
MAX_LABELS = 64
_REFUSALS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


def _retry_after_ms(exc: grpc.aio.AioRpcError) -> int | None:
    """The upstream's retry hint: tierkit's `retry-after-ms` or gRPC's `grpc-retry-pushback-ms` trailer."""
    for key, value in exc.trailing_metadata() or ():
        if key in (topics.RETRY_AFTER_METADATA, "grpc-retry-pushback-ms"):
            try:
                return max(0, int(value))
            except (TypeError, ValueError):
                return None
    return None


class UpstreamError(TierkitError):
    """The server escalations are forwarded to answered with an error; `grpc_status` is its status."""

    grpc_status: ClassVar[str] = "UNAVAILABLE"

    def __init__(self, msg: str, *, status: str, retry_after_ms: int | None = None) -> None:
        super().__init__(msg)
        object.__setattr__(self, "grpc_status", status)  # per instance: the upstream's own status
        self.retry_after_ms = retry_after_ms  # the upstream's retry hint, passed on to the device


class ForwardBackend:
    """Answers requests by forwarding them to an Open Inference Protocol server over gRPC.

    Args:
        url: `grpc://HOST:PORT` (or `grpcs://` with the system's roots).
        max_message_bytes: largest message sent or received.
        mode: "stream" (requests over long-lived ModelStreamInfer streams) or "unary" (a ModelInfer each).
        streams: how many streams to spread requests over in stream mode.

    Example:
        >>> backend = ForwardBackend("grpc://127.0.0.1:8001", max_message_bytes=16 << 20, mode="stream")
        >>> await backend.start()
        >>> response = await backend.infer(request, deadline=None)
    """

    def __init__(self, url: str, *, max_message_bytes: int, mode: str = "unary", streams: int = 1) -> None:
        if mode not in FORWARD_MODES or streams < 1:
            msg = f"forward mode must be one of {', '.join(FORWARD_MODES)} with streams >= 1, got {mode!r}, {streams}"
            raise ValueError(msg)
        self.url = url
        self.target, self.tls = split_forward_url(url)
        self.max_message_bytes = max_message_bytes
        self.mode, self.streams = mode, streams
        self._channel: grpc.aio.Channel | None = None
        self._infer: grpc.aio.UnaryUnaryMultiCallable | None = None
        self._stream: StreamForwarder | None = None
        self._labels: set[str] = set()
        self._pushback_until = 0.0  # loop time before which the upstream asked not to be called
        self._latency_s: float | None = None  # moving average of the upstream's answer time

    async def start(self) -> None:
        """Open the channel and check the upstream is live; one that is down is logged, not fatal."""
        options = [("grpc.max_send_message_length", self.max_message_bytes),
                   ("grpc.max_receive_message_length", self.max_message_bytes)]
        self._channel = (grpc.aio.secure_channel(self.target, grpc.ssl_channel_credentials(), options=options)
                         if self.tls else grpc.aio.insecure_channel(self.target, options=options))
        self._infer = self._channel.unary_unary(MODEL_INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                                response_deserializer=pb.ModelInferResponse.FromString)
        if self.mode == "stream":
            self._stream = StreamForwarder(self._channel, self.url, count=self.streams)
        live = self._channel.unary_unary(SERVER_LIVE, request_serializer=pb.ServerLiveRequest.SerializeToString,
                                         response_deserializer=pb.ServerLiveResponse.FromString)
        try:
            await live(pb.ServerLiveRequest(), timeout=2.0, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            log.warning("forward target %s is not live yet (%s); escalations fail until it is",
                        self.url, exc.code().name)

    async def aclose(self) -> None:
        channel, self._channel, self._infer = self._channel, None, None
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()
        if channel is not None:
            await channel.close()

    @property
    def streaming(self) -> bool:
        """Whether requests go over streams (False in unary mode or once the upstream lacked the stream RPC)."""
        return self._stream is not None

    def label(self, model_name: str) -> str:
        """The metrics label of a requested model name."""
        return model_name if model_name in self._labels else UNKNOWN_MODEL

    async def infer(self, request: pb.ModelInferRequest, *, deadline: float | None) -> pb.ModelInferResponse:
        """The upstream's answer to `request`, by `deadline` (the loop's clock) or DEFAULT_TIMEOUT_S.

        Raises:
            CloudTimeout: the deadline passed before or while forwarding.
            UpstreamError: the upstream answered an error status (carried as `grpc_status`).
            CodecError: a raw frame, which only a local package can preprocess.
        """
        if self._infer is None:
            msg = f"the forward backend to {self.url} is not started"
            raise UpstreamError(msg, status="UNAVAILABLE")
        timeout = DEFAULT_TIMEOUT_S
        loop = asyncio.get_running_loop()
        if deadline is not None:
            timeout = deadline - loop.time()
            if timeout <= 0:
                msg = "the request's deadline passed before it could be forwarded"
                raise CloudTimeout(msg)
        self._admit(loop.time(), timeout)
        plain, until = plain_request(request), loop.time() + timeout
        response = None
        if self._stream is not None:
            response = await self._over_stream(plain, until)
        if response is None:
            response = await self._unary(plain, until)
        if len(self._labels) < MAX_LABELS:
            self._labels.add(request.model_name)
        return response

    async def _over_stream(self, request: pb.ModelInferRequest, deadline: float) -> pb.ModelInferResponse | None:
        """The answer over a stream; None when it must be asked by a unary call (an error answer, no stream RPC)."""
        assert self._stream is not None
        future = self._stream.send(request.SerializeToString())
        try:
            async with asyncio.timeout_at(deadline):
                answer = await future
        except TimeoutError:
            msg = f"{self.url} did not answer within the request's deadline"
            raise CloudTimeout(msg) from None
        except StreamUnimplemented as exc:
            if self._stream is not None:
                log.warning("%s; forwarding with unary calls from now on", exc)
                stream, self._stream = self._stream, None
                await stream.aclose()
            return None
        except StreamBroken as exc:  # not answered: asked again by a unary call within its deadline
            log.info("%s; asking the requests it held by unary calls", exc)
            return None
        if answer.error_message:  # a message without a status: the unary call says which
            log.debug("%s answered an error on the stream (%s); asking again by a unary call", self.url,
                      answer.error_message[:200])
            return None
        response = answer.infer_response
        response.id = request.id
        return response

    async def _unary(self, request: pb.ModelInferRequest, deadline: float) -> pb.ModelInferResponse:
        assert self._infer is not None
        timeout = deadline - asyncio.get_running_loop().time()
        if timeout <= 0:
            msg = f"{self.url} did not answer within the request's deadline"
            raise CloudTimeout(msg)
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            response: pb.ModelInferResponse = await self._infer(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                msg = f"{self.url} did not answer within the request's deadline ({timeout:.3f} s)"
                raise CloudTimeout(msg) from None
            msg = f"{self.url} answered {code.name}: {exc.details() or 'no details'}"
            hint = _retry_after_ms(exc)
            if hint is not None and code in _REFUSALS:  # the upstream is busy: nothing goes to it until then
                self._pushback_until = max(self._pushback_until, loop.time() + hint / 1000)
            raise UpstreamError(msg, status=code.name, retry_after_ms=hint) from None
        took = loop.time() - sent
        self._latency_s = took if self._latency_s is None else self._latency_s + 0.2 * (took - self._latency_s)
        return response

    def _admit(self, now: float, timeout: float) -> None:
        """Refuse at once what the upstream cannot answer in time: while it asked for a pause (its
        retry hint), or when the deadline leaves less than its typical answer time."""
        if now < self._pushback_until:
            left_ms = math.ceil((self._pushback_until - now) * 1000)
            msg = f"{self.url} is overloaded (it asked for {left_ms} ms more of pause); retry after the hinted delay"
            raise ServerBusy(msg, retry_after_ms=left_ms)
        if self._latency_s is not None and timeout < self._latency_s:
            msg = (f"{self.url} answers in about {self._latency_s * 1000:.1f} ms, the deadline leaves "
                   f"{timeout * 1000:.1f} ms; not forwarded")
            raise ServerBusy(msg, retry_after_ms=1)


def plain_request(request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    """`request` with tierkit wire encodings undone (fp16 widened, zstd decompressed); as is when none."""
    if not any(t.parameters and encoding_of(t) for t in request.inputs):
        return request
    if any("frame" in encoding_of(t) for t in request.inputs):
        msg = ("a raw frame cannot be forwarded: the server it goes to does not know the package's preprocessing; "
               "send the model input (fp32, fp16 or zstd)")
        raise CodecError(msg)
    out = pb.ModelInferRequest(model_name=request.model_name, model_version=request.model_version, id=request.id)
    for key, value in request.parameters.items():
        out.parameters[key].CopyFrom(value)
    out.outputs.extend(request.outputs)
    for name, array in decode_inputs(request).items():
        encode_input(out, name, array)
    return out
