"""A release: one signed, versioned unit of a variant set, its escalation policy, budgets and energy profile.

On disk, a directory (or a tar archive of it, `pack_release`):

```
release.json    the document below; its sha256 is the release's digest ("sha256:...")
release.sig     Ed25519 over release.json's exact bytes (the same format as a package's manifest.sig)
variants/       a copy of the variant set (variants.json and one package directory per rung)
```

`release.json` names the release and its version, holds the policy (the agent's `policy:` section, the
calibrated threshold, the budgets and the energy profile) and the sha256 of every file under
`variants/`, so the one signature covers everything a device will run. It may list the digests of the
releases a device may roll back to from this one (`rollback_to`): an older release is refused by a
device's version floor unless the release it is leaving carries that permission, signed.

```yaml
# policy.yaml for `tierkit fleet release create VARIANTS --policy policy.yaml --sign-key ops.key`
name: digits
version: "7"
threshold: 0.82
policy: {score: calibrated}
budget: {latency_ms: 25, energy_mj: 4}
energy_profile: generic-cpu
```

Example:
    >>> rel = create_release("out/variants", load_policy("policy.yaml"), "rel-7", sign_key=key)
    >>> rel.digest
    'sha256:9f2c...'
    >>> open_release("rel-7", trusted_keys=[pub]).variant_set().recommended.id
    'int8-ort'
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from compilers import signing
from compilers.package import pack, sha256_file, unpack
from compilers.variants import VariantSet, is_variant_set
from compilers.version_floor import VersionFloor
from runtimes.budget import BudgetOverride
from runtimes.documents import read_document, validation_problems
from runtimes.errors import ConfigError, IntegrityError, PackageError, SignatureError, UnsafeArchiveError

RELEASE_FILE = "release.json"
RELEASE_SIG = "release.sig"
VARIANTS_DIR = "variants"
SCHEMA = 1
KIND = "tierkit-release"


class ReleasePolicy(BaseModel):
    """What `policy.yaml` may hold. Unknown keys are refused: a typo would silently do nothing."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, min_length=1, max_length=128)
    version: str = Field(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z][0-9A-Za-z.\-]*$")
    threshold: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    policy: dict[str, Any] = Field(default_factory=dict)
    budget: dict[str, Any] = Field(default_factory=dict)  # the fields of `runtimes.budget.Budget` it sets
    energy_profile: str | dict[str, Any] | None = None
    rollback_to: list[str] = Field(default_factory=list)

    @field_validator("budget")
    @classmethod
    def _budget(cls, value: dict[str, Any]) -> dict[str, Any]:
        return BudgetOverride.parse(value).to_json()  # Budget's own rules; ConfigError is a ValueError


@dataclass(frozen=True)
class Release:
    """A verified release directory. `digest` names it; `document` is its parsed release.json."""

    directory: Path
    digest: str
    document: dict[str, Any]
    key_id: str | None

    @property
    def name(self) -> str:
        return str(self.document["name"])

    @property
    def version(self) -> str:
        return str(self.document["version"])

    @property
    def threshold(self) -> float | None:
        value = self.document.get("threshold")
        return None if value is None else float(value)

    @property
    def policy(self) -> dict[str, Any]:
        return dict(self.document.get("policy") or {})

    @property
    def budget(self) -> BudgetOverride:
        """The budget fields the release sets (checked when the release was opened)."""
        return BudgetOverride.parse({k: v for k, v in (self.document.get("budget") or {}).items() if v is not None})

    @property
    def energy_profile(self) -> str | dict[str, Any] | None:
        value = self.document.get("energy_profile")
        return value if isinstance(value, (str, dict)) else None

    @property
    def rollback_to(self) -> tuple[str, ...]:
        return tuple(self.document.get("rollback_to") or ())

    @property
    def variants_dir(self) -> Path:
        return self.directory / VARIANTS_DIR

    def variant_set(self) -> VariantSet:
        return VariantSet.load(self.variants_dir)


def digest_of(document_bytes: bytes) -> str:
    return "sha256:" + hashlib.sha256(document_bytes).hexdigest()


def load_policy(path: str | Path) -> dict[str, Any]:
    """Read and validate `policy.yaml` (or JSON); `ConfigError` naming each problem."""
    return validate_policy(read_document(Path(path), "release policy"), where=str(path))


def validate_policy(doc: Any, *, where: str = "release policy") -> dict[str, Any]:
    try:
        return ReleasePolicy.model_validate(doc).model_dump(exclude_none=True)
    except ValidationError as exc:
        msg = f"{where}: {validation_problems(exc)}"
        raise ConfigError(msg) from None


