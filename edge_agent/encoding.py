"""Choosing an escalation's wire encoding from the link: bytes x measured bandwidth + RTT vs the budget.

`choose_encoding` is pure: given the bytes each encoding would put on the wire, the link's
estimated bandwidth and round-trip time, and the time left, it picks the most faithful encoding
predicted to arrive in time (fp32, then lossless zstd, then fp16, then fp16+zstd), or the fastest
one when none fits. The bandwidth and base round trip are the agent's one `link.Link`'s (its
`Bandwidth`, fed by what the transports time; `LinkMeter` is that class). `WireEncoder` puts both in
front of a transport:
it re-encodes a request's fp32 inputs (`cloud_service.protocol.encoding`) before sending.

Only clouds that decode these encodings may receive them (tierkit's server lists the
`tierkit.encodings` extension in ServerMetadata); a stock Triton or KServe gets plain fp32, so the
default `wire_encoding="fp32"` never re-encodes. The raw-frame encoding needs the frame, which only
the application has: it builds that request itself (`protocol.encoding.encode_input`).

Example:
    >>> link = LinkEstimate(bandwidth_bps=5e6, rtt_s=0.03)
    >>> choose_encoding({"fp32": 602_112, "fp16": 301_056}, link, budget_s=0.15).encoding
    'fp16'
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cloud_service.protocol import decode_inputs, inference_pb2
from cloud_service.protocol.encoding import check_encoding, encode_input
from edge_agent.link import Bandwidth, Link, LinkEstimate
from runtimes.errors import ConfigError

__all__ = ["EXACT", "FIDELITY_ORDER", "Choice", "LinkEstimate", "LinkMeter", "WireEncoder", "WireOption",
           "choose_encoding"]

log = logging.getLogger(__name__)

LinkMeter = Bandwidth  # the link's bandwidth estimator, under its former name

FIDELITY_ORDER = ("fp32", "zstd", "fp16", "fp16+zstd")  # most faithful first; the first two are exact
EXACT = frozenset({"fp32", "zstd"})  # the encodings the cloud decodes to the very same tensor
HEADROOM = 0.8  # plan to use at most this share of the budget: the estimate is noisy
ENCODE_TIMINGS = 3  # an encoding's cost is the least of this many timings of it on the first request


@dataclass(frozen=True, slots=True)
class WireOption:
    """One wire encoding the controller may choose for escalations: the request's bytes in it (the
    latest request's size) and what encoding it costs the edge (ms, measured once on a real request).
    `exact`: the cloud decodes the very tensor the edge had (fp32, zstd); fp16 rounds it."""

    encoding: str
    nbytes: int
    encode_ms: float = 0.0
    exact: bool = True

    @property
    def fidelity(self) -> int:
        """Rank in `FIDELITY_ORDER` (0 = most faithful)."""
        return FIDELITY_ORDER.index(self.encoding) if self.encoding in FIDELITY_ORDER else len(FIDELITY_ORDER)


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen encoding, its bytes, its predicted seconds, and whether that fits the budget."""

    encoding: str
    nbytes: int
    predicted_s: float
    fits: bool


def choose_encoding(sizes: Mapping[str, int], link: LinkEstimate, budget_s: float, *,
                    cpu_s: Mapping[str, float] | None = None, joules_per_byte: float = 0.0,
                    energy_budget_j: float | None = None) -> Choice:
    """The most faithful encoding in `sizes` predicted to arrive within `budget_s` (x HEADROOM).

    Args:
        sizes: wire bytes of the request in each candidate encoding.
        link: the link's estimate.
        budget_s: time left for the escalation.
        cpu_s: seconds each encoding costs to encode and decode (compression), if known.
        joules_per_byte: radio energy per byte sent (a device power profile's modeled figure).
        energy_budget_j: at most this much radio energy per escalation, if given.

    Returns:
        The choice; when nothing fits, the fastest candidate with `fits=False`.
    """
    if not sizes:
        msg = "choose_encoding needs at least one candidate encoding"
        raise ConfigError(msg)
    costs = cpu_s or {}
    order = [e for e in FIDELITY_ORDER if e in sizes] + [e for e in sizes if e not in FIDELITY_ORDER]
    options = [Choice(e, sizes[e], link.seconds(sizes[e]) + costs.get(e, 0.0), True) for e in order]
    for option in options:
        energy_ok = energy_budget_j is None or option.nbytes * joules_per_byte <= energy_budget_j
        if option.predicted_s <= budget_s * HEADROOM and energy_ok:
            return option
    fastest = min(options, key=lambda o: o.predicted_s)
    return Choice(fastest.encoding, fastest.nbytes, fastest.predicted_s, False)


