"""A link that answers each escalation in time with probability q, the rest timing out at the budget, in simulated
time: what `edge_agent.link.Link` reads of it.

    PYTHONPATH=. python bench/controller/straddle.py [--seeds 8] [--seconds 60]

Escalations arrive at 40/s while the link is up and 10/s while it is down (a controller's probe floor). A long run
of timeouts marks such a link down; the answers among the timeouts that follow mark it up. Printed per q: the share
answered in time a plan reads (the finite share of `LinkView.rtt_samples`) over all escalations while up and over the
first 40 after each time it came up, and the flips of up/down a minute. Reads near q are right; a read well over q
after coming up is a link taken as back in full that is not.
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from edge_agent.link import Link

BUDGET_MS = 10.0


def run(q: float, seed: int, seconds: float) -> tuple[float, float, float]:
    """(mean share read while up, mean over the first 40 escalations after each time it came up, flips a minute)."""
    rnd = random.Random(seed)
    now = [0.0]
    link = Link(rtt_ms=5.0, clock=lambda: now[0])
    reads: list[float] = []
    after_up: list[list[float]] = []
    flips, was_up = 0, True
    while now[0] < seconds:
        now[0] += rnd.expovariate(40.0 if link.up else 10.0)
        link.attempted()
        if rnd.random() < q:
            link.observe_answer(4.0 * (0.8 + 0.4 * rnd.random()))
        else:
            link.observe_timeout(BUDGET_MS)
        view = link.view()
        read = float(np.isfinite(view.rtt_samples).mean())  # an escalation not answered in time reads +inf
        if view.up and not was_up:
            after_up.append([])
        if view.up:
            reads.append(read)
            if after_up and len(after_up[-1]) < 40:
                after_up[-1].append(read)
        flips += view.up != was_up
        was_up = view.up
    first = float(np.mean([np.mean(a) for a in after_up])) if after_up else float("nan")
    return float(np.mean(reads)) if reads else float("nan"), first, flips * 60.0 / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    print("| answered in time (q) | share read while up | over the first 40 after coming up | up/down flips a minute |")
    print("| ---: | ---: | ---: | ---: |")
    for q in (0.03, 0.1, 0.3, 0.9):
        res = np.array([run(q, s, args.seconds) for s in range(args.seeds)])
        first = res[:, 1][np.isfinite(res[:, 1])]
        print(f"| {q:.2f} | {np.nanmean(res[:, 0]):.3f} | {np.mean(first) if first.size else float('nan'):.3f} "
              f"| {res[:, 2].mean():.1f} |")


if __name__ == "__main__":
    main()
