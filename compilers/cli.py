"""`tierkit compile`: parse, call `compile_model`, print the report (a table, or JSON with --json)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compilers.recipes import target_names
from compilers.report import PLANNED_SECONDS

_EPILOG = """\
MODEL is an .onnx file, a .pt2 torch.export program, or "package.module:factory", a callable that
returns a torch nn.Module (needed for --prune; its example input is the first calibration sample).
Data files are .npz archives of arrays keyed
by the model's input names, with an optional 'labels' array. Without --validation, 20% of the
calibration data is held out for the accuracy guard.

example:
  tierkit compile digits.onnx -o out/digits --target x86-avx512 --precision fp32,int8 \\
      --calibration calib.npz --validation val.npz --max-drop 1.0 --batch-sizes 1,64
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `compile`."""
    p = subparsers.add_parser("compile", help="compile a model into a ladder of verified variants",
                              description="Build fused, pruned and quantized variants of MODEL for a target, check "
                                          "each against the fp32 reference, and write them as a variant set.",
                              epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="an .onnx file, a .pt2 program, or package.module:factory")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="variant set directory to write")
    p.add_argument("--target", default="auto",
                   help=f"one of {', '.join(target_names())}, or a .json/.yaml target file (default: auto)")
    p.add_argument("--precision", default=None,
                   help="comma-separated precisions (default: fp32, bf16 where the hardware has it natively, int8)")
    p.add_argument("--calibration", metavar="FILE", help=".npz calibration data")
    p.add_argument("--validation", metavar="FILE", help=".npz validation data (labels optional)")
    limit = p.add_mutually_exclusive_group()
    limit.add_argument("--max-drop", type=float, metavar="POINTS",
                       help="accuracy points a classifier may lose (default: 1.0)")
    limit.add_argument("--min-cosine", type=float, metavar="C", help="least mean cosine to the fp32 outputs")
    p.add_argument("--max-slice-error", type=float, metavar="E",
                   help="most RMS error of any slice of any output relative to its own RMS, below fp32 (default: "
                        "0.35): a small-valued part of an output (class scores beside box coordinates) cannot die")
    p.add_argument("--metric", metavar="MODULE:FUNCTION",
                   help="your own metric, fn(outputs: dict, labels or None) -> float, higher is better (e.g. mAP)")
    p.add_argument("--max-metric-drop", type=float, metavar="D",
                   help="most the --metric may fall below the reference's value, in its units (default: 0.01)")
    p.add_argument("--prune", type=float, metavar="RATIO",
                   help="also build variants with this share of channels pruned, recovered by distillation "
                        "(MODEL must be a package.module:factory torch model)")
    p.add_argument("--sign-key", metavar="KEY", help="Ed25519 private key (PEM) to sign every package")
    p.add_argument("--batch-sizes", default="1", metavar="N[,N...]",
                   help="batch sizes to time; the first is the default the recommendation is made for (default: 1)")
    p.add_argument("--decoder", choices=("ctc-greedy", "argmax"),
                   help="read a sequence output [N, T, C] this way (default ctc-greedy; implies --task sequence)")
    p.add_argument("--min-rows-unchanged", type=float, metavar="SHARE",
                   help="sequences: least share of rows whose decoded sequence is unchanged (default 0.99)")
    p.add_argument("--max-char-error", type=float, metavar="RATE",
                   help="sequences: most character error rate against the fp32 decoding (default: unbounded)")
    p.add_argument("--min-map-iou", type=float, metavar="IOU",
                   help="segmentation maps: least IoU of the regions against fp32, on every image (default 0.92)")
    p.add_argument("--max-time", type=float, metavar="SECONDS",
                   help="end the rung search after SECONDS with the best rung found so far (the report says so)")
    p.add_argument("--repair-budget", type=float, metavar="SECONDS",
                   help="seconds one rung's repair search may take (default 60); a rung still failing is refused")
    p.add_argument("--repair-all", action="store_true",
                   help="repair every rung that fails the guard, even one slower than fp32 before repair")
    p.add_argument("--task", choices=("classification", "embedding", "regression", "sequence", "segmentation"),
                   help="how fidelity is measured (default: inferred)")
    p.add_argument("--name", help="model name (default: the file stem)")
    p.add_argument("--version", dest="model_version", default="1", help="model version (default: 1)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 1) when any variant is rejected; by default the compile succeeds when one passes")
    p.add_argument("--threads", type=int, help="threads for validation and timing (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> tuple[int, ...]:
    from runtimes.errors import ConfigError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        msg = f"{what} {text!r} is not a comma-separated list of integers"
        raise ConfigError(msg) from None


def _factory(spec: str, calibration: str | None) -> tuple[Any, Any]:
    """Import `package.module:factory`, call it, and take the first calibration sample as example input."""
    from compilers.calibration import CalibrationData
    from runtimes.errors import ConfigError

    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        msg = f"cannot import model factory {spec!r}: {exc}"
        raise ConfigError(msg) from None
    if calibration is None:
        msg = "a model factory needs --calibration: its first sample is the example input for export"
        raise ConfigError(msg)
    data = CalibrationData(calibration)
    return factory(), {k: v[:1] for k, v in data.inputs.items()}


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """Whatever a library underneath raises reaches the user as one `CompileError` line, not a traceback."""
    from runtimes.errors import CompileError, TierkitError

    try:
        yield
    except TierkitError:
        raise
    except Exception as exc:
        text = " ".join(str(exc).split())
        msg = f"{type(exc).__name__}: {text[:500]} (rerun with --debug for the traceback)"
        raise CompileError(msg) from exc


def seconds_line(build: dict[str, Any]) -> str:
    """Where the compile's time went, and whether the search was cut short."""
    secs = build.get("seconds", {})
    line = "seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in secs.items())
    rungs = [r for r in build.get("report", []) if r.get("seconds")]
    if rungs:
        worst = max(rungs, key=lambda r: r["seconds"].get("build", 0) + r["seconds"].get("validate", 0))
        s = worst["seconds"]
        repair = f"; repair {s['repair']:.1f} over {s['attempts']} attempt(s)" if "repair" in s else ""
        line += (f"\nslowest rung: {worst['id']} {s.get('build', 0) + s.get('validate', 0):.1f} s (build "
                 f"{s.get('build', 0):.1f}, validate {s.get('validate', 0):.1f}{repair})")
    slow = build.get("slowest_step") or {}
    if slow:
        total = float(secs.get("total", 0.0))
        over = f"the compile took {total:.0f} s, over {PLANNED_SECONDS:.0f} s; " if slow.get("over_planned") else ""
        repair = (f", {slow['repair_seconds']:.1f} s of it repairing over {slow['repair_attempts']} attempt(s)"
                  if "repair_seconds" in slow else "")
        line += (f"\n{over}most of it: {slow['step']} {slow['seconds']:.1f} s ({100 * slow['share']:.0f} %"
                 f"{repair})")
    if build.get("cut_short"):
        line += f"\nsearch cut short: {build['cut_short']}"
    return line


