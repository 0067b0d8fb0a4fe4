"""One fixed-shape OpenVINO request with its own input and output buffers: the session's hot path.

OpenVINO's Python `InferRequest.infer(dict, ...)` rebuilds the same things on every call: it dispatches
each input by type, wraps it in a new `Tensor`, builds a result dict keyed by ports and (unless shared)
copies every output. For a model whose input and output shapes are fixed, all of that can be settled
once: this request owns one numpy buffer per output, set as the request's output tensor at creation,
and (for small inputs) one buffer per input, so a call is a copy in, the C++ `infer` with no Python
dispatch, and a copy out of each output (the buffers are overwritten by the next call, so what the
caller keeps must be a copy).

Inputs up to `COPY_IN_BYTES` in all are copied into the request's own buffers (cheaper than wrapping the
caller's array in a new `Tensor`). Larger ones are shared: the request's input tensor points at the caller's
array itself (no copy), set again only when a call passes another array object than the last call did. A
caller that refills one array between calls (a capture buffer, a preprocessing output) thus pays nothing per
call, and OpenVINO reads the array's contents at the time of the call, as a copy would have. The request holds
the array it points at until the next call replaces it (OpenVINO's `Tensor` does not keep it alive). A
non-contiguous or read-only array is shared as a C-contiguous copy made for that call.

Why not always copy: a copy of a 110 KB input costs 3-4 us when it is in cache, 10-15 us right after
OpenVINO's request evicted it, and up to 45 us when the caller's array and the buffer lie a few bytes apart
modulo 4 KiB (AMD EPYC, AVX2: the copy's loads alias its stores; which happens depends on where the allocator
put the caller's array). Pointing the request at a new array costs about 3.5 us (a `Tensor` and
`set_input_tensor`), whatever its size.

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

COPY_IN_BYTES = 16 * 1024
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
    __slots__ = ("_request", "_inputs", "_outputs", "_held", "copy_in")  # noqa: RUF023

    def __init__(self, request: Any, inputs: list[np.ndarray] | None, outputs: list[np.ndarray] | None,
                 n_inputs: int = 0) -> None:
        self._request = request
        self._inputs = inputs
        self._outputs = outputs
        self.copy_in = inputs is not None
        # shared inputs: the array each input tensor points at now (None: none yet)
        self._held: list[np.ndarray | None] = [None] * n_inputs

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
        return cls(request, inputs, outputs, n_in)

    @classmethod
    def generic(cls, request: Any) -> FixedRequest:
        """`request` run through OpenVINO's own `infer` (outputs of dynamic shape, bf16 tensors)."""
        return cls(request, None, None)

    def close(self) -> None:
        """Release the request before the buffers and arrays it points into; the object cannot run after."""
        self._request = None
        self._held = []

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
        else:
            held = self._held
            for i, array in enumerate(arrays):
                if array is not held[i]:
                    self._share(i, array)
        _INFER(self._request, _NO_INPUTS, True, True)
        return [buffer.copy() for buffer in self._outputs]

    def _share(self, index: int, array: np.ndarray) -> None:
        """Point input `index` at `array` (or at its C-contiguous copy), held until another array replaces it."""
        flags = array.flags
        if not (flags.c_contiguous and flags.writeable):
            array = np.array(array, order="C")
        self._request.set_input_tensor(index, ov.Tensor(array, shared_memory=True))
        self._held[index] = array
