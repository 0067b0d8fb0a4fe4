"""onnxruntime int8: static QDQ (calibrated) or dynamic, with sensitivity-driven repair.

Static: activations are calibrated once (MinMax, Entropy or Percentile) and the ranges cached,
so every repair attempt re-quantizes in milliseconds; weights are per-channel by default (on the
digits CNN per-tensor lost 2 points where per-channel lost none). The model is pre-processed first
(`quant_pre_process`: graph optimisation and shape inference). It matters: the torch exporter folds
BatchNorm into Conv and shares equal folded biases through Identity nodes, a Conv so fed keeps an
fp32 bias and is not fused into an int8 convolution; QDQ over the raw ResNet-like export ran at
0.73x fp32 where the pre-processed one ran at 1.8x (u8s8, 224x224, 2 threads).
Symbolic shape inference fails on transformer exports ("Incomplete symbolic shape inference"):
then it is skipped, and when pre-processing fails altogether the raw export is quantized. A
BERT-fused graph needs an explicit default tensor type. On x86 the activations are best uint8
(u8s8, what the VNNI kernels take; s8s8 ran at 0.60x there): targets say which.

Dynamic: weights int8 ahead of time, activations per batch at run time; only MatMul-like nodes
(Conv through ConvInteger is slower than fp32 on CPU). A model without MatMul skips this rung.

When the guard fails, `sensitivity.search` keeps the most sensitive nodes in fp32.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

from compilers.passes import PassContext, PassResult, PassSkipped, sensitivity
from runtimes.errors import CompileError, ConfigError

logger = logging.getLogger(__name__)

_METHODS = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
            "percentile": CalibrationMethod.Percentile}
_TYPES = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
_DYNAMIC_OPS = ("MatMul",)
_RANKING_SAMPLES = 32


class _DropAdvice(logging.Filter):
    """onnxruntime.quantization logs on the root logger, at every call, advice to pre-process (we
    quantize the raw export on purpose: pre-processing fails on transformer exports) and a note per
    1-D weight that per-channel does not apply to (it is quantized per tensor, as it should be)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("Please consider") or "is out-of-range for weight" in text)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    root, advice = logging.getLogger(), _DropAdvice()
    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)


class _Reader(CalibrationDataReader):  # type: ignore[misc]
    """Batches for the calibrator; `set_range` lets it collect a few batches at a time (see below)."""

    def __init__(self, batches: Sequence[dict[str, np.ndarray]]) -> None:
        self._batches = list(batches)
        self._it = iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def set_range(self, start_index: int, end_index: int) -> None:
        self._it = iter(self._batches[start_index:end_index])


def quantize(artifact: Path, ctx: PassContext, *, mode: str = "static", per_channel: bool | None = None,
             method: str = "minmax", percentile: float = 99.999, reduce_range: bool = False,
             activation_type: str = "int8", weight_type: str = "int8", op_types: Sequence[str] | None = None,
             calibration_samples: int = 300, calibration_batch: int = 16, exclude: Sequence[str] = (),
             repair: bool = True, max_attempts: int = 8, preprocess: bool = True) -> PassResult:
    """Quantize `artifact` (fp32 ONNX) to int8 with onnxruntime; repair it when the guard fails.

    Args:
        artifact: the fp32 ONNX model.
        ctx: pass context (data, guard, evaluate).
        mode: "static" (QDQ, calibrated) or "dynamic".
        per_channel: per-channel weights (default: True for static, False for dynamic).
        method: static calibration, "minmax", "entropy" or "percentile".
        percentile: the percentile kept by the "percentile" method.
        reduce_range: 7-bit weights (for CPUs without VNNI).
        activation_type, weight_type: "int8" or "uint8".
        op_types: op types to quantize (default: every op onnxruntime can quantize; MatMul for dynamic).
        calibration_samples: how many calibration samples to calibrate on.
        calibration_batch: samples per calibration batch.
        exclude: node names kept in fp32 from the start.
        repair: exclude the most sensitive nodes while the guard fails.
        max_attempts: re-quantizations the repair may try.
        preprocess: run onnxruntime's `quant_pre_process` first (static mode; see the module doc).
    """
    if mode not in ("static", "dynamic"):
        msg = f"quantize_ort mode {mode!r} is not 'static' or 'dynamic'"
        raise ConfigError(msg)
    if method not in _METHODS:
        msg = f"calibration method {method!r} is not one of {', '.join(_METHODS)}"
        raise ConfigError(msg)
    for t in (activation_type, weight_type):
        if t not in _TYPES:
            msg = f"quantization type {t!r} is not one of {', '.join(_TYPES)}"
            raise ConfigError(msg)
    per_channel = (mode == "static") if per_channel is None else per_channel
    record: dict[str, Any] = {"name": "quantize_ort", "mode": mode, "per_channel": per_channel,
                              "reduce_range": reduce_range, "weight_type": weight_type}
    artifact = artifact.resolve()
    with contextlib.chdir(ctx.workdir):  # onnxruntime's shape inference writes temp files into the cwd
        return _quantize(artifact, ctx, record, mode=mode, per_channel=per_channel, method=method,
                         percentile=percentile, reduce_range=reduce_range, activation_type=activation_type,
                         weight_type=weight_type, op_types=op_types, calibration_samples=calibration_samples,
                         calibration_batch=calibration_batch, exclude=exclude, repair=repair,
                         max_attempts=max_attempts, preprocess=preprocess)


