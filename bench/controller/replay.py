"""Replay the held-out stream through the real agent while the delay proxy and the budget step.

Requests arrive at a fixed rate, as from an external load generator: request k at k / `rate` seconds,
whether or not the ones before it were answered (several are in flight while escalations wait on a
slow link). Each goes through `sdk.load(...).apredict`, the agent escalating over gRPC to the real
cloud service behind the delay proxy. A phase therefore lasts its requests / `rate` seconds for every
strategy: a driver sending one request after another would stretch a phase whose requests wait
(300 escalations of 30 ms take 9 s, not 3) and then catch up in a burst of thousands a second. At most
`MAX_IN_FLIGHT` are outstanding, as with a load generator's pool of connections: a stalled agent
delays the next arrivals rather than collecting hundreds of them.
The controller is the one `sdk.load(..., controller=True)` builds; the other strategies stand in
its place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
from models import CLOUD_NAME, Models
from strategies import Scripted

import sdk
from edge_agent.adaptive import AdaptiveOptions
from edge_agent.agent import AgentOptions
from edge_agent.breaker import BreakerConfig
from edge_agent.budget import Budget
from edge_agent.policy import Policy
from edge_agent.transports.base import TransportOptions
from testkit.delay_proxy import DelayProxy

POLICY = Policy("max_prob")
MAX_IN_FLIGHT = 8  # requests outstanding at once (at 100/s and a 40 ms budget, about 4 are)


@dataclass(frozen=True)
class Phase:
    """One stretch of the trace: the added round trip (None: the cloud is down) and the budgets."""

    name: str
    requests: int
    rtt_ms: float | None
    latency_ms: float
    energy_mj: float | None = None
    jitter_ms: float = 0.0  # added to the round trip: uniform 0..jitter/2 ms in each direction
    bandwidth_mbps: float | None = None  # each direction's rate (None: loopback's)
    stall_every_s: float = 0.0  # a loss burst this often...
    stall_s: float = 0.0  # ...holding the link this long

    @property
    def budget(self) -> Budget:
        return Budget(latency_ms=self.latency_ms, energy_mj=self.energy_mj)

    def apply(self, proxy: DelayProxy) -> None:
        if self.rtt_ms is None:
            proxy.set(mode="refuse")
        else:
            proxy.set(up_ms=self.rtt_ms / 2, down_ms=self.rtt_ms / 2, jitter_ms=self.jitter_ms / 2, mode="up",
                      bandwidth_mbps=self.bandwidth_mbps, unlimited=self.bandwidth_mbps is None)


def agent_options(adaptive: AdaptiveOptions | None = None, *, wire_encoding: str = "fp32") -> AgentOptions:
    # the agent's own probing (`rtt_probe_s`, 0.25 s by default) is what notices a returned link
    return AgentOptions(device_id="bench-controller", breaker=BreakerConfig(failure_threshold=3),
                        transport=TransportOptions(reconnect_min_s=0.05, reconnect_max_s=0.25, retry_max_attempts=1,
                                                   wire_encoding=wire_encoding),
                        telemetry_interval_s=3600.0, adaptive=adaptive or AdaptiveOptions())


def replay(controller: Any, models: Models, phases: list[Phase], trace: np.ndarray, proxy: DelayProxy, *,
           rate: float, warmup: int = 200, adaptive: AdaptiveOptions | None = None,
           wire_encoding: str = "fp32") -> dict[str, Any]:
    """Run `trace` (indices into the test split) through a fresh agent at `rate` requests per second;
    one record per request.

    `controller` is True (the agent builds its controller, with the priors of `adaptive`) or a
    `Scripted` strategy.
    """
    n = sum(p.requests for p in phases)
    rec: dict[str, Any] = {k: np.zeros(n, dtype=t) for k, t in (
        ("phase", int), ("t", float), ("latency_ms", float), ("energy_mj", float), ("cloud", bool),
        ("degraded", bool), ("wanted", bool), ("correct", bool), ("threshold", float), ("guard_ms", float),
        ("deadline_scale", float))}
    for k in ("variant", "reason", "encoding"):  # encoding: the controller's planned one ("" where none)
        rec[k] = [""] * n
    labels: set[str] = set()
    # The warm-up runs on the plain link under a loose budget whatever the first phase is: it opens the
    # channel and teaches the agent the round trip. Under a tight first budget (12 ms with jitter) the
    # cold channel's first calls time out, which opens the breaker and teaches the agent a timer
    # lateness of connection set-up, so that phase measured the start-up rather than the link.
    warm = Phase("warm-up", warmup, 2.0, 60.0)
    warm.apply(proxy)
    model = sdk.load(models.edge_dir, cloud=f"grpc://127.0.0.1:{proxy.port}/{CLOUD_NAME}",
                     budget=warm.budget, policy=POLICY, controller=controller,
                     options=agent_options(adaptive, wire_encoding=wire_encoding))
    if controller is True:
        controller = model.agent.controller
    try:
        driver = _Driver(model, controller, models, trace, rec, labels)
        asyncio.run(driver.run(phases, proxy, rate, warmup))
    finally:
        model.close()
    # read once the agent is closed: its fold thread appends decisions while requests flow
    decisions = [d.to_json() for d in getattr(controller, "decisions", [])]
    return {**rec, "variant": np.array(rec["variant"]), "reason": np.array(rec["reason"]),
            "encoding": np.array(rec["encoding"]), "energy_label": ", ".join(sorted(labels)),
            "decisions": decisions, "redecisions": getattr(controller, "redecisions", 0)}


class _Driver:
    """Sends the requests at their arrival times on an event loop of its own, each as a task."""

    def __init__(self, model: Any, controller: Any, models: Models, trace: np.ndarray, rec: dict[str, Any],
                 labels: set[str]) -> None:
        self.model, self.controller, self.trace, self.rec, self.labels = model, controller, trace, rec, labels
        self.x, self.y = models.split.x_test, models.split.y_test

    async def run(self, phases: list[Phase], proxy: DelayProxy, rate: float, warmup: int) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        start = loop.time()
        for i in range(warmup):  # opens the channel and teaches the agent the round trip; not recorded
            await _until(loop, start + i / rate)
            tasks.add(asyncio.ensure_future(self.model.apredict(self.x[self.trace[i % self.trace.size]][None])))
        await asyncio.gather(*tasks)
        tasks.clear()
        k, start = 0, loop.time() + 1 / rate
        for pi, phase in enumerate(phases):
            await _until(loop, start + k / rate)
            phase.apply(proxy)
            # the controller re-decides on a new budget; the arrivals do not wait for it
            budget = asyncio.ensure_future(asyncio.to_thread(self.model.set_budget, phase.budget))
            if isinstance(self.controller, Scripted):
                self.controller.enter_phase(pi)
            next_stall = start + k / rate + phase.stall_every_s
            for _ in range(phase.requests):
                due = start + k / rate
                if phase.stall_every_s and due >= next_stall:
                    proxy.stall(phase.stall_s)
                    next_stall += phase.stall_every_s
                await _until(loop, due)
                await slots.acquire()
                task = asyncio.ensure_future(self.one(k, pi, due - start))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: slots.release())
                k += 1
            await budget
        while tasks:
            await asyncio.gather(*list(tasks))

    async def one(self, k: int, pi: int, t: float) -> None:
        """Request `k` (phase `pi`), arriving `t` seconds into the trace."""
        rec, c = self.rec, self.controller
        i = self.trace[k % self.trace.size]  # a calibration phase may be longer than a shortened trace
        threshold = float(c.current.threshold)
        # what the agent's timer ends escalations by: its learned lateness, and the share of the budget
        rec["guard_ms"][k] = self.model.agent.lateness.margin_ms()
        rec["deadline_scale"][k] = c.deadline_scale()
        rec["encoding"][k] = str(getattr(c.current, "encoding", ""))
        pred = await self.model.apredict(self.x[i][None])
        rec["phase"][k], rec["t"][k] = pi, t
        rec["latency_ms"][k], rec["energy_mj"][k] = pred.latency_ms, pred.energy_mj
        rec["cloud"][k], rec["degraded"][k] = pred.tier == "cloud", pred.degraded
        rec["wanted"][k] = pred.score < threshold
        rec["correct"][k] = int(pred.outputs["logits"].argmax()) == int(self.y[i])
        rec["threshold"][k] = threshold
        rec["variant"][k], rec["reason"][k] = pred.variant, pred.reason
        self.labels.add(pred.energy_label)


async def _until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    if (wait := when - loop.time()) > 0:
        await asyncio.sleep(wait)
