"""What moves the share of escalations answered in time: the escalation rate, or the host over minutes.

    python bench/controller/answered.py [--rounds 4] [--requests 1000] [--work DIR]

Two measurements through the same real agent, delay proxy and `tierkit serve` as `run.py`, at 100
requests a second:

1. *Round trip by escalation share.* Fixed thresholds that escalate 100 % down to about 16 % on the
   plain +2 ms link with a loose budget; for each, the answered round trip's median (latency less the
   edge's median) by the gap since the escalation before it. If escalating more made escalations
   faster (a host whose idle CPUs wake slower the less often they are woken), the 100 % row and the
   short gaps would be the fastest.
2. *The same point, again and again.* One fixed point of the jitter phase (`run.binding_phases`, a
   16 ms p95 budget), on the recommended edge variant and the most accurate one in alternating
   order, `--rounds` times: accuracy and the share of escalations answered before the timer. The
   spread of one point's share over the rounds is what one phase run can tell two strategies apart by.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from models import Models, build
from replay import Phase, replay
from run import binding_phases, cloud_server, free_port
from strategies import ALWAYS, NEVER, Point, Scripted

from testkit.delay_proxy import DelayProxy

GAPS_MS = ((0, 15), (15, 25), (25, 45), (45, 95), (95, float("inf")))
THRESHOLDS = (ALWAYS, 0.9999, 0.999, 0.99, 0.9)


def by_share(models: Models, trace: np.ndarray, proxy: DelayProxy, n: int) -> None:
    rec_id = models.variants.recommended.id
    edge = replay(Scripted([Point(rec_id, NEVER)]), models, [Phase("edge", 500, 0.0, 1000.0)], trace, proxy, rate=100)
    med = float(np.median(edge["latency_ms"]))
    print(f"round trip (ms, latency less the edge's median {med:.2f}) by escalation share and by the gap since "
          "the escalation before (+2 ms link, 60 ms budget):")
    for thr in THRESHOLDS:
        r = replay(Scripted([Point(rec_id, thr)]), models, [Phase("plain", n, 2.0, 60.0)], trace, proxy, rate=100)
        idx = np.flatnonzero(r["wanted"])
        gaps, rtt, ok = np.diff(r["t"][idx]) * 1000, r["latency_ms"][idx[1:]] - med, r["cloud"][idx[1:]]
        cells = [f"gap {lo}-{hi:g} ms: n={int(m.sum())} median {np.median(rtt[m]):.2f}"
                 for lo, hi in GAPS_MS if (m := ok & (gaps >= lo) & (gaps < hi)).sum() >= 5]
        print(f"  threshold {thr:<6g} escalated {r['wanted'].mean():6.1%}  median {np.median(rtt[ok]):.2f} | "
              + " | ".join(cells), flush=True)


def again(models: Models, trace: np.ndarray, proxy: DelayProxy, n: int, rounds: int) -> None:
    plan = binding_phases(n, 0.0, 16.0)[:1]
    print(f"\none point (threshold 0.9923) on the jitter phase ({plan[0].name}, p95 budget 16 ms), {rounds} rounds:")
    seen: dict[str, list[tuple[float, float]]] = {}
    vs = models.variants
    best = max(vs.entries, key=lambda e: (float(e.fidelity.get("accuracy", 0.0)), -e.cost_ms)).id
    variants = list(dict.fromkeys([vs.recommended.id, best]))  # as built, and the most accurate (as run.py)
    for k in range(rounds):
        for v in variants if k % 2 == 0 else variants[::-1]:
            r: dict[str, Any] = replay(Scripted([Point(v, 0.9923)]), models, plan, trace, proxy, rate=100)
            acc, share = 100 * float(r["correct"].mean()), float(r["cloud"].sum() / max(1, r["wanted"].sum()))
            seen.setdefault(v, []).append((acc, share))
            print(f"  round {k + 1} {v:<9} accuracy {acc:.2f} %  escalated {r['wanted'].mean():.1%}  answered "
                  f"{share:.3f}  timer guard median {np.median(r['guard_ms']):.2f} ms", flush=True)
    for v, xs in seen.items():
        a = np.array(xs)
        print(f"  {v:<9} accuracy {a[:, 0].mean():.2f} (range {a[:, 0].min():.2f}-{a[:, 0].max():.2f}), answered "
              f"{a[:, 1].mean():.3f} (range {a[:, 1].min():.3f}-{a[:, 1].max():.3f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the repeated point (default 4)")
    ap.add_argument("--requests", type=int, default=1000, help="requests per run (default 1,000)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tierkit-bench-controller",
                    help="cache of the trained and compiled models (as run.py)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.requests < 100:
        ap.error(f"--rounds must be at least 1 and --requests at least 100, got {args.rounds}, {args.requests}")
    models = build(args.work)
    trace = np.resize(np.random.default_rng(0).permutation(models.split.y_test.size), args.requests)
    port = free_port()
    with cloud_server(models, port):
        proxy = DelayProxy(("127.0.0.1", port)).start()
        try:
            by_share(models, trace, proxy, args.requests)
            again(models, trace, proxy, args.requests, args.rounds)
        finally:
            proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
