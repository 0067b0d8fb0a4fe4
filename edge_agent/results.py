"""Result assembly: the `Prediction` an agent returns, the observation it records, the cached copy.

Every `Prediction` owns its arrays (writable, shared with nothing): the cache keeps its own copy of an
answer, and a cache hit hands out a fresh copy of it.
"""

from __future__ import annotations

import numpy as np

from edge_agent.agent_state import AgentState, Pending, perf_counter
from edge_agent.prediction import Prediction, make_prediction
from edge_agent.stats import Observation
from edge_agent.variants import Variant


class ResultAssembly(AgentState):
    """Builds an agent's answers and records one observation per request (see `edge_agent.stats`)."""

    def _finish(self, v: Variant, outputs: dict[str, np.ndarray], scores: np.ndarray, single: bool, t0: float,
                edge_ms: float, seq: int, *, cloud_rows: np.ndarray | None = None, degraded: bool = False,
                reason: str = "", rtt_ms: float | None = None, nbytes: int = 0, key: bytes | None = None,
                wanted: int = 0, agreed: bool | None = None) -> Prediction:
        total_ms = (perf_counter() - t0) * 1e3
        self.link.observe_served()
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
        self._obs.append(Observation(v.id, edge_ms, edge_mj, energy, label, n, wanted, tier, degraded,
                                     reason, rtt_ms, nbytes, agreed, total_ms, False, pred.score))
        if key is not None and not degraded and self.cache is not None:
            # the cache keeps its own copy: the app may edit the arrays it was handed
            self.cache.put(key, make_prediction({k: a.copy() for k, a in outputs.items()}, tier, pred.score, v.id,
                                                False, total_ms, energy, label, scores.copy(), cloud_rows.copy(),
                                                reason, False, seq, self.release))
        return pred

    def _cached(self, hit: Prediction, t0: float) -> Prediction:
        total_ms = (perf_counter() - t0) * 1e3
        self.link.observe_served()
        self._obs.append(Observation(hit.variant, 0.0, 0.0, 0.0, hit.energy_label, len(hit.scores), 0, hit.tier,
                                     False, "", None, 0, None, total_ms, True, hit.score))
        return make_prediction({k: a.copy() for k, a in hit.outputs.items()}, hit.tier, hit.score, hit.variant,
                               False, total_ms, 0.0, hit.energy_label, hit.scores.copy(), hit.cloud_rows.copy(), "",
                               True, hit.seq, self.release)

    def late(self, p: Pending) -> Prediction:
        """The local answer to a pending request whose escalation could not finish (thread-safe)."""
        return self._finish(p.variant, p.outputs, p.scores, p.single, p.t0, p.edge_ms, p.seq, degraded=True,
                            reason="late", wanted=int(p.mask.sum()))

