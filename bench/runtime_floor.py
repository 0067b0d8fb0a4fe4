"""The fastest a runtime itself runs one model file at batch 1: the floor a compiled rung is compared with.

- OpenVINO: its own `benchmark_app` (shipped in the openvino wheel) in latency mode on `threads` threads,
  one stream, one synchronous request (`-hint none -nstreams 1 -nireq 1 -api sync -nthreads N`: the
  app refuses `-nthreads` beside `-hint latency`, and these are what that hint sets), f32 inference
  precision for fp32 and int8 files (bf16 CPUs would otherwise compute them in bf16), on the very input
  the rung is timed with (`-i` .npy files; its own random fill would be other data), its median.
- onnxruntime: the file under a few session option sets (every graph optimization, with and without
  spinning threads, extended optimizations, sequential execution), timed interleaved with the rung in the
  same run; the fastest p50.

`floor_ratio` = floor / the rung's own p50: 1.0 means the compiled rung runs as fast as the runtime can.

benchmark_app reports OpenVINO's own request latency (`InferRequest.latency`, the median over its sync calls
for `seconds` after one first call), measured inside the C++ `infer`: the time a Python caller spends around
that call (the binding, the GIL, copying inputs and outputs) is not in it. `beside_bare_request` times the
rung's session interleaved with the bare request called from Python (inputs set once, the C++ `infer` with
no inputs and no outputs read back), the least any Python caller of that file pays, alone with it as
benchmark_app runs alone; after each round's timed calls, each of the two runs calls of its own that also take
OpenVINO's own latency (so that this timing code is in no p50), and a rung's wall time splits into the part inside
OpenVINO (what benchmark_app measures) and the part around it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compilers.measure import TimingPlan, time_runners
from compilers.passes.execute import Runner

_MEDIAN = re.compile(r"Median:\s+([0-9.]+)\s*(ms|us)")  # microseconds when the average is under a millisecond


def benchmark_app() -> str | None:
    """The `benchmark_app` next to this interpreter (the openvino wheel's), or on PATH."""
    local = Path(sys.executable).parent / "benchmark_app"
    return str(local) if local.is_file() else shutil.which("benchmark_app")


def openvino_floor(model: Path, feed: Mapping[str, np.ndarray], threads: int, *, precision: str = "fp32",
                   seconds: int = 4, pin: bool | None = None) -> tuple[float | None, str]:
    """benchmark_app's median ms for `model` (.xml or .onnx) at `feed`'s shapes; None and why when it cannot run.
    `pin`: its threads pinned to cores (`-pin YES`) or not (`-pin NO`); None leaves its default (pinned)."""
    app = benchmark_app()
    if app is None:
        return None, "benchmark_app not found (pip install openvino)"
    if any(v.ndim == 0 or not np.issubdtype(v.dtype, np.floating) for v in feed.values()):
        return None, "integer or scalar inputs: benchmark_app would feed random values"
    shape = ",".join(f"{k}[{','.join(str(d) for d in v.shape)}]" for k, v in feed.items())
    hint = {"fp32": "f32", "int8": "f32", "bf16": "bf16", "fp16": "f16"}.get(precision, "f32")
    cmd = [app, "-m", str(model), "-hint", "none", "-nstreams", "1", "-nireq", "1", "-api", "sync",
           "-nthreads", str(threads), "-t", str(seconds), "-shape", shape, "-infer_precision", hint]
    pinning = "" if pin is None else f" -pin {'YES' if pin else 'NO'}"
    cmd += pinning.split()
    with tempfile.TemporaryDirectory(prefix="floor-") as tmp:
        if all(v.dtype == np.float32 for v in feed.values()):  # the same input (its -ip applies to all inputs)
            files = {k: Path(tmp) / f"input{i}.npy" for i, k in enumerate(feed)}
            for k, v in feed.items():
                np.save(files[k], np.ascontiguousarray(v))
            cmd += ["-ip", "f32", "-i", ",".join(f"{k}:{f}" for k, f in files.items())]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60 + 3 * seconds, check=False)
        except subprocess.TimeoutExpired:
            return None, "benchmark_app timed out"
    found = _MEDIAN.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        return None, f"benchmark_app failed: {last[0][:120]}"
    scale = 1e-3 if found.group(2) == "us" else 1.0
    data = "the same input" if "-i" in cmd else "its own random input"
    return float(found.group(1)) * scale, f"benchmark_app -hint none -nstreams 1 -nireq 1 -api sync{pinning}, {data}"


