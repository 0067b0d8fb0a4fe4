"""An in-memory transport for tests: a handler function plays the cloud (httpx `MockTransport` style)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

from cloud_service.protocol import inference_pb2
from edge_agent.transports.base import Transport, escalation_error
from runtimes.errors import CloudTimeout, EscalationError

Handler = Callable[
    [inference_pb2.ModelInferRequest],
    inference_pb2.ModelInferResponse | Awaitable[inference_pb2.ModelInferResponse],
]


class FakeTransport(Transport):
    """Answers escalations with `handler(request)`, a plain function or a coroutine function.

    The handler sees the request as it would arrive on the wire (model name and device ids filled in).
    It may raise a tierkit `EscalationError` (`CloudUnavailable`, ...) to play a failing cloud; any other
    exception becomes an `EscalationError` with `.code == "INTERNAL"`. An async handler slower than the
    deadline gives `CloudTimeout`. Every request received is kept in `requests`.

    Example:
        >>> def double(request):
        ...     x = decode_inputs(request)["x"]
        ...     return encode_response("m", {"y": x * 2})
        >>> async with FakeTransport(double) as cloud:
        ...     response = await cloud.escalate(request, timeout_s=0.1)
    """

    name = "fake"

    def __init__(self, handler: Handler, *, model: str = "", device_id: str = "",
                 boot_id: str | None = None) -> None:
        super().__init__(model=model, device_id=device_id, boot_id=boot_id)
        self.handler = handler
        self.requests: list[inference_pb2.ModelInferRequest] = []
        self.closed = False

    async def escalate(self, request: inference_pb2.ModelInferRequest, *,
                       timeout_s: float) -> inference_pb2.ModelInferResponse:
        if self.closed:
            msg = "fake transport is closed; open a new one"
            raise escalation_error(EscalationError, msg, code="CANCELLED")
        wire = inference_pb2.ModelInferRequest.FromString(self.serialize(request))
        self.requests.append(wire)
        try:
            result = self.handler(wire)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, timeout_s)
        except EscalationError:
            raise
        except TimeoutError:
            msg = f"fake cloud did not answer within {timeout_s:.3f} s"
            raise escalation_error(CloudTimeout, msg, code="DEADLINE_EXCEEDED") from None
        except Exception as exc:
            msg = f"fake cloud handler failed: {exc!r}"
            raise escalation_error(EscalationError, msg, code="INTERNAL") from exc
        if not isinstance(result, inference_pb2.ModelInferResponse):
            msg = f"fake cloud handler returned {type(result).__name__}, expected a ModelInferResponse"
            raise escalation_error(EscalationError, msg, code="INTERNAL")
        return result

    async def aclose(self) -> None:
        self.closed = True
