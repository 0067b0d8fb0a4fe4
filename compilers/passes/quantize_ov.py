"""OpenVINO: ONNX -> IR export, and NNCF int8 repaired by keeping its most sensitive ops in fp32.

`export` converts the fp32 ONNX model to IR (`model.xml` + `model.bin`), with f16 weights when
asked (OpenVINO CPU computes them in f32: smaller, not faster; GPU and NPU run f16).

`quantize` runs `nncf.quantize` (the transformer model type for embeddings and attention
graphs). When the guard fails, the ops whose quantized inputs inject the most noise are kept in
fp32, 1, 2, 4, ... at a time, each attempt judged by the compile's own guard (decoded sequences
included) until one passes (`quantize_ov_repair`). This replaces NNCF's accuracy-controlled mode,
which compiles the model once per quantizer group to rank them (most of a compile on small graphs).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runtimes.ov_import import openvino as ov  # before nncf, whose import loads OpenVINO

# isort: split
from openvino.frontend import GeneralFailure, OpConversionFailure

from compilers.passes import PassContext, PassResult, quantize_ov_repair, sensitivity
from runtimes.errors import CompileError
from runtimes.spec import Task

logger = logging.getLogger(__name__)

_RANKING_SAMPLES = 16


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
        model = _convert(artifact)
        ov.save_model(model, str(out), compress_to_fp16=compress_to_fp16)
    except (RuntimeError, OSError, OpConversionFailure, GeneralFailure) as exc:
        raise CompileError(conversion_failure(exc, artifact.name)) from exc
    return PassResult(out, {"name": "export_openvino", "compress_to_fp16": compress_to_fp16,
                            "openvino": ov.__version__})


def _convert(artifact: Path) -> ov.Model:
    """`ov.convert_model` puts the root logger back only when it succeeds: a failed conversion leaves it at
    ERROR, with OpenVINO's filter and a stderr handler, and every later warning in the process is lost."""
    root = logging.getLogger()
    level, filters, handlers = root.level, list(root.filters), list(root.handlers)
    try:
        return ov.convert_model(str(artifact))
    finally:
        root.setLevel(level)
        root.filters[:] = filters
        root.handlers[:] = handlers


_NO_RULE = re.compile(r"No conversion rule found for operations: ([^\n]+)")
_OP_BLOCK = re.compile(r"^-- (\S+) with a message:\n(.*?)(?=^-- |^Summary:|\Z)", re.M | re.S)
_NODE = re.compile(r"<Node\(\w+\): ([^>]*)>")


def conversion_failure(exc: BaseException, name: str) -> str:
    """Why OpenVINO cannot convert model file `name`, in one line: from its conversion report, the ONNX ops
    it has no rule for or failed on, the `If`/`Loop` subgraph they sit in and the last line of each op's
    message; any other error's text without the source-file lines."""
    version = ov.__version__.split("-")[0]
    text = str(exc)
    unknown = _NO_RULE.search(text)
    ops = [op.strip() for op in unknown.group(1).split(",")] if unknown else []
    details = [f"no conversion rule for {', '.join(ops)}"] if ops else []
    places = set()
    for op, block in _OP_BLOCK.findall(text):
        ops.append(op.rsplit("-", 1)[0])
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if lines:
            details.append(f"{ops[-1]}: {lines[-1].rstrip('.')}")
        for node in _NODE.findall(block):
            if branch := re.match(r"(.+?)_(then|else)_branch_", node):
                places.add(f"{branch.group(1)}'s {branch.group(2)} branch")
            elif branch := re.match(r"(.+?)_body_", node):
                places.add(f"{branch.group(1)}'s body")
    if not ops:
        lines = [line.strip() for line in text.splitlines()
                 if line.strip() and not line.startswith(("Exception from", "Check '"))]
        return f"OpenVINO {version} cannot convert {name}: {' '.join(lines) or type(exc).__name__}"
    where = f" in {', '.join(sorted(places))}" if places else ""
    return (f"OpenVINO cannot convert ONNX {', '.join(dict.fromkeys(ops))}{where} of {name} "
            f"({'; '.join(details)}; openvino {version})")


