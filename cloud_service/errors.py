"""The cloud service's own refinements of the tierkit error tree (runtimes/errors.py).

Each subclasses the closest existing class, so `except InputError` / `except TierkitError` still
catch them; each only changes the gRPC status the servicer answers with.

```
InputError
  ModelNotFound          NOT_FOUND           unknown model or version
  MessageTooLarge        RESOURCE_EXHAUSTED  a request over the configured size limit
InferenceError
  ServerBusy             RESOURCE_EXHAUSTED  the model's queue is full; carries retry_after_ms
```

A request that passed its deadline in the queue raises `runtimes.errors.CloudTimeout`
(DEADLINE_EXCEEDED): to the caller it is the cloud not answering in time.
"""

from __future__ import annotations

from typing import ClassVar

from runtimes.errors import InferenceError, InputError


class ModelNotFound(InputError):
    """No model (or no such version of it) is served here."""

    grpc_status: ClassVar[str] = "NOT_FOUND"


class MessageTooLarge(InputError):
    """The request is larger than the server's message size limit."""

    grpc_status: ClassVar[str] = "RESOURCE_EXHAUSTED"


class ServerBusy(InferenceError):
    """The model's queue is full. Retry after `retry_after_ms`.

    Attributes:
        retry_after_ms: a hint for when a retry is likely to find room (the gRPC
            `grpc-retry-pushback-ms` trailer carries it).
        queued_s: 0 for a refusal at admission; else how long the request waited in the queue before it
            was shed as hopeless (the metrics time the two apart).
    """

    grpc_status: ClassVar[str] = "RESOURCE_EXHAUSTED"

    def __init__(self, msg: str, *, retry_after_ms: int = 10, queued_s: float = 0.0) -> None:
        super().__init__(msg)
        self.retry_after_ms = int(retry_after_ms)
        self.queued_s = float(queued_s)  # > 0: admitted, queued this long, then found hopeless (shed)
