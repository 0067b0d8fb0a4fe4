"""Fuzzed Open Inference Protocol requests at the gRPC service (ModelInfer and ModelStreamInfer).

Two generators: structured requests built by hypothesis (shapes up to 70 dimensions and 2**62,
every datatype name and some that are not, raw and typed contents of the wrong length, names up to
100 kB) and byte-level mutations of a valid serialized request. Every answer must be OK or one of
the statuses a client can act on, with a bounded message; nothing is logged as an internal error;
and a valid request from another client is answered within its deadline afterwards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_service.protocol import decode_outputs, encode_request
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import inference_pb2_grpc as pbg
from testkit.cloud_helpers import ServerThread, metric_value
from testkit.fuzz import ANSWERABLE, MAX_DETAILS, requests

FAST = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
SLOW = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture
def server(serve: Callable[..., ServerThread], models_dir: Path) -> ServerThread:
    return serve(models_dir)


@pytest.fixture
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        yield ch


def _raw_infer(channel: grpc.Channel) -> Callable[..., bytes]:
    return channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)


def _valid(x: np.ndarray) -> bytes:
    return encode_request("digits", {"x": x}).SerializeToString()


def _other_client_answered(server: ServerThread, x: np.ndarray) -> None:
    with grpc.insecure_channel(server.grpc) as other:
        stub = pbg.GRPCInferenceServiceStub(other)
        started = time.monotonic()
        reply = stub.ModelInfer(encode_request("digits", {"x": x}), timeout=5.0)
        assert time.monotonic() - started < 5.0
        assert decode_outputs(reply)["logits"].shape == (1, 10)


def _check(call: Callable[..., bytes], payload: bytes) -> grpc.StatusCode:
    code, details = grpc.StatusCode.OK, ""
    try:
        call(payload, timeout=10.0)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    assert code in ANSWERABLE, (code, details)
    assert len(details) <= MAX_DETAILS
    return code


def _run_structured(server: ServerThread, channel: grpc.Channel, x: np.ndarray, caplog: pytest.LogCaptureFixture,
                    profile: settings) -> None:
    call, seen = _raw_infer(channel), []

    @profile
    @given(requests())
    def case(payload: bytes) -> None:
        seen.append(_check(call, payload))

    with caplog.at_level(logging.ERROR, logger="cloud_service"):
        case()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "an internal error was logged"
    assert grpc.StatusCode.INVALID_ARGUMENT in seen
    assert grpc.StatusCode.NOT_FOUND in seen
    failed = sum(metric_value(server.metrics_text, "tierkit_request_failures_total", protocol="grpc", code=c.name)
                 for c in ANSWERABLE - {grpc.StatusCode.OK})
    assert failed == sum(1 for c in seen if c != grpc.StatusCode.OK)  # every refusal counted
    assert metric_value(server.metrics_text, "tierkit_request_failures_total", code="INTERNAL") == 0
    _other_client_answered(server, x)


def test_structured_fuzz_model_infer(server: ServerThread, channel: grpc.Channel, digits_x: np.ndarray,
                                     caplog: pytest.LogCaptureFixture) -> None:
    _run_structured(server, channel, digits_x[:1], caplog, FAST)


@pytest.mark.slow
def test_structured_fuzz_model_infer_long(server: ServerThread, channel: grpc.Channel, digits_x: np.ndarray,
                                          caplog: pytest.LogCaptureFixture) -> None:
    _run_structured(server, channel, digits_x[:1], caplog, SLOW)


@pytest.mark.parametrize(("shape", "raw"), [([0, 2**62], b""), ([1] * 70, b"\x00" * 4), ([2**62, 2**62], b""),
                                            ([2**31, 2**31, 8], b"")])
def test_malformed_shapes_are_invalid_argument_without_a_traceback(
        channel: grpc.Channel, shape: list[int], raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    request = pb.ModelInferRequest(model_name="digits")
    request.inputs.add(name="x", datatype="FP32", shape=shape)
    request.raw_input_contents.append(raw)
    with caplog.at_level(logging.ERROR, logger="cloud_service"), pytest.raises(grpc.RpcError) as info:
        _raw_infer(channel)(request.SerializeToString(), timeout=10.0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(info.value.details()) < 400
    assert not caplog.records


def test_a_huge_model_name_is_not_found_with_a_bounded_message(channel: grpc.Channel, digits_x: np.ndarray) -> None:
    request = encode_request("m" * 1_000_000, {"x": digits_x[:1]})
    with pytest.raises(grpc.RpcError) as info:
        pbg.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10.0)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "more characters" in info.value.details()
    assert len(info.value.details()) <= MAX_DETAILS


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_byte_mutations_of_a_valid_request(data: st.DataObject, server: ServerThread, channel: grpc.Channel,
                                           digits_x: np.ndarray) -> None:
    payload = bytearray(_valid(digits_x[:1]))
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(payload) - 1))
        payload[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.sampled_from([len(payload), len(payload), data.draw(st.integers(0, len(payload)))]))
    _check(_raw_infer(channel), bytes(payload[:cut]))


def test_stream_fuzz_every_request_answered_in_order(server: ServerThread, channel: grpc.Channel,
                                                     digits_x: np.ndarray) -> None:
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                   request_serializer=lambda b: b,
                                   response_deserializer=pb.ModelStreamInferResponse.FromString)
    payloads: list[bytes] = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests())
    def collect(p: bytes) -> None:
        payloads.append(p)

    collect()
    valid = _valid(digits_x[:1])
    mixed = [p for pair in zip(payloads, [valid] * len(payloads), strict=True) for p in pair]
    answers = list(stream(iter(mixed), timeout=60.0))
    assert len(answers) == len(mixed)  # nothing lost: one answer per request, the stream survived
    for i, answer in enumerate(answers):
        if i % 2:  # every valid request in between was answered correctly
            assert not answer.error_message
            assert decode_outputs(answer.infer_response)["logits"].shape == (1, 10)
        elif answer.error_message:
            assert answer.error_message.split(":")[0] in {c.name for c in ANSWERABLE}
            assert len(answer.error_message) <= MAX_DETAILS + 40
