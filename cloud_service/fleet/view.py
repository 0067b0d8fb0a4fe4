"""The fleet view at scale: percentile bands across devices and a paginated, filterable device list.

Neither reads raw telemetry windows: bands come from `telemetry_hourly` (every window folded at ingest into
sums per device and hour, indexed by hour), so a day of a 10,000-device fleet is at most 240,000 small rows
whatever the window rate; the device list is one indexed page of the `devices` table plus the reported
documents of that page.

`bands(by="label:site")` groups devices by a label's value (or `by="release"`: the release each device
reports it runs now) and gives, per group and hour, the 50th and 95th percentile across devices of each
device's hourly figure: p95 latency (mean of its windows' p95), escalation rate, edge/cloud agreement,
energy per request and degraded share.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.desired import stored_reported
from cloud_service.fleet.errors import InvalidDocument
from cloud_service.fleet.store import FleetStore

FIGURES = ("p95_ms", "escalation_rate", "agreement", "energy_mj_per_request", "degraded_share")
STATES = ("online", "offline", "revoked")


def _groups(conn: Any, by: str) -> dict[str, str]:
    """device -> its group's name."""
    if by == "release":
        return {r.device_id: (stored_reported(r.document).release or "none")[:23]
                for r in conn.execute(sa.select(t.reported.c.device_id, t.reported.c.document))}
    if by.startswith("label:") and len(by) > 6:
        key = by[6:]
        return {r.device_id: f"{key}={json.loads(r.labels).get(key, '?')}"
                for r in conn.execute(sa.select(t.devices.c.device_id, t.devices.c.labels))}
    if by == "fleet":
        return {r.device_id: "fleet" for r in conn.execute(sa.select(t.devices.c.device_id))}
    msg = f"bands by {by!r}: use fleet, release, or label:KEY (e.g. label:site)"
    raise InvalidDocument(msg)


_FIGURE_SQL = {  # each device-hour's figure, as the numpy path computes it (NULL where undefined)
    "p95_ms": "h.p95_sum / NULLIF(h.windows, 0)",
    "escalation_rate": "h.escalations / NULLIF(h.requests, 0)",
    "agreement": "CASE WHEN h.agreement_weight > 0 THEN h.agreement_sum / h.agreement_weight END",
    "energy_mj_per_request": "h.energy_mj / NULLIF(h.requests, 0)",
    "degraded_share": "CAST(h.degraded AS double precision) / NULLIF(h.requests, 0)"}


def _bands_sql(conn: Any, by: str, since: int) -> dict[str, Any]:
    """PostgreSQL: the percentiles in the database (one grouped scan of the hour index; a few hundred rows come
    back instead of every device-hour: a 10,000-device day is 240,000 of them)."""
    if by == "release":
        grp = ("SELECT device_id, left(coalesce(CAST(document AS json)->>'release', 'none'), 23) AS grp "
               "FROM reported")
    elif by.startswith("label:") and len(by) > 6:
        grp = "SELECT device_id, :key || '=' || coalesce(CAST(labels AS json)->>:label, '?') AS grp FROM devices"
    elif by == "fleet":
        grp = "SELECT device_id, 'fleet' AS grp FROM devices"
    else:
        msg = f"bands by {by!r}: use fleet, release, or label:KEY (e.g. label:site)"
        raise InvalidDocument(msg)
    figures = ", ".join(f"percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP (ORDER BY {expr}) AS {name}"
                        for name, expr in _FIGURE_SQL.items())
    query = sa.text(f"WITH g AS ({grp}) SELECT coalesce(g.grp, '?') AS grp, h.hour AS hour, count(*) AS devices, "
                    f"{figures} FROM telemetry_hourly h LEFT JOIN g ON g.device_id = h.device_id "
                    "WHERE h.hour >= :since GROUP BY 1, 2 ORDER BY 1, 2")
    params: dict[str, Any] = {"since": since}
    if by.startswith("label:"):
        params.update(key=by[6:], label=by[6:])
    out: dict[str, Any] = {}
    for r in conn.execute(query, params):
        point: dict[str, Any] = {"t": int(r.hour), "devices": int(r.devices)}
        for name in FIGURES:
            v = getattr(r, name)
            point[name] = [round(float(x), 6) for x in v] if v is not None and None not in v else None
        out.setdefault(r.grp, {"series": []})["series"].append(point)
    for g, body in out.items():
        body["devices"] = max(p["devices"] for p in body["series"])
        body["name"] = g
    return {"by": by, "since": since, "groups": out}


