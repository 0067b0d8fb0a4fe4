"""Escalation policies: how confident the edge answer is, and where the line is.

A *scorer* maps a model's outputs to one score per row, higher = more confident; a row escalates
when its score is below the threshold. Scorers are pure (no I/O) and precompute their constants,
because they run on every request:

```
MaxProb(T)      max softmax(logits / T)
Margin(T)       top-1 minus top-2 probability
Entropy(T)      1 - H(softmax(logits / T)) / log(K)
Calibrated()    MaxProb with the temperature fitted at compile time (manifest calibration)
EnergyOOD(k)    1 inside the calibration range of -T·logsumexp(logits/T), falling to 0 at p99 + k·std
MinOf(a, b)     the least confident of several (e.g. calibrated and not out of distribution)
Weighted(...)   a weighted mean of several
CustomScore(f)  any callable outputs -> score(s)
```

Thresholds are set directly or derived on the package's validation data with
`threshold_for_rate` or `threshold_for_accuracy`. `Policy` bundles the choice; `Policy.bind` turns
it into a `BoundPolicy` for one variant.

Example:
    >>> bound = Policy("margin", target_rate=0.2).bind(manifest.calibration, validation)
    >>> scores, escalate = bound.decide({"logits": logits})
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from runtimes.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.9
_SMALL = 64  # up to this many classes, one row is scored in plain Python
Outputs = Mapping[str, np.ndarray]


@runtime_checkable
class Scorer(Protocol):
    """Anything with `score(outputs) -> (batch,) float array`; `bind` attaches package calibration."""

    def score(self, outputs: Outputs) -> np.ndarray: ...

    def bind(self, calibration: Mapping[str, Any], output: str | None) -> Scorer: ...


def _logits(outputs: Outputs, name: str | None) -> np.ndarray:
    z = outputs[name] if name is not None else next(iter(outputs.values()))
    return z if z.ndim == 2 else z.reshape(z.shape[0] if z.ndim else 1, -1)


@dataclass(frozen=True)
class _Softmax:
    temperature: float = 1.0
    output: str | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            msg = f"temperature must be a positive number, got {self.temperature!r}"
            raise ConfigError(msg)

    def bind(self, calibration: Mapping[str, Any], output: str | None) -> Scorer:
        return type(self)(self.temperature, self.output or output)

    def score(self, outputs: Outputs) -> np.ndarray:
        z = _logits(outputs, self.output)
        if z.shape[0] == 1 and z.shape[1] <= _SMALL:
            # one row of a few classes: plain floats beat a dozen numpy calls (the per-request path)
            row = z[0].tolist()
            top = max(row)
            inv = 1.0 / self.temperature
            e = [math.exp((v - top) * inv) for v in row]
            return np.array([self._row(e, inv, top, row)])
        # float64: float32 saturates confident rows at exactly 1.0, and thresholds rank on ties
        z = z.astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        if self.temperature != 1.0:
            z *= 1.0 / self.temperature
        return self._rows(z)

    def _row(self, e: list[float], inv: float, top: float, row: list[float]) -> float:
        raise NotImplementedError

    def _rows(self, z: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class MaxProb(_Softmax):
    """The largest softmax probability at temperature T."""

    def _row(self, e: list[float], inv: float, top: float, row: list[float]) -> float:
        return 1.0 / sum(e)

    def _rows(self, z: np.ndarray) -> np.ndarray:
        # max softmax = exp(0) / sum(exp(z - max)): one exp, one sum
        out: np.ndarray = 1.0 / np.exp(z).sum(axis=1)
        return out


class Margin(_Softmax):
    """Top-1 minus top-2 softmax probability."""

    def _row(self, e: list[float], inv: float, top: float, row: list[float]) -> float:
        second = sorted(e)[-2] if len(e) > 1 else 0.0
        return (1.0 - second) / sum(e)

    def _rows(self, z: np.ndarray) -> np.ndarray:
        e = np.exp(z)
        second = np.sort(e, axis=1)[:, -2] if e.shape[1] > 1 else 0.0
        out: np.ndarray = (1.0 - second) / e.sum(axis=1)
        return out


class Entropy(_Softmax):
    """One minus the normalised entropy of the softmax: 1 for a one-hot answer, 0 for uniform."""

    def _row(self, e: list[float], inv: float, top: float, row: list[float]) -> float:
        total = sum(e)
        pz = sum(ei * (v - top) * inv for ei, v in zip(e, row, strict=True))
        return 1.0 - (math.log(total) - pz / total) / math.log(max(len(e), 2))

    def _rows(self, z: np.ndarray) -> np.ndarray:
        e = np.exp(z)
        total = e.sum(axis=1)
        # H = log(sum e) - sum(p * z)
        h = np.log(total) - (e * z).sum(axis=1) / total
        out: np.ndarray = 1.0 - h / math.log(max(z.shape[1], 2))
        return out


@dataclass(frozen=True)
class Calibrated:
    """MaxProb at the temperature fitted on validation data at compile time (1.0 when absent)."""

    output: str | None = None

    def bind(self, calibration: Mapping[str, Any], output: str | None) -> Scorer:
        return MaxProb(float(calibration.get("temperature", 1.0)), self.output or output)

    def score(self, outputs: Outputs) -> np.ndarray:
        return MaxProb(1.0, self.output).score(outputs)


@dataclass(frozen=True)
class EnergyOOD:
    """Out-of-distribution score from the energy -T·logsumexp(logits/T) of the outputs.

    1.0 up to the calibration data's 99th percentile, falling linearly to 0.0 at p99 + k·std.
    Combine it with a confidence scorer through `MinOf` so unfamiliar inputs escalate even when
    the model is (wrongly) sure. Unbound (no calibration statistics), it scores 1.0.
    """

    k: float = 10.0
    p99: float = math.inf
    std: float = 1.0
    temperature: float = 1.0
    output: str | None = None

    def bind(self, calibration: Mapping[str, Any], output: str | None) -> Scorer:
        ood = calibration.get("ood") or {}
        if "energy_p99" not in ood:
            logger.warning("the package has no OOD statistics; the energy score accepts every input")
            return self
        return EnergyOOD(self.k, float(ood["energy_p99"]), max(float(ood.get("energy_std", 1.0)), 1e-6),
                         float(calibration.get("temperature", 1.0)), self.output or output)

    def score(self, outputs: Outputs) -> np.ndarray:
        z = _logits(outputs, self.output) * (1.0 / self.temperature)
        top = z.max(axis=1)
        energy = -self.temperature * (top + np.log(np.exp(z - top[:, None]).sum(axis=1)))
        out: np.ndarray = np.clip(1.0 - (energy - self.p99) / (self.k * self.std), 0.0, 1.0)
        return out


@dataclass(frozen=True)
class MinOf:
    """The lowest of several scores: escalate when any one of them is unsure."""

    scorers: tuple[Any, ...]

    def __init__(self, *scorers: Any) -> None:
        if not scorers:
            msg = "MinOf needs at least one scorer"
            raise ConfigError(msg)
        object.__setattr__(self, "scorers", tuple(as_scorer(s) for s in scorers))

    def bind(self, calibration: Mapping[str, Any], output: str | None) -> Scorer:
        return MinOf(*(s.bind(calibration, output) for s in self.scorers))

    def score(self, outputs: Outputs) -> np.ndarray:
        out: np.ndarray = np.minimum.reduce([s.score(outputs) for s in self.scorers])
        return out


@dataclass(frozen=True)
class Weighted:
    """A weighted mean of scores, e.g. ``Weighted((MaxProb(), 0.7), (Margin(), 0.3))``."""

    parts: tuple[tuple[Any, float], ...]

    def __init__(self, *parts: tuple[Any, float]) -> None:
        total = sum(w for _, w in parts)
        if not parts or any(w < 0 for _, w in parts) or total <= 0:
            msg = f"Weighted needs (scorer, weight >= 0) pairs with a positive sum, got {parts!r}"
            raise ConfigError(msg)
        object.__setattr__(self, "parts", tuple((as_scorer(s), w / total) for s, w in parts))

    def bind(self, calibration: Mapping[str, Any], output: str | None) -> Scorer:
        return Weighted(*((s.bind(calibration, output), w) for s, w in self.parts))

    def score(self, outputs: Outputs) -> np.ndarray:
        return sum((w * s.score(outputs) for s, w in self.parts), start=np.zeros(()))


@dataclass(frozen=True)
class CustomScore:
    """Wrap a callable `outputs -> score` (float or one per row) as a scorer."""

    fn: Callable[[Outputs], Any]

    def bind(self, calibration: Mapping[str, Any], output: str | None) -> Scorer:
        return self

    def score(self, outputs: Outputs) -> np.ndarray:
        return np.atleast_1d(np.asarray(self.fn(outputs), dtype=np.float64))


_NAMED: dict[str, Callable[[], Scorer]] = {
    "max_prob": MaxProb, "margin": Margin, "entropy": Entropy, "calibrated": Calibrated,
    "ood": EnergyOOD, "calibrated+ood": lambda: MinOf(Calibrated(), EnergyOOD()),
}


def as_scorer(spec: str | Scorer | Callable[[Outputs], Any]) -> Scorer:
    """A scorer from a name (see `scorer_names()`), a scorer, or a plain callable."""
    if isinstance(spec, str):
        try:
            return _NAMED[spec]()
        except KeyError:
            msg = f"policy score {spec!r} is not one of {scorer_names()}, a Scorer, or a callable"
            raise ConfigError(msg) from None
    if isinstance(spec, Scorer):
        return spec
    if callable(spec):
        return CustomScore(spec)
    msg = f"policy score {spec!r} is not a name, a Scorer, or a callable"
    raise ConfigError(msg)


def scorer_names() -> list[str]:
    return sorted(_NAMED)


def threshold_for_rate(scores: np.ndarray, rate: float) -> float:
    """The threshold that escalates (score < threshold) a fraction `rate` of `scores`."""
    if not 0.0 <= rate <= 1.0:
        msg = f"target escalation rate must be in [0, 1], got {rate!r}"
        raise ConfigError(msg)
    s = np.sort(np.asarray(scores, dtype=np.float64).ravel())
    k = math.ceil(rate * len(s) - 1e-9)
    if k <= 0:
        return -math.inf
    return math.inf if k >= len(s) else float(s[k])


def threshold_for_accuracy(scores: np.ndarray, correct: np.ndarray, target: float, *,
                           cloud_accuracy: float = 1.0, max_rate: float = 1.0) -> float:
    """The highest-scoring cut that keeps the tiered accuracy at or above `target`.

    Tiered accuracy counts the edge's own correctness on the rows it keeps and `cloud_accuracy` on
    the rows it escalates. The fewest escalations that reach `target` win; when `max_rate` caps
    them first, the cap applies (and a warning says the target is out of reach).
    """
    if not 0.0 < target <= 1.0:
        msg = f"target accuracy must be in (0, 1], got {target!r}"
        raise ConfigError(msg)
    s = np.asarray(scores, dtype=np.float64).ravel()
    ok = np.asarray(correct, dtype=np.float64).ravel()
    if len(s) != len(ok) or not len(s):
        msg = f"scores ({len(s)}) and correct ({len(ok)}) must be non-empty and the same length"
        raise ConfigError(msg)
    order = np.argsort(s, kind="stable")
    s, ok = s[order], ok[order]
    n = len(s)
    # escalating the k lowest: edge correct on [k:], cloud on [:k]
    kept = np.concatenate([np.cumsum(ok[::-1])[::-1], [0.0]])
    acc = (kept + cloud_accuracy * np.arange(n + 1)) / n
    cap = math.floor(max_rate * n + 1e-9)
    reach = np.flatnonzero(acc[: cap + 1] >= target - 1e-12)
    if reach.size:
        k = int(reach[0])
    else:
        k = int(np.argmax(acc[: cap + 1]))
        logger.warning("target accuracy %.4f is out of reach within an escalation rate of %.2f on the "
                       "validation data (best %.4f at rate %.2f)", target, max_rate, acc[k], k / n)
    if k <= 0:
        return -math.inf
    # just above the k-th lowest score: rows tied with it escalate too (the safe side for accuracy)
    return float(np.nextafter(s[k - 1], math.inf))


@dataclass(frozen=True)
class Policy:
    """When to escalate: a scorer and one way of setting its threshold.

    Args:
        score: a scorer name (`scorer_names()`), a `Scorer`, or a callable `outputs -> score(s)`.
        threshold: escalate rows scoring below this.
        target_rate: instead, the threshold escalating this fraction of the validation data.
        target_accuracy: instead, the fewest escalations reaching this tiered accuracy on the
            validation data (escalated rows counted at `cloud_accuracy`), capped by `max_rate`.
        max_rate: the escalation-rate cap for `target_accuracy`.
        cloud_accuracy: the cloud's expected accuracy on escalated rows, for `target_accuracy`.
        ood: also escalate out-of-distribution inputs (`MinOf(score, EnergyOOD())`).
        keep: journal the escalations the cloud could not answer and send them when it is back.
        cache_size: answer up to this many recurring inputs from a cache (0: no cache).
        output: the output holding the logits (default: the first).

    With none of `threshold`, `target_rate`, `target_accuracy`, the threshold is 0.9.

    Example:
        >>> Policy("calibrated", target_accuracy=0.995, max_rate=0.25, ood=True)
    """

    score: str | Scorer | Callable[[Outputs], Any] = "calibrated"
    threshold: float | None = None
    target_rate: float | None = None
    target_accuracy: float | None = None
    max_rate: float = 1.0
    cloud_accuracy: float = 1.0
    ood: bool = False
    keep: bool = False
    cache_size: int = 0
    output: str | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("threshold", "target_rate", "target_accuracy") if getattr(self, n) is not None]
        if len(given) > 1:
            msg = f"Policy takes one of threshold, target_rate, target_accuracy; got {given}"
            raise ConfigError(msg)
        if not 0.0 <= self.max_rate <= 1.0 or not 0.0 <= self.cloud_accuracy <= 1.0:
            msg = f"Policy max_rate and cloud_accuracy must be in [0, 1], got {self.max_rate}, {self.cloud_accuracy}"
            raise ConfigError(msg)
        if self.cache_size < 0:
            msg = f"Policy cache_size must be >= 0, got {self.cache_size}"
            raise ConfigError(msg)
        as_scorer(self.score)  # fail at construction, not at first use

    @property
    def needs_validation(self) -> bool:
        return self.target_rate is not None or self.target_accuracy is not None

    def scorer(self, calibration: Mapping[str, Any], output: str | None = None) -> Scorer:
        """The scorer bound to a variant's calibration (temperature, OOD statistics)."""
        base = as_scorer(self.score)
        if self.ood:
            base = MinOf(base, EnergyOOD())
        return base.bind(calibration, self.output or output)

    def bind(self, calibration: Mapping[str, Any], validation: tuple[np.ndarray, np.ndarray] | None = None,
             output: str | None = None) -> BoundPolicy:
        """Fix the scorer and threshold for one variant.

        Args:
            calibration: the variant manifest's `calibration` dict.
            validation: (logits, labels) from the package's validation file.
            output: the logits output name when `self.output` is unset.

        Raises:
            ConfigError: a target was asked for and there is no validation data.
        """
        scorer = self.scorer(calibration, output)
        if not self.needs_validation:
            return BoundPolicy(scorer, DEFAULT_THRESHOLD if self.threshold is None else float(self.threshold))
        if validation is None:
            msg = "Policy target_rate / target_accuracy need the package's validation data, and it has none"
            raise ConfigError(msg)
        logits, labels = validation
        name = self.output or output or "logits"
        scores = scorer.score({name: np.asarray(logits)})
        if self.target_rate is not None:
            return BoundPolicy(scorer, threshold_for_rate(scores, self.target_rate))
        correct = np.asarray(logits).argmax(axis=1) == np.asarray(labels)
        assert self.target_accuracy is not None
        return BoundPolicy(scorer, threshold_for_accuracy(scores, correct, self.target_accuracy,
                                                          cloud_accuracy=self.cloud_accuracy,
                                                          max_rate=self.max_rate))


@dataclass(frozen=True)
class BoundPolicy:
    """A scorer and its threshold for one variant: `decide` is the per-request call."""

    scorer: Scorer
    threshold: float

    def decide(self, outputs: Outputs, threshold: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, escalate mask) per row; `threshold` overrides the bound one (the controller's)."""
        scores = self.scorer.score(outputs)
        return scores, scores < (self.threshold if threshold is None else threshold)
