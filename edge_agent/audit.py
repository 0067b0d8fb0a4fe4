"""Audits, the unbiased agreement estimate, drift, and the learned escalation rule, around one agent.

A share `rate` of the confident answers (those no row of which was escalated) is also sent to the
cloud, *after* the local answer was returned: a background task on the agent's loop, never on the
latency path, never changing the answer, not counted as an escalation, never journaled. It is sent
only while the link is up (the link model up, breaker closed, transport connected, no busy-cloud
pause), within `max_escalations_per_s`
(an audit takes a token only when one is left over for an escalation) and within the energy
budget (skipped when the mean energy per request, audits included, would pass it).

What the cloud's answers say, with `N` requests (cache hits left out) of which `N_E` wanted an
escalation (`n_E` compared, `k_E` agreed) and `N_C` were confident (audited with probability π each):

```
stratum E   p_E = k_E / n_E                       every escalation is compared when answered (π = 1)
stratum C   p_C = Σ a_i/π_i / Σ 1/π_i             Hájek (ratio) form of Horvitz-Thompson over the audits
agreement   A = (N_E p_E + N_C p_C) / N           the edge's top-1 agreement with the cloud, whole stream
variance    (N_E/N)² (1-n_E/N_E) p̃_E(1-p̃_E)/(n_E+4) + (N_C/N)² (1-π̄·kept) p̃_C(1-p̃_C)/(n_eff+4)
```
(kept: the share of drawn audits that were compared; a skipped audit lowers the true inclusion probability.)

The ratio form stays unbiased (to first order) when an audit or an escalation is lost (link down,
rate cap) for reasons that do not depend on whether the edge was right; the variance uses
Agresti-Coull's adjusted proportions p̃ = (k+2)/(n+4) (n_eff = (Σw)²/Σw² for the audits), so a stratum
with no disagreement seen yet still gets an interval. Agreement on the escalated rows alone
(`agreement` in telemetry) says nothing of the confident region: a shift that makes the edge
confidently wrong lowers `agreement_est` and leaves `agreement` where it was.

Drift (`edge_agent.drift`): the configured score and the predicted class of every request feed two
label-free CUSUMs, every audit an agreement CUSUM. While a drift event is flagged, audits run at
`drift_rate`, escalations at `drift_extra_rate` more (the threshold matching the raised rate on recent
scores), and the router judges on rows labelled since the event.

Router (`edge_agent.router`): labelled rows (escalations weighted 1, audits 1/π) train it; when it
wins on held-out rows it decides escalations, its threshold matching the configured rule's rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cloud_service.protocol import topics
from cloud_service.protocol.wire import raw_request, wire_size
from edge_agent.drift import DriftMonitor, DriftOptions
from edge_agent.policy import threshold_for_rate
from edge_agent.replies import UnusableReply, check_reply
from edge_agent.router import Router, RouterOptions
from runtimes.errors import ConfigError, EscalationError

if TYPE_CHECKING:
    from edge_agent.agent import EdgeAgent

logger = logging.getLogger(__name__)

Z95 = 1.959964
_RECENT = 4096  # recent requests kept for rate matching (score, limit, logits)
LEARN_INTERVAL_S = 0.25
_DRAW_BLOCK = 4096


class Draws:
    """Uniform numbers in [0, 1) fixed by (seed, request seq): block `seq // 4096` of a numpy generator seeded
    with (seed, block), so the draw of a request depends on nothing else (~0.1 µs a request)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._block: tuple[int, list[float]] = (-1, [])

    def __call__(self, seq: int) -> float:
        index, values = self._block  # replaced whole: a concurrent caller sees one block or the other
        block, offset = divmod(seq, _DRAW_BLOCK)
        if block != index:
            values = np.random.default_rng([self.seed, block]).random(_DRAW_BLOCK).tolist()
            self._block = (block, values)
        return values[offset]


