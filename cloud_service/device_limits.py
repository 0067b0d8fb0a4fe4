"""Per-device admission for the MQTT bridge: escalations in flight and a rate, per device id.

A replica's broker window (`receive_maximum`) is shared by every device; without a per-device bound
one device sending faster than the model answers holds the whole window and every other device
waits. A refusal is answered at once (RESOURCE_EXHAUSTED) and acknowledged, so it costs the window
nothing.
"""

from __future__ import annotations

import collections
import time
from typing import ClassVar

from runtimes.errors import InferenceError

_MAX_TRACKED = 100_000  # idle devices' buckets are forgotten past this many


class DeviceLimited(InferenceError):
    """One device is over its in-flight or rate limit. `reason` is the refusal counter's label."""

    grpc_status: ClassVar[str] = "RESOURCE_EXHAUSTED"

    def __init__(self, msg: str, *, reason: str) -> None:
        super().__init__(msg)
        self.reason = reason


class DeviceLimits:
    """In-flight count and a token bucket (`rate_per_s`, holding one second's worth) per device.

    Used from one event loop: no locking.
    """

    def __init__(self, max_inflight: int, rate_per_s: float) -> None:
        self.max_inflight, self.rate_per_s = max_inflight, rate_per_s
        self._inflight: dict[str, int] = {}
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def admit(self, device: str) -> None:
        """Take one slot for `device`, or raise DeviceLimited (nothing taken)."""
        inflight = self._inflight.get(device, 0)
        if inflight >= self.max_inflight:
            msg = (f"device {device[:64]!r} has {inflight} escalations being answered, the limit per device; "
                   "wait for replies before sending more")
            raise DeviceLimited(msg, reason="device_inflight")
        now = time.monotonic()
        tokens, last = self._buckets.pop(device, (self.rate_per_s, now))
        tokens = min(self.rate_per_s, tokens + (now - last) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[device] = (tokens, now)
            msg = (f"device {device[:64]!r} sends more than {self.rate_per_s:g} escalations per second, the "
                   "limit per device; slow down and retry")
            raise DeviceLimited(msg, reason="device_rate")
        self._buckets[device] = (tokens - 1.0, now)
        while len(self._buckets) > _MAX_TRACKED:
            self._buckets.popitem(last=False)
        self._inflight[device] = inflight + 1

    def release(self, device: str) -> None:
        left = self._inflight.get(device, 0) - 1
        if left > 0:
            self._inflight[device] = left
        else:
            self._inflight.pop(device, None)
