"""The fleet view's percentile bands, materialized: a page load reads a few hundred rows, never the windows.

Per grouping ("fleet", "release": the release each device reports, "label:KEY": a label's value), hour and
group, the 50th and 95th percentile across devices of each device's hourly figure: p95 latency (mean of its
windows' p95), escalation rate, edge/cloud agreement, energy per request and degraded share. The figures
come from `telemetry_hourly` (every window folded at ingest into sums per device and hour); an hour's bands
are computed once from its ≤ one row per device (every grouping in one pass) and stored in `fleet_bands`,
stamped with the hour's window count from `telemetry_minutes` (also kept at ingest). A later window changes
the count and makes the stored hour stale.

Who computes: `tierkit fleet serve` refreshes stale hours every `REFRESH_S` (the open hour at most every
`FRESH_S`); a read recomputes only hours missing or stale beyond that (a grouping never asked for before,
or no fleet process running), so a page load costs O(groups x hours) rows once the hours are stored.
An hour's bands group devices as they were when it was computed (the open hour: as they are now); at most
`MAX_GROUPS` groups an hour per grouping (the largest; the rest are "(other)").

Example:
    >>> bands(store, by="label:site")["groups"]["site=berlin"]["series"][0]["p95_ms"]  # [p50, p95]
    [7.5, 11.0]
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.bulk import Bulk
from cloud_service.fleet.errors import InvalidDocument
from cloud_service.fleet.store import FleetStore

FIGURES = ("p95_ms", "escalation_rate", "agreement", "energy_mj_per_request", "degraded_share")
MAX_GROUPS = 20
FRESH_S = 60.0  # the open hour's stored bands are used while younger than this
REFRESH_S = 15.0  # how often `tierkit fleet serve` refreshes stale hours
OTHER = "(other)"


def check_grouping(by: str) -> str:
    if by in ("fleet", "release") or (by.startswith("label:") and len(by) > 6):
        return by
    msg = f"bands by {by!r}: use fleet, release, or label:KEY (e.g. label:site)"
    raise InvalidDocument(msg)


def _stamps(conn: Any, since: int) -> dict[int, int]:
    """hour -> windows received in it (from the per-minute sums: at most 60 rows an hour)."""
    m = t.telemetry_minutes.c
    hour = (m.minute // 3600 * 3600).label("hour")
    return {int(r.hour): int(r.windows) for r in conn.execute(
        sa.select(hour, sa.func.sum(m.windows).label("windows")).where(m.minute >= since).group_by(hour))}


def _release(dialect: str) -> Any:
    doc = t.reported.c.document
    if dialect == "postgresql":
        return sa.func.json_extract_path_text(sa.cast(doc, sa.JSON), "release")
    return sa.func.json_extract(doc, "$.release")


def _device_hours(conn: Any, dialect: str, hour: int) -> list[tuple[Any, ...]]:
    """The hour's device-hours as columns: 8 sums, then labels, reported (a device id or None), release."""
    h, d, r = t.telemetry_hourly.c, t.devices.c, t.reported.c
    query = (sa.select(h.windows, h.requests, h.p95_sum, h.escalations, h.energy_mj, h.degraded, h.agreement_sum,
                       h.agreement_weight, d.labels, r.device_id.label("reported"), _release(dialect).label("release"))
             .select_from(t.telemetry_hourly.outerjoin(t.devices, d.device_id == h.device_id)
                          .outerjoin(t.reported, r.device_id == h.device_id))
             .where(h.hour == hour))
    rows = conn.execute(query).all()
    return list(zip(*rows, strict=True)) if rows else []


def _figures(cols: list[tuple[Any, ...]]) -> dict[str, np.ndarray]:
    """Each device-hour's figures (NaN where undefined)."""
    win, req, p95, esc, energy, degraded, agree, weight = (np.array(c, dtype=float) for c in cols[:8])
    with np.errstate(divide="ignore", invalid="ignore"):
        return {"p95_ms": p95 / win, "escalation_rate": esc / req,
                "agreement": np.where(weight > 0, agree / weight, np.nan),
                "energy_mj_per_request": energy / req, "degraded_share": degraded / req}


def _memberships(cols: list[tuple[Any, ...]], extra: Iterable[str]) -> dict[str, list[str]]:
    """grouping -> each device-hour's group name, for fleet, release, every label key present and `extra`."""
    texts, reported, releases = cols[8:11]
    parsed: dict[str, dict[str, str]] = {}  # devices share few label sets: each text parsed once
    labels = [None if x is None else parsed[x] if x in parsed else parsed.setdefault(x, json.loads(x))
              for x in texts]
    keys = {k for lab in labels if lab for k in lab} | {g[6:] for g in extra if g.startswith("label:")}
    out = {"fleet": ["fleet"] * len(texts),
           "release": ["?" if rep is None else (rel or "none")[:23]
                       for rep, rel in zip(reported, releases, strict=True)]}
    for k in sorted(keys):
        out[f"label:{k}"] = [f"{k}={lab.get(k, '?')}"[:200] if lab is not None else "?" for lab in labels]
    for grouping, names in out.items():  # at most MAX_GROUPS groups: the largest, the rest as one
        counts = Counter(names)
        if len(counts) > MAX_GROUPS:
            keep = {n for n, _ in counts.most_common(MAX_GROUPS - 1)}
            out[grouping] = [n if n in keep else OTHER for n in names]
    return out


