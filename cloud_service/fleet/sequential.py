"""Always-valid comparison of a wave with its control: a difference-in-differences confidence sequence.

Each observation is one telemetry window of one device: a value (a rate per inference, or the log of a
window's p95 or energy per request) and a weight (its inferences, or 1 for a window). The estimand is the
release's effect: how much the wave's devices changed since before the wave, minus how much the control's
devices changed over the same span.

- **Device effects** (one device slower or escalating more than another) cancel: every device is measured
  against its own baseline, the mean of its windows on the previous release before the wave began.
- **Shared load** (noisy neighbours, a slow cloud) cancels: windows are grouped into time buckets, and
  each bucket compares the wave with the control over that same bucket only.
- **Variance** is estimated across devices and windows (within-bucket spread of baseline-adjusted values;
  for rates, never below the binomial floor), not from one ratio of pooled figures.

The bucket differences D_k, weighted by W_k = 1/(1/n_wave + 1/n_control), sum to S_t = Σ W_k (D_k - Δ)
with variance V_t. Robbins' normal mixture (Howard et al. 2021; the asymptotic confidence sequences of
Waudby-Smith et al. 2024 with an estimated variance; Johari et al.'s mSPRT is its test form) bounds it
for every t at once:

    |S_t| < sqrt((V_t + ρ) log((V_t + ρ) / (ρ α²)))    for all t, with probability ≥ 1 - α

with ρ = σ² t* / (2 log(1/α) + log(1 + 2 log(1/α))), tightest near t* inferences (Waudby-Smith et al.).
The baselines' own error is a constant offset, not a martingale increment: its variance is added to V_t
(see `Estimate.radius`). Looking after every
window costs nothing: the bound holds at every look, so a wave can stop the moment it is crossed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

MIN_BUCKETS = 10  # a delayed start (Bibaut et al.): no decision on fewer buckets with both arms...
WIDE_BUCKETS, WIDE_WINDOWS = 3, 30  # ...unless a wide wave has this many buckets and windows in each arm
SHRINK_DEVICES = 10  # baselines are shrunk toward the cohort's only where this many devices show their spread
PRIOR_WINDOWS = 10.0  # the wave's variance starts from the control's, worth this many windows


class Obs(NamedTuple):
    """One window of one device: `value` weighted by `weight` (inferences, or 1 per window)."""

    device: str
    ts: float
    weight: float
    value: float


@dataclass(frozen=True)
class Estimate:
    """The wave's effect against control, with what its confidence radius needs."""

    delta: float  # the difference in differences
    weight: float  # Σ W_k: effective inferences (or windows) behind `delta`
    var_post: float  # V_t, the variance of Σ W_k D_k
    var_base: float  # the variance `delta` gets from the devices' baselines
    unit_var: float  # V_t / Σ W_k: the variance of one unit of weight
    buckets: int
    wave_n: float  # weight of the wave's windows that count
    control_n: float
    wave_mean: float  # raw means over the span (for display)
    control_mean: float

    @property
    def information(self) -> float:
        """Effective weight: `weight` discounted by the share of the variance the baselines add (a short
        baseline caps what more windows since the wave can tell)."""
        total = self.var_post + self.weight ** 2 * self.var_base
        return self.weight * self.var_post / total if total > 0 else self.weight

    def radius(self, alpha: float, t_star: float, *, one_sided: bool = False) -> float:
        """Half-width of the (1 - alpha) confidence sequence at this look; `one_sided`: the bound on one side
        only (a lower bound for "worse", an upper one for "not worse"), each crossed with probability <= alpha.

        The baselines' error is a constant offset B (not a martingale increment); it enters as the variance
        W² var(B) added to V_t, so the boundary covers it with at least sqrt(2 log(1/alpha)) of its
        standard deviations at every look (checked in simulation: tests/cloud_service/fleet/test_gates.py)."""
        if self.weight <= 0:
            return math.inf
        rho = max(self.unit_var, 1e-12) * t_star / (2 * math.log(1 / alpha) + math.log(1 + 2 * math.log(1 / alpha)))
        v = self.var_post + self.weight ** 2 * self.var_base + rho
        if one_sided:  # the one-sided normal mixture (Howard et al. 2021, eq. 14): alpha doubled, nearly
            return math.sqrt(2 * v * math.log(math.sqrt(v / rho) / (2 * alpha) + 1)) / self.weight
        return math.sqrt(v * math.log(v / (rho * alpha * alpha))) / self.weight


# per arm: device -> (baseline, weight, extra): the baseline's error variance is (unit variance / weight + extra)
Baselines = tuple[dict[str, tuple[float, float, float]], dict[str, tuple[float, float, float]]]