class WireEncoder:
    """Re-encodes requests for the link (`wire_encoding` "auto"), or always to one encoding.

    With "auto", a controller chooses the encoding together with the variant and the threshold
    (`edge_agent.decide`): it reads `options()` (each encoding's bytes and encode time, measured on
    the first request) and sets `planned`, which every request then uses. Without a controller (or
    before its first plan), each request takes `choose_encoding`'s pick for the time it has left.

    Args:
        wire_encoding: "auto", or one of `FIDELITY_ORDER`.
        meter: the link it reads and feeds (the agent hands its own; a fresh one by default).
    """

    def __init__(self, wire_encoding: str = "auto", *, meter: Link | None = None) -> None:
        if wire_encoding != "auto":
            check_encoding(wire_encoding)
            if wire_encoding not in FIDELITY_ORDER:
                msg = f"wire_encoding {wire_encoding!r} is not 'auto' or one of {list(FIDELITY_ORDER)}"
                raise ConfigError(msg)
        self.wire_encoding = wire_encoding
        self.meter = meter or Link()
        self.last: Choice | None = None
        self.planned: str | None = None  # the controller's choice (read on the event loop, set whole elsewhere)
        # per encoding: wire bytes of the raw contents per raw fp32 byte, encode seconds per raw byte
        self._costs: dict[str, tuple[float, float]] | None = None
        self._shape: tuple[int, int] | None = None  # the latest request: raw fp32 bytes, other bytes
        self._options: tuple[WireOption, ...] = ()

    def options(self) -> tuple[WireOption, ...]:
        """The encodings a controller may choose from, sized for the latest request (none before one);
        only the configured one when `wire_encoding` is fixed."""
        return self._options

    def prepare(self, request: inference_pb2.ModelInferRequest,
                timeout_s: float) -> inference_pb2.ModelInferRequest:
        """`request` in the encoding chosen for `timeout_s`; plain requests pass through untouched."""
        if not _plain_fp32(request):
            return request
        self._measure(request)
        encoding = self.wire_encoding
        if encoding == "auto":
            encoding = self.planned if self.planned in FIDELITY_ORDER else self._choose(request, timeout_s)
        if encoding == "fp32":
            return request
        return self._reencode(request, encoding)

    def sent_bytes(self, plain_bytes: int) -> int:
        """The bytes a plain fp32 request of `plain_bytes` goes out as: in the planned encoding (or the
        one last chosen per request), by the sizes measured on the latest request; what the agent
        charges radio energy for, as the controller's plan does."""
        encoding = self.planned if self.wire_encoding == "auto" else self.wire_encoding
        if encoding is None and self.last is not None:
            encoding = self.last.encoding
        if self._costs is None or self._shape is None or encoding not in self._costs:
            return plain_bytes
        raw, rest = self._shape
        return round(plain_bytes * (rest + raw * self._costs[encoding][0]) / max(rest + raw, 1))

    def observe(self, nbytes: int, elapsed_s: float) -> None:
        """A completed escalation: bytes both ways and round-trip seconds."""
        self.meter.observe_transfer(nbytes, elapsed_s)

    def observe_timeout(self, nbytes: int, waited_s: float) -> None:
        """An escalation of `nbytes` that got no answer within `waited_s`."""
        self.meter.observe_transfer(nbytes, waited_s, timed_out=True)

    def _choose(self, request: inference_pb2.ModelInferRequest, timeout_s: float) -> str:
        link = self.meter.estimate()
        if link is None or not self._options:
            return "fp32"  # first large escalations measure the link
        sizes = {o.encoding: o.nbytes for o in self._options}
        cpu = {o.encoding: o.encode_ms / 1e3 for o in self._options}
        self.last = choose_encoding(sizes, link, timeout_s, cpu_s=cpu)
        return self.last.encoding

    def _measure(self, request: inference_pb2.ModelInferRequest) -> None:
        """Each encoding's bytes and encode time, measured once on a real request (compression depends
        on the data; the time is the least of `ENCODE_TIMINGS`, since a codec's first call pays its set-up,
        twenty times a warm call's for zstd on an MNIST digit); the options follow the size of the latest
        request."""
        raw = sum(len(c) for c in request.raw_input_contents)
        shape = (raw, request.ByteSize() - raw)
        if shape == self._shape or not raw:
            return
        if self._costs is None:
            costs = {"fp32": (1.0, 0.0)}
            candidates = FIDELITY_ORDER[1:] if self.wire_encoding == "auto" else (self.wire_encoding,)
            for encoding in candidates:
                if encoding == "fp32":
                    continue
                spent = math.inf
                try:
                    for _ in range(ENCODE_TIMINGS):  # the first call pays the codec's set-up (1 ms for zstd's)
                        started = time.perf_counter()
                        encoded = self._reencode(request, encoding)
                        spent = min(spent, time.perf_counter() - started)
                except Exception:
                    log.debug("wire encoding %s unavailable", encoding, exc_info=True)
                    continue
                wire = sum(len(c) for c in encoded.raw_input_contents)
                costs[encoding] = (wire / raw, spent / raw)
            self._costs = costs
        self._shape = shape
        allowed = FIDELITY_ORDER if self.wire_encoding == "auto" else (self.wire_encoding,)
        self._options = tuple(WireOption(e, shape[1] + round(raw * self._costs[e][0]), raw * self._costs[e][1] * 1e3,
                                         e in EXACT) for e in allowed if e in self._costs)

    def _reencode(self, request: inference_pb2.ModelInferRequest, encoding: str) -> inference_pb2.ModelInferRequest:
        out = inference_pb2.ModelInferRequest(model_name=request.model_name, model_version=request.model_version,
                                              id=request.id)
        for key, value in request.parameters.items():
            out.parameters[key].CopyFrom(value)
        out.outputs.extend(request.outputs)
        for name, array in decode_inputs(request).items():
            encode_input(out, name, array, encoding)
        return out


def _plain_fp32(request: inference_pb2.ModelInferRequest) -> bool:
    return bool(request.raw_input_contents) and all(
        t.datatype == "FP32" and not t.parameters for t in request.inputs)