def bands(store: FleetStore, *, by: str = "fleet", hours: int = 24, now: float | None = None) -> dict[str, Any]:
    """Per group and hour, p50 and p95 across devices of each figure (see the module docstring)."""
    now = time.time() if now is None else now
    since = int((now - hours * 3600) // 3600 * 3600)
    with store.begin() as conn:
        if store.dialect == "postgresql":
            return _bands_sql(conn, by, since)
        return _bands_numpy(conn, by, since)


def _bands_numpy(conn: Any, by: str, since: int) -> dict[str, Any]:
    """Any database: the device-hours fetched, the percentiles in numpy."""
    h = t.telemetry_hourly.c
    groups = _groups(conn, by)
    rows = conn.execute(sa.select(h.device_id, h.hour, h.windows, h.requests, h.p95_sum, h.escalations,
                                  h.energy_mj, h.degraded, h.agreement_sum, h.agreement_weight)
                        .where(h.hour >= since)).all()
    if not rows:
        return {"by": by, "since": since, "groups": {}}
    names = sorted(set(groups.values()) | {"?"})
    code = {n: i for i, n in enumerate(names)}
    cols = list(zip(*rows, strict=True))
    group = np.array([code[groups.get(d, "?")] for d in cols[0]])
    hour = np.array(cols[1], dtype=np.int64)
    win, req = np.array(cols[2], dtype=float), np.array(cols[3], dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        figures = {
            "p95_ms": np.array(cols[4], dtype=float) / win,
            "escalation_rate": np.array(cols[5], dtype=float) / req,
            "agreement": np.where(np.array(cols[9], dtype=float) > 0,
                                  np.array(cols[8], dtype=float) / np.array(cols[9], dtype=float), np.nan),
            "energy_mj_per_request": np.array(cols[6], dtype=float) / req,
            "degraded_share": np.array(cols[7], dtype=float) / req}
    order = np.lexsort((hour, group))
    keys = np.stack([group[order], hour[order]], axis=1)
    cuts = np.flatnonzero(np.any(np.diff(keys, axis=0) != 0, axis=1)) + 1
    out: dict[str, Any] = {}
    for part in np.split(order, cuts):
        g, hr = names[int(group[part[0]])], int(hour[part[0]])
        point: dict[str, Any] = {"t": hr, "devices": len(part)}
        for name, values in figures.items():
            v = values[part]
            v = v[np.isfinite(v)]
            point[name] = [round(float(x), 6) for x in np.percentile(v, [50, 95])] if len(v) else None
        out.setdefault(g, {"series": []})["series"].append(point)
    for g, body in out.items():
        body["devices"] = max(p["devices"] for p in body["series"])
        body["name"] = g
    return {"by": by, "since": since, "groups": out}


def page(store: FleetStore, *, offset: int = 0, limit: int = 50, q: str = "", state: str = "",
         online_after_s: float = 120.0, now: float | None = None,
         data_drift: Callable[[list[str]], dict[str, bool]] | None = None) -> dict[str, Any]:
    """One page of devices (ordered by id), filtered by `q` (`k=v`: a label; else text in the id or labels) and
    `state`."""
    if state and state not in STATES:
        msg = f"state {state!r}: use one of {', '.join(STATES)} (or none)"
        raise InvalidDocument(msg)
    now = time.time() if now is None else now
    d = t.devices.c
    where: list[sa.ColumnElement[bool]] = []
    q = q.replace("%", "").replace("_", "").replace('"', "")
    if "=" in q:  # a label: k=v (labels are stored as a JSON object)
        key, _, value = q.partition("=")
        where.append(d.labels.like(f'%{json.dumps({key.strip(): value.strip()})[1:-1]}%'))
    elif q:
        where.append(sa.or_(d.device_id.like(f"%{q}%"), d.labels.like(f"%{q}%")))
    if state == "revoked":
        where.append(d.revoked_at.is_not(None))
    elif state == "online":
        where += [d.revoked_at.is_(None), d.last_seen >= now - online_after_s]
    elif state == "offline":
        where += [d.revoked_at.is_(None), sa.or_(d.last_seen.is_(None), d.last_seen < now - online_after_s)]
    with store.begin() as conn:
        total = int(conn.execute(sa.select(sa.func.count()).select_from(t.devices).where(*where)).scalar_one())
        rows = conn.execute(sa.select(d.device_id, d.labels, d.agent_version, d.revoked_at, d.last_seen,
                                      d.model_digest, d.variant, d.threshold).where(*where)
                            .order_by(d.device_id).offset(max(0, offset)).limit(max(1, min(limit, 500)))).all()
        ids = [r.device_id for r in rows]
        reported = {r.device_id: r for r in conn.execute(
            sa.select(t.reported.c.device_id, t.reported.c.document, t.reported.c.version)
            .where(t.reported.c.device_id.in_(ids)))} if ids else {}
        desired = {r.device_id: r.version for r in conn.execute(
            sa.select(t.desired_effective.c.device_id, t.desired_effective.c.version)
            .where(t.desired_effective.c.device_id.in_(ids)))} if ids else {}
    drifting = data_drift(ids) if data_drift is not None and ids else {}
    out = []
    for r in rows:
        rep = reported.get(r.device_id)
        release = stored_reported(rep.document).release if rep is not None else None
        seen = r.last_seen
        out.append({"device_id": r.device_id, "labels": json.loads(r.labels), "agent_version": r.agent_version,
                    "state": "revoked" if r.revoked_at is not None else "online"
                    if seen is not None and now - seen <= online_after_s else "offline",
                    "last_seen": seen, "model_digest": r.model_digest, "variant": r.variant, "threshold": r.threshold,
                    "release": release, "desired_version": desired.get(r.device_id),
                    "reported_version": rep.version if rep is not None else None,
                    "data_drift": drifting.get(r.device_id, False)})
    return {"total": total, "offset": offset, "limit": limit, "devices": out}
