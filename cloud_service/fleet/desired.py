"""Desired and reported state: layers by selector and priority, the effective document, drift.

A layer is a document for a selector: `*` (the fleet default), `k=v[,k=v]` (devices carrying all
those labels) or `device=ID`. A device's effective document merges its matching layers in
priority order (higher wins; key by key, nested mappings merged), and its version is the highest
version among them. A rollout assigns a release to a device through a layer of its own,
`rollout/device=ID` (no operator selector can take that form), at a priority above labels and
below the operator's device layers: `{"release": "sha256:...", "soak": {"requests": 50}}`.
Every document is a `cloud_service.protocol.fleet_docs.Desired` (the one parser of the wire contract).
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
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.errors import InvalidDocument
from cloud_service.fleet.registry import parse_labels
from cloud_service.fleet.store import FleetStore
from cloud_service.protocol.fleet_docs import Desired, Reported, parse_desired, parse_reported
from runtimes.errors import ConfigError

DEFAULT_PRIORITY = {"fleet": 0, "labels": 100, "rollout": 500, "device": 1000}
ROLLOUT_PREFIX = "rollout/"


def validate_document(doc: Any) -> Desired:
    """A layer's document (`fleet_docs.Desired`, without a version); `InvalidDocument` naming the field."""
    if not isinstance(doc, Desired | dict) or not doc or (isinstance(doc, Desired) and doc.is_empty()):
        msg = f"a desired document must be a non-empty mapping, got {doc!r}"
        raise InvalidDocument(msg)
    try:
        parsed = doc if isinstance(doc, Desired) else parse_desired(doc)
    except ConfigError as exc:
        raise InvalidDocument(str(exc)) from None
    if parsed.version is not None:
        msg = "a desired layer carries no version: the fleet numbers the documents it publishes"
        raise InvalidDocument(msg)
    return parsed


def _document(doc: Desired | Mapping[str, Any]) -> Desired:
    return doc if isinstance(doc, Desired) else validate_document(doc)


def stored_reported(text: str | bytes) -> Reported:
    """A reported document as stored (ingest parsed it); one an older fleet stored and that no longer parses
    reads as an empty report."""
    try:
        return parse_reported(text)
    except ConfigError:
        return Reported()


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


