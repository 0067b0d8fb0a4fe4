"""A variant set: the packages compiled from one model for one target, ordered by cost.

On disk: a directory with `variants.json` and one package directory per variant.

The index is not signed; each package is. So the index may only point inside its own directory
(no absolute path, no `..`, no symlink leading out), and each package it opens must be the rung the
index says: the set's model name and target, the entry's precision and runtime. An index edited to
point at an older signed package elsewhere (a rollback without the signing key) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from compilers.manifest import MANIFEST_FILE
from compilers.package import ModelPackage
from compilers.version_floor import VersionFloor
from runtimes.errors import IntegrityError, PackageError, UnsafeArchiveError

INDEX_FILE = "variants.json"
INDEX_SCHEMA = 1


@dataclass(frozen=True)
class VariantEntry:
    """One rung of the ladder, as listed in the index (a summary of its manifest)."""

    id: str
    path: str
    precision: str
    runtime: str
    passes: list[str]
    fidelity: dict[str, float]
    latency_ms: dict[str, Any]
    size_bytes: int
    energy: dict[str, Any] = field(default_factory=dict)
    recommended: bool = False
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def cost_ms(self) -> float:
        """Build-host p50 latency at batch 1, the ladder's ordering key."""
        return float(self.latency_ms.get("batch_1", {}).get("p50", float("inf")))

    def __repr__(self) -> str:
        star = ", recommended" if self.recommended else ""
        return f"<VariantEntry {self.id} {self.precision}/{self.runtime} p50 {self.cost_ms:.3g} ms{star}>"


@dataclass(frozen=True)
class VariantSet:
    """The variants of one model for one target, cheapest first."""

    directory: Path
    name: str
    target: str
    entries: tuple[VariantEntry, ...]
    rejected: tuple[dict[str, Any], ...] = ()
    build: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[VariantEntry]:
        return iter(self.entries)

    def __repr__(self) -> str:
        rec = next((e.id for e in self.entries if e.recommended), None)
        return (f"<VariantSet {self.name!r} target={self.target!r} {len(self.entries)} kept, "
                f"{len(self.rejected)} refused, recommended={rec!r} at {str(self.directory)!r}>")

    def __str__(self) -> str:
        """The compile report as a table (kept rungs cheapest first, then the refused ones with why)."""
        from compilers.report import format_table, report_rows

        sizes = tuple(self.entries[0].batch_sizes or (1,)) if self.entries else (1,)
        rows = self.build.get("report") or report_rows(list(self.entries), list(self.rejected),
                                                        self.build.get("baseline_latency_ms", {}), sizes)
        return f"{self!r}\n{format_table(rows, sizes)}"

    def __len__(self) -> int:
        return len(self.entries)

    def entry(self, variant_id: str) -> VariantEntry:
        for e in self.entries:
            if e.id == variant_id:
                return e
        msg = f"variant {variant_id!r} is not in {self.directory}; it has {[e.id for e in self.entries]}"
        raise PackageError(msg)

    @property
    def recommended(self) -> VariantEntry:
        return next((e for e in self.entries if e.recommended), self.entries[0])

    def open(self, variant_id: str | None = None, *, trusted_keys: Iterable[Ed25519PublicKey] | None = None,
             floor: VersionFloor | None = None) -> ModelPackage:
        entry = self.entry(variant_id) if variant_id else self.recommended
        package = ModelPackage.open(variant_path(self.directory, entry.path), trusted_keys=trusted_keys)
        check_binding(package, self.name, self.target, entry)
        if floor is not None:
            floor.admit(package.manifest, f"variant {entry.id!r} of {str(self.directory)!r}")
        return package

    def write(self) -> Path:
        doc = {"schema_version": INDEX_SCHEMA, "name": self.name, "target": self.target,
               "variants": [asdict(e) for e in sorted(self.entries, key=lambda e: e.cost_ms)],
               "rejected": list(self.rejected), "build": self.build}
        path = self.directory / INDEX_FILE
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> VariantSet:
        directory = Path(directory)
        path = directory / INDEX_FILE
        try:
            doc = json.loads(path.read_text())
            entries = tuple(VariantEntry(**e) for e in doc["variants"])
            if not entries:
                raise ValueError("no variants")  # noqa: EM101 - caught below
            if len({e.id for e in entries}) != len(entries):
                raise ValueError("two variants share an id")  # noqa: EM101 - caught below
            for e in entries:
                variant_path(directory, e.path)
            return cls(directory, doc["name"], doc["target"], entries, tuple(doc.get("rejected", ())),
                       doc.get("build", {}))
        except OSError:
            msg = f"{directory} has no {INDEX_FILE}: not a variant set"
            raise PackageError(msg) from None
        except (ValueError, KeyError, TypeError) as exc:
            msg = f"{path} is not a valid variant index ({exc})"
            raise PackageError(msg) from None


def variant_path(directory: Path, rel: str) -> Path:
    """`directory / rel`, refused unless it stays inside `directory` (also through symlinks)."""
    where = f"variant index {str(directory / INDEX_FILE)!r}"
    pure = PurePosixPath(rel) if isinstance(rel, str) else None
    if pure is None or pure.is_absolute() or not pure.parts or ".." in pure.parts or "\\" in rel:
        msg = f"{where}: variant path {str(rel)[:200]!r} leaves the variant set; paths are relative, without '..'"
        raise UnsafeArchiveError(msg)
    path = directory.joinpath(*pure.parts)
    try:
        inside = path.resolve().is_relative_to(directory.resolve())
    except OSError:
        inside = False
    if not inside or any(p.is_symlink() for p in (path, *path.parents) if p.is_relative_to(directory)):
        msg = f"{where}: variant path {rel!r} is or passes through a symlink; variant sets hold plain directories"
        raise UnsafeArchiveError(msg)
    return path


def check_binding(package: ModelPackage, name: str, target: str, entry: VariantEntry) -> None:
    """Refuse a package that is not the rung the (unsigned) index describes."""
    m = package.manifest
    got, want = (m.name, m.target, m.precision, m.runtime), (name, target, entry.precision, entry.runtime)
    if got != want:
        msg = (f"variant {entry.id!r} at {str(package.directory)!r} is {got[0]}/{got[1]}/{got[2]}/{got[3]} "
               f"(name/target/precision/runtime) but the index says {'/'.join(want)}: the index does not "
               "describe this package; rebuild the variant set")
        raise IntegrityError(msg)


def is_variant_set(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def is_package(path: str | Path) -> bool:
    p = Path(path)
    return (p / MANIFEST_FILE).is_file() or (p.is_file() and p.suffix == ".tkpkg")
