"""Hostile Open Inference Protocol requests (hypothesis strategies) and what a server may answer them with."""

from __future__ import annotations

import grpc
from hypothesis import strategies as st

from cloud_service.protocol import inference_pb2 as pb

ANSWERABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_DETAILS = 1200  # the server clips echoed content to 1,024 characters plus a note


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    request = pb.ModelInferRequest(model_name=draw(st.sampled_from(["digits", "digits"]) | _names),
                                   model_version=draw(st.sampled_from(["", "1", "2", "x" * 300])),
                                   id=draw(st.text(max_size=30)))
    for _ in range(draw(st.integers(0, 3))):
        request.inputs.add(name=draw(st.sampled_from(["x", "x", "y"]) | _names), datatype=draw(_datatypes),
                           shape=draw(_shapes))
    raw = draw(st.sampled_from(["raw", "typed", "mismatched"]))
    if raw == "raw":
        for _ in request.inputs:
            request.raw_input_contents.append(draw(st.sampled_from([256, 0, 3, 4096])) * b"\x00")
    elif raw == "mismatched":
        request.raw_input_contents.append(b"\x00" * 256)
        request.raw_input_contents.append(b"")
    else:
        for tensor in request.inputs:
            tensor.contents.fp32_contents.extend([0.5] * draw(st.sampled_from([0, 1, 64])))
    for name in draw(st.lists(st.sampled_from(["logits", "nope", ""]), max_size=2)):
        request.outputs.add(name=name)
    return request.SerializeToString()


_dims = st.one_of(st.integers(0, 4), st.integers(-3, 2**63 - 1), st.sampled_from([2**62, 2**31, 64, 8, 1]))


_shapes = st.one_of(st.lists(_dims, max_size=6), st.lists(st.integers(0, 2), min_size=60, max_size=70),
                    st.just([1, 1, 8, 8]), st.just([0, 2**62]))


_datatypes = st.sampled_from(["FP32", "FP16", "FP64", "INT64", "UINT8", "BOOL", "BYTES", "", "fp32", "FP8"])


_names = st.one_of(st.sampled_from(["digits", "x", ""]), st.text(max_size=40),
                   st.integers(1_000, 100_000).map(lambda n: "n" * n))
