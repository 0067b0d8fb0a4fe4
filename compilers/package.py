"""Model packages: a directory with `manifest.json` and its artifacts, or a single `.tkpkg` archive of it.

Writing computes the sha256 and size of every file and optionally signs the manifest. Opening
verifies every hash, and, when trusted keys are given, the signature. Archives are tar files,
extracted with no absolute paths, no `..`, no links or devices, and bounded sizes.

Example:
    >>> pkg = ModelPackage.open("digits-int8.tkpkg", trusted_keys=[load_public_key("ops.pub")])
    >>> with pkg.open_session() as session:
    ...     logits = session.run({"x": x})["logits"]
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from compilers import signing
from compilers.manifest import MANIFEST_FILE, Manifest
from compilers.version_floor import VersionFloor
from runtimes.errors import ConfigError, IntegrityError, PackageError, UnsafeArchiveError
from runtimes.registry import open_session
from runtimes.session import Session, SessionOptions

ARCHIVE_SUFFIX = ".tkpkg"
MAX_ARCHIVE_MEMBERS = 10_000
MAX_ARCHIVE_BYTES = 8 * 1024**3  # 8 GiB unpacked
_RESERVED = {MANIFEST_FILE, signing.SIGNATURE_FILE}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _package_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix()
                  not in _RESERVED)


def write_package(directory: str | Path, manifest: Manifest, *,
                  sign_key: Ed25519PrivateKey | None = None) -> ModelPackage:
    """Finalize `directory`, which already holds the artifacts: hash them, write the manifest, sign.

    The manifest's `files`, `size_bytes` and `created_at` are filled in here.
    """
    directory = Path(directory)
    if not (directory / manifest.artifact).is_file():
        msg = f"artifact {manifest.artifact!r} is not in {directory}"
        raise ConfigError(msg)
    for link in (p for p in directory.rglob("*") if p.is_symlink()):
        msg = f"package {directory} holds a symlink ({link}); packages hold plain files only"
        raise ConfigError(msg)
    files = {p.relative_to(directory).as_posix(): sha256_file(p) for p in _package_files(directory)}
    size = sum((directory / f).stat().st_size for f in files)
    manifest = manifest.replace(files=files, size_bytes=size,
                                created_at=manifest.created_at or datetime.now(UTC).isoformat(timespec="seconds"))
    raw = manifest.dumps()
    (directory / MANIFEST_FILE).write_bytes(raw)
    sig = directory / signing.SIGNATURE_FILE
    if sign_key is not None:
        sig.write_bytes(signing.sign(raw, sign_key))
    elif sig.exists():
        sig.unlink()
    return ModelPackage(directory, manifest, signed_by=None)


@dataclass(frozen=True)
class ModelPackage:
    """A verified package on disk. Build with `ModelPackage.open` or `write_package`."""

    directory: Path
    manifest: Manifest
    signed_by: str | None

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def artifact_path(self) -> Path:
        return self.directory / self.manifest.artifact

    def open_session(self, options: SessionOptions | None = None) -> Session:
        """A session on the artifact, with the manifest's precision pinned (whatever `options` says)."""
        options = dataclasses.replace(options or SessionOptions(), precision=self.manifest.precision)
        return open_session(self.artifact_path, backend=self.manifest.runtime, options=options)

    @classmethod
    def open(cls, path: str | Path, *, trusted_keys: Iterable[Ed25519PublicKey] | None = None,
             extract_to: str | Path | None = None, floor: VersionFloor | None = None) -> ModelPackage:
        """Open and verify a package directory or `.tkpkg` archive.

        Args:
            path: package directory, or archive file.
            trusted_keys: when given (even empty), the package must carry a signature by one of them.
            extract_to: where an archive is unpacked (default: a fresh temporary directory, removed
                when the returned package is garbage collected or the process exits, or at once when
                the archive is refused).
            floor: when given, a version older than the newest accepted before is refused unless it is
                a signed rollback (`compilers.version_floor`).

        Raises:
            PackageError, IntegrityError, SignatureError, UnsafeArchiveError.
        """
        path = Path(path)
        keys = None if trusted_keys is None else list(trusted_keys)
        if path.is_file():
            own = extract_to is None  # a temporary copy this call made: removed with the package object
            target = Path(tempfile.mkdtemp(prefix="tierkit-pkg-")) if own else Path(str(extract_to))
            try:
                unpack(path, target)
                package = cls._verify(target, keys)
                if floor is not None:
                    floor.admit(package.manifest, f"archive {str(path)!r}")
            except BaseException:
                if own:
                    shutil.rmtree(target, ignore_errors=True)
                raise
            if own:
                weakref.finalize(package, shutil.rmtree, str(target), True)
            return package
        if not path.is_dir():
            msg = f"{str(path)!r} is neither a package directory nor a {ARCHIVE_SUFFIX} archive"
            raise PackageError(msg)
        package = cls._verify(path, keys)
        if floor is not None:
            floor.admit(package.manifest, f"package {str(path)!r}")
        return package

    @classmethod
    def _verify(cls, directory: Path, keys: list[Ed25519PublicKey] | None) -> ModelPackage:
        where = f"package {str(directory)!r}"
        _refuse_links(directory, where)
        manifest_path = directory / MANIFEST_FILE
        if not manifest_path.is_file():
            msg = f"{where} has no {MANIFEST_FILE}: not a tierkit package"
            raise PackageError(msg)
        raw = manifest_path.read_bytes()
        signed_by = None
        sig_path = directory / signing.SIGNATURE_FILE
        if keys is not None:
            signed_by = signing.verify(raw, sig_path.read_bytes() if sig_path.is_file() else None, keys, where)
        manifest = Manifest.loads(raw, where=where)
        for rel, expected in manifest.files.items():
            file = _safe_join(directory, rel, where)
            if file.is_symlink() or not file.is_file():
                msg = f"{where}: file {rel!r} listed in the manifest is missing"
                raise IntegrityError(msg)
            actual = sha256_file(file)
            if actual != expected:
                msg = (f"{where}: {rel!r} has sha256 {actual[:16]}…, the manifest says {expected[:16]}…: "
                       "the file was modified or corrupted; rebuild or re-download the package")
                raise IntegrityError(msg)
        if manifest.artifact not in manifest.files:
            msg = f"{where}: the artifact {manifest.artifact!r} is not covered by the manifest's hashes"
            raise IntegrityError(msg)
        extra = {p.relative_to(directory).as_posix() for p in _package_files(directory)} - set(manifest.files)
        if extra:
            msg = f"{where}: files not listed in the manifest: {sorted(extra)[:5]}"
            raise IntegrityError(msg)
        return cls(directory, manifest, signed_by)


