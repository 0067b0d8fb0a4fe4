"""What the controller knows about each variant and about the link to the cloud.

A `VariantProfile` holds one variant's latency on this device (a bounded window updated online,
seeded from the manifest or a warm-up self-benchmark), its energy per inference (measured or
modeled, labelled), and, from the validation outputs stored at compile time, the policy's score
of every validation input and whether the edge answer was right: for any threshold, the
escalation rate and the edge accuracy on the accepted and on the escalated inputs. A
`LinkProfile` is the controller's view of the one `link.Link` (round trips, availability, up/down),
with bytes and radio energy per escalation and the cloud accuracy estimate that agreement refines.

Example:
    >>> profile = VariantProfile.from_package(ModelPackage.open("variants/int8"), policy)
    >>> esc, acc_accepted, acc_escalated = profile.curve(np.array([0.9]))
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edge_agent.link import Link, RoundTrips, lognormal_points
from runtimes.errors import ConfigError, PackageError

if TYPE_CHECKING:
    from compilers.package import ModelPackage

__all__ = ["LatencyWindow", "LinkProfile", "LinkState", "ScoringPolicy", "VariantProfile", "lognormal_points"]

log = logging.getLogger(__name__)

DEFAULT_VALIDATION_FILE = "validation.npz"
DEFAULT_BUSY_POWER_W = 5.0  # modeled CPU power while inferring, when the manifest has no energy figure
DEFAULT_RTT_MS = 10.0  # prior median round trip to the cloud, until escalations measure it
DEFAULT_CLOUD_ACCURACY = 0.99  # prior accuracy of the cloud on escalated inputs, until agreement refines it


class ScoringPolicy(Protocol):
    """Anything with the edge policies' `score(outputs) -> (batch,)` method; higher = more confident."""

    def score(self, outputs: Mapping[str, np.ndarray]) -> np.ndarray: ...


class LatencyWindow:
    """A bounded window of latency samples (ms) with an EWMA, seeded by prior quantile points.

    The prior is used until `min_samples` real samples arrived; `rebase` drops old samples after a
    detected change so that quantiles follow the new regime at once.
    """

    def __init__(self, prior: np.ndarray | None = None, *, maxlen: int = 256, min_samples: int = 8,
                 alpha: float = 0.2) -> None:
        self._prior = np.sort(np.asarray(prior, dtype=float)) if prior is not None else np.empty(0)
        self._window: deque[float] = deque(maxlen=maxlen)
        self._min = min_samples
        self._alpha = alpha
        self.ewma = float(np.median(self._prior)) if self._prior.size else math.nan
        self.count = 0

    def add(self, value: float) -> None:
        self._window.append(float(value))
        self.count += 1
        if math.isfinite(value):
            self.ewma = value if math.isnan(self.ewma) else self.ewma + self._alpha * (value - self.ewma)

    def samples(self) -> np.ndarray:
        """Sorted samples: the real ones once there are enough, else prior and real together."""
        real = np.fromiter(self._window, dtype=float, count=len(self._window))
        if not real.size and not self._prior.size:
            return np.array([self.ewma]) if math.isfinite(self.ewma) else real
        if real.size >= self._min or not self._prior.size:
            return np.sort(real)
        return np.sort(np.concatenate([self._prior, real]))

    def quantile(self, q: float) -> float:
        s = self.samples()
        if not s.size:
            return math.nan
        return float(s[min(s.size - 1, math.ceil(q * s.size) - 1 if q > 0 else 0)])

    def drop_infinite(self) -> None:
        """Forget the +inf samples (escalations not answered in time), keeping the others in order."""
        kept = [v for v in self._window if math.isfinite(v)]
        self._window.clear()
        self._window.extend(kept)

    def rebase(self, keep: int, *, reset_ewma: bool = True) -> None:
        """Keep only the last `keep` samples; the prior is dropped too (it described the old regime).
        With `reset_ewma`, the EWMA restarts from their mean."""
        recent = list(self._window)[-keep:] if keep > 0 else []
        self._prior = np.empty(0)
        self._window.clear()
        self._window.extend(recent)
        finite = [v for v in recent if math.isfinite(v)]
        if finite and reset_ewma:
            self.ewma = float(np.mean(finite))

    def __len__(self) -> int:
        return len(self._window)


