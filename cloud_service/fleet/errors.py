"""The fleet service's refinements of the tierkit error tree (runtimes/errors.py).

```
TierkitError
  FleetError                 any fleet failure
    EnrollmentRefused        unknown, expired or reused enrollment token; bad CSR
    Unauthorized             missing or wrong operator token, or a read-only token asked to write
    UnknownDevice            no such device id
    DeviceRevoked            the device was revoked
    InvalidDocument          a desired document or selector that does not validate
    StoreUnavailable         the database is locked or gone (retry later)
    UnknownRelease           no release registered under that digest
    ReleaseRefused           a release that is unsigned, signed by a key the fleet does not trust, or altered
    UnknownRollout           no rollout with that id
    RolloutConflict          the rollout's state does not allow the change (e.g. resume a rolled-back one)
```
"""

from __future__ import annotations

from typing import ClassVar

from runtimes.errors import ConfigError, TierkitError


class FleetError(TierkitError):
    """A fleet service failure; `http_status` is what the HTTP API answers with."""

    http_status: ClassVar[int] = 500


class EnrollmentRefused(FleetError):
    http_status: ClassVar[int] = 403


class Unauthorized(FleetError):
    http_status: ClassVar[int] = 401


class Forbidden(Unauthorized):
    http_status: ClassVar[int] = 403


class UnknownDevice(FleetError):
    http_status: ClassVar[int] = 404


class DeviceRevoked(FleetError):
    http_status: ClassVar[int] = 403


class InvalidDocument(FleetError, ConfigError):
    http_status: ClassVar[int] = 422


class StoreUnavailable(FleetError):
    http_status: ClassVar[int] = 503


class UnknownRelease(FleetError):
    http_status: ClassVar[int] = 404


class ReleaseRefused(FleetError, ConfigError):
    http_status: ClassVar[int] = 422


class UnknownRollout(FleetError):
    http_status: ClassVar[int] = 404


class RolloutConflict(FleetError):
    http_status: ClassVar[int] = 409
