"""The telemetry store: per-window aggregates from devices, deduplicated, capped per day, rolled up.

One telemetry window (JSON, published by the agent on `tierkit/v1/{device}/telemetry`):

```json
{"device": "dev-1a2b", "boot_id": "9f0c...", "seq": 17, "ts": 1763900000.0, "window_s": 60,
 "requests": 412, "tiers": {"edge": 350, "cloud": 62}, "p50_ms": 3.1, "p95_ms": 14.2,
 "latency_hist": {"bounds_ms": [1, 2, 5, 10, 20, 50, 100, 1000], "counts": [0, 40, 300, 50, 20, 2, 0, 0, 0]},
 "escalation_rate": 0.15, "agreement": 0.97, "energy_mj_per_request": 2.4, "energy_label": "modeled:cpu",
 "degraded": 3, "degraded_reasons": {"cloud_timeout": 3}, "variant": "int8", "threshold": 0.8,
 "model_digest": "sha256:..."}
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
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cloud_service.fleet import schema as t
from cloud_service.fleet.store import FleetStore

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


class _Window(BaseModel):
    model_config = ConfigDict(extra="allow")
    device: str = Field(min_length=1, max_length=128)
    boot_id: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0, lt=2**62)
    ts: float = Field(allow_inf_nan=False)
    window_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    requests: int = Field(default=0, ge=0)
    p50_ms: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    p95_ms: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    escalation_rate: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)
    agreement: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    energy_mj_per_request: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    energy_label: str = Field(default="", max_length=64)
    degraded: int = Field(default=0, ge=0)
    variant: str = Field(default="", max_length=128)
    threshold: float | None = Field(default=None, allow_inf_nan=False)


@dataclass
class IngestResult:
    stored: int = 0
    dropped: Counter[str] = field(default_factory=Counter)


def _upsert(store: FleetStore, table: sa.Table) -> Any:
    from sqlalchemy.dialects import postgresql, sqlite

    return postgresql.insert(table) if store.dialect == "postgresql" else sqlite.insert(table)


class TelemetryStore:
    """Ingest, query and roll up telemetry windows over a `FleetStore`."""

    def __init__(self, store: FleetStore, limits: TelemetryLimits | None = None) -> None:
        self.store, self.limits = store, limits or TelemetryLimits()

    def ingest(self, batch: list[tuple[str, bytes, float]]) -> IngestResult:
        """Validate, deduplicate, cap and store a batch in one transaction."""
        res = IngestResult()
        parsed: list[tuple[_Window, int, float, str]] = []
        for device, payload, server_ts in batch:
            if len(payload) > self.limits.max_message_bytes:
                res.dropped["oversized"] += 1
                continue
            try:
                win = _Window.model_validate_json(payload)
            except ValidationError:
                res.dropped["malformed"] += 1
                continue
            if win.device != device:
                res.dropped["impersonating"] += 1
                continue
            parsed.append((win, len(payload), server_ts, payload.decode()))
        with self.store.begin() as conn:
            names = sorted({w.device for w, *_ in parsed})
            status = {r.device_id: r.revoked_at for r in conn.execute(
                sa.select(t.devices.c.device_id, t.devices.c.revoked_at).where(self._in(t.devices.c.device_id, names)))}
            days = sorted({int(ts // 86400) for _w, _n, ts, _d in parsed})
            usage = {(r.device_id, r.day): r.bytes for r in conn.execute(sa.select(t.telemetry_usage).where(
                self._in(t.telemetry_usage.c.device_id, names), self._in(t.telemetry_usage.c.day, days)))}
            # replays first, so that a redelivered window is never counted against the byte cap
            c = t.telemetry.c
            seen = {(r.device_id, r.boot_id, r.seq) for r in conn.execute(
                sa.select(c.device_id, c.boot_id, c.seq).where(
                    self._in(c.device_id, names), self._in(c.seq, sorted({w.seq for w, *_ in parsed}))))}
            rows, sizes, cut = [], {}, Counter[tuple[str, int]]()
            cut_bytes = Counter[tuple[str, int]]()
            for win, size, server_ts, text in parsed:
                if win.device not in status:
                    res.dropped["unknown"] += 1
                    continue
                if status[win.device] is not None:
                    res.dropped["revoked"] += 1
                    continue
                wkey = (win.device, win.boot_id, win.seq)
                if wkey in seen:
                    res.dropped["replayed"] += 1
                    continue
                seen.add(wkey)
                key = (win.device, int(server_ts // 86400))
                if usage.get(key, 0) + size > self.limits.daily_bytes:
                    res.dropped["capped"] += 1
                    cut[key] += 1
                    cut_bytes[key] += size
                    continue
                usage[key] = usage.get(key, 0) + size
                rows.append(self._row(win, size, server_ts, text))
                sizes[wkey] = (key, size)
            if rows:
                # replays were filtered above; ON CONFLICT only guards a race with another fleet process
                # inserting the same window at the same moment (then the counters may overstate by that window)
                stmt = _upsert(self.store, t.telemetry).on_conflict_do_nothing(
                    index_elements=["device_id", "boot_id", "seq"])
                conn.execute(stmt, rows)
            res.stored = len(rows)
            accepted = Counter[tuple[str, int]]()
            for k, size in sizes.values():
                accepted[k] += size
            self._add_usage(conn, accepted, cut, cut_bytes)
            last_seen: dict[str, float] = {}
            for r in rows:
                last_seen[r["device_id"]] = max(last_seen.get(r["device_id"], 0.0), r["server_ts"])
            if last_seen:
                # executemany of one cached statement: psycopg pipelines it; a multi-row VALUES statement
                # would be recompiled for every batch (measured slower, bench/bench_fleet.py)
                conn.execute(t.devices.update().where(t.devices.c.device_id == sa.bindparam("d"))
                             .values(last_seen=sa.bindparam("ls")),
                             [{"d": d, "ls": ts} for d, ts in last_seen.items()])
            self.count_drops(conn, res.dropped)
        return res

    def _in(self, col: Any, values: list[Any]) -> Any:
        """`col IN values`; on PostgreSQL `col = ANY(array)`: one parameter instead of one per value."""
        if self.store.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import ARRAY

            return col == sa.any_(sa.bindparam(None, values, type_=ARRAY(col.type)))
        return col.in_(values)

    def _row(self, w: _Window, size: int, server_ts: float, text: str) -> dict[str, Any]:
        return {"device_id": w.device, "boot_id": w.boot_id, "seq": w.seq, "device_ts": w.ts, "server_ts": server_ts,
                "skewed": abs(w.ts - server_ts) > self.limits.max_skew_s, "window_s": w.window_s,
                "requests": w.requests, "p50_ms": w.p50_ms, "p95_ms": w.p95_ms,
                "escalation_rate": w.escalation_rate, "agreement": w.agreement,
                "energy_mj_per_request": w.energy_mj_per_request, "energy_label": w.energy_label,
                "degraded": w.degraded, "variant": w.variant, "threshold": w.threshold, "bytes": size,
                "document": text}

    def _add_usage(self, conn: Any, accepted: Counter[tuple[str, int]], cut: Counter[tuple[str, int]],
                   cut_bytes: Counter[tuple[str, int]]) -> None:
        keys = set(accepted) | set(cut)
        if not keys:
            return
        u = t.telemetry_usage
        stmt = _upsert(self.store, u)
        stmt = stmt.on_conflict_do_update(index_elements=["device_id", "day"], set_={
            "bytes": u.c.bytes + stmt.excluded.bytes, "cut_windows": u.c.cut_windows + stmt.excluded.cut_windows,
            "cut_bytes": u.c.cut_bytes + stmt.excluded.cut_bytes})
        conn.execute(stmt, [{"device_id": d, "day": day, "bytes": accepted[(d, day)],
                             "cut_windows": cut[(d, day)], "cut_bytes": cut_bytes[(d, day)]}
                            for d, day in sorted(keys)])

    def count_drops(self, conn: Any, dropped: Counter[str]) -> None:
        if not +dropped:
            return
        stmt = _upsert(self.store, t.ingest_drops)
        stmt = stmt.on_conflict_do_update(index_elements=["reason"],
                                          set_={"count": t.ingest_drops.c.count + stmt.excluded.count})
        conn.execute(stmt, [{"reason": k, "count": v} for k, v in sorted(dropped.items()) if v])

    # -- queries -------------------------------------------------------------------------------

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

    def rollups(self, devices: list[str] | None = None, *, since: float = 0.0) -> list[dict[str, Any]]:
        c = t.telemetry_rollup.c
        q = sa.select(t.telemetry_rollup).where(c.hour >= int(since // 3600 * 3600))
        if devices is not None:
            q = q.where(c.device_id.in_(devices))
        with self.store.begin() as conn:
            return [dict(r._mapping) for r in conn.execute(q.order_by(c.hour, c.device_id))]

    def roll_up(self, *, now: float | None = None, batch: int = 50_000) -> int:
        """Fold raw windows older than the retention into hourly rows and delete them. Returns windows folded."""
        cutoff = (time.time() if now is None else now) - self.limits.retention_s
        c = t.telemetry.c
        with self.store.begin() as conn:
            rows = conn.execute(sa.select(c.id, c.device_id, c.server_ts, c.requests, c.p95_ms, c.escalation_rate,
                                          c.energy_mj_per_request, c.degraded)
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
                    "degraded": (old.degraded if old else 0) + sum(r.degraded for r in rs)}
                if old:
                    conn.execute(t.telemetry_rollup.update().where(t.telemetry_rollup.c.device_id == device,
                                                                   t.telemetry_rollup.c.hour == hour).values(**values))
                else:
                    conn.execute(t.telemetry_rollup.insert().values(device_id=device, hour=hour, **values))
            conn.execute(t.telemetry.delete().where(c.id.in_([r.id for r in rows])))
        return len(rows)
