"""A version floor per model: once a version of a model was accepted, an older one is refused.

Signatures say who built a package, not whether it is current: an older signed package is still
validly signed, and putting it back is a rollback without the signing key. A `VersionFloor` remembers,
in a small JSON file, the highest version of each model that was opened, and refuses anything older,
unless the older package is an explicit, signed rollback: its manifest's `build` section (covered by
the signature) holds `{"rollback_from": "<version>"}`, and that version is not below the floor. So a
rollback from 5 to 4 is accepted while 5 is the newest seen, and refused again once 6 was opened.

Example:
    >>> floor = VersionFloor("/var/lib/tierkit/floor.json")
    >>> pkg = ModelPackage.open("digits.tkpkg", trusted_keys=keys, floor=floor)
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from compilers.manifest import Manifest
from runtimes.errors import ConfigError, IntegrityError

ROLLBACK_KEY = "rollback_from"


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Order versions as release numbers: "10" > "9", "1.10" > "1.9"; other parts compare as text."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in version.replace("-", ".").split("."))


class VersionFloor:
    """The highest accepted version per model, kept in `path` (written atomically)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            doc = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError) as exc:
            msg = f"version floor file {str(self.path)!r} is unreadable ({exc}); restore it from a backup"
            raise ConfigError(msg) from None
        if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
            msg = f"version floor file {str(self.path)!r} must map model names to version strings"
            raise ConfigError(msg)
        self._floor: dict[str, str] = dict(doc)

    def get(self, model: str) -> str | None:
        return self._floor.get(model)

    def admit(self, manifest: Manifest, where: str) -> None:
        """Refuse `manifest` if it is older than the floor and not a signed rollback; else raise the
        floor to its version (or set it to the rollback's version)."""
        rollback = manifest.build.get(ROLLBACK_KEY) if isinstance(manifest.build, dict) else None
        with self._lock:
            floor = self._floor.get(manifest.name)
            ok = isinstance(rollback, str) and floor is not None and version_key(rollback) >= version_key(floor)
        how = (f"a signed rollback (manifest build.{ROLLBACK_KEY} naming a version not below {floor!r})"
               if floor is not None else "")
        self.admit_version(manifest.name, manifest.version, where, rollback_ok=ok, how=how)

    def admit_version(self, name: str, version: str, where: str, *, rollback_ok: bool = False,
                      record: bool = True, how: str = "a signed rollback") -> None:
        """Refuse `version` of `name` if it is below the floor, unless `rollback_ok`; with `record`,
        move the floor to it (up, or down to an admitted rollback). `record=False` only checks."""
        with self._lock:
            floor = self._floor.get(name)
            older = floor is not None and version_key(version) < version_key(floor)
            if older and not rollback_ok:
                msg = (f"{where}: {name} version {version[:40]!r} is older than version {floor!r}, already "
                       f"accepted here; an older version is accepted only as {how}")
                raise IntegrityError(msg)
            if record and (older or floor is None or version_key(version) > version_key(floor)):
                self._set(name, version)

    def _set(self, model: str, version: str) -> None:
        self._floor[model] = version
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self._floor, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path)
