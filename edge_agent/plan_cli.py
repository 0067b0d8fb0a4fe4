"""`tierkit plan`: what the controller would choose on a device, before deployment.

    tierkit plan VARIANTS [--rtt-ms R] [--latency-ms L] [--energy-mj E] [--max-escalations-per-s C] [--json]

It reads the stored profiles (build-host latency, energy and validation outputs of every variant),
assumes a link, and prints the chosen operating point and the Pareto frontier (accuracy vs p95
latency vs energy) as a table, writing the same as a PNG plot.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from compilers.package import ModelPackage
from compilers.variants import VariantSet, is_variant_set
from edge_agent.budget import Budget
from edge_agent.plan import Conditions, PlanReport, format_table, plot_frontier, what_if
from edge_agent.policy import Policy
from edge_agent.profiles import LinkProfile, VariantProfile
from runtimes.errors import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `tierkit plan`."""
    p = subparsers.add_parser("plan", help="what-if planning: the operating point and Pareto frontier",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", help="a variant-set directory (or one package directory)")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="assumed median round trip to the cloud (20)")
    p.add_argument("--rtt-p95-ms", type=float, default=None, help="assumed p95 round trip (1.3 x median)")
    p.add_argument("--no-cloud", action="store_true", help="plan an edge-only device")
    p.add_argument("--latency-ms", type=float, default=Budget().latency_ms, help="p95 latency budget")
    p.add_argument("--energy-mj", type=float, default=None, help="mean energy budget per request (mJ)")
    p.add_argument("--max-escalations-per-s", type=float, default=None, help="cap on cloud calls per second")
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests per second (default: one after another)")
    p.add_argument("--cloud-accuracy", type=float, default=0.99, help="cloud accuracy on escalated inputs")
    p.add_argument("--availability", type=float, default=1.0, help="share of escalations the cloud answers")
    p.add_argument("--wait-power-w", type=float, default=0.3, help="modeled power while waiting for the cloud")
    p.add_argument("--energy-per-byte-mj", type=float, default=1e-4, help="modeled radio energy per byte sent")
    p.add_argument("--policy", default="calibrated", help="escalation scorer (max_prob, margin, ...)")
    p.add_argument("--png", type=Path, default=Path("tierkit-plan.png"), help="where to write the plot")
    p.add_argument("--no-png", action="store_true", help="do not write the plot")
    p.add_argument("--all", action="store_true", help="list every point, not only the frontier")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def load_profiles(path: str | Path, policy: Policy) -> list[VariantProfile]:
    """One profile per variant of the set at `path` (or for the single package there)."""
    path = Path(path)
    if is_variant_set(path):
        vs = VariantSet.load(path)
        pkgs = [(e.id, vs.open(e.id)) for e in vs.entries]
    else:
        pkg = ModelPackage.open(path)
        pkgs = [(path.name, pkg)]
    return [VariantProfile.from_package(pkg, policy, variant_id=vid) for vid, pkg in pkgs]


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.availability <= 1:
        msg = f"--availability must be in [0, 1], got {args.availability}"
        raise ConfigError(msg)
    budget = Budget(latency_ms=args.latency_ms, energy_mj=args.energy_mj,
                    max_escalations_per_s=args.max_escalations_per_s)
    profiles = load_profiles(args.variants, Policy(args.policy))
    link = None
    if not args.no_cloud:
        lp = LinkProfile(rtt_ms=args.rtt_ms, rtt_high_ms=args.rtt_p95_ms, cloud_accuracy=args.cloud_accuracy,
                         wait_power_w=args.wait_power_w, energy_per_byte_mj=args.energy_per_byte_mj)
        link = lp.state()
        if args.availability < 1:
            link = replace(link, availability=args.availability)
    report = what_if(profiles, link, budget, conditions=Conditions(request_rate=args.request_rate))
    png = None if args.no_png else plot_frontier(report.points, report.frontier, args.png, chosen=report.decision,
                                                 budget=budget, title=f"tierkit plan: {Path(args.variants).name}")
    if args.json:
        doc = report.to_json()
        doc["png"] = str(png) if png else None
        if args.all:
            doc["all_points"] = PlanReport(report.decision, [], report.points).to_json()["frontier"]
        print(json.dumps(doc, indent=2))
        return 0
    d = report.decision
    status = "meets the budgets" if d.feasible else f"VIOLATES the {' and '.join(d.violated)} budget"
    print(f"chosen: {d.variant} at threshold {d.threshold:.4g} ({status})")
    print(f"  accuracy {100 * d.predicted_accuracy:.2f}%  p95 {d.predicted_p95_ms:.2f} ms  "
          f"energy {d.predicted_energy_mj:.3f} mJ ({d.energy_label})  "
          f"escalations {100 * d.predicted_escalation_rate:.1f}%")
    print(f"  why: {d.reason}")
    print(f"\n{'all points' if args.all else 'Pareto frontier'} (accuracy vs p95 latency vs energy):")
    print(format_table(report.points if args.all else report.frontier, d))
    if png:
        print(f"\nplot: {png}")
    return 0
