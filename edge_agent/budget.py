"""What a device may spend per request: latency, energy, and cloud calls."""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtimes.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Budget:
    """Per-request budgets the edge agent and its controller keep.

    Args:
        latency_ms: end-to-end p95 latency budget of one `predict` call (edge inference plus any
            escalation). Escalations get a deadline of what remains of it.
        energy_mj: mean energy budget per request in millijoules (inference plus radio), or None.
        max_escalations_per_s: cap on cloud calls per second (cloud cost), or None.

    Example:
        >>> Budget(latency_ms=20, energy_mj=5.0)
    """

    latency_ms: float = 100.0
    energy_mj: float | None = None
    max_escalations_per_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_ms) and self.latency_ms > 0):
            msg = f"Budget latency_ms must be a positive number, got {self.latency_ms!r}"
            raise ConfigError(msg)
        if self.energy_mj is not None and not (math.isfinite(self.energy_mj) and self.energy_mj > 0):
            msg = f"Budget energy_mj must be a positive number or None, got {self.energy_mj!r}"
            raise ConfigError(msg)
        if self.max_escalations_per_s is not None and not self.max_escalations_per_s >= 0:
            msg = f"Budget max_escalations_per_s must be >= 0 or None, got {self.max_escalations_per_s!r}"
            raise ConfigError(msg)
