"""The tierkit error tree. Every layer raises these; the bottom layer owns the root.

```
TierkitError
  ConfigError(TierkitError, ValueError)   bad argument / recipe / manifest field
  BackendUnavailable                      missing extra, no device; the message names the extra
  PackageError                            unreadable or malformed package
    IntegrityError                        sha256 mismatch, truncated archive
    SignatureError                        unsigned, tampered or wrongly signed, when a key is configured
    UnsafeArchiveError                    path traversal, links out of the tree, size limits
  CompileError
    FidelityError                         accuracy guard failed; carries measured vs required
  InferenceError                          the backend failed while running, or bad input
    InputError(InferenceError, ValueError)  wrong name, dtype or shape of an input
  EscalationError                         the cloud call failed (raised only in strict mode)
    CloudUnavailable
    CloudTimeout
  JournalError                            the store-and-forward journal's storage failed (disk, I/O, SQLite)
    JournalFull                           the store-and-forward journal reached its byte bound
  ModelClosed                             the model or agent was closed; open a new one with `sdk.load`
  CodecError(TierkitError, ValueError)    a tensor or parameter the wire codec cannot encode or decode
                                          (defined in cloud_service.protocol.codec, the wire contract)
```

Each class carries a `grpc_status` name so that the cloud service maps exceptions to status
codes in one place.
"""

from __future__ import annotations

from typing import ClassVar


class TierkitError(Exception):
    """Root of every error tierkit raises on purpose."""

    grpc_status: ClassVar[str] = "INTERNAL"


class ConfigError(TierkitError, ValueError):
    """A bad argument, recipe, budget or manifest field. The message names the value."""

    grpc_status: ClassVar[str] = "INVALID_ARGUMENT"


class BackendUnavailable(TierkitError):
    """A backend or device is missing; the message says what to install."""

    grpc_status: ClassVar[str] = "UNAVAILABLE"


class PackageError(TierkitError):
    """A model package that cannot be read."""

    grpc_status: ClassVar[str] = "FAILED_PRECONDITION"


class IntegrityError(PackageError):
    """A file's sha256 does not match the manifest, or a file is missing or truncated."""


class SignatureError(PackageError):
    """The package is unsigned, tampered with, or signed by another key."""


class UnsafeArchiveError(PackageError):
    """An archive entry escapes the target directory, is a link, or exceeds a size limit."""


class CompileError(TierkitError):
    """A compile pass failed."""


class FidelityError(CompileError):
    """A variant lost more accuracy than allowed.

    Attributes:
        measured: the fidelity figures measured against the fp32 reference.
        required: the limit it had to meet.
    """

    def __init__(self, msg: str, *, measured: dict[str, float] | None = None,
                 required: dict[str, float] | None = None) -> None:
        super().__init__(msg)
        self.measured = dict(measured or {})
        self.required = dict(required or {})


class InferenceError(TierkitError):
    """The backend failed while running a model."""


class InputError(InferenceError, ValueError):
    """An input has the wrong name, dtype or shape."""

    grpc_status: ClassVar[str] = "INVALID_ARGUMENT"


class EscalationError(TierkitError):
    """The cloud call failed. Raised only where the caller asked for strict mode."""

    grpc_status: ClassVar[str] = "UNAVAILABLE"


class CloudUnavailable(EscalationError):
    """The cloud refused the connection, or the circuit breaker is open."""


class CloudTimeout(EscalationError):
    """The cloud did not answer within the deadline."""

    grpc_status: ClassVar[str] = "DEADLINE_EXCEEDED"


class JournalError(TierkitError):
    """The on-disk journal could not be read or written (disk full, I/O error, locked or broken database)."""

    grpc_status: ClassVar[str] = "UNAVAILABLE"


class JournalFull(JournalError):
    """The on-disk journal reached its byte bound; nothing was written."""

    grpc_status: ClassVar[str] = "RESOURCE_EXHAUSTED"


class ModelClosed(TierkitError):
    """The model (or agent) was closed: nothing more can run on it. Open a new one with `sdk.load`."""

    grpc_status: ClassVar[str] = "FAILED_PRECONDITION"
