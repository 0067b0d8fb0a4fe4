"""Reading the cloud's replies: outputs checked against what the edge produced, or why a reply is unusable."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cloud_service.protocol import CodecError, decode_outputs, inference_pb2


def check_reply(response: inference_pb2.ModelInferResponse, model: str,
                expected: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | str:
    """The cloud's outputs shaped and typed like `expected`, or why the reply is unusable."""
    if response.model_name != model:
        return f"reply for model {response.model_name!r}, asked {model!r}"
    try:
        got = decode_outputs(response)
    except CodecError as exc:
        return f"malformed reply: {exc}"
    out = {}
    for name, edge in expected.items():
        cloud = got.get(name)
        if cloud is None:
            return f"reply lacks output {name!r} (has {sorted(got)})"
        if cloud.shape != edge.shape:
            return f"reply output {name!r} has shape {list(cloud.shape)}, expected {list(edge.shape)}"
        out[name] = cloud.astype(edge.dtype)  # a copy: decoded arrays are read-only views of the reply
    return out


def decode_reply(response: inference_pb2.ModelInferResponse) -> dict[str, np.ndarray] | None:
    """The reply's outputs, or None when they do not decode (a late reply handed to a callback)."""
    try:
        return decode_outputs(response)
    except CodecError:
        return None
