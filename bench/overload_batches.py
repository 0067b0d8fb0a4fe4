"""Where `tierkit serve`'s time goes under overload: batch sizes and time inside the session, per caller count.

For each caller count, a closed loop of gRPC callers (processes of their own, honouring retry hints, as in
`bench_overload.py`) runs for a few seconds against the PP-OCRv4 detector; the server's own metrics are read
before and after: rows and batches run (`tierkit_batch_size`), seconds inside the session
(`tierkit_batch_run_seconds`), refusals at admission and requests expired in the queue. Printed per row: answers
in time a second, rows run a second, the mean batch, the session's busy share (seconds inside it per second),
milliseconds a row inside it, refusals and expiries a second.

    PYTHONPATH=$PWD python bench/overload_batches.py --model slow --callers 2,8,32,128 \
        [--server-cpus 0,1 --loadgen-cpus 2-9] [--serve-args "--instances 2 --threads 1"]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from testkit.overload import Load, Server, aio_closed_loop, cpu_list, ocr_det_package, request_bytes

MODELS = {"slow": (128, 256), "fast": (32, 64)}
_SAMPLE = re.compile(r"^(tierkit_[a-z_]+?)(?:\{[^}]*\})? ([0-9.e+-]+)$")


def scrape(address: str) -> dict[str, float]:
    """tierkit's counters and histogram sums, summed over labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not m.group(1).endswith("_created") and "_bucket" not in m.group(1):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _part(job: tuple[str, bytes, dict[str, Any]]) -> Load:
    address, payload, kwargs = job
    return aio_closed_loop(address, payload, **kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="slow")
    ap.add_argument("--callers", default="2,8,32,128")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--deadline-ms", type=float, default=100.0)
    ap.add_argument("--procs", type=int, default=4, help="load generator processes")
    ap.add_argument("--server-cpus", type=cpu_list, default=None)
    ap.add_argument("--loadgen-cpus", type=cpu_list, default=None)
    ap.add_argument("--serve-args", default="")
    args = ap.parse_args(argv)
    if args.loadgen_cpus is not None:
        os.sched_setaffinity(0, args.loadgen_cpus)
    height, width = MODELS[args.model]
    root = Path(tempfile.mkdtemp())
    payload = request_bytes("ocrdet", ocr_det_package(root / "models", height=height, width=width, name="ocrdet"))
    deadline_s = args.deadline_ms / 1000
    with Server(root / "models", "--metrics", "127.0.0.1:0", *args.serve_args.split(), cpus=args.server_cpus) as srv, \
            ProcessPoolExecutor(args.procs) as pool:
        warm = {"callers": 1, "seconds": 1.0, "deadline_s": deadline_s}
        list(pool.map(_part, [(srv.address, payload, warm)] * args.procs))
        print(f"# {args.model}, serve args: {args.serve_args or '(defaults)'}")
        print("| callers | in time/s | rows/s | mean batch | session busy | ms a row in the session | refused/s "
              "| expired/s |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for n in (int(c) for c in args.callers.split(",")):
            before, started = scrape(srv.metrics), time.monotonic()
            shares = [n // args.procs + (1 if i < n % args.procs else 0) for i in range(args.procs)]
            jobs = [(srv.address, payload, {"callers": s, "seconds": args.seconds, "deadline_s": deadline_s})
                    for s in shares if s]
            loads = list(pool.map(_part, jobs))
            took = time.monotonic() - started
            after = scrape(srv.metrics)
            d = {k: after[k] - before.get(k, 0.0) for k in after}
            rows, batches = d.get("tierkit_batch_size_sum", 0.0), d.get("tierkit_batch_size_count", 0.0)
            busy = d.get("tierkit_batch_run_seconds_sum", 0.0)
            print(f"| {n} | {sum(x.goodput for x in loads):.1f} | {rows / took:.1f} | {rows / max(batches, 1):.2f} | "
                  f"{busy / took:.2f} | {1000 * busy / max(rows, 1):.2f} | "
                  f"{d.get('tierkit_requests_refused_total', 0.0) / took:.1f} | "
                  f"{d.get('tierkit_requests_expired_total', 0.0) / took:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