def _refuse_links(directory: Path, where: str) -> None:
    """Refuse a package holding a symlink anywhere (to a file or to a directory) or being one."""
    if directory.is_symlink():
        msg = f"{where} is a symlink; open the directory it points to, or copy it"
        raise UnsafeArchiveError(msg)
    for root, dirs, files in os.walk(directory, followlinks=False):
        for entry in (*dirs, *files):
            if (Path(root) / entry).is_symlink():
                link = (Path(root) / entry).relative_to(directory).as_posix()
                msg = f"{where} holds a symlink ({link!r}); packages hold plain files and directories only"
                raise UnsafeArchiveError(msg)


def _safe_join(root: Path, rel: str, where: str) -> Path:
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts:
        msg = f"{where}: path {rel!r} escapes the package"
        raise UnsafeArchiveError(msg)
    return root.joinpath(*pure.parts)


def pack(directory: str | Path, archive: str | Path, *, marker: str = MANIFEST_FILE) -> Path:
    """Write the package directory (or any directory holding `marker`, e.g. a release) as one tar
    archive (no compression: artifacts rarely shrink)."""
    directory, archive = Path(directory), Path(archive)
    if not (directory / marker).is_file():
        msg = f"{directory} has no {marker}: write it first"
        raise PackageError(msg)
    tmp = archive.with_name(archive.name + ".part")
    with tarfile.open(tmp, "w") as tar:
        for file in sorted(p for p in directory.rglob("*") if p.is_file()):
            info = tar.gettarinfo(str(file), arcname=file.relative_to(directory).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with file.open("rb") as fh:
                tar.addfile(info, fh)
    tmp.replace(archive)
    return archive


def unpack(archive: str | Path, target: str | Path, *, max_bytes: int = MAX_ARCHIVE_BYTES,
           max_members: int = MAX_ARCHIVE_MEMBERS) -> Path:
    """Extract a package archive into `target` safely; nothing is written outside `target`."""
    archive, target = Path(archive), Path(target)
    where = f"archive {str(archive)!r}"
    try:
        tar = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError) as exc:
        msg = f"{where} is not a readable package archive ({exc})"
        raise PackageError(msg) from None
    with tar:
        try:
            members = _checked_members(tar, where, max_bytes, max_members)
        except (tarfile.TarError, EOFError, OSError) as exc:
            msg = f"{where} is truncated or corrupt ({exc})"
            raise IntegrityError(msg) from None
        target.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target))
        try:
            for member in members:
                dest = _safe_join(staging, member.name, where)
                if member.isdir():
                    dest.mkdir(parents=True, exist_ok=True)
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                if src is None:
                    msg = f"{where}: cannot read entry {member.name!r}"
                    raise IntegrityError(msg)
                data = src.read()
                if len(data) != member.size:
                    msg = f"{where}: entry {member.name!r} is truncated ({len(data)} of {member.size} bytes)"
                    raise IntegrityError(msg)
                dest.write_bytes(data)
            for item in staging.iterdir():
                shutil.move(str(item), target / item.name)
        except (tarfile.TarError, EOFError, OSError, io.UnsupportedOperation) as exc:
            msg = f"{where} is truncated or corrupt ({exc})"
            raise IntegrityError(msg) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _checked_members(tar: tarfile.TarFile, where: str, max_bytes: int, max_members: int) -> list[tarfile.TarInfo]:
    members, total = [], 0
    for member in tar:
        members.append(member)
        if len(members) > max_members:
            msg = f"{where} has more than {max_members} entries"
            raise UnsafeArchiveError(msg)
        if not (member.isfile() or member.isdir()):
            msg = f"{where}: entry {member.name!r} is a link or special file; packages hold plain files only"
            raise UnsafeArchiveError(msg)
        _safe_join(Path("/"), member.name, where)
        total += member.size
        if total > max_bytes:
            msg = f"{where} unpacks to more than {max_bytes} bytes"
            raise UnsafeArchiveError(msg)
    return members
