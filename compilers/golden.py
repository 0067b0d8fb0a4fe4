"""Golden inputs: a few inputs and their fp32 reference outputs that travel inside every package.

Whoever opens a variant on a machine (the SDK, the agent, `tierkit serve`) re-runs them and refuses
the variant when its outputs leave the tolerance the compiler recorded. That catches what no hash
can: a runtime or CPU that computes the same file differently (an int8 kernel that saturates
without VNNI, a precision the session did not pin, a driver that changed an engine's tactics).

The tolerance is on `max_rel_error` (max |outputs - reference| / max |reference|, per output):
for an fp32 variant the fp32 bound; for lower precisions twice what the variant measured on the
build host, and at least that plus 0.02, since other CPUs may pick other kernels.

Example:
    >>> result = check_golden(pkg, session)
    >>> result.passed, result.max_rel_error, result.tolerance
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from compilers.fidelity import FP32_BOUND
from runtimes.errors import PackageError
from runtimes.session import Session

if TYPE_CHECKING:
    from compilers.package import ModelPackage

logger = logging.getLogger(__name__)

GOLDEN_FILE = "golden.npz"
GOLDEN_SAMPLES = 4
_IN, _REF = "in/", "ref/"


def max_rel_error(reference: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> float:
    """The largest max |outputs - reference| / max |reference| over the reference's outputs."""
    worst = 0.0
    for name, ref_value in reference.items():
        ref = np.asarray(ref_value, np.float64)
        if name not in outputs or np.shape(outputs[name]) != ref.shape:
            return float("inf")
        out = np.asarray(outputs[name], np.float64)
        if not ref.size:
            continue
        if not np.isfinite(out).all():
            return float("inf")
        scale = max(float(np.abs(ref).max()), 1e-30)
        worst = max(worst, float(np.abs(out - ref).max()) / scale)
    return worst


def tolerance(precision: str, build_host_error: float) -> float:
    if precision == "fp32":
        return max(FP32_BOUND, 2.0 * build_host_error)
    return max(FP32_BOUND, 2.0 * build_host_error, build_host_error + 0.02)


def write_golden(directory: Path, inputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                 outputs: Mapping[str, np.ndarray], precision: str) -> dict[str, Any]:
    """Write `golden.npz` into a package directory; returns the manifest's `golden` record."""
    arrays = {f"{_IN}{k}": np.asarray(v) for k, v in inputs.items()}
    arrays.update({f"{_REF}{k}": np.asarray(v) for k, v in reference.items()})
    np.savez(directory / GOLDEN_FILE, **arrays)  # type: ignore[arg-type]
    error = max_rel_error(reference, outputs)
    samples = len(next(iter(inputs.values()))) if inputs and np.ndim(next(iter(inputs.values()))) else 1
    return {"file": GOLDEN_FILE, "samples": samples, "build_host_error": error,
            "tolerance": tolerance(precision, error), "metric": "max_rel_error"}


def read_golden(directory: Path, record: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    path = directory / str(record.get("file", GOLDEN_FILE))
    try:
        with np.load(path, allow_pickle=False) as data:
            inputs = {k[len(_IN):]: data[k] for k in data.files if k.startswith(_IN)}
            reference = {k[len(_REF):]: data[k] for k in data.files if k.startswith(_REF)}
    except (OSError, ValueError) as exc:
        msg = f"golden inputs {str(path)!r} are unreadable ({exc}); recompile the package"
        raise PackageError(msg) from None
    return inputs, reference


@dataclass(frozen=True)
class GoldenResult:
    """The on-device check: passed, the error measured here, the tolerance, and why it failed."""

    passed: bool
    max_rel_error: float
    tolerance: float
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "max_rel_error": self.max_rel_error, "tolerance": self.tolerance,
                "reason": self.reason}


def check_golden(package: ModelPackage, session: Session) -> GoldenResult | None:
    """Re-run the package's golden inputs on `session`; None when the package carries none (older packages)."""
    record = package.manifest.golden
    if not record:
        return None
    inputs, reference = read_golden(package.directory, record)
    limit = float(record.get("tolerance", FP32_BOUND))
    try:
        outputs = session.run(inputs)
    except Exception as exc:  # any backend failure on the golden inputs refuses the variant
        return GoldenResult(False, float("inf"), limit, f"running the golden inputs raised {type(exc).__name__}: {exc}")
    error = max_rel_error(reference, outputs)
    if error <= limit:
        return GoldenResult(True, error, limit)
    reason = (f"golden outputs differ from the reference by {error:.3g} of their scale here, over the tolerance "
              f"{limit:.3g} recorded at build (build host: {float(record.get('build_host_error', 0.0)):.3g}; "
              f"{package.manifest.runtime} {package.manifest.precision} computes differently on this machine)")
    return GoldenResult(False, error, limit, reason)


def require_golden(package: ModelPackage, session: Session, *, where: str) -> GoldenResult | None:
    """`check_golden`, raising `PackageError` naming `where` when the variant does not reproduce."""
    result = check_golden(package, session)
    if result is not None and not result.passed:
        msg = f"{where}: golden check failed: {result.reason}"
        raise PackageError(msg)
    if result is not None:
        logger.info("%s: golden check passed (%.3g <= %.3g)", where, result.max_rel_error, result.tolerance)
    return result
