"""Backend registry: a name maps to an import path and the extra that provides it.

Backends are imported only when asked for, so `import runtimes` stays light.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Protocol

from runtimes.errors import BackendUnavailable, ConfigError
from runtimes.session import Session, SessionOptions

_OWN_PACKAGES = {"runtimes", "compilers", "edge_agent", "cloud_service", "sdk"}

# name -> (module:Class, extra that installs it, distribution whose presence makes it usable)
_BACKENDS: dict[str, tuple[str, str | None, str]] = {
    "onnxruntime": ("runtimes.ort_backend:OrtBackend", None, "onnxruntime"),
    "openvino": ("runtimes.ov_backend:OpenVinoBackend", "openvino", "openvino"),
    "tensorrt": ("runtimes.trt_backend:TensorRTBackend", "tensorrt", "tensorrt"),
    "torch": ("runtimes.torch_backend:TorchBackend", "torch", "torch"),
}
_BUILT_IN = frozenset(_BACKENDS)

# artifact suffix -> backend name; the manifest's "runtime" field overrides this.
_SUFFIXES = {
    ".onnx": "onnxruntime",
    ".xml": "openvino",
    ".engine": "tensorrt",
    ".plan": "tensorrt",
    ".pt2": "torch",
    ".pt": "torch",
    ".ts": "torch",
}


class Backend(Protocol):
    name: str

    def load(self, artifact: Path, options: SessionOptions) -> Session: ...


def register_backend(name: str, target: str, *, extra: str | None = None, distribution: str = "numpy") -> None:
    """Add a backend from outside the product (a plugin; the test suite registers its fake one this way).

    Args:
        name: the name manifests and `open_session(backend=...)` use.
        target: "package.module:Class" of a class whose instances have `load(artifact, options)`.
        extra: the tierkit extra that installs its library, for the error message when it is missing.
        distribution: the distribution whose presence makes it usable.
    """
    if name in _BUILT_IN:
        msg = f"backend {name!r} is built in and cannot be replaced"
        raise ConfigError(msg)
    if ":" not in target:
        msg = f"backend target {target!r} must be 'package.module:Class'"
        raise ConfigError(msg)
    _BACKENDS[name] = (target, extra, distribution)


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def backend_for(artifact: str | Path) -> str:
    """The backend that runs `artifact`, chosen from its suffix."""
    suffix = Path(artifact).suffix.lower()
    try:
        return _SUFFIXES[suffix]
    except KeyError:
        msg = f"no backend runs {str(artifact)!r}; known artifact suffixes: {sorted(_SUFFIXES)}"
        raise ConfigError(msg) from None




def get_backend(name: str) -> Backend:
    """Import and instantiate backend `name`; raise an error that says what to install."""
    try:
        target, extra, _ = _BACKENDS[name]
    except KeyError:
        msg = f"unknown backend {name!r}; expected one of {backend_names()}"
        raise ConfigError(msg) from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] in _OWN_PACKAGES:
            raise
        hint = f"pip install 'tierkit[{extra}]'" if extra else "pip install tierkit"
        msg = f"backend {name!r} needs {exc.name!r}: {hint}"
        raise BackendUnavailable(msg) from None
    backend: Backend = getattr(module, class_name)()
    return backend


def open_session(artifact: str | Path, *, backend: str | None = None,
                 options: SessionOptions | None = None) -> Session:
    """Load `artifact` with `backend` (default: chosen from the file suffix)."""
    path = Path(artifact)
    if not path.exists():
        msg = f"model artifact {str(path)!r} does not exist"
        raise ConfigError(msg)
    return get_backend(backend or backend_for(path)).load(path, options or SessionOptions())


def available_backends() -> dict[str, str | None]:
    """Backend name -> installed version of its library, or None when it is not installed.

    Uses `find_spec` and package metadata only: nothing heavy is imported.
    """
    out: dict[str, str | None] = {}
    for name, (_, _, dist) in _BACKENDS.items():
        if name not in _BUILT_IN:
            continue
        module = "openvino" if dist == "openvino" else dist
        if importlib.util.find_spec(module) is None:
            out[name] = None
            continue
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out