@dataclass(frozen=True)
class AuditOptions:
    """Audits of confident answers, drift detection and the learned escalation rule.

    Args:
        rate: the share of confident answers also sent to the cloud to compare (0: no audits).
        drift_rate: the share while a drift event is flagged.
        drift_extra_rate: escalate this share of requests more while a drift event is flagged.
        timeout_s: an audit's deadline (it is background work: no request waits for it).
        max_inflight: audits in flight at once; more are skipped.
        seed: the audit draw's seed (None: random). The draw of request `seq` is a hash of (seed, seq): which
            requests are audited does not depend on which others were confident, nor on timing.
        drift: the drift charts' options.
        router: the learned rule's options; None: no learned rule.
    """

    rate: float = 0.01
    drift_rate: float = 0.1
    drift_extra_rate: float = 0.1
    timeout_s: float = 2.0
    max_inflight: int = 4
    seed: int | None = None
    drift: DriftOptions = field(default_factory=DriftOptions)
    router: RouterOptions | None = field(default_factory=RouterOptions)

    def __post_init__(self) -> None:
        if not (0.0 <= self.rate <= 1.0 and 0.0 <= self.drift_rate <= 1.0 and 0.0 <= self.drift_extra_rate <= 1.0):
            msg = f"AuditOptions rate, drift_rate and drift_extra_rate must be in [0, 1], got {self!r}"
            raise ConfigError(msg)
        if not (self.timeout_s > 0 and self.max_inflight >= 1):
            msg = f"AuditOptions timeout_s must be > 0 and max_inflight >= 1, got {self.timeout_s}, {self.max_inflight}"
            raise ConfigError(msg)


def with_router_state(options: AuditOptions, state_dir: Path, model: str, shipped: Path | None = None) -> AuditOptions:
    """`options` with the learned rule of `model` (a release digest, or a name) kept under `state_dir/routers/`
    (unless a path is set; one file per model: another model's logits mean other things), starting from the
    state a release ships (`shipped`, e.g. its `router.json`) when the device has learned none for it yet."""
    router = options.router
    if router is None or router.path is not None:
        return options
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in model)[:120] or "model"
    router = dataclasses.replace(router, path=state_dir / "routers" / f"{name}.json",
                                 initial=router.initial or (shipped if shipped is not None and shipped.exists()
                                                            else None))
    return dataclasses.replace(options, router=router)


# cumulative audit counters, published in the agent's snapshot (telemetry windows difference them)
COUNTERS = ("audits_drawn", "audits_sent", "audits_compared", "audits_agreed", "audit_w", "audit_wa", "audit_w2",
            "audit_pi_w", "audits_skipped", "audits_failed", "audit_mj")


def estimate_agreement(c: Mapping[str, float]) -> dict[str, float | None]:
    """The whole-stream agreement estimate and its 95 % interval from counters (cumulative or a window's).

    `c` holds the stats counters `requests`, `cache_hits`, `escalations_wanted`, `escalations_compared`,
    `escalations_agreed` and the audit `COUNTERS`. None where a stratum with requests has no comparison.
    """
    n = float(c.get("requests", 0)) - float(c.get("cache_hits", 0))
    n_e = float(c.get("escalations_wanted", 0))
    n_c = max(0.0, n - n_e)
    cmp_e, agr_e = float(c.get("escalations_compared", 0)), float(c.get("escalations_agreed", 0))
    sw, swa, sw2 = float(c.get("audit_w", 0.0)), float(c.get("audit_wa", 0.0)), float(c.get("audit_w2", 0.0))
    none: dict[str, float | None] = {"agreement_est": None, "agreement_low": None, "agreement_high": None}
    if n <= 0 or (n_e > 0 and cmp_e <= 0) or (n_c > 0 and sw <= 0):
        return none
    est = var = 0.0
    if n_e > 0:
        p = agr_e / cmp_e
        pt = (agr_e + 2) / (cmp_e + 4)
        fpc = max(0.0, 1.0 - cmp_e / n_e)
        est += n_e / n * p
        var += (n_e / n) ** 2 * fpc * pt * (1 - pt) / (cmp_e + 4)
    if n_c > 0:
        p = swa / sw
        n_eff = sw * sw / sw2 if sw2 > 0 else 0.0
        pt = (p * n_eff + 2) / (n_eff + 4)
        pi_mean = float(c.get("audit_pi_w", 0.0)) / sw  # the audits' mean inclusion probability, weighted
        drawn = float(c.get("audits_drawn", 0))
        if drawn > 0:  # skipped or lost audits lower the true inclusion probability below the drawn rate
            pi_mean *= min(1.0, float(c.get("audits_compared", 0)) / drawn)
        est += n_c / n * p
        var += (n_c / n) ** 2 * max(0.0, 1.0 - pi_mean) * pt * (1 - pt) / (n_eff + 4)
    half = Z95 * math.sqrt(var)
    return {"agreement_est": est, "agreement_low": max(0.0, est - half), "agreement_high": min(1.0, est + half)}


