"""The telemetry store: per-window aggregates from devices, deduplicated, capped per day, rolled up.

One telemetry window (JSON, published by the agent on `tierkit/v1/{device}/telemetry`; its type and parser
are `cloud_service.protocol.fleet_docs.TelemetryWindow` / `parse_telemetry`):

```json
{"device": "dev-1a2b", "boot_id": "9f0c...", "seq": 17, "ts": 1763900000.0, "window_s": 60,
 "requests": 412, "tiers": {"edge": 350, "cloud": 62}, "p50_ms": 3.1, "p95_ms": 14.2,
 "latency_hist": {"bounds_ms": [1, 2, 5, 10, 20, 50, 100, 1000], "counts": [0, 40, 300, 50, 20, 2, 0, 0, 0]},
 "escalation_rate": 0.15, "agreement": 0.97, "energy_mj_per_request": 2.4, "energy_label": "modeled:cpu",
 "degraded": 3, "degraded_reasons": {"timeout": 3}, "variant": "int8", "threshold": 0.8,
 "model_digest": "sha256:...", "audited": 4, "audit_agreement": 1.0, "agreement_est": 0.95,
 "agreement_low": 0.91, "agreement_high": 0.99, "data_drift": false, "drift_events": 0}
```

`ingest` takes a batch of (topic device, payload, server time) and writes what it accepts in one
transaction. Every message that is not stored is counted under a reason in `ingest_drops`:
oversized, malformed, unknown (no such device), revoked, impersonating (the payload names
another device than its topic), replayed (same device, boot id and sequence: a redelivery),
capped (over the device's daily byte budget; also counted in `telemetry_usage.cut_*`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.bulk import Bulk
from cloud_service.fleet.store import FleetStore
from cloud_service.protocol.fleet_docs import TelemetryWindow, parse_telemetry
from runtimes.errors import ConfigError

MINUTES_KEPT_S = 32 * 86400.0  # per-minute sums stamp the bands of up to 31 days (the API's longest view)
DROP_REASONS = ("oversized", "malformed", "unknown", "revoked", "impersonating", "replayed", "capped")


@dataclass(frozen=True)
class TelemetryLimits:
    """Args: max_message_bytes: larger windows are dropped; daily_bytes: per device and UTC day;
    max_skew_s: device and server clocks further apart than this flag the window; retention_s: raw
    windows older than this are rolled up into hourly rows."""

    max_message_bytes: int = 16 * 1024
    daily_bytes: int = 2 * 1024 * 1024
    max_skew_s: float = 60.0
    retention_s: float = 7 * 86400.0


def stored_window(text: str | bytes | None) -> TelemetryWindow | None:
    """A stored window's document (ingest parsed it); None when an older fleet stored one that no longer parses."""
    try:
        return None if text is None else parse_telemetry(text)
    except ConfigError:
        return None


@dataclass
class IngestResult:
    stored: int = 0
    dropped: Counter[str] = field(default_factory=Counter)


def _key(row: dict[str, Any]) -> tuple[str, str, int]:
    return row["device_id"], row["boot_id"], row["seq"]


_DayKey = tuple[str, int]


