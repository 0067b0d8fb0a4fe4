"""Tensor bytes beside the protobuf message, not inside it: large payloads with fewer copies.

A `bytes` field in protobuf cannot hold a view, so a 600 KB tensor is copied each time it enters
or leaves a message: into the message, into the serialized bytes (twice with upb: arena, then a
Python `bytes`), out of a parsed message, out of each `raw_*_contents` getter. The raw bytes echo
pays none of these, and on this kind of host they were most of the gap between a generated-stub
round trip (1.5-1.6x the echo) and the echo itself.

The tensor fields are the last fields of both messages (`raw_input_contents` = 7 of
`ModelInferRequest`, `raw_output_contents` = 6 of `ModelInferResponse`), so a message serialized
without them followed by each tensor as hand-written protobuf wire bytes (tag, varint length,
payload) is byte-identical to what protobuf itself writes: `join_fields` builds it with one copy of
each tensor. `split_fields` does the reverse on received bytes: it walks the top-level fields,
hands back each tensor as a `memoryview` of the received buffer (no copy; numpy reads it in place),
and leaves the rest, a few hundred bytes, for protobuf to parse. Anything it does not expect
(a group, a truncated field) sends the whole buffer to protobuf's own parser, which either parses
it or raises its usual `DecodeError`. Stock clients and servers see ordinary messages.

Example:
    >>> data = RawRequest(head, (array,)).serialize()      # what `SerializeToString` would give
    >>> RawRequest.parse(data).raw[0]                      # a memoryview of `data`
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol.codec import Param, RawBytes, oip_datatype, set_parameters

__all__ = ["RAW_INPUT_FIELD", "RAW_OUTPUT_FIELD", "RawRequest", "RawResponse", "Request", "as_message", "join_fields",
           "raw_request", "raw_response", "serialize_request", "split_fields", "wire_array", "wire_size"]

RAW_INPUT_FIELD: int = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
RAW_OUTPUT_FIELD: int = pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number

Buffer = RawBytes


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _nbytes(buffer: Buffer) -> int:
    return buffer.nbytes if isinstance(buffer, np.ndarray | memoryview) else len(buffer)


def join_fields(head: bytes, number: int, payloads: Sequence[Buffer]) -> bytes:
    """`head` followed by each payload as a length-delimited field `number`, with one copy of each.

    Payloads must be C-contiguous (`bytes.join` reads their buffers directly).
    """
    if not payloads:
        return head
    tag = _varint((number << 3) | 2)
    parts: list[Buffer] = [head]
    for payload in payloads:
        parts += (tag, _varint(_nbytes(payload)), payload)
    return b"".join(parts)  # type: ignore[arg-type]  # bytes.join takes any contiguous buffer


# A real request has a few dozen top-level fields (names, parameters, tensors). Past this many the scan
# stops and protobuf's C parser takes the bytes: a message of millions of tiny fields must not cost
# a Python loop over each.
MAX_SCANNED_FIELDS = 1024


class _Unexpected(Exception):
    """The scan met something protobuf's own parser should judge."""


