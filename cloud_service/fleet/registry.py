"""The device registry: enrollment tokens, enrollment (CSR -> certificate), operator tokens, revocation.

A one-time enrollment token carries the labels its device will have; only its SHA-256 is stored.
Enrolling exchanges it, once and before it expires, for a device id, a certificate the fleet CA
signs over the device's own key, and an MQTT password (the plain alternative to mutual TLS).
Revoking a device refuses it at the API, drops its telemetry, and removes it from the broker
password file the fleet writes (`write_broker_passwords`), which the broker reloads on SIGHUP.

Example:
    >>> registry = Registry(store, FleetCA.load_or_create(data_dir))
    >>> token = registry.create_token({"site": "berlin"}, expires_s=86400)
    >>> enrolled = registry.enroll(token, csr_pem, hardware={...}, agent_version="0.1.0")
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from cloud_service.fleet import schema as t
from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.errors import (
    DeviceRevoked,
    EnrollmentRefused,
    Forbidden,
    InvalidDocument,
    Unauthorized,
    UnknownDevice,
)
from cloud_service.fleet.store import FleetStore
from cloud_service.identity import check_device_id as check_issuable
from cloud_service.protocol import topics

ROLES = ("read", "admin")


def parse_labels(text: str | dict[str, str] | None, *, where: str = "labels") -> dict[str, str]:
    """`site=berlin,kind=cam` (or a mapping) -> {"site": "berlin", "kind": "cam"}."""
    if text is None or text == "":
        return {}
    items = text.items() if isinstance(text, dict) else (p.partition("=")[::2] for p in str(text).split(","))
    out: dict[str, str] = {}
    for k, v in items:
        key, value = str(k).strip(), str(v).strip()
        if not key or not value or any(c in key + value for c in ",=*/"):
            msg = f"{where} {text!r} must be k=v pairs separated by commas, e.g. site=berlin,kind=cam"
            raise InvalidDocument(msg)
        if len(key) > 128 or len(value) > 256:
            msg = f"{where} {key!r}: a label key has at most 128 characters and a value at most 256"
            raise InvalidDocument(msg)
        out[key] = value
    return out


def write_file(path: Path, text: str, *, mode: int) -> None:
    """Replace `path` with `text` atomically, with permissions `mode`. Each writer has a temporary file of its
    own, so writers racing (two enrollments at once, two fleet processes) each leave a whole file, never a
    missing one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def mosquitto_hash(password: str, *, iterations: int = 101) -> str:
    """A `mosquitto_passwd` entry's hash ($7$: PBKDF2-HMAC-SHA512, 12-byte salt), readable by Mosquitto 2."""
    salt = os.urandom(12)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


@dataclass(frozen=True)
class Enrolled:
    """What a device receives once: its id, certificate, the CA's certificate and its MQTT password."""

    device_id: str
    cert_pem: str
    ca_pem: str
    mqtt_username: str
    mqtt_password: str
    labels: dict[str, str]


def insert_devices(conn: Any, rows: list[dict[str, Any]]) -> None:
    """Insert `devices` rows (`labels` as JSON text) and index their labels (`device_labels`: the device table's
    `k=v` filter). Enrollment writes devices through this; so may a bulk import."""
    if not rows:
        return
    conn.execute(t.devices.insert(), rows)
    labels = [{"key": k, "value": str(v), "device_id": r["device_id"]}
              for r in rows for k, v in json.loads(r.get("labels") or "{}").items()]
    if labels:
        conn.execute(t.device_labels.insert(), labels)