def baselines(pre_wave: Iterable[Obs], pre_control: Iterable[Obs], min_windows: int,
              floor: Callable[[float], float] | None, bucket_s: float) -> Baselines:
    """Each arm's device -> (baseline, weight, extra): the mean of its windows before the wave, shrunk toward
    the cohort's (empirical Bayes) where ten devices or more show how far devices differ.

    Devices with fewer than `min_windows` are left out (a device just started or just swapped: its few
    windows are a cold start, not its level). Shrinkage: with s² the within-device variance per unit weight
    (net of shared load: each time bucket's common move is taken out, as in the comparison itself) and tau² the
    between-device variance (DerSimonian-Laird, method of moments), a device's own mean m (weight n) and the
    cohort's M give the baseline (n m + a M) / (n + a), a = s²/tau², whose error variance is s²/(n + a) (the
    `weight` n + a) plus (a / (n + a))² tau² / D for M's own (`extra`). Sparse figures (audits) gain most: an
    hour of one device's audits hardly tells its level, the cohort's does unless devices differ."""
    rows = [(o, side) for side, pre in enumerate((pre_wave, pre_control)) for o in pre if o.weight > 0]
    devs = sorted({o.device for o, _ in rows})
    index = {d: k for k, d in enumerate(devs)}
    di = np.array([index[o.device] for o, _ in rows], dtype=np.int64)
    w = np.array([o.weight for o, _ in rows], dtype=float)
    x = np.array([o.value for o, _ in rows], dtype=float)
    n = np.bincount(di, weights=w, minlength=len(devs))
    k = np.bincount(di, minlength=len(devs))
    m = np.bincount(di, weights=w * x, minlength=len(devs)) / np.where(n > 0, n, 1.0)
    keep = (k >= min_windows) & (n > 0)
    side = {o.device: s for o, s in rows}
    out: list[dict[str, tuple[float, float, float]]] = [{}, {}]
    for d in (d for d in devs if keep[index[d]]):
        out[side[d]][d] = (float(m[index[d]]), float(n[index[d]]), 0.0)
    if int(keep.sum()) < SHRINK_DEVICES:
        return out[0], out[1]
    use = keep[di]
    di, w, x = di[use], w[use], x[use]
    _, bi = np.unique(np.array([int(o.ts // bucket_s) for o, _ in rows], dtype=np.int64)[use], return_inverse=True)
    r = x - m[di]
    common = np.bincount(bi, weights=w * r) / np.bincount(bi, weights=w)
    dof = len(x) - int(keep.sum()) - (int(bi.max()) + 1 if len(bi) else 0)
    big_n, devices = float(n[keep].sum()), int(keep.sum())
    centre = float((n[keep] * m[keep]).sum()) / big_n
    within = float((w * (r - common[bi]) ** 2).sum()) / max(dof, 1)
    within = max(within, floor(centre) if floor else 0.0, 1e-12)
    q_stat = float((n[keep] * (m[keep] - centre) ** 2).sum())
    den = big_n - float((n[keep] ** 2).sum()) / big_n
    tau2 = max(0.0, (q_stat - (devices - 1) * within) / den) if den > 0 else math.inf
    for arm in out:
        for d, (mean, weight, _e) in arm.items():
            a = within / tau2 if tau2 > 0 else big_n
            pull = a / (weight + a)
            arm[d] = ((weight * mean + a * centre) / (weight + a), weight + a,
                      pull * pull * (tau2 if math.isfinite(tau2) else 0.0) / devices)
    return out[0], out[1]


class _Arm:
    """One arm's post windows, adjusted by their device's baseline and grouped by time bucket."""

    def __init__(self, post: Iterable[Obs], base: dict[str, tuple[float, float, float]],
                 bucket_s: float) -> None:
        rows = [o for o in post if o.weight > 0 and o.device in base]
        self.dev = [o.device for o in rows]
        self.k = np.array([int(o.ts // bucket_s) for o in rows], dtype=np.int64)
        self.w = np.array([o.weight for o in rows], dtype=float)
        x = np.array([o.value for o in rows], dtype=float)
        self.y = x - np.array([base[o.device][0] for o in rows], dtype=float)
        self.total = float(self.w.sum())
        self.raw = float((self.w * x).sum() / self.total) if self.total else math.nan
        self.n: dict[int, float] = {}
        self.mean: dict[int, float] = {}
        if rows:
            keys, inv = np.unique(self.k, return_inverse=True)
            n = np.bincount(inv, weights=self.w)
            m = np.bincount(inv, weights=self.w * self.y) / n
            self.n, self.mean = dict(zip(keys.tolist(), n.tolist(), strict=True)), dict(
                zip(keys.tolist(), m.tolist(), strict=True))

    def rows(self, keep: set[int]) -> int:
        """Windows in the buckets `keep`."""
        return int(np.isin(self.k, list(keep)).sum())

    def at(self, table: dict[int, float], default: float = 0.0) -> np.ndarray:
        return np.array([table.get(k, default) for k in self.k.tolist()], dtype=float)

    def spread(self, centre: np.ndarray) -> tuple[float, float]:
        """(Σ w (y - centre)², degrees of freedom)."""
        return float((self.w * (self.y - centre) ** 2).sum()), float(len(self.y))

    def own_spread(self) -> tuple[float, float]:
        ss, n = self.spread(self.at(self.mean))
        return ss, n - len(self.mean)

    def shares(self, keep: set[int], weights: dict[int, float]) -> dict[str, float]:
        """Each device's share of the arm's bucket means, weighted by the buckets' W_k."""
        out: dict[str, float] = defaultdict(float)
        part = self.at(weights) * self.w / self.at(self.n, 1.0)
        for d, k, v in zip(self.dev, self.k.tolist(), part.tolist(), strict=True):
            if k in keep:
                out[d] += v
        return out


def did(pre_wave: Iterable[Obs], post_wave: Iterable[Obs], pre_control: Iterable[Obs],
        post_control: Iterable[Obs], *, bucket_s: float,
        floor: Callable[[float], float] | None = None, min_baseline: int = 5,
        base: Baselines | None = None) -> Estimate | None:
    """The wave's effect (difference in differences over shared time buckets); None with too little data.

    `floor(mean)` gives the least variance of one unit of weight (the binomial p(1-p) for rates).
    Devices with fewer than `min_baseline` baseline windows are left out (their change cannot be told from
    their level). `base`: `baselines(pre_wave, pre_control, ...)` computed already (they do not change
    between looks)."""
    bw, bc = base if base is not None else baselines(pre_wave, pre_control, min_baseline, floor, bucket_s)
    wave, ctl = _Arm(post_wave, bw, bucket_s), _Arm(post_control, bc, bucket_s)
    keep = set(wave.n) & set(ctl.n)
    if len(keep) < MIN_BUCKETS and (len(keep) < WIDE_BUCKETS or min(wave.rows(keep), ctl.rows(keep)) < WIDE_WINDOWS):
        return None
    wk = {k: 1 / (1 / wave.n[k] + 1 / ctl.n[k]) for k in keep}
    total = sum(wk.values())
    delta = sum(wk[k] * (wave.mean[k] - ctl.mean[k]) for k in keep) / total
    lo = floor((wave.raw * wave.total + ctl.raw * ctl.total) / (wave.total + ctl.total)) if floor else 0.0
    ss_c, df_c = ctl.own_spread()
    if df_c < 5:  # too few control windows per bucket to see their spread: against the wave's bucket means
        ss_c, df_c = ctl.spread(np.where(np.isin(ctl.k, list(keep)), ctl.at(wave.mean) - delta, ctl.at(ctl.mean)))
    var_c = max(ss_c / max(df_c, 1.0), lo)
    ss_w, df_w = wave.own_spread()
    if df_w < 5:
        ss_w, df_w = wave.spread(np.where(np.isin(wave.k, list(keep)), wave.at(ctl.mean) + delta,
                                          wave.at(wave.mean)))
    var_w = max((ss_w + PRIOR_WINDOWS * var_c) / (df_w + PRIOR_WINDOWS), lo)
    var_post = sum(wk[k] ** 2 * (var_w / wave.n[k] + var_c / ctl.n[k]) for k in keep)
    var_base = 0.0
    for arm, levels, var in ((wave, bw, var_w), (ctl, bc, var_c)):
        for dev, share in arm.shares(keep, wk).items():
            var_base += (share / total) ** 2 * (var / levels[dev][1] + levels[dev][2])
    return Estimate(delta=delta, weight=total, var_post=var_post, var_base=var_base, unit_var=var_post / total,
                    buckets=len(keep), wave_n=sum(wave.n[k] for k in keep), control_n=sum(ctl.n[k] for k in keep),
                    wave_mean=wave.raw, control_mean=ctl.raw)


def binomial_floor(pseudo: float = 1.0) -> Callable[[float], float]:
    """The variance of one Bernoulli trial at the pooled rate, kept off 0 and 1."""
    def floor(p: float) -> float:
        p = min(max(p if math.isfinite(p) else 0.5, pseudo / 1000), 1 - pseudo / 1000)
        return p * (1 - p)
    return floor
