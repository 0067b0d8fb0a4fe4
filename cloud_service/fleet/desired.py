"""Desired and reported state: layers by selector and priority, the effective document, drift.

A layer is a document for a selector: `*` (the fleet default), `k=v[,k=v]` (devices carrying all
those labels) or `device=ID`. A device's effective document merges its matching layers in
priority order (higher wins; key by key, nested mappings merged), and its version is the highest
version among them. Versions come from one counter, so a device's effective version only grows.
The agent reports on `.../reported` once a document has taken effect, naming that version and the
model digest it runs; a device whose reported version stays behind for `drift_after_s` is drift.

```json
{"budget": {"latency_ms": 25, "energy_mj": 4}, "threshold": 0.8, "telemetry_interval_s": 60}
```

Example:
    >>> state = DesiredState(store)
    >>> state.set_layer("site=berlin", {"threshold": 0.7})
    >>> state.effective(device)          # {"version": 3, "document": {...}}
"""

from __future__ import annotations

import json
import time
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cloud_service.fleet import schema as t
from cloud_service.fleet.errors import InvalidDocument
from cloud_service.fleet.registry import parse_labels
from cloud_service.fleet.store import FleetStore

DEFAULT_PRIORITY = {"fleet": 0, "labels": 100, "device": 1000}


class _Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    latency_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    energy_mj: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_escalations_per_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class DesiredDocument(BaseModel):
    """What a layer may set. Unknown keys are refused (a typo would otherwise silently do nothing)."""

    model_config = ConfigDict(extra="forbid")
    budget: _Budget | None = None
    threshold: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    telemetry_interval_s: float | None = Field(default=None, ge=1, le=86400)
    release: str | None = Field(default=None, max_length=128)  # a release digest (rollouts)


def validate_document(doc: Any) -> dict[str, Any]:
    """The document with unset keys left out; `InvalidDocument` naming each problem."""
    if not isinstance(doc, dict) or not doc:
        msg = f"a desired document must be a non-empty mapping, got {doc!r}"
        raise InvalidDocument(msg)
    try:
        return DesiredDocument.model_validate(doc).model_dump(exclude_unset=True)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        msg = f"desired document does not validate: {problems}"
        raise InvalidDocument(msg) from None


def parse_selector(selector: str) -> tuple[str, dict[str, str]]:
    """-> ("fleet" | "labels" | "device", labels); `device=ID` gives {"device": ID}."""
    selector = selector.strip()
    if selector == "*":
        return "fleet", {}
    labels = parse_labels(selector, where="selector")
    if "device" in labels:
        if len(labels) != 1:
            msg = f"selector {selector!r}: device=ID cannot be combined with labels"
            raise InvalidDocument(msg)
        return "device", labels
    return "labels", labels


