"""The local daemon: the edge agent as a process, serving the Open Inference Protocol on localhost.

An application that already speaks the protocol (tritonclient, KServe clients) gets tiered
inference by changing one address. Each response carries how it was answered in its parameters
(`tierkit.tier`, `tierkit.degraded`, `tierkit.score`, ...); a request may ask for its escalation
to be kept for later with the boolean parameter `tierkit.keep`.

Telemetry goes to `tierkit/v1/{device}/telemetry`: through the cloud link when it is MQTT, through
the configured broker otherwise, and into a journal (`<journal>.telemetry`) while neither is
reachable. With a broker, the retained `tierkit/v1/{device}/desired` document changes the budget
(a controller, when configured, re-decides at once) and the threshold (ignored while a controller
decides), and the result is reported (retained) on `.../reported`:

```json
{"budget": {"latency_ms": 25, "energy_mj": 4}, "threshold": 0.8}
```

Enrolled in a fleet, the desired document may also name a release (`"release": "sha256:..."`, `"soak"`,
`"rollback"`): the agent takes it through its A/B slots (`edge_agent.swap`, `edge_agent.slots`) and
reports at every step what it runs (`release`, `swap`, `slots`, `golden`, `crashes`). A release's
threshold, policy, budget and energy profile take effect with it; the desired document's own budget and
threshold still override them. The documents are `cloud_service.protocol.fleet_docs`'s; desired and
reported handling is `edge_agent.fleet_sync.FleetSync`; what runs is recorded by the slot store alone.

Example:
    >>> daemon = await AgentDaemon(load_config("agent.yaml")).start()
    >>> daemon.port
    8500
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import importlib.metadata
import itertools
import json
import logging
from pathlib import Path
from typing import Any

import grpc

from cloud_service.protocol import (
    CodecError,
    decode_inputs,
    encode_response,
    get_parameters,
    inference_pb2,
    inference_pb2_grpc,
    topics,
)
from cloud_service.protocol.codec import NP_TO_OIP
from cloud_service.protocol.fleet_docs import SwapState
from compilers import signing
from compilers.release import Release, open_release
from edge_agent.agent import EdgeAgent
from edge_agent.audit import with_router_state
from edge_agent.config import AgentConfig
from edge_agent.fleet_sync import FleetSync, TelemetryWindows, load_identity, model_digest
from edge_agent.journal import Journal, JournalEntry, drain
from edge_agent.slots import SlotStore
from edge_agent.swap import SwapOptions, Swapper, golden_of
from edge_agent.transports.base import TransportOptions
from edge_agent.transports.mqtt import MqttTransport
from edge_agent.transports.mqtt_session import MqttSession
from runtimes.energy import PROFILES, PowerProfile
from runtimes.errors import CloudUnavailable, ConfigError, InputError, JournalError, TierkitError

logger = logging.getLogger(__name__)

PARAM_KEEP = "tierkit.keep"
_MAX_MESSAGE = 64 * 1024 * 1024
_MAX_ERROR_CHARS = 1024  # an error message echoes request content: bounded
_THRESHOLDS = ("threshold", "target_rate", "target_accuracy")  # a policy takes one of them


def _version() -> str:
    try:
        return importlib.metadata.version("tierkit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _Servicer(inference_pb2_grpc.GRPCInferenceServiceServicer):
    """The Open Inference Protocol over one `EdgeAgent`."""

    def __init__(self, agent: EdgeAgent) -> None:
        self.agent = agent
        self.busy: collections.Counter[EdgeAgent] = collections.Counter()  # requests in flight per agent

    def _known(self, name: str) -> bool:
        return name in ("", self.agent.model_name)

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return inference_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return inference_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        return inference_pb2.ModelReadyResponse(ready=self._known(request.name))

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return inference_pb2.ServerMetadataResponse(name="tierkit-agent", version=_version())

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not self._known(request.name):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.name[:200]!r} is not served here; "
                                                           f"this agent serves {self.agent.model_name!r}")
        meta = inference_pb2.ModelMetadataResponse(name=self.agent.model_name, versions=["1"], platform="tierkit")
        for specs, target in ((self.agent.inputs, meta.inputs), (self.agent.outputs, meta.outputs)):
            for s in specs:
                target.add(name=s.name, datatype=NP_TO_OIP.get(s.dtype, s.dtype.upper()), shape=s.oip_shape)
        return meta

    async def ModelInfer(self, request: inference_pb2.ModelInferRequest,
                         context: grpc.aio.ServicerContext) -> inference_pb2.ModelInferResponse:
        agent = self.agent  # the whole request runs on this agent, even if a model swap replaces it meanwhile
        self.busy[agent] += 1
        try:
            return await self._infer(agent, request, context)
        finally:
            self.busy[agent] -= 1
            if not self.busy[agent]:
                del self.busy[agent]

    async def _infer(self, agent: EdgeAgent, request: inference_pb2.ModelInferRequest,
                     context: grpc.aio.ServicerContext) -> inference_pb2.ModelInferResponse:
        if request.model_name not in ("", agent.model_name):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model_name[:200]!r} is not served here; "
                                                           f"this agent serves {agent.model_name!r}")
        try:
            inputs = decode_inputs(request)
            keep = bool(get_parameters(request.parameters).get(PARAM_KEEP, False))
            pred = await agent.infer(inputs, keep=keep)
        except (CodecError, InputError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)[:_MAX_ERROR_CHARS])
        except TierkitError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.grpc_status, grpc.StatusCode.INTERNAL),
                                str(exc)[:_MAX_ERROR_CHARS])
        wanted = [o.name for o in request.outputs]
        unknown = set(wanted) - set(pred.outputs)
        if unknown:
            names = f"{sorted(unknown)[:5]}"[:_MAX_ERROR_CHARS]
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown output(s) {names}; "
                                                                  f"the model has {sorted(pred.outputs)}")
        outputs = {k: pred.outputs[k] for k in wanted} if wanted else pred.outputs
        params: dict[str, bool | int | float | str] = {
            "tierkit.tier": pred.tier, "tierkit.degraded": pred.degraded, "tierkit.score": pred.score,
            "tierkit.variant": pred.variant, "tierkit.latency_ms": pred.latency_ms,
            "tierkit.energy_mj": pred.energy_mj, "tierkit.energy_label": pred.energy_label,
            "tierkit.reason": pred.reason, topics.PARAM_SEQ: pred.seq, topics.PARAM_RELEASE: pred.release}
        return encode_response(agent.model_name, outputs, request_id=request.id, parameters=params)


class AgentDaemon:
    """`tierkit agent`: an `EdgeAgent`, its local gRPC endpoint, telemetry and desired state.

    Args:
        config: the validated `agent.yaml`.
        pause_swap_at: stop a swap for good at this state (`SwapOptions.pause_at`, for the crash tests).
    """

    def __init__(self, config: AgentConfig, *, pause_swap_at: SwapState | None = None) -> None:
        self.config = config
        opts = config.options
        self.device = opts.device_id
        self._digests: dict[str | None, str] = {}  # release digest (None: the configured model) -> model digest
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._servicer: _Servicer | None = None
        self._control: MqttSession | None = None
        self._telemetry_journal: Journal | None = None
        self._telemetry_seq = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        # enrolled in a fleet: telemetry goes out as per-window aggregates, reports name the release it runs
        self._windows: TelemetryWindows | None = None
        self.slots: SlotStore | None = None
        self.sync = FleetSync(self, None, None)
        self.agent: EdgeAgent
        if config.fleet is None:
            self.agent = self.build_agent(None)
            return
        self.slots = SlotStore(config.fleet.state_dir)
        note = self.slots.recover()
        if note:
            logger.warning("swap journal: %s", note)
        swap_opts = dataclasses.replace(self._swap_options(), pause_at=pause_swap_at)
        self.agent = self._boot(swap_opts)
        self._windows = TelemetryWindows(opts.boot_id)
        swapper = Swapper(self.slots, swap_opts, lambda release: self.build_agent(release, successor_of=self.agent))
        self.sync = FleetSync(self, self.slots, swapper)

    @property
    def release(self) -> Release | None:
        """The release that runs (None: the configured model), as the slot store records it."""
        return self.slots.running_release() if self.slots is not None else None

    @property
    def model_digest(self) -> str:
        """The digest of the model that runs (enrolled agents report it; "" otherwise)."""
        return self._model_id(self.release) if self.slots is not None else ""

    @property
    def desired_applied(self) -> int:
        return self.sync.applied

    def served(self) -> int:
        """Requests the serving agent answered (the soak counts them)."""
        self.agent.fold()
        return int(self.agent.stats.requests)

    def _swap_options(self) -> SwapOptions:
        fleet = self.config.fleet
        assert fleet is not None
        keys = tuple(signing.load_public_key(p) for p in fleet.release_keys)
        identity = load_identity(fleet.state_dir)
        auth = (identity.mqtt_username, identity.mqtt_password) if identity else None
        return SwapOptions(keys=keys, fleet_url=identity.fleet_url if identity else None, auth=auth,
                           session=self.config.options.session, ca_file=str(fleet.ca_file) if fleet.ca_file else None)

    def _boot(self, swap_opts: SwapOptions) -> EdgeAgent:
        """The committed release's agent (verified, and recorded as running in the slot store); the configured
        model's when there is none or it fails."""
        slots = self.slots
        assert slots is not None
        slot, digest = slots.state.committed, slots.committed_release()
        if slot is not None and digest is not None:
            try:
                release = open_release(slots.slot_dir(slot), trusted_keys=list(swap_opts.keys), expect_digest=digest)
                agent = self.build_agent(release)
                slots.opened(slot, release)
                return agent
            except TierkitError as exc:
                logger.error("the committed release %s does not open (%s); running the configured model %s",
                             digest, exc, self.config.model)
        if slots.state.active is not None:
            slots.activate(None, None)
        return self.build_agent(None)

    def build_agent(self, release: Release | None, *, successor_of: EdgeAgent | None = None) -> EdgeAgent:
        """An agent for `release` (None: the configured model), with the desired overrides (any thread)."""
        cfg = self.config
        policy, budget, opts = cfg.policy, cfg.budget, cfg.options
        if successor_of is not None:
            opts = successor_of.options  # telemetry_interval_s may have been changed by a desired document
        if release is not None:
            settings = release.policy  # over the configured policy: keep, cache_size... stay unless it sets them
            if release.threshold is not None:
                settings["threshold"] = release.threshold
            if settings.keys() & _THRESHOLDS:
                settings = {**dict.fromkeys(_THRESHOLDS), **settings}
            try:
                policy = dataclasses.replace(policy, **settings)
                budget = release.budget.apply(budget)
            except TypeError as exc:
                msg = f"release {release.digest}: its policy or budget does not fit this agent ({exc})"
                raise ConfigError(msg) from None
            opts = dataclasses.replace(opts, power=_power(release.energy_profile, opts.power))
        if cfg.fleet is not None:  # the learned escalation rule lives in the state directory; a release may seed it
            shipped = Path(release.variants_dir) / "router.json" if release is not None else None
            audit = dataclasses.replace(opts.audit, router=cfg.options.audit.router)  # not the predecessor's file
            opts = dataclasses.replace(opts, audit=with_router_state(
                audit, cfg.fleet.state_dir, release.digest if release is not None else "configured", shipped))
        agent = EdgeAgent(release.variants_dir if release else cfg.model, cloud=cfg.cloud, budget=budget,
                          policy=policy, controller=cfg.controller, options=opts, telemetry=self._publish_telemetry,
                          successor_of=successor_of)
        # answers name what answered: the release, else the configured model's digest
        agent.release = release.digest if release is not None else self._model_id(None)
        self.sync.overrides(agent)
        return agent

    def _model_id(self, release: Release | None) -> str:
        key = None if release is None else release.digest
        if key not in self._digests:
            self._digests[key] = model_digest(release.variants_dir if release is not None else Path(self.config.model))
        return self._digests[key]

    async def start(self) -> AgentDaemon:
        """Start the agent, bind the local endpoint, connect the control channel."""
        if self.slots is not None and await asyncio.to_thread(self.slots.mark_running):
            logger.warning("the agent did not stop cleanly last time (crashes so far: %d)", self.slots.state.crashes)
            if self._windows is not None:
                self._windows.crashes += 1
        await self.agent.start()
        await self._golden_after_restart()
        if self.config.options.journal_path is not None:
            path = Path(self.config.options.journal_path)
            # opening runs SQLite's integrity check: off the loop
            self._telemetry_journal = await asyncio.to_thread(Journal, path.with_name(path.name + ".telemetry"),
                                                              max_bytes=self.config.options.journal_max_bytes)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                                          ("grpc.max_send_message_length", _MAX_MESSAGE)])
        self._servicer = _Servicer(self.agent)
        inference_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            self._servicer, server)
        host, port = self.config.listen
        try:
            self.port = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:
            await self.agent.aclose()
            msg = f"cannot listen on {host}:{port} ({exc}); is another agent running there?"
            raise ConfigError(msg) from None
        await server.start()
        self._server = server
        self._start_control()
        if self.sync.swapper is not None:
            self._tasks.append(asyncio.create_task(self.sync.run_swaps(), name="tierkit-swap"))
        if self.slots is not None:  # enrolled: the fleet learns what runs here without waiting for a desired doc
            self._tasks.append(asyncio.create_task(self.sync.first_report(), name="tierkit-first-report"))
        return self

    async def _golden_after_restart(self) -> None:
        """A restart (clean or not) on a release clears nothing the fleet relies on: its golden inputs are
        re-run here when the journal holds no result for what runs (`slots.recover` drops it on a rollback)."""
        release = self.release
        if self.slots is None or release is None or self.slots.state.golden is not None:
            return
        session = self.sync.swapper.options.session if self.sync.swapper is not None else None
        try:
            golden = await asyncio.to_thread(golden_of, release, session)
        except TierkitError as exc:
            golden = {"ok": False, "reason": str(exc)[:300], "max_rel_error": None}
        await asyncio.to_thread(self.slots.set_golden, golden)

    def _control_broker(self) -> tuple[str, int] | None:
        if self.config.broker is not None:
            return self.config.broker
        transport = self.agent.transport
        return transport.cloud.targets[0] if getattr(transport, "name", "") == "mqtt" else None  # type: ignore[union-attr]

    def _start_control(self) -> None:
        desired = topics.desired_topic(self.device)
        transport = self.agent.transport
        if isinstance(transport, MqttTransport) and self.config.broker in (None, transport.cloud.targets[0]):
            # one session, one client id (the device id): the per-device broker ACL covers it all
            transport.listen(desired, self.sync.on_desired)
            return
        broker = self._control_broker()
        if broker is None:
            return
        tls = self.config.broker_tls if self.config.broker is not None else False
        self._control = MqttSession(broker[0], broker[1], client_id=self.device, subscribe=desired, tls=tls,
                                    options=self.agent.options.transport or TransportOptions(),
                                    on_message=self.sync.on_desired, on_down=lambda why: None)
        self._control.start()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self._control is not None:
            await self._control.close()
        await self.agent.aclose()
        if self._telemetry_journal is not None:
            self._telemetry_journal.close()
        if self.slots is not None:
            self.slots.clear_running()

    # -- model swaps (the fleet sync applies the swap's `active` step here) --------------------------

    async def switch(self, agent: EdgeAgent) -> None:
        """Serve from `agent` (built with `successor_of=` the running one) from now on; requests in flight
        finish on the old agent, which is closed once they have (bounded by the drain timeout)."""
        old = self.agent
        agent.take_over()
        await agent.start()
        old.telemetry = None
        last = self._window(old) if self._windows is not None else None  # named by what ran until now
        self.agent = agent
        if self._servicer is not None:
            self._servicer.agent = agent
        if self._windows is not None:
            self._windows.restart()
        if last is not None:
            await self._send_window(last)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.config.budget.latency_ms / 1e3, old.options.drain_timeout_s)
        while self._servicer is not None and self._servicer.busy.get(old) and loop.time() < deadline:
            await asyncio.sleep(0.005)
        await old.aclose()

    async def __aenter__(self) -> AgentDaemon:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- telemetry ------------------------------------------------------------------------------

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish through the cloud link when it is MQTT and up, else through the control session."""
        transport = self.agent.transport
        if getattr(transport, "name", "") == "mqtt" and transport.connected:  # type: ignore[union-attr]
            await transport.publish(topic, payload, qos=1, retain=retain)  # type: ignore[union-attr]
            return
        control = self._control
        if control is None or not control.up:
            msg = "no MQTT broker is connected"
            raise CloudUnavailable(msg)
        info = control.publish(topic, payload, qos=1, retain=retain)
        await control.acknowledged(info, 5.0)

    def _window(self, agent: EdgeAgent, snapshot: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self._windows is not None
        release = self.release
        return self._windows.window(agent.snapshot() if snapshot is None else snapshot, agent.stats.recent_latencies,
                                    release=release.digest if release is not None else None,
                                    model_digest=self.model_digest)

    async def _publish_telemetry(self, doc: dict[str, Any]) -> None:
        await self._send_window(self._window(self.agent, doc) if self._windows is not None else doc)

    async def _send_window(self, doc: dict[str, Any]) -> None:
        payload = json.dumps(doc, default=str).encode()
        topic = topics.telemetry_topic(self.device)
        journal = self._telemetry_journal
        try:
            if journal is not None and journal.count():
                await drain(journal, self._send_telemetry)
            await self.publish(topic, payload)
        except (TierkitError, TimeoutError, ConnectionError) as exc:
            if journal is None:
                logger.debug("telemetry dropped (no broker, no journal): %s", exc)
                return
            try:
                await asyncio.to_thread(journal.append, "telemetry", payload, device=self.device,
                                        boot_id=self.agent.options.boot_id, seq=next(self._telemetry_seq))
            except JournalError as full:  # full, or its disk failing: telemetry is not worth more
                logger.warning("telemetry dropped: %s", full)

    async def _send_telemetry(self, entry: JournalEntry) -> None:
        await self.publish(topics.telemetry_topic(self.device), entry.payload)


def _power(profile: str | dict[str, Any] | None, current: PowerProfile) -> PowerProfile:
    """A release's energy profile: a full `PowerProfile` mapping, or the name of the default one."""
    if isinstance(profile, dict):
        try:
            return PowerProfile(**profile)
        except TypeError as exc:
            msg = f"the release's energy_profile is not a power profile ({exc})"
            raise ConfigError(msg) from None
    if profile is not None and profile in PROFILES:
        return PROFILES[profile]
    if profile is not None and profile != current.name:
        logger.warning("the release names energy profile %r, unknown here; keeping %r", profile, current.name)
    return current


async def run_daemon(config: AgentConfig, *, stop: asyncio.Event, ready: Any = None,
                     pause_swap_at: SwapState | None = None) -> None:
    """Run until `stop` is set; `ready(daemon)` is called once it serves."""
    async with AgentDaemon(config, pause_swap_at=pause_swap_at) as daemon:
        if ready is not None:
            ready(daemon)
        await stop.wait()
