"""One served model version: a verified package, its sessions (one per instance), and its batcher."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cloud_service.batcher import BatchObserver, DynamicBatcher
from cloud_service.config import SERVED_SPIN, ModelOptions, instance_layout
from cloud_service.protocol.codec import NP_TO_OIP
from cloud_service.statistics import ModelStats
from compilers.golden import require_golden
from compilers.manifest import Manifest
from compilers.package import ModelPackage
from compilers.version_floor import VersionFloor
from runtimes.errors import InputError, IntegrityError, PackageError, TierkitError
from runtimes.session import Session, SessionOptions
from runtimes.spec import TensorSpec, check_inputs

log = logging.getLogger(__name__)

# runtime -> the Triton platform name stock tools expect in metadata and config
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "openvino": "openvino", "tensorrt": "tensorrt_plan",
             "torch": "pytorch_libtorch"}


@dataclass(eq=False)
class ServedModel:
    """A loaded, smoke-tested model version. `start()` it on the event loop before use.

    Attributes:
        name, version: what requests name it by.
        manifest: the package's manifest.
        batched: whether requests are concatenated along axis 0 (every input and output has a
            dynamic batch axis, and batching allows more than one row).
        variant: the variant id when it comes from a variant set.
        stats: its statistics since it was loaded (the ModelStatistics RPC).
    """

    name: str
    version: str
    manifest: Manifest
    options: ModelOptions
    sessions: list[Session]
    source: Path
    variant: str | None = None
    cleanup_dir: Path | None = None
    batcher: DynamicBatcher | None = field(default=None, init=False)
    stats: ModelStats = field(default_factory=ModelStats, init=False)
    _expected: dict[str, tuple[np.dtype[Any], int, tuple[tuple[int, int], ...]]] | None = field(
        default=None, init=False, repr=False)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.manifest.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self.manifest.outputs

    @property
    def batched(self) -> bool:
        return (self.options.batching.max_batch_size > 1
                and all(s.dynamic_batch for s in (*self.inputs, *self.outputs)))

    @property
    def max_batch_size(self) -> int:
        """Triton's convention: 0 when the model does not batch."""
        return self.options.batching.max_batch_size if self.batched else 0

    @property
    def platform(self) -> str:
        return PLATFORMS.get(self.manifest.runtime, self.manifest.runtime)

    def start(self, observer: BatchObserver | None = None) -> None:
        self.stats = ModelStats(observer)
        self.batcher = DynamicBatcher(self.name, [s.run for s in self.sessions], self.options.batching,
                                      batched=self.batched, observer=self.stats)
        self.batcher.start()

    def validate(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Raise `InputError` naming what is wrong: unknown, missing, dtype, shape, NaN/Inf."""
        expected = self._expected
        if expected is None:
            expected = self._expected = {s.name: (np.dtype(s.dtype), len(s.shape),
                                                  tuple((i, d) for i, d in enumerate(s.shape) if isinstance(d, int)))
                                         for s in self.inputs}
        # Fast path (this runs for every request); `check_inputs` words the refusal.
        if arrays.keys() != expected.keys():
            check_inputs(self.inputs, arrays)
        for name, array in arrays.items():
            dtype, ndim, fixed = expected[name]
            shape = array.shape
            if array.dtype != dtype or len(shape) != ndim or [d for i, d in fixed if shape[i] != d]:
                check_inputs(self.inputs, arrays)
                msg = f"input {name!r} does not match {self.inputs}"
                raise InputError(msg)
        if self.options.allow_non_finite:
            return
        for name, array in arrays.items():
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                bad = int(array.size - np.isfinite(array).sum())
                msg = (f"input {name!r} holds {bad} NaN or Inf value(s); model {self.name!r} does not accept "
                       "non-finite inputs (allow_non_finite is off)")
                raise InputError(msg)

    def output_names(self, requested: Iterable[str]) -> list[str]:
        """The outputs to return: all declared ones, or the requested subset (checked)."""
        names = [s.name for s in self.outputs]
        wanted = list(requested)
        if not wanted:
            return names
        unknown = [n for n in wanted if n not in names]
        if unknown:
            msg = f"requested output(s) {unknown} are not outputs of model {self.name!r}; it has {names}"
            raise InputError(msg)
        return wanted

    async def aclose(self, timeout: float | None = None) -> None:
        """Finish the queued requests (up to `timeout`), then close the sessions."""
        if self.batcher is not None:
            await self.batcher.aclose(timeout)
        await asyncio.to_thread(self._close_sessions)

    def _close_sessions(self) -> None:
        for session in self.sessions:
            try:
                session.close()
            except Exception:  # a failing close must not stop the others
                log.exception("closing a session of %s:%s failed", self.name, self.version)
        if self.cleanup_dir is not None:
            shutil.rmtree(self.cleanup_dir, ignore_errors=True)


def open_model(path: Path, name: str, version: str, options: ModelOptions, *,
               trusted_keys: list[Ed25519PublicKey] | None = None, variant: str | None = None,
               floor: VersionFloor | None = None) -> ServedModel:
    """Verify the package at `path`, open one session per instance and smoke-test it. Blocking.

    With `options.instances` 0 the instances are `config.instance_layout`'s, from the CPUs and the smoke
    input's run time on the first one.

    Raises:
        PackageError (and subclasses) when verification, loading or the smoke run fails.
    """
    cleanup = Path(tempfile.mkdtemp(prefix="tierkit-serve-")) if path.is_file() else None
    sessions: list[Session] = []
    try:
        package = ModelPackage.open(path, trusted_keys=trusted_keys, extract_to=cleanup)
        if package.manifest.name != name:
            msg = (f"package {str(path)!r} holds model {package.manifest.name[:100]!r}, not {name[:100]!r}: a variant "
                   "index may point only at its own model's packages")
            raise IntegrityError(msg)
        instances, threads = instance_layout(options, package.manifest.runtime)
        sessions.append(_open_session(package, path, _session_options(threads, options)))
        smoke_check(sessions[0], package.manifest, where=f"package {str(path)!r}")
        if instances > 1 and not options.instances:  # automatic: several only for a model that computes long
            run_s = _run_seconds(sessions[0], package.manifest)
            instances, threads = instance_layout(options, package.manifest.runtime, run_s=run_s)
            log.info("%s:%s: a request runs %.1f ms on one instance: %d instance(s)", name, version,
                     run_s * 1000, instances)
            if instances == 1:
                sessions.pop().close()
                sessions.append(_open_session(package, path, _session_options(threads, options)))
        while len(sessions) < instances:
            sessions.append(_open_session(package, path, _session_options(threads, options)))
        require_golden(package, sessions[0], where=f"package {str(path)!r}")
        if floor is not None:  # after the checks: a package that does not load raises no floor
            floor.admit(package.manifest, f"package {str(path)!r}")
    except BaseException:
        for session in sessions:
            session.close()
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise
    return ServedModel(name, version, package.manifest, options, sessions, path, variant, cleanup)


def _session_options(threads: int, options: ModelOptions) -> SessionOptions:
    """An instance's session options: `threads` intra-op threads; spinning as the model's options say, else off
    (`SERVED_SPIN`)."""
    return SessionOptions(intra_op_threads=threads, spin=SERVED_SPIN if options.spin is None else options.spin)


def _open_session(package: ModelPackage, path: Path, options: SessionOptions) -> Session:
    try:
        return package.open_session(options)
    except TierkitError:
        raise
    except Exception as exc:
        msg = f"package {str(path)!r}: the backend cannot load {package.manifest.artifact!r}: {exc}"
        raise PackageError(msg) from exc


def _run_seconds(session: Session, manifest: Manifest, runs: int = 5) -> float:
    """The shortest of `runs` run times of the smoke input (every named axis at 1) on `session`, after one
    untimed run: the model's own time, the least inflated by whatever else the host runs (a swap under load)."""
    inputs = {spec.name: smoke_input(spec) for spec in manifest.inputs}
    session.run(inputs)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(inputs)
        times.append(time.perf_counter() - started)
    return min(times)


def smoke_input(spec: TensorSpec) -> np.ndarray:
    """Zeros of the spec's dtype, with every named axis at size 1."""
    return np.zeros([d if isinstance(d, int) else 1 for d in spec.shape], dtype=spec.dtype)


def smoke_check(session: Session, manifest: Manifest, *, where: str) -> None:
    """Run zeros through the session; the outputs must be the manifest's names, dtypes and shapes, and every
    tensor's dtype one the wire codec carries (else no request for it could be decoded)."""
    unservable = [f"{s.name} ({s.dtype})" for s in (*manifest.inputs, *manifest.outputs)
                  if s.dtype not in NP_TO_OIP]
    if unservable:
        msg = (f"{where}: cannot be served: tensors {', '.join(unservable)} have a dtype the wire codec cannot "
               f"carry (it carries {sorted(NP_TO_OIP)}); export the model with one of those at its inputs and outputs")
        raise PackageError(msg)
    declared = {s.name for s in manifest.inputs}
    actual = {s.name for s in session.inputs} if session.inputs else declared
    if actual != declared:
        msg = (f"{where}: smoke check failed: the model takes inputs {sorted(actual)}, "
               f"the manifest says {sorted(declared)}")
        raise PackageError(msg)
    try:
        out = session.run({s.name: smoke_input(s) for s in manifest.inputs})
    except Exception as exc:
        msg = f"{where}: smoke check failed: running zeros raised {type(exc).__name__}: {exc}"
        raise PackageError(msg) from exc
    for spec in manifest.outputs:
        if spec.name not in out:
            msg = f"{where}: smoke check failed: output {spec.name!r} missing; the model gave {sorted(out)}"
            raise PackageError(msg)
        array = np.asarray(out[spec.name])
        if not spec.matches(array):
            msg = (f"{where}: smoke check failed: output {spec.name!r} is {array.dtype.name}{list(array.shape)}, "
                   f"the manifest declares {spec.dtype}{list(spec.shape)}")
            raise PackageError(msg)
