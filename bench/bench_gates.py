"""Rollout gates at fleet scale: false rollbacks of good releases (A/A), detection of known regressions (A/B).

Devices are drawn from a model (testkit/gate_sim.py): per-device levels of latency, energy,
escalation and confident-error rate, per-device noise, uneven traffic (log-normal rates), noisy neighbours
(shared-load spikes that hit every device, whichever release it runs, and each device's own slow swings of
p95 and energy: 0.1 sd on the log with 30 s correlation, `--swing-sd 0.35` for agents sharing two cores),
audits at the agent's default 1 %
(the canary at the rollout's raised `audit_rate` while it soaks), an hour of windows before the rollout
(the default baseline), and the engine's control: the devices not yet on the release and those of earlier
waves (each against its own windows on the release before the wave), with the hold-back of 5 % (at least 2)
devices only where fewer than that many of earlier waves have a baseline to be the last wave's control.
Releases: the same model (A/A), or one with a known regression (A/B): 2 points less accurate at the same
escalation rate, one class flipped (confident errors, mostly seen only by audits), +30 % p95, +10 % energy.

Two parts:

1. statistics (in-process, many runs): `--runs` A/A rollouts and `--ab-runs` per regression, every look
   judged by the same gate code the engine runs (`gates.evaluate`) on simulated windows;
2. end to end (`--e2e-devices`, 0 to skip): a real `tierkit fleet serve` and a real Mosquitto on loopback,
   that many simulated devices enrolled over HTTP, following their desired release over MQTT (download,
   verify, soak, commit, rollback) and publishing the agents' telemetry windows; one A/A rollout and one
   rollout per regression through the real rollout engine.

Reported: the A/A false-rollback rate (target <= 1 % of 100) and how many were held inconclusive; per
regression, the share stopped at the canary wave and the canary inferences each decision needed (target
<= 2,000); the soak inferences a good release needed per wave against the fixed default before the gates
were sequential (200 requests on every device of the wave: as 200 x devices, and as it ran with uneven
traffic, the wave's whole traffic until its slowest device had 200).

    python bench/bench_gates.py [--devices 200] [--runs 100] [--ab-runs 25] [--e2e-devices 200]
                                [--e2e-regressions accuracy-2,p95+30%] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cloud_service.fleet.gates import Evidence  # noqa: E402
from testkit.gate_sim import OLD_SOAK, REGRESSIONS, Fleet, Model, Outcome, model_devices, run_rollout, summary  # noqa: E402

WAVES = ("1", "5%", "25%", "100%")
TARGET_INFERENCES = 2000  # the canary inferences a decision should need


def _one(job: tuple[str, int, int, int, float, float]) -> dict[str, Any]:
    regression, seed, n, baseline, swing_sd, canary_share = job
    return asdict(run_rollout(Fleet(n, seed, Model(swing_sd=swing_sd), regression=regression), waves=WAVES,
                              max_soak_windows=90, baseline_windows=baseline,
                              evidence=Evidence(canary_share=canary_share)))


def statistics_part(n: int, runs: int, ab_runs: int, procs: int, baseline: int = 360,
                    swing_sd: float = Model().swing_sd,
                    canary_share: float = Evidence().canary_share) -> dict[str, Any]:
    jobs = [("none", s, n, baseline, swing_sd, canary_share) for s in range(runs)]
    jobs += [(r, 10_000 + k * 1000 + s, n, baseline, swing_sd, canary_share) for k, r in enumerate(REGRESSIONS)
             if r != "none" for s in range(ab_runs)]
    t0 = time.monotonic()
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        got = pool.map(_one, jobs, chunksize=2)
    out: dict[str, Any] = {"devices": n, "waves": ",".join(WAVES), "baseline_windows": baseline,
                           "swing_sd": swing_sd, "canary_share": canary_share,
                           "wall_s": round(time.monotonic() - t0, 1)}
    outs_all = [Outcome(**g) for g in got]
    for regression in REGRESSIONS:
        outs = [o for (r, *_), o in zip(jobs, outs_all, strict=True) if r == regression]
        if not outs:
            continue
        out[regression] = summary(outs)
        seeds: dict[str, list[int]] = {}  # to rerun one: run_rollout(Fleet(n, seed, ...), ...) as `_one`
        for (r, seed, *_), o in zip(jobs, outs_all, strict=True):
            if r == regression and o.result != "succeeded":
                seeds.setdefault(f"{o.result} wave {o.wave}: {','.join(o.gates)}", []).append(seed)
        out[regression]["seeds_not_succeeded"] = seeds
        if regression == "none":
            done = [o for o in outs if o.result == "succeeded"]
            sizes = _wave_devices(n)
            out[regression]["soak_inferences_per_wave_median"] = [
                int(np.median([o.wave_inferences[i] for o in done])) for i in range(len(WAVES))] if done else None
            out[regression]["old_default_soak_per_wave"] = [OLD_SOAK * s for s in sizes]
            # the canary's pre-swap audit phase (its devices on the previous release at the raised audit rate): what
            # it cost, apart from the soak of the release (its inferences ran the previous release)
            out[regression]["canary_pre_swap_windows_inferences_audits_median"] = [
                int(np.median([getattr(o, k) for o in done]))
                for k in ("pre_swap_windows", "pre_swap_inferences", "pre_swap_audits")] if done else None
            out[regression]["canary_pre_swap_share_of_runs"] = round(
                sum(o.pre_swap_windows > 0 for o in done) / max(1, len(done)), 3)
            # windows the last wave waited, its devices on the previous release, for its control's baselines
            out[regression]["last_wave_settle_windows_median_p90"] = [
                int(np.median([o.settle_windows for o in done])),
                int(np.percentile([o.settle_windows for o in done], 90))] if done else None
            # the old soak waited for every device of the wave: its slowest set the time, the others ran on
            out[regression]["old_default_soak_per_wave_uneven_traffic_median"] = [
                int(np.median([o.old_soak_inferences[i] for o in done])) for i in range(len(WAVES))] if done else None
    return out


def canary_floor(model: Model, audit_rate: float, canary_share: float) -> dict[str, dict[str, int]]:
    """Per gate, the fewest canary inferences at which a good release can pass and a margin-sized regression can
    fail (`gates.evidence_floor`: the confidence sequence's width, no baseline error, the control's noise left
    out) on the model's median device, from the model's per-unit variances; beside them, the old default's 200."""
    from cloud_service.fleet.gates import Margins, evidence_floor

    per_window = model.rate_rps * model.window_s
    p_esc = model.escalation * model.disagree
    p_conf = (1 - model.escalation) * model.conf_disagree
    log_var = (model.window_sd * (1 + 3 / per_window ** 0.5)) ** 2 + model.swing_sd ** 2
    # (per-unit variance, inferences per unit of the gate's weight)
    units = {"escalation_rate": (model.escalation * (1 - model.escalation), 1.0),
             "degraded_share": (model.degraded * (1 - model.degraded), 1.0),
             "agreement": (p_esc * (1 - p_esc), 1.0),
             # audits over the confident share: audit_rate per inference; the escalations' part rides along
             "audit_agreement": (p_conf * (1 - p_conf) + p_esc * (1 - p_esc) * audit_rate, 1 / audit_rate),
             "p95_vs_control": (log_var, per_window), "energy_per_request": (log_var / 9, per_window)}
    out = {}
    ev = Evidence(canary_share=canary_share)
    for gate, (var, per) in units.items():
        f = evidence_floor(gate, var, margins=Margins(), evidence=ev, waves=len(WAVES))
        out[gate] = {"pass": round(min(f["pass"], f["plan"]) * per), "fail": round(f["fail"] * per)}
    return out


