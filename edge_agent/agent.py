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
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cloud_service.protocol import inference_pb2, topics
from cloud_service.protocol.preprocess import Preprocess
from cloud_service.protocol.wire import Request, raw_request, serialize_request, wire_size
from compilers.package import ModelPackage
from compilers.variants import VariantSet
from compilers.version_floor import VersionFloor
from edge_agent.adaptive import build_controller
from edge_agent.audit import Auditor
from edge_agent.breaker import CircuitBreaker
from edge_agent.budget import Budget
from edge_agent.cache import ResultCache, input_key
from edge_agent.controller import Controller, Decision
from edge_agent.frames import from_frame, mark_frame
from edge_agent.journal import Journal, JournalEntry, drain
from edge_agent.ladder import Variant, load_packages, open_variants
from edge_agent.link import Link, TimerLateness
from edge_agent.options import AgentOptions
from edge_agent.policy import Policy
from edge_agent.prediction import Prediction, make_prediction
from edge_agent.pushback import DrainPace, Pushback, retry_hint_s
from edge_agent.replies import check_reply, decode_reply
from edge_agent.stats import Stats, feed_controller, top1_agreed
from edge_agent.transports.base import Transport, open_transport
from runtimes.errors import (
    CloudTimeout,
    CloudUnavailable,
    EscalationError,
    InputError,
    JournalError,
    JournalFull,
    ModelClosed,
)
from runtimes.spec import check_inputs

__all__ = ["AgentOptions", "EdgeAgent", "LateReply", "Pending", "Telemetry"]

logger = logging.getLogger(__name__)

perf_counter = time.perf_counter
Telemetry = Callable[[dict[str, Any]], Awaitable[None]]
LateReply = Callable[[int, dict[str, np.ndarray] | None], None]


@dataclass
class Pending:
    """An edge result with rows to escalate: what `escalate` needs to finish the request."""

    variant: Variant
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    scores: np.ndarray
    mask: np.ndarray
    single: bool
    t0: float
    edge_ms: float
    keep: bool
    key: bytes | None
    seq: int
    frame: np.ndarray | None = None  # the raw [N, H, W, C] uint8 frame the inputs were made from


