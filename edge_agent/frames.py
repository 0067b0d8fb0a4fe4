"""Raw camera frames: the edge runs on the preprocessed input, an escalation carries the frame itself.

A package may declare how its input is made from a raw uint8 frame (the manifest's `preprocess`,
`cloud_service.protocol.preprocess`). Given `infer(frame=...)`, the agent runs that preprocessing
here for the edge variant and, when it escalates, sends the frame in the `frame` wire encoding
(`cloud_service.protocol.encoding`): the cloud applies the same declared preprocessing, so it answers
the input the edge saw, from a quarter of the fp32 bytes (for a frame at the model's input size).

Example:
    >>> x, frames = from_frame(Preprocess.from_json(manifest.preprocess), "x", "pool", None, frame)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cloud_service.protocol.codec import CodecError
from cloud_service.protocol.encoding import PARAM_ENCODING
from cloud_service.protocol.preprocess import Preprocess
from cloud_service.protocol.wire import RawRequest
from runtimes.errors import InputError

__all__ = ["from_frame", "mark_frame"]


def from_frame(preprocess: Preprocess | None, single_input: str | None, model: str, x: Any,
               frame: Any) -> tuple[Any, np.ndarray | None]:
    """The model input made from `frame` by the declared preprocessing, and the frame with a batch axis.

    Without a frame, `x` passes through. A frame without a batch axis gives an input without one.

    Raises:
        InputError: neither or both of `x` and `frame`; a model that declares no preprocessing or takes
            several inputs; a frame that is not a `[N,] H, W, C` uint8 array.
    """
    if frame is None:
        if x is None:
            msg = "give the model input x, or a raw frame (frame=...)"
            raise InputError(msg)
        return x, None
    if x is not None:
        msg = "give the model input x or a raw frame (frame=...), not both"
        raise InputError(msg)
    if preprocess is None or single_input is None:
        msg = (f"model {model!r} declares no preprocess in its manifest (or takes several inputs), so it cannot "
               "take a raw frame; pass the model input instead")
        raise InputError(msg)
    array = np.asarray(frame)
    if array.dtype != np.uint8 or array.ndim not in (3, 4):
        msg = f"a frame is a [N,] H, W, C uint8 array, got {array.dtype.name} of shape {list(array.shape)}"
        raise InputError(msg)
    batch = array if array.ndim == 4 else array[None]
    try:
        x = preprocess.apply(batch)
    except CodecError as exc:
        raise InputError(str(exc)) from None
    return (x if array.ndim == 4 else x[0]), batch


def mark_frame(request: RawRequest) -> RawRequest:
    """Declare the request's one input a raw frame (`tierkit.encoding = "frame"`)."""
    request.message.inputs[0].parameters[PARAM_ENCODING].string_param = "frame"
    return request
