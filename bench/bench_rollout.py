"""Rollout rollback time: from a failed gate to the whole fleet back on the previous release.

A real `tierkit fleet serve` process, a real Mosquitto (the fleet's ACL and password file) and N
simulated devices (testkit/rollout_device.py) that follow their desired release over MQTT,
download it over HTTP, soak and commit, and publish telemetry windows. The release rolls out in
waves 1,100%: the canary passes; then the release turns bad (+10 points of escalation) while every
device takes it in the last wave, whose gate fails after the soak, so the rollback covers the
whole fleet. Times, on the host's one clock:

    fail -> all back     from the `fail` decision to the last device running the previous release again
                         (device side: the A/B pointer flip)
    fail -> recorded     from the `fail` decision to the fleet recording every device restored
                         (their reported documents ingested)

    python bench/bench_rollout.py [--devices 20,100] [--window 1.0] [--json]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testkit.rollout_device import HEALTHY, MORE_ESCALATIONS  # noqa: E402
from testkit.rollout_harness import RolloutFleet  # noqa: E402


def run(n: int, window_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tierkit-bench-rollout-") as tmp, \
            RolloutFleet(Path(tmp), n, window_s=window_s, online_after="30s") as fleet:
        release = fleet.release(HEALTHY)
        t_deploy = time.time()
        rid = fleet.deploy(release, waves="1,100%", soak="30")
        fleet.wait("the canary to pass", lambda: fleet.show(rid)["waves"][0]["state"] == "passed", timeout=120)
        fleet.behaviours[release] = MORE_ESCALATIONS  # the release turns bad as the whole fleet takes it
        shown = fleet.wait("the rollout to fail", lambda: (s := fleet.show(rid))["state"] == "rolled_back" and s,
                           timeout=300)
        fail = next(d for d in shown["decisions"] if d["kind"] == "fail")
        took = sum(release in d.ran for d in fleet.devices)
        fleet.wait("every device back", lambda: all(d.running == fleet.first for d in fleet.devices), timeout=300)
        restored = fleet.wait("the fleet to record it", lambda: next(
            (d for d in fleet.show(rid)["decisions"] if d["kind"] == "restored"), None), timeout=300)
        backs = [d.flipped_back_at - fail["at"] for d in fleet.devices if d.flipped_back_at is not None]
        return {"devices": n, "took_release": took, "flipped_back": len(backs),
                "failed_gates": [g["gate"] for g in fail["figures"]["gates"] if g["ok"] is False],
                "deploy_to_fail_s": fail["at"] - t_deploy, "fail_to_all_back_s": max(backs),
                "fail_to_back_p50_s": statistics.median(backs), "fail_to_recorded_s": restored["at"] - fail["at"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="20,100", help="fleet sizes, comma-separated")
    ap.add_argument("--window", type=float, default=1.0, help="devices' telemetry window (s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [run(int(n), args.window) for n in args.devices.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'devices':>8} {'took it':>8} {'back':>6} {'failed gates':<22} {'deploy->fail s':>15} "
          f"{'fail->all back s':>17} {'p50 s':>7} {'fail->recorded s':>17}")
    for r in rows:
        print(f"{r['devices']:>8} {r['took_release']:>8} {r['flipped_back']:>6} {','.join(r['failed_gates']):<22} "
              f"{r['deploy_to_fail_s']:>15.1f} {r['fail_to_all_back_s']:>17.2f} {r['fail_to_back_p50_s']:>7.2f} "
              f"{r['fail_to_recorded_s']:>17.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
