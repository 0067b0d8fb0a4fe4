"""The SDK's edge path against a raw onnxruntime call on the same model, in the same run.

For each model (digits logistic regression; a small digits CNN), compiled by `compile_model` and
loaded with `sdk.load`, one held-out image is answered two ways at batch 1:

- raw: `InferenceSession.run(output_names, feed)` on the very onnxruntime session the SDK runs;
- sdk: `TieredModel.predict(x)`: input check, variant choice, inference, policy score, the
  `Prediction` with latency and energy. Two cases: no cloud configured, and a cloud configured but
  the input confident (the path every non-escalated request takes).

Blocks of calls alternate between the paths (swapping which goes first), so that drift in machine
load hits both alike; each figure is the median over blocks of the mean time per call. The target:
the SDK adds at most 30 µs or 5 % per call, whichever is larger.

Usage:
    python bench/bench_edge.py [--quick] [--json] [--threads N]

`--quick` runs fewer blocks: a check that the script works, not a measurement. Timings on a shared
host are noisy; compare the columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import overhead  # noqa: E402 - after the path fix above
from bench.overhead import OverheadRow  # noqa: E402

TARGET_US, TARGET_PCT = 30.0, 5.0


def compare(model: str, case: str, raw: Callable[[], Any], sdk_call: Callable[[], Any], *, blocks: int,
            calls: int) -> OverheadRow:
    return overhead.compare(model, case, raw, sdk_call, blocks=blocks, calls=calls, warmup=max(20, calls // 4),
                            target_us=TARGET_US, target_pct=TARGET_PCT)


def build(work: Path) -> tuple[Any, list[tuple[str, Path]]]:
    """Train and compile the two digits models; returns the split and (name, fp32 onnxruntime package)."""
    import torch

    from compilers import compile_model
    from testkit import zoo

    split = zoo.digits(seed=0)
    out = []
    for name, module in (("digits-linear", zoo.train(zoo.linear_classifier(), split, epochs=10, lr=1e-2)),
                         ("digits-cnn", zoo.train(zoo.small_cnn(), split, epochs=2))):
        vs = compile_model(module, example_inputs=torch.from_numpy(split.x_test[:1]), output=work / name,
                           precisions=("fp32",), validation={"x": split.x_val, "labels": split.y_val},
                           calibration={"x": split.x_train[:256]}, name=name, progress=False)
        entry = next(e for e in vs if e.runtime == "onnxruntime")
        out.append((name, vs.directory / entry.path))
    return split, out


def bench_model(name: str, package: Path, x: np.ndarray, *, threads: int, blocks: int, calls: int) -> list[OverheadRow]:
    import sdk
    from cloud_service.protocol import encode_response
    from edge_agent.agent import AgentOptions
    from edge_agent.policy import Policy
    from runtimes.session import SessionOptions
    from testkit.fake_transport import FakeTransport

    options = AgentOptions(session=SessionOptions(intra_op_threads=threads, inter_op_threads=1))
    rows = []
    never = Policy("margin", threshold=-1.0)  # every input confident: the non-escalated path
    cloud = FakeTransport(lambda request: encode_response(name, {}))
    for case, kwargs in (("no cloud", {}), ("cloud set, confident", {"cloud": cloud})):
        with sdk.load(package, policy=never, options=options, **kwargs) as model:  # type: ignore[arg-type]
            session = next(iter(model.agent.variants.values())).session
            inner, names = session._sess, [s.name for s in session.outputs]  # the object the SDK wraps
            feed = {session.inputs[0].name: x[None]}
            pred = model.predict(x)
            assert pred.tier == "edge"
            np.testing.assert_array_equal(inner.run(names, feed)[0][0], pred.outputs[names[0]])
            rows.append(compare(name, case, partial(inner.run, names, feed), partial(model.predict, x),
                                blocks=blocks, calls=calls))
    return rows


def render(rows: list[OverheadRow]) -> str:
    head = ("model", "case", "raw µs", "sdk µs", "added µs", "added %", "allowed µs", "result")
    lines = [head] + [(r.model, r.case, f"{r.raw_us:.1f}", f"{r.wrapped_us:.1f}", f"{r.added_us:+.1f}",
                       f"{r.added_pct:+.1f}", f"{r.allowed_us:.1f}", "PASS" if r.passed else "FAIL") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths, strict=True))) for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks: checks the script works")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both paths (default 1)")
    args = parser.parse_args(argv)
    blocks, calls = (9, 200) if args.quick else (41, 1000)
    rows: list[OverheadRow] = []
    with tempfile.TemporaryDirectory(prefix="tierkit-bench-edge-") as tmp:
        split, packages = build(Path(tmp))
        x = np.ascontiguousarray(split.x_test[0])
        time.sleep(2.0)  # let the training and compile thread pools go idle: they would steal a core
        for name, package in packages:
            rows += bench_model(name, package, x, threads=args.threads, blocks=blocks, calls=calls)
    if args.json:
        print(json.dumps({"threads": args.threads, "quick": args.quick, "target_us": TARGET_US,
                          "target_pct": TARGET_PCT, "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(render(rows))
        print(f"\nbatch 1, {args.threads} intra-op thread(s); median over {blocks} alternating blocks of {calls} "
              f"calls; target: added <= max({TARGET_US:.0f} µs, {TARGET_PCT:.0f} % of raw)")
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