class _BareOpenVino:
    """OpenVINO's own request on `model` at `feed`'s shapes, compiled as the rung's session compiles it (threads not
    pinned unless `pinning` says otherwise: None is OpenVINO's and benchmark_app's default, pinned), called from
    Python with nothing around it: inputs written once, then the C++ `infer` with no inputs and no outputs read."""

    def __init__(self, model: Path, feed: Mapping[str, np.ndarray], threads: int, precision: str,
                 pinning: bool | None = False) -> None:
        import openvino as ov
        from openvino._pyopenvino import InferRequest

        core = ov.Core()
        graph = core.read_model(str(model))
        graph.reshape({k: ov.PartialShape(list(v.shape)) for k, v in feed.items()})
        hint = {"fp32": "f32", "int8": "f32", "bf16": "bf16", "fp16": "f16"}.get(precision, "f32")
        config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
                                  "INFERENCE_PRECISION_HINT": hint}
        if pinning is not None:  # False: as tierkit's session runs; None: OpenVINO's default (pinned on Linux)
            config["ENABLE_CPU_PINNING"] = pinning
        self.compiled = core.compile_model(graph, "CPU", config)
        self.request = self.compiled.create_infer_request()
        for name, value in feed.items():
            self.request.get_tensor(name).data[...] = value
        self._infer = InferRequest.infer

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._infer(self.request, {}, True, True)
        return {}

    @property
    def last_latency_ms(self) -> float:
        """OpenVINO's own latency of the last call (see `_Inside`)."""
        return float(self.request.latency)

    def close(self) -> None:
        del self.request, self.compiled


# what decides how OpenVINO's CPU plugin threads a request: the rung's session and the bare request should agree
CONFIG = ("PERFORMANCE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS", "ENABLE_CPU_PINNING", "SCHEDULING_CORE_TYPE",
          "ENABLE_HYPER_THREADING", "INFERENCE_PRECISION_HINT")


def config_difference(rung: Any, bare: Any) -> str:
    """The CPU plugin properties (`CONFIG`) on which the rung's compiled model and the bare request's differ,
    as "NAME rung/bare"; "" when they agree."""
    diffs = []
    for name in CONFIG:
        try:
            mine, theirs = str(rung.get_property(name)), str(bare.get_property(name))
        except RuntimeError:
            continue
        if mine != theirs:
            diffs.append(f"{name} {mine}/{theirs}")
    return ", ".join(diffs)


class _Inside:
    """A runner whose calls are split into OpenVINO's own latency (`last_latency_ms`, inside its C++ request)
    and the rest of the call's wall time. Used apart from the timed calls (`split_calls`), so that its own
    timing code is in no p50; the rung's session and the bare request are split alike."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.split: list[tuple[float, float]] = []

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        out: dict[str, np.ndarray] = self.runner.run(inputs)
        wall = (time.perf_counter() - t0) * 1e3
        inside = self.runner.last_latency_ms
        self.split.append((inside, wall - inside))
        return out

    def close(self) -> None:
        """The wrapped runner is its caller's to close."""


SPLIT_S = 0.15  # per round and second of budget: the calls whose time is split into inside and around


def split_calls(split: _Inside, feed: Mapping[str, np.ndarray], seconds: float) -> None:
    """Calls of `split` for `seconds` (at least 20, at most 400), after 5 untimed ones."""
    for _ in range(5):
        split.runner.run(feed)
    end = time.perf_counter() + seconds
    for done in range(400):
        split.run(feed)
        if done >= 19 and time.perf_counter() > end:
            break


@dataclass(frozen=True)
class BesideBare:
    """A rung's session and the bare OpenVINO request from Python on its file, timed interleaved at batch 1 (ms).

    `*_rounds`: each round's p50 (see `beside_bare_request`); `rung_ms` and `bare_ms` are their medians.
    `*_split`: medians over every call of OpenVINO's own latency (inside the C++ request, what benchmark_app
    reports) and of the rest of each call's wall time (around it, in Python); None where the runner is not an
    OpenVINO one. `bare_ms` is None (and `how` says why) where there is no bare request."""

    rung_ms: float
    rung_split: tuple[float, float] | None
    bare_ms: float | None
    bare_split: tuple[float, float] | None
    how: str
    config: str = ""  # where the rung's compile config differs from the bare request's (see CONFIG)
    pinned_ms: float | None = None  # the bare request compiled with OpenVINO's default pinning, timed beside them
    rung_rounds: tuple[float, ...] = ()
    bare_rounds: tuple[float, ...] = ()


