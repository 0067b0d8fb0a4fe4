"""Side runs: the variants an agent is not serving with, timed now and then at the load of now.

The controller prices a variant it is not serving with from that variant's own benchmark at start,
scaled by how much slower the serving variant runs now than at its own (the device's slowdown). Under
load the variants do not slow alike: on a 2-core host that also ran the cloud, an OpenVINO int8 variant
served at 4.8 times its benchmark, and the onnxruntime fp32 variant, priced by that slowdown at about 10 %
under the int8 one's energy, spent 30 % less per request when it served; an energy budget set then kept
the dearer variant until its own estimate went over the budget, 252 requests later.

So one request in `every`, the agent also runs one variant it is not serving with (round robin) once, on
a batch-1 input of zeros as its benchmark did, in a worker thread, and gives the controller's profile of
that variant the time and the energy of that run (`VariantProfile.observe_latency`/`observe_energy`):
after 8 such runs a variant's energy is its own figure at the load of now (`plan._inference_mj`). The
energy is modeled (the power profile's busy watts times the time) unless the agent measures energy: a
meter reads the whole device, not one run, so a side run then gives its time only. Modeled figures do
not move the controller to another variant on their own (`evidence.energy_evidence`); they set its
choice among variants as accurate, and that choice is taken when an energy budget is set.

The cost: one extra inference per `every` requests (2 % at the default 50), on a worker thread.

Example:
    >>> runs = SideRuns(every=50)
    >>> if runs.due(stats.requests):
    ...     runs.run_due(agent.variants, ctl, power, lock, stats.requests)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from edge_agent.variants import Variant, zero_feed
from runtimes.energy import PowerProfile

if TYPE_CHECKING:
    from edge_agent.controller import Controller

__all__ = ["SideRuns"]

logger = logging.getLogger(__name__)


class SideRuns:
    """When a side run is due, and which variant it times next."""

    def __init__(self, every: int) -> None:
        self.every = int(every)
        self._last = 0  # requests seen at the last side run
        self._turn = 0
        self._feeds: dict[str, dict[str, np.ndarray]] = {}  # each variant's batch-1 zeros, made once
        self.runs = 0

    def due(self, requests: int) -> int:
        """How many side runs `requests` (served so far) make due: one per `every` since the last; 0 with `every` 0."""
        return (requests - self._last) // self.every if self.every > 0 else 0

    def run_due(self, variants: Mapping[str, Variant], ctl: Controller, power: PowerProfile,
                lock: threading.Lock, requests: int, *, measured: bool = False) -> list[str]:
        """The side runs due after `requests` served, at most one per variant not serving (a burst served
        between two folds is not made up for later). Returns the variants timed."""
        due = self.due(requests)
        if due <= 0:
            return []
        self._last = requests
        timed = []
        for _ in range(min(due, len(ctl.profiles) - 1)):
            if (vid := self.run_one(variants, ctl, power, lock, measured=measured)) is not None:
                timed.append(vid)
        return timed

    def run_one(self, variants: Mapping[str, Variant], ctl: Controller, power: PowerProfile,
                lock: threading.Lock, *, measured: bool = False) -> str | None:
        """Time one variant other than the one serving (round robin) and hand its figures to the controller's
        profile of it, under `lock` (the controller's owner); with `measured`, the time only. Returns the
        variant timed, or None (one variant only, or its session closed meanwhile: a swap)."""
        serving = ctl.current.variant
        profiles = {p.id: p for p in ctl.profiles if p.id != serving and p.id in variants}
        if not profiles:
            return None
        profile = list(profiles.values())[self._turn % len(profiles)]
        self._turn += 1
        variant = variants[profile.id]
        try:
            feed = self._feeds.get(variant.id)
            if feed is None:
                feed = self._feeds[variant.id] = zero_feed(variant.session)
            started = time.perf_counter()
            variant.session.run(feed)
            ms = (time.perf_counter() - started) * 1e3
        except Exception as exc:  # closed by a swap, or a backend refusing a second caller: skip this turn
            logger.debug("side run of %s skipped: %s", variant.id, exc)
            return None
        with lock:
            profile.observe_latency(ms)
            if not measured:
                profile.observe_energy(power.busy_watts * ms, power.label)
        self.runs += 1
        return variant.id
