"""One fixed-shape OpenVINO request with its own input and output buffers: the session's hot path.

OpenVINO's Python `InferRequest.infer(dict, ...)` rebuilds the same things on every call: it dispatches
each input by type, wraps it in a new `Tensor`, builds a result dict keyed by ports and (unless shared)
copies every output. For a model whose input and output shapes are fixed, all of that can be settled
once: this request owns one numpy buffer per output, set as the request's output tensor at creation,
and (for small inputs) one buffer per input, so a call is a copy in, the C++ `infer` with no Python
dispatch, and a copy out of each output (the buffers are overwritten by the next call, so what the
caller keeps must be a copy).

Inputs up to `COPY_IN_BYTES` in all are copied into the request's own buffers (cheaper than wrapping
the caller's array in a new `Tensor` each call, and it takes non-contiguous arrays in one copy); larger
ones are shared with OpenVINO for the call (no copy), as `infer(share_inputs=True)` does.

Measured on the PP-OCR direction classifier (input 1x3x48x192) on a loaded 2-core AMD EPYC: the time a
call spends outside OpenVINO's own request (wall time minus `InferRequest.latency`) went from about
220 us (`infer(dict, share_inputs=True, share_outputs=True)` and a copy of each output) to about 100 us;
the bare `InferRequest.infer()` with no inputs and no outputs read back is about 70-90 us there.

A model whose outputs have dynamic shapes, or whose element types numpy cannot hold (bf16), is not
eligible (`FixedRequest.build` returns None; `FixedRequest.generic` runs it through OpenVINO's own `infer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from runtimes.ov_telemetry import silence

silence()  # before openvino is imported: its import posts an event
import openvino as ov  # noqa: E402

try:  # the C++ binding's infer: no Python dispatch of inputs, outputs returned as views
    from openvino._pyopenvino import InferRequest as _BaseRequest

    _INFER: Any = _BaseRequest.infer
except (ImportError, AttributeError):  # pragma: no cover - another OpenVINO layout
    _INFER = None

COPY_IN_BYTES = 256 * 1024
_NO_INPUTS: dict[int, Any] = {}


def _numpy_dtype(element_type: Any) -> np.dtype[Any] | None:
    """The numpy dtype holding `element_type` exactly, or None (bf16, strings, dynamic)."""
    name = element_type.get_type_name()
    if name in ("bf16", "string", "dynamic", "undefined") or element_type.is_dynamic():
        return None
    try:
        dtype: np.dtype[Any] = np.dtype(element_type.to_dtype())
    except (RuntimeError, TypeError, ValueError):
        return None
    return dtype


class FixedRequest:
    """An `InferRequest` of a fixed-shape compiled model, with its buffers set once (see module doc)."""

    # in this order: when the object goes, the request goes before the buffers it points into
    __slots__ = ("_request", "_inputs", "_outputs", "copy_in")  # noqa: RUF023

    def __init__(self, request: Any, inputs: list[np.ndarray] | None, outputs: list[np.ndarray] | None) -> None:
        self._request = request
        self._inputs = inputs
        self._outputs = outputs
        self.copy_in = inputs is not None

    @classmethod
    def build(cls, compiled: Any) -> FixedRequest | None:
        """A request of `compiled` with its own buffers; None where shapes or element types do not allow it."""
        if _INFER is None:
            return None
        specs = []
        for port in (*compiled.inputs, *compiled.outputs):
            dtype = _numpy_dtype(port.get_element_type())
            if dtype is None or port.get_partial_shape().is_dynamic:
                return None
            specs.append((tuple(port.get_shape()), dtype))
        n_in = len(compiled.inputs)
        request = compiled.create_infer_request()
        outputs = [np.empty(shape, dtype) for shape, dtype in specs[n_in:]]
        for i, buffer in enumerate(outputs):
            request.set_output_tensor(i, ov.Tensor(buffer, shared_memory=True))
        inputs = None
        if sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs[:n_in]) <= COPY_IN_BYTES:
            inputs = [np.zeros(shape, dtype) for shape, dtype in specs[:n_in]]
            for i, buffer in enumerate(inputs):
                request.set_input_tensor(i, ov.Tensor(buffer, shared_memory=True))
        return cls(request, inputs, outputs)

    @classmethod
    def generic(cls, request: Any) -> FixedRequest:
        """`request` run through OpenVINO's own `infer` (outputs of dynamic shape, bf16 tensors)."""
        return cls(request, None, None)

    def close(self) -> None:
        """Release the request before the buffers it points into; the object cannot run after."""
        self._request = None

    @property
    def request(self) -> Any:
        """The OpenVINO `InferRequest` (its input and output tensors are this object's buffers)."""
        return self._request

    def run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run on `arrays` (in the model's input order, with its shapes and dtypes: the caller checked);
        fresh copies of the outputs. Not thread-safe: the caller serialises calls."""
        if self._outputs is None:
            results = self._request.infer(dict(enumerate(arrays)), share_inputs=True, share_outputs=True)
            return [a.copy() for a in results.to_tuple()]
        if self._inputs is not None:
            for buffer, array in zip(self._inputs, arrays, strict=True):
                np.copyto(buffer, array, casting="no")
            _INFER(self._request, _NO_INPUTS, True, True)
        else:
            _INFER(self._request, {i: ov.Tensor(_shareable(a), shared_memory=True) for i, a in enumerate(arrays)},
                   True, True)
        return [buffer.copy() for buffer in self._outputs]


def _shareable(array: np.ndarray) -> np.ndarray:
    """`array` itself when OpenVINO can share it (C-contiguous, writeable), else a C-contiguous copy."""
    flags = array.flags
    return array if flags.c_contiguous and flags.writeable else np.array(array, order="C")
