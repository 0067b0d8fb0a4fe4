"""What `predict` returns: the outputs, the tier that answered, and what it cost."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Prediction:
    """One answer of `predict`: the outputs and how they were obtained.

    Attributes:
        outputs: output name -> array; without the batch axis when the input had none.
        tier: "cloud" when the cloud answered (some of) the rows, else "edge".
        score: the edge confidence (the lowest over the rows of a batch); higher = surer.
        variant: the edge variant that ran.
        degraded: the cloud was wanted but unavailable, too slow, or its answer unusable.
        latency_ms: wall time of the call.
        energy_mj: device energy of the call (inference plus radio) in millijoules.
        energy_label: `measured:<source>` or `modeled:<profile>`.
        scores: the per-row edge scores.
        cloud_rows: per-row mask of the rows the cloud answered.
        reason: why the cloud was not used when wanted: "no_cloud" (edge only), "breaker_open", "rtt"
            (recent round trips do not fit), "budget", "rate", "cloud_busy" (the cloud refused with a retry hint
            that has not passed), "timeout", "unavailable", "error", "bad_reply",
            "journal_full", "late"; empty otherwise.
        cached: answered from the result cache.
        seq: the request's sequence number on this agent (its id in the journal and telemetry).
        release: the fleet release that answered (its digest) where the agent runs one (`tierkit agent`
            enrolled in a fleet: else the digest of its configured model); empty for a model loaded directly.

    Example:
        >>> pred = model.predict(x)
        >>> pred.outputs["logits"].argmax(), pred.tier, pred.degraded
    """

    outputs: dict[str, np.ndarray]
    tier: str
    score: float
    variant: str
    degraded: bool
    latency_ms: float
    energy_mj: float
    energy_label: str
    scores: np.ndarray = field(repr=False)
    cloud_rows: np.ndarray = field(repr=False)
    reason: str = ""
    cached: bool = False
    seq: int = 0
    release: str = ""


def make_prediction(outputs: dict[str, np.ndarray], tier: str, score: float, variant: str, degraded: bool,
                latency_ms: float, energy_mj: float, energy_label: str, scores: np.ndarray, cloud_rows: np.ndarray,
                reason: str, cached: bool, seq: int, release: str = "") -> Prediction:
    """`Prediction(...)` without the frozen dataclass's per-field `object.__setattr__` (~3 µs per request)."""
    pred = object.__new__(Prediction)
    pred.__dict__.update(outputs=outputs, tier=tier, score=score, variant=variant, degraded=degraded,
                         latency_ms=latency_ms, energy_mj=energy_mj, energy_label=energy_label, scores=scores,
                         cloud_rows=cloud_rows, reason=reason, cached=cached, seq=seq, release=release)
    return pred
