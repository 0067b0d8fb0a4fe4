"""Rollout gates: a wave's figures against a control cohort still on the previous release, over the same window.

Pure functions over telemetry windows (dicts with requests, window_s, p95_ms, escalation_rate,
agreement, degraded, energy_mj_per_request, crashes). Each gate is a JSON-able dict recorded with
the decision it led to:

```json
{"gate": "escalation_rate", "ok": false, "wave": 0.27, "control": 0.16, "limit": 0.21,
 "note": "no worse than control + 0.05"}
```

`ok` is None when a gate cannot be judged (no control, no budget, no capacity figure): it neither
passes nor fails the wave. Figures are request-weighted over the windows: p95 is the request-weighted
mean of the windows' p95s (windows carry quantiles, not samples); agreement is weighted by escalated
requests (it is measured on escalated inputs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from runtimes.errors import ConfigError


@dataclass(frozen=True)
class Margins:
    """How much worse than control a wave may be; per deployment (`tierkit fleet deploy --max-...`).

    Args:
        p95_ratio: p95 latency at most control x (1 + this), and within the release's latency budget.
        escalation_points: escalation rate at most control + this (0.05 = 5 points).
        agreement_points: edge/cloud agreement at least control - this.
        degraded_points: degraded share at most control + this.
        energy_ratio: energy per request at most control x (1 + this).
        min_requests: requests on the release a wave needs before its figures are judged.
    """

    p95_ratio: float = 0.25
    escalation_points: float = 0.05
    agreement_points: float = 0.05
    degraded_points: float = 0.05
    energy_ratio: float = 0.20
    min_requests: int = 50

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value >= 0:
                msg = f"margin {name}={value!r} must be a number >= 0"
                raise ConfigError(msg)


@dataclass(frozen=True)
class Cohort:
    """Request-weighted figures of a set of windows."""

    devices: int
    windows: int
    requests: int
    seconds: float
    p95_ms: float | None
    escalation_rate: float | None
    agreement: float | None
    degraded_share: float | None
    energy_mj_per_request: float | None
    crashes: int

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def cohort(windows: Iterable[Mapping[str, Any]]) -> Cohort:
    ws = list(windows)
    req = sum(int(w.get("requests") or 0) for w in ws)

    def weighted(key: str, weight: Any = None) -> float | None:
        num = den = 0.0
        for w in ws:
            value = w.get(key)
            wt = float(w.get("requests") or 0) if weight is None else weight(w)
            if value is None or wt <= 0:
                continue
            num, den = num + float(value) * wt, den + wt
        return num / den if den > 0 else None

    return Cohort(
        devices=len({w.get("device_id") for w in ws}), windows=len(ws), requests=req,
        seconds=sum(float(w.get("window_s") or 0) for w in ws),
        p95_ms=weighted("p95_ms"), escalation_rate=weighted("escalation_rate"),
        agreement=weighted("agreement", lambda w: float(w.get("requests") or 0) * float(w.get("escalation_rate") or 0)),
        degraded_share=(sum(int(w.get("degraded") or 0) for w in ws) / req) if req else None,
        energy_mj_per_request=weighted("energy_mj_per_request"),
        crashes=sum(int(w.get("crashes") or 0) for w in ws))


def _gate(name: str, ok: bool | None, wave: Any, control: Any, limit: Any, note: str) -> dict[str, Any]:
    def r(v: Any) -> Any:
        return round(v, 6) if isinstance(v, float) else v

    return {"gate": name, "ok": ok, "wave": r(wave), "control": r(control), "limit": r(limit), "note": note}


def _worse(name: str, wave: float | None, control: float | None, limit: float | None, note: str, *,
           higher_is_worse: bool = True) -> dict[str, Any]:
    if wave is None or control is None or limit is None:
        return _gate(name, None, wave, control, limit, note + " (not judged: no figure)")
    ok = wave <= limit if higher_is_worse else wave >= limit
    return _gate(name, ok, wave, control, limit, note)


def evaluate(wave: Cohort, control: Cohort | None, *, margins: Margins, budget_ms: float | None,
             device_failures: Mapping[str, str], crashes: int, fleet_request_rate: float | None,
             cloud_capacity_rps: float | None) -> list[dict[str, Any]]:
    """Every gate on the wave's figures (`wave`) against `control` (None: no control cohort)."""
    m, c = margins, control
    gates = [
        _gate("device_verifies", not device_failures, len(device_failures), None, 0,
              "swap not refused, golden inputs reproduce, no device rollback"
              + (": " + "; ".join(f"{d}: {e}" for d, e in sorted(device_failures.items())[:5]) if device_failures
                 else "")),
        _gate("crashes", crashes + wave.crashes == 0, crashes + wave.crashes, c.crashes if c else None, 0,
              "no crash on the release"),
    ]
    if budget_ms is None:
        gates.append(_gate("p95_budget", None, wave.p95_ms, None, None, "the release sets no latency budget"))
    else:
        gates.append(_gate("p95_budget", None if wave.p95_ms is None else wave.p95_ms <= budget_ms, wave.p95_ms, None,
                           budget_ms, f"p95 within the release's latency budget {budget_ms:g} ms"))
    cc = c if c is not None and c.requests > 0 else None

    def ctl(name: str) -> float | None:
        value = getattr(cc, name) if cc is not None else None
        return None if value is None else float(value)

    def lim(name: str, add: float = 0.0, mul: float = 1.0) -> float | None:
        value = ctl(name)
        return None if value is None else value * mul + add

    gates += [
        _worse("p95_vs_control", wave.p95_ms, ctl("p95_ms"), lim("p95_ms", mul=1 + m.p95_ratio),
               f"p95 no worse than control x {1 + m.p95_ratio:g}"),
        _worse("escalation_rate", wave.escalation_rate, ctl("escalation_rate"),
               lim("escalation_rate", add=m.escalation_points), f"no worse than control + {m.escalation_points:g}"),
        _worse("agreement", wave.agreement, ctl("agreement"), lim("agreement", add=-m.agreement_points),
               f"no worse than control - {m.agreement_points:g}", higher_is_worse=False),
        _worse("degraded_share", wave.degraded_share, ctl("degraded_share"),
               lim("degraded_share", add=m.degraded_points), f"no worse than control + {m.degraded_points:g}"),
        _worse("energy_per_request", wave.energy_mj_per_request, ctl("energy_mj_per_request"),
               lim("energy_mj_per_request", mul=1 + m.energy_ratio), f"no worse than control x {1 + m.energy_ratio:g}"),
    ]
    projected = (fleet_request_rate * wave.escalation_rate
                 if fleet_request_rate is not None and wave.escalation_rate is not None else None)
    if cloud_capacity_rps is None:
        gates.append(_gate("cloud_capacity", None, projected, None, None,
                           "escalations/s the release would bring fleet-wide; no --cloud-capacity given"))
    else:
        gates.append(_gate("cloud_capacity", None if projected is None else projected <= cloud_capacity_rps,
                           projected, None, cloud_capacity_rps, "escalations/s fleet-wide (targeted devices' "
                           "request rate x the wave's escalation rate) within the cloud's measured capacity"))
    return gates


def failed(gates: Iterable[Mapping[str, Any]]) -> list[str]:
    return [g["gate"] for g in gates if g["ok"] is False]
