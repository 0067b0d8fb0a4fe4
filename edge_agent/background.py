"""An agent's background work: observations folded into statistics and the controller, the energy meter,
telemetry, and the drain that delivers the store-and-forward journal once the cloud answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from cloud_service.protocol import inference_pb2, topics
from edge_agent.agent_state import AgentState
from edge_agent.journal import JournalEntry, drain
from edge_agent.pushback import retry_hint_s
from edge_agent.replies import decode_reply
from edge_agent.stats import feed_controller
from runtimes.errors import EscalationError

logger = logging.getLogger("edge_agent.agent")


class Background(AgentState):
    """Folding, telemetry and the journal's drain, run by the agent's background tasks."""

    def fold(self) -> None:
        """Fold pending observations into `stats` and the controller (any thread)."""
        if not self._obs:
            return
        with self._fold_lock:
            ctl = self.controller
            # the audits' energy since the last fold, spread over the requests folded now: the controller
            # plans audits into the energy per request, so the mean it calibrates against holds them too
            spent = self.audits.counts["audit_mj"]
            audit_mj, self._audit_mj_folded = spent - self._audit_mj_folded, spent
            share = audit_mj / len(self._obs) if self._obs else 0.0
            while self._obs:
                rec = self._obs.popleft()
                self.stats.add(rec)
                if ctl is not None:
                    feed_controller(ctl, rec._replace(energy_mj=rec.energy_mj + share) if share else rec)
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
                if (side := self._side) is not None and side.due(self.stats.requests) and self.controller is not None:
                    await asyncio.to_thread(side.run_due, self.variants, self.controller, self.options.power,
                                            self._fold_lock, self.stats.requests, measured=self.meter is not None)
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