def _is_transformer(model: ov.Model, task: str) -> bool:
    ops = {op.get_type_name() for op in model.get_ops()}
    return task == Task.EMBEDDING or ("Softmax" in ops and "MatMul" in ops)


def quantize(artifact: Path, ctx: PassContext, *, preset: str | None = None, model_type: str | None = "auto",
             subset_size: int = 300, fast_bias_correction: bool = True, ignored: tuple[str, ...] = (),
             repair: bool = True, max_attempts: int = 8) -> PassResult:
    """NNCF post-training int8 of the IR `artifact`; accuracy-controlled rerun when the guard fails.

    Args:
        artifact: the fp32 OpenVINO IR.
        ctx: pass context.
        preset: "performance" (symmetric) or "mixed"; NNCF's default when None.
        model_type: "transformer", None, or "auto" (transformer for embeddings and attention graphs).
        subset_size: calibration samples.
        fast_bias_correction: NNCF's fast bias correction (False: slower, sometimes more accurate).
        ignored: node names kept in fp32.
        repair: when the guard fails, keep the most sensitive ops in fp32 (`quantize_ov_repair`).
        max_attempts: most repair builds before the bisection steps (each one compile and validation).
    """
    import nncf  # here, not at the top: it imports torch (seconds), which an fp32 export does not need

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
    record["excluded_nodes"] = []
    fid, verdict = ctx.evaluate(out, "openvino")
    if verdict.passed or not repair:
        return PassResult(out, record)
    if ctx.deadline is not None and time.monotonic() > ctx.deadline:
        record["sensitivity"] = {"note": f"{verdict.reason}; max_time was spent before the repair", "repaired": False}
        return PassResult(out, record)
    futile = ctx.repair_pays(out, "openvino") if ctx.repair_pays is not None else ""
    if futile:
        record["sensitivity"] = {"note": f"{verdict.reason}; {futile}", "repaired": False}
        return PassResult(out, record)
    logger.info("NNCF int8 failed the guard (%s); keeping its most sensitive ops in fp32", verdict.reason)
    out = _repair(model, quantized, out, ctx, record, (fid, verdict), max_attempts)
    return PassResult(out, record)


def _repair(original: ov.Model, quantized: ov.Model, first: Path, ctx: PassContext, record: dict[str, Any],
            measured: tuple[dict[str, float], Any], max_attempts: int) -> Path:
    """Keep the most sensitive ops of `quantized` (from `original`) in fp32 (quantize_ov_repair): the last build."""
    started, deadline = time.monotonic(), ctx.repair_deadline()
    batches = list(ctx.validation.subset(_RANKING_SAMPLES).batches(4))
    ranking = quantize_ov_repair.rank(quantized, batches, threads=ctx.threads)
    ranked_s = time.monotonic() - started
    attempt = [0]

    def build(excluded: list[str]) -> Path:
        attempt[0] += 1
        return quantize_ov_repair.bypass(quantized, excluded, ctx.workdir / f"attempt{attempt[0]}" / "model.xml",
                                         original=original)

    result = sensitivity.search(build, lambda p: ctx.evaluate(p, "openvino"), ranking, first=(first, *measured),
                                max_attempts=max_attempts, deadline=deadline)
    record["excluded_nodes"] = list(result.excluded)
    record["sensitivity"] = {"method": "fake-quantize-noise", "ranked_ops": len(ranking),
                             "top": [{"node": n, "noise": round(v, 6)} for n, v in ranking[:10]],
                             "attempts": result.attempts, "repaired": result.passed,
                             "seconds": {"rank": round(ranked_s, 2),
                                         "search": round(time.monotonic() - started - ranked_s, 2)}}
    sensitivity.note_time_spent(record["sensitivity"], result, ctx.repair_budget)
    if ranking and len(result.excluded) >= len(ranking):
        record["sensitivity"]["repaired"] = False
        record["sensitivity"]["note"] = "every quantized op is excluded: nothing is int8 any more"
    return result.artifact


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