def _percentiles(values: np.ndarray) -> list[float] | None:
    v = values[np.isfinite(values)]
    return [float(f"{x:.9g}") for x in np.percentile(v, [50, 95])] if len(v) else None


def compute_hour(conn: Any, dialect: str, hour: int, *, extra: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """grouping -> group -> {"devices", "figures"} for one hour, from its device-hours."""
    cols = _device_hours(conn, dialect, hour)
    if not cols:
        return {}
    figures = _figures(cols)
    out: dict[str, dict[str, Any]] = {}
    for grouping, names in _memberships(cols, extra).items():
        arr = np.array(names, dtype=object)
        groups: dict[str, Any] = {}
        for name in sorted(set(names)):
            sel = arr == name
            groups[name] = {"devices": int(sel.sum()),
                            "figures": {f: _percentiles(values[sel]) for f, values in figures.items()}}
        out[grouping] = groups
    return out


def _store_hour(conn: Any, bulk: Bulk, hour: int, computed: dict[str, dict[str, Any]], windows: int,
                now: float) -> None:
    b = t.fleet_bands.c
    rows = [{"grouping": g, "hour": hour, "grp": name, "devices": body["devices"],
             "figures": json.dumps(body["figures"], separators=(",", ":")), "windows": windows, "computed_at": now}
            for g, groups in sorted(computed.items()) for name, body in sorted(groups.items())]
    for g, groups in computed.items():  # groups gone since the hour was last computed
        conn.execute(t.fleet_bands.delete().where(b.grouping == g, b.hour == hour, b.grp.not_in(sorted(groups))))
    if rows:
        ins = bulk.upsert(t.fleet_bands)
        conn.execute(ins.on_conflict_do_update(
            index_elements=["grouping", "hour", "grp"],
            set_={c: ins.excluded[c] for c in ("devices", "figures", "windows", "computed_at")}), rows)


def _stale(stored: tuple[int, float] | None, windows: int, hour: int, now: float, fresh_s: float) -> bool:
    """Whether an hour's stored bands (its stamp, computed at) must be computed again."""
    if stored is None:
        return True
    stamp, computed_at = stored
    if stamp == windows:
        return False
    closed = hour + 3600 <= computed_at  # computed after the hour ended: only late windows changed it
    return closed or now - computed_at >= fresh_s


def refresh(store: FleetStore, *, by: str = "fleet", hours: int = 24, now: float | None = None,
            fresh_s: float = FRESH_S) -> list[int]:
    """Compute and store the stale hours of the last `hours` (every grouping, `by` included). Returns them."""
    now = time.time() if now is None else now
    since = int((now - hours * 3600) // 3600 * 3600)
    b = t.fleet_bands.c
    with store.begin() as conn:
        stamps = _stamps(conn, since)
        stored = {int(r.hour): (int(r.windows), float(r.computed_at)) for r in conn.execute(
            sa.select(b.hour, sa.func.min(b.windows).label("windows"), sa.func.min(b.computed_at).label("computed_at"))
            .where(b.grouping == by, b.hour >= since).group_by(b.hour))}
    stale = sorted(hr for hr, n in stamps.items() if _stale(stored.get(hr), n, hr, now, fresh_s))
    bulk = Bulk(store)
    for hour in stale:
        with store.begin() as conn:  # the stamp first: windows added meanwhile leave the hour stale, not lost
            windows = _stamps(conn, hour).get(hour, 0)
            _store_hour(conn, bulk, hour, compute_hour(conn, store.dialect, hour, extra=[by]), windows, now)
    return stale


def bands(store: FleetStore, *, by: str = "fleet", hours: int = 24, now: float | None = None,
          fresh_s: float = FRESH_S) -> dict[str, Any]:
    """Per group and hour, p50 and p95 across devices of each figure (see the module docstring)."""
    check_grouping(by)
    now = time.time() if now is None else now
    since = int((now - hours * 3600) // 3600 * 3600)
    refresh(store, by=by, hours=hours, now=now, fresh_s=fresh_s)
    b = t.fleet_bands.c
    with store.begin() as conn:
        rows = conn.execute(sa.select(b.grp, b.hour, b.devices, b.figures, b.computed_at)
                            .where(b.grouping == by, b.hour >= since).order_by(b.grp, b.hour)).all()
    out: dict[str, Any] = {}
    for r in rows:
        point = {"t": int(r.hour), "devices": int(r.devices), **json.loads(r.figures)}
        out.setdefault(r.grp, {"series": []})["series"].append(point)
    for name, body in out.items():
        body["devices"] = max(p["devices"] for p in body["series"])
        body["name"] = name
    return {"by": by, "since": since, "computed_at": max((float(r.computed_at) for r in rows), default=None),
            "groups": out}
