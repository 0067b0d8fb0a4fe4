"""Timing a wrapper against the bare call it wraps, on a shared and noisy host.

Calls run in blocks, raw and wrapped blocks alternating (and swapping which goes first), so that
drift in machine load hits both alike. Each figure is the median over blocks of the mean time per call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def time_block(fn: Callable[[], Any], calls: int) -> float:
    """Mean µs per call of `calls` back-to-back calls."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls / 1e3


def interleaved_medians(raw: Callable[[], Any], wrapped: Callable[[], Any], *, blocks: int, calls: int,
                        warmup: int) -> tuple[float, float]:
    """(raw µs, wrapped µs) per call: medians over alternating blocks, after `warmup` calls of each."""
    for _ in range(warmup):  # warm both paths: allocator, caches, thread pools
        raw()
        wrapped()
    raw_t: list[float] = []
    wrapped_t: list[float] = []
    for block in range(blocks):
        pair = ((raw, raw_t), (wrapped, wrapped_t))
        for fn, sink in pair if block % 2 == 0 else reversed(pair):
            sink.append(time_block(fn, calls))
    return statistics.median(raw_t), statistics.median(wrapped_t)


@dataclass(frozen=True)
class OverheadRow:
    """One wrapped-vs-raw comparison; `case` names the backend or the path that was wrapped."""

    model: str
    case: str
    raw_us: float
    wrapped_us: float
    added_us: float
    added_pct: float
    allowed_us: float
    passed: bool
    blocks: int
    calls_per_block: int


def compare(model: str, case: str, raw: Callable[[], Any], wrapped: Callable[[], Any], *, blocks: int, calls: int,
            warmup: int, target_us: float, target_pct: float) -> OverheadRow:
    """Time both, and judge the added time against `max(target_us, target_pct % of raw)`."""
    r, w = interleaved_medians(raw, wrapped, blocks=blocks, calls=calls, warmup=warmup)
    allowed = max(target_us, r * target_pct / 100)
    return OverheadRow(model, case, r, w, w - r, (w - r) / r * 100, allowed, w - r <= allowed, blocks, calls)
