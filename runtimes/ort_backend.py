"""onnxruntime backend: one `InferenceSession` per model, created at load and reused.

Execution providers come from `SessionOptions.providers` when given, else from the device:

- "cpu" (default): CPUExecutionProvider.
- "gpu", "cuda", "cuda:N": TensorRT, then CUDA (on device N), then CPU.
- an OpenVINO device name in upper case ("CPU", "GPU", "NPU", "AUTO"): the OpenVINO execution
  provider with that `device_type`, then CPU.

Only providers this onnxruntime build lists in `get_available_providers()` are requested; the
rest are dropped with a warning. After creation the session's actual providers are compared with
the preferred one, because onnxruntime falls back to CPU without failing.

The hot path passes the input dict straight to onnxruntime and zips the outputs. Bad input is
caught by onnxruntime itself; the except clause (free when nothing fails) re-checks the inputs
against the specs to raise an `InputError` that names the input.

Example:
    >>> with OrtBackend().load(Path("digits.onnx"), SessionOptions(intra_op_threads=2)) as s:
    ...     logits = s.run({"x": x})["logits"]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from runtimes.errors import ConfigError, InferenceError, InputError, PackageError
from runtimes.session import Session, SessionOptions, axis_name
from runtimes.spec import DTYPES, TensorSpec, input_error

logger = logging.getLogger(__name__)

_CPU = "CPUExecutionProvider"
_CUDA = "CUDAExecutionProvider"
_TRT = "TensorrtExecutionProvider"
_OPENVINO = "OpenVINOExecutionProvider"

_ORT_TYPES = {d.onnx: d.name for d in DTYPES.values()}

# What onnxruntime raises for a bad feed: its Python wrapper (ValueError for a missing name), the
# binding (RuntimeError for a value that is no array) and the core (InvalidArgument).
_INPUT_ERRORS = (ort_state.InvalidArgument, ValueError, TypeError, KeyError, RuntimeError)
_RUN_ERRORS = (ort_state.Fail, ort_state.RuntimeException, ort_state.NotImplemented, ort_state.EPFail)


def trt_provider_options(artifact: Path | None, options: SessionOptions, device_id: str) -> dict[str, Any]:
    """onnxruntime's TensorRT provider options: an engine cache beside the model, explicit shape profiles.

    Without a cache every process builds its engines again (minutes for a large model), and without
    explicit profiles a batch size the provider has not seen rebuilds an engine on the request path.
    Profiles span batch 1 .. `options.max_batch` on axis 0 of every input whose other axes are fixed;
    fp16 and int8 variants enable those kernels, fp32 ones keep TensorRT's fp32 (TF32 is a CUDA-provider
    setting and stays off there).
    """
    opts: dict[str, Any] = {"device_id": device_id, "trt_timing_cache_enable": "True"}
    if options.precision in ("fp16", "int8"):
        opts["trt_fp16_enable"] = "True"
    if options.precision == "int8":
        opts["trt_int8_enable"] = "True"
    if artifact is None:
        return opts
    cache = artifact.parent / ".trt-cache"
    opts.update(trt_engine_cache_enable="True", trt_engine_cache_path=str(cache), trt_timing_cache_path=str(cache))
    profiles = _batch_profiles(artifact, options.max_batch)
    if profiles:
        for key, shapes in zip(("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes"),
                               profiles, strict=True):
            opts[key] = shapes
    return opts


def _batch_profiles(artifact: Path, max_batch: int) -> tuple[str, str, str] | None:
    """"name:1x3x224x224,..." strings for min/opt/max, when only axis 0 of the inputs is dynamic."""
    import onnx

    try:
        graph = onnx.load(str(artifact), load_external_data=False).graph
    except Exception:  # the session itself will report an unreadable file
        return None
    inits = {t.name for t in graph.initializer}
    rows: list[tuple[str, list[int]]] = []
    for vi in graph.input:
        if vi.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                for d in vi.type.tensor_type.shape.dim]
        if not dims or -1 in dims[1:]:
            return None
        rows.append((vi.name, dims[1:]))

    def text(batch: int) -> str:
        return ",".join(f"{name}:{'x'.join(str(d) for d in (batch, *rest))}" for name, rest in rows)

    return text(1), text(1), text(max_batch)


def _device_providers(device: str, artifact: Path | None = None,
                      options: SessionOptions | None = None) -> list[str | tuple[str, dict[str, Any]]]:
    dev = device.strip()
    low = dev.lower()
    if low.startswith("cuda") or dev == "gpu":
        index = low.partition(":")[2] or "0"
        if not index.isdigit():
            msg = f"device {device!r}: expected 'cuda:<index>', e.g. 'cuda:0'"
            raise ConfigError(msg)
        trt = trt_provider_options(artifact, options or SessionOptions(), index)
        return [(_TRT, trt), (_CUDA, {"device_id": index, "use_tf32": "0"}), _CPU]
    if dev == "cpu":
        return [_CPU]
    if dev.isupper() or dev.startswith(("AUTO", "HETERO", "MULTI")):
        return [(_OPENVINO, {"device_type": dev}), _CPU]
    msg = f"device {device!r} is not 'cpu', 'gpu', 'cuda:N' or an OpenVINO device name (CPU, GPU, NPU, AUTO)"
    raise ConfigError(msg)


def _provider_name(entry: str | tuple[str, dict[str, Any]]) -> str:
    return entry if isinstance(entry, str) else entry[0]


def select_providers(options: SessionOptions, available: list[str] | None = None,
                     artifact: Path | None = None) -> list[str | tuple[str, dict[str, Any]]]:
    """The execution providers to request, best first, restricted to those this build has."""
    available = ort.get_available_providers() if available is None else available
    wanted: list[str | tuple[str, dict[str, Any]]] = (
        list(options.providers) if options.providers else _device_providers(options.device, artifact, options))
    chosen = [p for p in wanted if _provider_name(p) in available]
    missing = [_provider_name(p) for p in wanted if _provider_name(p) not in available]
    if missing:
        logger.warning("onnxruntime here has no %s (it has %s); falling back to the others",
                       missing, available)
    return chosen or [_CPU]


def _spec(arg: Any, where: str) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        msg = f"{where}: tensor {arg.name!r} has type {arg.type}; tierkit runs numeric tensors only"
        raise ConfigError(msg)
    shape = tuple(d if isinstance(d, int | str) else axis_name(i) for i, d in enumerate(arg.shape))
    return TensorSpec(arg.name, dtype, shape)


class OrtSession(Session):
    """A model loaded in onnxruntime. Build it with `OrtBackend().load(...)`."""

    backend = "onnxruntime"

    def __init__(self, artifact: Path, options: SessionOptions) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = options.intra_op_threads
        so.inter_op_num_threads = options.inter_op_threads
        if options.inter_op_threads > 1:
            so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        if options.spin is not None:
            for pool in ("intra_op", "inter_op"):
                so.add_session_config_entry(f"session.{pool}.allow_spinning", "1" if options.spin else "0")
        providers = select_providers(options, artifact=artifact)
        try:
            self._sess = ort.InferenceSession(str(artifact), so, providers=providers)
        except (ort_state.InvalidProtobuf, ort_state.InvalidGraph, ort_state.NoSuchFile,
                ort_state.Fail, ort_state.NotImplemented) as exc:
            msg = f"onnxruntime cannot load {str(artifact)!r}: {exc}"
            raise PackageError(msg) from exc
        self.providers: tuple[str, ...] = tuple(self._sess.get_providers())
        preferred = _provider_name(providers[0])
        if preferred not in self.providers:
            logger.warning("onnxruntime fell back from %s to %s for %s", preferred, list(self.providers),
                           artifact.name)
        where = f"model {artifact.name!r}"
        self.inputs = tuple(_spec(a, where) for a in self._sess.get_inputs())
        self.precision = options.precision
        self.outputs = tuple(_spec(a, where) for a in self._sess.get_outputs())
        self._output_names = [s.name for s in self.outputs]

    @property
    def session_options(self) -> ort.SessionOptions:
        """The onnxruntime options the session runs with (thread counts, execution mode)."""
        return self._sess.get_session_options()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self._output_names
        try:
            return dict(zip(names, self._sess.run(names, inputs), strict=True))
        except _INPUT_ERRORS as exc:
            raise self._input_error(inputs, exc) from exc
        except _RUN_ERRORS as exc:
            msg = f"onnxruntime failed while running: {exc}"
            raise InferenceError(msg) from exc

    def _input_error(self, inputs: Mapping[str, np.ndarray], exc: Exception) -> InferenceError:
        precise = input_error(self.inputs, inputs)
        if precise is not None:
            return precise
        if isinstance(exc, ort_state.InvalidArgument | ValueError | TypeError | RuntimeError):
            msg = f"onnxruntime rejected the inputs: {exc}; the model takes {list(self.inputs)}"
            return InputError(msg)
        return InferenceError(f"onnxruntime failed while running: {exc}")

    def _close(self) -> None:
        del self._sess


class OrtBackend:
    """Loads `.onnx` files into onnxruntime sessions."""

    name = "onnxruntime"

    def load(self, artifact: Path, options: SessionOptions) -> OrtSession:
        return OrtSession(Path(artifact), options)