def _wave_devices(n: int) -> list[int]:
    from cloud_service.fleet.rollouts import wave_sizes

    sizes = wave_sizes(WAVES, n)
    return [b - a for a, b in zip([0, *sizes[:-1]], sizes, strict=True)]


def e2e_part(n: int, regressions: list[str]) -> dict[str, Any]:
    from testkit.rollout_device import HEALTHY
    from testkit.rollout_harness import RolloutFleet

    model = Model(window_s=1.0, rate_rps=200.0)  # a window a second standing for a longer one of a busy device
    regressing: dict[str, str] = {}
    results: dict[str, Any] = {"devices": n}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tierkit-bench-gates-") as tmp, RolloutFleet(
            Path(tmp), n, window_s=1.0, online_after="30s", make_device=model_devices(Fleet(n, 7, model),
                                                                                       regressing)) as fleet:
        results["setup_s"] = round(time.monotonic() - t0, 1)
        for name in ("none", *regressions):
            release = fleet.release(HEALTHY)
            if name != "none":
                regressing[release] = name
            started = time.time()
            rid = fleet.deploy(release, waves=",".join(WAVES), soak="50", margins={},
                               evidence={"bucket_s": 1.0, "baseline_s": 600}, max_soak="5m")
            shown = fleet.wait(f"the {name} rollout to end", lambda rid=rid: (
                s := fleet.show(rid))["state"] not in ("running",) and s, timeout=900)
            decisive = [d for d in shown["decisions"] if d["kind"] in ("fail", "pass", "inconclusive")]
            last = decisive[-1] if decisive else {"wave": None, "figures": {}, "at": time.time()}
            gates = {g["gate"]: g for g in last["figures"].get("gates", [])}
            results[name] = {
                "state": shown["state"], "decided_at_wave": last["wave"], "seconds": round(last["at"] - started, 1),
                "failed": [g for g, v in gates.items() if v["ok"] is False],
                "canary_inferences": (shown["waves"][0]["figures"].get("wave") or {}).get("requests"),
                "tests": {g: {k: v.get(k) for k in ("decision", "estimate", "lower", "upper", "evidence")}
                          for g, v in gates.items() if "estimate" in v}}
            if shown["state"] == "paused":
                fleet.api("POST", f"/v1/rollouts/{rid}/rollback")
            fleet.wait("every device back on one release", lambda: len({d.running for d in fleet.devices}) == 1,
                       timeout=300)
    results["wall_s"] = round(time.monotonic() - t0, 1)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=200, help="simulated fleet size (statistics part)")
    ap.add_argument("--runs", type=int, default=100, help="A/A rollouts")
    ap.add_argument("--ab-runs", type=int, default=25, help="rollouts per regression")
    ap.add_argument("--e2e-devices", type=int, default=200, help="devices over the real fleet and broker; 0: skip")
    ap.add_argument("--e2e-regressions", default="accuracy-2,p95+30%",
                    help="A/B rollouts end to end after one A/A: "  # argparse formats help with %: the names carry one
                    + ", ".join(r for r in REGRESSIONS if r != "none").replace("%", "%%"))
    ap.add_argument("--procs", type=int, default=2, help="processes for the statistics part")
    ap.add_argument("--baseline-windows", type=int, default=360,
                    help="windows (10 s) each device sends before a rollout: 360 is the default baseline, an hour")
    ap.add_argument("--swing-sd", type=float, default=Model().swing_sd,
                    help="sd of a device's own slow swings of log p95 (30 s correlation); 0.35 is five agents on two "
                         "shared cores")
    ap.add_argument("--canary-share", type=float, default=Evidence().canary_share,
                    help="share of alpha the canary wave spends (the later waves split the rest); 0.25 is an even "
                         "split over the four waves")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    wanted = [r for r in args.e2e_regressions.split(",") if r]
    unknown = set(wanted) - set(REGRESSIONS)
    if unknown:
        print(f"unknown regression(s) {sorted(unknown)}; known: {', '.join(REGRESSIONS)}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"statistics": statistics_part(args.devices, args.runs, args.ab_runs, args.procs,
                                                    args.baseline_windows, args.swing_sd, args.canary_share)}
    stats = out["statistics"]
    aa = stats["none"]
    out["checks"] = {
        "aa_false_rollback_rate": aa["rolled_back"] / max(1, aa["runs"]),
        "aa_false_rollback_rate_ci95": aa["rolled_back_ci95"],
        # the design: alpha split over the waves (the canary: --canary-share), evenly over gates, valid every look
        "aa_design_alpha": Evidence().alpha, "aa_design_alpha_per_gate_by_wave": [
            Evidence(canary_share=args.canary_share).alpha_gate(len(WAVES), w) for w in range(len(WAVES))],
        "aa_false_rollback_ok": aa["rolled_back"] <= max(1, aa["runs"] // 100),
        **{f"{r}_stopped_at_canary": stats[r]["stopped_at_canary"] / max(1, stats[r]["runs"])
           for r in REGRESSIONS if r != "none" and r in stats},
        **{f"{r}_canary_inferences_median": stats[r]["canary_inferences_median"]
           for r in REGRESSIONS if r != "none" and r in stats},
        **{f"{r}_canary_within_{TARGET_INFERENCES}":
           (stats[r]["canary_inferences_median"] or 10**9) <= TARGET_INFERENCES
           for r in REGRESSIONS if r != "none" and r in stats}}
    # what the statistics need at the canary (its median device), against the old default's 200 inferences
    out["checks"]["canary_floor_inferences_by_gate"] = canary_floor(Model(swing_sd=args.swing_sd), 0.5,
                                                                    args.canary_share)
    out["checks"]["canary_floor_old_default"] = OLD_SOAK
    soak = aa.get("soak_inferences_per_wave_median")
    if soak:  # a good release's soak against the old fixed default, wave by wave
        out["checks"]["soak_over_old_default"] = [round(a / b, 2) for a, b in zip(soak, aa["old_default_soak_per_wave"],
                                                                                 strict=True)]
        out["checks"]["soak_over_old_default_uneven_traffic"] = [
            round(a / b, 2) for a, b in zip(soak, aa["old_default_soak_per_wave_uneven_traffic_median"], strict=True)]
    print(json.dumps(out, indent=None if args.json else 1, default=str), flush=True)
    if args.e2e_devices:
        e2e = e2e_part(args.e2e_devices, wanted)
        print(json.dumps({"end_to_end": e2e}, indent=None if args.json else 1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
