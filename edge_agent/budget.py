"""What a device may spend per request (`Budget`, defined once in `runtimes.budget`) and how the agent holds it."""

from __future__ import annotations

import math

from runtimes.budget import Budget
from runtimes.errors import ConfigError

__all__ = ["Budget", "BudgetWindows"]


class BudgetWindows:
    """Holds one budget per window of time: tightens the planning target when a window goes over it.

    The controller plans against a model; this checks the model against what happened. Each
    `window_s` window's figure (p95 latency, or mean energy) is compared with the budget: over it,
    the planning target shrinks by `tighten` at once; after `calm` windows in a row under
    `comfort` x the budget, it grows back by `loosen` (up to 1), or, with `max_loosen` above it, by
    as much as the room those calm windows left (comfort x budget over the largest of their figures,
    at most `max_loosen`): a target cut by a window a model error caused comes back in a few calm
    windows, not dozens. The asymmetry is the hysteresis: one bad window moves the target at once,
    good ones only after `calm` of them in a row, so it does not oscillate around the edge.

    Args:
        statistic: "p95" or "mean" of the window's values.
        window_s: the window length in seconds.
        min_values: windows with fewer values are not judged.
        tighten, loosen: the factors applied to `scale`.
        floor: the smallest `scale`.
        calm, comfort: loosen after `calm` windows in a row at or under `comfort` x the budget.
        max_loosen: the largest factor one loosening applies (at least `loosen`).

    Example:
        >>> held = BudgetWindows("p95")
        >>> if held.add(now, total_ms, budget.latency_ms):
        ...     redecide(latency_target=budget.latency_ms * held.scale)
    """

    def __init__(self, statistic: str, *, window_s: float = 1.0, min_values: int = 5, tighten: float = 0.85,
                 loosen: float = 1.05, floor: float = 0.3, calm: int = 10, comfort: float = 0.9,
                 max_loosen: float | None = None) -> None:
        if statistic not in ("p95", "mean"):
            msg = f"BudgetWindows statistic must be 'p95' or 'mean', got {statistic!r}"
            raise ConfigError(msg)
        self.statistic, self.window_s, self.min_values = statistic, window_s, min_values
        self.tighten, self.loosen, self.floor, self.calm, self.comfort = tighten, loosen, floor, calm, comfort
        self.max_loosen = max(loosen, max_loosen if max_loosen is not None else loosen)
        self.scale = 1.0
        self.windows = self.over = 0
        self._start: float | None = None
        self._values: list[float] = []
        self._good = 0
        self._calm_peak = 0.0

    def add(self, now: float, value: float, limit: float) -> bool:
        """One request's figure at time `now` (seconds); True when `scale` changed."""
        if self._start is None:
            self._start = now
        changed = False
        if now - self._start >= self.window_s:
            changed = self._close(limit)
            self._start, self._values = now, []
        self._values.append(float(value))
        return changed

    def reset(self) -> None:
        """Forget the open window (after the budget changed, its figures judge another budget)."""
        self._start, self._values, self._good, self._calm_peak = None, [], 0, 0.0

    def _close(self, limit: float) -> bool:
        values = self._values
        if len(values) < self.min_values:
            return False
        ordered = sorted(values)
        stat = (ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)] if self.statistic == "p95"
                else sum(values) / len(values))
        self.windows += 1
        old = self.scale
        if stat > limit:
            self.over += 1
            self._good, self._calm_peak = 0, 0.0
            self.scale = max(self.floor, self.scale * self.tighten)
        elif stat <= self.comfort * limit:
            self._good += 1
            self._calm_peak = max(self._calm_peak, stat)
            if self._good >= self.calm:
                room = self.comfort * limit / self._calm_peak if self._calm_peak > 0 else self.max_loosen
                self._good, self._calm_peak = 0, 0.0
                self.scale = min(1.0, self.scale * min(max(room, self.loosen), self.max_loosen))
        else:
            self._good, self._calm_peak = 0, 0.0
        return self.scale != old
