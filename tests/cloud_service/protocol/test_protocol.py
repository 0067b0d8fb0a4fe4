"""The wire contract: our messages match the public Open Inference Protocol, and the codec round-trips."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import descriptor_pb2

from cloud_service.protocol import (
    CodecError,
    decode_inputs,
    decode_outputs,
    encode_request,
    encode_response,
    get_parameters,
    topics,
)
from cloud_service.protocol import inference_pb2 as pb

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")


def _fields(descriptor) -> dict[str, tuple[int, int, int]]:  # type: ignore[no-untyped-def]
    proto = descriptor_pb2.DescriptorProto()
    descriptor.CopyToProto(proto)
    return {f.name: (f.number, f.type, f.label) for f in proto.field}


@pytest.mark.parametrize("name", [
    "ModelInferRequest", "ModelInferResponse", "InferParameter", "InferTensorContents",
    "ModelMetadataResponse", "ServerMetadataResponse", "ModelReadyRequest", "ModelConfigRequest",
    "ModelStreamInferResponse", "ModelStatisticsRequest", "ModelStatisticsResponse", "ModelStatistics",
    "InferStatistics", "InferBatchStatistics", "InferResponseStatistics", "StatisticDuration", "MemoryUsage",
])
def test_messages_match_the_public_spec(name: str) -> None:
    ours, theirs = getattr(pb, name).DESCRIPTOR, getattr(service_pb2, name).DESCRIPTOR
    assert ours.full_name == theirs.full_name
    assert _fields(ours) == _fields(theirs)
    for nested in ours.nested_types:
        if not nested.GetOptions().map_entry:
            assert _fields(nested) == _fields(theirs.nested_types_by_name[nested.name])


def test_model_config_fields_are_a_subset_with_the_same_numbers() -> None:
    from tritonclient.grpc import model_config_pb2

    for name in ("ModelConfig", "ModelInput", "ModelOutput", "ModelDynamicBatching", "ModelInstanceGroup"):
        ours, theirs = _fields(getattr(pb, name).DESCRIPTOR), _fields(getattr(model_config_pb2, name).DESCRIPTOR)
        assert {k: v[0] for k, v in ours.items()} == {k: theirs[k][0] for k in ours}, name


def test_service_methods_match() -> None:
    ours = {m.name: (m.input_type.full_name, m.output_type.full_name)
            for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for name, types in ours.items():
        method = theirs.methods_by_name[name]
        assert types == (method.input_type.full_name, method.output_type.full_name)


def test_request_round_trip_through_tritonclients_messages() -> None:
    x = np.random.default_rng(0).normal(size=(3, 1, 8, 8)).astype(np.float32)
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    req = encode_request("digits", {"x": x, "ids": ids}, request_id="r1",
                         parameters={topics.PARAM_DEVICE: "cam-1", topics.PARAM_SEQ: 7,
                                     topics.PARAM_EDGE_SCORE: 0.25, "flag": True})
    wire = req.SerializeToString()
    theirs = service_pb2.ModelInferRequest.FromString(wire)
    assert theirs.model_name == "digits"
    assert theirs.inputs[0].datatype == "FP32"
    back = pb.ModelInferRequest.FromString(wire)
    arrays = decode_inputs(back)
    np.testing.assert_array_equal(arrays["x"], x)
    np.testing.assert_array_equal(arrays["ids"], ids)
    assert get_parameters(back.parameters) == {topics.PARAM_DEVICE: "cam-1", topics.PARAM_SEQ: 7,
                                               topics.PARAM_EDGE_SCORE: 0.25, "flag": True}


def test_typed_input_contents_are_accepted() -> None:
    req = pb.ModelInferRequest(model_name="m")
    t = req.inputs.add(name="x", datatype="FP32", shape=[2, 2])
    t.contents.fp32_contents.extend([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(decode_inputs(req)["x"], np.array([[1, 2], [3, 4]], np.float32))


def test_response_round_trip() -> None:
    y = np.linspace(0, 1, 20, dtype=np.float32).reshape(2, 10)
    resp = encode_response("digits", {"logits": y}, version="1", request_id="r1")
    back = pb.ModelInferResponse.FromString(resp.SerializeToString())
    np.testing.assert_array_equal(decode_outputs(back)["logits"], y)


@pytest.mark.parametrize(("mutate", "fragment"), [
    (lambda r: r.inputs[0].shape.__setitem__(0, 5), "bytes given"),
    (lambda r: setattr(r.inputs[0], "datatype", "FP8"), "not supported"),
    (lambda r: r.inputs[0].shape.__setitem__(0, -1), "negative"),
    (lambda r: r.raw_input_contents.append(b"x"), "raw_input_contents for"),
])
def test_malformed_tensors_raise_codec_errors(mutate, fragment: str) -> None:  # type: ignore[no-untyped-def]
    req = encode_request("m", {"x": np.zeros((2, 3), np.float32)})
    mutate(req)
    with pytest.raises(CodecError, match=fragment):
        decode_inputs(req)


def test_topics() -> None:
    assert topics.escalate_topic("cam-1") == "tierkit/v1/cam-1/escalate"
    assert topics.device_from_topic("tierkit/v1/cam-1/escalate") == "cam-1"
    assert topics.shared_escalate_subscription("cloud") == "$share/cloud/tierkit/v1/+/escalate"
    for bad in ("", "a/b", "+", "#", "$SYS"):
        with pytest.raises(ValueError, match="device id"):
            topics.escalate_topic(bad)
    with pytest.raises(ValueError, match="not under"):
        topics.device_from_topic("other/v1/x/escalate")
