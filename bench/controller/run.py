"""Evaluate the controller on a real stream, a real agent and a real cloud service on loopback.

    python bench/controller/run.py [--phases adapt|binding|trace] [--quick] [--requests N] [--only 1,2]
                                   [--work DIR] [--rate R] [--png PATH]

A delay-injecting TCP proxy sits between the agent and `tierkit serve`, while the held-out MNIST
stream is replayed (the same trace for every strategy). Requests arrive at a fixed rate, as from an
external load generator (`replay`): several are in flight while escalations wait, and every phase
lasts its requests / rate seconds for every strategy.

- `--phases adapt` (default): the round trip steps 2 ms -> 60 ms -> cloud down -> 2 ms and the
  latency budget 20 ms -> 8 ms; budgets rarely bind.
- `--phases binding`: phases where the budgets bind: +2 ms with 0-12 ms jitter under a p95 budget
  that a good share of the jittered escalations can meet (the third quartile of cloud-only latency
  on that link, measured in the same run); free escalation (60 ms); an energy budget half way
  between edge-only and cloud-only (measured in the same run); the cloud down, then back, under
  10 ms. 100 requests/s by default.

- `--phases trace`: a trace-driven link with bandwidth as well as delay (the proxy sends each direction
  at the phase's rate, so a request's bytes and its wire encoding matter; every strategy's agent
  chooses its encoding with `wire_encoding="auto"` from the link's measured bandwidth): 10 Mbit/s at
  20 ms -> 1 Mbit/s at 200 ms -> a 10 s outage -> 10 Mbit/s at 20 ms again with a 0.3 s loss burst
  every 2 s, under a 40 ms p95 budget. Checked besides the binding checks: escalations resume within
  1 s of the link's return, and the controller settles within 100 requests of each change.

`--requests N` and `--only 1,2` shorten a run for diagnosis (N requests per phase; only those
phases, numbered as in the full plan). `--repeats K` runs every strategy K times, every other time in the
reverse order, and judges each strategy by its mean: where half the escalations miss their deadline,
which ones do is the link's draw and the host's, and one run of 1,000 requests tells a strategy's
accuracy to 0.2-0.6 points (the standard deviation between two runs of the jitter phase); the best of
three fixed strategies so drawn is biased up by most of one. The repeats' spread is printed beside the gap,
so a systematic gap is told from a draw.

Compared, per phase: the controller; the best static (variant, threshold) of each phase chosen with
hindsight that meets the same budgets (oracle); fixed 0.5 (Sedna's default) and, for binding
phases, fixed 0.99 confidence thresholds; edge-only; cloud-only. Reported: accuracy, p95 latency,
energy per request, share of 1-second windows over the latency budget (p95; the mean energy is held
over the phase, and windows over the energy budget are reported beside it), and the requests (and seconds)
the controller needed to settle after each change. Prints a table, the checks and a markdown
block, and writes a PNG of latency, accuracy and the chosen threshold over the trace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from models import CLOUD_NAME, Models, build
from replay import Phase, replay
from report import markdown, mean_results, metrics, paired, plot, table
from strategies import ALWAYS, NEVER, PhaseLatency, Point, Scripted, hindsight

from compilers.variants import VariantSet
from edge_agent.adaptive import AdaptiveOptions
from testkit.delay_proxy import DelayProxy


def phases(per_phase: int) -> list[Phase]:
    return [Phase("2 ms RTT", per_phase, 2.0, 20.0), Phase("60 ms RTT", per_phase, 60.0, 20.0),
            Phase("cloud down", per_phase, None, 20.0), Phase("2 ms RTT again", per_phase, 2.0, 20.0),
            Phase("budget 8 ms", per_phase, 2.0, 8.0)]


JITTER_MS = 12.0


def binding_phases(per_phase: int, energy_mj: float, jitter_budget_ms: float = 12.0) -> list[Phase]:
    """Phases where a budget binds; `energy_mj` lies between edge-only and cloud-only energy, and
    `jitter_budget_ms` is where a share of the jittered escalations fits (measured: `jitter_budget`)."""
    return [Phase(f"jitter 2+0-{JITTER_MS:g} ms", per_phase, 2.0, jitter_budget_ms, jitter_ms=JITTER_MS),
            Phase("free escalation", per_phase, 2.0, 60.0),
            Phase(f"energy {energy_mj:.2f} mJ", per_phase, 2.0, 60.0, energy_mj=energy_mj),
            Phase("cloud down", per_phase, None, 10.0),
            Phase("link back", per_phase, 2.0, 10.0)]


def trace_phases(per_phase: int) -> list[Phase]:
    """The trace: a good link, a slow narrow one, a 10 s outage (1,000 requests at 100/s), the good one
    back with loss bursts."""
    return [Phase("10 Mbit/s 20 ms", per_phase, 20.0, 40.0, bandwidth_mbps=10.0),
            Phase("1 Mbit/s 200 ms", per_phase, 200.0, 40.0, bandwidth_mbps=1.0),
            Phase("outage 10 s", 1000, None, 40.0),
            Phase("back, loss bursts", per_phase, 20.0, 40.0, bandwidth_mbps=10.0, stall_every_s=2.0, stall_s=0.3)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def cloud_server(models: Models, port: int):  # type: ignore[no-untyped-def]
    """`tierkit serve` in a child process, as an operator would run it."""
    cmd = [sys.executable, "-m", "sdk.cli", "serve", "--models", str(models.cloud_root), "--grpc",
           f"127.0.0.1:{port}", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                msg = f"tierkit serve exited: {proc.stderr.read() if proc.stderr else ''}"
                raise RuntimeError(msg)
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()


def adaptive_options(models: Models) -> AdaptiveOptions:
    """The operator's priors: the cloud model's validation accuracy, as its compiler measured it on
    labelled samples, weighted as that many escalations' agreement (at most 300)."""
    cloud = VariantSet.load(models.cloud_root / CLOUD_NAME).recommended
    prior = min(float(cloud.fidelity.get("accuracy", 0.99)), 0.999)
    weight = min(float(cloud.fidelity.get("samples", 30.0)), 300.0)
    return AdaptiveOptions(cloud_accuracy=prior, cloud_accuracy_weight=weight, benchmark_repeats=30)


