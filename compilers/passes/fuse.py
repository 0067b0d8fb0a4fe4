"""Graph fusion, kept only where it measurably helps.

Candidates: onnxslim (constant folding, dead-node removal, fusions), onnxruntime's offline
basic-level optimization (hardware-independent rewrites only, so the file still runs anywhere),
and onnxoptimizer when it is installed.
Each candidate is timed against the unfused graph in the same interleaved run, all loaded the way
devices load them (online ORT_ENABLE_ALL). The fastest is kept when it beats the original by
`min_gain`; otherwise the original is kept and the measurements say why. Online optimization
already does most of this work, so on many models nothing is kept: that is the expected outcome,
not a failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import shutil
from pathlib import Path
from typing import Any

from compilers.measure import TimingPlan, time_runners
from compilers.passes import PassContext, PassResult
from compilers.passes.execute import open_runner
from runtimes.errors import ConfigError

logger = logging.getLogger(__name__)


def _onnxslim(src: Path, dst: Path) -> Path:
    import onnx

    onnxslim = importlib.import_module("onnxslim")
    onnx.save(onnxslim.slim(onnx.load(str(src))), str(dst))
    return dst


def _ort_basic(src: Path, dst: Path) -> Path:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    return dst


def _onnxoptimizer(src: Path, dst: Path) -> Path:
    import onnx

    onnxoptimizer = importlib.import_module("onnxoptimizer")
    onnx.save(onnxoptimizer.optimize(onnx.load(str(src))), str(dst))
    return dst


_CANDIDATES = {"onnxslim": _onnxslim, "ort-basic": _ort_basic, "onnxoptimizer": _onnxoptimizer}


def _default_candidates() -> tuple[str, ...]:
    return tuple(n for n in ("onnxslim", "ort-basic", "onnxoptimizer")
                 if n == "ort-basic" or importlib.util.find_spec(n) is not None)


def fuse(artifact: Path, ctx: PassContext, *, candidates: tuple[str, ...] | None = None,
         min_gain: float = 0.03, budget_s: float = 0.8) -> PassResult:
    """Try each fusion candidate on `artifact`; keep the fastest if it is `min_gain` faster than none.

    Args:
        artifact: the fp32 ONNX model.
        ctx: pass context (timing threads, data, batch sizes).
        candidates: which fusions to try ("onnxslim", "ort-basic", "onnxoptimizer"; default: the
            installed ones).
        min_gain: the relative speed-up a candidate must show to be kept.
        budget_s: timing budget per batch size.
    """
    if candidates is None:
        candidates = _default_candidates()
    unknown = sorted(set(candidates) - set(_CANDIDATES))
    if unknown:
        msg = f"fuse candidates {unknown} are not among {sorted(_CANDIDATES)}"
        raise ConfigError(msg)
    built: dict[str, Path] = {"none": artifact}
    failures: dict[str, str] = {}
    for name in candidates:
        try:
            built[name] = _CANDIDATES[name](artifact, ctx.workdir / f"fused-{name}.onnx")
        except ModuleNotFoundError as exc:
            failures[name] = f"not installed ({exc.name}); pip install 'tierkit[fuse]'"
        except Exception as exc:  # a fusion tool failing on a graph leaves the graph as it is
            failures[name] = f"{type(exc).__name__}: {exc}"[:200]
    batch = ctx.batch_sizes[0]
    runners = {}
    try:
        for name, path in built.items():
            runners[name] = open_runner(path, "onnxruntime", threads=ctx.threads)
        timing = time_runners(runners, {batch: ctx.validation.batch(batch)}, plan=TimingPlan(budget_s=budget_s))
    finally:
        for r in runners.values():
            r.close()
    p50 = {name: t[f"batch_{batch}"]["p50"] for name, t in timing.items()}
    best = min(p50, key=p50.__getitem__)
    kept = best if best != "none" and p50[best] <= p50["none"] * (1 - min_gain) else "none"
    out = ctx.workdir / "model.onnx"
    shutil.copyfile(built[kept], out)
    record: dict[str, Any] = {"name": "fuse", "kept": kept, "batch": batch,
                              "p50_ms": {k: round(v, 4) for k, v in p50.items()}}
    if failures:
        record["failed"] = failures
    logger.info("fuse: kept %s (%s)", kept, record["p50_ms"])
    return PassResult(out, record)
