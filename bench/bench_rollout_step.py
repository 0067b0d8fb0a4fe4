"""The rollout engine's step on a wide fleet: seconds a step takes while a canary soaks, on a real SQLite store.

`tierkit fleet serve` steps the engine every second. A step judges the wave against its control (at most
`control_max`, 200, devices), each device against its windows over the evidence's baseline (an hour: 360 windows
of 10 s a device, 72,000 windows for 200 devices). Rows:

(kept)   one engine, stepped once a simulated second, a window a device every 10 s: the windows it read, the
         wave's baselines and what the gates computed from them are kept between steps (`window_cache`)
(anew)   a new engine every step: every window read, parsed and judged again (the floor of a step without
         anything kept; the engine before `window_cache` kept only the parsed documents)

Both over the same store and rollout, in the same run; the ratio is anew / kept. The first step of each (the
first read of every window) and the wave's first `SETTLE_S` seconds (its baselines read once more then) are
shown apart from the settled steps' median.

    python bench/bench_rollout_step.py [--devices 200] [--baseline-windows 360] [--steps 40] [--anew-steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cpu_name  # noqa: E402
from cloud_service.fleet.rollout_engine import RolloutEngine  # noqa: E402
from cloud_service.fleet.rollouts import make_options  # noqa: E402
from cloud_service.fleet.store import FleetStore  # noqa: E402
from cloud_service.fleet.window_cache import SETTLE_S  # noqa: E402
from testkit.rollout_harness import TwoReleases, two_releases  # noqa: E402

WINDOW_S = 10.0


class _Fleet:
    """`n` enrolled devices publishing a window every WINDOW_S into the real telemetry store."""

    def __init__(self, f: TwoReleases, seed: int = 1) -> None:
        self.f, self.rng, self.now, self.seq = f, np.random.default_rng(seed), 1_800_000_000.0, 0
        self.running = dict.fromkeys(f.devices, f.first)
        for d in f.devices:
            f.desired.record_reported(d, {"release": f.first}, now=self.now)

    def tick(self) -> None:
        self.now += WINDOW_S
        self.seq += 1
        batch = []
        for d in self.f.devices:
            want = ((self.f.desired.effective(self.f.reg.device(d)) or {}).get("document", {}).get("release")
                    or self.f.first)
            if want != self.running[d]:
                self.running[d] = want
                self.f.desired.record_reported(d, {"release": want}, now=self.now)
            n = 100
            esc = int(self.rng.binomial(n, 0.2))
            p95 = 5.0 * float(np.exp(self.rng.normal(0, 0.1)))
            batch.append((d, json.dumps({
                "device": d, "boot_id": "b", "seq": self.seq, "ts": self.now, "window_s": WINDOW_S, "requests": n,
                "edge": n - esc, "cloud": esc, "compared": esc, "escalation_rate": esc / n, "agreement": 0.9,
                "audited": int(self.rng.binomial(n - esc, 0.01)), "audit_agreement": 1.0, "p95_ms": p95,
                "p50_ms": p95 / 2, "energy_mj_per_request": 2.0, "release": self.running[d]}).encode(), self.now))
        self.f.tel.ingest(batch)


def _steps(fleet: _Fleet, make: Any, steps: int, *, anew: bool) -> list[float]:
    engine = make()
    out = []
    start = fleet.now
    for i in range(steps):
        now = start + i  # a step a second, a window a device every 10 s
        if now >= fleet.now + WINDOW_S:
            fleet.tick()
        engine = make() if anew else engine
        t0 = time.perf_counter()
        engine.step(now=now)
        out.append(time.perf_counter() - t0)
    return out


def run(devices: int, baseline_windows: int, steps: int, anew_steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tierkit-bench-step-") as tmp:
        store = FleetStore.open(f"sqlite:///{Path(tmp) / 'fleet.db'}")
        try:
            fleet = _Fleet(two_releases(store, Path(tmp), devices))
            t0 = time.perf_counter()
            for _ in range(baseline_windows):
                fleet.tick()
            setup = time.perf_counter() - t0
            # a one-device canary soaking long (its own audits before the swap switched off: the canary's step)
            rid = fleet.f.rollouts.deploy(fleet.f.second, {}, make_options(
                waves="1,5%,25%,100%", soak="1000000", max_soak="1h", pre_swap_s=0))
            f = fleet.f

            def make() -> RolloutEngine:
                return RolloutEngine(store, f.desired, f.releases, holder="bench", online_after_s=120)

            kept = _steps(fleet, make, steps, anew=False)
            anew = _steps(fleet, make, anew_steps, anew=True)
            state = f.rollouts.show(rid)
        finally:
            store.close()
    settle = int(SETTLE_S)
    return {"devices": devices, "windows": devices * baseline_windows, "setup_s": round(setup, 1),
            "state": state["state"], "wave": state["wave"],
            "kept_first_s": round(kept[0], 3), "kept_settling_median_s": round(statistics.median(kept[1:settle]), 3),
            "kept_median_s": round(statistics.median(kept[settle + 1:]), 3),
            "kept_max_s": round(max(kept[settle + 1:]), 3), "anew_median_s": round(statistics.median(anew), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--baseline-windows", type=int, default=360, help="windows a device before the rollout")
    ap.add_argument("--steps", type=int, default=40, help="steps of the engine that keeps its windows")
    ap.add_argument("--anew-steps", type=int, default=5, help="steps of a new engine each")
    args = ap.parse_args()
    if args.steps <= SETTLE_S + 2:
        ap.error(f"--steps must be over {SETTLE_S + 2:g} (the settled steps are those after SETTLE_S)")
    r = run(args.devices, args.baseline_windows, args.steps, args.anew_steps)
    print(f"# bench_rollout_step on {cpu_name()}, Python {sys.version.split()[0]}; "
          f"{r['devices']} devices, {r['windows']} windows before the rollout (ingested in {r['setup_s']} s); "
          f"rollout {r['state']} at wave {r['wave']}")
    print("| engine | first step s | settling steps median s | settled steps median s | max s | ratio anew/kept |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| kept | {r['kept_first_s']} | {r['kept_settling_median_s']} | {r['kept_median_s']} | {r['kept_max_s']} "
          f"| 1.00 |")
    print(f"| anew | - | - | {r['anew_median_s']} | - | {r['anew_median_s'] / r['kept_median_s']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
