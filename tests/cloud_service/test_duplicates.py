"""The duplicate cache both transports share: keys, expiry, bound, and one answer served in either form."""

from __future__ import annotations

import numpy as np

from cloud_service.duplicates import DuplicateCache, message_key, request_key
from cloud_service.protocol import decode_outputs, encode_request, get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol.wire import RawResponse

PARAMS = {topics.PARAM_DEVICE: "cam-1", topics.PARAM_BOOT: "boot-a", topics.PARAM_SEQ: 7}


def _answer(value: float) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name="digits")
    out = response.outputs.add(name="logits", datatype="FP32", shape=[1, 2])
    response.raw_output_contents.append(np.full((1, 2), value, np.float32).tobytes())
    assert out.name == "logits"
    return response


def test_both_transports_read_the_same_key_from_a_request() -> None:
    request = encode_request("digits", {"x": np.zeros((1, 1, 8, 8), np.float32)}, parameters=PARAMS)
    assert message_key(request.parameters) == request_key(get_parameters(request.parameters)) == ("cam-1", "boot-a", 7)
    assert request_key(get_parameters(request.parameters), "cam-2") == ("cam-2", "boot-a", 7)  # the topic's identity
    bare = encode_request("digits", {"x": np.zeros((1, 1, 8, 8), np.float32)})
    assert message_key(bare.parameters) is None
    assert request_key({}) is None
    assert request_key({topics.PARAM_SEQ: True}) is None  # a bool is no sequence number
    # over gRPC (no identity from the transport) a request must name its device and boot id to be deduplicated
    seq_only = encode_request("digits", {"x": np.zeros((1, 1, 8, 8), np.float32)}, parameters={topics.PARAM_SEQ: 7})
    assert message_key(seq_only.parameters) is None


def test_an_answer_kept_by_one_transport_is_served_marked_cached_in_the_others_form() -> None:
    cache, key = DuplicateCache(), ("cam-1", "boot-a", 7)
    cache.put(key, RawResponse(_answer(1.0)))  # as the gRPC servicer keeps it
    as_message = cache.message(key)
    assert as_message is not None
    assert get_parameters(as_message.parameters)[topics.PARAM_CACHED] is True
    np.testing.assert_array_equal(decode_outputs(as_message)["logits"], np.ones((1, 2), np.float32))
    cache.put(key, _answer(2.0))  # as the MQTT bridge keeps it
    as_raw = cache.raw(key)
    assert as_raw is not None
    again = pb.ModelInferResponse.FromString(as_raw.serialize())
    assert get_parameters(again.parameters)[topics.PARAM_CACHED] is True
    np.testing.assert_array_equal(decode_outputs(again)["logits"], np.full((1, 2), 2.0, np.float32))
    kept = cache.get(key)
    assert isinstance(kept, pb.ModelInferResponse)
    assert topics.PARAM_CACHED not in kept.parameters


def test_the_cache_is_bounded_and_can_be_turned_off() -> None:
    cache = DuplicateCache(ttl_s=60.0, max_entries=2)
    for seq in range(3):
        cache.put(("d", "b", seq), _answer(float(seq)))
    assert cache.get(("d", "b", 0)) is None
    assert cache.get(("d", "b", 2)) is not None
    off = DuplicateCache(ttl_s=0.0)
    off.put(("d", "b", 0), _answer(0.0))
    assert off.get(("d", "b", 0)) is None