class EdgeAgent:
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
        self.variants = open_variants(packages, self.policy, ids, opts.session, opts.inline_max_ms, self.refused)
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
        self.breaker = CircuitBreaker(opts.breaker, link=self.link)
        if (encoder := getattr(cloud, "encoder", None)) is not None:
            encoder.meter = self.link  # the bandwidth the transport times is the link's
            if isinstance(ctl, Controller):
                ctl.attach_encoder(encoder)  # the encoding is chosen with the variant and threshold
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
        self._obs: deque[tuple[Any, ...]] = deque()
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
        self.audits = Auditor(opts.audit, self)  # audits of confident answers, drift, the learned rule

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

    def _current(self) -> tuple[Variant, float | None]:
        ctl = self.controller
        if ctl is None:
            return self._variant, self._threshold
        decision = ctl.current
        return self.variants.get(decision.variant, self._variant), decision.threshold

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
        audit = self.audits.draw()
        if audit:  # copied before the app gets (and may edit) the arrays; sent after the answer is back
            self.audits.submit(v.id, inputs, outputs, seq)
        return self._finish(v, outputs, scores, single, t0, edge_ms, seq, key=key)

    async def escalate(self, p: Pending) -> Prediction:
        """The asynchronous part: send the unsure rows within the deadline, merge or degrade."""
        rows = np.flatnonzero(p.mask)
        # capped at a quarter of the budget: a burst of load must not make every escalation look out of time
        guard_ms = self.options.margin_ms + min(self.link.margin_ms(), self.budget.latency_ms / 4)
        budget_ms = self.budget.latency_ms
        if (ctl := self.controller) is not None:  # it plans escalations to end where this timer ends them
            budget_ms *= ctl.deadline_scale()
        left_ms = budget_ms - (perf_counter() - p.t0) * 1e3 - guard_ms
        needed_ms = self._rtt_needed()
        reason = self._skip_reason(left_ms, needed_ms)
        if reason:
            return await self._degrade(p, rows, reason, None)
        whole = len(rows) == len(p.mask)
        sub = p.inputs if whole else {k: a[rows] for k, a in p.inputs.items()}
        expected = p.outputs if whole else {k: a[rows] for k, a in p.outputs.items()}
        request = self._request(p, sub, rows, left_ms)
        kept: str | None = None  # with `keep`: "" once journaled ahead of the send, else why it could not be
        if p.keep and self.journal is not None:
            kept = await self._journal_ahead(p, request)
            left_ms = budget_ms - (perf_counter() - p.t0) * 1e3 - guard_ms
            if left_ms < self.options.min_deadline_ms:  # the fsync took what was left: it is sent later
                self._settle(p.seq, answered=False)
                return await self._degrade(p, rows, kept or "budget", None, kept=kept)
        try:
            return await self._send(p, rows, request, expected, left_ms, needed_ms, whole, kept)
        except BaseException:
            self._settle(p.seq, answered=False)  # cancelled or strict: the journaled entry stays for the drain
            raise

    async def _send(self, p: Pending, rows: np.ndarray, request: Request,
                    expected: dict[str, np.ndarray], left_ms: float, needed_ms: float, whole: bool,
                    kept: str | None) -> Prediction:
        timeout_s = left_ms / 1e3
        self.link.attempted()
        sent = perf_counter()
        due = sent + timeout_s
        error: EscalationError | None = None
        try:
            # The agent's own timer ends the call, whatever the transport's deadline does (gRPC's fires
            # 2-3 ms late on a loaded host): cancelling the call abandons it, and no reply can come
            # after the answer. It is set `guard_ms` before the budget ends, what abandoning has been
            # observed to take, so the degraded answer is still ready inside the budget.
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + timeout_s):
                response = await self.transport.escalate(request, timeout_s=timeout_s)  # type: ignore[union-attr]
        except TimeoutError:
            error = CloudTimeout(f"the cloud did not answer within {left_ms:.1f} ms")
        except EscalationError as exc:
            error = exc
        rtt_ms = (perf_counter() - sent) * 1e3
        if error is not None:
            timed_out = isinstance(error, CloudTimeout)
            busy = not timed_out and self.pushback.note(error)  # the cloud is there, shedding load
            self._link_failed(error, rtt_ms, busy=busy)
            self.breaker.record_failure(timeout=timed_out)
            if self.options.strict:
                if timed_out:
                    self.link.observe_lateness((perf_counter() - due) * 1e3)
                raise error
            kind = ("timeout" if timed_out else "cloud_busy" if busy
                    else "unavailable" if isinstance(error, CloudUnavailable) else "error")
            logger.debug("escalation %d failed (%s): %s", p.seq, kind, error)
            self._settle(p.seq, answered=False)
            pred = await self._degrade(p, rows, kind, request, rtt_ms=rtt_ms, kept=kept)
            if timed_out:  # how late the answer is past the timer's due time: the next timer ends that much earlier
                self.link.observe_lateness((perf_counter() - due) * 1e3)
            return pred
        self._settle(p.seq, answered=True)  # answered (even unusably): sending it again would not help
        cloud = check_reply(response, self.cloud_model, expected)
        if isinstance(cloud, str):
            self.link.observe_refusal()
            self.breaker.record_failure()
            logger.warning("ignoring the cloud's answer to request %d: %s", p.seq, cloud)
            return await self._degrade(p, rows, "bad_reply", None, rtt_ms=rtt_ms)
        # a probe (sent although the view said it would not fit) answered in time: the slow samples are stale
        self.link.observe_answer(rtt_ms, probe=needed_ms > left_ms)
        self.breaker.record_success()
        if self.journal is not None and self.journal.count() and self._drain_wake is not None:
            self._drain_wake.set()  # the cloud answers again: deliver what waits, now rather than on a timer
        first = self.outputs[0].name
        agreed = top1_agreed(expected[first], cloud[first])
        self.audits.label(expected[first], cloud[first], 1.0)  # an escalation: compared with probability 1
        if whole:
            merged = cloud
        else:
            merged = p.outputs  # ours: onnxruntime hands back fresh arrays
            for k, a in cloud.items():
                merged[k][rows] = a
        cloud_rows = p.mask.copy()
        return self._finish(p.variant, merged, p.scores, p.single, p.t0, p.edge_ms, p.seq, cloud_rows=cloud_rows,
                            rtt_ms=rtt_ms, nbytes=wire_size(request), key=p.key, wanted=len(rows), agreed=agreed)

    @property
    def lateness(self) -> TimerLateness:
        """The agent timer's measured lateness (the link's)."""
        return self.link.lateness

    def _link_failed(self, error: EscalationError, waited_ms: float, *, busy: bool) -> None:
        """Tell the link how an escalation failed: a timeout, a busy cloud (its hint is `pushback`'s), a refusal."""
        if isinstance(error, CloudTimeout):
            self.link.observe_timeout(waited_ms)  # censored, but it teaches the link it is slow
        else:
            self.link.observe_refusal(waited_ms, busy=busy, retry_after_s=retry_hint_s(error) if busy else None)

    def _rtt_needed(self) -> float:
        """The round trip an escalation must fit in: a high quantile of the recent ones; with a
        controller, whose threshold already accounts for the link, a share of the median only."""
        if self.controller is None:
            return self.link.quantile(self.options.rtt_quantile)
        return self.options.rtt_skip_share * self.link.quantile(0.5)

    def _skip_reason(self, left_ms: float, needed_ms: float) -> str:
        if left_ms < self.options.min_deadline_ms:
            return "budget"
        # while the link is judged too slow, one escalation in `rtt_probe_s` goes anyway: the probe that
        # notices a returned link (its answer still helps the request it carries)
        if needed_ms > left_ms and time.monotonic() - self.link.last_attempt < self.options.rtt_probe_s:
            return "rtt"
        cap = self.budget.max_escalations_per_s
        if cap is not None:
            tokens, last = self._tokens
            now = time.monotonic()
            tokens = min(max(cap, 1.0), tokens + (now - last) * cap)
            if tokens < 1.0:
                self._tokens = (tokens, now)
                return "rate"
            self._tokens = (tokens - 1.0, now)
        if self.pushback.active():
            return "cloud_busy"
        return "" if self.breaker.allow() else "breaker_open"

    def spare_token(self) -> bool:
        """Take a token of the `max_escalations_per_s` bucket for background work (an audit) only when one
        is left over for the next escalation (on the loop, where escalations take theirs)."""
        cap = self.budget.max_escalations_per_s
        if cap is None:
            return True
        tokens, last = self._tokens
        now = time.monotonic()
        tokens = min(max(cap, 1.0), tokens + (now - last) * cap)
        if tokens < 2.0:
            self._tokens = (tokens, now)
            return False
        self._tokens = (tokens - 1.0, now)
        return True

    def _request(self, p: Pending, sub: Mapping[str, np.ndarray], rows: np.ndarray,
                 left_ms: float) -> Request:
        edge_answer = p.outputs[self.outputs[0].name][rows].reshape(len(rows), -1).argmax(axis=1)
        params: dict[str, str | int | float] = {
            topics.PARAM_DEVICE: self.options.device_id, topics.PARAM_BOOT: self.options.boot_id,
            topics.PARAM_SEQ: p.seq, topics.PARAM_VARIANT: p.variant.id,
            topics.PARAM_EDGE_SCORE: float(p.scores[rows].min()),
            topics.PARAM_EDGE_ANSWER: ",".join(map(str, edge_answer.tolist())),
            topics.PARAM_DEADLINE_MS: int(time.time() * 1e3 + left_ms),
            topics.PARAM_TRACE: f"{self.options.boot_id}-{p.seq}",
        }
        rid = f"{self.options.boot_id}-{p.seq}"
        if p.frame is not None and self.options.send_frames and self._single_input is not None:
            # the raw frame instead of the input: the cloud applies the package's declared preprocessing
            frames = p.frame if len(rows) == len(p.mask) else p.frame[rows]
            return mark_frame(raw_request(self.cloud_model, {self._single_input: frames}, request_id=rid,
                                          parameters=params))
        # the tensors travel beside the message: serialized once, straight from the arrays (protocol.wire)
        return raw_request(self.cloud_model, sub, request_id=rid, parameters=params)

    async def _journal_ahead(self, p: Pending, request: Request) -> str:
        """Journal the escalation durably before it is sent; "" when held, else why not (then it is only sent)."""
        assert self.journal is not None
        self._inflight[p.seq] = asyncio.get_running_loop().create_future()
        try:  # fsync: off the loop
            await asyncio.to_thread(self.journal.append, "escalation", serialize_request(request),
                                    device=self.options.device_id, boot_id=self.options.boot_id, seq=p.seq)
        except JournalError as exc:
            logger.warning("escalation %d not kept: %s", p.seq, exc)
            self._settle(p.seq, answered=False)
            return "journal_full" if isinstance(exc, JournalFull) else "journal_error"
        return ""

    def _settle(self, seq: int, *, answered: bool) -> None:
        """A journaled-ahead escalation's send ended: clear its entry (in the background) once answered."""
        flight = self._inflight.get(seq)
        if flight is None or flight.done():
            return
        flight.set_result(answered)
        if not answered or self.journal is None:
            self._inflight.pop(seq, None)
            return
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(
            self.journal.clear, device=self.options.device_id, boot_id=self.options.boot_id, seq=seq))
        self._background.add(task)
        task.add_done_callback(lambda t: self._cleared(seq, t))

    def _cleared(self, seq: int, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        self._inflight.pop(seq, None)
        if not task.cancelled() and task.exception() is not None:  # it stays; the drain sends it (deduplicated)
            logger.warning("could not clear answered escalation %d from the journal: %s", seq, task.exception())

    async def _degrade(self, p: Pending, rows: np.ndarray, reason: str,
                       request: Request | None, *, rtt_ms: float | None = None,
                       kept: str | None = None) -> Prediction:
        """The local answer, marked degraded. With `keep`, the escalation stays journaled for the drain (it
        was journaled before the send; `kept` says how that went), or is journaled now when it was not sent."""
        if kept is not None:
            if kept:
                reason = kept
            else:
                self.stats.journaled += 1
        elif p.keep and self.journal is not None and reason != "bad_reply":
            if request is None:
                request = self._request(p, {k: a[rows] for k, a in p.inputs.items()}, rows, 0.0)
            try:
                # durable before the answer returns (fsync: off the loop), so kill -9 loses nothing
                await asyncio.to_thread(self.journal.append, "escalation", serialize_request(request),
                                        device=self.options.device_id, boot_id=self.options.boot_id, seq=p.seq)
                self.stats.journaled += 1
            except JournalError as exc:  # a full journal, a full or failing disk: answer anyway, say why
                logger.warning("escalation %d not kept: %s", p.seq, exc)
                reason = "journal_full" if isinstance(exc, JournalFull) else "journal_error"
        return self._finish(p.variant, p.outputs, p.scores, p.single, p.t0, p.edge_ms, p.seq, degraded=True,
                            reason=reason, rtt_ms=rtt_ms, wanted=len(rows))

    def _finish(self, v: Variant, outputs: dict[str, np.ndarray], scores: np.ndarray, single: bool, t0: float,
                edge_ms: float, seq: int, *, cloud_rows: np.ndarray | None = None, degraded: bool = False,
                reason: str = "", rtt_ms: float | None = None, nbytes: int = 0, key: bytes | None = None,
                wanted: int = 0, agreed: bool | None = None) -> Prediction:
        total_ms = (perf_counter() - t0) * 1e3
        power = self.options.power
        if self._measured_mj is not None:
            energy, label = self._measured_mj, self.meter.label
        else:  # watts x milliseconds = millijoules
            energy = (power.busy_watts * edge_ms + power.idle_watts * (rtt_ms or 0.0)
                      + power.joules_per_byte_sent * nbytes * 1e3)
            label = power.label
        n = len(scores)
        if cloud_rows is None:
            cloud_rows = np.zeros(n, dtype=bool)
        if single:
            outputs = {k: a[0] for k, a in outputs.items()}
        tier = "cloud" if rtt_ms is not None and not degraded else "edge"
        pred = make_prediction(outputs, tier, float(scores[0] if n == 1 else scores.min()), v.id, degraded, total_ms,
                           energy, label, scores, cloud_rows, reason, False, seq, self.release)
        # the controller's edge energy travels with `label`: the measured figure when measured, else modeled
        edge_mj = energy if self._measured_mj is not None else power.busy_watts * edge_ms
        self._obs.append((v.id, edge_ms, edge_mj, energy, label, n, wanted, tier, degraded,
                          reason, rtt_ms, nbytes, agreed, total_ms, False, pred.score))
        if key is not None and not degraded and self.cache is not None:
            # the cache keeps its own copy: the app may edit the arrays it was handed
            self.cache.put(key, make_prediction({k: a.copy() for k, a in outputs.items()}, tier, pred.score, v.id,
                                                False, total_ms, energy, label, scores.copy(), cloud_rows.copy(),
                                                reason, False, seq, self.release))
        return pred

    def _cached(self, hit: Prediction, t0: float) -> Prediction:
        total_ms = (perf_counter() - t0) * 1e3
        self._obs.append((hit.variant, 0.0, 0.0, 0.0, hit.energy_label, len(hit.scores), 0, hit.tier, False, "",
                          None, 0, None, total_ms, True, hit.score))
        return make_prediction({k: a.copy() for k, a in hit.outputs.items()}, hit.tier, hit.score, hit.variant,
                               False, total_ms, 0.0, hit.energy_label, hit.scores.copy(), hit.cloud_rows.copy(), "",
                               True, hit.seq, self.release)

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
    def decision(self) -> Decision | None:
        """The controller's decision in force (inputs, predictions, why), or None without a controller."""
        return None if self.controller is None else self.controller.current

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

    def late(self, p: Pending) -> Prediction:
        """The local answer to a pending request whose escalation could not finish (thread-safe)."""
        return self._finish(p.variant, p.outputs, p.scores, p.single, p.t0, p.edge_ms, p.seq, degraded=True,
                            reason="late", wanted=int(p.mask.sum()))

    # -- background: statistics, controller, telemetry, journal ------------------------------

    def fold(self) -> None:
        """Fold pending observations into `stats` and the controller (any thread)."""
        if not self._obs:
            return
        with self._fold_lock:
            ctl = self.controller
            while self._obs:
                rec = self._obs.popleft()
                self.stats.add(rec)
                if ctl is not None:
                    feed_controller(ctl, rec)
            if ctl is not None:
                try:
                    ctl.maybe_redecide()
                except Exception:
                    logger.exception("the controller failed to redecide; keeping its last decision")

    def snapshot(self) -> dict[str, Any]:
        """Counters, latency quantiles and state, as published in telemetry."""
        self.fold()
        variant, threshold = self._current()
        to_json = getattr(self.decision, "to_json", None)
        return {"device": self.options.device_id, "boot_id": self.options.boot_id, "ts": time.time(),
                "model": self.model_name, "variant": variant.id,
                "threshold": variant.policy.threshold if threshold is None else threshold,
                "budget_ms": self.budget.latency_ms, "breaker": self.breaker.state,
                "journal_pending": self._journal_pending(),
                "journal_recovered_from": str(self.journal.recovered_from or "") if self.journal else "",
                "decision": to_json() if to_json is not None else None, "refused_variants": dict(self.refused),
                **(stats := self.stats.snapshot()), **self.audits.snapshot(stats)}

    async def _housekeeping(self) -> None:
        """Fold observations, read the meter, publish telemetry. Folding feeds the controller, which may
        re-decide: that runs in a worker thread. The loop wakes 20 times a second only while a controller
        has fresh observations to learn from; otherwise at most once a second."""
        next_telemetry = time.monotonic() + self.options.telemetry_interval_s
        next_meter, seen = time.monotonic() + 1.0, 0
        while True:
            busy = self.controller is not None and bool(self._obs)
            if busy:
                await asyncio.to_thread(self.fold)
            elif self._obs:
                self.fold()  # statistics only: a few µs per observation
            now = time.monotonic()
            wait = 0.05 if busy else 1.0
            if self.meter is not None:
                wait = min(wait, next_meter - now)
            if self.telemetry is not None:
                wait = min(wait, next_telemetry - now)
            await asyncio.sleep(max(wait, 0.01))
            now = time.monotonic()
            if self.meter is not None and now >= next_meter:
                reading = self.meter.stop()
                self.meter.start()
                served, seen = self.stats.requests - seen, self.stats.requests
                if served and str(reading.label).startswith("measured:"):
                    self._measured_mj = reading.joules * 1e3 / served
                next_meter = now + 1.0
            if self.telemetry is not None and now >= next_telemetry:
                next_telemetry = now + self.options.telemetry_interval_s
                try:
                    await self.telemetry(self.snapshot())
                except Exception:
                    logger.exception("publishing telemetry failed; it is skipped this time")

    def _journal_pending(self) -> int:
        return 0 if self.journal is None else self.journal.count()

    async def _drain_loop(self) -> None:
        """Deliver the journal: woken at once when a live escalation is answered, else every `drain_interval_s`.

        A drain starts with one entry sent with the short `drain_probe_s` deadline, whatever the breaker
        says (it is background work and costs no request its budget): once the cloud answers that probe,
        the rest follows `drain_window` at a time. A transport that says it is disconnected is not probed.
        """
        assert self._drain_wake is not None
        wake = self._drain_wake
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.drain_interval_s):
                    await wake.wait()
            wake.clear()
            if not self._journal_pending() or getattr(self.transport, "connected", True) is False:
                continue
            if (busy_s := self.pushback.remaining_s()) > 0:  # the cloud asked for a pause: drain after it
                await asyncio.sleep(busy_s)
            try:
                await self.drain_journal()
            except Exception:
                logger.exception("draining the journal failed; retrying later")

    async def drain_journal(self) -> int:
        """Send journaled escalations, oldest first, until one fails; returns how many were delivered."""
        if self.journal is None:
            return 0
        first = True

        async def send(entry: JournalEntry) -> None:
            nonlocal first
            probe, first = first, False
            await self._send_journaled(entry, probe=probe)

        return await drain(self.journal, send, window=self.options.drain_window, pace=self._pace)

    async def _send_journaled(self, entry: JournalEntry, *, probe: bool = False) -> None:
        if entry.boot_id == self.options.boot_id and entry.device == self.options.device_id:
            flight = self._inflight.get(entry.seq)
            if flight is not None and await asyncio.shield(flight):
                return  # its live send was answered; the journal entry is being cleared
        request = inference_pb2.ModelInferRequest.FromString(entry.payload)
        timeout_s = min(self.options.drain_probe_s, self.options.drain_timeout_s) if probe else \
            self.options.drain_timeout_s
        request.parameters[topics.PARAM_DEADLINE_MS].int64_param = int(time.time() * 1e3 + timeout_s * 1e3)
        try:
            response = await self.transport.escalate(request, timeout_s=timeout_s)  # type: ignore[union-attr]
        except EscalationError as exc:
            if self.pushback.note(exc):  # busy: the drain slows down and pauses for the hint
                self._pace.on_busy()
                self.link.observe_refusal(busy=True, retry_after_s=retry_hint_s(exc))  # the link's view too
            raise
        self._pace.on_answer()
        self.breaker.record_success()
        self.stats.late_replies += 1
        if self.on_late_reply is not None:
            try:
                self.on_late_reply(entry.seq, decode_reply(response))
            except Exception:
                logger.exception("the late-reply callback failed for seq %d", entry.seq)

