"""Per-caller admission over gRPC: a caller that calls again inside its retry hint is refused first.

A refusal carries a retry hint (`admission.RetryHints`) sized so that the refused callers, together,
come back at about half the model's capacity. A caller that ignores it (a naive retry loop, a hostile
client) calls again at once and, polling faster than the honest callers who wait, takes the room the
queue has each time a batch ends: honest callers' goodput falls to a fraction of their share.
`HintLedger` remembers, per caller, until when its last hint asked it to wait; a call inside that
window is refused at once (RESOURCE_EXHAUSTED, the rest of the window as its hint), before the model is
looked up or the request decoded, and without counting toward the model's refusal pressure (so it does
not lengthen the honest callers' hints either). Once its window has passed the caller is admitted as
anyone else: each caller is admitted at most once a hint, whatever rate it sends at.

The caller's identity (`caller_id`) is the device id the agent sends (`tierkit.device_id` request
parameter), else a `tierkit-device-id` metadata entry. A call with neither is not tracked: the peer's
address is no identity here, since one connection often carries many callers' calls in flight at once
(a gateway, a client library's concurrent requests), and one refusal must not refuse the calls that were
already on their way beside it. An identity is the caller's claim, not authenticated: a client rotating
ids escapes the ledger, which bounds a misbehaving retry loop, not an attacker (that needs the broker's
or mTLS's identity in front).

Example:
    >>> ledger = HintLedger()
    >>> ledger.refused("device-7", hint_ms=200, now=10.0)
    >>> ledger.early("device-7", now=10.05)  # called again 50 ms into a 200 ms hint: ms left to wait
    150
    >>> ledger.early("device-7", now=10.25) is None  # waited the hint out
    True
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Sequence
from typing import Any

from cloud_service.errors import ServerBusy
from cloud_service.protocol import topics

DEVICE_METADATA_KEY = "tierkit-device-id"
_GRACE = 0.95  # a call after this share of the hint counts as waiting it out (an honest caller waits the whole
# hint from when it got the refusal, after the server gave it: the rest is rounding)
_MAX_TRACKED = 100_000  # callers remembered at most; the oldest windows are forgotten first


class HintIgnored(ServerBusy):
    """The caller called again before its retry hint had passed: refused without looking at the model."""


class HintLedger:
    """Per caller, until when its last refusal's hint asked it to wait. Thread-safe (gRPC's pool threads)."""

    def __init__(self, *, grace: float = _GRACE, max_tracked: int = _MAX_TRACKED) -> None:
        if not 0 < grace <= 1:
            msg = f"HintLedger: grace must be in (0, 1] (the share of a hint a caller must wait), got {grace!r}"
            raise ValueError(msg)
        self.grace = grace
        self.max_tracked = max_tracked
        self._until: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()  # (grace, end)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._until)

    def refused(self, caller: str, hint_ms: int, now: float) -> None:
        """`caller` was refused at `now` (monotonic seconds) with a hint of `hint_ms`."""
        with self._lock:
            self._until.pop(caller, None)
            self._until[caller] = (now + self.grace * hint_ms / 1000, now + hint_ms / 1000)
            while len(self._until) > self.max_tracked:
                self._until.popitem(last=False)

    def early(self, caller: str, now: float) -> int | None:
        """The ms left of `caller`'s hint at `now` when it called inside it (past the grace), or None (admit it)."""
        with self._lock:
            window = self._until.get(caller)
            if window is None:
                return None
            if now >= window[0]:
                del self._until[caller]
                return None
        return max(1, math.ceil((window[1] - now) * 1000))

    def refusal(self, caller: str, now: float) -> HintIgnored | None:
        """The refusal of an early call (its hint: the rest of the window), or None."""
        left_ms = self.early(caller, now)
        if left_ms is None:
            return None
        msg = (f"called again {left_ms} ms before the previous refusal's retry hint ends; not looked at. "
               "Wait the hinted delay (grpc-retry-pushback-ms / retry-after-ms) before retrying")
        return HintIgnored(msg, retry_after_ms=left_ms)


def caller_id(parameters: Any, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """Who is calling: the request's `tierkit.device_id` parameter, else the `tierkit-device-id` metadata
    entry, else None (not tracked)."""
    if topics.PARAM_DEVICE in parameters:
        device = str(parameters[topics.PARAM_DEVICE].string_param)
        if device:
            return "device:" + device[:128]
    for key, value in metadata or ():
        if key == DEVICE_METADATA_KEY and value:
            return "device:" + str(value)[:128]
    return None