def beside_bare_request(rung: Runner, model: Path, feed: Mapping[str, np.ndarray], threads: int, *,
                        precision: str = "fp32", budget_s: float = 2.0, rounds: int = 1,
                        before_round: Callable[[int], object] | None = None) -> BesideBare:
    """The rung timed interleaved with the bare request at batch 1, the bare request only for an OpenVINO file
    whose inputs are float arrays; in `rounds` rounds of `budget_s` seconds per two runners, each begun by
    `before_round(i)` (the caller runs benchmark_app there, so that it and the rung take turns: a ratio taken
    round by round cancels a load that drifts over the run)."""
    inside = _Inside(rung) if hasattr(rung, "last_latency_ms") else None
    runners: dict[str, Runner] = {"rung": rung}
    why = "OpenVINO's C++ InferRequest.infer from Python, inputs set once, no outputs read"
    bare = bare_inside = None
    if model.suffix == ".xml" and all(v.ndim and np.issubdtype(v.dtype, np.floating) for v in feed.values()):
        try:
            runners["bare"] = bare = _BareOpenVino(model, feed, threads, precision)
            bare_inside = _Inside(bare)
            runners["pinned"] = _BareOpenVino(model, feed, threads, precision, pinning=None)
        except RuntimeError as exc:
            why = f"bare request failed: {str(exc).splitlines()[-1][:120]}"
    else:
        why = "no bare request: not an OpenVINO file with float inputs"
    differs = config_difference(rung, bare.compiled) if bare is not None and hasattr(rung, "get_property") else ""
    p50s: dict[str, list[float]] = {name: [] for name in runners}
    try:
        for i in range(rounds):
            if before_round is not None:
                before_round(i)
            timing = time_runners(runners, {1: feed}, plan=TimingPlan(budget_s=budget_s * len(runners) / 2))
            for name in runners:
                p50s[name].append(timing[name]["batch_1"]["p50"])
            for split in (inside, bare_inside) if i % 2 == 0 else (bare_inside, inside):
                if split is not None:
                    split_calls(split, feed, SPLIT_S * budget_s)
    finally:
        for name in ("bare", "pinned"):
            if name in runners:
                runners[name].close()

    def medians(split: list[tuple[float, float]] | None) -> tuple[float, float] | None:
        return (float(np.median([a for a, _ in split])), float(np.median([b for _, b in split]))) if split else None

    def p50(name: str) -> float | None:
        return float(np.median(p50s[name])) if name in p50s else None

    return BesideBare(float(np.median(p50s["rung"])), medians(inside.split if inside else None), p50("bare"),
                      medians(bare_inside.split if bare_inside else None), why, differs, p50("pinned"),
                      tuple(p50s["rung"]), tuple(p50s.get("bare", ())))


class _OrtRunner:
    def __init__(self, path: Path, threads: int, level: str, spinning: bool, sequential: bool) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        if sequential:
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip([o.name for o in self.session.get_outputs()], self.session.run(None, dict(inputs)),
                        strict=True))

    def close(self) -> None:
        del self.session


ORT_OPTION_SETS = {"all": ("ORT_ENABLE_ALL", True, False), "all-nospin": ("ORT_ENABLE_ALL", False, False),
                   "extended": ("ORT_ENABLE_EXTENDED", True, False), "all-seq": ("ORT_ENABLE_ALL", True, True)}


def onnxruntime_floor(model: Path, feed: Mapping[str, np.ndarray], threads: int,
                      budget_s: float = 2.0) -> tuple[float, str]:
    """The fastest p50 (ms) onnxruntime reaches on `model` at `feed` over `ORT_OPTION_SETS`, and which set."""
    runners = {name: _OrtRunner(model, threads, *opts) for name, opts in ORT_OPTION_SETS.items()}
    try:
        timing = time_runners(runners, {1: feed}, plan=TimingPlan(budget_s=budget_s))
    finally:
        for r in runners.values():
            r.close()
    best = min(timing, key=lambda k: timing[k]["batch_1"]["p50"])
    return timing[best]["batch_1"]["p50"], f"onnxruntime {best}"