def run(args: argparse.Namespace) -> int:
    """Run `tierkit compile` with parsed arguments; print the report."""
    from compilers.compile import compile_model
    from compilers.report import format_table

    sizes = _ints(args.batch_sizes, "--batch-sizes")
    kwargs: dict[str, Any] = {}
    model: Any = args.model
    if ":" in model and not Path(model).exists():
        model, kwargs["example_inputs"] = _factory(model, args.calibration)
    if args.max_drop is not None:
        kwargs["max_drop"] = args.max_drop
    for name in ("max_slice_error", "metric", "max_metric_drop", "decoder", "min_rows_unchanged", "max_char_error",
                 "min_map_iou", "max_time", "repair_budget"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    # Libraries underneath may print to stdout; keep it for the report (JSON must stay parseable).
    with contextlib.redirect_stdout(sys.stderr), _one_line_errors():
        vs = compile_model(model, output=args.output, target=args.target, precisions=args.precision,
                           calibration=args.calibration, validation=args.validation, min_cosine=args.min_cosine,
                           prune=args.prune, sign_key=args.sign_key, name=args.name, version=args.model_version,
                           batch_sizes=sizes, task=args.task, strict=args.strict, progress=not args.no_progress,
                           threads=args.threads, repair_all=args.repair_all, **kwargs)
    rows = vs.build.get("report", [])
    if args.json:
        doc = {"output": str(vs.directory), "name": vs.name, "target": vs.target,
               "recommended": vs.recommended.id, "baseline": vs.build.get("baseline"),
               "batch_sizes": list(sizes), "variants": rows, "seconds": vs.build.get("seconds", {}),
               "cut_short": vs.build.get("cut_short", "")}
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(rows, sizes))
        print(seconds_line(vs.build))
        print(f"\nwrote {len(vs)} variant(s) to {vs.directory}; recommended: {vs.recommended.id}")
    failed = [r for r in vs.rejected if r.get("stage") not in ("unavailable", "skipped")]
    if args.strict and failed:
        print(f"tierkit: error: --strict: {len(failed)} rung(s) rejected: "
              + "; ".join(f"{r['id']}: {r['reason']}" for r in failed), file=sys.stderr)
        return 1
    return 0