def _day(row: dict[str, Any]) -> _DayKey:
    """The byte cap's key: device and UTC day of the server's clock."""
    return row["device_id"], int(row["server_ts"] // 86400)


def _agreement(old: Any, rows: list[Any]) -> dict[str, Any]:
    """The roll-up's agreement: windows that carry one, weighted by their escalations (requests x rate)."""
    w0 = float(old.agreement_weight) if old is not None and old.agreement is not None else 0.0
    total = w0 * (old.agreement if w0 else 0.0)
    weight = w0
    for r in rows:
        if r.agreement is not None:
            w = r.requests * r.escalation_rate or 1.0
            total += r.agreement * w
            weight += w
    return {"agreement": total / weight if weight else None, "agreement_weight": weight}


def _hourly(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored windows as sums per device and hour (`telemetry_hourly`)."""
    acc: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["device_id"], int(r["server_ts"] // 3600 * 3600))
        h = acc.setdefault(key, {"device_id": key[0], "hour": key[1], "windows": 0, "requests": 0, "p95_sum": 0.0,
                                 "escalations": 0.0, "energy_mj": 0.0, "degraded": 0, "agreement_sum": 0.0,
                                 "agreement_weight": 0.0})
        n = int(r["requests"])
        h["windows"] += 1
        h["requests"] += n
        h["p95_sum"] += float(r["p95_ms"])
        h["escalations"] += n * float(r["escalation_rate"])
        h["energy_mj"] += n * float(r["energy_mj_per_request"])
        h["degraded"] += int(r["degraded"])
        if r["agreement"] is not None:
            w = n * float(r["escalation_rate"]) or 1.0
            h["agreement_sum"] += w * float(r["agreement"])
            h["agreement_weight"] += w
    return list(acc.values())


def _minutes(rows: list[dict[str, Any]], refused: dict[tuple[str, str, int], int]) -> list[dict[str, Any]]:
    """Stored windows as fleet-wide sums per minute of server time (`telemetry_minutes`)."""
    acc: dict[int, dict[str, Any]] = {}
    for r in rows:
        minute = int(r["server_ts"] // 60 * 60)
        m = acc.setdefault(minute, {"minute": minute, "windows": 0, "requests": 0, "escalations": 0.0,
                                    "cloud_refused": 0})
        m["windows"] += 1
        m["requests"] += int(r["requests"])
        m["escalations"] += int(r["requests"]) * float(r["escalation_rate"])
        m["cloud_refused"] += refused.get(_key(r), 0)
    return list(acc.values())


class TelemetryStore:
    """Ingest, query and roll up telemetry windows over a `FleetStore`."""

    def __init__(self, store: FleetStore, limits: TelemetryLimits | None = None) -> None:
        self.store, self.limits = store, limits or TelemetryLimits()
        self.bulk = Bulk(store)

    def ingest(self, batch: list[tuple[str, bytes, float]]) -> IngestResult:
        """Validate, deduplicate, cap and store a batch in one transaction (a fixed number of statements)."""
        res = IngestResult()
        parsed = self._parse(batch, res)
        cap, key = self.limits.daily_bytes, ("device_id", "boot_id", "seq")
        with self.store.begin() as conn:
            names = sorted({w.device for w, *_ in parsed})
            status = {r.device_id: r.revoked_at for r in conn.execute(
                sa.select(t.devices.c.device_id, t.devices.c.revoked_at).where(
                    self.bulk.any_of(t.devices.c.device_id, names)))}
            days = sorted({int(ts // 86400) for _w, _n, ts, _d in parsed})
            usage = {(r.device_id, r.day): r.bytes for r in conn.execute(sa.select(t.telemetry_usage).where(
                self.bulk.any_of(t.telemetry_usage.c.device_id, names),
                self.bulk.any_of(t.telemetry_usage.c.day, days)))}
            rows: list[dict[str, Any]] = []
            refused: dict[tuple[str, str, int], int] = {}
            in_batch: set[tuple[Any, ...]] = set()
            for win, size, server_ts, text in parsed:
                if win.device not in status:
                    res.dropped["unknown"] += 1
                elif status[win.device] is not None:
                    res.dropped["revoked"] += 1
                elif (win.device, win.boot_id, win.seq) in in_batch:
                    res.dropped["replayed"] += 1  # the same window twice in one batch
                else:
                    in_batch.add((win.device, win.boot_id, win.seq))
                    rows.append(self._row(win, size, server_ts, text))
                    refused[(win.device, win.boot_id, win.seq)] = win.cloud_refused
            # A window that cannot fit under the cap whatever else is new only needs telling replayed from
            # capped; the others are inserted where not stored yet (the unique key decides, also against
            # another fleet process), then those that the cap cuts are taken back out (the batch crossed it).
            over = [r for r in rows if usage.get(_day(r), 0) + r["bytes"] > cap]
            over_keys = {_key(r) for r in over}
            tried = [r for r in rows if _key(r) not in over_keys]
            fresh = self.bulk.insert_new(conn, t.telemetry, tried, key)
            fresh |= over_keys - self.bulk.existing(conn, t.telemetry, sorted(over_keys), key)
            # replays first, so that a redelivered window is never counted against the byte cap
            accepted, cut, cut_bytes = Counter[_DayKey](), Counter[_DayKey](), Counter[_DayKey]()
            take_back: list[tuple[Any, ...]] = []
            kept: list[dict[str, Any]] = []
            last_seen: dict[str, float] = {}
            for r in rows:
                k, day = _key(r), _day(r)
                if k not in fresh:
                    res.dropped["replayed"] += 1
                elif usage.get(day, 0) + r["bytes"] > cap:
                    res.dropped["capped"] += 1
                    cut[day] += 1
                    cut_bytes[day] += r["bytes"]
                    if k not in over_keys:
                        take_back.append(k)
                else:
                    usage[day] = usage.get(day, 0) + r["bytes"]
                    accepted[day] += r["bytes"]
                    res.stored += 1
                    kept.append(r)
                    last_seen[r["device_id"]] = max(last_seen.get(r["device_id"], 0.0), r["server_ts"])
            self.bulk.delete(conn, t.telemetry, take_back, key)
            self.bulk.add_counts(conn, t.telemetry_usage, [
                {"device_id": d, "day": day, "bytes": accepted[(d, day)], "cut_windows": cut[(d, day)],
                 "cut_bytes": cut_bytes[(d, day)]} for d, day in set(accepted) | set(cut)], ("device_id", "day"))
            self.bulk.raise_to(conn, t.devices, "device_id", "last_seen", last_seen)
            self.bulk.add_counts(conn, t.telemetry_hourly, _hourly(kept), ("device_id", "hour"))
            self.bulk.add_counts(conn, t.telemetry_minutes, _minutes(kept, refused), ("minute",))
            self.count_drops(conn, res.dropped)
        return res

    def _parse(self, batch: list[tuple[str, bytes, float]],
               res: IngestResult) -> list[tuple[TelemetryWindow, int, float, str]]:
        parsed: list[tuple[TelemetryWindow, int, float, str]] = []
        for device, payload, server_ts in batch:
            if len(payload) > self.limits.max_message_bytes:
                res.dropped["oversized"] += 1
                continue
            try:  # the parser refuses NUL in text too: no database text column holds one
                win = parse_telemetry(payload)
            except ConfigError:
                res.dropped["malformed"] += 1
                continue
            if win.device != device:
                res.dropped["impersonating"] += 1
                continue
            parsed.append((win, len(payload), server_ts, payload.decode()))
        return parsed

    def _row(self, w: TelemetryWindow, size: int, server_ts: float, text: str) -> dict[str, Any]:
        return {"device_id": w.device, "boot_id": w.boot_id, "seq": w.seq, "device_ts": w.ts, "server_ts": server_ts,
                "skewed": abs(w.ts - server_ts) > self.limits.max_skew_s, "window_s": w.window_s,
                "requests": w.requests, "p50_ms": w.p50_ms, "p95_ms": w.p95_ms,
                "escalation_rate": w.escalation_rate, "agreement": w.agreement,
                "energy_mj_per_request": w.energy_mj_per_request, "energy_label": w.energy_label,
                "degraded": w.degraded, "variant": w.variant, "threshold": w.threshold, "bytes": size,
                "document": text}

    def count_drops(self, conn: Any, dropped: Counter[str]) -> None:
        self.bulk.add_counts(conn, t.ingest_drops, [{"reason": k, "count": v} for k, v in dropped.items() if v],
                             ("reason",))

    # -- queries -------------------------------------------------------------------------------

    def data_drift(self, devices: list[str] | None = None) -> dict[str, bool]:
        """Whether each device's latest window flags a data-drift event (devices without windows: absent).

        One probe of the (device, server time) index per device: a device's older windows are never read."""
        c, d = t.telemetry.c, t.devices.c
        latest = (sa.select(c.id).where(c.device_id == d.device_id).order_by(c.server_ts.desc(), c.id.desc())
                  .limit(1).correlate(t.devices).scalar_subquery())
        query = sa.select(c.device_id, c.document).select_from(t.devices.join(t.telemetry, c.id == latest))
        if devices is not None:
            query = query.where(d.device_id.in_(devices))
        with self.store.begin() as conn:
            rows = conn.execute(query).all()
        return {r.device_id: (w := stored_window(r.document)) is not None and w.data_drift for r in rows}

    def drops(self) -> dict[str, int]:
        with self.store.begin() as conn:
            got = {r.reason: int(r.count) for r in conn.execute(sa.select(t.ingest_drops))}
        return {k: got.get(k, 0) for k in DROP_REASONS}

    def usage(self, device_id: str) -> list[dict[str, Any]]:
        with self.store.begin() as conn:
            rows = conn.execute(sa.select(t.telemetry_usage).where(t.telemetry_usage.c.device_id == device_id)
                                .order_by(t.telemetry_usage.c.day)).all()
        return [dict(r._mapping) for r in rows]

    def windows(self, devices: list[str] | None = None, *, since: float = 0.0, until: float = math.inf,
                limit: int = 10_000) -> list[dict[str, Any]]:
        """Raw windows by device list (None: all) and server time, oldest first."""
        c = t.telemetry.c
        q = sa.select(t.telemetry).where(c.server_ts >= since)
        if math.isfinite(until):
            q = q.where(c.server_ts < until)
        if devices is not None:
            q = q.where(c.device_id.in_(devices))
        with self.store.begin() as conn:
            rows = conn.execute(q.order_by(c.server_ts, c.id).limit(limit)).all()
        return [{k: v for k, v in r._mapping.items() if k != "document"} for r in rows]

    def cloud_load(self, *, since: float) -> dict[str, Any]:
        """Escalations and the cloud's refusals of them in the windows received since `since` (from the minute
        `since` falls in: the per-minute sums ingest keeps, a few rows whatever the fleet's size)."""
        m = t.telemetry_minutes.c
        with self.store.begin() as conn:
            windows, requests, escalations, refused = conn.execute(sa.select(
                sa.func.coalesce(sa.func.sum(m.windows), 0), sa.func.coalesce(sa.func.sum(m.requests), 0),
                sa.func.coalesce(sa.func.sum(m.escalations), 0.0), sa.func.coalesce(sa.func.sum(m.cloud_refused), 0))
                .where(m.minute >= int(since // 60 * 60))).one()
        requests, escalations, refused = float(requests), float(escalations), float(refused)
        return {"since": since, "windows": int(windows), "requests": int(requests), "escalations": round(escalations),
                "escalation_rate": escalations / requests if requests else None, "cloud_refused": int(refused),
                "refused_share": refused / escalations if escalations else None}

    def rollups(self, devices: list[str] | None = None, *, since: float = 0.0) -> list[dict[str, Any]]:
        c = t.telemetry_rollup.c
        q = sa.select(t.telemetry_rollup).where(c.hour >= int(since // 3600 * 3600))
        if devices is not None:
            q = q.where(c.device_id.in_(devices))
        with self.store.begin() as conn:
            return [dict(r._mapping) for r in conn.execute(q.order_by(c.hour, c.device_id))]

    def roll_up(self, *, now: float | None = None, batch: int = 50_000) -> int:
        """Fold raw windows older than the retention into hourly rows and delete them. Returns windows folded."""
        now = time.time() if now is None else now
        cutoff = now - self.limits.retention_s
        c = t.telemetry.c
        with self.store.begin() as conn:
            conn.execute(t.telemetry_minutes.delete().where(t.telemetry_minutes.c.minute < now - MINUTES_KEPT_S))
            rows = conn.execute(sa.select(c.id, c.device_id, c.server_ts, c.requests, c.p95_ms, c.escalation_rate,
                                          c.energy_mj_per_request, c.degraded, c.agreement)
                                .where(c.server_ts < cutoff).order_by(c.id).limit(batch)).all()
            if not rows:
                return 0
            acc: dict[tuple[str, int], list[Any]] = {}
            for r in rows:
                acc.setdefault((r.device_id, int(r.server_ts // 3600 * 3600)), []).append(r)
            existing = {(r.device_id, r.hour): r for r in conn.execute(sa.select(t.telemetry_rollup).where(
                t.telemetry_rollup.c.device_id.in_({d for d, _ in acc})))}
            for (device, hour), rs in sorted(acc.items()):
                old = existing.get((device, hour))
                n0 = old.windows if old else 0
                req0 = old.requests if old else 0
                req = req0 + sum(r.requests for r in rs)
                wsum = max(req, 1)
                values = {
                    "windows": n0 + len(rs), "requests": req,
                    "p95_ms_max": max([r.p95_ms for r in rs] + ([old.p95_ms_max] if old else [])),
                    "p95_ms_mean": ((old.p95_ms_mean * n0 if old else 0.0)
                                    + sum(r.p95_ms for r in rs)) / (n0 + len(rs)),
                    "escalation_rate": ((old.escalation_rate * req0 if old else 0.0)
                                        + sum(r.escalation_rate * r.requests for r in rs)) / wsum,
                    "energy_mj_per_request": ((old.energy_mj_per_request * req0 if old else 0.0)
                                              + sum(r.energy_mj_per_request * r.requests for r in rs)) / wsum,
                    "degraded": (old.degraded if old else 0) + sum(r.degraded for r in rs),
                    **_agreement(old, rs)}
                if old:
                    conn.execute(t.telemetry_rollup.update().where(t.telemetry_rollup.c.device_id == device,
                                                                   t.telemetry_rollup.c.hour == hour).values(**values))
                else:
                    conn.execute(t.telemetry_rollup.insert().values(device_id=device, hour=hour, **values))
            conn.execute(t.telemetry.delete().where(c.id.in_([r.id for r in rows])))
        return len(rows)