def canonical_selector(selector: str) -> str:
    kind, labels = parse_selector(selector)
    return "*" if kind == "fleet" else ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def matches(selector: str, device: dict[str, Any]) -> bool:
    kind, labels = parse_selector(selector)
    if kind == "fleet":
        return True
    if kind == "device":
        return bool(labels["device"] == device["device_id"])
    return all(device["labels"].get(k) == v for k, v in labels.items())


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class DesiredState:
    """Layers, effective documents, reported state and drift over a `FleetStore`."""

    def __init__(self, store: FleetStore, *, drift_after_s: float = 300.0) -> None:
        self.store, self.drift_after_s = store, drift_after_s

    def set_layer(self, selector: str, document: Any, *, priority: int | None = None) -> int:
        """Create or replace the layer for `selector`; returns its new version."""
        doc = validate_document(document)
        sel = canonical_selector(selector)
        prio = DEFAULT_PRIORITY[parse_selector(sel)[0]] if priority is None else int(priority)
        with self.store.begin() as conn:
            if self.store.dialect == "postgresql":
                # one version counter for all layers: serialize writers so versions stay strictly increasing
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7412002)"))
            version = int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(t.desired_layers.c.version), 0)))
                          .scalar_one()) + 1
            values = {"priority": prio, "document": json.dumps(doc, sort_keys=True), "version": version,
                      "updated_at": time.time()}
            n = conn.execute(t.desired_layers.update().where(t.desired_layers.c.selector == sel).values(**values))
            if n.rowcount == 0:
                conn.execute(t.desired_layers.insert().values(selector=sel, **values))
        return version

    def layers(self) -> list[dict[str, Any]]:
        with self.store.begin() as conn:
            rows = conn.execute(sa.select(t.desired_layers).order_by(t.desired_layers.c.priority)).all()
        return [dict(r._mapping, document=json.loads(r.document)) for r in rows]

    def effective(self, device: dict[str, Any], layers: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """{"version", "document", "layers"} for `device` (a registry dict), or None when no layer matches."""
        hits = [la for la in (self.layers() if layers is None else layers) if matches(la["selector"], device)]
        if not hits:
            return None
        doc: dict[str, Any] = {}
        for la in sorted(hits, key=lambda la: (la["priority"], la["version"])):
            doc = _merge(doc, la["document"])
        return {"version": max(la["version"] for la in hits), "document": doc,
                "layers": [la["selector"] for la in hits]}

    def refresh(self, devices: list[dict[str, Any]]) -> list[tuple[str, int, dict[str, Any]]]:
        """Recompute every device's effective document; returns those not yet published at their version."""
        layers = self.layers()
        changed: list[tuple[str, int, dict[str, Any]]] = []
        now = time.time()
        with self.store.begin() as conn:
            rows = {r.device_id: r for r in conn.execute(sa.select(t.desired_effective)).all()}
            known = {d: r.version for d, r in rows.items()}
            for dev in devices:
                eff = self.effective(dev, layers)
                if eff is None or dev.get("revoked_at") is not None:
                    continue
                if known.get(dev["device_id"]) == eff["version"]:
                    if rows[dev["device_id"]].published_version != eff["version"]:
                        changed.append((dev["device_id"], eff["version"], eff["document"]))
                    continue
                row = {"version": eff["version"], "document": json.dumps(eff["document"], sort_keys=True),
                       "since": now}
                if dev["device_id"] in known:
                    conn.execute(t.desired_effective.update()
                                 .where(t.desired_effective.c.device_id == dev["device_id"]).values(**row))
                else:
                    conn.execute(t.desired_effective.insert().values(device_id=dev["device_id"], **row))
                changed.append((dev["device_id"], eff["version"], eff["document"]))
        return changed

    def effective_versions(self) -> dict[str, int]:
        """Device id -> the version of its effective document, as last computed."""
        with self.store.begin() as conn:
            return {r.device_id: int(r.version) for r in conn.execute(
                sa.select(t.desired_effective.c.device_id, t.desired_effective.c.version))}

    def reported_versions(self) -> dict[str, int | None]:
        """Device id -> the desired version it last reported applied (one query for the whole fleet)."""
        with self.store.begin() as conn:
            return {r.device_id: r.version for r in conn.execute(
                sa.select(t.reported.c.device_id, t.reported.c.version))}

    def mark_published(self, device_id: str, version: int) -> None:
        with self.store.begin() as conn:
            conn.execute(t.desired_effective.update().where(t.desired_effective.c.device_id == device_id)
                         .values(published_version=version))

    def record_reported(self, device_id: str, document: dict[str, Any], *, now: float | None = None) -> None:
        """Store what the device says it runs, and copy digest/variant/threshold into the registry."""
        now = time.time() if now is None else now
        version = document.get("desired_version")
        row = {"version": int(version) if isinstance(version, int) else None,
               "document": json.dumps(document, sort_keys=True), "received_at": now}
        with self.store.begin() as conn:
            if conn.execute(t.reported.update().where(t.reported.c.device_id == device_id).values(**row)).rowcount == 0:
                conn.execute(t.reported.insert().values(device_id=device_id, **row))
            threshold = document.get("threshold")
            conn.execute(t.devices.update().where(t.devices.c.device_id == device_id).values(
                model_digest=str(document.get("model_digest", ""))[:128],
                variant=str(document.get("variant", ""))[:128],
                threshold=float(threshold) if isinstance(threshold, int | float) else None, last_seen=now))

    def reported(self, device_id: str) -> dict[str, Any] | None:
        with self.store.begin() as conn:
            row = conn.execute(sa.select(t.reported).where(t.reported.c.device_id == device_id)).first()
        return None if row is None else {"version": row.version, "document": json.loads(row.document),
                                         "received_at": row.received_at}

    def drift(self, *, now: float | None = None) -> list[dict[str, Any]]:
        """Devices whose reported version differs from the effective one for longer than `drift_after_s`."""
        now = time.time() if now is None else now
        eff, rep, dev = t.desired_effective, t.reported, t.devices
        query = (sa.select(eff.c.device_id, eff.c.version.label("desired_version"), eff.c.since,
                           rep.c.version.label("reported_version"), rep.c.received_at)
                 .select_from(eff.join(dev, dev.c.device_id == eff.c.device_id)
                              .outerjoin(rep, rep.c.device_id == eff.c.device_id))
                 .where(dev.c.revoked_at.is_(None)).order_by(eff.c.device_id))
        with self.store.begin() as conn:
            rows = conn.execute(query).all()
        return [dict(r._mapping, behind_s=now - r.since) for r in rows
                if r.reported_version != r.desired_version and now - r.since > self.drift_after_s]
