"""Per-caller admission over gRPC: a caller that calls again inside its retry hint is refused first.

A refusal carries a retry hint (`admission.RetryHints`) sized so that the refused callers, together,
come back at about a tenth of the model's capacity. A caller that ignores it (a naive retry loop, a hostile
client) calls again at once and, polling faster than the honest callers who wait, takes the room the
queue has each time a batch ends: honest callers' goodput falls to a fraction of their share.
`HintLedger` remembers, per caller, until when its last hint asked it to wait; a call inside that
window is refused at once (RESOURCE_EXHAUSTED, the rest of the window as its hint), before the model is
looked up or the request decoded, and without counting toward the model's refusal pressure (so it does
not lengthen the honest callers' hints either). Once its window has passed the caller is admitted as
anyone else: each caller is admitted at most once a hint, whatever rate it sends at.

A caller that calls inside its window also has the window lengthened, once, by a quarter of its hint
(`EARLY_PENALTY`). Without it a poller still won a race each hint: it was there the moment its window
ended, while an honest caller refused at the same moment came back the refusal's way to it and the call's
way back later (tens of ms on a loaded host: several batches of a small model), to find the room a batch
freed taken. Measured (`tests/cloud_service/test_overload.py`, six honest beside six hostile callers on
2 loaded cores): the honest half's share of the answers was 0.20-0.66 (median 0.4) without the
lengthening; with it the poller comes back after the honest callers refused beside it.

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
    >>> ledger.early("device-7", now=10.05)  # called again 50 ms into a 200 ms hint: lengthened by 50 ms
    200
    >>> ledger.early("device-7", now=10.125)  # calling inside it again lengthens it no more
    125
    >>> ledger.early("device-7", now=10.26) is None  # waited the (lengthened) hint out
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
# A call after this share of the hint counts as waiting it out. The whole hint: an honest caller waits it from
# when it got the refusal, which the server gave (and recorded) before, so it never comes back sooner, and
# the hint it waits is the very number of ms recorded here. A share below 1 let a caller polling through its
# hint in ahead of every honest caller refused at the same moment (5 % of a 1 s hint is 50 ms, several
# batches): the room a batch freed went to the poller, and the honest caller was refused again.
_GRACE = 1.0
EARLY_PENALTY = 0.25  # a caller calling inside its hint has it lengthened, once, by this share of it
_MAX_TRACKED = 100_000  # callers remembered at most; the oldest windows are forgotten first


class HintIgnored(ServerBusy):
    """The caller called again before its retry hint had passed: refused without looking at the model."""


class HintLedger:
    """Per caller, until when its last refusal's hint asked it to wait. Thread-safe (gRPC's pool threads)."""

    def __init__(self, *, grace: float = _GRACE, penalty: float = EARLY_PENALTY,
                 max_tracked: int = _MAX_TRACKED) -> None:
        if not 0 < grace <= 1 or penalty < 0:
            msg = (f"HintLedger: grace must be in (0, 1] (the share of a hint a caller must wait) and penalty >= 0 "
                   f"(the share of a hint added for calling inside it), got grace={grace!r}, penalty={penalty!r}")
            raise ValueError(msg)
        self.grace = grace
        self.penalty = penalty
        self.max_tracked = max_tracked
        # caller -> (admitted from, hint ends, lengthening still to add on an early call)
        self._until: collections.OrderedDict[str, tuple[float, float, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._until)

    def refused(self, caller: str, hint_ms: int, now: float) -> None:
        """`caller` was refused at `now` (monotonic seconds) with a hint of `hint_ms`."""
        with self._lock:
            self._until.pop(caller, None)
            self._until[caller] = (now + self.grace * hint_ms / 1000, now + hint_ms / 1000,
                                   self.penalty * hint_ms / 1000)
            while len(self._until) > self.max_tracked:
                self._until.popitem(last=False)

    def early(self, caller: str, now: float) -> int | None:
        """The ms left of `caller`'s hint at `now` when it called inside it (its first such call lengthens it
        by `penalty` of the hint), or None (admit it)."""
        with self._lock:
            window = self._until.get(caller)
            if window is None:
                return None
            admit_at, end, extra = window
            if now >= admit_at:
                del self._until[caller]
                return None
            if extra:
                self._until[caller] = (admit_at + extra, end + extra, 0.0)
                end += extra
        return max(1, math.ceil((end - now) * 1000))

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