def window_fields(snap: Mapping[str, Any], prev: Mapping[str, Any]) -> dict[str, Any]:
    """A telemetry window's audit figures: counts, audit agreement, the agreement estimate over the window's
    requests with its interval, and the drift flag (`fleet_sync.TelemetryWindows` adds them)."""
    keys = ("requests", "cache_hits", "escalations_wanted", "escalations_compared", "escalations_agreed", *COUNTERS)
    d = {k: float(snap.get(k, 0) or 0) - float(prev.get(k, 0) or 0) for k in keys}
    audited = int(d["audits_compared"])
    drift = snap.get("drift") or {}
    return {"audited": audited, "audit_agreement": d["audits_agreed"] / audited if audited else None,
            **estimate_agreement(d), "data_drift": bool(drift.get("flagged", False)),
            "drift_events": int(drift.get("events", 0)) - int((prev.get("drift") or {}).get("events", 0))}


@dataclass
class _Job:
    inputs: dict[str, np.ndarray]
    logits: np.ndarray
    seq: int
    pi: float
    variant: str


class Auditor:
    """Audits, drift and the router for one `EdgeAgent` (`agent.audits`).

    Thread use: `route`, `draw` and `submit` run on the request path (any thread; appends to deques and
    one call onto the loop); the audit itself runs on the agent's loop; `fold` runs where the agent folds.
    """

    def __init__(self, options: AuditOptions, agent: EdgeAgent) -> None:
        self.options = options
        self.agent = agent
        self._fleet_rate: float | None = None
        self.active = agent.transport is not None and (options.rate > 0 or options.drift_rate > 0)
        self._draws = Draws(options.seed if options.seed is not None else random.getrandbits(63))
        self.counts = dict.fromkeys(COUNTERS, 0.0)
        self.skipped: dict[str, int] = {}
        self.drift = DriftMonitor(options.drift)
        self.router = Router(options.router) if options.router is not None and agent.transport is not None else None
        self._output = agent.outputs[0].name
        self._recent: deque[tuple[float, float, np.ndarray]] = deque(maxlen=_RECENT)
        self._scores: deque[float] = deque(maxlen=16 * _RECENT)  # drained by `fold` (the drift chart)
        self._tops: deque[int] = deque(maxlen=16 * _RECENT)  # predicted classes, drained by `fold`
        self._labels: deque[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = deque(maxlen=_RECENT)
        self._audit_outcomes: deque[bool] = deque(maxlen=_RECENT)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight = 0
        self._fold_lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.router_limit = math.nan  # the learned rule's threshold (on 1 - risk), when it is champion
        self.boost_limit = -math.inf  # while drift is flagged: the configured score's raised threshold
        self.matched_rate = math.nan
        self._matched_at = -math.inf

    @property
    def rate(self) -> float:
        """The audit share in force (raised while a drift event is flagged, or by the fleet during a rollout)."""
        own = self.options.rate if self._fleet_rate is None else max(self.options.rate, self._fleet_rate)
        return max(own, self.options.drift_rate) if self.drift.flagged else own

    def set_rate(self, rate: Any) -> None:
        """The fleet's audit share (a rollout's small wave audits more while it soaks); None: the configured one."""
        if rate is not None and not (isinstance(rate, int | float) and not isinstance(rate, bool) and 0 <= rate <= 1):
            msg = f"audit_rate must be a share in [0, 1] or null, got {rate!r}"
            raise ConfigError(msg)
        self._fleet_rate = None if rate is None else float(rate)
        self.active = self.agent.transport is not None and (self.rate > 0 or self.options.drift_rate > 0)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start on the agent's loop: audits run there; the charts and the router learn in a worker thread."""
        self._loop = loop
        if self.active:
            task = loop.create_task(self._learn_loop(), name="tierkit-audit-learn")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _learn_loop(self) -> None:
        while True:
            await asyncio.sleep(LEARN_INTERVAL_S)
            if self._scores or self._tops or self._audit_outcomes or self._labels:
                try:  # refits take milliseconds: never on the loop, where requests wait on timers
                    await asyncio.to_thread(self.fold)
                except Exception:
                    logger.exception("folding audits and scores failed; retrying")

    # -- the request path ----------------------------------------------------------------------

    def route(self, outputs: Mapping[str, np.ndarray], scores: np.ndarray, limit: float) -> tuple[np.ndarray, float]:
        """Record the configured score; return the scores and threshold that decide (the learned rule's when
        it is champion, a raised threshold while drift is flagged)."""
        if not self.active:
            return scores, limit
        z = outputs[self._output]
        s = float(scores[0]) if len(scores) == 1 else float(scores.min())
        self._recent.append((s, limit, z.reshape(len(scores), -1).copy()))
        self._scores.append(s)
        self._tops.extend(z.reshape(len(scores), -1).argmax(axis=1).tolist())
        router = self.router
        if router is not None and router.champion and not math.isnan(self.router_limit):
            if len(scores) == 1:
                return np.array([1.0 - router.risk_row(z.reshape(-1).tolist())]), self.router_limit
            return 1.0 - router.risk(z.reshape(len(scores), -1)), self.router_limit
        return scores, (limit if self.boost_limit <= limit else self.boost_limit)

    def draw(self, seq: int) -> bool:
        """Whether the confident answer to request `seq` is audited (a Bernoulli draw fixed by seed and seq)."""
        return self.active and self._draws(seq) < self.rate

    def submit(self, variant: str, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
               seq: int) -> None:
        """Hand a confident answer to the background audit (copies: the application owns its arrays)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        job = _Job({k: np.array(a) for k, a in inputs.items()}, np.array(outputs[self._output]), seq, self.rate,
                   variant)
        self.counts["audits_drawn"] += 1
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._start, job)

    # -- the audit, on the loop -----------------------------------------------------------------

    def _skip(self, why: str) -> None:
        self.counts["audits_skipped"] += 1
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def _start(self, job: _Job) -> None:
        agent = self.agent
        if agent._closed or agent.transport is None:
            return
        why = self._blocked(agent)
        if why:
            self._skip(why)
            return
        self._inflight += 1
        task = asyncio.get_running_loop().create_task(self._audit(job), name="tierkit-audit")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _blocked(self, agent: EdgeAgent) -> str:
        if self._inflight >= self.options.max_inflight:
            return "inflight"
        link = agent.link  # the one model of the link: down, or a busy cloud asked for a pause
        if (agent.breaker.state != "closed" or not link.up or time.monotonic() < link.hold_until
                or getattr(agent.transport, "connected", True) is False):
            return "link"
        energy = agent.budget.energy_mj
        if energy is not None:
            st = agent.stats
            spent = st.energy_mj + self.counts["audit_mj"]
            per_audit = self.counts["audit_mj"] / self.counts["audits_sent"] if self.counts["audits_sent"] else 0.0
            if st.requests and (spent + per_audit) / st.requests > energy:
                return "energy"
        if not agent.spare_token():
            return "rate"
        return ""

    async def _audit(self, job: _Job) -> None:
        agent = self.agent
        opts = agent.options
        params: dict[str, str | int | float] = {
            topics.PARAM_DEVICE: opts.device_id, topics.PARAM_BOOT: opts.boot_id, topics.PARAM_SEQ: job.seq,
            topics.PARAM_VARIANT: job.variant, topics.PARAM_AUDIT: 1,
            topics.PARAM_DEADLINE_MS: int(time.time() * 1e3 + self.options.timeout_s * 1e3),
            topics.PARAM_TRACE: f"{opts.boot_id}-{job.seq}-audit"}
        request = raw_request(agent.cloud_model, job.inputs, request_id=f"{opts.boot_id}-{job.seq}-audit",
                              parameters=params)
        sent = time.perf_counter()
        try:
            self.counts["audits_sent"] += 1
            async with asyncio.timeout(self.options.timeout_s):
                response = await agent.transport.escalate(request, timeout_s=self.options.timeout_s)  # type: ignore[union-attr]
        except (TimeoutError, EscalationError) as exc:
            self.counts["audits_failed"] += 1
            logger.debug("audit of request %d failed: %s", job.seq, exc)
            return
        finally:
            self._inflight -= 1
            power = opts.power  # radio and waiting: watts x ms = mJ
            self.counts["audit_mj"] += (power.idle_watts * (time.perf_counter() - sent) * 1e3
                                        + power.joules_per_byte_sent * wire_size(request) * 1e3)
        reply = check_reply(response, agent.cloud_model, {self._output: job.logits})
        if isinstance(reply, UnusableReply):
            self.counts["audits_failed"] += 1
            return
        self._compared(job.logits, reply.outputs[self._output], job.pi)

    def _compared(self, edge: np.ndarray, cloud: np.ndarray, pi: float) -> None:
        e = edge.reshape(-1, edge.shape[-1]) if edge.ndim else edge.reshape(1, 1)
        c = cloud.reshape(e.shape)
        if e.shape[-1] < 2:
            return
        agreed = bool((e.argmax(axis=1) == c.argmax(axis=1)).all())
        w = 1.0 / pi
        cnt = self.counts
        cnt["audits_compared"] += 1
        cnt["audits_agreed"] += agreed
        cnt["audit_w"] += w
        cnt["audit_wa"] += w * agreed
        cnt["audit_w2"] += w * w
        cnt["audit_pi_w"] += 1.0  # Σ w·π: the weighted mean π is this over Σ w
        self._audit_outcomes.append(agreed)
        self.label(e, c, w)

    def label(self, edge: np.ndarray, cloud: np.ndarray, weight: float) -> None:
        """Rows the cloud answered (an escalation, weight 1, or an audit, 1/π): the router's training data."""
        if self.router is None or edge.ndim != 2 or edge.shape[-1] < 2 or edge.shape != cloud.shape:
            return
        disagreed = (edge.argmax(axis=1) != cloud.argmax(axis=1)).astype(np.float64)
        self._labels.append((edge.astype(np.float64), disagreed, np.full(len(edge), weight), np.zeros(len(edge))))

    # -- background ----------------------------------------------------------------------------

    def fold(self) -> None:
        """Feed the drift charts and the router with what the requests and audits left (any thread; a worker
        thread every `LEARN_INTERVAL_S`, or a caller that wants the figures now)."""
        if not self.active:
            return
        with self._fold_lock:
            self._fold()

    def _fold(self) -> None:
        scores = self._scores
        while scores:
            if self.drift.score(scores.popleft()) is not None:
                self._drifted()
        tops = self._tops
        while tops:
            if self.drift.top_class(tops.popleft()) is not None:
                self._drifted()
        while self._audit_outcomes:
            if self.drift.audit(agreed=self._audit_outcomes.popleft()) is not None:
                self._drifted()
        self._fold_labels()

    def _drifted(self) -> None:
        event = self.drift.last
        logger.warning("drift detected (%s chart) at request %d: statistic %.2f over %.2f",
                       event.kind if event else "?", self.drift.requests, event.statistic if event else 0,
                       event.threshold if event else 0)
        if self.router is not None:
            self.router.forget_holdout()

    def _fold_labels(self) -> None:
        router = self.router
        labelled = bool(self._labels)
        while self._labels:
            z, y, w, _cfg = self._labels.popleft()
            if router is not None:
                router.learn(z, y, w, self._config_risk(z))
        now = time.monotonic()
        # the rate matching reads the recent requests: only when something depends on it, at most once a second
        wanted = (router is not None and (router.champion or router.due())) or self.drift.flagged \
            or self.boost_limit > -math.inf
        if not wanted or (not labelled and now - self._matched_at < 1.0):
            return
        self._matched_at = now
        recent = list(self._recent)
        rate = self._matched_rate(recent)
        if router is not None and router.due():
            router.refit(rate if math.isfinite(rate) else 0.1)
            if router.options.path is not None:
                try:
                    router.save()
                except OSError as exc:
                    logger.warning("could not save the router state: %s", exc)
        self._set_limits(recent, rate)

    def _config_risk(self, z: np.ndarray) -> np.ndarray:
        variant = self.agent.variants.get(self.agent.variant)
        scorer = variant.policy.scorer if variant is not None else None
        if scorer is None:
            return np.zeros(len(z))
        out: np.ndarray = 1.0 - scorer.score({self._output: z})
        return out

    def _matched_rate(self, recent: list[tuple[float, float, np.ndarray]]) -> float:
        if not recent:
            return math.nan
        s = np.fromiter((r[0] for r in recent), np.float64, len(recent))
        limits = np.fromiter((r[1] for r in recent), np.float64, len(recent))
        rate = float(np.mean(s < limits))
        self.matched_rate = rate
        return rate

    def _set_limits(self, recent: list[tuple[float, float, np.ndarray]], rate: float) -> None:
        if len(recent) < 64 or not math.isfinite(rate):
            return
        extra = self.options.drift_extra_rate if self.drift.flagged else 0.0
        target = min(1.0, rate + extra)
        router = self.router
        if router is not None and router.champion:
            risk = router.risk(np.concatenate([z for _, _, z in recent]))
            self.router_limit = threshold_for_rate(1.0 - risk, target)
        self.boost_limit = (threshold_for_rate(np.array([s for s, _, _ in recent]), target) if extra > 0
                            else -math.inf)

    # -- reporting -----------------------------------------------------------------------------

    def drift_summary(self) -> dict[str, Any]:
        """The drift flag, the chart that raised the last event ("score", "classes" or "agreement") and when."""
        drift = self.drift
        last = drift.last
        return {"flagged": drift.flagged, "kind": last.kind if last else None,
                "request": last.request if last else None, "events": drift.count}

    def snapshot(self, stats: Mapping[str, Any]) -> dict[str, Any]:
        """Cumulative counters (for telemetry windows) and the figures since start."""
        counts = dict(self.counts)
        est = estimate_agreement({**stats, **counts})
        router = self.router
        audit = {"rate": self.rate, "audited": int(counts["audits_compared"]),
                 "audit_agreement": (counts["audits_agreed"] / counts["audits_compared"]
                                     if counts["audits_compared"] else None),
                 "skipped": dict(self.skipped), **est,
                 "router": None if router is None else {
                     "champion": "learned" if router.champion else "configured", "fitted": router.fitted,
                     "threshold": None if math.isnan(self.router_limit) else self.router_limit,
                     "matched_rate": None if math.isnan(self.matched_rate) else self.matched_rate,
                     **router.verdict}}
        return {**counts, "audit": audit, "drift": self.drift.to_json()}

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):  # background audits end with the agent
                await task
        if self.router is not None and self.router.options.path is not None:
            try:
                self.router.save()
            except OSError as exc:
                logger.warning("could not save the router state: %s", exc)
