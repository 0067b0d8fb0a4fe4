"""Always-valid comparison of a wave with its control: a difference-in-differences confidence sequence.

Each observation is one telemetry window of one device: a value (a rate per inference, or the log of a
window's p95 or energy per request) and a weight (its inferences, or 1 for a window). The estimand is the
release's effect: how much the wave's devices changed since before the wave, minus how much the control's
devices changed over the same span.

- **Device effects** (one device slower or escalating more than another) cancel: every device is measured
  against its own baseline, the mean of its windows on the previous release before the wave began.
- **Shared load** (noisy neighbours, a slow cloud) cancels: windows are grouped into time buckets, and
  each bucket compares the wave with the control over that same bucket only. The baselines are net of it too
  (device and bucket effects fitted together, `levels`), so a control device whose baseline is a few windows
  (an earlier wave's, since its swap) is not biased by a spike that one of them saw.
- **Variance** is estimated with the device and time as the unit, not one ratio of pooled figures: a device's
  windows within one block of `block_s` seconds form one cluster (a cluster-robust, batch-means variance), so
  noise that stays with a device for a minute (a noisy neighbour on a shared CPU, another app on a phone)
  counts once per block, not once per window. The reference is an A/A one built from the same load: every
  device's windows before the wave against its peers' over the same buckets, and the control's devices against
  each other since; the wave's own clusters join as they come. Never below the naive per-window spread, nor,
  for rates, the binomial floor.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

MIN_BUCKETS = 6  # a delayed start (Bibaut et al.): no decision on fewer buckets with both arms...
WIDE_BUCKETS, WIDE_WINDOWS = 2, 10  # ...unless a wide wave has this many buckets and windows in each arm
# (the variance does not rest on the wave's few windows: the A/A reference from before the wave carries it)
SHRINK_DEVICES = 10  # baselines are shrunk toward the cohort's only where this many devices show their spread
PRIOR_CLUSTERS = 4.0  # the wave's variance starts from the control's, worth this many device-blocks
MIN_CLUSTERS = 5.0  # an arm's own clustered spread counts beside the A/A reference from this many device-blocks
LEVEL_ITERATIONS = 50  # alternating means for the devices' levels net of shared load (converged well before)


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

    def plus(self, other: Estimate) -> Estimate:
        """The sum of two effects measured on the same units from independent data (escalations and audits),
        its variance the sum of theirs, on this one's evidence (the sparser)."""
        w = self.weight
        var_post = w * w * (self.var_post / w ** 2 + other.var_post / other.weight ** 2) if w > 0 else math.inf
        return Estimate(delta=self.delta + other.delta, weight=w, var_post=var_post,
                        var_base=self.var_base + other.var_base, unit_var=var_post / w if w > 0 else math.inf,
                        buckets=min(self.buckets, other.buckets), wave_n=self.wave_n, control_n=self.control_n,
                        wave_mean=self.wave_mean + other.wave_mean, control_mean=self.control_mean + other.control_mean)

    @property
    def se(self) -> float:
        """The standard error of `delta` (on the tested scale), the baselines' error included."""
        if self.weight <= 0:
            return math.inf
        return math.sqrt(self.var_post + self.weight ** 2 * self.var_base) / self.weight

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


class Baselines(NamedTuple):
    """Per arm, device -> (baseline, weight, extra): the baseline's error variance is unit variance / weight + extra;
    and the A/A reference: the clustered within-device variance per unit weight before the wave, net of shared
    load (`unit_var`), with its degrees of freedom (`df`, device-blocks less what the means took)."""

    wave: dict[str, tuple[float, float, float]]
    control: dict[str, tuple[float, float, float]]
    unit_var: float = 0.0
    df: float = 0.0
    naive_var: float = 0.0  # the same, each window alone: unit_var / naive_var is the clustering's design effect


