"""Layer-wise quantization sensitivity, and the search that keeps the most sensitive layers in fp32.

Ranking a QDQ model (static int8): every QuantizeLinear -> DequantizeLinear pair is made
observable, the model runs once on a few validation batches, and each pair's noise is measured
where it is injected: ||dq(q(t)) - t||² / ||t||² for activations (inside the quantized model, so
upstream error is already included; also over the elements below ±1000 alone, so that attention-mask
sentinels cannot hide the damage) and the same against the fp32 initializer for weights. A
node's score is the worst noise among the tensors it quantizes (its inputs, and its output when
it owns that QDQ). Clipping from a bad calibration range and coarse per-tensor weights both show
up here.

Ranking a dynamic-int8 model: activations are quantized per batch, per tensor, to 8 bits over
[min, max], so their expected noise is ((max - min) / 255)² / 12 over their variance; the fp32
model runs once with the MatMul inputs exposed to estimate it, and weight noise is computed from
the weights.

`search` then excludes the top 1, 2, 4, 8, ... nodes, re-quantizing (from the cached
calibration) and re-validating each time, until the guard passes or half of the candidates are
excluded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from compilers.fidelity import Verdict

logger = logging.getLogger(__name__)

_SAVED = "_tk_saved"
# Attention masks fill padded positions with -1e4 or float32's minimum. Such sentinels dominate a
# tensor's power, so a relative error over all elements cannot see that quantizing to their range
# wiped out the ordinary values; the noise is therefore also measured over elements below this.
_SENTINEL = 1e3
_QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def _expose(model: onnx.ModelProto, tensors: Iterable[str]) -> onnx.ModelProto:
    """A copy of `model` with `tensors` added as flat float graph outputs."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    shape_name = "_tk_flat_shape"
    out.graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), shape_name))
    for name in dict.fromkeys(tensors):
        flat = name + _SAVED
        out.graph.node.append(helper.make_node("Reshape", [name, shape_name], [flat], name=flat))
        out.graph.output.append(helper.make_tensor_value_info(flat, onnx.TensorProto.FLOAT, [-1]))
    return out