def _hits(layer: dict[str, Any], device: dict[str, Any]) -> bool:
    """Whether `layer` applies to `device` (a rollout layer by a string compare: there is one per device)."""
    if layer["selector"].startswith(ROLLOUT_PREFIX):
        return bool(layer["selector"] == rollout_selector(device["device_id"]))
    return matches(layer["selector"], device)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class DesiredState:
    """Layers, effective documents, reported state and drift over a `FleetStore`."""

    def __init__(self, store: FleetStore, *, drift_after_s: float = 300.0) -> None:
        self.store, self.drift_after_s = store, drift_after_s
        self._seen = 0  # the newest layer version the last `refresh` took into account

    def set_layer(self, selector: str, document: Any, *, priority: int | None = None) -> int:
        """Create or replace the layer for `selector`; returns its new version."""
        doc = validate_document(document).to_json()
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

    def assign(self, documents: Mapping[str, Desired | Mapping[str, Any]], *, conn: Any = None) -> int:
        """Set the rollout layer of each device (device id -> document), all at one new version, in one
        transaction (`conn`: the caller's, so that the assignment commits with the rollout's own rows)."""
        if not documents:
            return 0
        docs = {d: json.dumps(_document(doc).to_json(), sort_keys=True) for d, doc in documents.items()}
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
        hits = [la for la in (self.layers() if layers is None else layers) if _hits(la, device)]
        if not hits:
            return None
        doc: dict[str, Any] = {}
        for la in sorted(hits, key=lambda la: (la["priority"], la["version"])):
            doc = _merge(doc, la["document"])
        return {"version": max(la["version"] for la in hits), "document": doc,
                "layers": [la["selector"] for la in hits]}

    def refresh(self, devices: list[dict[str, Any]]) -> list[tuple[str, int, dict[str, Any]]]:
        """The devices whose effective document is not yet published at its version: recomputed only for the
        devices a layer changed since the last refresh matches (and new ones); the others are looked up."""
        layers = self.layers()
        fresh = [la for la in layers if la["version"] > self._seen]
        changed: list[tuple[str, int, dict[str, Any]]] = []
        now = time.time()
        with self.store.begin() as conn:
            rows = {r.device_id: r for r in conn.execute(sa.select(t.desired_effective)).all()}
            for dev in devices:
                if dev.get("revoked_at") is not None:
                    continue
                row = rows.get(dev["device_id"])
                if row is not None and not any(_hits(la, dev) for la in fresh):
                    if row.published_version != row.version:
                        changed.append((dev["device_id"], int(row.version), json.loads(row.document)))
                    continue
                eff = self.effective(dev, layers)
                if eff is not None:
                    self._store_effective(conn, dev["device_id"], eff, row, now, changed)
        self._seen = max((la["version"] for la in layers), default=self._seen)
        return changed

    @staticmethod
    def _store_effective(conn: Any, device_id: str, eff: dict[str, Any], row: Any, now: float,
                         changed: list[tuple[str, int, dict[str, Any]]]) -> None:
        if row is not None and row.version == eff["version"]:
            if row.published_version != eff["version"]:
                changed.append((device_id, eff["version"], eff["document"]))
            return
        values = {"version": eff["version"], "document": json.dumps(eff["document"], sort_keys=True), "since": now}
        if row is not None:
            conn.execute(t.desired_effective.update().where(t.desired_effective.c.device_id == device_id)
                         .values(**values))
        else:
            conn.execute(t.desired_effective.insert().values(device_id=device_id, **values))
        changed.append((device_id, eff["version"], eff["document"]))

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

    def record_reported(self, device_id: str, document: Reported | Mapping[str, Any], *,
                        now: float | None = None) -> None:
        """Store what the device says it runs, and copy digest/variant/threshold into the registry."""
        now = time.time() if now is None else now
        try:
            report = document if isinstance(document, Reported) else parse_reported(document)
        except ConfigError as exc:
            raise InvalidDocument(str(exc)) from None
        row = {"version": report.desired_version, "document": json.dumps(report.to_json(), sort_keys=True),
               "received_at": now}
        with self.store.begin() as conn:
            if conn.execute(t.reported.update().where(t.reported.c.device_id == device_id).values(**row)).rowcount == 0:
                conn.execute(t.reported.insert().values(device_id=device_id, **row))
            conn.execute(t.devices.update().where(t.devices.c.device_id == device_id).values(
                model_digest=report.model_digest[:128], variant=report.variant[:128], threshold=report.threshold,
                last_seen=now))

    def reported(self, device_id: str) -> dict[str, Any] | None:
        with self.store.begin() as conn:
            row = conn.execute(sa.select(t.reported).where(t.reported.c.device_id == device_id)).first()
        return None if row is None else {"version": row.version, "document": json.loads(row.document),
                                         "received_at": row.received_at}

    def _drifting(self, now: float) -> tuple[Any, list[Any]]:
        """The join and the conditions of drift, in SQL (the rows that do not drift stay in the database)."""
        eff, rep, dev = t.desired_effective, t.reported, t.devices
        joined = (eff.join(dev, dev.c.device_id == eff.c.device_id)
                  .outerjoin(rep, rep.c.device_id == eff.c.device_id))
        return joined, [dev.c.revoked_at.is_(None), eff.c.since < now - self.drift_after_s,
                        rep.c.version.is_distinct_from(eff.c.version)]

    def drift(self, *, now: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """Devices whose reported version differs from the effective one for longer than `drift_after_s`
        (by id; the first `limit`, when given)."""
        now = time.time() if now is None else now
        eff, rep = t.desired_effective, t.reported
        joined, where = self._drifting(now)
        query = (sa.select(eff.c.device_id, eff.c.version.label("desired_version"), eff.c.since,
                           rep.c.version.label("reported_version"), rep.c.received_at)
                 .select_from(joined).where(*where).order_by(eff.c.device_id))
        if limit is not None:
            query = query.limit(max(0, limit))
        with self.store.begin() as conn:
            rows = conn.execute(query).all()
        return [dict(r._mapping, behind_s=now - r.since) for r in rows]

    def drift_count(self, *, now: float | None = None) -> int:
        """How many devices `drift` lists."""
        joined, where = self._drifting(time.time() if now is None else now)
        with self.store.begin() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(joined).where(*where)).scalar_one())
