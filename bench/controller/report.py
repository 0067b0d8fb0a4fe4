"""Per-phase metrics, the comparison table, the markdown block and the plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from replay import Phase

WINDOW_S = 1.0
MIN_WINDOW = 5  # requests; emptier windows (a phase's last fraction of a second) are not judged


def _windows(t: np.ndarray) -> np.ndarray:
    return np.floor((t - t[0]) / WINDOW_S).astype(int)


def _violations(rec: dict[str, Any], m: np.ndarray, phase: Phase, since: float, *,
                energy: bool = False) -> tuple[float, int]:
    """Share of 1-second windows (starting at or after `since` s into the phase) over the latency budget
    (p95), or with `energy` over the energy budget (the window's mean: information; the budget is the
    phase's mean)."""
    t, lat, joules = rec["t"][m], rec["latency_ms"][m], rec["energy_mj"][m]
    w = _windows(t)
    judged = bad = 0
    for k in np.unique(w):
        sel = w == k
        if sel.sum() < MIN_WINDOW or t[sel][0] - t[0] < since - 1e-9:
            continue
        judged += 1
        over = (joules[sel].mean() > phase.energy_mj if energy and phase.energy_mj is not None
                else not energy and np.quantile(lat[sel], 0.95) > phase.latency_ms)
        bad += int(over)
    return (bad / judged if judged else 0.0), judged


def metrics(rec: dict[str, Any], phases: list[Phase], *, adaptive: bool) -> list[dict[str, Any]]:
    """One dict per phase: accuracy, p95, energy, escalations, window violations, convergence."""
    out = []
    keys = list(zip(rec["variant"].tolist(), rec["threshold"].tolist(), strict=True))
    for pi, phase in enumerate(phases):
        idx = np.flatnonzero(rec["phase"] == pi)
        m = rec["phase"] == pi
        t = rec["t"][m]
        row: dict[str, Any] = {
            "phase": phase.name, "n": int(idx.size), "accuracy": float(rec["correct"][m].mean()),
            "p95_ms": float(np.quantile(rec["latency_ms"][m], 0.95)), "energy_mj": float(rec["energy_mj"][m].mean()),
            "escalated": float(rec["wanted"][m].mean()), "cloud_answered": float(rec["cloud"][m].mean()),
        }
        row["violating"], row["windows"] = _violations(rec, m, phase, 0.0)
        row["energy_windows_over"], _ = _violations(rec, m, phase, 0.0, energy=True)
        if adaptive:
            changes = [j for j in range(1, idx.size) if keys[idx[j]] != keys[idx[j - 1]]]
            c = changes[-1] if changes else 0
            row["converge_requests"], row["converge_s"] = c, float(t[c] - t[0])
            row["violating_after"], _ = _violations(rec, m, phase, float(t[c] - t[0]))
            row["accuracy_after"] = float(rec["correct"][idx[c:]].mean())
        out.append(row)
    return out


def mean_results(each: list[dict[str, list[dict[str, Any]]]]) -> dict[str, list[dict[str, Any]]]:
    """Each strategy's rows averaged over repeats; the controller's settling is the slowest repeat's."""
    if len(each) == 1:
        return each[0]
    out: dict[str, list[dict[str, Any]]] = {}
    for name, rows in each[0].items():
        out[name] = []
        for pi, row in enumerate(rows):
            got = [e[name][pi] for e in each]
            merged: dict[str, Any] = {}
            for key, value in row.items():
                if key in ("converge_requests", "converge_s"):
                    merged[key] = max(g[key] for g in got)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    merged[key] = type(value)(np.mean([g[key] for g in got]))
                else:
                    merged[key] = value
            out[name].append(merged)
    return out


def paired(each: list[dict[str, list[dict[str, Any]]]], phases: list[Phase],
           meets: Callable[[dict[str, Any], Phase], bool]) -> str:
    """Per phase, the controller's accuracy less the best fixed strategy's (the best by its mean over the
    repeats, among those that kept the budgets in every repeat), repeat by repeat, with the mean and its
    standard error; beside it, each fixed strategy's spread across repeats (its standard deviation: what
    one run's figure is off by)."""
    lines = ["\nthe controller against the best fixed strategy, repeat by repeat (points; mean ± standard error):"]
    for pi, phase in enumerate(phases):
        fair = [k for k in each[0] if k != "controller" and all(meets(e[k][pi], phase) for e in each)]
        if not fair:
            continue
        best = max(fair, key=lambda k: np.mean([e[k][pi]["accuracy"] for e in each]))
        gaps = np.array([100 * (e["controller"][pi]["accuracy"] - e[best][pi]["accuracy"]) for e in each])
        spread = {k: float(np.std([100 * e[k][pi]["accuracy"] for e in each], ddof=1))
                  for k in ("controller", *fair) if k not in ("edge-only",)}
        lines.append(f"  {phase.name:<18} vs {best}: " + ", ".join(f"{g:+.2f}" for g in gaps)
                     + f"  mean {gaps.mean():+.2f} ± {gaps.std(ddof=1) / np.sqrt(gaps.size):.2f}; sd across "
                     "repeats " + ", ".join(f"{k} {v:.2f}" for k, v in spread.items()))
    return "\n".join(lines)


def table(results: dict[str, list[dict[str, Any]]], phases: list[Phase], labels: dict[str, str]) -> str:
    lines = []
    for pi, phase in enumerate(phases):
        budget = f"p95 <= {phase.latency_ms:g} ms" + (f", energy <= {phase.energy_mj:g} mJ" if phase.energy_mj else "")
        lines.append(f"\nphase {pi + 1}: {phase.name} ({budget})")
        lines.append(f"  {'strategy':<12} {'acc %':>7} {'p95 ms':>8} {'mJ/req':>8} {'esc %':>6} {'cloud %':>8} "
                     f"{'viol %':>7} {'converge':>16} {'after: acc %':>12} {'viol %':>7}")
        for name, rows in results.items():
            r = rows[pi]
            conv = (f"{r['converge_requests']} req/{r['converge_s']:.2f}s" if "converge_requests" in r else "")
            acc = f"{100 * r['accuracy_after']:.2f}" if "accuracy_after" in r else ""
            after = f"{100 * r['violating_after']:.1f}" if "violating_after" in r else ""
            lines.append(f"  {name:<12} {100 * r['accuracy']:>7.2f} {r['p95_ms']:>8.2f} {r['energy_mj']:>8.3f} "
                         f"{100 * r['escalated']:>6.1f} {100 * r['cloud_answered']:>8.1f} {100 * r['violating']:>7.1f} "
                         f"{conv:>16} {acc:>12} {after:>7}")
    lines.append("\nenergy: " + "; ".join(f"{k}: {v}" for k, v in labels.items()))
    return "\n".join(lines)


def markdown(results: dict[str, list[dict[str, Any]]], phases: list[Phase], *, header: str, labels: str) -> str:
    rows = ["| phase | strategy | accuracy % | p95 ms | energy mJ/req | escalated % | windows violating % "
            "| converge (requests / s) | after convergence: accuracy % | windows violating % |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for pi, phase in enumerate(phases):
        for name, res in results.items():
            r = res[pi]
            conv = f"{r['converge_requests']} / {r['converge_s']:.2f}" if "converge_requests" in r else ""
            acc = f"{100 * r['accuracy_after']:.2f}" if "accuracy_after" in r else ""
            after = f"{100 * r['violating_after']:.1f}" if "violating_after" in r else ""
            rows.append(f"| {pi + 1}. {phase.name} | {name} | {100 * r['accuracy']:.2f} | {r['p95_ms']:.2f} | "
                        f"{r['energy_mj']:.3f} | {100 * r['escalated']:.1f} | {100 * r['violating']:.1f} | {conv} | "
                        f"{acc} | {after} |")
    return f"{header}\n\n" + "\n".join(rows) + f"\n\nEnergy per request is {labels}.\n"


def plot(records: dict[str, dict[str, Any]], phases: list[Phase], path: Path) -> Path:
    """Latency, accuracy and the controller's choice over the trace (x: request index)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8.5), dpi=100, sharex=True)
    bounds = np.cumsum([0] + [p.requests for p in phases])
    win = 100
    for name, rec in records.items():
        lat = rec["latency_ms"]
        n = lat.size
        starts = np.arange(0, n - win + 1, win // 4)
        style = {"lw": 1.6} if name == "controller" else {"lw": 0.9, "alpha": 0.75}
        if name in ("controller", "oracle", "fixed-0.5"):
            ax1.plot(starts + win / 2, [np.quantile(lat[s:s + win], 0.95) for s in starts], label=name, **style)
        acc = np.convolve(rec["correct"].astype(float), np.ones(win) / win, mode="valid")
        ax2.plot(np.arange(acc.size) + win / 2, 100 * acc, label=name, **style)
    budget = np.repeat([p.latency_ms for p in phases], [p.requests for p in phases])
    ax1.plot(np.arange(budget.size), budget, "k--", lw=1, label="latency budget")
    ax1.set_ylabel(f"p95 latency, ms\n(per {win} requests)")
    ax1.set_yscale("log")
    ax2.set_ylabel(f"accuracy, %\n(rolling {win})")
    ctl = records.get("controller")
    if ctl is not None:
        variants = sorted(set(ctl["variant"].tolist()))
        for v in variants:
            sel = ctl["variant"] == v
            ax3.scatter(np.flatnonzero(sel), np.clip(ctl["threshold"][sel], 0, 1), s=3, label=f"threshold ({v})")
        esc = np.convolve(ctl["wanted"].astype(float), np.ones(win) / win, mode="valid")
        ax3.plot(np.arange(esc.size) + win / 2, esc, color="k", lw=1, label=f"escalated share (rolling {win})")
    ax3.set_ylabel("controller: threshold\nand escalated share")
    ax3.set_xlabel("request")
    for ax in (ax1, ax2, ax3):
        for b in bounds[1:-1]:
            ax.axvline(b, color="gray", lw=0.8, ls=":")
        ax.grid(alpha=0.25)
        ax.legend(fontsize=7, loc="lower left", ncol=3)
    for p, a, b in zip(phases, bounds[:-1], bounds[1:], strict=True):
        ax1.text((a + b) / 2, 1.02, p.name, transform=ax1.get_xaxis_transform(), ha="center", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
