"""The published wire contract: Open Inference Protocol messages, the numpy codec, the MQTT topics.

A leaf: it imports only the standard library, numpy, protobuf and grpc, so the edge agent can use
it without pulling in the rest of the cloud service.
"""

from cloud_service.protocol import inference_pb2, inference_pb2_grpc, topics
from cloud_service.protocol.codec import (
    CodecError,
    declared_rows,
    decode_inputs,
    decode_outputs,
    encode_request,
    encode_response,
    get_parameters,
    set_parameters,
)

__all__ = [
    "CodecError",
    "declared_rows",
    "decode_inputs",
    "decode_outputs",
    "encode_request",
    "encode_response",
    "get_parameters",
    "inference_pb2",
    "inference_pb2_grpc",
    "set_parameters",
    "topics",
]
