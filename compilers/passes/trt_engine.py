"""TensorRT 10 engines (fp32, fp16, int8) with dynamic-shape optimization profiles.

One optimization profile covers every declared batch size: min = the smallest (1), opt = the
default batch size, max = the largest, so that running any of them never triggers an engine
rebuild. Other dynamic axes (e.g. sequence length) take their min/max from the calibration data
unless `shapes` overrides them.

int8 uses TensorRT's entropy (or min-max) calibrator on the calibration data, with the
calibration cache written next to the engine (`model.calib`) and shipped in the package, so a
rebuild on the device skips calibration. TensorRT 10.1 deprecates implicit (calibrated) int8 in
favour of explicit Q/DQ graphs; an input model that already holds QuantizeLinear/DequantizeLinear
nodes is built as explicit int8 without a calibrator.

Engines are specific to the GPU model and TensorRT version they are built with: the manifest
records both.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compilers.calibration import CalibrationData
from compilers.passes import PassContext, PassResult
from runtimes.errors import BackendUnavailable, CompileError, ConfigError
from runtimes.spec import TensorSpec

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]
Profile = tuple[Shape, Shape, Shape]


def shape_profiles(specs: Sequence[TensorSpec], data: CalibrationData, batch_sizes: Sequence[int],
                   shapes: Mapping[str, Sequence[Sequence[int]]] | None = None) -> dict[str, Profile]:
    """(min, opt, max) shape of every input for one optimization profile.

    Axis 0 spans 1 .. max(batch_sizes) with opt at batch_sizes[0]; other dynamic axes span the
    calibration data's size; fixed axes keep their size. `shapes` overrides an input entirely.
    """
    shapes = shapes or {}
    out: dict[str, Profile] = {}
    for spec in specs:
        if spec.name in shapes:
            lo, opt, hi = (tuple(int(d) for d in s) for s in shapes[spec.name])
            out[spec.name] = (lo, opt, hi)
            continue
        sample = data.inputs[spec.name].shape
        lo_dims, opt_dims, hi_dims = [], [], []
        for axis, dim in enumerate(spec.shape):
            if isinstance(dim, int) and dim > 0:
                lo_dims.append(dim)
                opt_dims.append(dim)
                hi_dims.append(dim)
            elif axis == 0:
                lo_dims.append(1)
                opt_dims.append(int(batch_sizes[0]))
                hi_dims.append(int(max(batch_sizes)))
            else:
                lo_dims.append(int(sample[axis]))
                opt_dims.append(int(sample[axis]))
                hi_dims.append(int(sample[axis]))
        out[spec.name] = (tuple(lo_dims), tuple(opt_dims), tuple(hi_dims))
    return out


def calibration_shapes(profiles: Mapping[str, Profile], batch: int) -> dict[str, tuple[int, ...]]:
    """The one shape per input the int8 calibrator feeds: `batch` rows, the profile's opt for the other axes."""
    return {name: (batch, *opt[1:]) for name, (_, opt, _) in profiles.items()}


def _has_qdq(path: Path) -> bool:
    import onnx

    return any(n.op_type == "QuantizeLinear" for n in onnx.load(str(path), load_external_data=False).graph.node)


