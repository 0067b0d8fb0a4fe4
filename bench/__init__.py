"""Benchmarks; each prints its table against a baseline measured in the same run (bench/RESULTS.md)."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name, as a benchmark's heading names it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"
