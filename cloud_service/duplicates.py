"""One duplicate-request cache for both transports: an escalation sent again is answered, not recomputed.

An edge agent journals an escalation before sending it and sends it again after a crash or a lost
reply, with the same device, boot id and sequence number (`topics.PARAM_DEVICE`, `PARAM_BOOT`,
`PARAM_SEQ`). The gRPC servicer and the MQTT bridge of one service share one `DuplicateCache`, so a
resend is answered from it whichever transport carried the first send. A cached answer carries
`topics.PARAM_CACHED = True`.

What differs by transport: the MQTT bridge also makes a resend that arrives while the first copy is
still computing wait for that computation (a broker redelivers unacknowledged messages at once); the
gRPC servicer answers from the cache only once the first copy has finished (a gRPC caller resends only
after its first call ended).

Thread-safe: the gRPC servicer's pool threads and the bridge's event loop use it at once.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping
from typing import Any

from cloud_service.protocol import inference_pb2 as pb
from cloud_service.protocol import topics
from cloud_service.protocol.wire import RawResponse

Key = tuple[str, str, int]
Answer = pb.ModelInferResponse | RawResponse


def request_key(params: Mapping[str, Any], device: str = "") -> Key | None:
    """(device, boot id, seq) of a request's parameters, or None when it carries no sequence number.

    `device`: the sender's identity where the transport knows it (the MQTT topic); else the parameter.
    """
    seq = params.get(topics.PARAM_SEQ)
    if not isinstance(seq, int) or isinstance(seq, bool):
        return None
    return (device or str(params.get(topics.PARAM_DEVICE, "")), str(params.get(topics.PARAM_BOOT, "")), seq)


def message_key(parameters: Mapping[str, pb.InferParameter]) -> Key | None:
    """The key of a request that names its device, boot id and seq, read straight from its parameter map
    (the gRPC servicer's form: no transport identity, so all three must be there); else None."""
    if not (topics.PARAM_SEQ in parameters and topics.PARAM_DEVICE in parameters and topics.PARAM_BOOT in parameters):
        return None
    seq = parameters[topics.PARAM_SEQ]
    if seq.WhichOneof("parameter_choice") != "int64_param":
        return None
    return (parameters[topics.PARAM_DEVICE].string_param, parameters[topics.PARAM_BOOT].string_param, seq.int64_param)


class DuplicateCache:
    """Answers by (device, boot id, seq) for `ttl_s`, at most `max_entries` (oldest evicted first)."""

    def __init__(self, ttl_s: float = 60.0, max_entries: int = 10_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._items: collections.OrderedDict[Key, tuple[float, Answer]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Key) -> Answer | None:
        """The answer kept for `key` (as it was put), or None."""
        with self._lock:
            item = self._items.get(key)
        if item is None or item[0] < time.monotonic():
            return None
        return item[1]

    def put(self, key: Key, response: Answer) -> None:
        """Keep `response` (not copied: neither transport changes an answer once it is made)."""
        if self.max_entries == 0 or self.ttl_s == 0:
            return
        now = time.monotonic()
        with self._lock:
            items = self._items
            items[key] = (now + self.ttl_s, response)
            items.move_to_end(key)
            while items and (len(items) > self.max_entries or next(iter(items.values()))[0] < now):
                items.popitem(last=False)

    def message(self, key: Key) -> pb.ModelInferResponse | None:
        """A cached answer as a whole message of its own, marked cached (the MQTT bridge's form)."""
        kept = self.get(key)
        if kept is None:
            return None
        reply = pb.ModelInferResponse()
        reply.CopyFrom(kept.to_message() if isinstance(kept, RawResponse) else kept)
        reply.parameters[topics.PARAM_CACHED].bool_param = True
        return reply

    def raw(self, key: Key) -> RawResponse | None:
        """A cached answer as a `RawResponse` marked cached, sharing the kept tensors (the gRPC servicer's form)."""
        kept = self.get(key)
        if kept is None:
            return None
        head = pb.ModelInferResponse()
        head.CopyFrom(kept.message if isinstance(kept, RawResponse) else kept)
        head.parameters[topics.PARAM_CACHED].bool_param = True
        return RawResponse(head, kept.raw if isinstance(kept, RawResponse) else ())
