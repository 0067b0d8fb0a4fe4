"""The fleet view at scale: a paginated, filterable device table (the percentile bands are in `bands.py`).

A page is a keyset page of the `devices` table ordered by id (`after` / `before` an id: an index range,
whatever the page's depth), plus the reported and desired versions and latest data-drift flag of just its
devices. Filters are index ranges too: `k=v` through `device_labels`, text as a device-id prefix, state
through `last_seen` and `revoked_at`. `total` counts the filtered devices (an index-only count).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.bands import FIGURES, bands
from cloud_service.fleet.desired import stored_reported
from cloud_service.fleet.errors import InvalidDocument
from cloud_service.fleet.store import FleetStore

__all__ = ["FIGURES", "STATES", "bands", "page"]
STATES = ("online", "offline", "revoked")


def _filters(q: str, state: str, now: float, online_after_s: float) -> list[sa.ColumnElement[bool]]:
    """`q`: `k=v` (a label) or a device-id prefix; `state`: online, offline, revoked or "" (any)."""
    if state and state not in STATES:
        msg = f"state {state!r}: use one of {', '.join(STATES)} (or none)"
        raise InvalidDocument(msg)
    d, lab = t.devices.c, t.device_labels.c
    where: list[sa.ColumnElement[bool]] = []
    q = q.strip()
    if "=" in q:
        key, _, value = q.partition("=")
        where.append(d.device_id.in_(sa.select(lab.device_id).where(lab.key == key.strip(),
                                                                    lab.value == value.strip())))
    elif q:
        where.append(d.device_id.startswith(q, autoescape=True))
    if state == "revoked":
        where.append(d.revoked_at.is_not(None))
    elif state == "online":
        where += [d.last_seen >= now - online_after_s, d.revoked_at.is_(None)]
    elif state == "offline":
        where += [sa.or_(d.last_seen.is_(None), d.last_seen < now - online_after_s), d.revoked_at.is_(None)]
    return where


def page(store: FleetStore, *, after: str = "", before: str = "", limit: int = 50, q: str = "", state: str = "",
         online_after_s: float = 120.0, drift_after_s: float = 300.0, now: float | None = None,
         data_drift: Callable[[list[str]], dict[str, bool]] | None = None) -> dict[str, Any]:
    """One page of devices ordered by id: the first, the one `after` an id, or the one `before` an id;
    filtered by `q` (`k=v`: a label; else a device-id prefix) and `state`."""
    now = time.time() if now is None else now
    limit = max(1, min(limit, 500))
    d = t.devices.c
    where = _filters(q, state, now, online_after_s)
    query = sa.select(d.device_id, d.labels, d.agent_version, d.revoked_at, d.last_seen, d.model_digest, d.variant,
                      d.threshold).where(*where)
    if before:
        query = query.where(d.device_id < before).order_by(d.device_id.desc())
    else:
        query = query.where(d.device_id > after).order_by(d.device_id) if after else query.order_by(d.device_id)
    with store.begin() as conn:
        total = int(conn.execute(sa.select(sa.func.count()).select_from(t.devices).where(*where)).scalar_one())
        rows = sorted(conn.execute(query.limit(limit)).all(), key=lambda r: r.device_id)
        ids = [r.device_id for r in rows]

        def beyond(cond: sa.ColumnElement[bool]) -> bool:
            return conn.execute(sa.select(d.device_id).where(*where, cond).limit(1)).first() is not None

        has_prev = bool(ids) and beyond(d.device_id < ids[0])
        has_next = bool(ids) and beyond(d.device_id > ids[-1])
        reported = {r.device_id: r for r in conn.execute(
            sa.select(t.reported.c.device_id, t.reported.c.document, t.reported.c.version)
            .where(t.reported.c.device_id.in_(ids)))} if ids else {}
        desired = {r.device_id: r for r in conn.execute(
            sa.select(t.desired_effective.c.device_id, t.desired_effective.c.version, t.desired_effective.c.since)
            .where(t.desired_effective.c.device_id.in_(ids)))} if ids else {}
    drifting = data_drift(ids) if data_drift is not None and ids else {}
    out = []
    for r in rows:
        rep, want = reported.get(r.device_id), desired.get(r.device_id)
        seen = r.last_seen
        behind = (want is not None and (rep.version if rep is not None else None) != want.version
                  and now - want.since > drift_after_s)
        out.append({"device_id": r.device_id, "labels": json.loads(r.labels), "agent_version": r.agent_version,
                    "state": "revoked" if r.revoked_at is not None else "online"
                    if seen is not None and now - seen <= online_after_s else "offline",
                    "last_seen": seen, "model_digest": r.model_digest, "variant": r.variant, "threshold": r.threshold,
                    "release": stored_reported(rep.document).release if rep is not None else None,
                    "desired_version": want.version if want is not None else None,
                    "drift": bool(behind and r.revoked_at is None),
                    "reported_version": rep.version if rep is not None else None,
                    "data_drift": drifting.get(r.device_id, False)})
    return {"total": total, "limit": limit, "devices": out, "has_prev": has_prev, "has_next": has_next}