class VariantProfile:
    """One variant on this device: latency, energy and its escalation curve for a policy.

    Args:
        variant_id: the variant id (as in the variant set); kept as `id`.
        scores: the policy's score of each validation input (higher = more confident).
        correct: whether the variant's answer was right on each validation input.
        latency_prior_ms: prior latency samples (ms), e.g. `lognormal_points(p50, p95)`.
        energy_mj: energy per inference in millijoules; `energy_label` says measured or modeled.
        live_weight: pseudo-count of the validation score distribution when live scores blend in.

    Example:
        >>> p = VariantProfile("int8", scores, correct, lognormal_points(2.0, 3.0), 1.5, "modeled:cpu")
    """

    def __init__(self, variant_id: str, scores: Sequence[float] | np.ndarray, correct: Sequence[bool] | np.ndarray,
                 latency_prior_ms: Sequence[float] | np.ndarray, energy_mj: float,
                 energy_label: str = "modeled", *, live_weight: int = 300, window: int = 256) -> None:
        s, c = np.asarray(scores, dtype=float).ravel(), np.asarray(correct, dtype=bool).ravel()
        if s.size == 0 or s.size != c.size:
            msg = f"variant {variant_id!r}: need as many scores as correctness flags, got {s.size} and {c.size}"
            raise ConfigError(msg)
        if not np.isfinite(s).all():
            msg = f"variant {variant_id!r}: validation scores contain NaN or inf"
            raise ConfigError(msg)
        if not (math.isfinite(energy_mj) and energy_mj >= 0):
            msg = f"variant {variant_id!r}: energy_mj must be a number >= 0, got {energy_mj!r}"
            raise ConfigError(msg)
        order = np.argsort(s, kind="stable")
        self.id = variant_id
        self.scores = s[order]
        self._correct = c[order]
        self._cum_correct = np.concatenate([[0], np.cumsum(self._correct)])
        # score bins (validation quantiles) for reweighting validation by the live score distribution
        self._edges = np.unique(np.quantile(self.scores, np.arange(1, 20) / 20))
        self._bin = np.searchsorted(self._edges, self.scores, side="right")
        self._bin_share = np.bincount(self._bin, minlength=self._edges.size + 1) / s.size
        counts = np.bincount(self._bin, minlength=self._edges.size + 1)
        right = np.bincount(self._bin, weights=self._correct, minlength=self._edges.size + 1)
        # per score bin, shrunk towards the overall accuracy by 10 pseudo-observations: a bin of 50 inputs
        # all right does not show the edge is never wrong there, and reading it so would blame the cloud
        # for every disagreement on such inputs
        self._bin_accuracy = (right + 10 * self._cum_correct[-1] / s.size) / (counts + 10)
        # each input's chance of being right as the plan reads it: its bin's accuracy with one pseudo-observation
        # at the overall accuracy. Escalating a band the edge got all right then still gains what the cloud's
        # fewer errors there are worth (a little), where the raw count would say it gains nothing
        self._smooth = ((right + self._cum_correct[-1] / s.size) / (counts + 1))[self._bin]
        self._cum_smooth = np.concatenate([[0.0], np.cumsum(self._smooth)])
        # the sampling variance of the edge's correctness summed over the lowest-scored k inputs (`escalated_variance`)
        self._cum_var = np.concatenate([[0.0], np.cumsum(self._smooth * (1 - self._smooth))]) / s.size ** 2
        self.latency = LatencyWindow(np.asarray(latency_prior_ms, dtype=float), maxlen=window)
        self.baseline_p50_ms = self.latency.quantile(0.5)
        self.energy_mj = float(energy_mj)
        self.energy_label = energy_label
        self._energies: deque[float] = deque(maxlen=64)
        self.live_scores: deque[float] = deque(maxlen=512)
        self._live_weight = live_weight

    @property
    def validation_size(self) -> int:
        return int(self.scores.size)

    @property
    def accuracy(self) -> float:
        """Edge accuracy on the whole validation set."""
        return float(self._cum_correct[-1] / self.scores.size)

    def observe_latency(self, ms: float) -> None:
        self.latency.add(ms)

    def accuracy_at(self, score: float) -> float:
        """The validation accuracy of inputs scored like `score` (its score bin: a twentieth of validation)."""
        return float(self._bin_accuracy[int(np.searchsorted(self._edges, score, side="right"))])

    @property
    def energy_observed(self) -> bool:
        """Whether `energy_mj` comes from this variant's own live figures (8 or more), not a prior."""
        return len(self._energies) >= 8

    def energy_stderr(self) -> float:
        """The standard error of the energy estimate from its recent figures (inf with fewer than 8)."""
        n = len(self._energies)
        if n < 8:
            return math.inf
        return float(np.std(np.fromiter(self._energies, dtype=float), ddof=1)) * 1.25 / math.sqrt(n)

    def observe_energy(self, mj: float, label: str | None = None) -> None:
        """One measured (or modeled) inference energy; the estimate is the median of the last 64.

        The median keeps the estimate steady when some figures carry more than the inference
        (a request's radio and waiting energy).
        """
        self._energies.append(float(mj))
        if len(self._energies) >= 8:
            self.energy_mj = float(np.median(np.fromiter(self._energies, dtype=float)))
        if label:
            self.energy_label = label

    def observe_score(self, score: float) -> None:
        self.live_scores.append(float(score))

    def mark_baseline(self) -> None:
        """Take the current latency median as the baseline the drift checks compare with."""
        self.baseline_p50_ms = self.latency.quantile(0.5)

    def thresholds(self, grid: Sequence[float]) -> np.ndarray:
        """Thresholds that escalate (about) each fraction in `grid` of the validation inputs."""
        n = self.scores.size
        out = []
        for e in grid:
            k = round(min(max(float(e), 0.0), 1.0) * n)
            out.append(float(np.nextafter(self.scores[-1], np.inf)) if k >= n else float(self.scores[k]))
        return np.unique(np.asarray(out))

    def escalated_variance(self, thresholds: np.ndarray) -> np.ndarray:
        """For each threshold, the validation sampling variance of what escalating gains, in accuracy
        units squared: the sum of p (1 - p) / N^2 over the N validation inputs it escalates, p each
        input's smoothed chance of being right. Thresholds nest, so the variance of the difference in
        gain between two thresholds (the band one escalates and the other does not) is the difference
        of theirs."""
        k = np.searchsorted(self.scores, np.atleast_1d(np.asarray(thresholds, dtype=float)), side="left")
        return np.asarray(self._cum_var[k], dtype=float)

    def curve(self, thresholds: np.ndarray, *, smoothed: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each threshold: escalation rate, edge accuracy on accepted, edge accuracy on escalated.

        Read from the validation data (`smoothed`: each input counted at its score bin's shrunk
        accuracy rather than right or wrong). Once live scores arrive, validation inputs are reweighted
        so that their score distribution matches the live one (per score bin, blended with the
        validation prior): a drifted input stream moves escalation rates and accuracies together.
        """
        t = np.atleast_1d(np.asarray(thresholds, dtype=float))
        k = np.searchsorted(self.scores, t, side="left")
        if not self.live_scores:
            n, cum = self.scores.size, (self._cum_smooth if smoothed else self._cum_correct)
            acc_esc = np.where(k > 0, cum[k] / np.maximum(k, 1), 1.0)
            acc_acc = np.where(k < n, (cum[-1] - cum[k]) / np.maximum(n - k, 1), 1.0)
            return k / n, acc_acc, acc_esc
        w = self._live_weights()
        weight = np.concatenate([[0.0], np.cumsum(w)])
        right = np.concatenate([[0.0], np.cumsum(w * (self._smooth if smoothed else self._correct))])
        total, esc_w, acc_w = weight[-1], weight[k], weight[-1] - weight[k]
        acc_esc = np.where(esc_w > 0, right[k] / np.maximum(esc_w, 1e-12), 1.0)
        acc_acc = np.where(acc_w > 0, (right[-1] - right[k]) / np.maximum(acc_w, 1e-12), 1.0)
        return esc_w / total, acc_acc, acc_esc

    def _live_weights(self) -> np.ndarray:
        live = np.fromiter(self.live_scores, dtype=float)
        counts = np.bincount(np.searchsorted(self._edges, live, side="right"), minlength=self._edges.size + 1)
        share = counts / live.size
        ratio = np.divide(share, self._bin_share, out=np.zeros_like(share), where=self._bin_share > 0)
        lam = live.size / (live.size + self._live_weight)
        return ((1 - lam) + lam * ratio)[self._bin]

    def self_benchmark(self, run: Callable[[], object], *, repeats: int = 20, warmup: int = 3,
                       clock: Callable[[], float] = time.perf_counter) -> float:
        """Time `run()` (one batch-1 inference) and feed the latencies; return the median (ms)."""
        for _ in range(warmup):
            run()
        times = []
        for _ in range(repeats):
            t0 = clock()
            run()
            times.append((clock() - t0) * 1e3)
            self.observe_latency(times[-1])
        self.mark_baseline()
        return float(np.median(times))

    @classmethod
    def from_package(cls, pkg: ModelPackage, policy: ScoringPolicy | Any, *, energy_mj: float | None = None,
                     energy_label: str | None = None, variant_id: str | None = None) -> VariantProfile:
        """Build from a package's manifest and its `validation.npz` (logits, labels, reference_logits).

        Correctness is against `labels`; without labels, agreement with `reference_logits` stands in.
        `policy` is a scorer (`score(outputs)`), a `Policy` (bound here to this variant's
        calibration) or a `BoundPolicy`: its scores must be those the agent compares with the threshold.

        Raises:
            PackageError: the validation file is missing or lacks the arrays.
        """
        m = pkg.manifest
        name = str(m.calibration.get("validation_file", DEFAULT_VALIDATION_FILE))
        path = pkg.directory / name
        if not path.is_file():
            msg = f"package {pkg.directory}: no validation file {name!r}; recompile with validation data"
            raise PackageError(msg)
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: np.asarray(data[k]) for k in data.files}
        if "logits" not in arrays:
            msg = f"{path}: lacks the 'logits' array (has {sorted(arrays)})"
            raise PackageError(msg)
        logits = arrays["logits"]
        if "labels" in arrays:
            truth = arrays["labels"].astype(np.int64).ravel()
        elif "reference_logits" in arrays:
            truth = arrays["reference_logits"].argmax(axis=1)
        else:
            msg = f"{path}: needs 'labels' or 'reference_logits' to tell right from wrong"
            raise PackageError(msg)
        scorer: Any = policy
        bind = getattr(policy, "scorer", None)
        if callable(bind):  # an unbound `Policy`: bind it to this variant's calibration (temperature, OOD)
            scorer = bind(m.calibration, m.outputs[0].name)
        elif bind is not None and hasattr(bind, "score"):  # a `BoundPolicy`
            scorer = bind
        scores = np.asarray(scorer.score({m.outputs[0].name: logits}), dtype=float).ravel()
        b1 = m.latency_ms.get("batch_1", {})
        p50 = float(b1.get("p50", 1.0))
        prior = lognormal_points(p50, float(b1.get("p95", p50 * 1.2)))
        if energy_mj is None:
            if "mj" in m.energy:
                energy_mj = float(m.energy["mj"])
                energy_label = energy_label or str(m.energy.get("label", "modeled"))
            else:
                energy_mj = p50 * DEFAULT_BUSY_POWER_W
                energy_label = energy_label or f"modeled:{DEFAULT_BUSY_POWER_W:g}W-busy"
        vid = variant_id or pkg.directory.name or f"{m.name}-{m.precision}"
        return cls(vid, scores, logits.argmax(axis=1) == truth, prior, energy_mj, energy_label or "modeled")

    def __repr__(self) -> str:
        return (f"<VariantProfile {self.id} p50={self.latency.quantile(0.5):.3g}ms "
                f"acc={self.accuracy:.4f} energy={self.energy_mj:.3g}mJ ({self.energy_label})>")


@dataclass(frozen=True)
class LinkState:
    """A snapshot of the link that one decision is computed from.

    Energy figures say `energy_label` ("modeled:..." unless a radio counter measured them).
    `rtt_samples` (sorted; +inf for escalations that were not answered in time) stays out of JSON.
    """

    rtt_ms: float
    rtt_high_ms: float
    availability: float
    up: bool
    bytes_per_escalation: float
    energy_per_byte_mj: float
    wait_power_w: float
    energy_label: str
    cloud_accuracy: float
    edge_error_scale: float = 1.0
    failure_latency_ms: float = 0.0
    agreement_rate: float | None = None
    agreement_n: int = 0
    epoch: int = 0
    event: str = ""
    cloud_reference_accuracy: float | None = None
    bandwidth_bps: float | None = None  # measured on the wire (None until a large request was timed)
    rtt_samples: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False, compare=False)
    slow: bool = False  # the link's unusual run of timeouts is going on (`link.Link.slow`)

    def timely(self, within_ms: float) -> float:
        """Share of escalations answered within `within_ms` (from the RTT window)."""
        if not self.rtt_samples.size:
            return 1.0 if self.rtt_high_ms <= within_ms else 0.0
        return float(np.searchsorted(self.rtt_samples, within_ms, side="right") / self.rtt_samples.size)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc.pop("rtt_samples")
        return {k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else
                    (None if isinstance(v, float) else v)) for k, v in doc.items()}


# the grids the agreement fit searches: cloud accuracies (dense near 1) and edge error scales
_CLOUD = np.unique(np.concatenate([np.linspace(0.5, 0.9, 9), 1 - np.logspace(-1, -3.7, 80)]))
_SCALES = np.exp(np.linspace(math.log(0.25), math.log(4.0), 25))


class LinkProfile:
    """What the controller knows of the link: a view over the one `link.Link`, with the request size,
    the radio and waiting energy, and the cloud's accuracy that edge/cloud agreement refines.

    Round trips, up/down, availability and failure latency are the `Link`'s (shared with the agent's
    skip rule, breaker and wire encoder when an agent passes its own); `observe` feeds it for a
    controller used on its own (tests, what-if planning).

    Args:
        rtt_ms, rtt_high_ms: prior round trip (median, high quantile) until escalations measure it.
        bytes_per_escalation: prior request size; refined from `bytes_sent`.
        energy_per_byte_mj, wait_power_w: radio energy per byte sent and power drawn while waiting
            (from a device power profile); `energy_label` says whether they are measured.
        cloud_accuracy: prior accuracy of the cloud on escalated inputs, with `cloud_prior_strength`
            pseudo-observations; edge/cloud agreement refines it (see `observe_agreement`).
        down_after, up_after, down_after_timeouts, horizon_s: the `Link`'s hysteresis and memory.
        link: the link to view (default: a new one from the priors above).

    Example:
        >>> link = LinkProfile(rtt_ms=5.0)
        >>> link.observe(rtt_ms=4.2, ok=True, bytes_sent=420)
    """

    def __init__(self, *, rtt_ms: float = DEFAULT_RTT_MS, rtt_high_ms: float | None = None,
                 bytes_per_escalation: float = 1024.0, energy_per_byte_mj: float = 1e-4,
                 wait_power_w: float = 0.3, energy_label: str = "modeled:default-radio",
                 cloud_accuracy: float = DEFAULT_CLOUD_ACCURACY, cloud_prior_strength: float = 30.0,
                 edge_prior_strength: float = 50.0, high_quantile: float = 0.95, window: int = 256,
                 alpha: float = 0.2, down_after: int = 3, up_after: int = 3, down_after_timeouts: int = 64,
                 agreement_window: int = 256, horizon_s: float = 5.0, link: Link | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < cloud_accuracy <= 1:
            msg = f"LinkProfile: need 0 < cloud_accuracy <= 1, got {cloud_accuracy!r}"
            raise ConfigError(msg)
        self.link = link or Link(rtt_ms=rtt_ms, rtt_high_ms=rtt_high_ms, horizon_s=horizon_s,
                                 high_quantile=high_quantile, window=window, alpha=alpha, down_after=down_after,
                                 up_after=up_after, down_after_timeouts=down_after_timeouts, clock=clock)
        self.high_quantile = self.link.high_quantile
        self.bytes_per_escalation = float(bytes_per_escalation)
        self.energy_per_byte_mj, self.wait_power_w, self.energy_label = energy_per_byte_mj, wait_power_w, energy_label
        self.cloud_prior, self.cloud_prior_strength = cloud_accuracy, cloud_prior_strength
        self.edge_prior_strength = edge_prior_strength
        self._alpha = alpha
        self._agree: deque[tuple[bool, float]] = deque(maxlen=agreement_window)
        self._agree_seen = 0
        self._fit: tuple[int, tuple[float, float, float | None]] | None = None

    @property
    def rtt(self) -> RoundTrips:
        return self.link.rtt

    @property
    def up(self) -> bool:
        return self.link.up

    def observe_bytes(self, bytes_sent: int) -> None:
        if bytes_sent > 0:
            self.bytes_per_escalation += self._alpha * (bytes_sent - self.bytes_per_escalation)

    def observe(self, rtt_ms: float | None, ok: bool, bytes_sent: int = 0,
                elapsed_ms: float | None = None, *, timeout: bool = False) -> tuple[str, ...]:
        """Feed one escalation to the link; returns the availability events it caused ("down", "up").

        A failure's `elapsed_ms` (or an `rtt_ms` given with ok=False) is how long the edge waited.
        `timeout` says the failure was the deadline passing rather than the cloud refusing.
        """
        self.observe_bytes(bytes_sent)
        was_up = self.link.up
        if ok and rtt_ms is not None:
            self.link.observe_answer(rtt_ms)
        elif timeout:
            self.link.observe_timeout(elapsed_ms if elapsed_ms is not None else rtt_ms)
        else:
            self.link.observe_refusal(elapsed_ms if elapsed_ms is not None else rtt_ms)
        if was_up == self.link.up:
            return ()
        return ("up",) if self.link.up else ("down",)

    def observe_agreement(self, agreed: bool, edge_accuracy: float) -> None:
        """Record whether the cloud agreed with the edge on an escalated input.

        Args:
            agreed: the edge's answer equals the cloud's.
            edge_accuracy: the edge accuracy on escalated inputs that validation predicts at the
                operating point in force (the prior for the edge side).
        """
        self._agree.append((bool(agreed), float(edge_accuracy)))
        self._agree_seen += 1

    def _refit(self) -> tuple[float, float, float | None]:
        """Cloud accuracy and edge error scale that best explain the observed agreements (MAP on a grid).

        Each escalation i agrees with probability about a_e,i(s) * a_c: both right (coinciding wrong
        answers are rare), where a_e,i(s) is the edge's validation accuracy e_i at that input's score
        with its odds of being right divided by s (so it stays in (0, 1)); the error scale reported
        is the edge's mean error at s over its validation error. Inputs the edge is nearly always right on
        measure a_c almost directly; the others constrain the product. Priors: a_c ~ Beta with
        `cloud_prior_strength` pseudo-observations at the prior accuracy (a few hundred escalations
        override it), log s ~ Normal(0, 20 / `edge_prior_strength`).
        """
        n = len(self._agree)
        if n == 0:
            return self.cloud_prior, 1.0, None
        if self._fit is not None and self._fit[0] == self._agree_seen:
            return self._fit[1]
        agree = np.fromiter((a for a, _ in self._agree), dtype=float, count=n)
        edge = np.clip(np.fromiter((e for _, e in self._agree), dtype=float, count=n), 1e-3, 1 - 1e-4)
        odds = (edge / (1 - edge))[None, :] / _SCALES[:, None]
        a_e = odds / (1 + odds)                                                              # (S, n)
        p = np.clip(_CLOUD[:, None, None] * a_e[None, :, :], 1e-6, 1 - 1e-6)                   # (C, S, n)
        loglik = (agree * np.log(p) + (1 - agree) * np.log1p(-p)).sum(axis=2)
        prior_c = min(max(self.cloud_prior, 1e-3), 1 - 1e-4)
        k = self.cloud_prior_strength
        loglik += (k * prior_c * np.log(_CLOUD) + k * (1 - prior_c) * np.log1p(-_CLOUD))[:, None]
        loglik -= (0.5 * self.edge_prior_strength / 20 * np.log(_SCALES) ** 2)[None, :]
        c, sc = np.unravel_index(int(np.argmax(loglik)), loglik.shape)
        scale = float((1 - a_e[sc]).mean() / max(float((1 - edge).mean()), 1e-6))
        fit = float(_CLOUD[c]), min(max(scale, 0.25), 4.0), float(agree.mean())
        self._fit = (self._agree_seen, fit)
        return fit

    def forget_unanswered(self) -> None:
        """Forget the escalations not answered in time (after the deadline grew: cut at the old one)."""
        self.link.forget_unanswered()

    def rebase(self, keep: int = 4) -> None:
        """Forget all but the last `keep` round trips (after a detected change)."""
        self.link.rebase(keep)

    def state(self) -> LinkState:
        cloud, scale, rate = self._refit()
        v = self.link.view()
        ewma = v.rtt_ms if math.isfinite(v.rtt_ms) else v.rtt_high_ms
        return LinkState(rtt_ms=ewma, rtt_high_ms=v.rtt_high_ms, availability=v.availability, up=v.up,
                         bytes_per_escalation=self.bytes_per_escalation, energy_per_byte_mj=self.energy_per_byte_mj,
                         wait_power_w=self.wait_power_w, energy_label=self.energy_label, cloud_accuracy=cloud,
                         edge_error_scale=scale, failure_latency_ms=v.failure_latency_ms, agreement_rate=rate,
                         agreement_n=len(self._agree), epoch=v.epoch, event=v.event,
                         cloud_reference_accuracy=self._reference(),
                         bandwidth_bps=v.bandwidth.bandwidth_bps if v.bandwidth is not None else None,
                         rtt_samples=v.rtt_samples, slow=v.slow)

    def _reference(self) -> float | None:
        """The edge's mean validation accuracy on the escalations the cloud accuracy was fitted on (None
        before any: the prior is the cloud's accuracy on everything, to set against the edge's)."""
        if not self._agree:
            return None
        return float(np.mean(np.fromiter((e for _, e in self._agree), dtype=float, count=len(self._agree))))
