"""Forwarding over long-lived ModelStreamInfer streams, matched to requests by id.

grpcio spends far less Python work per message on an open stream than on a unary call, so the
forward backend (`cloud_service.forward`) sends its requests over `count` bidirectional streams on
one channel (round robin) instead of one `ModelInfer` call each:

- Each request goes out with an id of the stream's own (appended to the serialized request as a
  second `id` field, which protobuf parsers take over the first), and its answer is found by that id;
  the caller restores the device's id. An answer without an id (an error from a server that does not
  echo ids) goes to the oldest request still waiting on that stream, as servers answer a stream of a
  model that is not decoupled in request order (Triton, tierkit serve).
- A request that waits past its deadline is given up by its caller; its late answer is dropped.
- When a stream ends or breaks, the requests waiting on it fail with `StreamBroken` and the next
  request opens a new one. A server that does not implement the stream RPC (UNIMPLEMENTED) fails
  them with `StreamUnimplemented`, and the caller falls back to unary calls.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator

import grpc
import grpc.aio

from cloud_service.protocol import inference_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["StreamBroken", "StreamForwarder", "StreamUnimplemented"]

MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
_ID_TAG = b"\x1a"  # ModelInferRequest.id: field 3, length-delimited


class StreamBroken(Exception):
    """The stream a request waited on ended before its answer; `code` is the stream's gRPC status name."""

    def __init__(self, msg: str, code: str) -> None:
        super().__init__(msg)
        self.code = code


class StreamUnimplemented(StreamBroken):
    """The upstream does not implement ModelStreamInfer."""


def with_id(serialized: bytes, request_id: str) -> bytes:
    """A serialized ModelInferRequest whose `id` parses as `request_id` (short ASCII), without re-encoding it."""
    raw = request_id.encode()
    return serialized + _ID_TAG + bytes((len(raw),)) + raw


class _Lane:
    """One open stream: requests written from a queue, answers read by a task of its own."""

    def __init__(self, method: grpc.aio.StreamStreamMultiCallable, url: str) -> None:
        self.url = url
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.waiting: collections.OrderedDict[str, asyncio.Future[pb.ModelStreamInferResponse]] = (
            collections.OrderedDict())
        self.broken = False
        self.answered = False  # whether any answer came on this stream
        self._call = method(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self) -> AsyncIterator[bytes]:
        while (item := await self._queue.get()) is not None:
            yield item

    def send(self, request_id: str, serialized: bytes) -> asyncio.Future[pb.ModelStreamInferResponse]:
        future: asyncio.Future[pb.ModelStreamInferResponse] = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        self._queue.put_nowait(with_id(serialized, request_id))
        return future

    async def _read(self) -> None:
        error: StreamBroken
        try:
            async for response in self._call:
                self._answer(response)
            error = StreamBroken(f"{self.url} ended the inference stream before answering", "UNAVAILABLE")
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or "no details"
            # a server without the stream RPC answers UNIMPLEMENTED, or INTERNAL when it closes the stream
            # while the client is still sending; a stream that never answered anything is taken for that
            if code == grpc.StatusCode.UNIMPLEMENTED or (code == grpc.StatusCode.INTERNAL and not self.answered):
                error = StreamUnimplemented(f"{self.url} does not implement ModelStreamInfer: {details}", code.name)
            else:
                error = StreamBroken(f"the inference stream to {self.url} broke ({code.name}: {details}); "
                                     "it is reopened for the next request", code.name)
        except asyncio.CancelledError:
            error = StreamBroken(f"the inference stream to {self.url} was closed", "CANCELLED")
        finally:
            self.broken = True
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(error)
        self.waiting.clear()

    def _answer(self, response: pb.ModelStreamInferResponse) -> None:
        self.answered = True
        request_id = response.infer_response.id
        if request_id:
            future = self.waiting.pop(request_id, None)
        else:  # an error that does not name its request: answers come in request order
            future = self.waiting.popitem(last=False)[1] if self.waiting else None
        if future is None:
            log.debug("answer on the stream to %s for no waiting request (id %r): dropped", self.url, request_id)
        elif not future.done():  # done: its caller gave up at its deadline
            future.set_result(response)

    async def aclose(self) -> None:
        self._queue.put_nowait(None)
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class StreamForwarder:
    """Sends serialized requests over `count` streams of `channel`, reopening a stream that broke.

    Example:
        >>> forwarder = StreamForwarder(channel, "grpc://triton:8001", count=1)
        >>> answer = await forwarder.send(request.SerializeToString())   # then await it with a timeout
    """

    def __init__(self, channel: grpc.aio.Channel, url: str, *, count: int) -> None:
        self.url = url
        self._method = channel.stream_stream(MODEL_STREAM_INFER, request_serializer=None,
                                             response_deserializer=pb.ModelStreamInferResponse.FromString)
        self._lanes: list[_Lane | None] = [None] * count
        self._turn = itertools.cycle(range(count))
        self._ids = itertools.count(1)

    def send(self, serialized: bytes) -> asyncio.Future[pb.ModelStreamInferResponse]:
        """The future answer to a serialized ModelInferRequest (its `id` is replaced on the wire)."""
        index = next(self._turn)
        lane = self._lanes[index]
        if lane is None or lane.broken:
            lane = self._lanes[index] = _Lane(self._method, self.url)
        return lane.send(str(next(self._ids)), serialized)

    async def aclose(self) -> None:
        lanes = [lane for lane in self._lanes if lane is not None]
        self._lanes = [None] * len(self._lanes)
        await asyncio.gather(*(lane.aclose() for lane in lanes))
