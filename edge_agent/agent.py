"""The edge agent: answer from a local variant, escalate the rows it is unsure about, never block.

```
infer(x) -> check inputs -> cache? -> run variant -> policy scores -> all confident: edge answer
                                                          | unsure rows
        breaker open / no time left / RTT clearly does not fit / rate cap -> local answer, degraded
        transport.escalate(unsure rows, deadline = budget - elapsed - margin)
            ok and well formed -> cloud rows merged in, tier="cloud"
            failed / late / malformed -> local answer, degraded
```

With `keep`, an escalation is journaled (durably, fsync) *before* it is sent and cleared once the cloud
answered, so a `kill -9` at any instant loses nothing: an entry the cloud had answered but the agent had
not yet cleared is sent again, carrying the same device, boot id, seq and request id, and the cloud's
duplicate cache answers it without computing it twice.

Every `Prediction` owns its arrays: `outputs`, `scores` and `cloud_rows` are writable and shared with
nothing (not with the cache, not with a reply's buffer, not with another answer), for edge, cloud and
cached answers alike.

The no-escalation path (`edge`) is synchronous, so `TieredModel.predict` runs it in the caller's
thread with no hop to the event loop; only escalations (`escalate`) run on the loop. Per-request
observations go to a deque (thread-safe append, no lock on the hot path) that a background task
folds into the statistics, the telemetry and the controller.

The agent is assembled from parts that share its state (`edge_agent.agent_state`): the escalation
path (`edge_agent.escalation`), result assembly (`edge_agent.results`) and background work
(`edge_agent.background`: statistics, telemetry, the journal's drain).

Example:
    >>> async with EdgeAgent("variants/", cloud="grpc://127.0.0.1:8001/digits",
    ...                      budget=Budget(latency_ms=20)) as agent:
    ...     pred = await agent.infer(x)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cloud_service.protocol.preprocess import Preprocess
from compilers.package import ModelPackage
from compilers.variants import VariantSet
from compilers.version_floor import VersionFloor
from edge_agent.adaptive import build_controller
from edge_agent.agent_state import LateReply, Pending, Telemetry, perf_counter
from edge_agent.audit import Auditor
from edge_agent.background import Background
from edge_agent.breaker import CircuitBreaker
from edge_agent.budget import Budget
from edge_agent.cache import ResultCache, input_key
from edge_agent.controller import Controller
from edge_agent.escalation import EscalationPath
from edge_agent.frames import from_frame
from edge_agent.journal import Journal
from edge_agent.link import Link
from edge_agent.options import AgentOptions, edge_session
from edge_agent.policy import Policy
from edge_agent.prediction import Prediction
from edge_agent.pushback import DrainPace, Pushback
from edge_agent.side_runs import SideRuns
from edge_agent.stats import Observation, Stats
from edge_agent.transports.base import Transport, open_transport
from edge_agent.variants import Variant, load_packages, open_variants
from runtimes.errors import InputError, ModelClosed
from runtimes.spec import check_inputs

__all__ = ["AgentOptions", "EdgeAgent", "LateReply", "Pending", "Telemetry"]

logger = logging.getLogger(__name__)


class EdgeAgent(EscalationPath, Background):
    """Composes edge sessions, an escalation policy, a transport, a breaker, a cache and a journal.

    Args:
        model: a variant-set directory, a package directory or `.tkpkg`, a `VariantSet` or a `ModelPackage`.
        cloud: a cloud URL (`grpc://HOST:PORT/MODEL`, `mqtt://BROKER:PORT/MODEL`), a `Transport`, or None.
        budget: the per-request budget; escalation deadlines come out of its `latency_ms`.
        policy: a `Policy` or a scorer name.
        controller: True builds one from the variants (see `edge_agent.adaptive`), or a ready
            `Controller`; its `current` decision picks the variant and threshold of each request.
            None or False: the policy's threshold on the recommended variant.
        options: rarer knobs (`AgentOptions`).
        meter: an energy meter with `label`, `start()` and `stop() -> reading` (measured figures).
        telemetry: an async callable publishing one telemetry document.
        on_late_reply: called with (seq, outputs or None) when a journaled escalation is answered.
        trusted_keys: Ed25519 public keys packages must be signed with.
        version_floor: a JSON file of the newest version opened per model; an older one is refused
            unless it is a signed rollback (`compilers.version_floor`).
        successor_of: a running agent this one will replace (a model swap): it shares that agent's
            transport; `take_over()` then hands it the journal, request numbering, breaker and round trips.

    Example:
        >>> agent = EdgeAgent("variants/", cloud=None, policy=Policy("margin", threshold=0.3))
        >>> async with agent:
        ...     pred = await agent.infer(np.zeros((1, 1, 8, 8), np.float32))
    """

    def __init__(self, model: str | Path | VariantSet | ModelPackage, *, cloud: str | Transport | None = None,
                 budget: Budget | None = None, policy: Policy | str | None = None,
                 controller: bool | Controller | None = None,
                 options: AgentOptions | None = None, meter: Any = None, telemetry: Telemetry | None = None,
                 on_late_reply: LateReply | None = None, trusted_keys: Iterable[Any] | None = None,
                 version_floor: str | Path | None = None, successor_of: EdgeAgent | None = None) -> None:
        self.options = opts = options or AgentOptions()
        self._predecessor = successor_of
        self._owns_link = successor_of is None  # the transport and journal: closed by whoever owns them
        self._link_open = False  # the transport was entered (by a predecessor whose link this agent took over)
        if successor_of is not None:
            cloud = successor_of.transport
        self.budget = budget or Budget()
        self.policy = policy if isinstance(policy, Policy) else Policy(policy or "calibrated")
        ctl = None if isinstance(controller, bool) else controller
        floor = VersionFloor(version_floor) if version_floor is not None else None
        packages, recommended = load_packages(model, trusted_keys=trusted_keys, floor=floor)
        ids = list(packages) if controller is True or ctl is not None else [recommended]
        # variants whose golden inputs do not reproduce here, with why (the agent runs the next rung)
        self.refused: dict[str, str] = {}
        self.variants = open_variants(packages, self.policy, ids, edge_session(opts.session), opts.inline_max_ms,
                                      self.refused)
        self._variant = self.variants.get(recommended) or next(iter(self.variants.values()))
        self.inputs = self._variant.session.inputs
        self.outputs = self._variant.session.outputs
        self.model_name = self._variant.name
        self.release = ""  # the fleet release (digest) it serves; `tierkit agent` sets it, Prediction carries it
        self._names = frozenset(s.name for s in self.inputs)
        # the package's declared frame -> input preprocessing (`infer(frame=...)`), if it declares one
        declared = self._variant.package.manifest.preprocess
        self.preprocess: Preprocess | None = Preprocess.from_json(declared) if declared else None
        self._single_input = self.inputs[0].name if len(self.inputs) == 1 else None
        # per input: spec, dtype, rank, and the fixed trailing dims when only the batch axis varies
        self._checks = tuple((s, np.dtype(s.dtype), len(s.shape),
                              tuple(s.shape[1:]) if s.dynamic_batch and all(isinstance(d, int) for d in s.shape[1:])
                              else None) for s in self.inputs)
        self._threshold: float | None = None
        if isinstance(cloud, str):
            cloud = open_transport(cloud, device_id=opts.device_id, boot_id=opts.boot_id, options=opts.transport)
        self.transport: Transport | None = cloud
        self.cloud_model = (cloud.model if cloud is not None else "") or self.model_name
        # the one view of the link: the skip rule, the breaker, the wire encoder and the controller read it
        self.link: Link = (ctl.link.link if ctl is not None and ctl.link is not None else
                           Link(rtt_ms=opts.adaptive.rtt_ms, horizon_s=opts.rtt_max_age_s,
                                timer_lateness_ms=opts.timer_lateness_ms))
        if controller is True:
            try:
                ctl = build_controller(self.variants, self.budget, power=opts.power, cloud=cloud is not None,
                                       options=opts.adaptive, link=self.link)
            except BaseException:
                self._close_sessions()
                raise
        if ctl is not None and ctl.deadline_margin_ms is None:
            ctl.deadline_margin_ms = opts.margin_ms  # it plans escalations to end where this agent's timer ends them
        self.controller: Controller | None = ctl
        # the variants not serving, timed now and then at the load of now (`edge_agent.side_runs`)
        self._side = (SideRuns(opts.adaptive.side_run_every)
                      if isinstance(ctl, Controller) and len(ctl.profiles) > 1 else None)
        self.breaker = CircuitBreaker(opts.breaker, link=self.link)
        if (encoder := getattr(cloud, "encoder", None)) is not None:
            encoder.meter = self.link  # the bandwidth the transport times is the link's
            if isinstance(ctl, Controller):
                ctl.attach_encoder(encoder)  # the encoding is chosen with the variant and threshold
        self._init_state(meter, telemetry, on_late_reply)
        self.audits = Auditor(opts.audit, self)  # audits of confident answers, drift, the learned rule
        self._audit_mj_folded = 0.0
        if isinstance(ctl, Controller) and self.audits.active:
            audits = self.audits
            ctl.attach_audits(lambda: audits.rate if audits.active else 0.0)  # planned with the escalations

    def _init_state(self, meter: Any, telemetry: Telemetry | None, on_late_reply: LateReply | None) -> None:
        """What the agent keeps while it runs: pacing, cache, counters, the journal, tasks in flight."""
        opts = self.options
        self.pushback = Pushback()  # the cloud's "busy, retry after" (edge_agent.pushback)
        self._pace = DrainPace(opts.drain_rate_per_s)
        self.cache: ResultCache[Prediction] | None = (ResultCache(self.policy.cache_size)
                                                      if self.policy.cache_size else None)
        self.stats = Stats()
        self.meter = meter
        self.telemetry = telemetry
        self.on_late_reply = on_late_reply
        self.journal: Journal | None = None
        self._seq = itertools.count(1)
        self._obs: deque[Observation] = deque()
        self._fold_lock = threading.Lock()
        self._measured_mj: float | None = None
        self._tokens = (math.inf, time.monotonic())  # a full bucket, whatever the cap
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        # (variant id, batch size) -> smoothed ms of an edge call at that size: picks inline or worker thread
        self._batch_ms: dict[tuple[str, int], float] = {}
        # journaled escalations being sent now: seq -> resolves True once answered (and cleared), False if not
        self._inflight: dict[int, asyncio.Future[bool]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._drain_wake: asyncio.Event | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def take_over(self) -> None:
        """Become the agent that owns the link of `successor_of` (on the event loop, before `start`): its
        journal, request numbering (so no seq is used twice), breaker and round-trip estimates. The old
        agent goes on answering the requests it has in flight; closed, it leaves the link open."""
        old = self._predecessor
        if old is None or self._owns_link:
            return
        self.journal, self._seq, self._inflight = old.journal, old._seq, old._inflight
        self.breaker, self.link = old.breaker, old.link
        self.pushback, self._pace = old.pushback, old._pace
        old._owns_link, self._owns_link, self._link_open, self._predecessor = False, True, True, None
        for task in old._tasks:
            if task.get_name() == "tierkit-drain":  # one drain per journal: this agent's
                task.cancel()

    async def start(self) -> EdgeAgent:
        """Connect the transport, open the journal and start the background tasks."""
        if self._predecessor is not None:
            msg = "a successor agent starts after take_over(); call it on the event loop first"
            raise ModelClosed(msg)
        if self.transport is not None and not self._link_open:
            await self.transport.__aenter__()
        if self.options.journal_path is not None and self.journal is None:
            # a corrupt file is moved aside (and logged) by the journal itself; `journal.recovered_from` says where.
            # Opening runs SQLite's integrity check and fsyncs: in a worker thread, never on the loop.
            self.journal = await asyncio.to_thread(Journal, self.options.journal_path,
                                                   max_bytes=self.options.journal_max_bytes)
        self._drain_wake = asyncio.Event()
        self.audits.bind(asyncio.get_running_loop())
        if self.meter is not None:
            self.meter.start()
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="tierkit-housekeeping"))
        if self.journal is not None and self.transport is not None:
            self._tasks.append(asyncio.create_task(self._drain_loop(), name="tierkit-drain"))
        return self

    async def aclose(self) -> None:
        """Stop background tasks, close the transport, the journal and the sessions. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.audits.aclose()
        self.fold()
        if self._owns_link and self.transport is not None:
            await self.transport.aclose()
        if self._owns_link and self.journal is not None:
            self.journal.close()
        self._close_sessions()

    def _close_sessions(self) -> None:
        for v in self.variants.values():
            v.session.close()

    async def __aenter__(self) -> EdgeAgent:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the request path ----------------------------------------------------------------------

    async def infer(self, x: Any = None, *, keep: bool = False, frame: Any = None) -> Prediction:
        """Answer `x` (one input or a batch, an array or a dict of named arrays), or a raw `frame`.

        Args:
            x: the model input.
            keep: journal an escalation the cloud cannot answer now, and send it when it is back.
            frame: instead of `x`, the raw uint8 camera frame (`[N,] H, W, C`) of a package that declares
                its preprocessing: the edge runs on the preprocessed input, and an escalation carries
                the frame itself (`AgentOptions.send_frames`), which the cloud preprocesses the same way.

        Raises:
            InputError: wrong input names, dtypes or shapes (before anything runs).
            EscalationError: only with `AgentOptions(strict=True)`.
            ModelClosed: the agent was closed.
        """
        t0 = perf_counter()
        x, frame = from_frame(self.preprocess, self._single_input, self.model_name, x, frame)
        if self.inline_for(x):
            step = self.edge(x, t0=t0, keep=keep, frame=frame)
        else:  # a slow variant would stall every other request on this loop
            step = await asyncio.to_thread(self.edge, x, t0=t0, keep=keep, frame=frame)
        return step if isinstance(step, Prediction) else await self.escalate(step)

    def normalize(self, x: Any) -> tuple[dict[str, np.ndarray], bool]:
        """Named, batched, checked inputs, and whether `x` was a single sample without a batch axis."""
        if isinstance(x, np.ndarray) and self._single_input is not None:  # the common case, kept lean
            spec, dtype, ndim, tail = self._checks[0]
            single = spec.dynamic_batch and x.ndim == ndim - 1
            if single:
                x = x[None]
            if not (x.dtype == dtype and x.ndim == ndim and (x.shape[1:] == tail if tail else spec.matches(x))):
                check_inputs(self.inputs, {spec.name: x})
            return {spec.name: x}, single
        if isinstance(x, Mapping):
            inputs = dict(x)
        elif self._single_input is not None:
            inputs = {self._single_input: x}
        else:
            msg = f"the model takes {len(self.inputs)} inputs {sorted(self._names)}; pass a dict of arrays"
            raise InputError(msg)
        flags = set()
        for spec, _dtype, ndim, _tail in self._checks:
            a = inputs.get(spec.name)
            if a is None:
                continue
            if not isinstance(a, np.ndarray):
                a = inputs[spec.name] = np.asarray(a, dtype=spec.dtype)
            one = spec.dynamic_batch and a.ndim == ndim - 1
            inputs[spec.name] = a[None] if one else a
            flags.add(one)
        if len(flags) > 1:
            msg = "give every input a batch axis, or none of them"
            raise InputError(msg)
        check_inputs(self.inputs, inputs)
        if len({len(a) for a in inputs.values()}) > 1:
            msg = f"inputs have different batch sizes {[len(a) for a in inputs.values()]}"
            raise InputError(msg)
        return inputs, flags == {True}

    def edge(self, x: Any, *, t0: float, keep: bool = False, frame: np.ndarray | None = None) -> Prediction | Pending:
        """The synchronous part: check, cache, run the variant, score. Escalation is left `Pending`."""
        if self._closed:
            msg = f"the edge agent for {self.model_name!r} is closed; open a new one (sdk.load or EdgeAgent)"
            raise ModelClosed(msg)
        inputs, single = self.normalize(x)
        key = None
        if self.cache is not None:
            key = input_key(inputs)
            hit = self.cache.get(key)
            if hit is not None:
                return self._cached(hit, t0)
        variant, threshold = (self._variant, self._threshold) if self.controller is None else self._current()
        outputs = variant.session.run(inputs)
        edge_ms = (perf_counter() - t0) * 1e3
        self._timed(variant.id, len(next(iter(inputs.values()))), edge_ms)
        policy = variant.policy
        scores = policy.scorer.score(outputs)
        scores, limit = self.audits.route(outputs, scores, policy.threshold if threshold is None else threshold)
        seq = next(self._seq)
        if len(scores) == 1:  # a scalar compare is cheaper than an array op and .any()
            if not scores[0] < limit:
                return self._confident(variant, inputs, outputs, scores, single, t0, edge_ms, seq, key)
            mask = scores < limit
        else:
            mask = scores < limit
            if not mask.any():
                return self._confident(variant, inputs, outputs, scores, single, t0, edge_ms, seq, key)
        if self.transport is None:  # edge only: unsure, but nowhere to escalate (not degraded)
            return self._finish(variant, outputs, scores, single, t0, edge_ms, seq, reason="no_cloud",
                                wanted=int(mask.sum()))
        return Pending(variant, inputs, outputs, scores, mask, single, t0, edge_ms, keep or self.policy.keep, key,
                       seq, frame)

    def _confident(self, v: Variant, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
                   scores: np.ndarray, single: bool, t0: float, edge_ms: float, seq: int,
                   key: bytes | None) -> Prediction:
        """The edge answer; a share of them is also audited by the cloud in the background (`edge_agent.audit`)."""
        audit = self.audits.draw(seq)
        if audit:  # copied before the app gets (and may edit) the arrays; sent after the answer is back
            self.audits.submit(v.id, inputs, outputs, seq)
        return self._finish(v, outputs, scores, single, t0, edge_ms, seq, key=key)

    # -- control -------------------------------------------------------------------------------

    def set_budget(self, budget: Budget) -> None:
        """Change the budget of the next requests (and the controller's)."""
        self.budget = budget
        if self.controller is not None:
            with self._fold_lock:  # the controller is not thread-safe: one caller at a time
                self.controller.set_budget(budget)

    def set_threshold(self, threshold: float | None) -> None:
        """Override the policy's threshold (None: back to the policy's); ignored while a controller decides."""
        self._threshold = threshold

    @property
    def threshold(self) -> float:
        """The threshold requests are decided with now."""
        variant, threshold = self._current()
        return variant.policy.threshold if threshold is None else threshold

    @property
    def variant(self) -> str:
        """The id of the variant requests run on now."""
        return self._current()[0].id

    @property
    def inline(self) -> bool:
        """Whether the current variant is fast enough at batch 1 to run on an event loop."""
        return self._current()[0].inline

    def inline_for(self, x: Any) -> bool:
        """Whether answering `x` is fast enough to run on an event loop: decided per batch size, from the
        time measured at that size, or batch 1's time scaled by the batch size until one is measured."""
        variant = self._current()[0]
        if not variant.inline:
            return False
        spec, _dtype, ndim, _tail = self._checks[0]
        a = x.get(spec.name) if isinstance(x, Mapping) else x
        shape = getattr(a, "shape", None)
        n = int(shape[0]) if shape is not None and len(shape) == ndim and ndim and spec.dynamic_batch else 1
        if n <= 1:
            return True
        ms = self._batch_ms.get((variant.id, n))
        return (variant.p50_ms * n if ms is None else ms) <= self.options.inline_max_ms

    def _timed(self, variant: str, n: int, ms: float) -> None:
        key = (variant, n)
        old = self._batch_ms.get(key)
        if old is not None:
            self._batch_ms[key] = 0.8 * old + 0.2 * ms
        elif len(self._batch_ms) < 1024:  # bounded: one entry per batch size seen
            self._batch_ms[key] = ms
