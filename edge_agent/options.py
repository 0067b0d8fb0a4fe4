"""`AgentOptions`: the rarer knobs of an `EdgeAgent` (a frozen dataclass, checked on construction)."""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from cloud_service.protocol import topics
from edge_agent.adaptive import AdaptiveOptions
from edge_agent.audit import AuditOptions
from edge_agent.breaker import BreakerConfig
from edge_agent.transports.base import TransportOptions
from runtimes.energy import PowerProfile
from runtimes.errors import ConfigError
from runtimes.hardware import machine_power_profile
from runtimes.session import SessionOptions


@dataclass(frozen=True)
class AgentOptions:
    """The rarer knobs of an `EdgeAgent`.

    Args:
        device_id: this device's id on the wire (default: the host name).
        boot_id: this run's id (default: a fresh UUID); journaled entries are keyed by both.
        breaker: when the circuit breaker opens and probes.
        transport: connection settings passed to `open_transport`.
        session: thread counts and device for the edge sessions. onnxruntime's threads do not spin unless
            it says `spin=True` (`edge_session`): spinning kept a core busy between a tiny model's runs (1.02 cores
            at 100 inferences a second where 0.02-0.03 did without, a few hundredths of a millisecond a run
            faster), on a device whose energy and other work need it.
        margin_ms: kept free of the budget when an escalation deadline is set, on top of the agent
            timer's lateness it learns (`link.TimerLateness`, prior `timer_lateness_ms`).
        timer_lateness_ms: the lateness of an abandoned escalation assumed until some are observed.
        min_deadline_ms: below this much time left, escalation is skipped.
        inline_max_ms: a call this fast runs on the event loop; slower ones in a worker thread. Decided
            per batch size, from the variant's measured time at that size (scaled from batch 1 until measured).
        rtt_quantile: the round-trip quantile an escalation must fit in (without a controller).
        rtt_skip_share: with a controller (whose threshold already prices the link), escalation is
            skipped for the round trip only when the time left is below this share of the median one.
        rtt_max_age_s: round trips older than this are forgotten (the link's `horizon_s`).
        rtt_probe_s: while escalations are skipped for the round trip (or a busy cloud's retry hint), one
            goes anyway each this long: the probe that notices a returned link. It ends at the agent's
            deadline like any escalation, so it costs the request it carries no latency budget.
        power: the power profile used to model energy when no meter is given (default: this machine's,
            chosen by the hardware probe, the one the compiler records energy with).
        journal_path: the store-and-forward journal (None: nothing is journaled).
        journal_max_bytes: its bound.
        drain_interval_s: how often the journal is drained while the link is up.
        drain_timeout_s: the deadline of a journaled escalation when it is finally sent.
        drain_probe_s: the deadline of the first one of a drain, which probes whether the cloud answers;
            a drain starts as soon as a live escalation is answered, else every `drain_interval_s`
            while the transport is connected (whatever the circuit breaker says).
        drain_window: journaled escalations in flight at once while draining.
        drain_rate_per_s: journaled escalations sent per second at most (a token bucket); each busy
            refusal from the cloud halves the rate and pauses the drain for the cloud's retry hint, each
            answer raises it again (`edge_agent.pushback.DrainPace`), so a fleet reconnecting at once
            does not flood the cloud it drains into.
        telemetry_interval_s: how often telemetry is published.
        strict: raise the escalation error instead of answering degraded.
        send_frames: escalate the raw frame given as `infer(frame=...)` in the `frame` wire encoding (the
            cloud applies the package's declared preprocessing; a quarter of the fp32 bytes for a frame at
            the model's size). Needs a cloud listing the `tierkit.encodings` extension (tierkit's own);
            False sends the preprocessed input instead, for a stock Triton or KServe.
        adaptive: how `controller=True` builds the controller (cloud accuracy prior, ...).
        audit: audits of confident answers, drift detection and the learned escalation rule (`edge_agent.audit`).
    """

    device_id: str = field(default_factory=lambda: _safe_device(socket.gethostname()))
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    transport: TransportOptions | None = None
    session: SessionOptions | None = None
    margin_ms: float = 1.0
    timer_lateness_ms: float = 1.0
    min_deadline_ms: float = 0.5
    inline_max_ms: float = 1.0
    rtt_quantile: float = 0.9
    rtt_skip_share: float = 0.5
    rtt_max_age_s: float = 5.0
    rtt_probe_s: float = 0.25
    power: PowerProfile = field(default_factory=machine_power_profile)
    journal_path: str | Path | None = None
    journal_max_bytes: int = 64 * 1024 * 1024
    drain_interval_s: float = 0.5
    drain_timeout_s: float = 5.0
    drain_probe_s: float = 0.5
    drain_window: int = 32
    drain_rate_per_s: float = 20.0
    telemetry_interval_s: float = 10.0
    strict: bool = False
    send_frames: bool = True
    adaptive: AdaptiveOptions = field(default_factory=AdaptiveOptions)
    audit: AuditOptions = field(default_factory=AuditOptions)

    def __post_init__(self) -> None:
        try:
            topics.check_device_id(self.device_id)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not (self.drain_probe_s > 0 and self.drain_timeout_s > 0 and self.drain_window >= 1
                and self.drain_rate_per_s > 0):
            msg = ("AgentOptions: drain_probe_s, drain_timeout_s and drain_rate_per_s must be > 0 and "
                   "drain_window >= 1")
            raise ConfigError(msg)
        if (self.margin_ms < 0 or self.min_deadline_ms < 0 or self.timer_lateness_ms < 0
                or not 0 < self.rtt_quantile <= 1 or not 0 <= self.rtt_skip_share <= 1 or not self.rtt_max_age_s > 0):
            msg = ("AgentOptions: margin_ms, min_deadline_ms, timer_lateness_ms must be >= 0, rtt_quantile in (0, 1], "
                   "rtt_skip_share in [0, 1] and rtt_max_age_s > 0")
            raise ConfigError(msg)


def edge_session(options: SessionOptions | None) -> SessionOptions:
    """The options an agent opens its variants with: `options` (default ones if None), onnxruntime's threads
    not spinning unless `options.spin` is True."""
    options = options or SessionOptions()
    return options if options.spin is not None else replace(options, spin=False)


def _safe_device(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:128]
    return cleaned.lstrip("$") or "edge"


