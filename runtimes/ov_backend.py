"""OpenVINO backend: `Core.read_model` + `compile_model`, and one reused `InferRequest`.

Reads OpenVINO IR (`.xml` with its `.bin` beside it) and, when `backend="openvino"` is asked for
explicitly, `.onnx` files too. `SessionOptions.intra_op_threads` becomes `INFERENCE_NUM_THREADS`
and `performance_hint` becomes `PERFORMANCE_HINT`; OpenVINO has no inter-op thread knob, so
`inter_op_threads` is ignored. With the LATENCY hint on CPU, threads are not pinned to cores unless
`SessionOptions.cpu_pinning` asks for it (see there: OpenVINO pins by default, which costs every call).
The device is "cpu" / "gpu" (mapped to "CPU" / "GPU") or any OpenVINO device name ("NPU", "AUTO",
"HETERO:GPU,CPU").

Fixed shapes: a model with dynamic dimensions (an ONNX export's `[?,3,?,?]`) runs 10-25 % slower in
OpenVINO's CPU plugin than the same model reshaped to the shape it is called with (measured here on the
PP-OCR detector and recognizer and YOLOv8n: `benchmark_app -shape` reshapes, so it runs the fixed-shape
model). The session therefore compiles a fixed-shape copy on the first call with each new input shape,
for up to `SessionOptions.static_shapes` shapes (default 4), and runs the dynamic model for any shape
beyond those, or that the model cannot take. That first call pays one compile (tenths of a second);
later calls with the shape run the copy.

Running: a fixed-shape model (and each fixed-shape copy) runs through `runtimes.ov_request.FixedRequest`:
a call copies small inputs into the request's own buffers (larger ones are shared, and an array passed again
needs nothing), runs the C++ request with no Python dispatch, and takes each output as a fresh array copied
by the binding. A one-input model called again with the last call's shape and dtype skips the general
checks (one lookup and three comparisons, then the lock and `FixedRequest.run_one`): 15.2 us a call against
19.0 us by the general path on a two-op model, where OpenVINO's C++ call alone takes 12.3 us (2-core EPYC,
under load from other work). The dynamic model runs through OpenVINO's `infer` with shared inputs and
outputs, then a copy of each output. A static model called with another shape is refused before OpenVINO sees it.

OpenVINO converts a float64 array for a float32 input without complaint, and reuses the previous
tensor when an input is left out; the session therefore checks input names and dtypes on every
call (a dict lookup and a dtype comparison per input), and the shapes pick the request.

Example:
    >>> with OpenVinoBackend().load(Path("digits.xml"), SessionOptions(intra_op_threads=2)) as s:
    ...     logits = s.run({"x": x})["logits"]
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from runtimes.errors import BackendUnavailable, ConfigError, InferenceError, InputError, PackageError
from runtimes.ov_import import openvino as ov
from runtimes.ov_request import FixedRequest
from runtimes.session import Session, SessionOptions, axis_name
from runtimes.spec import DTYPES, TensorSpec, input_error

logger = logging.getLogger(__name__)

_OV_TYPES = {d.openvino: d.name for d in DTYPES.values()}
_SUFFIXES = (".xml", ".onnx")
# A variant's declared precision -> OpenVINO's INFERENCE_PRECISION_HINT. Without a hint the CPU plugin
# computes in bf16 on CPUs with avx512_bf16 or AMX and the GPU plugin in f16, whatever the model says.
# int8 models keep their non-quantized parts in f32, as they were validated.
_HINTS = {"fp32": "f32", "int8": "f32", "bf16": "bf16", "fp16": "f16"}
_EXECUTED = {"f32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "f16": "fp16", "float16": "fp16"}


def ov_device(device: str) -> str:
    """The OpenVINO device name for a `SessionOptions.device` value."""
    if device in ("cpu", "gpu", "npu"):
        return device.upper()
    if device.lower().startswith("cuda"):
        msg = f"device {device!r}: OpenVINO does not run on CUDA; use 'cpu', 'gpu', 'NPU' or 'AUTO'"
        raise ConfigError(msg)
    return device


def _spec(port: Any, index: int, kind: str, where: str) -> TensorSpec:
    names = port.get_names()
    name = port.get_any_name() if names else f"{kind}{index}"
    type_name = port.get_element_type().get_type_name()
    dtype = _OV_TYPES.get(type_name)
    if dtype is None:
        msg = f"{where}: tensor {name!r} has element type {type_name}; tierkit runs numeric tensors only"
        raise ConfigError(msg)
    pshape = port.get_partial_shape()
    if pshape.rank.is_dynamic:
        msg = f"{where}: tensor {name!r} has a dynamic rank; reshape the model to a fixed rank first"
        raise ConfigError(msg)
    shape = tuple(axis_name(i) if d.is_dynamic else d.get_length() for i, d in enumerate(pshape))
    return TensorSpec(name, dtype, shape)


def executed_precision(compiled: Any, declared: str) -> str:
    """The precision a compiled model computes in, from its INFERENCE_PRECISION_HINT as OpenVINO reports it.

    An int8 model whose float parts run f32 is reported "int8"; a bf16 model on a CPU without native
    bf16 (OpenVINO then runs f32) is reported "fp32", so a caller can refuse or relabel it.
    """
    try:
        value = compiled.get_property("INFERENCE_PRECISION_HINT")
    except RuntimeError:  # a device that does not report it
        return declared
    name = getattr(value, "get_type_name", lambda: str(value))()
    executed = _EXECUTED.get(str(name).lower(), str(name))
    return "int8" if declared == "int8" and executed == "fp32" else executed


class OpenVinoSession(Session):
    """A model compiled by OpenVINO. Build it with `OpenVinoBackend().load(...)`.

    Calls are serialised with a lock, because an `InferRequest` is not safe to share between
    threads; open one session per worker thread for parallel runs.
    """

    backend = "openvino"

    def __init__(self, artifact: Path, options: SessionOptions, core: ov.Core | None = None) -> None:
        if artifact.suffix.lower() not in _SUFFIXES:
            msg = f"OpenVINO reads {list(_SUFFIXES)} files, not {artifact.name!r}"
            raise ConfigError(msg)
        self._core = core or ov.Core()
        device = ov_device(options.device)
        known = self._core.available_devices
        if device.partition(":")[0] not in (*known, "AUTO", "HETERO", "MULTI", "BATCH"):
            msg = f"OpenVINO device {device!r} is not available here; this machine has {known}"
            raise BackendUnavailable(msg)
        config: dict[str, Any] = {"PERFORMANCE_HINT": options.performance_hint,
                                  "INFERENCE_PRECISION_HINT": _HINTS[options.precision]}
        if options.intra_op_threads:
            config["INFERENCE_NUM_THREADS"] = options.intra_op_threads
        pinning = options.cpu_pinning
        if pinning is None and options.performance_hint == "LATENCY":
            pinning = False  # see SessionOptions.cpu_pinning: not pinned unless asked for
        if pinning is not None and device == "CPU":
            config["ENABLE_CPU_PINNING"] = pinning
        try:
            model = self._core.read_model(str(artifact))
        except RuntimeError as exc:
            msg = f"OpenVINO cannot read {str(artifact)!r}: {exc}"
            raise PackageError(msg) from exc
        try:
            self._compiled = self._core.compile_model(model, device, config)
        except RuntimeError as exc:
            msg = f"OpenVINO cannot compile {artifact.name!r} for {device} with {config}: {exc}"
            raise InferenceError(msg) from exc
        self.device = device
        self.precision = executed_precision(self._compiled, options.precision)
        where = f"model {artifact.name!r}"
        self.inputs = tuple(_spec(p, i, "x", where) for i, p in enumerate(self._compiled.inputs))
        self.outputs = tuple(_spec(p, i, "y", where) for i, p in enumerate(self._compiled.outputs))
        self._dtypes = {s.name: np.dtype(s.dtype) for s in self.inputs if s.dtype != "bfloat16"}
        self._names = tuple(s.name for s in self.inputs)
        self._dtype_list = [self._dtypes.get(n) for n in self._names]  # None: bf16, which numpy cannot hold
        self._output_names = [s.name for s in self.outputs]
        self._request = self._compiled.create_infer_request()
        # the dynamic model's request, run by OpenVINO's infer
        self._generic = FixedRequest.generic(self._request, self._output_names)
        self._lock = threading.Lock()
        dynamic = any(isinstance(d, str) for spec in self.inputs for d in spec.shape)
        self._model = model if dynamic and options.static_shapes else None
        self._config = config
        self._static_left = options.static_shapes
        # input shapes -> the request that runs them: a fixed-shape copy's, or None for the dynamic model's
        self._static: dict[tuple[tuple[int, ...], ...], FixedRequest | None] = {}
        self._fixed = None if dynamic else FixedRequest.build(self._compiled, self._output_names)
        # the input shapes `_fixed` runs (None: a dynamic model, whose requests `_request_for` picks)
        self._fixed_key = None if dynamic else tuple(tuple(int(d) for d in s.shape) for s in self.inputs)
        self._last: FixedRequest | None = None  # the request the last call ran on, and its input shapes
        self._last_key: tuple[tuple[int, ...], ...] | None = None
        # a one-input model whose last call ran a fixed-shape request: (input name, shape, dtype, that request's
        # `run_one`); a call with one array of that shape and dtype goes straight to it (see `run`)
        self._fast: tuple[str, tuple[int, ...], np.dtype[Any], Callable[[np.ndarray], dict[str, np.ndarray]]] | None
        self._fast = None

    @property
    def static_shapes(self) -> tuple[dict[str, tuple[int, ...]], ...]:
        """The input shapes this session has compiled a fixed-shape copy for, in the order they came."""
        return tuple(dict(zip(self._names, key, strict=True)) for key, r in self._static.items() if r is not None)

    def _fixed_for(self, key: tuple[tuple[int, ...], ...]) -> FixedRequest | None:
        """The fixed-shape request for input shapes `key`: compiled on the first call with them, while the
        budget lasts; None to run the dynamic model. Called under the lock."""
        if self._model is None:
            return self._fixed if key == self._fixed_key else None
        if key in self._static:
            return self._static[key]
        fits = all(len(k) == len(s.shape) and all(isinstance(d, str) or d == n for d, n in zip(s.shape, k, strict=True))
                   for s, k in zip(self.inputs, key, strict=True))
        if not fits or self._static_left <= 0:
            return None  # OpenVINO names what is wrong, or runs the shape dynamically
        self._static_left -= 1
        model = self._model.clone()
        fixed: FixedRequest | None = None
        try:
            model.reshape({s.name: ov.PartialShape(list(k)) for s, k in zip(self.inputs, key, strict=True)})
            compiled = self._core.compile_model(model, self.device, self._config)
            fixed = (FixedRequest.build(compiled, self._output_names)
                     or FixedRequest.generic(compiled.create_infer_request(), self._output_names))
        except RuntimeError as exc:
            logger.info("OpenVINO cannot compile %s at fixed shape %s (%s); the dynamic model runs it",
                        self.inputs, key, exc)
        self._static[key] = fixed
        return fixed

    @property
    def last_latency_ms(self) -> float | None:
        """OpenVINO's own latency of the last call, in ms: the time inside its C++ request (`InferRequest.latency`,
        what `benchmark_app` reports); the rest of the call's wall time is spent around it, in Python. None before
        the first call."""
        last = self._last
        return None if last is None or last.request is None else float(last.request.latency)

    def get_property(self, name: str) -> Any:
        """A property of the compiled model, e.g. "INFERENCE_NUM_THREADS" or "PERFORMANCE_HINT"."""
        return self._compiled.get_property(name)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # the hot path for a one-input model called again with the last call's shape: a lookup, three comparisons
        # and the lock before OpenVINO's C++ call. Each step costs more right after a request, which evicts the
        # interpreter's data from the caches, so fewer steps pay (see `runtimes.ov_request`).
        fast = self._fast
        if fast is not None:
            try:
                array = inputs[fast[0]]
                hit = array.shape == fast[1] and array.dtype is fast[2] and len(inputs) == 1
            except (KeyError, TypeError, AttributeError):
                hit = False
            if hit:
                try:
                    with self._lock:
                        return fast[3](array)
                except (RuntimeError, TypeError, ValueError) as exc:
                    raise self._input_error(inputs, exc) from exc
        return self._run(inputs)

    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`run` by the general path: every input looked up and checked, the request picked by the shapes."""
        try:
            arrays = [inputs[n] for n in self._names]
            key = tuple([a.shape for a in arrays])
            right = [a.dtype for a in arrays] == self._dtype_list  # None for bf16, which numpy cannot hold
        except (KeyError, AttributeError, TypeError):
            raise self._input_error(inputs, None) from None
        if not right or len(inputs) != len(arrays):
            raise self._input_error(inputs, None)
        try:
            with self._lock:
                fixed = self._last
                if fixed is None or key != self._last_key:
                    self._last = fixed = self._request_for(key, inputs)
                    self._last_key = key
                    self._fast = ((self._names[0], key[0], self._dtype_list[0], fixed.run_one)
                                  if fixed.single and self._dtype_list[0] is not None else None)
                return fixed.run(arrays)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise self._input_error(inputs, exc) from exc

    def _request_for(self, key: tuple[tuple[int, ...], ...], inputs: Mapping[str, np.ndarray]) -> FixedRequest:
        """The request that runs input shapes `key` (the last call's runs the same shapes again). Called under the
        lock."""
        if self._model is None:
            if self._fixed is None:
                return self._generic
            if key != self._fixed_key:
                raise self._input_error(inputs, None)  # a fixed-shape model called with another shape
            return self._fixed
        return self._static.get(key) or self._fixed_for(key) or self._generic

    def _input_error(self, inputs: Mapping[str, np.ndarray], exc: Exception | None) -> InferenceError:
        precise = input_error(self.inputs, inputs)
        if precise is not None:
            return precise
        if exc is None:
            msg = f"inputs must be numpy arrays named {[s.name for s in self.inputs]}"
            return InputError(msg)
        text = str(exc).replace("\n", " ")
        if "input" in text.lower() and ("shape" in text.lower() or "port" in text.lower()):
            return InputError(f"OpenVINO rejected the inputs: {text}; the model takes {list(self.inputs)}")
        return InferenceError(f"OpenVINO failed while running: {text}")

    def _close(self) -> None:
        for fixed in (self._fixed, *self._static.values()):
            if fixed is not None:
                fixed.close()
        self._fast = None
        self._static.clear()
        self._fixed = self._last = self._last_key = None
        self._generic.close()
        del self._request, self._compiled, self._model


class OpenVinoBackend:
    """Loads OpenVINO IR (and ONNX, when asked explicitly) with the OpenVINO runtime."""

    name = "openvino"

    def load(self, artifact: Path, options: SessionOptions) -> OpenVinoSession:
        return OpenVinoSession(Path(artifact), options)
