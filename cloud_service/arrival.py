"""Admission of MQTT escalations on arrival, on paho's network thread, before the event loop sees them.

Over MQTT the bridge's event loop decodes each request (a page of text is ~400 KB) and only then
reaches the batcher's admission; under overload the escalations that paho's thread hands over pile up
in the loop's ready queue, where no deadline is checked, and a refusal comes back after the caller's
budget is spent. So on arrival, in paho's thread:

- the request's envelope is parsed (protobuf keeps the tensors as bytes: nothing is decoded), for its
  model, rows and deadline (the earlier of `tierkit.deadline_ms` and the Message Expiry Interval);
- a request already past its deadline is answered DEADLINE_EXCEEDED; one whose deadline the model's
  queue cannot meet (`DynamicBatcher.admissible`) is answered RESOURCE_EXHAUSTED with the retry hint;
- at most `max_waiting` escalations wait between paho's thread and the model's queue: past that, the
  next is refused at once rather than queued where nothing watches its deadline; those waiting are
  work ahead of every arrival (their rows count as queued: under overload tens wait, all let through
  against the same queue, and each one's admission would otherwise ignore the others);
- the answer still has to travel back through the broker: the median of how long recent escalations
  took to arrive (their `tierkit.sent_ms` against this host's clock; each at most half its budget, so a
  skewed device clock cannot stop admission) is kept back from every deadline (`reply_margin_s`), here
  and when the request is queued.

Whatever this gate lets through is admitted again by the batcher when it is queued (the gate's view is
a moment old). Requests it cannot read go through unchanged: the event loop answers them with the
precise error.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from cloud_service.errors import ServerBusy
from cloud_service.protocol import declared_rows, get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from cloud_service.repository import ModelRepository
from runtimes.errors import CloudTimeout

if TYPE_CHECKING:
    import paho.mqtt.client as paho

    from cloud_service.batcher import DynamicBatcher

DEFAULT_MAX_WAITING = 64  # MqttConfig.max_waiting
_WAITING_HINT_MS = 5  # a refusal for a full hand-off: the loop clears it within a few milliseconds
_TRANSITS = 64  # recent arrivals the reply margin is the median of


def time_left(message: paho.MQTTMessage, request: pb.ModelInferRequest) -> float | None:
    """Seconds left before the escalation's deadline: the earlier of its `tierkit.deadline_ms` parameter
    (wall-clock milliseconds) and its Message Expiry Interval (what the broker says remains); None if neither."""
    left: float | None = None
    expiry = getattr(message.properties, "MessageExpiryInterval", None)
    if isinstance(expiry, int) and expiry > 0:
        left = float(expiry)
    if topics.PARAM_DEADLINE_MS in request.parameters:
        due = get_parameters(request.parameters).get(topics.PARAM_DEADLINE_MS)
        if isinstance(due, int) and not isinstance(due, bool):
            own = due / 1000 - time.time()
            left = own if left is None else min(left, own)
    return left


class ArrivalGate:
    """Refuses, on arrival, the escalations that cannot be answered in time; bounds those waiting.

    Args:
        repository: the served models (their batchers answer "would this be admitted now?").
        max_waiting: escalations taken from the broker and not yet at their model's queue, at most.
        is_duplicate: whether a parsed request (and its topic) repeats one being answered or cached (let
            through: its answer costs no compute).
        forwarding: the bridge forwards upstream: only the deadline and the bound are checked here.
        max_bytes: payloads larger than this are not parsed here (the loop refuses them).
        on_refused: called with the model name and `waiting` (the hand-off was full) or `expired` (past
            its deadline) for each escalation the gate itself refused (the batcher counts its own).
    """

    def __init__(self, repository: ModelRepository, *, max_waiting: int = DEFAULT_MAX_WAITING,
                 is_duplicate: Callable[[pb.ModelInferRequest, str], bool] = lambda _, __: False,
                 forwarding: bool = False, max_bytes: int = 2**31 - 1,
                 on_refused: Callable[[str, str], None] = lambda _, __: None) -> None:
        self.repository = repository
        self.max_waiting = max_waiting
        self._is_duplicate = is_duplicate
        self._forwarding = forwarding
        self._max_bytes = max_bytes
        self._on_refused = on_refused
        self._waiting = 0
        self._waiting_rows = 0  # the rows of the escalations waiting: work ahead of every arrival
        self._lock = threading.Lock()
        self._transits: deque[float] = deque(maxlen=_TRANSITS)
        self._margin = 0.0

    @property
    def reply_margin_s(self) -> float:
        """Seconds kept back from a deadline for the answer's way back (see the module doc)."""
        return self._margin

    @property
    def waiting(self) -> int:
        return self._waiting

    def arrive(self, message: paho.MQTTMessage) -> tuple[pb.ModelInferRequest | None, Exception | None]:
        """On paho's thread: the parsed request (None if unreadable) and its refusal, or None when it is
        let through (then counted as waiting until `taken()`)."""
        request = _envelope(message.payload) if len(message.payload) <= self._max_bytes else None
        refusal = self._refusal(message, request)
        if refusal is None:
            with self._lock:
                full = self._waiting >= self.max_waiting
                if not full:
                    self._waiting += 1
                    self._waiting_rows += _rows(request)
            if full:
                self._on_refused(request.model_name if request is not None else "", "waiting")
                msg = (f"{self.max_waiting} escalations are waiting to be queued at their models; not queued, "
                       "retry after the hinted delay or add replicas")
                batcher = self._batcher(request)
                hint = _WAITING_HINT_MS if batcher is None else max(_WAITING_HINT_MS, batcher.busy_hint_ms())
                return request, ServerBusy(msg, retry_after_ms=hint)
        return request, refusal

    def taken(self, request: pb.ModelInferRequest | None) -> None:
        """On the event loop: one escalation let through (`request`, as `arrive` returned it) left the
        hand-off (it reached its handler)."""
        with self._lock:
            self._waiting = max(0, self._waiting - 1)
            self._waiting_rows = max(0, self._waiting_rows - _rows(request))

    def _observe_transit(self, request: pb.ModelInferRequest) -> float:
        """Learn how long `request` took to arrive (if it says when it was sent); the margin now."""
        if topics.PARAM_SENT_MS in request.parameters and topics.PARAM_DEADLINE_MS in request.parameters:
            params = get_parameters(request.parameters)
            sent, due = params.get(topics.PARAM_SENT_MS), params.get(topics.PARAM_DEADLINE_MS)
            if isinstance(sent, int) and isinstance(due, int) and due > sent:
                transit = min(max(0.0, time.time() - sent / 1000), 0.5 * (due - sent) / 1000)
                with self._lock:
                    self._transits.append(transit)
                    self._margin = statistics.median(self._transits)
        return self._margin

    def _refusal(self, message: paho.MQTTMessage, request: pb.ModelInferRequest | None) -> Exception | None:
        if request is None or self._is_duplicate(request, message.topic):
            return None
        left = time_left(message, request)
        margin = self._observe_transit(request)
        if left is not None and left - margin <= 0:
            self._on_refused(request.model_name, "expired")
            msg = (f"escalation arrived {-left * 1000:.1f} ms after its deadline; not computed" if left <= 0 else
                   f"escalation arrived with {left * 1000:.1f} ms left, less than an answer takes to travel back "
                   f"({margin * 1000:.1f} ms); not computed")
            return CloudTimeout(msg)
        left = None if left is None else left - margin
        batcher = self._batcher(request)
        if batcher is None:
            return None
        return batcher.admissible(declared_rows(request), left, waiting_rows=self._waiting_rows)

    def _batcher(self, request: pb.ModelInferRequest | None) -> DynamicBatcher | None:
        """The batcher of the model `request` names, when it is served here and batches (not forwarding)."""
        if request is None or self._forwarding:
            return None
        try:
            model = self.repository.get(request.model_name, request.model_version)
        except Exception:  # unknown model, bad version: the loop answers with the precise error
            return None
        return model.batcher


def _rows(request: pb.ModelInferRequest | None) -> int:
    return 0 if request is None else declared_rows(request)


def _envelope(payload: bytes | bytearray) -> pb.ModelInferRequest | None:
    """The request message (tensors left as bytes), or None when the payload is not one."""
    try:
        request: pb.ModelInferRequest = pb.ModelInferRequest.FromString(payload)
    except DecodeError:
        return None
    return request if request.model_name else None
