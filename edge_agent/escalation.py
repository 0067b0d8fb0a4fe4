"""The escalation path: decide whether to send, send under the agent's own timer, merge or degrade.

```
escalate(pending) -> no time left / RTT clearly does not fit / rate cap / cloud busy / breaker open: degrade
                  -> with `keep`: journal ahead (fsync, off the loop), then send
                  -> transport.escalate(rows, deadline = budget - elapsed - guard)
                       answered and well formed (`edge_agent.replies`): cloud rows merged in, tier="cloud"
                       failed / late / malformed: the local answer, degraded (journaled for the drain with `keep`)
```

Every outcome is told to the link (`edge_agent.link`), the breaker and the cloud's pushback, which the
next escalation's skip rule reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from cloud_service.protocol import topics
from cloud_service.protocol.wire import Request, raw_request, serialize_request, wire_size
from edge_agent.agent_state import Pending, perf_counter
from edge_agent.frames import mark_frame
from edge_agent.link import TimerLateness
from edge_agent.prediction import Prediction
from edge_agent.pushback import retry_hint_s
from edge_agent.replies import UnusableReply, check_reply
from edge_agent.results import ResultAssembly
from edge_agent.stats import top1_agreed
from runtimes.errors import CloudTimeout, CloudUnavailable, EscalationError, JournalError, JournalFull

logger = logging.getLogger("edge_agent.agent")


class EscalationPath(ResultAssembly):
    """Sends an agent's unsure rows to the cloud and turns whatever happens into an answer."""

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
        reply = check_reply(response, self.cloud_model, expected)
        if isinstance(reply, UnusableReply):
            self.link.observe_refusal()
            self.breaker.record_failure()
            logger.warning("ignoring the cloud's answer to request %d: %s", p.seq, reply.why)
            return await self._degrade(p, rows, "bad_reply", None, rtt_ms=rtt_ms)
        cloud = reply.outputs
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
                            rtt_ms=rtt_ms, nbytes=self._sent_bytes(request), key=p.key, wanted=len(rows),
                            agreed=agreed)

    @property
    def lateness(self) -> TimerLateness:
        """The agent timer's measured lateness (the link's)."""
        return self.link.lateness

    def _sent_bytes(self, request: Request) -> int:
        """The request's bytes as the transport's wire encoder sends them (radio energy is charged on those)."""
        encoder = getattr(self.transport, "encoder", None)
        return wire_size(request) if encoder is None else int(encoder.sent_bytes(wire_size(request)))

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