def _quantize(artifact: Path, ctx: PassContext, record: dict[str, Any], *, mode: str, per_channel: bool,
              method: str, percentile: float, reduce_range: bool, activation_type: str, weight_type: str,
              op_types: Sequence[str] | None, calibration_samples: int, calibration_batch: int,
              exclude: Sequence[str], repair: bool, max_attempts: int, preprocess: bool) -> PassResult:
    artifact, record["opset"] = upgrade_opset(artifact, ctx.workdir / "opset13.onnx")
    if mode == "static" and preprocess:
        artifact, record["preprocess"] = _preprocess(artifact, ctx.workdir / "preprocessed.onnx")
    artifact, named = _name_nodes(artifact, ctx.workdir / "named.onnx")
    model = onnx.load(str(artifact))
    kept = output_concats(model) if mode == "static" else []
    if kept:
        # A Concat that forms a graph output joins unlike tensors (box coordinates in pixels, class scores in
        # [0, 1]); QDQ gives its inputs one shared scale, which rounds the small-valued part to zero.
        record["kept_fp32"] = {"nodes": kept, "why": "Concat forming a graph output (a shared scale across unlike "
                                                     "inputs)"}
        exclude = [*exclude, *kept]
    if named:
        record["named_nodes"] = named
    # CalibStridedMinMax (despite its name, any method) makes the calibrator reduce every batch as it
    # goes: by default it keeps every intermediate tensor of every batch, gigabytes on a transformer.
    common = {"per_channel": per_channel, "reduce_range": reduce_range, "weight_type": _TYPES[weight_type],
              "extra_options": {"DefaultTensorType": onnx.TensorProto.FLOAT, "CalibStridedMinMax": 1}}
    out = ctx.workdir / "model.onnx"
    n_attempt = [0]

    def target() -> Path:
        n_attempt[0] += 1
        return out if n_attempt[0] == 1 else ctx.workdir / f"attempt{n_attempt[0]}" / "model.onnx"

    if mode == "dynamic":
        ops = list(op_types or _DYNAMIC_OPS)
        if not any(n.op_type in ops for n in model.graph.node):
            msg = f"no {'/'.join(ops)} node to quantize dynamically (the model has {_op_summary(model)})"
            raise PassSkipped(msg)

        def build(excluded: list[str]) -> Path:
            path = target()
            path.parent.mkdir(parents=True, exist_ok=True)
            with _quiet():
                quantize_dynamic(str(artifact), str(path), op_types_to_quantize=ops,
                                 nodes_to_exclude=[*exclude, *excluded], **common)
            return path

        def rank() -> list[tuple[str, float]]:
            batches = list(ctx.calibration.subset(_RANKING_SAMPLES).batches(4))
            return sensitivity.dynamic_ranking(model, batches, ops, per_channel=per_channel, threads=ctx.threads)
        record["op_types"] = ops
    else:
        cache = ctx.workdir / f"calibration-{method}.json"
        calib = ctx.calibration.subset(calibration_samples)
        # Histogram calibrators stack per-batch arrays: every batch must have the same size.
        calibration_batch = min(calibration_batch, len(calib))
        calib = calib.subset(len(calib) // calibration_batch * calibration_batch)
        record.update(method=method, activation_type=activation_type, calibration_samples=len(calib))
        if method == "percentile":
            common["extra_options"]["CalibPercentile"] = percentile
            record["percentile"] = percentile
        if op_types:
            record["op_types"] = list(op_types)

        def build(excluded: list[str]) -> Path:
            path = target()
            path.parent.mkdir(parents=True, exist_ok=True)
            reader = None if cache.is_file() else _Reader(list(calib.batches(calibration_batch)))
            try:
                with _quiet():
                    quantize_static(str(artifact), str(path), reader, quant_format=QuantFormat.QDQ,
                                    op_types_to_quantize=list(op_types) if op_types else None,
                                    activation_type=_TYPES[activation_type], nodes_to_exclude=[*exclude, *excluded],
                                    calibrate_method=_METHODS[method], calibration_cache_path=str(cache), **common)
            except (ValueError, RuntimeError, KeyError) as exc:
                msg = f"onnxruntime static quantization failed: {exc}"
                raise CompileError(msg) from exc
            return path

        def rank() -> list[tuple[str, float]]:
            batches = list(ctx.calibration.subset(_RANKING_SAMPLES).batches(4))
            return sensitivity.qdq_ranking(model, onnx.load(str(out)), batches, threads=ctx.threads)

    first = build([])
    fid, verdict = ctx.evaluate(first, "onnxruntime")
    record["excluded_nodes"] = list(exclude)
    if verdict.passed or not repair:
        return PassResult(first, record)
    futile = ctx.repair_pays(first, "onnxruntime") if ctx.repair_pays is not None else ""
    if futile:
        record["sensitivity"] = {"note": f"{verdict.reason}; {futile}", "repaired": False}
        return PassResult(first, record)
    deadline, started = ctx.repair_deadline(), time.monotonic()
    ranking = rank()
    ranked_s = time.monotonic() - started
    logger.info("int8 (%s) failed the guard (%s); ranked %d nodes by sensitivity", mode, verdict.reason,
                len(ranking))
    result = sensitivity.search(build, lambda p: ctx.evaluate(p, "onnxruntime"), ranking,
                                first=(first, fid, verdict), max_attempts=max_attempts, deadline=deadline)
    record["excluded_nodes"] = [*exclude, *result.excluded]
    record["sensitivity"] = {"method": "qdq-noise" if mode == "static" else "modeled-dynamic-noise",
                             "top": [{"node": n, "noise": round(s, 6)} for n, s in ranking[:10]],
                             "attempts": result.attempts, "repaired": result.passed,
                             "seconds": {"rank": round(ranked_s, 2),
                                         "search": round(time.monotonic() - started - ranked_s, 2)}}
    sensitivity.note_time_spent(record["sensitivity"], result, ctx.repair_budget)
    quantized = {n.name for n in model.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")}
    if quantized and quantized <= set(record["excluded_nodes"]):
        record["sensitivity"]["repaired"] = False
        record["sensitivity"]["note"] = "every Conv/MatMul/Gemm is excluded: nothing is int8 any more"
    return PassResult(result.artifact, record)


QDQ_OPSET = 13
_SHAPE_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"}


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def upgrade_opset(artifact: Path, out: Path) -> tuple[Path, str]:
    """Graphs below opset 13 upgraded with onnx's version converter before QDQ (per-channel
    DequantizeLinear needs 13); the original is kept where the conversion fails. Returns the model
    to quantize and what was done."""
    model = onnx.load(str(artifact))
    opset = _opset(model)
    if opset >= QDQ_OPSET:
        return artifact, str(opset)
    try:
        from onnx import version_converter

        converted = version_converter.convert_version(model, QDQ_OPSET)
        onnx.checker.check_model(converted)
        onnx.save(converted, str(out))
    except Exception as exc:  # the converter raises many types for ops it cannot adapt
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        logger.info("opset %d -> %d conversion failed (%s); quantizing the original", opset, QDQ_OPSET, why)
        return artifact, f"{opset} (upgrade to {QDQ_OPSET} failed: {why})"
    return out, f"{opset} -> {QDQ_OPSET}"


def _name_nodes(artifact: Path, out: Path) -> tuple[Path, int]:
    """Exclusion and sensitivity ranking go by node name: give unnamed nodes one (`<op>_<index>`)."""
    model = onnx.load(str(artifact))
    unnamed = [(i, n) for i, n in enumerate(model.graph.node) if not n.name]
    if not unnamed:
        return artifact, 0
    taken = {n.name for n in model.graph.node}
    for i, node in unnamed:
        name = f"{node.op_type}_{i}"
        while name in taken:
            name += "_"
        node.name = name
        taken.add(name)
    onnx.save(model, str(out))
    return out, len(unnamed)


def output_concats(model: onnx.ModelProto) -> list[str]:
    """Names of the Concat nodes whose result is a graph output (directly or through reshapes/transposes)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    found = []
    for out in model.graph.output:
        node = producer.get(out.name)
        while node is not None and node.op_type in _SHAPE_OPS and node.input:
            node = producer.get(node.input[0])
        if node is not None and node.op_type == "Concat" and node.name not in found:
            found.append(node.name)
    return found


def _preprocess(artifact: Path, out: Path) -> tuple[Path, str]:
    """`quant_pre_process` with full shape inference, else without the symbolic part, else nothing.

    Returns the model to quantize and what was done ("full", "no-symbolic-shape" or "none: why").
    """
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out.parent.mkdir(parents=True, exist_ok=True)
    why = ""
    for label, skip_symbolic in (("full", False), ("no-symbolic-shape", True)):
        try:
            with _quiet():
                quant_pre_process(str(artifact), str(out), skip_symbolic_shape=skip_symbolic)
            return out, label
        except Exception as exc:  # onnxruntime raises bare Exception from shape inference
            why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            logger.info("quant_pre_process (%s) failed: %s", label, why)
    return artifact, f"none: {why}"


def _op_summary(model: onnx.ModelProto) -> str:
    counts: dict[str, int] = {}
    for n in model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:6])
