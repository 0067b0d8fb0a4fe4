"""The edge variants an agent runs: packages opened, sessions warmed, policies bound."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compilers.golden import check_golden
from compilers.package import ModelPackage
from compilers.variants import VariantSet, is_variant_set
from compilers.version_floor import VersionFloor
from edge_agent.policy import BoundPolicy, Policy
from runtimes.errors import PackageError
from runtimes.session import Session, SessionOptions

logger = logging.getLogger(__name__)
perf_counter = time.perf_counter


@dataclass
class Variant:
    """One loaded edge variant: its package, open session and bound policy."""

    id: str
    package: ModelPackage
    session: Session
    policy: BoundPolicy
    p50_ms: float = 0.0
    inline: bool = True

    @property
    def name(self) -> str:
        return self.package.manifest.name


def load_packages(model: str | Path | VariantSet | ModelPackage, *, trusted_keys: Iterable[Any] | None = None,
                  floor: VersionFloor | None = None) -> tuple[dict[str, ModelPackage], str]:
    """The packages of `model` by variant id, and the recommended variant's id.

    With a `floor`, a version older than the newest opened before is refused (`compilers.version_floor`).
    """
    keys = None if trusted_keys is None else list(trusted_keys)
    if isinstance(model, ModelPackage):
        if floor is not None:
            floor.admit(model.manifest, f"package {str(model.directory)!r}")
        return {model.directory.name: model}, model.directory.name
    if not isinstance(model, VariantSet) and is_variant_set(model):
        model = VariantSet.load(model)
    if isinstance(model, VariantSet):
        pkgs = {e.id: model.open(e.id, trusted_keys=keys, floor=floor) for e in model.entries}
        return pkgs, model.recommended.id
    pkg = ModelPackage.open(model, trusted_keys=keys, floor=floor)
    return {pkg.directory.name: pkg}, pkg.directory.name


def read_validation(pkg: ModelPackage) -> tuple[np.ndarray, np.ndarray] | None:
    """(logits, labels) of the package's validation file, or None when it has none."""
    name = pkg.manifest.calibration.get("validation_file", "validation.npz")
    path = pkg.directory / str(name)
    if not path.is_file():
        return None
    with np.load(path) as data:
        if "logits" not in data or "labels" not in data:
            return None
        return np.asarray(data["logits"]), np.asarray(data["labels"])


def zero_feed(session: Session) -> dict[str, np.ndarray]:
    """A batch-1 input of zeros for every input of `session` (dynamic axes set to 1)."""
    return {s.name: np.zeros(tuple(1 if isinstance(d, str) else d for d in s.shape), dtype=s.dtype)
            for s in session.inputs}


def _warm(session: Session, runs: int = 5) -> float:
    """p50 ms of `runs` batch-1 calls on zeros (also pays the first-call cost before traffic)."""
    feed = zero_feed(session)
    times = []
    for _ in range(runs):
        t = perf_counter()
        session.run(feed)
        times.append((perf_counter() - t) * 1e3)
    return float(np.median(times))


def open_variants(packages: Mapping[str, ModelPackage], policy: Policy, ids: Iterable[str],
                  options: SessionOptions | None, inline_max_ms: float,
                  refused: dict[str, str] | None = None) -> dict[str, Variant]:
    """Open, golden-check and warm the variants `ids`.

    A variant whose golden inputs do not reproduce on this machine is closed and left out, its reason
    put in `refused` (and logged); when every one of `ids` is refused, the other packages are tried in
    ladder order, so the agent falls to the next rung. Raises `PackageError` when none reproduces.
    """
    out: dict[str, Variant] = {}
    refused = {} if refused is None else refused
    wanted = list(ids)
    for vid in [*wanted, *(v for v in packages if v not in wanted)]:
        if vid not in wanted and out:
            break
        pkg = packages[vid]
        validation = read_validation(pkg) if policy.needs_validation else None
        bound = policy.bind(pkg.manifest.calibration, validation, pkg.manifest.outputs[0].name)
        session = pkg.open_session(options)
        check = check_golden(pkg, session)
        if check is not None and not check.passed:
            session.close()
            refused[vid] = check.reason
            logger.warning("variant %s refused on this machine: %s", vid, check.reason)
            continue
        p50 = _warm(session)
        out[vid] = Variant(vid, pkg, session, bound, p50, p50 <= inline_max_ms)
        logger.info("variant %s: p50 %.3f ms, threshold %.4g, %s", vid, p50, bound.threshold,
                    "inline" if p50 <= inline_max_ms else "worker thread")
    if not out:
        for variant in out.values():
            variant.session.close()
        reasons = "; ".join(f"{k}: {v}" for k, v in refused.items())
        msg = f"no variant reproduces its golden outputs on this machine: {reasons}"
        raise PackageError(msg)
    return out