class Registry:
    """Devices and tokens over a `FleetStore`. Args: store; ca: the fleet CA (signs CSRs)."""

    def __init__(self, store: FleetStore, ca: FleetCA | None = None) -> None:
        self.store, self.ca = store, ca

    # -- enrollment tokens ---------------------------------------------------------------------

    def create_token(self, labels: dict[str, str], *, expires_s: float = 86400.0) -> str:
        if expires_s <= 0:
            msg = f"a token's lifetime must be positive, got {expires_s} s"
            raise InvalidDocument(msg)
        token = "tke_" + secrets.token_urlsafe(24)
        now = time.time()
        with self.store.begin() as conn:
            conn.execute(t.enrollment_tokens.insert().values(
                token_hash=_hash(token), labels=json.dumps(parse_labels(labels)), created_at=now,
                expires_at=now + expires_s))
        return token

    def enroll(self, token: str, csr_pem: str, *, hardware: dict[str, Any] | None = None,
               agent_version: str = "", now: float | None = None,
               on_issue: Callable[[str, str], None] | None = None) -> Enrolled:
        """Exchange a one-time token for an identity; `EnrollmentRefused` for a bad, expired or used token or CSR.

        `on_issue(device_id, mqtt_password)` runs inside the enrollment's transaction (e.g. to create the
        device's broker account): if it raises, nothing is enrolled and the token stays unused."""
        if self.ca is None:
            msg = "this fleet process has no CA (start it with a data directory)"
            raise EnrollmentRefused(msg)
        now = time.time() if now is None else now
        device_id = check_issuable("dev-" + secrets.token_hex(6))  # the CA signs only names fit to be topic levels
        cert_pem, serial = self.ca.sign(csr_pem, device_id=device_id)  # validates the CSR before any write
        password = secrets.token_urlsafe(24)
        with self.store.begin() as conn:
            # the UPDATE ... WHERE used_at IS NULL is the one-time guard: two racing enrollments, one wins
            row = conn.execute(sa.select(t.enrollment_tokens).where(
                t.enrollment_tokens.c.token_hash == _hash(token))).first()
            if row is None:
                msg = "enrollment token is unknown; create one with `tierkit fleet token create`"
                raise EnrollmentRefused(msg)
            if row.used_at is not None:
                msg = f"enrollment token was already used (by {row.device_id}); tokens are one-time, create another"
                raise EnrollmentRefused(msg)
            if row.expires_at < now:
                msg = "enrollment token has expired; create another with `tierkit fleet token create`"
                raise EnrollmentRefused(msg)
            claimed = conn.execute(t.enrollment_tokens.update().where(
                t.enrollment_tokens.c.token_hash == row.token_hash, t.enrollment_tokens.c.used_at.is_(None)
            ).values(used_at=now, device_id=device_id)).rowcount
            if claimed != 1:
                msg = "enrollment token was already used; tokens are one-time, create another"
                raise EnrollmentRefused(msg)
            insert_devices(conn, [{
                "device_id": device_id, "labels": row.labels, "hardware": json.dumps(hardware or {}),
                "agent_version": str(agent_version)[:64], "cert_serial": serial,
                "mqtt_password_hash": mosquitto_hash(password), "enrolled_at": now}])
            if on_issue is not None:
                on_issue(device_id, password)
        return Enrolled(device_id, cert_pem, self.ca.cert_pem, device_id, password, json.loads(row.labels))

    # -- devices -------------------------------------------------------------------------------

    def device(self, device_id: str) -> dict[str, Any]:
        with self.store.begin() as conn:
            row = conn.execute(sa.select(t.devices).where(t.devices.c.device_id == device_id)).first()
        if row is None:
            msg = f"no device {device_id!r} is enrolled; `tierkit fleet devices` lists them"
            raise UnknownDevice(msg)
        return _device_dict(row)

    def check_active(self, device_id: str) -> dict[str, Any]:
        dev = self.device(device_id)
        if dev["revoked_at"] is not None:
            msg = f"device {device_id!r} was revoked"
            raise DeviceRevoked(msg)
        return dev

    def devices(self, labels: dict[str, str] | None = None, *, include_revoked: bool = True) -> list[dict[str, Any]]:
        with self.store.begin() as conn:
            rows = conn.execute(sa.select(t.devices).order_by(t.devices.c.device_id)).all()
        out = [_device_dict(r) for r in rows]
        want = labels or {}
        return [d for d in out if all(d["labels"].get(k) == v for k, v in want.items())
                and (include_revoked or d["revoked_at"] is None)]

    def revoke(self, device_id: str) -> None:
        with self.store.begin() as conn:
            n = conn.execute(t.devices.update().where(t.devices.c.device_id == device_id)
                             .values(revoked_at=time.time())).rowcount
        if n != 1:
            msg = f"no device {device_id!r} is enrolled; nothing was revoked"
            raise UnknownDevice(msg)

    def revoked_certificates(self) -> list[tuple[str, float]]:
        """(certificate serial hex, revoked at) of every revoked device, for the CA's revocation list."""
        with self.store.begin() as conn:
            rows = conn.execute(sa.select(t.devices.c.cert_serial, t.devices.c.revoked_at)
                                .where(t.devices.c.revoked_at.is_not(None))).all()
        return [(r.cert_serial, float(r.revoked_at)) for r in rows]

    def write_broker_passwords(self, path: Path, *, extra: dict[str, str] | None = None) -> int:
        """Write a Mosquitto password file of every active device (plus `extra` user -> password). Atomic."""
        lines = [f"{user}:{mosquitto_hash(pw)}" for user, pw in sorted((extra or {}).items())]
        with self.store.begin() as conn:
            rows = conn.execute(sa.select(t.devices.c.device_id, t.devices.c.mqtt_password_hash)
                                .where(t.devices.c.revoked_at.is_(None)).order_by(t.devices.c.device_id)).all()
        lines += [f"{r.device_id}:{r.mqtt_password_hash}" for r in rows]
        write_file(path, "\n".join(lines) + "\n", mode=0o600)
        return len(lines)

    # -- operator tokens -----------------------------------------------------------------------

    def create_operator_token(self, name: str, role: str) -> str:
        if role not in ROLES:
            msg = f"operator token role {role!r} is not one of {', '.join(ROLES)}"
            raise InvalidDocument(msg)
        token = f"tko_{role}_" + secrets.token_urlsafe(24)
        with self.store.begin() as conn:
            conn.execute(t.operator_tokens.insert().values(token_hash=_hash(token), name=name, role=role,
                                                           created_at=time.time()))
        return token

    def authorize(self, token: str | None, *, write: bool) -> str:
        """The operator name for a valid token; `Unauthorized` / `Forbidden` otherwise."""
        if not token:
            msg = "an operator token is required (Authorization: Bearer TOKEN): `tierkit fleet operator create`"
            raise Unauthorized(msg)
        with self.store.begin() as conn:
            row = conn.execute(sa.select(t.operator_tokens).where(
                t.operator_tokens.c.token_hash == _hash(token))).first()
        if row is None:
            msg = "the operator token is not known"
            raise Unauthorized(msg)
        if write and row.role != "admin":
            msg = f"operator token {row.name!r} is read-only; this needs an admin token"
            raise Forbidden(msg)
        return str(row.name)


def _device_dict(row: Any) -> dict[str, Any]:
    d = dict(row._mapping)
    d.pop("mqtt_password_hash", None)
    d["labels"] = json.loads(d["labels"])
    d["hardware"] = json.loads(d["hardware"])
    return d


def check_device_id(device_id: str) -> str:
    try:
        return topics.check_device_id(device_id)
    except ValueError as exc:
        raise InvalidDocument(str(exc)) from None
