"""`tierkit fleet release|releases|deploy|rollouts|rollout ...`: releases and rollouts from the shell.

    tierkit fleet release create VARIANTS_DIR --policy policy.yaml --sign-key ops.key [--rollback-to DIGEST]
    tierkit fleet release add RELEASE_DIR_OR_TAR
    tierkit fleet releases [--json]
    tierkit fleet deploy RELEASE --label kind=cam --waves 1,5%,25%,100% [--soak 500 | --soak 10m]
                         [--cloud-capacity RPS] [--escalation-margin 0.05 ...]
    tierkit fleet rollouts [--json]
    tierkit fleet rollout show|pause|resume|rollback ID

Releases are verified against the fleet's release keys (`--release-key ops.pub`, or the `*.pub`
files in DATA_DIR/release-keys/). A running `tierkit fleet serve` carries rollouts out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from cloud_service.fleet.gates import Evidence, Margins
from cloud_service.protocol.fleet_docs import ROLLOUT_MAX_SOAK, ROLLOUT_SOAK, WAVES_TEXT

_MARGINS = {"p95_margin": "p95_ratio", "escalation_margin": "escalation_points",
            "agreement_margin": "agreement_points", "degraded_margin": "degraded_points",
            "energy_margin": "energy_ratio", "min_requests": "min_requests"}


def add_parsers(sub: Any, common: argparse.ArgumentParser, fleet: Any) -> None:
    """Register the subcommands; `fleet(args, **config)` opens the `Fleet` (cli._fleet)."""
    keys = argparse.ArgumentParser(add_help=False)
    keys.add_argument("--release-key", type=Path, action="append", default=[], metavar="PUB",
                      help="an Ed25519 public key releases must be signed with (repeatable)")

    rel = sub.add_parser("release", help="create or register a release").add_subparsers(dest="release_command",
                                                                                           required=True)
    rc = rel.add_parser("create", parents=[common, keys], help="create a signed release and register it")
    rc.add_argument("variants", type=Path, help="the variant set directory (tierkit compile's output)")
    rc.add_argument("--policy", type=Path, required=True, help="policy.yaml: name, version, threshold, budget, ...")
    rc.add_argument("--sign-key", type=Path, required=True, help="the operators' Ed25519 private key")
    rc.add_argument("--rollback-to", action="append", metavar="DIGEST",
                    help="a release devices may roll back to from this one (default: the newest of the same name)")
    rc.set_defaults(func=lambda a: _release_create(a, fleet))
    ra = rel.add_parser("add", parents=[common, keys], help="register a release made elsewhere (dir or archive)")
    ra.add_argument("path", type=Path)
    ra.set_defaults(func=lambda a: _release_add(a, fleet))
    rl = sub.add_parser("releases", parents=[common], help="list registered releases")
    rl.add_argument("--json", action="store_true")
    rl.set_defaults(func=lambda a: _releases(a, fleet))

    d = sub.add_parser("deploy", parents=[common], help="roll a release out in waves gated on model behaviour")
    d.add_argument("release", help="digest, digest prefix, or NAME@VERSION")
    d.add_argument("--label", default="", help="the devices with these labels (k=v[,k=v]; default: all)")
    d.add_argument("--waves", default=WAVES_TEXT, help="cumulative wave sizes, counts or percentages")
    d.add_argument("--soak", default=ROLLOUT_SOAK,
                   help="requests (500) or time (10m) a device runs the release at least")
    d.add_argument("--max-soak", default=ROLLOUT_MAX_SOAK,
                   help="a wave still inconclusive this long (or requests per device)...")
    d.add_argument("--on-inconclusive", default="hold", choices=("hold", "extend", "rollback", "promote"),
                   help="...is held for the operator, soaks on, is rolled back, or (after the canary) passes on "
                   "the evidence of the waves before it")
    d.add_argument("--alpha", type=float, help=f"false-rollback rate per rollout (default {Evidence().alpha})")
    d.add_argument("--beta", type=float, help=f"per gate and wave, chance a full-margin regression passes "
                   f"(default {Evidence().beta})")
    d.add_argument("--bucket", type=float, metavar="S", help="compare with control over buckets this long "
                   f"(default {Evidence().bucket_s:g} s: the agents' telemetry interval)")
    d.add_argument("--holdback", type=float, default=0.05,
                   help="share of devices (at least 2) the last wave keeps back as its control until its gates "
                   "pass, where fewer than 2 devices of earlier waves can serve as its control")
    d.add_argument("--audit-rate", type=float, default=0.5, metavar="SHARE",
                   help="share of confident answers a small wave's devices audit while it soaks (0: their own)")
    d.add_argument("--audit-devices", type=int, default=10, metavar="N",
                   help="a wave of at most this many devices audits at --audit-rate")
    d.add_argument("--pre-swap", default="5m", metavar="DURATION",
                   help="before such a wave's swap, its devices audit at --audit-rate on the release they run until "
                   "the audit baseline is narrow enough for its gate to pass, at most this long (0: no such phase)")
    d.add_argument("--previous", help="the release to roll back to (default: what most targeted devices run)")
    d.add_argument("--cloud-capacity", type=float, metavar="RPS",
                   help="escalations/s the cloud tier sustains (measure with bench/bench_cloud.py)")
    d.add_argument("--stall-after", default="5m", help="an assigned device with no progress this long: catch-up")
    for flag, name in _MARGINS.items():
        d.add_argument("--" + flag.replace("_", "-"), type=float if name != "min_requests" else int,
                       help=f"default {getattr(Margins(), name)}")
    d.set_defaults(func=lambda a: _deploy(a, fleet))

    ls = sub.add_parser("rollouts", parents=[common], help="list rollouts")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=lambda a: _rollouts(a, fleet))
    ro = sub.add_parser("rollout", help="one rollout").add_subparsers(dest="rollout_command", required=True)
    for name, text in (("show", "waves, gates with their figures against control, decisions"),
                       ("pause", "stop starting waves"), ("resume", "carry on"),
                       ("rollback", "send every device that took the release back to its previous one")):
        p = ro.add_parser(name, parents=[common], help=text)
        p.add_argument("id", type=int)
        if name == "show":
            p.add_argument("--json", action="store_true")
        p.set_defaults(func=lambda a, name=name: _rollout(a, fleet, name))


def _release_create(args: argparse.Namespace, fleet: Any) -> int:
    from compilers.signing import load_private_key

    with fleet(args, release_keys=tuple(args.release_key)) as f:
        rel = f.releases.create(args.variants, args.policy, sign_key=load_private_key(args.sign_key),
                                rollback_to=args.rollback_to)
    print(f"release {rel['name']}@{rel['version']} {rel['digest']} (rollback_to: "
          f"{', '.join(d[:19] for d in rel['rollback_to']) or 'none'})")
    return 0


def _release_add(args: argparse.Namespace, fleet: Any) -> int:
    with fleet(args, release_keys=tuple(args.release_key)) as f:
        rel = f.releases.register(args.path)
    print(f"release {rel['name']}@{rel['version']} {rel['digest']}")
    return 0


def _releases(args: argparse.Namespace, fleet: Any) -> int:
    with fleet(args) as f:
        rows = f.releases.list()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        made = time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["created_at"]))
        print(f"{r['digest'][:23]}  {r['name']}@{r['version']:<8} {made}  budget {r['budget'] or '-'}")
    if not rows:
        print("no release registered (tierkit fleet release create ...)")
    return 0


def _deploy(args: argparse.Namespace, fleet: Any) -> int:
    from cloud_service.fleet.cli import parse_duration
    from cloud_service.fleet.registry import parse_labels
    from cloud_service.fleet.rollouts import make_options

    margins = {name: getattr(args, flag) for flag, name in _MARGINS.items()}
    evidence = {"alpha": args.alpha, "beta": args.beta, "bucket_s": args.bucket}
    opts = make_options(waves=args.waves, soak=args.soak, cloud_capacity_rps=args.cloud_capacity,
                        stall_after_s=parse_duration(args.stall_after), margins=margins, evidence=evidence,
                        max_soak=args.max_soak, on_inconclusive=args.on_inconclusive, holdback=args.holdback,
                        audit_rate=args.audit_rate, audit_devices=args.audit_devices,
                        pre_swap_s=parse_duration(args.pre_swap) if args.pre_swap not in ("0", "0s") else 0.0)
    with fleet(args) as f:
        rid = f.rollouts.deploy(args.release, parse_labels(args.label, where="--label"), opts, previous=args.previous)
        r = f.rollouts.get(rid)
    print(f"rollout {rid}: {r['release'][:23]} to {r['selector']} in waves {','.join(opts.waves)}, "
          f"soak {opts.soak}; previous {r['previous'] or 'none'}")
    return 0


def _rollouts(args: argparse.Namespace, fleet: Any) -> int:
    with fleet(args) as f:
        rows = f.rollouts.list()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        states = " ".join(f"{k}={v}" for k, v in sorted(r["devices"].items()))
        print(f"{r['id']:>4}  {r['state']:<12} wave {r['wave'] + 1}/{len(r['options']['waves'])}  "
              f"{r['release'][:23]}  {r['selector']}  {states}")
    if not rows:
        print("no rollout (tierkit fleet deploy ...)")
    return 0


def _rollout(args: argparse.Namespace, fleet: Any, action: str) -> int:
    with fleet(args) as f:
        if action == "show":
            shown = f.rollouts.show(args.id)
            print(json.dumps(shown, indent=2, default=str) if args.json else format_rollout(shown))
            return 0
        r = {"pause": f.rollouts.pause, "resume": f.rollouts.resume,
             "rollback": f.rollouts.request_rollback}[action](args.id, by="cli")
    print(f"rollout {args.id}: {r['state']}")
    return 0


def _fig(v: Any) -> str:
    return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def _capacity(r: dict[str, Any]) -> str:
    """The capacity the gate was judged against: the rollout's own, else the fleet's (`--cloud-capacity`)."""
    judged = [g.get("limit") for w in r["waves"] for g in w["gates"] if g["gate"] == "cloud_capacity"]
    value = r["options"].get("cloud_capacity_rps") or next((v for v in reversed(judged) if v), None)
    return "-" if value is None else f"{value:g} escalations/s"


def _gate_line(g: dict[str, Any]) -> str:
    decision = {"pass": "pass", "fail": "FAIL", "open": "open"}.get(g.get("decision") or "", "-")
    if "estimate" in g:
        return (f"    {g['gate']:<20} {decision:<5} {_fig(g['estimate']):>9} [{_fig(g['lower'])}, {_fig(g['upper'])}]"
                f"  margin {_fig(g['margin'])}  evidence {_fig(g['evidence'])}  wave {_fig(g.get('wave'))}"
                f"  control {_fig(g.get('control'))}")
    return f"    {g['gate']:<20} {decision:<5} {_fig(g.get('wave')):>9}  limit {_fig(g.get('limit'))}  {g['note']}"


def format_rollout(r: dict[str, Any]) -> str:
    """`tierkit fleet rollout show ID`: waves, each gate's test (estimate, confidence bounds, margin), decisions."""
    ev = r["options"].get("evidence") or {}
    lines = [f"rollout {r['id']}: {r['state']}  release {r['release']}  previous {r['previous'] or 'none'}",
             f"  devices {r['selector']}: " + " ".join(f"{k}={v}" for k, v in sorted(r["states"].items())),
             f"  soak {r['options']['soak']}  max soak {r['options'].get('max_soak')}  "
             f"alpha {ev.get('alpha', '-')} per rollout  cloud capacity {_capacity(r)}"]
    if r["reason"]:
        lines.append(f"  reason: {r['reason']}")
    for w in r["waves"]:
        lines.append(f"  wave {w['idx']} ({w['spec']}, up to {w['size']} devices): {w['state']}  "
                     + " ".join(f"{k}={v}" for k, v in sorted(w["devices"].items())))
        if w["gates"]:
            lines.append(f"    control: {w['figures'].get('control_kind') or 'none'}")
            lines.append(f"    {'gate':<20} {'test':<5} {'estimate':>9} [confidence sequence]")
            lines.extend(_gate_line(g) for g in w["gates"])
    lines.append("  decisions:")
    for d in r["decisions"]:
        if d["kind"] != "observe":
            lines.append(f"    {time.strftime('%H:%M:%S', time.gmtime(d['at']))} {d['kind']:<16} "
                         f"wave {'-' if d['wave'] is None else d['wave']}  {d['note']}")
    return "\n".join(lines)
