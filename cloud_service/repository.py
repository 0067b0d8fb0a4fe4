"""The models a server answers for, loaded from a directory, swapped without dropping a request.

The directory holds, side by side:

- model packages (a directory with `manifest.json`, or a `.tkpkg` archive): served under the
  manifest's name, at the manifest's version. Several packages may share a name with different
  versions; an empty version in a request means the highest one (numeric order when versions are
  integers).
- variant sets (a directory with `variants.json`): served under the set's name, with every variant
  as a version named by its variant id (`digits` at version `int8`, ...). An empty version means
  the set's recommended variant.

`reload()` rescans the directory. A new or changed package is opened (hashes and, with trusted
keys, signature verified), its sessions are created and a smoke run on zero inputs must give the
declared outputs; only then does it replace the old version, in one step on the event loop. The
old version stops taking requests, finishes the ones it holds, and is closed. A package that fails
any check is refused, logged and counted, and whatever served before keeps serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cloud_service.batcher import BatchObserver
from cloud_service.config import ServerConfig
from cloud_service.errors import ModelNotFound
from cloud_service.models import ServedModel, open_model
from compilers.signing import load_public_key
from compilers.variants import INDEX_FILE, VariantSet, is_package, is_variant_set
from compilers.version_floor import VersionFloor
from runtimes.errors import TierkitError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Source:
    """One loadable version found by a scan: where it is and a cheap fingerprint of its content."""

    name: str
    version: str
    path: Path
    fingerprint: str
    variant: str | None = None
    recommended: bool = False


@dataclass
class ReloadReport:
    """What one `reload()` did, keyed by `name:version`."""

    loaded: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    unloaded: list[str] = field(default_factory=list)


@dataclass
class _Entry:
    """A model name's versions. Change them through `put`, `remove` and `recommend`: the default
    version is worked out there, once, not on every request."""

    versions: dict[str, ServedModel] = field(default_factory=dict)
    recommended: str | None = None
    _default: str | None = None

    @property
    def default(self) -> ServedModel | None:
        return None if self._default is None else self.versions.get(self._default)

    def put(self, version: str, model: ServedModel) -> ServedModel | None:
        """Install `model` as `version`; return the model it replaces."""
        old = self.versions.get(version)
        self.versions[version] = model
        self._refresh()
        return old

    def remove(self, version: str) -> ServedModel:
        model = self.versions.pop(version)
        self._refresh()
        return model

    def recommend(self, version: str) -> None:
        self.recommended = version
        self._refresh()

    def _refresh(self) -> None:
        if self.recommended in self.versions:
            self._default = self.recommended
        else:
            self._default = max(self.versions, key=_version_key) if self.versions else None


def _version_key(version: str) -> tuple[int, int, str]:
    return (1, int(version), "") if version.isdigit() else (0, 0, version)


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        if path.is_file():
            st = path.stat()
            if path.suffix == ".tkpkg":  # archives can be large: size and mtime stand in for content
                h.update(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode())
            else:
                h.update(path.read_bytes())
    return h.hexdigest()


class ModelRepository:
    """Loaded models by name and version.

    Args:
        config: the server's configuration (directory, trusted keys, per-model options).
        observer_for: returns the batch observer (metrics) of a model name.
        on_load: called with (model name, "loaded" | "refused") after every load attempt.

    Example:
        >>> repo = ModelRepository(config)
        >>> report = await repo.reload()
        >>> model = repo.get("digits")            # default version
    """

    def __init__(self, config: ServerConfig, *, observer_for: Callable[[str], BatchObserver | None] | None = None,
                 on_load: Callable[[str, str], None] | None = None) -> None:
        self.config = config
        self._observer_for: Callable[[str], BatchObserver | None] = observer_for or (lambda name: None)
        self._on_load: Callable[[str, str], None] = on_load or (lambda name, outcome: None)
        self._entries: dict[str, _Entry] = {}
        self._fingerprints: dict[tuple[str, str], str] = {}
        self._refused: dict[tuple[str, str], str] = {}
        self._scan_refused: dict[str, str] = {}  # directory entries refused while scanning, by fingerprint
        self._retiring: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()
        self._keys = [load_public_key(p) for p in config.trusted_keys] if config.trusted_keys else None
        self._floor = VersionFloor(config.version_floor) if config.version_floor else None

    def get(self, name: str, version: str = "") -> ServedModel:
        """The model to run, or `ModelNotFound`. Synchronous on purpose: no await between this and submit."""
        entry = self._entries.get(name)
        if entry is None or not entry.versions:
            msg = f"model {name!r} is not served here; served models: {sorted(self._entries)[:20]}"
            raise ModelNotFound(msg)
        model = entry.versions.get(version) if version else entry.default
        if model is None:
            msg = f"model {name!r} has no version {version!r}; versions: {sorted(entry.versions, key=_version_key)}"
            raise ModelNotFound(msg)
        return model

    def versions(self, name: str) -> list[str]:
        entry = self._entries.get(name)
        return sorted(entry.versions, key=_version_key) if entry else []

    def __iter__(self) -> Iterator[ServedModel]:
        for entry in list(self._entries.values()):
            yield from list(entry.versions.values())

    def __contains__(self, name: object) -> bool:
        entry = self._entries.get(name) if isinstance(name, str) else None
        return entry is not None and bool(entry.versions)

    def __len__(self) -> int:
        return sum(len(e.versions) for e in self._entries.values())

    async def reload(self) -> ReloadReport:
        """Rescan the directory; load new or changed versions, swap them in, retire removed ones."""
        async with self._lock:
            report = ReloadReport()
            sources = await asyncio.to_thread(self._scan, report)
            seen: set[tuple[str, str]] = set()
            for source in sources:
                key = (source.name, source.version)
                label = f"{source.name}:{source.version}"
                if key in seen:
                    report.refused[label] = f"{source.path} serves {label} again; rename one of them"
                    continue
                seen.add(key)
                entry = self._entries.setdefault(source.name, _Entry())
                if source.recommended:
                    entry.recommend(source.version)
                if self._fingerprints.get(key) == source.fingerprint or self._refused.get(key) == source.fingerprint:
                    continue
                await self._load(source, entry, report)
            for name, entry in list(self._entries.items()):
                for version in [v for v in entry.versions if (name, v) not in seen]:
                    self._retire(entry.remove(version))
                    self._fingerprints.pop((name, version), None)
                    report.unloaded.append(f"{name}:{version}")
                if not entry.versions:
                    del self._entries[name]
            self._refused = {k: v for k, v in self._refused.items() if k in seen}
            return report

    async def _load(self, source: _Source, entry: _Entry, report: ReloadReport) -> None:
        key, label = (source.name, source.version), f"{source.name}:{source.version}"
        options = self.config.options_for(source.name)
        observer: BatchObserver | None = self._observer_for(source.name)
        try:
            model = await asyncio.to_thread(open_model, source.path, source.name, source.version, options,
                                            trusted_keys=self._keys, variant=source.variant, floor=self._floor)
        except TierkitError as exc:
            old = "; the previous version keeps serving" if key in self._fingerprints else ""
            log.error("refused %s from %s: %s%s", label, source.path, exc, old)
            report.refused[label] = str(exc)
            self._refused[key] = source.fingerprint
            self._on_load(source.name, "refused")
            return
        model.start(observer)
        old_model = entry.put(source.version, model)  # the swap: requests looked up from now on get the new one
        self._fingerprints[key] = source.fingerprint
        self._refused.pop(key, None)
        if old_model is not None:
            self._retire(old_model)
        log.info("serving %s from %s (%d instance%s)", label, source.path, len(model.sessions),
                 "" if len(model.sessions) == 1 else "s")
        report.loaded.append(label)
        self._on_load(source.name, "loaded")

    def _retire(self, model: ServedModel) -> None:
        task = asyncio.get_running_loop().create_task(model.aclose(self.config.drain_timeout_s))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def aclose(self) -> None:
        """Drain and close every model (in-flight requests finish, up to the drain timeout)."""
        async with self._lock:
            for entry in self._entries.values():
                for model in entry.versions.values():
                    self._retire(model)
            self._entries.clear()
            if self._retiring:
                await asyncio.gather(*list(self._retiring), return_exceptions=True)

    # -- scanning (in a thread: it reads files) ------------------------------------------------

    def _scan(self, report: ReloadReport) -> list[_Source]:
        root = self.config.models_dir
        if not root.is_dir():
            log.warning("models directory %s does not exist", root)
            return []
        sources: list[_Source] = []
        for path in sorted(root.iterdir()):
            if path.name.startswith("."):
                continue
            try:
                if is_variant_set(path):
                    sources += self._scan_variant_set(path)
                elif is_package(path):
                    sources.append(self._scan_package(path))
            except (TierkitError, OSError) as exc:
                report.refused[path.name] = str(exc)
                log.error("cannot read %s: %s", path, exc)
                # counted once per content, as load refusals are, not once per rescan
                fingerprint = _digest(path, path / INDEX_FILE, path / "manifest.json")
                if self._scan_refused.get(path.name) != fingerprint:
                    self._scan_refused[path.name] = fingerprint
                    self._on_load(path.name, "refused")
        return sources

    def _scan_variant_set(self, path: Path) -> list[_Source]:
        vs = VariantSet.load(path)
        recommended = vs.recommended.id
        return [_Source(vs.name, e.id, path / e.path, _digest(path / e.path / "manifest.json",
                                                               path / e.path / "manifest.sig"),
                        variant=e.id, recommended=e.id == recommended) for e in vs.entries]

    def _scan_package(self, path: Path) -> _Source:
        if path.is_file():
            name, version = _peek_archive(path)
            return _Source(name, version, path, _digest(path))
        from compilers.manifest import Manifest

        manifest = Manifest.loads((path / "manifest.json").read_bytes(), where=f"package {str(path)!r}")
        return _Source(manifest.name, manifest.version, path, _digest(path / "manifest.json", path / "manifest.sig"))


def _peek_archive(path: Path) -> tuple[str, str]:
    """Name and version of an archived package, read from its manifest without verifying it."""
    import tarfile

    from compilers.manifest import Manifest
    from runtimes.errors import PackageError

    try:
        with tarfile.open(path, "r:*") as tar:
            member = tar.extractfile("manifest.json")
            raw = member.read() if member else b""
    except (tarfile.TarError, KeyError, OSError) as exc:
        msg = f"archive {str(path)!r} has no readable manifest.json ({exc})"
        raise PackageError(msg) from None
    manifest = Manifest.loads(raw, where=f"archive {str(path)!r}")
    return manifest.name, manifest.version

