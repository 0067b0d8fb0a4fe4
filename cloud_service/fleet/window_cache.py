"""The telemetry windows the rollout engine reads, kept from one step to the next.

A step reads every window of a wave's devices and of its control (at most `control_max` devices) over the
evidence's baseline (an hour by default) and the request-rate lookback: 200 devices with a window each 10 s are
72,000 windows. Read from the database, parsed and judged anew every second, a step took 3-4 s on a 2-core
host (bench/RESULTS.md), longer than the second between steps. Here each window is read and parsed once:

- per device, the cache holds every window from `since` on, complete up to `upto`: `SETTLE_S` before the newest
  window the read that filled it saw (or before its clock, if earlier); a later read asks only for the windows
  past that mark (`server_ts > upto`) and adds those it does not hold (by id). The mark trails by `SETTLE_S`
  because a window's `server_ts` is stamped when the fleet receives it, before its batch commits: a window
  committed late is still read. It follows the stamps, not the engine's clock, so an engine process whose
  clock runs ahead of the ingesting one's does not move the mark past windows not yet committed;
- a read for an earlier `since` than the cache holds reads that device whole again;
- `end_step()` drops what the step did not read: devices not asked for, windows older than any `since` asked;
- each window is one dict for as long as it is held, so `memo` (the gates' `ObsMemo`) reads each window's
  observation once, and a caller may keep lists of windows between steps (a wave's baseline, `RolloutEngine`).

The windows a read returns are those a fresh query returns (one device after another); the
dicts are shared: callers must not change them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.gates import ObsMemo, window_counts
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import stored_window

SETTLE_S = 15.0  # assumed bound from a window's server_ts to its batch's commit (a batch waits 0.05 s to fill,
# `IngestOptions.batch_wait_s`; the rest is the store's write: a margin, not a measured tail)
PARSE_CHUNK = 2000  # window documents fetched per query (an IN list well under any database's limit)


class _Held:
    """One device's windows: by id, in the order read (a late commit after newer ones); complete from `since` to
    `upto` (server time)."""

    __slots__ = ("rows", "since", "upto")

    def __init__(self, since: float) -> None:
        self.rows: dict[int, dict[str, Any]] = {}
        self.since = since
        self.upto = since


class WindowCache:
    """Args: store: the fleet database."""

    def __init__(self, store: FleetStore) -> None:
        self.store = store
        self.memo = ObsMemo()
        self._held: dict[str, _Held] = {}
        self._asked: dict[str, float] = {}  # device -> the earliest `since` asked of it this step

    def windows(self, devices: Iterable[str], since: float, *, now: float) -> list[dict[str, Any]]:
        """The devices' windows with `server_ts >= since`, each with what its document adds (release, crashes,
        counts: `gates.window_counts`). `now`: the engine's clock (that of the windows' `server_ts`)."""
        devices = list(dict.fromkeys(devices))
        for d in devices:
            self._asked[d] = min(self._asked.get(d, since), since)
        whole = [d for d in devices if d not in self._held or self._held[d].since > since]
        for d in whole:
            if d in self._held:
                self.memo.forget(self._held[d].rows.values())
            self._held[d] = _Held(since)
        self._read(whole, since, now)
        if (held := [d for d in devices if d not in whole]):
            self._read(held, min(self._held[d].upto for d in held), now, strictly_after=True)
        out = []
        for d in devices:
            out += [w for w in self._held[d].rows.values() if w["server_ts"] >= since]
        return out

    def _read(self, devices: list[str], since: float, now: float, *, strictly_after: bool = False) -> None:
        if not devices:
            return
        c = t.telemetry.c
        newest = -math.inf
        when = c.server_ts > since if strictly_after else c.server_ts >= since
        with self.store.begin() as conn:
            fresh = []
            for k in range(0, len(devices), PARSE_CHUNK):
                for r in conn.execute(sa.select(c.id, c.device_id, c.server_ts, c.window_s, c.requests, c.p95_ms,
                                                c.escalation_rate, c.agreement, c.degraded, c.energy_mj_per_request)
                                      .where(c.device_id.in_(devices[k:k + PARSE_CHUNK]), when).order_by(c.id)):
                    newest = max(newest, float(r.server_ts))
                    if int(r.id) not in self._held[r.device_id].rows:
                        fresh.append(r)
            docs: dict[int, str] = {}
            ids = [int(r.id) for r in fresh]
            for k in range(0, len(ids), PARSE_CHUNK):
                docs.update((int(r.id), r.document) for r in conn.execute(
                    sa.select(c.id, c.document).where(c.id.in_(ids[k:k + PARSE_CHUNK]))))
        for r in fresh:
            w = dict(r._mapping)
            wid = int(w.pop("id"))
            w["server_ts"] = float(w["server_ts"])
            doc = stored_window(docs.get(wid))
            w.update(release=doc.release if doc is not None else None, crashes=doc.crashes if doc is not None else 0,
                     **window_counts(doc))
            self._held[w["device_id"]].rows[wid] = w
        # complete up to SETTLE_S before the newest window seen (by the fleet's clock, which stamped it, not the
        # engine's: several fleet processes on one database may disagree by seconds), or the clock if earlier
        upto = max(since, min(now, newest) - SETTLE_S)
        for d in devices:
            self._held[d].upto = max(self._held[d].upto, upto)

    def end_step(self) -> None:
        """Keep what this step read (the next one reads it again), drop the rest, and the memo's entries with it."""
        dropped: list[dict[str, Any]] = []
        for d in [d for d in self._held if d not in self._asked]:
            dropped += self._held.pop(d).rows.values()
        for d, since in self._asked.items():
            h = self._held.get(d)
            if h is not None and since > h.since:
                dropped += [w for w in h.rows.values() if w["server_ts"] < since]
                h.rows = {i: w for i, w in h.rows.items() if w["server_ts"] >= since}
                h.since = since
        self._asked = {}
        self.memo.forget(dropped)
