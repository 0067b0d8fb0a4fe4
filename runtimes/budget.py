"""What a device may spend per request, one definition for every layer: the agent, releases, the fleet.

`Budget` is the whole budget a device keeps. A release's policy and a fleet's desired document set
only some of its fields; `BudgetOverride` holds those, checked by `Budget`'s own rules (there is no
second validator), and `apply` lays them over the budget a device has.

Example:
    >>> base = Budget(latency_ms=20)
    >>> BudgetOverride.parse({"energy_mj": 4}).apply(base)
    Budget(latency_ms=20, energy_mj=4, max_escalations_per_s=None)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
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
        if not (_number(self.latency_ms) and math.isfinite(self.latency_ms) and self.latency_ms > 0):
            msg = f"Budget latency_ms must be a positive number, got {self.latency_ms!r}"
            raise ConfigError(msg)
        if self.energy_mj is not None and not (_number(self.energy_mj) and math.isfinite(self.energy_mj)
                                               and self.energy_mj > 0):
            msg = f"Budget energy_mj must be a positive number or None, got {self.energy_mj!r}"
            raise ConfigError(msg)
        if self.max_escalations_per_s is not None and not (
                _number(self.max_escalations_per_s) and math.isfinite(self.max_escalations_per_s)
                and self.max_escalations_per_s >= 0):
            msg = f"Budget max_escalations_per_s must be >= 0 or None, got {self.max_escalations_per_s!r}"
            raise ConfigError(msg)

    def to_json(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(Budget))


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class BudgetOverride:
    """The budget fields a release or a desired document sets; the others keep the device's.

    Args:
        values: (field, value) pairs, each a field of `Budget`; a None value clears an optional field.
    """

    values: tuple[tuple[str, float | None], ...] = ()

    def __post_init__(self) -> None:
        unknown = [k for k, _ in self.values if k not in FIELDS]
        if unknown:
            msg = f"budget field {unknown[0]!r} is not one of {', '.join(FIELDS)}"
            raise ConfigError(msg)
        Budget(**dict(self.values))  # type: ignore[arg-type]  # each value under Budget's own rules (the other fields at their defaults)

    @classmethod
    def parse(cls, value: object, *, where: str = "budget") -> BudgetOverride:
        """From JSON (`{"latency_ms": 25, "energy_mj": 4}`); `ConfigError` naming the field."""
        if not isinstance(value, Mapping):
            msg = f"{where} must be a mapping of {', '.join(FIELDS)}, got {value!r}"
            raise ConfigError(msg)
        for k, v in value.items():
            if k not in FIELDS:
                msg = f"{where}.{k} is not a budget field; use {', '.join(FIELDS)}"
                raise ConfigError(msg)
            try:
                if v is not None and not _number(v):
                    raise ConfigError(f"must be a number or null, got {v!r}")  # noqa: EM102
                Budget(**{k: None if v is None else float(v)})  # type: ignore[arg-type]  # its own rule
            except ConfigError as exc:
                msg = f"{where}.{k}: {exc}"
                raise ConfigError(msg) from None
        return cls(tuple((str(k), None if v is None else float(v)) for k, v in sorted(value.items())))

    def apply(self, base: Budget) -> Budget:
        return dataclasses.replace(base, **dict(self.values))  # type: ignore[arg-type]

    def merged(self, over: BudgetOverride) -> BudgetOverride:
        """These fields, with `over`'s taking precedence."""
        return BudgetOverride(tuple(sorted({**dict(self.values), **dict(over.values)}.items())))

    @property
    def latency_ms(self) -> float | None:
        return dict(self.values).get("latency_ms")

    def to_json(self) -> dict[str, float | None]:
        return dict(self.values)