def build(artifact: Path, ctx: PassContext, *, precision: str = "fp32", calibrator: str = "entropy",
          workspace_mb: int = 2048, calibration_batch: int = 8, calibration_samples: int = 512,
          shapes: Mapping[str, Sequence[Sequence[int]]] | None = None) -> PassResult:
    """Build a serialized TensorRT engine (`model.engine`) from the ONNX `artifact`.

    Args:
        artifact: the ONNX model.
        ctx: pass context (specs, calibration data, batch sizes).
        precision: "fp32", "fp16" or "int8".
        calibrator: int8 calibrator, "entropy" (IInt8EntropyCalibrator2) or "minmax".
        workspace_mb: builder workspace memory pool limit.
        calibration_batch: samples per calibration batch.
        calibration_samples: calibration samples used.
        shapes: per-input (min, opt, max) shapes overriding the derived profile.
    """
    if precision not in ("fp32", "fp16", "int8"):
        msg = f"TensorRT precision {precision!r} is not fp32, fp16 or int8"
        raise ConfigError(msg)
    try:
        import tensorrt as trt
    except ModuleNotFoundError:
        msg = "TensorRT engines need 'tensorrt' and an NVIDIA GPU: pip install 'tierkit[tensorrt]'"
        raise BackendUnavailable(msg) from None
    log = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(log)
    network = builder.create_network(0)  # TensorRT 10: networks are always explicit-batch
    parser = trt.OnnxParser(network, log)
    if not parser.parse_from_file(str(artifact)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        msg = f"TensorRT cannot parse {artifact.name}: {errors}"
        raise CompileError(msg)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    calib = ctx.calibration.subset(calibration_samples)
    profiles = shape_profiles(ctx.specs, calib, ctx.batch_sizes, shapes)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profiles.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    out = ctx.workdir / "model.engine"
    cache = ctx.workdir / "model.calib"
    record: dict[str, Any] = {"name": "tensorrt_engine", "precision": precision, "tensorrt": trt.__version__,
                              "profiles": {k: [list(s) for s in v] for k, v in profiles.items()},
                              "workspace_mb": workspace_mb}
    # TensorRT enables TF32 for fp32 layers by default on Ampere and later: an fp32 rung must compute in fp32.
    config.clear_flag(trt.BuilderFlag.TF32)
    record["tf32"] = False
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    elif precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
        config.set_flag(trt.BuilderFlag.FP16)  # layers int8 cannot take fall back to fp16, not fp32
        if _has_qdq(artifact):
            record["int8"] = "explicit-qdq"
        else:
            batch = min(calibration_batch, len(calib))
            config.int8_calibrator = _calibrator(trt, calibrator, calib, ctx.specs, batch, cache)
            # The calibrator feeds batches of exactly `batch` rows: its profile must be that shape (min = opt = max).
            calibration_profile = builder.create_optimization_profile()
            for name, shape in calibration_shapes(profiles, batch).items():
                calibration_profile.set_shape(name, shape, shape, shape)
            config.set_calibration_profile(calibration_profile)
            record.update(int8="calibrated", calibrator=calibrator, calibration_samples=len(calib),
                          calibration_batch=batch, calibration_cache=cache.name)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        msg = f"TensorRT failed to build the {precision} engine for {artifact.name}; see the TensorRT log above"
        raise CompileError(msg)
    out.write_bytes(bytes(engine))
    record["gpu"] = _gpu_name()
    return PassResult(out, record)


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except ModuleNotFoundError:
        return ""


def _calibrator(trt: Any, kind: str, data: CalibrationData, specs: Sequence[TensorSpec], batch: int,
                cache: Path) -> Any:
    """An int8 calibrator feeding `data` from GPU buffers (torch CUDA tensors) and caching its table."""
    try:
        import torch
    except ModuleNotFoundError:
        msg = "TensorRT int8 calibration copies batches to the GPU with torch: pip install 'tierkit[torch]'"
        raise BackendUnavailable(msg) from None
    if not torch.cuda.is_available():
        msg = "TensorRT int8 calibration needs a CUDA device; none is visible"
        raise BackendUnavailable(msg)
    base = trt.IInt8EntropyCalibrator2 if kind == "entropy" else trt.IInt8MinMaxCalibrator
    batch = min(batch, len(data))
    usable = data.subset(len(data) // batch * batch)

    class Calibrator(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)
            self._batches = iter(list(usable.batches(batch)))
            self._device: dict[str, Any] = {}

        def get_batch_size(self) -> int:
            return batch

        def get_batch(self, names: list[str]) -> list[int] | None:
            feed = next(self._batches, None)
            if feed is None:
                return None
            for name in names:
                self._device[name] = torch.from_numpy(np.ascontiguousarray(feed[name])).cuda()
            return [int(self._device[n].data_ptr()) for n in names]

        def read_calibration_cache(self) -> bytes | None:
            return cache.read_bytes() if cache.is_file() else None

        def write_calibration_cache(self, table: Any) -> None:
            cache.write_bytes(bytes(table))

    logger.info("TensorRT int8: calibrating on %d samples (%s) for inputs %s", len(usable), kind,
                [s.name for s in specs])
    return Calibrator()
