"""OpenVINO: ONNX -> IR export, and NNCF int8 with its accuracy-controlled mode as the repair.

`export` converts the fp32 ONNX model to IR (`model.xml` + `model.bin`), with f16 weights when
asked (OpenVINO CPU computes them in f32: smaller, not faster; GPU and NPU run f16).

`quantize` runs `nncf.quantize` (the transformer model type for embeddings and attention
graphs). When the guard fails it reruns as `nncf.quantize_with_accuracy_control`: NNCF ranks the
quantized layers by their effect on a validation metric and reverts the worst to fp32 until the
drop is within the limit. The metric mirrors the guard: accuracy with labels, top-1 agreement
with the reference without, mean cosine for embeddings.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nncf
import numpy as np
import openvino as ov

from compilers.passes import PassContext, PassResult
from compilers.sequence import decode
from runtimes.errors import CompileError
from runtimes.spec import Task

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _quiet_nncf() -> Iterator[None]:
    """NNCF logs to a stdout handler and draws rich progress bars on stdout: keep stdout for results.

    The handler's stream is swapped by assignment, not `setStream`, which flushes the old stream:
    NNCF binds it at import, and when that happened under a redirected stdout it may be closed now.
    """
    from nncf.common.logging.logger import stdout_handler

    old = stdout_handler.stream
    stdout_handler.stream = sys.stderr
    nncf_logger = logging.getLogger("nncf")
    level = nncf_logger.level
    nncf_logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        stdout_handler.stream = sys.stdout if getattr(old, "closed", False) else old
        nncf_logger.setLevel(level)


def export(artifact: Path, ctx: PassContext, *, compress_to_fp16: bool = False) -> PassResult:
    """Convert ONNX to OpenVINO IR in `ctx.workdir` (f16 weights when `compress_to_fp16`)."""
    out = ctx.workdir / "model.xml"
    try:
        model = ov.convert_model(str(artifact))
        ov.save_model(model, str(out), compress_to_fp16=compress_to_fp16)
    except (RuntimeError, OSError) as exc:
        msg = f"OpenVINO cannot convert {artifact.name}: {exc}"
        raise CompileError(msg) from exc
    return PassResult(out, {"name": "export_openvino", "compress_to_fp16": compress_to_fp16,
                            "openvino": ov.__version__})


def _is_transformer(model: ov.Model, task: str) -> bool:
    ops = {op.get_type_name() for op in model.get_ops()}
    return task == Task.EMBEDDING or ("Softmax" in ops and "MatMul" in ops)


def _uses_cosine(ctx: PassContext) -> bool:
    return "min_cosine_mean" in ctx.guard.required(ctx.task)


def _metric_fn(ctx: PassContext) -> Any:
    """NNCF validation function: (compiled model, items) -> (metric, per-item values), higher is better.

    The metric is the guard's: for sequences, the share of rows whose decoded sequence is unchanged;
    mean cosine to the reference when the guard bounds it, else accuracy (labels) or top-1 agreement
    with the reference.
    """
    cosine, name = _uses_cosine(ctx), ctx.output_names[0] if ctx.output_names else None
    sequence = ctx.task == Task.SEQUENCE

    def validate(compiled: Any, items: Any) -> tuple[float, list[float]]:
        values: list[float] = []
        for inputs, reference, label in items:
            result = compiled(inputs)
            out = np.asarray(result[name] if name is not None else result[0], np.float64)
            ref = np.asarray(reference, np.float64)
            if sequence:
                values.extend(float(r == o) for r, o in zip(decode(ref, ctx.decoder), decode(out, ctx.decoder),
                                                            strict=True))
            elif not cosine:
                target = label if label is not None else ref.argmax(axis=1)
                values.extend((out.argmax(axis=1) == target).astype(float).tolist())
            else:
                o, r = out.reshape(len(out), -1), ref.reshape(len(ref), -1)
                denom = np.linalg.norm(o, axis=1) * np.linalg.norm(r, axis=1)
                values.extend(((o * r).sum(axis=1) / np.maximum(denom, 1e-30)).tolist())
        return float(np.mean(values)), values

    return validate


def quantize(artifact: Path, ctx: PassContext, *, preset: str | None = None, model_type: str | None = "auto",
             subset_size: int = 300, fast_bias_correction: bool = True, ignored: tuple[str, ...] = (),
             accuracy_control: bool = True, max_iterations: int = 20) -> PassResult:
    """NNCF post-training int8 of the IR `artifact`; accuracy-controlled rerun when the guard fails.

    Args:
        artifact: the fp32 OpenVINO IR.
        ctx: pass context.
        preset: "performance" (symmetric) or "mixed"; NNCF's default when None.
        model_type: "transformer", None, or "auto" (transformer for embeddings and attention graphs).
        subset_size: calibration samples.
        fast_bias_correction: NNCF's fast bias correction (False: slower, sometimes more accurate).
        ignored: node names kept in fp32.
        accuracy_control: rerun with `quantize_with_accuracy_control` when the guard fails.
        max_iterations: layers the accuracy-controlled mode may revert.
    """
    core = ov.Core()
    model = core.read_model(str(artifact))
    if model_type == "auto":
        model_type = "transformer" if _is_transformer(model, ctx.task) else None
    calib = ctx.calibration.subset(subset_size)
    calibration = nncf.Dataset(list(calib.batches(1)))
    kwargs: dict[str, Any] = {"subset_size": len(calib), "fast_bias_correction": fast_bias_correction}
    if model_type == "transformer":
        kwargs["model_type"] = nncf.ModelType.TRANSFORMER
    if preset is not None:
        kwargs["preset"] = nncf.QuantizationPreset(preset)
    kept = output_concats(model)
    ignored = (*ignored, *(k for k in kept if k not in ignored))
    if ignored:
        kwargs["ignored_scope"] = nncf.IgnoredScope(names=list(ignored), validate=False)
    record: dict[str, Any] = {"name": "quantize_nncf", "nncf": nncf.__version__, "preset": preset,
                              "model_type": model_type, "subset_size": len(calib),
                              "fast_bias_correction": fast_bias_correction, "ignored": list(ignored)}
    if kept:
        record["kept_fp32"] = {"nodes": kept, "why": "Concat forming a graph output (a shared scale across unlike "
                                                     "inputs)"}
    out = ctx.workdir / "model.xml"
    try:
        with _quiet_nncf():
            quantized = nncf.quantize(model, calibration, **kwargs)
    except Exception as exc:  # NNCF raises many types (its own, RuntimeError, ValueError)
        msg = f"nncf.quantize failed: {exc}"
        raise CompileError(msg) from exc
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    record["fake_quantize_ops"] = _count_fq(quantized)
    fid, verdict = ctx.evaluate(out, "openvino")
    if verdict.passed or not accuracy_control:
        return PassResult(out, record)
    if ctx.deadline is not None and time.monotonic() > ctx.deadline:
        record["sensitivity"] = {"note": f"{verdict.reason}; max_time was spent before the accuracy-controlled rerun"}
        return PassResult(out, record)
    futile = ctx.repair_pays(out, "openvino") if ctx.repair_pays is not None else ""
    if futile:
        record["sensitivity"] = {"note": f"{verdict.reason}; {futile}"}
        return PassResult(out, record)
    logger.info("NNCF int8 failed the guard (%s); rerunning in accuracy-controlled mode", verdict.reason)
    out = _accuracy_controlled(model, calibration, ctx, kwargs, max_iterations, record, fid)
    return PassResult(out, record)


def _accuracy_controlled(model: ov.Model, calibration: Any, ctx: PassContext, kwargs: dict[str, Any],
                         max_iterations: int, record: dict[str, Any], first: dict[str, float]) -> Path:
    if ctx.reference is None:
        msg = "accuracy-controlled quantization needs the reference outputs on the validation data"
        raise CompileError(msg)
    labels = ctx.validation.labels
    items = [(batch, ctx.reference[i:i + 1], None if labels is None else labels[i:i + 1])
             for i, batch in enumerate(ctx.validation.batches(1))]
    validation = nncf.Dataset(items, lambda item: item[0])
    if ctx.task == Task.SEQUENCE:
        max_drop = 1.0 - ctx.guard.min_rows_unchanged
    elif _uses_cosine(ctx):
        max_drop = 1.0 - float(ctx.guard.required(ctx.task)["min_cosine_mean"])
    else:
        max_drop = ctx.guard.max_drop / 100.0
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    restorer = AdvancedAccuracyRestorerParameters(max_num_iterations=max_iterations)
    try:
        with _quiet_nncf():
            quantized = nncf.quantize_with_accuracy_control(
                model, calibration, validation, _metric_fn(ctx), max_drop=max_drop * 0.9,
                drop_type=nncf.DropType.ABSOLUTE, advanced_accuracy_restorer_parameters=restorer, **kwargs)
    except Exception as exc:  # NNCF raises many types
        msg = f"nncf.quantize_with_accuracy_control failed: {exc}"
        raise CompileError(msg) from exc
    out = ctx.workdir / "accuracy_control" / "model.xml"
    out.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(quantized, str(out), compress_to_fp16=False)
    fq = _count_fq(quantized)
    metric = "sequence_rows_unchanged" if ctx.task == Task.SEQUENCE else "cosine_mean" if _uses_cosine(ctx) \
        else "accuracy"
    record["accuracy_control"] = {"used": True, "metric": metric,
                                  "max_drop": max_drop * 0.9, "max_iterations": max_iterations,
                                  "first_attempt": {k: round(v, 6) for k, v in first.items()},
                                  "fake_quantize_ops": fq}
    if fq == 0:
        record["sensitivity"] = {"note": "the accuracy-controlled mode reverted every layer: nothing is int8 any more"}
    return out


_SHAPE_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Convert"}


def output_concats(model: ov.Model) -> list[str]:
    """Friendly names of the Concat ops whose result is a model output (directly or through reshapes)."""
    found: list[str] = []
    for result in model.get_results():
        node = result.input_value(0).get_node()
        while node.get_type_name() in _SHAPE_OPS and node.get_input_size():
            node = node.input_value(0).get_node()
        if node.get_type_name() == "Concat" and node.get_friendly_name() not in found:
            found.append(node.get_friendly_name())
    return found


def _count_fq(model: ov.Model) -> int:
    return sum(op.get_type_name() == "FakeQuantize" for op in model.get_ops())