def select(only: str | None, count: int, ap: argparse.ArgumentParser) -> list[int]:
    """The indices of the phases `--only` names (1-based, comma-separated); all of them without it."""
    if only is None:
        return list(range(count))
    try:
        picked = sorted({int(x) - 1 for x in only.split(",") if x.strip()})
    except ValueError:
        picked = []
    if not picked or picked[0] < 0 or picked[-1] >= count:
        ap.error(f"--only takes phase numbers 1..{count} separated by commas, got {only!r}")
    return picked


def jitter_budget(latency_ms: np.ndarray) -> float:
    """The p95 budget of the jittered phase: the third quartile of cloud-only latency on that link with
    no budget in the way (rounded to 0.5 ms), so that the cloud can answer a good share in time and
    misses the rest. A fixed figure does not bind the same way on every machine: with 12 ms on a
    loaded 2-core host, the jittered round trip (9-20 ms) left no escalation able to answer."""
    return round(2 * float(np.quantile(latency_ms, 0.75))) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", choices=("adapt", "binding", "trace"), default="adapt",
                    help="adapt: link and budget steps (default); binding: phases where the budgets bind; "
                         "trace: bandwidth, delay, an outage and loss bursts")
    ap.add_argument("--quick", action="store_true",
                    help="400 requests per phase instead of 1,200 (binding: 300 instead of 1,000)")
    ap.add_argument("--requests", type=int, help="requests per phase (overrides the default and --quick)")
    ap.add_argument("--only", help="run only these phases, e.g. 1,2 (numbered as in the full plan)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "tierkit-bench-controller",
                    help="cache of the trained and compiled models")
    ap.add_argument("--rate", type=float, help="requests per second, arriving at fixed times (adapt 200, binding and "
                                               "trace 100)")
    ap.add_argument("--png", type=Path, default=Path(__file__).with_name("controller.png"))
    ap.add_argument("--dump", type=Path, help="also write every record and the controller's decisions here (.npz)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every strategy this many times, every other time in the reverse order: the table and "
                         "checks use each strategy's mean, and the controller's gap to the best fixed strategy is "
                         "printed per repeat with its mean and standard error (the dump and plot: the first run)")
    args = ap.parse_args(argv)
    binding, traced = args.phases == "binding", args.phases == "trace"
    args.rate = args.rate or (100.0 if binding or traced else 200.0)
    per_phase = ((300 if args.quick else 1000) if binding else (300 if args.quick else 800) if traced
                 else (400 if args.quick else 1200))
    encoding = "auto" if traced else "fp32"
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.requests is not None:
        if args.requests < 50:
            ap.error(f"--requests must be at least 50, got {args.requests}")
        per_phase = args.requests
    plan = (binding_phases(per_phase, 0.0) if binding else trace_phases(per_phase) if traced
            else phases(per_phase))
    only = select(args.only, len(plan), ap)
    plan = [plan[i] for i in only]
    total = sum(p.requests for p in plan)
    models = build(args.work)
    vs = models.variants
    off = models.offline
    rng = np.random.default_rng(0)
    trace = np.resize(rng.permutation(models.split.y_test.size), total)
    fidelity = {e.id: float(e.fidelity.get("accuracy", 0.0)) for e in vs.entries}
    best_edge = max(vs.entries, key=lambda e: (fidelity[e.id], -e.cost_ms)).id
    recommended = vs.recommended.id
    print(f"edge ladder: {[e.id for e in vs.entries]} (recommended {recommended}, most accurate {best_edge}); "
          f"{total} requests per strategy arriving at {args.rate:g}/s")
    port = free_port()
    with cloud_server(models, port):
        proxy = DelayProxy(("127.0.0.1", port)).start()
        try:
            calib = Phase("edge only", 300 if args.quick else 600, 0.0, 1000.0)
            edge_ms, edge_mj = {}, {}
            for e in vs.entries:
                rec = replay(Scripted([Point(e.id, NEVER)]), models, [calib], trace, proxy, rate=args.rate)
                edge_ms[e.id], edge_mj[e.id] = rec["latency_ms"], float(rec["energy_mj"].mean())
            if binding:  # the energy budget: half way between edge-only and cloud-only, as measured here
                free = Phase("free", calib.requests, 2.0, 60.0)
                rec = replay(Scripted([Point(recommended, ALWAYS)]), models, [free], trace, proxy, rate=args.rate)
                low, high = edge_mj[best_edge], float(rec["energy_mj"].mean())
                jittered = Phase("free, jittered", calib.requests, 2.0, 60.0, jitter_ms=JITTER_MS)
                rec = replay(Scripted([Point(recommended, ALWAYS)]), models, [jittered], trace, proxy, rate=args.rate)
                budget_ms = jitter_budget(rec["latency_ms"])
                plan = binding_phases(per_phase, low + 0.5 * (high - low), budget_ms)
                plan = [plan[i] for i in only]
                print(f"energy per request: edge-only {low:.3f} mJ, cloud-only {high:.3f} mJ "
                      f"-> budget {low + 0.5 * (high - low):.3f} mJ; cloud-only latency on the jittered link: median "
                      f"{np.median(rec['latency_ms']):.2f} ms, p95 {np.quantile(rec['latency_ms'], 0.95):.2f} ms "
                      f"-> p95 budget {budget_ms:g} ms")
            records: dict[str, dict[str, Any]] = {}
            fixed = [("fixed-0.5", Point(recommended, 0.5))] + ([("fixed-0.99", Point(recommended, 0.99))]
                                                                if binding or traced else [])
            statics = [("edge-only", Point(best_edge, NEVER)), ("cloud-only", Point(recommended, ALWAYS)), *fixed]

            def run(name: str, points: list[Point] | None = None) -> dict[str, Any]:
                print(f"replaying {name} ...", flush=True)
                if name == "controller":
                    return replay(True, models, plan, trace, proxy, rate=args.rate,
                                  adaptive=adaptive_options(models), wire_encoding=encoding)
                return replay(Scripted(points or [dict(statics)[name]]), models, plan, trace, proxy,
                              rate=args.rate, wire_encoding=encoding)

            for name, _ in statics:
                records[name] = run(name)
            cloud = records["cloud-only"]
            med = float(np.median(edge_ms[recommended]))
            points, predicted = [], []
            for pi, phase in enumerate(plan):
                m = cloud["phase"] == pi
                link = PhaseLatency(cloud["latency_ms"][m & cloud["cloud"]] - med,
                                    cloud["latency_ms"][m & ~cloud["cloud"]] - med, float(cloud["cloud"][m].mean()),
                                    float(cloud["energy_mj"][m].mean()) - edge_mj[recommended])
                point, pred = hindsight(trace[m], off.scores, off.correct, off.cloud_correct, edge_ms, link,
                                        phase.latency_ms, energy_budget_mj=phase.energy_mj, edge_mj=edge_mj)
                points.append(point)
                predicted.append(pred)
            print("oracle points: " + "; ".join(f"{p.name}: {q.variant}@{q.threshold:.4g} (esc {r['escalation']:.1%})"
                                                for p, q, r in zip(plan, points, predicted, strict=True)))
            records["oracle"] = run("oracle", points)
            records["controller"] = run("controller")
            repeats = [records]
            for r in range(1, args.repeats):  # the same strategies again, in the reverse order, then forward
                names = ["controller", "oracle", *reversed([n for n, _ in statics])]
                print(f"repeat {r + 1} of {args.repeats}", flush=True)
                repeats.append({n: run(n, points if n == "oracle" else None)
                                for n in (names if r % 2 else names[::-1])})
        finally:
            proxy.stop()
    order = ["controller", "oracle", *(name for name, _ in fixed), "edge-only", "cloud-only"]
    each = [{k: metrics(rec[k], plan, adaptive=k == "controller") for k in order} for rec in repeats]
    results = mean_results(each)
    labels = {k: records[k]["energy_label"] for k in order}
    print(table(results, plan, labels))
    check_energy_profile(labels)
    print(f"\ncontroller: {records['controller']['redecisions']} re-decisions, "
          f"{len(records['controller']['decisions'])} recorded decisions")
    print_encodings(records["controller"], plan)
    ctl, oracle = results["controller"], results["oracle"]
    if binding or traced:
        check_binding(ctl, results, plan)
    if len(each) > 1 and (binding or traced):
        print(paired(each, plan, meets))
        check_resume(records["controller"], plan)
    else:
        check_adapt(ctl, oracle, plan)
    png = plot({k: records[k] for k in order}, plan, args.png)
    with contextlib.suppress(ValueError):
        png = png.resolve().relative_to(Path.cwd())
    if args.dump:  # the first repeat's keys bare, the others' prefixed "repeat2.", "repeat3.", ...
        arrays: dict[str, Any] = {}
        for r, rec in enumerate(repeats):
            pre = f"repeat{r + 1}." if r else ""
            arrays |= {f"{pre}{k}.{f}": v for k in order for f, v in rec[k].items() if isinstance(v, np.ndarray)}
            arrays[f"{pre}decisions"] = json.dumps(rec["controller"]["decisions"])
        np.savez(args.dump, **arrays)
    flags = ((f" --phases {args.phases}" if binding or traced else "") + (" --quick" if args.quick else "")
             + (f" --requests {args.requests}" if args.requests is not None else "")
             + (f" --only {args.only}" if args.only else ""))
    header = (f"### Controller evaluation (`bench/controller/run.py{flags}`)\n\n"
              f"MNIST held-out stream, {per_phase} requests per phase arriving at {args.rate:g}/s, edge ladder "
              f"{', '.join(e.id for e in vs.entries)}, cloud `{CLOUD_NAME}` via `tierkit serve` behind a TCP delay "
              f"proxy on loopback. Plot: `{png}`.")
    print("\n" + markdown(results, plan, header=header, labels=labels["controller"]))
    return 0


