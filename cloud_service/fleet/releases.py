"""Releases in the fleet: registered by digest after their signature verifies, stored as archives, served to devices.

A release (compilers/release.py) is verified against the fleet's release keys (Ed25519 public keys
the operators sign releases with) before it is registered: unsigned, wrong-key and altered releases
are refused. The registered archive (`pack_release`) lives under the fleet data directory,
`releases/<hex>.tar`; the `releases` table names it. Devices download it with
`GET /v1/releases/{digest}/archive` and HTTP Basic auth (their MQTT user and password).

Example:
    >>> reg = ReleaseRegistry(store, Path("fleet-data"), keys=[load_public_key("ops.pub")])
    >>> rel = reg.create("out/variants", "policy.yaml", sign_key=load_private_key("ops.key"))
    >>> reg.archive(rel["digest"])
    PosixPath('fleet-data/releases/9f2c....tar')
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cloud_service.fleet import schema as t
from cloud_service.fleet.errors import DeviceRevoked, ReleaseRefused, Unauthorized, UnknownRelease
from cloud_service.fleet.store import FleetStore
from compilers.release import create_release, load_policy, open_release, pack_release, unpack_release
from compilers.signing import load_public_key
from compilers.variants import VariantSet
from runtimes.errors import TierkitError

RELEASE_KEYS_DIR = "release-keys"


def configured_keys(data_dir: Path, extra: Sequence[Path] = ()) -> list[Ed25519PublicKey]:
    """The release keys given (`--release-key`), plus every `*.pub` in DATA_DIR/release-keys/."""
    paths = [*extra, *sorted((data_dir / RELEASE_KEYS_DIR).glob("*.pub"))]
    return [load_public_key(p) for p in paths]


class ReleaseRegistry:
    """Register, list and find releases over a `FleetStore` and a data directory.

    Args:
        store: the fleet database.
        data_dir: where archives are kept (`releases/`); shared by every fleet process that serves them.
        keys: the public keys a release must be signed with (none: every release is refused).
    """

    def __init__(self, store: FleetStore, data_dir: Path, keys: Sequence[Ed25519PublicKey] = ()) -> None:
        self.store, self.data_dir, self.keys = store, data_dir, list(keys)

    def register(self, directory: Path) -> dict[str, Any]:
        """Verify a release directory (or archive) and register it; registering it again is a no-op."""
        if directory.is_file():
            with tempfile.TemporaryDirectory(prefix="tierkit-release-") as tmp:
                return self.register(unpack_release(directory, Path(tmp) / "release"))
        if not self.keys:
            msg = ("the fleet has no release key to verify releases with: pass --release-key ops.pub or put "
                   f"the operators' public key in {self.data_dir / RELEASE_KEYS_DIR}/")
            raise ReleaseRefused(msg)
        try:
            rel = open_release(directory, trusted_keys=self.keys)
        except TierkitError as exc:
            msg = f"release refused: {exc}"
            raise ReleaseRefused(msg) from exc
        hexdigest = rel.digest.removeprefix("sha256:")
        archive = Path("releases") / f"{hexdigest}.tar"
        (self.data_dir / "releases").mkdir(parents=True, exist_ok=True)
        if not (self.data_dir / archive).exists():
            part = self.data_dir / "releases" / f".{hexdigest}.tmp.tar"
            pack_release(directory, part)
            part.replace(self.data_dir / archive)
        body = (directory / "release.json").read_text()
        with self.store.begin() as conn:
            if conn.execute(sa.select(t.releases.c.digest).where(t.releases.c.digest == rel.digest)).first() is None:
                conn.execute(t.releases.insert().values(digest=rel.digest, name=rel.name, version=rel.version,
                                                        manifest=body, created_at=time.time(),
                                                        archive=archive.as_posix()))
        return self.get(rel.digest)

    def create(self, variants_dir: Path, policy_file: Path, *, sign_key: Ed25519PrivateKey,
               rollback_to: Sequence[str] | None = None) -> dict[str, Any]:
        """`create_release` + `register`. `rollback_to` default: the newest registered release of the same name
        that was not rolled back (its latest rollout did not end rolled back)."""
        policy = load_policy(policy_file)
        if rollback_to is None:
            name = policy.get("name") or VariantSet.load(variants_dir).name
            newest = self.newest(str(name), skip=self.rolled_back())
            rollback_to = [newest["digest"]] if newest else []
        for digest in rollback_to:
            self.get(digest)  # a rollback target the fleet does not hold could never be sent to a device
        with tempfile.TemporaryDirectory(prefix="tierkit-release-") as tmp:
            rel = create_release(variants_dir, policy, Path(tmp) / "release", sign_key=sign_key,
                                 rollback_to=rollback_to)
            return self.register(rel.directory)

    def get(self, digest: str) -> dict[str, Any]:
        with self.store.begin() as conn:
            row = conn.execute(sa.select(t.releases).where(t.releases.c.digest == digest)).first()
        if row is None:
            msg = f"no release {digest!r} is registered; `tierkit fleet releases` lists them"
            raise UnknownRelease(msg)
        return _release_dict(row)

    def find(self, ref: str) -> dict[str, Any]:
        """A release by full digest, unique digest prefix (at least 8 hex digits), or NAME@VERSION."""
        rows = self.list()
        if "@" in ref:
            name, _, version = ref.partition("@")
            hits = [r for r in rows if r["name"] == name and r["version"] == version]
        else:
            want = ref if ref.startswith("sha256:") else "sha256:" + ref
            hits = [r for r in rows if r["digest"] == want] or (
                [r for r in rows if r["digest"].startswith(want)] if len(want) >= 15 else [])
        if len(hits) != 1:
            msg = (f"release {ref!r} {'is ambiguous' if hits else 'is not registered'}; give the digest or "
                   "NAME@VERSION (`tierkit fleet releases` lists them)")
            raise UnknownRelease(msg)
        return hits[0]

    def list(self) -> list[dict[str, Any]]:
        with self.store.begin() as conn:
            rows = conn.execute(sa.select(t.releases).order_by(t.releases.c.created_at)).all()
        return [_release_dict(r) for r in rows]

    def newest(self, name: str, *, exclude: str | None = None, skip: set[str] | None = None) -> dict[str, Any] | None:
        hits = [r for r in self.list() if r["name"] == name and r["digest"] != exclude
                and r["digest"] not in (skip or set())]
        return hits[-1] if hits else None

    def rolled_back(self) -> set[str]:
        """Releases whose latest rollout ended rolled back (or is being rolled back)."""
        r = t.rollouts.c
        with self.store.begin() as conn:
            last: dict[str, str] = {row.release: row.state for row in conn.execute(
                sa.select(r.release, r.state).order_by(r.id))}
        return {d for d, state in last.items() if state in ("rolled_back", "rollback_asked")}

    def archive(self, digest: str) -> Path:
        rel = self.get(digest)
        path: Path = self.data_dir / str(rel["archive"])
        if not rel["archive"] or not path.is_file():
            msg = f"release {digest} is registered but its archive {path} is missing from the fleet data directory"
            raise UnknownRelease(msg)
        return path


def _release_dict(row: Any) -> dict[str, Any]:
    doc = json.loads(row.manifest)
    return {"digest": row.digest, "name": row.name, "version": row.version or str(doc.get("version", "")),
            "created_at": row.created_at, "archive": row.archive, "budget": doc.get("budget") or {},
            "threshold": doc.get("threshold"), "rollback_to": doc.get("rollback_to") or [],
            "target": doc.get("target")}


def check_mosquitto_hash(password: str, encoded: str) -> bool:
    """Whether `password` matches a `mosquitto_passwd` $7$ entry (the hash enrollment stored)."""
    parts = encoded.split("$")
    if len(parts) != 5 or parts[1] != "7" or not parts[2].isdigit():
        return False
    try:
        salt, want = base64.b64decode(parts[3]), base64.b64decode(parts[4])
    except ValueError:
        return False
    got = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, int(parts[2]))
    return hmac.compare_digest(got, want)


def authenticate_device(store: FleetStore, username: str, password: str) -> str:
    """The device id for a device's MQTT user and password; `Unauthorized` (401) or `DeviceRevoked` (403)."""
    with store.begin() as conn:
        row = conn.execute(sa.select(t.devices.c.device_id, t.devices.c.mqtt_password_hash, t.devices.c.revoked_at)
                           .where(t.devices.c.device_id == username)).first()
    if row is None or not check_mosquitto_hash(password, row.mqtt_password_hash):
        msg = "device credentials are not valid (HTTP Basic: the MQTT user and password issued at enrollment)"
        raise Unauthorized(msg)
    if row.revoked_at is not None:
        msg = f"device {username!r} was revoked"
        raise DeviceRevoked(msg)
    return str(row.device_id)