def _read_varint(data: memoryview, i: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while i < end and shift < 64:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7
    raise _Unexpected


def split_fields(data: bytes | memoryview, number: int) -> tuple[bytes, list[memoryview]] | None:
    """The message bytes without top-level field `number`, and each of its payloads as a view of `data`.

    None when the bytes hold something the scan does not handle (groups, truncation, field `number`
    with another wire type, more than `MAX_SCANNED_FIELDS` fields): parse them with protobuf instead,
    which judges them.
    """
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    end = len(view)
    payloads: list[memoryview] = []
    kept: list[memoryview] = []
    start = i = fields = 0
    try:
        while i < end:
            fields += 1
            if fields > MAX_SCANNED_FIELDS:
                raise _Unexpected
            field_start = i
            key, i = _read_varint(view, i, end)
            kind = key & 7
            if kind == 0:
                _, i = _read_varint(view, i, end)
            elif kind == 2:
                length, i = _read_varint(view, i, end)
                if i + length > end:
                    raise _Unexpected
                if key >> 3 == number:
                    if field_start > start:
                        kept.append(view[start:field_start])
                    payloads.append(view[i:i + length])
                    start = i + length
                i += length
            elif kind == 1:
                i += 8
            elif kind == 5:
                i += 4
            else:
                raise _Unexpected
            if key >> 3 == number and kind != 2:
                raise _Unexpected
    except _Unexpected:
        return None
    if i != end:
        return None
    if start < end:
        kept.append(view[start:end])
    return b"".join(kept), payloads


@dataclass(frozen=True, slots=True)
class RawRequest:
    """A `ModelInferRequest` whose tensor bytes travel beside `message` rather than inside it.

    `message.raw_input_contents` is empty; `raw` holds one buffer per input, in order.
    """

    message: pb.ModelInferRequest
    raw: tuple[Buffer, ...] = ()

    @classmethod
    def parse(cls, data: bytes) -> RawRequest:
        """Parse wire bytes; raises protobuf's `DecodeError` for bytes that are no ModelInferRequest."""
        message, raw = _parse(pb.ModelInferRequest, data, RAW_INPUT_FIELD, "raw_input_contents")
        return cls(message, raw)

    @classmethod
    def of(cls, request: pb.ModelInferRequest) -> RawRequest:
        """From a whole message (copies its tensors out once, as their getter does)."""
        if not request.raw_input_contents:
            return cls(request)
        head = pb.ModelInferRequest()
        head.CopyFrom(request)
        del head.raw_input_contents[:]
        return cls(head, tuple(request.raw_input_contents))

    def serialize(self) -> bytes:
        """The wire bytes, identical to the whole message's `SerializeToString()`."""
        return join_fields(self.message.SerializeToString(), RAW_INPUT_FIELD, self.raw)

    def to_message(self) -> pb.ModelInferRequest:
        """The whole message (copies the tensors in)."""
        return _whole(self.message, "raw_input_contents", self.raw)


@dataclass(frozen=True, slots=True)
class RawResponse:
    """A `ModelInferResponse` whose output arrays travel beside `message` (serialized with one copy)."""

    message: pb.ModelInferResponse
    raw: tuple[Buffer, ...] = field(default=())

    def serialize(self) -> bytes:
        """The wire bytes, identical to the whole message's `SerializeToString()`."""
        return join_fields(self.message.SerializeToString(), RAW_OUTPUT_FIELD, self.raw)

    def to_message(self) -> pb.ModelInferResponse:
        """The whole message (copies the outputs in)."""
        return _whole(self.message, "raw_output_contents", self.raw)

    @classmethod
    def parse(cls, data: bytes) -> RawResponse:
        """Parse wire bytes; raises protobuf's `DecodeError` for bytes that are no ModelInferResponse."""
        message, raw = _parse(pb.ModelInferResponse, data, RAW_OUTPUT_FIELD, "raw_output_contents")
        return cls(message, raw)


_M = TypeVar("_M", pb.ModelInferRequest, pb.ModelInferResponse)


def _parse(kind: type[_M], data: bytes, field_number: int, name: str) -> tuple[_M, tuple[Buffer, ...]]:
    """The message without its tensor field, and the tensors as views of `data` where the layout allows
    (else as protobuf's copies)."""
    split = split_fields(data, field_number)
    if split is None:
        message = kind.FromString(data)
        raw = tuple(getattr(message, name))
        del getattr(message, name)[:]
        return message, raw
    return kind.FromString(split[0]), tuple(split[1])


def _whole(message: _M, name: str, raw: tuple[Buffer, ...]) -> _M:
    """A copy of `message` with the tensors copied into its field `name`."""
    whole = type(message)()
    whole.CopyFrom(message)
    getattr(whole, name).extend(bytes(b) for b in raw)
    return whole


def wire_array(array: Any) -> np.ndarray:
    """`array` as a C-contiguous little-endian array, ready for `join_fields` (copies only if it must)."""
    a = np.asarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a)


def raw_response(model: str, outputs: Mapping[str, Any], *, version: str = "", request_id: str = "",
                 parameters: Mapping[str, Param] | None = None) -> RawResponse:
    """`codec.encode_response`'s message, with the output arrays beside it instead of copied in."""
    message = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    arrays = []
    for name, value in outputs.items():
        array = wire_array(value)
        message.outputs.add(name=name, datatype=oip_datatype(array), shape=array.shape)
        arrays.append(array)
    if parameters:
        set_parameters(message.parameters, parameters)
    return RawResponse(message, tuple(arrays))


def raw_request(model: str, inputs: Mapping[str, Any], *, version: str = "", request_id: str = "",
                parameters: Mapping[str, Param] | None = None) -> RawRequest:
    """`codec.encode_request`'s message, with the input arrays beside it (no copy until it is serialized).

    The arrays are referenced, not copied: leave them unchanged until the request is sent.
    """
    message = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    arrays = []
    for name, value in inputs.items():
        array = wire_array(value)
        message.inputs.add(name=name, datatype=oip_datatype(array), shape=array.shape)
        arrays.append(array)
    if parameters:
        set_parameters(message.parameters, parameters)
    return RawRequest(message, tuple(arrays))


Request = pb.ModelInferRequest | RawRequest


def as_message(request: Request) -> pb.ModelInferRequest:
    """The whole `ModelInferRequest` (a `RawRequest`'s tensors are copied in)."""
    return request if isinstance(request, pb.ModelInferRequest) else request.to_message()


def serialize_request(request: Request) -> bytes:
    """The request's wire bytes."""
    return request.serialize() if isinstance(request, RawRequest) else bytes(request.SerializeToString())


def wire_size(request: Request) -> int:
    """The request's wire bytes, counted without serializing it."""
    if isinstance(request, pb.ModelInferRequest):
        return int(request.ByteSize())
    tag = len(_varint((RAW_INPUT_FIELD << 3) | 2))
    return int(request.message.ByteSize()) + sum(
        tag + len(_varint(n)) + n for n in (_nbytes(b) for b in request.raw))
