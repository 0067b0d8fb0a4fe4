"""TensorRT backend: serialized engines (`.engine`, `.plan`) run with the TensorRT 10 tensor API.

Loading deserializes the engine with `trt.Runtime.deserialize_cuda_engine` and creates one
execution context. Tensors are discovered by name (`num_io_tensors`, `get_tensor_name`,
`get_tensor_mode`, `get_tensor_shape`, `get_tensor_dtype`); `-1` dimensions become named dynamic
axes, bounded by optimization profile 0 (`get_tensor_profile_shape`).

Device memory: torch CUDA tensors. torch's caching allocator makes a fresh output tensor per call
as cheap as a reused buffer, handles every dynamic shape without our own pool, and frees memory
with the tensors; cuda-python would need all of that written by hand. So this backend needs both
`tensorrt` and a CUDA build of `torch` (`pip install 'tierkit[tensorrt,torch]'`).

A call: copy each input to the GPU on the session's stream, `set_input_shape`, then
`set_tensor_address` for inputs and for freshly allocated outputs (their shapes come from the
context once the input shapes are set), `execute_async_v3(stream)`, copy outputs back (which
synchronises the stream). Calls are serialised with a lock, as an execution context is not safe to
share between threads. Engines are built for one GPU model and one TensorRT version; a mismatch
makes deserialisation fail with a `PackageError`.

Example:
    >>> with TensorRTBackend().load(Path("digits.engine"), SessionOptions(device="cuda:0")) as s:
    ...     logits = s.run({"x": x})["logits"]
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tensorrt as trt

from runtimes.errors import BackendUnavailable, ConfigError, InferenceError, InputError, PackageError
from runtimes.session import Session, SessionOptions, axis_name
from runtimes.spec import TensorSpec, check_inputs

try:
    import torch
except ModuleNotFoundError:  # the registry would name the 'tensorrt' extra, which does not bring torch
    _msg = "backend 'tensorrt' needs 'torch' (CUDA build) for GPU memory: pip install 'tierkit[tensorrt,torch]'"
    raise BackendUnavailable(_msg) from None

logger = logging.getLogger(__name__)

_DTYPES: dict[Any, tuple[str, torch.dtype]] = {
    trt.DataType.FLOAT: ("float32", torch.float32),
    trt.DataType.HALF: ("float16", torch.float16),
    trt.DataType.BF16: ("bfloat16", torch.bfloat16),
    trt.DataType.INT8: ("int8", torch.int8),
    trt.DataType.UINT8: ("uint8", torch.uint8),
    trt.DataType.INT32: ("int32", torch.int32),
    trt.DataType.INT64: ("int64", torch.int64),
    trt.DataType.BOOL: ("bool", torch.bool),
}


class _TrtLogger(trt.ILogger):  # type: ignore[misc]
    """Routes TensorRT's messages to Python logging instead of stderr."""

    _LEVELS: dict[Any, int] = {  # noqa: RUF012 - read-only table
        trt.ILogger.Severity.INTERNAL_ERROR: logging.CRITICAL, trt.ILogger.Severity.ERROR: logging.ERROR,
        trt.ILogger.Severity.WARNING: logging.WARNING, trt.ILogger.Severity.INFO: logging.DEBUG,
        trt.ILogger.Severity.VERBOSE: logging.DEBUG,
    }

    def __init__(self) -> None:
        trt.ILogger.__init__(self)

    def log(self, severity: Any, msg: str) -> None:
        logger.log(self._LEVELS.get(severity, logging.INFO), "TensorRT: %s", msg)


def cuda_device(device: str) -> torch.device:
    """The CUDA device for a `SessionOptions.device` value ("gpu", "cuda", "cuda:N")."""
    low = device.lower()
    if low not in ("gpu", "cuda") and not low.startswith("cuda:"):
        msg = f"device {device!r}: TensorRT runs on NVIDIA GPUs only; use 'gpu' or 'cuda:N'"
        raise ConfigError(msg)
    if not torch.cuda.is_available():
        msg = f"device {device!r}: no CUDA device is visible (or torch is a CPU build)"
        raise BackendUnavailable(msg)
    return torch.device("cuda:0" if low in ("gpu", "cuda") else low)


