"""`TieredModel`: the synchronous and asyncio faces of one `EdgeAgent`.

The agent lives on one background event-loop thread. `predict` runs the edge part (check inputs,
run the variant, score) in the caller's thread, so a confident answer costs no thread hop; only a
request that escalates is handed to the loop, and waited for no longer than its budget allows.
`apredict` does the same for asyncio callers without blocking their loop. One implementation:
both call the agent's `edge` and `escalate`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from edge_agent.agent import AgentOptions, EdgeAgent, Pending
from edge_agent.budget import Budget
from edge_agent.frames import from_frame
from edge_agent.policy import Policy
from edge_agent.prediction import Prediction
from runtimes.errors import ConfigError, ModelClosed

if TYPE_CHECKING:
    from compilers.package import ModelPackage
    from compilers.variants import VariantSet
    from edge_agent.controller import Controller, Decision
    from edge_agent.transports.base import Transport

__all__ = ["Budget", "Prediction", "TieredModel", "compile_model", "load"]

perf_counter = time.perf_counter
# how long past its budget `predict` waits for a wedged event loop before answering locally ("late")
LATE_MARGIN_S = 0.05


class _LoopThread:
    """An event loop running forever on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tierkit-agent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class TieredModel:
    """A model answered at the edge when it is confident, by the cloud when it is not.

    Build it with `sdk.load`. Use it as a context manager (`with` or `async with`), or call `close`.

    Example:
        >>> with sdk.load("variants/", cloud="grpc://127.0.0.1:8001/digits",
        ...               budget=sdk.Budget(latency_ms=30)) as model:
        ...     pred = model.predict(x)
        ...     print(pred.outputs["logits"].argmax(), pred.tier, pred.degraded)
    """

    def __init__(self, agent: EdgeAgent) -> None:
        self._agent = agent
        self._loop = _LoopThread()
        try:
            self._loop.submit(agent.start()).result(timeout=60)
        except BaseException:
            self._loop.stop()
            raise
        self._closed = False

    @property
    def agent(self) -> EdgeAgent:
        """The underlying `EdgeAgent` (breaker, transport, variants, statistics)."""
        return self._agent

    def predict(self, x: Any = None, *, keep: bool = False, frame: Any = None) -> Prediction:
        """Answer one input or a batch: an array (single-input models) or a dict of named arrays.

        Args:
            x: the input; without its batch axis for a single sample.
            keep: if the cloud cannot answer now, journal the escalation and send it when it is back.
            frame: instead of `x`, the raw uint8 camera frame (`[N,] H, W, C`) of a package whose manifest
                declares its preprocessing: the edge runs on the preprocessed input and an escalation
                sends the frame itself, a quarter of the fp32 bytes (`EdgeAgent.infer`).

        Raises:
            InputError: wrong names, dtypes or shapes, before anything runs.
            ModelClosed: the model was closed.
        """
        if self._closed:
            raise self._closed_error()
        t0 = perf_counter()
        agent = self._agent
        x, frames = from_frame(agent.preprocess, agent.inputs[0].name if len(agent.inputs) == 1 else None,
                               agent.model_name, x, frame)
        step = agent.edge(x, t0=t0, keep=keep, frame=frames)
        if type(step) is Prediction:
            return step
        assert isinstance(step, Pending)
        future = self._loop.submit(self._agent.escalate(step))
        left_s = self._agent.budget.latency_ms / 1e3 - (perf_counter() - t0)
        try:
            pred: Prediction = future.result(timeout=max(left_s, 0.0) + LATE_MARGIN_S)
            return pred
        except concurrent.futures.TimeoutError:  # the loop is wedged: never block the app on it
            if not step.keep:  # a kept escalation goes on: it is journaled and delivered later
                future.cancel()
            return self._agent.late(step)

    def _closed_error(self) -> ModelClosed:
        return ModelClosed(f"this TieredModel ({self._agent.model_name}) is closed; load a new one with sdk.load")

    async def apredict(self, x: Any = None, *, keep: bool = False, frame: Any = None) -> Prediction:
        """`predict` for asyncio callers: never blocks their event loop."""
        if self._closed:
            raise self._closed_error()
        t0 = perf_counter()
        agent = self._agent
        x, frames = from_frame(agent.preprocess, agent.inputs[0].name if len(agent.inputs) == 1 else None,
                               agent.model_name, x, frame)
        if agent.inline_for(x):
            step = agent.edge(x, t0=t0, keep=keep, frame=frames)
        else:  # slow variant: keep the caller's loop free
            step = await asyncio.to_thread(agent.edge, x, t0=t0, keep=keep, frame=frames)
        if type(step) is Prediction:
            return step
        assert isinstance(step, Pending)
        return await asyncio.wrap_future(self._loop.submit(self._agent.escalate(step)))

    def stats(self) -> dict[str, Any]:
        """Counters, latency quantiles and state (what telemetry publishes).

        With a controller, `"decision"` holds its decision record: the chosen variant and threshold,
        the predicted accuracy, p95 latency and energy, the inputs they were computed from, and why.
        """
        return self._agent.snapshot()

    @property
    def decision(self) -> Decision | None:
        """The controller's decision in force, or None when no controller is configured."""
        return self._agent.decision

    def set_budget(self, budget: Budget) -> None:
        """Change the budget of the next requests; a controller re-decides before this returns."""
        self._agent.set_budget(budget)

    def set_threshold(self, threshold: float | None) -> None:
        self._agent.set_threshold(threshold)

    def close(self) -> None:
        """Stop the agent and its loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.submit(self._agent.aclose()).result(timeout=30)
        finally:
            self._loop.stop()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> TieredModel:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> TieredModel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        a = self._agent
        return f"<TieredModel {a.model_name} variant={a.variant} cloud={a.cloud_model if a.transport else None}>"


def load(model: str | Path | VariantSet | ModelPackage, cloud: str | Transport | None = None, *,
         budget: Budget | None = None, policy: Policy | str | None = None,
         controller: bool | Controller | None = None,
         options: AgentOptions | None = None, meter: Any = None,
         trusted_keys: Iterable[Any] | None = None, version_floor: str | Path | None = None) -> TieredModel:
    """Load a package or variant set for tiered inference.

    Args:
        model: a variant-set directory, a package directory or `.tkpkg`, a `VariantSet` or a `ModelPackage`.
        cloud: `grpc://HOST:PORT/MODEL`, `mqtt://BROKER:PORT/MODEL` (MODEL defaults to the edge
            model's name), a `Transport`, or None for edge only.
        budget: per-request latency (and energy) budget; escalation deadlines come out of it.
        policy: a `Policy` or a scorer name ("calibrated", "margin", "entropy", ...).
        controller: True: pick the variant and threshold per request adaptively, with a controller
            built from the variants' validation data, a self-benchmark and the device's power profile
            (`AgentOptions.adaptive` holds its priors); or a ready `Controller`. None: off.
        options: rarer knobs (`AgentOptions`: device id, breaker, journal, power profile, ...).
        meter: an energy meter for measured figures (otherwise energy is modeled).
        trusted_keys: refuse packages not signed by one of these Ed25519 public keys.
        version_floor: a JSON file of the newest version opened per model; an older one is then
            refused unless it is a signed rollback (`compilers.version_floor`).

    Raises:
        ConfigError, PackageError: bad arguments or an unreadable package.

    Example:
        >>> model = sdk.load("variants/", cloud="grpc://127.0.0.1:8001/cnn", budget=sdk.Budget(latency_ms=30),
        ...                  controller=True)
        >>> model.decision.variant, model.decision.threshold
    """
    if isinstance(policy, dict):
        msg = "policy must be a Policy or a scorer name, not a dict; use Policy(**...)"
        raise ConfigError(msg)
    agent = EdgeAgent(model, cloud=cloud, budget=budget, policy=policy, controller=controller, options=options,
                      meter=meter, trusted_keys=trusted_keys,
                      version_floor=version_floor)
    return TieredModel(agent)


def compile_model(model: Any, **kwargs: Any) -> VariantSet:
    """Compile a model into a variant set: `compilers.compile_model`, imported only when called.

    Example:
        >>> variants = sdk.compile("model.onnx", output="variants/", precisions=("fp32", "int8"),
        ...                        calibration="calib.npz")
    """
    from compilers import compile_model as _compile

    result: VariantSet = _compile(model, **kwargs)
    return result
