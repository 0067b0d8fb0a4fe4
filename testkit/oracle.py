"""A scripted cloud that answers digits escalations with the true label (or a fixed one).

For the audit, drift and router tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cloud_service.protocol import decode_inputs, encode_response, inference_pb2


def oracle(xs: np.ndarray, ys: np.ndarray, *, answer: int | None = None) -> Callable[[Any], Any]:
    """A cloud answering each known image with its true label (or always `answer`)."""
    labels = {x.tobytes(): int(y) for x, y in zip(xs, ys, strict=True)}

    def handler(request: inference_pb2.ModelInferRequest) -> inference_pb2.ModelInferResponse:
        x = decode_inputs(request)["x"]
        logits = np.zeros((len(x), 10), np.float32)
        for i, row in enumerate(x):
            logits[i, answer if answer is not None else labels[np.ascontiguousarray(row).tobytes()]] = 7.0
        return encode_response("digits", {"logits": logits})

    return handler
