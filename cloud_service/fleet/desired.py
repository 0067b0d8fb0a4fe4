"""Desired and reported state: layers by selector and priority, the effective document, drift.

A layer is a document for a selector: `*` (the fleet default), `k=v[,k=v]` (devices carrying all
those labels) or `device=ID`. A device's effective document merges its matching layers in
priority order (higher wins; key by key, nested mappings merged), and its version is the highest
version among them. A rollout assigns a release to a device through a layer of its own,
`rollout/device=ID` (no operator selector can take that form), at a priority above labels and
below the operator's device layers: `{"release": "sha256:...", "soak": {"requests": 200}}`.
Versions come from one counter, so a device's effective version only grows.
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
from runtimes.documents import validation_problems

DEFAULT_PRIORITY = {"fleet": 0, "labels": 100, "rollout": 500, "device": 1000}
ROLLOUT_PREFIX = "rollout/"


class _Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    latency_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    energy_mj: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_escalations_per_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class _Soak(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: int | None = Field(default=None, ge=1)
    seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class DesiredDocument(BaseModel):
    """What a layer may set. Unknown keys are refused (a typo would otherwise silently do nothing)."""

    model_config = ConfigDict(extra="forbid")
    budget: _Budget | None = None
    threshold: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    telemetry_interval_s: float | None = Field(default=None, ge=1, le=86400)
    release: str | None = Field(default=None, max_length=128)  # a release digest (rollouts)
    soak: _Soak | None = None
    rollback: bool | None = None  # the release is a rollback target (informational for the device)


def validate_document(doc: Any) -> dict[str, Any]:
    """The document with unset keys left out; `InvalidDocument` naming each problem."""
    if not isinstance(doc, dict) or not doc:
        msg = f"a desired document must be a non-empty mapping, got {doc!r}"
        raise InvalidDocument(msg)
    try:
        return DesiredDocument.model_validate(doc).model_dump(exclude_unset=True)
    except ValidationError as exc:
        msg = f"desired document does not validate: {validation_problems(exc)}"
        raise InvalidDocument(msg) from None


def parse_selector(selector: str) -> tuple[str, dict[str, str]]:
    """-> ("fleet" | "labels" | "device", labels); `device=ID` gives {"device": ID}."""
    selector = selector.strip()
    if selector.startswith(ROLLOUT_PREFIX):
        kind, labels = parse_selector(selector.removeprefix(ROLLOUT_PREFIX))
        if kind != "device":
            msg = f"selector {selector!r}: a rollout layer names one device (rollout/device=ID)"
            raise InvalidDocument(msg)
        return "rollout", labels
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
    if kind == "rollout":
        return f"{ROLLOUT_PREFIX}device={labels['device']}"
    return "*" if kind == "fleet" else ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def rollout_selector(device_id: str) -> str:
    return f"{ROLLOUT_PREFIX}device={device_id}"


def matches(selector: str, device: dict[str, Any]) -> bool:
    kind, labels = parse_selector(selector)
    if kind == "fleet":
        return True
    if kind in ("device", "rollout"):
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
        if sel.startswith(ROLLOUT_PREFIX):
            msg = f"selector {selector!r} is a rollout's layer; start a rollout with `tierkit fleet deploy`"
            raise InvalidDocument(msg)
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

    def assign(self, documents: dict[str, dict[str, Any]], *, conn: Any = None) -> int:
        """Set the rollout layer of each device (device id -> document), all at one new version, in one
        transaction (`conn`: the caller's, so that the assignment commits with the rollout's own rows)."""
        if not documents:
            return 0
        docs = {d: json.dumps(validate_document(doc), sort_keys=True) for d, doc in documents.items()}
        if conn is None:
            with self.store.begin() as own:
                return self.assign(documents, conn=own)
        if self.store.dialect == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(7412002)"))
        version = int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(t.desired_layers.c.version), 0)))
                      .scalar_one()) + 1
        now, c = time.time(), t.desired_layers.c
        sels = {rollout_selector(d): d for d in docs}
        have = {r.selector for r in conn.execute(sa.select(c.selector).where(c.selector.in_(sorted(sels))))}
        old = [{"b_sel": sel, "b_doc": docs[d]} for sel, d in sorted(sels.items()) if sel in have]
        if old:
            conn.execute(t.desired_layers.update().where(c.selector == sa.bindparam("b_sel")).values(
                document=sa.bindparam("b_doc"), priority=DEFAULT_PRIORITY["rollout"], version=version,
                updated_at=now), old)
        new = [{"selector": sel, "document": docs[d], "priority": DEFAULT_PRIORITY["rollout"], "version": version,
                "updated_at": now} for sel, d in sorted(sels.items()) if sel not in have]
        if new:
            conn.execute(t.desired_layers.insert(), new)
        return version

    def layers(self) -> list[dict[str, Any]]:
        with self.store.begin() as conn:
            rows = conn.execute(sa.select(t.desired_layers).order_by(t.desired_layers.c.priority)).all()
        return [dict(r._mapping, document=json.loads(r.document)) for r in rows]

    def effective(self, device: dict[str, Any], layers: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """{"version", "document", "layers"} for `device` (a registry dict), or None when no layer matches."""
        mine = rollout_selector(device["device_id"])
        hits = [la for la in (self.layers() if layers is None else layers)  # rollout layers: a string compare
                if (la["selector"] == mine if la["selector"].startswith(ROLLOUT_PREFIX)
                    else matches(la["selector"], device))]
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