def create_release(variants_dir: str | Path, policy: Mapping[str, Any], out_dir: str | Path, *,
                   sign_key: Ed25519PrivateKey | None, rollback_to: Iterable[str] = ()) -> Release:
    """Copy the variant set into `out_dir/variants`, write release.json over it and sign it."""
    src, out = Path(variants_dir), Path(out_dir)
    if not is_variant_set(src):
        msg = f"{src} is not a variant set (no variants.json); build one with `tierkit compile`"
        raise PackageError(msg)
    checked = validate_policy(dict(policy))
    variants = VariantSet.load(src)
    for entry in variants:  # every rung opens (hashes, signatures if any) before it is released
        variants.open(entry.id)
    if out.exists() and any(out.iterdir()):
        msg = f"{out} exists and is not empty; choose a new directory for the release"
        raise ConfigError(msg)
    shutil.copytree(src, out / VARIANTS_DIR, symlinks=False, dirs_exist_ok=True)
    files = {p.relative_to(out).as_posix(): sha256_file(p) for p in sorted((out / VARIANTS_DIR).rglob("*"))
             if p.is_file()}
    rollbacks = sorted({*checked.pop("rollback_to", []), *rollback_to})
    doc = {"schema_version": SCHEMA, "kind": KIND, "name": checked.pop("name", None) or variants.name,
           "target": variants.target, "created_at": time.time(), **checked, "rollback_to": rollbacks,
           "files": files}
    body = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    (out / RELEASE_FILE).write_bytes(body)
    if sign_key is not None:
        (out / RELEASE_SIG).write_bytes(signing.sign(body, sign_key))
    return Release(out, digest_of(body), doc, signing.key_id(sign_key.public_key()) if sign_key else None)


def open_release(directory: str | Path, *, trusted_keys: Iterable[Ed25519PublicKey] | None,
                 floor: VersionFloor | None = None, leaving: Release | None = None,
                 expect_digest: str | None = None, record: bool = False) -> Release:
    """Verify a release directory: signature (when keys are given), digest, every file's hash, no
    extra or linked file, and the version floor. An older release passes the floor only when
    `leaving` (the verified release the device runs now) lists its digest in `rollback_to`.
    `record` moves the floor (do it when the release is committed, not when it is staged)."""
    root = Path(directory)
    where = f"release {str(root)!r}"
    try:
        body = (root / RELEASE_FILE).read_bytes()
    except OSError:
        msg = f"{where} has no {RELEASE_FILE}: not a release (create one with `tierkit fleet release create`)"
        raise PackageError(msg) from None
    digest = digest_of(body)
    if expect_digest is not None and digest != expect_digest:
        msg = f"{where} is {digest}, not the release {expect_digest} that was asked for"
        raise IntegrityError(msg)
    keys = list(trusted_keys) if trusted_keys is not None else None
    key_id = None
    if keys:
        sig = root / RELEASE_SIG
        key_id = signing.verify(body, sig.read_bytes() if sig.is_file() else None, keys, where)
    elif keys is not None:
        msg = f"{where}: no trusted key to verify it with; configure the operators' public key"
        raise SignatureError(msg)
    doc = _parse(body, where)
    _check_files(root, doc["files"], where)
    if floor is not None:
        ok = leaving is not None and digest in leaving.rollback_to
        how = (f"a rollback that the running release lists in its signed rollback_to "
               f"(running: {leaving.digest if leaving else 'none'})")
        floor.admit_version(f"release:{doc['name']}", doc["version"], where, rollback_ok=ok, record=record, how=how)
    return Release(root, digest, doc, key_id)


def _parse(body: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict) or doc.get("kind") != KIND or doc.get("schema_version") != SCHEMA:
            raise ValueError(f"kind/schema_version must be {KIND!r}/{SCHEMA}")  # noqa: EM102
        files = doc.get("files")
        if not isinstance(files, dict) or not files or not all(isinstance(v, str) for v in files.values()):
            raise ValueError("'files' must map paths to sha256")  # noqa: EM101
        validate_policy({k: doc[k] for k in ReleasePolicy.model_fields if k in doc}, where=where)
    except (ValueError, TypeError, ConfigError) as exc:
        msg = f"{where}: {RELEASE_FILE} is not a valid release document ({exc})"
        raise IntegrityError(msg) from None
    return doc


def _check_files(root: Path, files: Mapping[str, str], where: str) -> None:
    seen = set()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            msg = f"{where}: {rel} is a symlink; releases hold plain files only"
            raise UnsafeArchiveError(msg)
        if path.is_dir() or rel in (RELEASE_FILE, RELEASE_SIG):
            continue
        if rel not in files:
            msg = f"{where}: {rel} is not listed in {RELEASE_FILE}; the release was altered after signing"
            raise IntegrityError(msg)
        if sha256_file(path) != files[rel]:
            msg = f"{where}: {rel} does not match its sha256 in {RELEASE_FILE}; the release was altered"
            raise IntegrityError(msg)
        seen.add(rel)
    missing = sorted(set(files) - seen)
    if missing:
        msg = f"{where}: {len(missing)} file(s) listed in {RELEASE_FILE} are missing, e.g. {missing[0]}"
        raise IntegrityError(msg)


def pack_release(directory: str | Path, archive: str | Path) -> Path:
    """One tar archive of a release directory, for download."""
    return pack(directory, archive, marker=RELEASE_FILE)


def unpack_release(archive: str | Path, target: str | Path) -> Path:
    """Extract safely (no links, no path outside `target`, size caps); verify with `open_release`."""
    return unpack(archive, target)