def clustered(dev: Sequence[str] | np.ndarray, ts: np.ndarray, w: np.ndarray, r: np.ndarray,
              block_s: float) -> tuple[float, int]:
    """(Σ over clusters of (Σ w r)², clusters): one cluster per device and block of `block_s` seconds. Over
    Σ w it is the variance of one unit of weight with the correlation inside a block counted (batch means):
    for independent windows it is their variance; for noise that lasts a minute, up to a block's worth more."""
    if not len(r):
        return 0.0, 0
    _, di = np.unique(np.asarray(dev), return_inverse=True)
    bi = (ts // block_s).astype(np.int64)
    bi -= bi.min()
    _, ci = np.unique(di.astype(np.int64) * (int(bi.max()) + 1) + bi, return_inverse=True)
    sums = np.bincount(ci, weights=w * r)
    return float((sums ** 2).sum()), len(sums)


def levels(di: np.ndarray, bucket: np.ndarray, w: np.ndarray, x: np.ndarray, keep: np.ndarray,
           devices: int) -> np.ndarray:
    """Each device's level net of shared load (a two-way fixed-effects fit, device + time bucket, by alternating
    weighted means): a device whose baseline is a few windows (an earlier wave's device, on the release since
    moments ago) and one whose baseline is an hour are put on the same footing. With raw means a shared-load
    spike in a short baseline stays in it, and the difference in differences carries it as a bias the size of
    the spike over the baseline's windows (a 2x spike in one of 6 windows: 1.12x on p95), which no amount of
    evidence since the wave removes. Only the `keep` devices inform the bucket effects; the others get their raw
    means. The bucket effects are centred (their weighted mean over the windows is 0), so a level stays on the
    scale of the device's own figures."""
    n = np.bincount(di, weights=w, minlength=devices)
    m = np.bincount(di, weights=w * x, minlength=devices) / np.where(n > 0, n, 1.0)
    use = keep[di]
    if int(keep.sum()) < 2:
        return m
    d, wu, xu = di[use], w[use], x[use]
    _, bi = np.unique(bucket[use], return_inverse=True)
    bw = np.bincount(bi, weights=wu)
    nu = np.bincount(d, weights=wu, minlength=devices)
    for _ in range(LEVEL_ITERATIONS):
        common = np.bincount(bi, weights=wu * (xu - m[d])) / bw
        common -= float((wu * common[bi]).sum() / wu.sum())
        new = np.where(keep, np.bincount(d, weights=wu * (xu - common[bi]), minlength=devices)
                       / np.where(nu > 0, nu, 1.0), m)
        moved = float(np.abs(new - m).max())
        m = new
        if moved < 1e-9:
            break
    return m


def baselines(pre_wave: Iterable[Obs], pre_control: Iterable[Obs], min_windows: int,
              floor: Callable[[float], float] | None, bucket_s: float, block_s: float | None = None) -> Baselines:
    """Each arm's device -> (baseline, weight, extra): the mean of its windows before the wave net of shared load
    (`levels`: each time bucket's common move taken out, so a baseline of a few windows and one of an hour agree
    whatever load their spans saw), shrunk toward
    the cohort's (empirical Bayes) where ten devices or more show how far devices differ; and the A/A reference
    variance (`Baselines.unit_var`).

    Devices with fewer than `min_windows` are left out (a device just started or just swapped: its few
    windows are a cold start, not its level). The within-device variance s² per unit weight is net of shared
    load (each time bucket's common move is taken out, as in the comparison itself) and clustered by device and
    block of `block_s` (default: one window per cluster). Shrinkage: with tau² the between-device variance
    (DerSimonian-Laird, method of moments, at its upper end), a device's own mean m (weight n) and the cohort's M
    give the baseline (n m + a M) / (n + a), a = s²/tau², whose error variance is s²/(n + a) (the `weight` n + a) plus
    (a / (n + a))² tau² / D for M's own (`extra`). Sparse figures (audits) gain most: an hour of one device's
    audits hardly tells its level, the cohort's does unless devices differ."""
    rows = [(o, side) for side, pre in enumerate((pre_wave, pre_control)) for o in pre if o.weight > 0]
    uniq, di = np.unique(np.array([o.device for o, _ in rows], dtype=str), return_inverse=True)
    devs = uniq.tolist()
    index = {d: k for k, d in enumerate(devs)}
    w = np.array([o.weight for o, _ in rows], dtype=float)
    x = np.array([o.value for o, _ in rows], dtype=float)
    ts = np.array([o.ts for o, _ in rows], dtype=float)
    n = np.bincount(di, weights=w, minlength=len(devs))
    k = np.bincount(di, minlength=len(devs))
    keep = (k >= min_windows) & (n > 0)
    m = levels(di, (ts // bucket_s).astype(np.int64), w, x, keep, len(devs))
    side = {o.device: s for o, s in rows}
    out: list[dict[str, tuple[float, float, float]]] = [{}, {}]
    for d in (d for d in devs if keep[index[d]]):
        out[side[d]][d] = (float(m[index[d]]), float(n[index[d]]), 0.0)
    devices = int(keep.sum())
    if devices < 2:
        return Baselines(out[0], out[1])
    use = keep[di]
    di, w, x, ts = di[use], w[use], x[use], ts[use]
    _, bi = np.unique((ts // bucket_s).astype(np.int64), return_inverse=True)
    r = x - m[di]
    common = np.bincount(bi, weights=w * r) / np.bincount(bi, weights=w)
    resid = r - common[bi]
    naive_dof = len(x) - devices - (int(bi.max()) + 1)
    naive = float((w * resid ** 2).sum()) / max(naive_dof, 1)
    ss, clusters = clustered(di, ts, w, resid, block_s or bucket_s / 2)
    dof = clusters * (1 - 1 / devices) - devices  # each device's mean, each bucket's common move
    unit_var = max(ss / float(w.sum()) * clusters / max(dof, 1.0), naive)
    if devices < SHRINK_DEVICES:
        return Baselines(out[0], out[1], unit_var, max(dof, 0.0), naive)
    big_n = float(n[keep].sum())
    centre = float((n[keep] * m[keep]).sum()) / big_n
    within = max(unit_var, floor(centre) if floor else 0.0, 1e-12)
    q_stat = float((n[keep] * (m[keep] - centre) ** 2).sum())
    den = big_n - float((n[keep] ** 2).sum()) / big_n
    # tau² at the upper end of its range (Q's own spread is about sqrt(2 (D - 1)) within): the point estimate is
    # often 0 and would trust the cohort's level for a device that differs from it
    slack = 2 * math.sqrt(2 * (devices - 1)) * within
    tau2 = max(0.0, (q_stat - (devices - 1) * within + slack) / den) if den > 0 else math.inf
    for arm in out:
        for d, (mean, weight, _e) in arm.items():
            a = within / tau2 if tau2 > 0 else big_n
            pull = a / (weight + a)
            arm[d] = ((weight * mean + a * centre) / (weight + a), weight + a,
                      pull * pull * (tau2 if math.isfinite(tau2) else 0.0) / devices)
    return Baselines(out[0], out[1], unit_var, max(dof, 0.0), naive)


class _Arm:
    """One arm's post windows, adjusted by their device's baseline and grouped by time bucket."""

    def __init__(self, post: Iterable[Obs], base: dict[str, tuple[float, float, float]],
                 bucket_s: float) -> None:
        rows = [o for o in post if o.weight > 0 and o.device in base]
        self.dev = [o.device for o in rows]
        self.ts = np.array([o.ts for o in rows], dtype=float)
        self.k = (self.ts // bucket_s).astype(np.int64)
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

    def variance(self, centre: np.ndarray, block_s: float, *, own: bool) -> tuple[float, float, float]:
        """(clustered variance of one unit of weight, naive variance (each window alone), the clustered one's
        degrees of freedom) from the spread about `centre`, the clustered one never below the naive one. `own`:
        `centre` is this arm's own bucket means (a device per bucket's worth of freedom is spent on them)."""
        if not self.total:
            return 0.0, 0.0, 0.0
        r = self.y - centre
        devices = len(set(self.dev))
        ss, clusters = clustered(self.dev, self.ts, self.w, r, block_s)
        dof = clusters * (1 - 1 / devices) if own else clusters - 1.0
        naive_dof = len(r) - (len(self.mean) if own else 1)
        if naive_dof <= 0:
            return 0.0, 0.0, 0.0
        naive = float((self.w * r * r).sum()) / naive_dof
        if dof <= 0:  # within one block: what the windows show, worth little beside a reference
            return naive, naive, 0.5
        return max(ss / self.total * clusters / dof, naive), naive, dof

    def shares(self, keep: set[int], weights: dict[int, float]) -> dict[str, float]:
        """Each device's share of the arm's bucket means, weighted by the buckets' W_k."""
        out: dict[str, float] = defaultdict(float)
        part = self.at(weights) * self.w / self.at(self.n, 1.0)
        for d, k, v in zip(self.dev, self.k.tolist(), part.tolist(), strict=True):
            if k in keep:
                out[d] += v
        return out


def _pool(own: tuple[float, float], prior: float, prior_df: float) -> tuple[float, float]:
    """(variance, degrees of freedom): an arm's own beside a reference worth `prior_df`; the larger of the two
    once its own has MIN_CLUSTERS (a release or a control noisier than the reference shows through)."""
    var, dof = own
    if dof <= 0 or prior_df <= 0:
        return (var, dof) if dof > 0 else (prior, prior_df)
    pooled = (var * dof + prior * prior_df) / (dof + prior_df)
    return (max(pooled, var) if dof >= MIN_CLUSTERS else pooled), dof + prior_df


def _unsure(var: float, dof: float) -> float:
    """A variance estimated from `dof` device-blocks, scaled by dof / (dof - 2) (the mean of its inverse, capped
    at 3x): a few clusters can say a noisy device is quiet, and the bound must not trust that."""
    return var * min(3.0, dof / (dof - 2)) if dof > 3 else 3.0 * var


def did(pre_wave: Iterable[Obs], post_wave: Iterable[Obs], pre_control: Iterable[Obs],
        post_control: Iterable[Obs], *, bucket_s: float,
        floor: Callable[[float], float] | None = None, min_baseline: int = 5,
        base: Baselines | None = None, block_s: float | None = None) -> Estimate | None:
    """The wave's effect (difference in differences over shared time buckets); None with too little data.

    `floor(mean)` gives the least variance of one unit of weight (the binomial p(1-p) for rates).
    Devices with fewer than `min_baseline` baseline windows are left out (their change cannot be told from
    their level). `base`: `baselines(pre_wave, pre_control, ...)` computed already (they do not change
    between looks). `block_s`: a device's windows within a block this long are one cluster (default: each
    window its own).

    Variance: the control's, its devices against each other over the buckets since the wave (clustered), pooled
    with the A/A reference from before the wave (`Baselines.unit_var`); the wave's, its devices against the
    control's bucket means (or each other), pooled with the control's worth PRIOR_CLUSTERS device-blocks."""
    block = block_s or bucket_s / 2
    pre_w, pre_c = list(pre_wave), list(pre_control)
    base = base if base is not None else baselines(pre_w, pre_c, min_baseline, floor, bucket_s, block)
    wave, ctl = _Arm(post_wave, base.wave, bucket_s), _Arm(post_control, base.control, bucket_s)
    keep = set(wave.n) & set(ctl.n)
    if len(keep) < MIN_BUCKETS and (len(keep) < WIDE_BUCKETS or min(wave.rows(keep), ctl.rows(keep)) < WIDE_WINDOWS):
        return None
    wk = {k: 1 / (1 / wave.n[k] + 1 / ctl.n[k]) for k in keep}
    total = sum(wk.values())
    delta = sum(wk[k] * (wave.mean[k] - ctl.mean[k]) for k in keep) / total
    lo = floor((wave.raw * wave.total + ctl.raw * ctl.total) / (wave.total + ctl.total)) if floor else 0.0
    inside = np.isin(ctl.k, list(keep))
    if len(set(ctl.dev)) >= 2:
        own_c = ctl.variance(ctl.at(ctl.mean), block, own=True)
    else:  # one control device: against the wave's bucket means
        own_c = ctl.variance(np.where(inside, ctl.at(wave.mean) - delta, ctl.at(ctl.mean)), block, own=False)
    pooled_c = _pool((own_c[0], own_c[2]), base.unit_var, base.df)
    var_c = max(_unsure(*pooled_c), lo)
    # the clustering's design effect (how much a device's slow swings add to what its windows show), from the
    # A/A reference
    naive_ref = base.naive_var if base.df > 0 else own_c[1]
    deff = max(1.0, max(pooled_c[0], lo, 1e-12) / max(naive_ref, lo, 1e-12))
    if len(set(wave.dev)) >= 2:
        own_w = wave.variance(wave.at(wave.mean), block, own=True)
    else:  # a one-device wave (a canary): against the control's bucket means and the effect
        inside_w = np.isin(wave.k, list(keep))
        own_w = wave.variance(np.where(inside_w, wave.at(ctl.mean) + delta, wave.at(wave.mean)), block, own=False)
    # a figure per window (log p95, energy: `floor` None) is measured alike in both arms, and a short run of
    # windows that swing together shows too little spread: the wave starts from the control's variance. A rate's
    # spread follows its counts (a small wave audits at a raised rate): from its own windows' times the design
    # effect.
    prior_w = own_w[1] * deff if own_w[1] > 0 and floor is not None else pooled_c[0]
    var_w = max(_unsure(_pool((own_w[0], own_w[2]), prior_w, PRIOR_CLUSTERS)[0], max(own_w[2], 0.0) + pooled_c[1]),
                lo)
    var_post = sum(wk[k] ** 2 * (var_w / wave.n[k] + var_c / ctl.n[k]) for k in keep)
    var_base = 0.0
    # a baseline's error is that of the windows before the wave (measured there: a small wave audits at a raised
    # rate since, its baseline at the fleet's own)
    before = max(_unsure(base.unit_var, base.df), lo) if base.df > 0 else None
    for arm, levels, var in ((wave, base.wave, before or var_w), (ctl, base.control, before or var_c)):
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


def baseline_se(pre_wave: Iterable[Obs], pre_control: Iterable[Obs], base: Baselines, bucket_s: float,
                floor: Callable[[float], float] | None = None, wave_scale: float = 1.0) -> float:
    """The standard error a comparison gets from its baselines alone, each arm's devices weighing alike: the part
    of a wave's estimate that no soak after its start shrinks. Before a wave starts it says whether its gates can
    ever pass: a baseline error near the margin keeps a good release's estimate off "under the margin" however
    long the wave soaks.

    The baselines are levels net of shared load (`levels`: device and time-bucket effects fitted together), so
    the arms' levels are told apart only where both have windows in the same buckets: a control of earlier waves'
    devices, on the release for a minute, is compared with the wave's devices over that minute, not their hour.
    The variance of the contrast (the wave's mean level less the control's) is the fit's: V c' M⁺ c, with M the
    devices' information once the bucket effects are taken out (a Schur complement) and V the A/A reference's
    variance of one unit of weight (`Baselines.unit_var`, scaled for its degrees of freedom as the comparison's
    is); shrinkage toward the cohort, which only narrows it, is left out. Infinite where an arm has no baseline,
    the variance cannot be estimated, or no bucket holds both arms. `wave_scale`: the wave's windows weigh this
    many times theirs (large: what the control's baselines alone leave, however rich the wave's were made)."""
    arms = (base.wave, base.control)
    if not all(arms) or (base.df <= 0 and base.naive_var <= 0):
        return math.inf
    index = {d: k for k, d in enumerate([*base.wave, *base.control])}
    rows = [o for o in (*pre_wave, *pre_control) if o.device in index and o.weight > 0]
    di = np.array([index[o.device] for o in rows])
    w = np.array([o.weight for o in rows], dtype=float)
    _, bi = np.unique(np.array([o.ts // bucket_s for o in rows]), return_inverse=True)
    n = np.zeros((int(bi.max()) + 1, len(index)))
    np.add.at(n, (bi, di), w * np.where(di < len(base.wave), wave_scale, 1.0))
    info = np.diag(n.sum(axis=0)) - n.T @ (n / n.sum(axis=1, keepdims=True))
    c = np.array([1 / len(base.wave)] * len(base.wave) + [-1 / len(base.control)] * len(base.control))
    inv = np.linalg.pinv(info, rcond=1e-9, hermitian=True)
    if not np.allclose(info @ (inv @ c), c, atol=1e-6):  # the arms share no bucket: their levels are not compared
        return math.inf
    mean = float((w * np.array([o.value for o in rows])).sum() / w.sum())
    var = max(_unsure(base.unit_var, base.df) if base.df > 0 else 3.0 * base.naive_var, floor(mean) if floor else 0.0)
    return math.sqrt(var * max(float(c @ inv @ c), 0.0))
