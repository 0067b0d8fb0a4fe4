"""One fixed-shape OpenVINO request, called with nothing around the C++ `infer`: the session's hot path.

OpenVINO's Python `InferRequest.infer(dict, ...)` rebuilds the same things on every call: it dispatches
each input by type, wraps it in a new `Tensor`, and wraps the result dict keyed by ports. For a model whose
input and output shapes are fixed, all of that can be settled once: a call here sets what changed of the
inputs, runs the C++ `infer` with no Python dispatch, and takes the outputs it returns as fresh arrays
(`share_outputs=False`: the binding copies each output tensor into a new array, so what a call returned is
the caller's and the next call cannot change it).

Inputs: an array passed again (the same object as the last call's) is shared: the request's input tensor
points at the caller's array itself and stays so while calls pass that array, so a caller that refills one
array between calls (a capture buffer, a preprocessing output) pays nothing per call, and OpenVINO reads the
array's contents at the time of the call, as a copy would have. The request holds that array until another
replaces it (OpenVINO's `Tensor` does not keep it alive). A new array is copied into the request's own buffer
where the inputs total up to `COPY_IN_BYTES`, and shared for the call above that. A non-contiguous or
read-only array is copied (into the buffer, or into a C-contiguous array that is shared).

Why: a copy of a 110 KB input costs 3-4 us when it is in cache, 10-15 us right after OpenVINO's request evicted
it, and up to 45 us when the caller's array and the buffer lie a few bytes apart modulo 4 KiB (AMD EPYC, AVX2:
the copy's loads alias its stores; which happens depends on where the allocator put the caller's array).
Pointing the request at a new array costs about 3.5 us in Python (a `Tensor` and `set_input_tensor`), but the
call after it took about 14 us more around OpenVINO's request than a copy did (2-core EPYC under load), so a new
array is copied up to `COPY_IN_BYTES`, and the same array is not copied at all.

Measured on the PP-OCR direction classifier (input 1x3x48x192, 0.6 ms a call) on a 2-core AMD EPYC under load
from other work, calls interleaved: the time a call spends outside OpenVINO's own request (wall time minus
`InferRequest.latency`) is about 16 us for the bare C++ `infer` with inputs set once and no outputs read, 20 us
with the outputs copied by the binding, and about 23 us here with the same array passed each call.

A model whose outputs have dynamic shapes, or whose element types numpy cannot hold (bf16), is not
eligible (`FixedRequest.build` returns None; `FixedRequest.generic` runs it through OpenVINO's own `infer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from runtimes.ov_import import openvino as ov

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
    """An `InferRequest` of a fixed-shape compiled model, called directly (see module doc)."""

    # in this order: when the object goes, the request goes before the buffers and arrays it points into
    __slots__ = ("_request", "_names", "_inputs", "_tensors", "_held", "_seen", "_fixed", "copy_in",  # noqa: RUF023
                 "_name")

    def __init__(self, request: Any, names: Sequence[str], inputs: list[np.ndarray] | None, n_inputs: int,
                 fixed: bool) -> None:
        self._request = request
        self._names = tuple(names)  # the outputs' names, in the model's order
        self._inputs = inputs  # the request's own input buffers, where new arrays are copied in
        self._tensors = [ov.Tensor(b, shared_memory=True) for b in inputs] if inputs is not None else []
        for i, tensor in enumerate(self._tensors):
            request.set_input_tensor(i, tensor)
        self._held: list[np.ndarray | None] = [None] * n_inputs  # the array each input points at (None: its buffer)
        self._seen: list[np.ndarray | None] = [None] * n_inputs  # the array the last call passed
        self._fixed = fixed
        self.copy_in = inputs is not None
        self._name = self._names[0] if len(self._names) == 1 else None  # the only output's name

    @classmethod
    def build(cls, compiled: Any, names: Sequence[str]) -> FixedRequest | None:
        """A request of `compiled` whose outputs are returned under `names`; None where shapes or element
        types do not allow it."""
        if _INFER is None:
            return None
        specs = []
        for port in (*compiled.inputs, *compiled.outputs):
            dtype = _numpy_dtype(port.get_element_type())
            if dtype is None or port.get_partial_shape().is_dynamic:
                return None
            specs.append((tuple(port.get_shape()), dtype))
        n_in = len(compiled.inputs)
        inputs = None
        if sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs[:n_in]) <= COPY_IN_BYTES:
            inputs = [np.zeros(shape, dtype) for shape, dtype in specs[:n_in]]
        return cls(compiled.create_infer_request(), names, inputs, n_in, True)

    @classmethod
    def generic(cls, request: Any, names: Sequence[str]) -> FixedRequest:
        """`request` run through OpenVINO's own `infer` (outputs of dynamic shape, bf16 tensors)."""
        return cls(request, names, None, 0, False)

    def close(self) -> None:
        """Release the request before the buffers and arrays it points into; the object cannot run after."""
        self._request = None
        self._held = self._seen = []

    @property
    def request(self) -> Any:
        """The OpenVINO `InferRequest` (its input tensors are this object's buffers or the caller's arrays)."""
        return self._request

    def run(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Run on `arrays` (in the model's input order, with its shapes and dtypes: the caller checked); the
        outputs by name, each a fresh array. Not thread-safe: the caller serialises calls."""
        if not self._fixed:
            results = self._request.infer(dict(enumerate(arrays)), share_inputs=True, share_outputs=True)
            return {n: a.copy() for n, a in zip(self._names, results.to_tuple(), strict=True)}
        held = self._held
        for i, array in enumerate(arrays):
            if array is not held[i]:
                self._set(i, array)
        return dict(zip(self._names, _INFER(self._request, _NO_INPUTS, False, True).values(), strict=False))

    @property
    def single(self) -> bool:
        """Whether `run_one` runs this request: fixed shapes and one input."""
        return self._fixed and len(self._held) == 1

    def run_one(self, array: np.ndarray) -> dict[str, np.ndarray]:
        """`run([array])` for a `single` request, with fewer steps: the session's hot path for a one-input model."""
        if array is not self._held[0]:
            self._set(0, array)
        results = _INFER(self._request, _NO_INPUTS, False, True)
        if self._name is not None:
            return {self._name: next(iter(results.values()))}
        return dict(zip(self._names, results.values(), strict=False))

    def _set(self, index: int, array: np.ndarray) -> None:
        """Input `index` for a call that passes `array`, which the request does not point at now."""
        flags = array.flags
        shareable = flags.c_contiguous and flags.writeable
        if self._inputs is None or (shareable and array is self._seen[index]):
            if not shareable:
                array = np.array(array, order="C")
            self._request.set_input_tensor(index, ov.Tensor(array, shared_memory=True))
            self._held[index] = array
        else:
            if self._held[index] is not None:  # it pointed at the caller's array: back to the buffer
                self._request.set_input_tensor(index, self._tensors[index])
                self._held[index] = None
            np.copyto(self._inputs[index], array, casting="no")
        self._seen[index] = array
