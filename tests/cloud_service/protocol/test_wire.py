"""Tensors beside the message (`protocol.wire`): byte-identical to protobuf's own serialization, parsed
into views of the received bytes, and wire compatible both ways with stock clients and servers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError

from cloud_service.protocol import decode_inputs, decode_outputs, encode_request, encode_response, get_parameters
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import inference_pb2_grpc as pbg
from cloud_service.protocol.wire import (
    MAX_SCANNED_FIELDS,
    RAW_INPUT_FIELD,
    RawRequest,
    RawResponse,
    raw_request,
    raw_response,
    serialize_request,
    split_fields,
    wire_size,
)
from edge_agent.transports import open_transport
from testkit.cloud_helpers import ServerThread
from testkit.grpc_doubler import Doubler, serving

PARAMS = {"tierkit.device_id": "cam-7", "tierkit.seq": 12, "score": 0.25, "flag": True}


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "image": rng.random((1, 3, 224, 224), dtype=np.float32),  # 600 KB: lengths need 3-byte varints
        "mask": rng.random((4, 6)).astype(">f4")[:, ::2],  # big-endian and not contiguous
        "ids": np.arange(5, dtype=np.int64),
        "empty": np.zeros((0, 3), np.uint8),
    }


def test_raw_request_serializes_to_protobufs_bytes() -> None:
    inputs = _inputs()
    stock = encode_request("m", inputs, version="2", request_id="r-1", parameters=PARAMS).SerializeToString()
    ours = raw_request("m", inputs, version="2", request_id="r-1", parameters=PARAMS)
    assert ours.serialize() == stock
    assert serialize_request(ours) == stock
    assert wire_size(ours) == len(stock)
    # map fields (the parameters) serialize in an order protobuf does not fix: compare the messages
    assert ours.to_message() == pb.ModelInferRequest.FromString(stock)


def test_raw_response_serializes_to_protobufs_bytes() -> None:
    outputs = _inputs()
    stock = encode_response("m", outputs, version="2", request_id="r-1", parameters=PARAMS).SerializeToString()
    ours = raw_response("m", outputs, version="2", request_id="r-1", parameters=PARAMS)
    assert ours.serialize() == stock
    parsed = RawResponse.parse(stock)
    assert decode_outputs(parsed.to_message()).keys() == outputs.keys()
    for name, array in decode_outputs(parsed.to_message()).items():
        np.testing.assert_array_equal(array, outputs[name])


def test_parse_gives_views_of_the_received_bytes() -> None:
    inputs = _inputs()
    stock = encode_request("m", inputs, request_id="r-1", parameters=PARAMS)
    data = stock.SerializeToString()
    parsed = RawRequest.parse(data)
    assert not parsed.message.raw_input_contents
    assert [t.name for t in parsed.message.inputs] == list(inputs)
    assert get_parameters(parsed.message.parameters) == get_parameters(stock.parameters)
    assert all(isinstance(b, memoryview) and b.obj is data for b in parsed.raw)  # no copy of the tensors
    decoded = decode_inputs(parsed.message, parsed.raw)
    for name, array in inputs.items():
        np.testing.assert_array_equal(decoded[name], array)
    assert not decoded["image"].flags.writeable


def test_fields_after_the_tensors_and_other_wire_types_are_kept() -> None:
    request = encode_request("m", {"x": np.ones(3, np.float32)})
    tail = pb.ModelInferRequest(id="late")  # a field written after raw_input_contents
    data = request.SerializeToString() + tail.SerializeToString()
    parsed = RawRequest.parse(data)
    assert parsed.message.id == "late"
    assert parsed.message.model_name == "m"
    assert bytes(parsed.raw[0]) == np.ones(3, np.float32).tobytes()


def test_bytes_the_scan_does_not_handle_go_to_protobuf() -> None:
    data = encode_request("m", {"x": np.ones(3, np.float32)}).SerializeToString()
    assert split_fields(data[:-2], RAW_INPUT_FIELD) is None  # truncated
    with pytest.raises(DecodeError):
        RawRequest.parse(data[:-2])
    with pytest.raises(DecodeError):
        RawRequest.parse(b"\xff\xff\xff")
    group = bytes([(9 << 3) | 3, (9 << 3) | 4])  # an empty group in an unknown field: protobuf keeps it
    assert split_fields(data + group, RAW_INPUT_FIELD) is None
    parsed = RawRequest.parse(data + group)
    assert bytes(parsed.raw[0]) == np.ones(3, np.float32).tobytes()


def test_a_message_of_many_small_fields_is_left_to_protobuf() -> None:
    """Millions of tiny fields would cost a Python loop each; past the bound protobuf's C parser takes them."""
    request = encode_request("m", {"x": np.ones(3, np.float32)})
    many = pb.ModelInferRequest(id="x").SerializeToString() * (MAX_SCANNED_FIELDS + 1)
    data = many + request.SerializeToString()
    assert split_fields(data, RAW_INPUT_FIELD) is None
    parsed = RawRequest.parse(data)
    assert parsed.message.model_name == "m"
    assert bytes(parsed.raw[0]) == np.ones(3, np.float32).tobytes()


def test_transport_sends_raw_requests_a_stock_server_parses() -> None:
    """tierkit's client -> the generated servicer: the message arrives whole, stamped, tensors intact."""
    x = np.arange(3 * 224 * 224, dtype=np.float32).reshape(1, 3, 224, 224)

    async def main() -> None:
        servicer = Doubler()
        async with serving(servicer) as port, \
                open_transport(f"grpc://127.0.0.1:{port}/digits", device_id="cam-7") as cloud:
            response = await cloud.escalate(raw_request("", {"x": x}, request_id="r-9"), timeout_s=10)
        np.testing.assert_array_equal(decode_outputs(response)["y"], x * 2)
        seen = servicer.calls[0]
        assert seen.model_name == "digits"
        assert seen.id == "r-9"
        assert get_parameters(seen.parameters)["tierkit.device_id"] == "cam-7"

    asyncio.run(main())


def test_tierkit_serve_answers_stock_and_raw_clients_alike(serve: Callable[..., ServerThread], models_dir: Path,
                                                           digits_x: np.ndarray) -> None:
    """Stock stub and tierkit's transport -> tierkit serve's reader and writer: the same answer."""
    server = serve(models_dir)
    x = digits_x[:3]
    with grpc.insecure_channel(server.grpc) as channel:
        stock = pbg.GRPCInferenceServiceStub(channel).ModelInfer(encode_request("digits", {"x": x}, request_id="s"))

    async def ours() -> pb.ModelInferResponse:
        async with open_transport(f"grpc://{server.grpc}/digits", device_id="cam-7") as cloud:
            return await cloud.escalate(raw_request("", {"x": x}, request_id="s"), timeout_s=10)

    mine = asyncio.run(ours())
    assert mine.SerializeToString() == stock.SerializeToString()
    assert decode_outputs(stock)["logits"].shape == (3, 10)