def print_encodings(rec: dict[str, Any], plan: list[Phase]) -> None:
    """The wire encodings the controller planned in each phase (share of requests), where it planned any."""
    if not any(rec["encoding"]):
        return
    print("controller's wire encoding per phase (share of requests): " + "; ".join(
        f"{phase.name}: " + ", ".join(f"{e or 'per request'} {n / (rec['phase'] == pi).sum():.0%}" for e, n in
                                      zip(*np.unique(rec["encoding"][rec["phase"] == pi], return_counts=True),
                                          strict=True))
        for pi, phase in enumerate(plan)))


def check_energy_profile(labels: dict[str, str]) -> None:
    """Every agent of the run models energy with this machine's probed profile (`tierkit doctor`'s, the
    compiler's): one label for the same device."""
    from runtimes.hardware import machine_power_profile

    probed = machine_power_profile().label
    agents = {m for label in labels.values() for m in re.findall(r"(?:modeled|measured):[\w.-]+", label)}
    ok = all(a == probed or a.startswith("measured:") for a in agents)
    print(f"energy profile: probed {probed}; the agents' {', '.join(sorted(agents))}  {'ok' if ok else 'MISMATCH'}")


def meets(row: dict[str, Any], phase: Phase) -> bool:
    """Whether a strategy kept a phase's budgets: <= 5 % of 1-second windows over the latency budget, mean
    energy within the energy budget (the issue's checks; windows over the energy budget are reported)."""
    return row["violating"] <= 0.05 and (phase.energy_mj is None or row["energy_mj"] <= phase.energy_mj)


