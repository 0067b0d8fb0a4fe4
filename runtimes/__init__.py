"""Run a model artifact on this machine, behind one `Session` interface.

Backends (onnxruntime, OpenVINO, torch, TensorRT) are imported only when asked for.
"""

from runtimes.energy import EnergyMeter, EnergyReading, PowerProfile, modeled_energy
from runtimes.errors import (
    BackendUnavailable,
    ConfigError,
    InferenceError,
    InputError,
    PackageError,
    TierkitError,
)
from runtimes.registry import available_backends, backend_for, get_backend, open_session
from runtimes.session import Session, SessionOptions
from runtimes.spec import Precision, Task, TensorSpec

__all__ = [
    "BackendUnavailable",
    "ConfigError",
    "EnergyMeter",
    "EnergyReading",
    "InferenceError",
    "InputError",
    "PackageError",
    "PowerProfile",
    "Precision",
    "Session",
    "SessionOptions",
    "Task",
    "TensorSpec",
    "TierkitError",
    "available_backends",
    "backend_for",
    "get_backend",
    "modeled_energy",
    "open_session",
]