def _run_exposed(model: onnx.ModelProto, batches: Sequence[Mapping[str, np.ndarray]],
                 threads: int) -> Iterator[dict[str, np.ndarray]]:
    """Run `model` (made by `_expose`) on each batch; yield its exposed tensors, one batch at a time.

    One batch at a time: a transformer's intermediate tensors over many samples take gigabytes.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    # Optimizations would fold the Q/DQ pairs we are measuring.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs() if o.name.endswith(_SAVED)]
    for batch in batches:
        yield {name[: -len(_SAVED)]: v for name, v in zip(names, sess.run(names, dict(batch)), strict=True)}


def _noise(pre: np.ndarray, post: np.ndarray) -> float:
    return float(((post - pre) ** 2).sum() / max((pre**2).sum(), 1e-30))


def _dequantize(init: Mapping[str, onnx.TensorProto], node: onnx.NodeProto) -> np.ndarray | None:
    try:
        q = numpy_helper.to_array(init[node.input[0]]).astype(np.float64)
        scale = numpy_helper.to_array(init[node.input[1]]).astype(np.float64)
        zp = numpy_helper.to_array(init[node.input[2]]).astype(np.float64) if len(node.input) > 2 else 0.0
    except KeyError:
        return None
    if np.ndim(scale) == 1 and scale.size > 1:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        shape = [1] * q.ndim
        shape[axis] = -1
        scale, zp = scale.reshape(shape), np.reshape(zp, shape) if np.ndim(zp) else zp
    return (q - zp) * scale


def qdq_ranking(fp32: onnx.ModelProto, qdq: onnx.ModelProto, batches: Sequence[Mapping[str, np.ndarray]],
                threads: int = 0) -> list[tuple[str, float]]:
    """Nodes of a QDQ model, most sensitive first, with their injected-noise score."""
    graph = qdq.graph
    init = {t.name: t for t in graph.initializer}
    fp32_init = {t.name: t for t in fp32.graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    act_pairs: list[tuple[str, str, list[str]]] = []
    weight_noise: dict[str, float] = {}
    for dq in (n for n in graph.node if n.op_type == "DequantizeLinear"):
        owners = [c.name for c in consumers.get(dq.output[0], []) if c.op_type not in _QDQ_OPS]
        q = producer.get(dq.input[0])
        if q is not None and q.op_type == "QuantizeLinear":
            src = producer.get(q.input[0])
            if src is not None and src.op_type not in _QDQ_OPS:
                owners.append(src.name)
            act_pairs.append((q.input[0], dq.output[0], owners))
        elif dq.input[0] in init and numpy_helper.to_array(init[dq.input[0]]).dtype != np.int32:
            original = dq.output[0].removesuffix("_DequantizeLinear_Output")
            post = _dequantize(init, dq)
            if original in fp32_init and post is not None:
                noise = _noise(numpy_helper.to_array(fp32_init[original]).astype(np.float64), post)
                for owner in owners:
                    weight_noise[owner] = max(weight_noise.get(owner, 0.0), noise)
    observed = [t for before, after, _ in act_pairs for t in (before, after)]
    # [0]/[1]: error and power over all elements; [2]/[3]: over the moderate ones (see _SENTINEL).
    sums = np.zeros((len(act_pairs), 4))
    for values in _run_exposed(_expose(qdq, observed), batches, threads) if act_pairs else ():
        for k, (before, after, _) in enumerate(act_pairs):
            a, b = values[before].astype(np.float64), values[after].astype(np.float64)
            sq_err, moderate = (b - a) ** 2, np.abs(a) <= _SENTINEL
            sums[k] += (sq_err.sum(), (a**2).sum(), sq_err[moderate].sum(), (a[moderate] ** 2).sum())
    scores = dict(weight_noise)
    for k, (_, _, owners) in enumerate(act_pairs):
        noise = max(sums[k, 0] / max(sums[k, 1], 1e-30), sums[k, 2] / max(sums[k, 3], 1e-30))
        for owner in owners:
            scores[owner] = max(scores.get(owner, 0.0), noise)
    return sorted(scores.items(), key=lambda kv: -kv[1])


def dynamic_ranking(fp32: onnx.ModelProto, batches: Sequence[Mapping[str, np.ndarray]], op_types: Sequence[str],
                    *, per_channel: bool = False, threads: int = 0) -> list[tuple[str, float]]:
    """MatMul-like nodes of an fp32 model, most sensitive to dynamic int8 first (modeled noise)."""
    init = {t.name: t for t in fp32.graph.initializer}
    nodes = [n for n in fp32.graph.node if n.op_type in op_types]
    acts = [i for n in nodes for i in n.input[:2] if i and i not in init]
    # Expected noise of per-batch [min, max] 8-bit quantization: (range / 255)² / 12 per batch.
    quant_noise = dict.fromkeys(acts, 0.0)
    stats = {a: [0.0, 0.0, 0] for a in acts}  # sum, sum of squares, count
    n_batches = 0
    for values in _run_exposed(_expose(fp32, acts), batches, threads) if acts else ():
        n_batches += 1
        for a in acts:
            v = values[a].astype(np.float64)
            quant_noise[a] += (np.ptp(v) / 255) ** 2 / 12
            stats[a][0] += float(v.sum())
            stats[a][1] += float((v**2).sum())
            stats[a][2] += v.size
    scores = []
    for n in nodes:
        score = 0.0
        for name in n.input[:2]:
            if name in init:
                w = numpy_helper.to_array(init[name]).astype(np.float64)
                span = (np.ptp(w, axis=0) if per_channel and w.ndim == 2 else np.ptp(w))
                score = max(score, float(np.mean(np.square(span / 255) / 12) / max(w.var(), 1e-30)))
            elif name in stats and stats[name][2]:
                total, squares, count = stats[name]
                var = squares / count - (total / count) ** 2
                score = max(score, quant_noise[name] / n_batches / max(var, 1e-30))
        scores.append((n.name, score))
    return sorted(scores, key=lambda kv: -kv[1])


@dataclass
class SearchResult:
    """Outcome of the exclusion search: the last artifact built, what was excluded, every attempt."""

    artifact: Path
    excluded: list[str]
    passed: bool
    attempts: list[dict[str, Any]] = field(default_factory=list)
    stopped_at_deadline: bool = False  # the search ended because its time was spent, not its steps


def search(build: Callable[[list[str]], Path], evaluate: Callable[[Path], tuple[dict[str, float], Verdict]],
           ranking: Sequence[tuple[str, float]], *, first: tuple[Path, dict[str, float], Verdict],
           max_fraction: float = 0.5, max_attempts: int = 8, refine: int = 2,
           deadline: float | None = None) -> SearchResult:
    """Exclude the top 1, 2, 4, ... ranked nodes until the guard passes; stop at `max_fraction` of them.

    Once k nodes pass where k/2 did not, up to `refine` bisection steps look for a smaller count
    that still passes, so that as much as possible stays int8. The doubling bounds the work: at most
    log2(nodes * max_fraction) + 1 + `refine` builds and validations, and none is started past
    `deadline` (a `time.monotonic()` value; the best passing attempt so far is kept).
    """
    artifact, fid, verdict = first
    attempts = [_attempt([], fid, verdict)]
    names = [n for n, _ in ranking]
    cap = max(1, int(len(names) * max_fraction))
    k, failed_at = 1, 0
    excluded: list[str] = []
    def late() -> bool:
        return deadline is not None and time.monotonic() > deadline

    while not verdict.passed and len(attempts) <= max_attempts and names and not late():
        excluded = names[:min(k, cap)]
        artifact, (fid, verdict) = _try(build, evaluate, excluded, attempts)
        if not verdict.passed:
            failed_at = len(excluded)
        if k >= cap:
            break
        k *= 2
    best = (artifact, excluded, fid, verdict)
    for _ in range(refine if verdict.passed else 0):
        if late():
            break
        mid = (failed_at + len(best[1])) // 2
        if mid <= failed_at:
            break
        path, (f, v) = _try(build, evaluate, names[:mid], attempts)
        if v.passed:
            best = (path, names[:mid], f, v)
        else:
            failed_at = mid
    artifact, excluded, fid, verdict = best
    return SearchResult(artifact, excluded, verdict.passed, attempts, stopped_at_deadline=late())


def note_time_spent(record: dict[str, Any], result: SearchResult, budget: float | None) -> None:
    """A search that failed because its time ran out says so in the rung's reason (`note`)."""
    if result.passed or not result.stopped_at_deadline:
        return
    last = result.attempts[-1]
    spent = f"the repair budget of {budget:g} s" if budget is not None else "max_time"
    record["note"] = (f"{last['reason']}; the repair stopped when {spent} was spent, after {len(result.attempts) - 1} "
                      f"attempt(s) keeping up to {max(a['excluded'] for a in result.attempts)} op(s) in fp32 "
                      "(raise repair_budget to search further)")


def _try(build: Callable[[list[str]], Path], evaluate: Callable[[Path], tuple[dict[str, float], Verdict]],
         excluded: list[str], attempts: list[dict[str, Any]]) -> tuple[Path, tuple[dict[str, float], Verdict]]:
    artifact = build(excluded)
    fid, verdict = evaluate(artifact)
    attempts.append(_attempt(excluded, fid, verdict))
    logger.info("excluding %d most sensitive node(s): %s", len(excluded), verdict.reason)
    return artifact, (fid, verdict)


def _attempt(excluded: list[str], fid: Mapping[str, float], verdict: Verdict) -> dict[str, Any]:
    keep = ("drop_points", "top1_agreement", "accuracy", "cosine_mean", "max_abs_error", "sequence_rows_unchanged",
            "char_error_rate")
    return {"excluded": len(excluded), "nodes": excluded[:8], "passed": verdict.passed, "reason": verdict.reason,
            **{k: round(float(fid[k]), 6) for k in keep if k in fid}}