def check_resume(rec: dict[str, Any], plan: list[Phase]) -> None:
    """After each phase where the cloud was down or nothing fit, how long until the first cloud answer."""
    print("\ntarget: escalations resume within 1 s of the link's return:")
    for pi in range(1, len(plan)):
        before, phase = plan[pi - 1], plan[pi]
        if phase.rtt_ms is None or (before.rtt_ms is not None and before.rtt_ms < before.latency_ms):
            continue
        m = rec["phase"] == pi
        t0 = float(rec["t"][m][0])
        answered = rec["t"][m & rec["cloud"]]
        after = float(answered[0]) - t0 if answered.size else float("inf")
        print(f"  {phase.name:<18} first cloud answer {after:.2f} s after the change  "
              f"{'ok' if after <= 1.0 else 'MISSED'}")


def check_binding(ctl: list[dict[str, Any]], results: dict[str, list[dict[str, Any]]], plan: list[Phase], *,
                  settle: int = 100) -> None:
    """The checks of phases where budgets bind, over each whole phase. The accuracy is compared with the best
    fixed strategy of the phase that kept the same budgets, chosen with hindsight: the oracle (the best static
    point by the model fitted to the cloud-only run) or a fixed threshold that did better in the same run."""
    print("\ntargets, every phase: <= 5% of 1-second windows over the latency budget (p95); mean energy within "
          "the budget; accuracy within 1 point of the best fixed strategy that kept the same budgets (hindsight); "
          f"settled within {settle} requests:")
    for pi, phase in enumerate(plan):
        c = ctl[pi]
        fair = {k: rows[pi] for k, rows in results.items() if k != "controller" and meets(rows[pi], phase)}
        best = max(fair, key=lambda k: fair[k]["accuracy"]) if fair else None
        gap = 100 * (c["accuracy"] - fair[best]["accuracy"]) if best is not None else 0.0
        ok = (meets(c, phase), gap >= -1.0 - 1e-9, c["converge_requests"] <= settle)  # -1.00 is within
        held = ("" if phase.energy_mj is None else
                f" (budget {phase.energy_mj:.3f}, windows over it {100 * c['energy_windows_over']:.0f}%)")
        print(f"  {phase.name:<18} windows violating {100 * c['violating']:.1f}%  energy {c['energy_mj']:.3f} mJ"
              f"{held}  accuracy vs {best} "
              f"{gap:+.2f} points  settled after {c['converge_requests']} requests  {'ok' if all(ok) else 'MISSED'}")


def check_adapt(ctl: list[dict[str, Any]], oracle: list[dict[str, Any]], plan: list[Phase]) -> None:
    print("\ntargets, after convergence: <= 1% of windows over the latency budget; accuracy within 0.5 points of "
          "the oracle's; settled within 200 requests or 5 s:")
    for pi, phase in enumerate(plan):
        c, o = ctl[pi], oracle[pi]
        gap = 100 * (c["accuracy_after"] - o["accuracy"])
        ok = (c["violating_after"] <= 0.01, gap >= -0.5 - 1e-9, c["converge_requests"] <= 200 or c["converge_s"] <= 5)
        print(f"  {phase.name:<16} windows violating {100 * c['violating_after']:.1f}%  accuracy vs oracle {gap:+.2f} "
              f"points  settled after {c['converge_requests']} requests / {c['converge_s']:.2f} s  "
              f"{'ok' if all(ok) else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