class TensorRTSession(Session):
    """A deserialized TensorRT engine and its execution context. Build it with `TensorRTBackend().load`."""

    backend = "tensorrt"

    def __init__(self, artifact: Path, options: SessionOptions) -> None:
        # "cpu" is SessionOptions' default; for an engine it can only mean "the default GPU".
        self.device = cuda_device("gpu" if options.device == "cpu" else options.device)
        with torch.cuda.device(self.device):
            self._logger = _TrtLogger()  # TensorRT keeps a raw pointer to it: it must outlive the runtime
            self._runtime = trt.Runtime(self._logger)
            engine = self._runtime.deserialize_cuda_engine(artifact.read_bytes())
            if engine is None:
                msg = (f"TensorRT cannot deserialize {str(artifact)!r}: engines only load on the GPU model and "
                       f"TensorRT version ({trt.__version__} here) they were built with; rebuild it on this device")
                raise PackageError(msg)
            self._engine = engine
            self._context = engine.create_execution_context()
            self._stream = torch.cuda.Stream(self.device)
        inputs: list[TensorSpec] = []
        outputs: list[TensorSpec] = []
        self._torch_dtypes: dict[str, torch.dtype] = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            dtype = _DTYPES.get(engine.get_tensor_dtype(name))
            if dtype is None:
                msg = f"engine tensor {name!r} has type {engine.get_tensor_dtype(name)}, which tierkit does not map"
                raise PackageError(msg)
            shape = tuple(axis_name(a) if d < 0 else int(d) for a, d in enumerate(engine.get_tensor_shape(name)))
            spec = TensorSpec(name, dtype[0], shape)
            self._torch_dtypes[name] = dtype[1]
            (inputs if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else outputs).append(spec)
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self.precision = options.precision
        self._lock = threading.Lock()

    def profile_range(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(min, max) shape of input `name` allowed by optimization profile 0."""
        low, _, high = self._engine.get_tensor_profile_shape(name, 0)
        return tuple(low), tuple(high)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        specs = self.inputs
        if len(inputs) != len(specs):
            check_inputs(specs, inputs)
        ctx, device = self._context, self.device
        with self._lock, torch.cuda.device(device), torch.cuda.stream(self._stream):
            keep = []  # device tensors must outlive execute_async_v3
            for spec in specs:
                array = inputs.get(spec.name)
                if not isinstance(array, np.ndarray) or not spec.matches(array):
                    check_inputs(specs, inputs)
                assert array is not None  # check_inputs raised for a missing input
                tensor = torch.from_numpy(np.ascontiguousarray(array)).to(device)
                if not ctx.set_input_shape(spec.name, tuple(array.shape)):
                    low, high = self.profile_range(spec.name)
                    msg = (f"input {spec.name!r}: shape {list(array.shape)} is outside the engine's optimization "
                           f"profile {list(low)}..{list(high)}; rebuild the engine with a wider profile")
                    raise InputError(msg)
                ctx.set_tensor_address(spec.name, tensor.data_ptr())
                keep.append(tensor)
            results = {}
            for spec in self.outputs:
                out = torch.empty(tuple(ctx.get_tensor_shape(spec.name)), dtype=self._torch_dtypes[spec.name],
                                  device=device)
                ctx.set_tensor_address(spec.name, out.data_ptr())
                results[spec.name] = out
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                msg = "TensorRT execute_async_v3 failed; set the 'runtimes.trt_backend' logger to DEBUG for details"
                raise InferenceError(msg)
            return {name: out.cpu().numpy() for name, out in results.items()}

    def _close(self) -> None:
        self._stream.synchronize()
        del self._context, self._engine, self._runtime


class TensorRTBackend:
    """Loads serialized TensorRT engines onto an NVIDIA GPU."""

    name = "tensorrt"

    def load(self, artifact: Path, options: SessionOptions) -> TensorRTSession:
        return TensorRTSession(Path(artifact), options)
