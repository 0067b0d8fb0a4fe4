"""Reading the cloud's replies: outputs checked against what the edge produced, or why a reply is unusable.

`check_reply` returns a `CheckedReply`: either `UsableReply` (the outputs, shaped and typed like the
edge's) or `UnusableReply` (why not, for the log and the breaker). Match on the type:

    >>> match check_reply(response, "digits", expected):
    ...     case UsableReply(outputs):
    ...         merge(outputs)
    ...     case UnusableReply(why):
    ...         log(why)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cloud_service.protocol import CodecError, decode_outputs, inference_pb2

__all__ = ["CheckedReply", "UnusableReply", "UsableReply", "check_reply", "decode_reply"]


@dataclass(frozen=True, slots=True)
class UsableReply:
    """The cloud's outputs, each a writable copy shaped and typed like the edge's."""

    outputs: dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class UnusableReply:
    """Why a reply cannot be used (another model's, malformed, missing an output, misshapen)."""

    why: str


CheckedReply = UsableReply | UnusableReply


def check_reply(response: inference_pb2.ModelInferResponse, model: str,
                expected: Mapping[str, np.ndarray]) -> CheckedReply:
    """The cloud's outputs shaped and typed like `expected`, or why the reply is unusable."""
    if response.model_name != model:
        return UnusableReply(f"reply for model {response.model_name!r}, asked {model!r}")
    try:
        got = decode_outputs(response)
    except CodecError as exc:
        return UnusableReply(f"malformed reply: {exc}")
    out = {}
    for name, edge in expected.items():
        cloud = got.get(name)
        if cloud is None:
            return UnusableReply(f"reply lacks output {name!r} (has {sorted(got)})")
        if cloud.shape != edge.shape:
            return UnusableReply(f"reply output {name!r} has shape {list(cloud.shape)}, expected {list(edge.shape)}")
        out[name] = cloud.astype(edge.dtype)  # a copy: decoded arrays are read-only views of the reply
    return UsableReply(out)


def decode_reply(response: inference_pb2.ModelInferResponse) -> dict[str, np.ndarray] | None:
    """The reply's outputs, or None when they do not decode (a late reply handed to a callback)."""
    try:
        return decode_outputs(response)
    except CodecError:
        return None
