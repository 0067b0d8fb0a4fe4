"""Latency on the build host and modeled energy per inference.

Variants are timed interleaved: every round runs each open session in turn, so a load spike on a
shared host spreads over all variants instead of penalising whichever ran during it. Ratios
between variants timed in the same call are what to trust; absolute milliseconds move with load.

Energy is modeled with `runtimes.energy` (no counters are read at build time): a power
profile's busy watts times the latency, labelled `modeled:<profile>`.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compilers.passes.execute import Runner
from runtimes import energy as runtime_energy
from runtimes.energy import PowerProfile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimingPlan:
    """How long to time each batch size: `rounds` interleaved rounds within `budget_s` seconds in all.

    Each round times every variant in a block of calls. A block starts with untimed calls, at least
    `switch_warmup` of them and at least `switch_warmup_s` seconds' worth: the onnxruntime session
    timed just before keeps its threads spinning for tens of milliseconds and slows whatever runs
    next. Measured here: alternating onnxruntime and OpenVINO call by call made OpenVINO int8 MiniLM
    look 1.8x faster than onnxruntime fp32 where blocks of 10 calls showed 3.0x; on the ResNet-like
    CNN (224x224) the 5 to 10 calls that follow an onnxruntime fp32 block run 1.5x to 2x slower
    (40 to 60 ms in all, gone when that session may not spin), and blocks of 3 calls after 2 untimed
    ones put onnxruntime int8 at 1.5x fp32 where steady state is 2.9x.
    """

    budget_s: float = 1.5
    rounds: int = 5
    warmup: int = 3
    min_iterations: int = 5
    switch_warmup: int = 2
    switch_warmup_s: float = 0.08
    min_block: int = 3


def host_cpu() -> str:
    """The build host's CPU model name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_runners(runners: Mapping[str, Runner], inputs: Mapping[int, Mapping[str, np.ndarray]], *,
                 plan: TimingPlan | None = None,
                 spent: dict[str, float] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """p50/p95/mean milliseconds per runner and batch size, timed interleaved.

    Args:
        runners: variant id -> open session.
        inputs: batch size -> the input dict of that batch size.
        plan: time budget and rounds.
        spent: filled with the wall seconds each runner's calls took (warm-up, settling and timed calls).

    Returns:
        variant id -> {"batch_<n>": {"p50", "p95", "mean", "iterations"}}.
    """
    plan = plan or TimingPlan()
    out: dict[str, dict[str, dict[str, float]]] = {k: {} for k in runners}
    ids = list(runners)
    spent = spent if spent is not None else {}
    for batch_size, feed in inputs.items():
        per_call = {}
        for vid in ids:
            runners[vid].run(feed)  # a first call apart: OpenVINO compiles a fixed-shape copy on it
            t0 = time.perf_counter()
            for _ in range(plan.warmup):
                runners[vid].run(feed)
            per_call[vid] = max((time.perf_counter() - t0) / plan.warmup, 1e-6)
            spent[vid] = spent.get(vid, 0.0) + time.perf_counter() - t0
        slot = plan.budget_s / plan.rounds / max(len(ids), 1)
        samples: dict[str, list[float]] = {vid: [] for vid in ids}
        for r in range(plan.rounds):
            order = ids[r % len(ids):] + ids[:r % len(ids)]
            for vid in order:
                n = max(1, round(slot / per_call[vid]))
                n = max(n, -(-plan.min_iterations // plan.rounds), plan.min_block)
                run = runners[vid].run
                block = time.perf_counter()
                _settle(run, feed, plan)
                for _ in range(n):
                    t0 = time.perf_counter()
                    run(feed)
                    samples[vid].append(time.perf_counter() - t0)
                spent[vid] = spent.get(vid, 0.0) + time.perf_counter() - block
        for vid, values in samples.items():
            ms = np.asarray(values) * 1e3
            out[vid][f"batch_{batch_size}"] = {"p50": float(np.median(ms)), "p95": float(np.quantile(ms, 0.95)),
                                               "mean": float(ms.mean()), "iterations": float(len(ms))}
    return out


def _settle(run: Any, feed: Mapping[str, np.ndarray], plan: TimingPlan) -> None:
    """The untimed calls that start a block: `switch_warmup` calls and `switch_warmup_s` seconds."""
    end = time.perf_counter() + plan.switch_warmup_s
    done = 0
    while done < plan.switch_warmup or time.perf_counter() < end:
        run(feed)
        done += 1


def latency_record(timing: Mapping[str, Mapping[str, float]], threads: int) -> dict[str, Any]:
    """The manifest's `latency_ms` field: per-batch figures, host and threads."""
    return {**{k: dict(v) for k, v in timing.items()}, "host": host_cpu(), "threads": threads}


def modeled_energy(latency_ms: Mapping[str, Any], batch_size: int = 1,
                   profile: PowerProfile | None = None) -> dict[str, Any]:
    """Energy per inference: the profile's busy watts × p50 latency at `batch_size`, per sample.

    `profile` defaults to the build host's (`runtimes.hardware.machine_power_profile`), the one the
    agent and controller on that machine use too.
    """
    if profile is None:
        from runtimes.hardware import machine_power_profile

        profile = machine_power_profile()
    timing = latency_ms.get(f"batch_{batch_size}") or latency_ms.get("batch_1") or {}
    busy_s = float(timing.get("p50", 0.0)) / 1e3 / batch_size
    reading = runtime_energy.modeled_energy(profile, busy_s)
    return {"mj": reading.joules * 1e3, "label": reading.label, "batch_size": batch_size,
            "busy_watts": profile.busy_watts}
