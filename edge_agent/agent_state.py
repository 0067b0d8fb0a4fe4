"""What an `EdgeAgent` holds, declared once for the parts it is built from.

The agent is one object assembled from a few parts, each in its own module, sharing this state:

```
EdgeAgent (agent.py)               lifecycle, the synchronous edge path, control knobs
  |- Background (background.py)     observations folded into stats and the controller, telemetry, the drain
  '- EscalationPath (escalation.py)  the skip rules, the send under the agent's timer, journal-ahead, degrade
       '- ResultAssembly (results.py)   a `Prediction` and its observation, the cache
            '- AgentState (here)           the attributes below, `Pending`, the decision in force
```

`EdgeAgent.__init__` assigns every attribute declared here; the parts only read and update them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_agent.variants import Variant

if TYPE_CHECKING:
    from cloud_service.protocol.preprocess import Preprocess
    from edge_agent.audit import Auditor
    from edge_agent.breaker import CircuitBreaker
    from edge_agent.budget import Budget
    from edge_agent.cache import ResultCache
    from edge_agent.controller import Controller, Decision
    from edge_agent.journal import Journal
    from edge_agent.link import Link
    from edge_agent.options import AgentOptions
    from edge_agent.policy import Policy
    from edge_agent.prediction import Prediction
    from edge_agent.pushback import DrainPace, Pushback
    from edge_agent.side_runs import SideRuns
    from edge_agent.stats import Observation, Stats
    from edge_agent.transports.base import Transport
    from runtimes.spec import TensorSpec

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


class AgentState:
    """The attributes of an `EdgeAgent` (assigned in its `__init__`), shared by its parts."""

    options: AgentOptions
    budget: Budget
    policy: Policy
    refused: dict[str, str]
    variants: dict[str, Variant]
    _variant: Variant
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    model_name: str
    release: str
    preprocess: Preprocess | None
    _single_input: str | None
    _threshold: float | None
    transport: Transport | None
    cloud_model: str
    link: Link
    controller: Controller | None
    _side: SideRuns | None
    breaker: CircuitBreaker
    pushback: Pushback
    _pace: DrainPace
    cache: ResultCache[Prediction] | None
    stats: Stats
    meter: Any
    telemetry: Telemetry | None
    on_late_reply: LateReply | None
    journal: Journal | None
    _seq: itertools.count[int]
    _obs: deque[Observation]
    _fold_lock: threading.Lock
    _measured_mj: float | None
    _tokens: tuple[float, float]
    _tasks: list[asyncio.Task[None]]
    _closed: bool
    _inflight: dict[int, asyncio.Future[bool]]
    _background: set[asyncio.Task[Any]]
    _drain_wake: asyncio.Event | None
    audits: Auditor
    _audit_mj_folded: float  # the audits' energy already spread over folded requests

    def _current(self) -> tuple[Variant, float | None]:
        ctl = self.controller
        if ctl is None:
            return self._variant, self._threshold
        decision = ctl.current
        return self.variants.get(decision.variant, self._variant), decision.threshold


    @property
    def decision(self) -> Decision | None:
        """The controller's decision in force (inputs, predictions, why), or None without a controller;
        its `drift` says whether a drift event is flagged and which chart raised the last one."""
        if self.controller is None:
            return None
        return dataclasses.replace(self.controller.current, drift=self.audits.drift_summary())

