"""Overload helpers: a slow real model (PP-OCRv4's text detector), `tierkit serve` in a process of its own,
and closed-loop callers with deadlines. Shared by tests/cloud_service/test_overload.py and
bench/bench_overload.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from cloud_service.protocol import inference_pb2 as pb
from runtimes.spec import TensorSpec
from testkit.cloud_helpers import make_package

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
# A refused caller that honours hints waits the server's retry hint before it calls again, as gRPC's own
# retry machinery does with `grpc-retry-pushback-ms` (and the agent with `edge_agent.pushback`), up to
# the agent's longest hold; one that does not (`honour_hints=False`: a hostile or naive client) calls again
# at once.
HINT_CAP_S = 5.0


def ocr_det_package(models_dir: Path, *, height: int = 128, width: int = 256, name: str = "ocrdet") -> np.ndarray:
    """Package PP-OCRv4's text detector (about 14 ms a page of 128x256 on two idle cores) into `models_dir`;
    return one page (1, 3, height, width) of rendered text to send it."""
    from testkit.onnx_zoo import OCR_DET

    make_package(models_dir / name, OCR_DET.path(), name=name,
                 inputs=(TensorSpec("x", "float32", ("batch", 3, height, width)),),
                 outputs=(TensorSpec("sigmoid_0.tmp_0", "float32", ("batch", 1, height, width)),))
    page = OCR_DET.inputs(1, seed=3)["x"][:, :, :height, :width]
    return np.ascontiguousarray(page, np.float32)


def request_bytes(model: str, x: np.ndarray, *, input_name: str = "x") -> bytes:
    """A serialized ModelInferRequest carrying `x` as raw contents."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=input_name, datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


def pinned(cpus: frozenset[int] | None) -> list[str]:
    """The prefix of a command that confines it, before it starts any thread, to `cpus` (`taskset`); none
    for None."""
    return [] if cpus is None else ["taskset", "-c", ",".join(map(str, sorted(cpus)))]


def cpu_list(text: str) -> frozenset[int]:
    """'0,1' or '2-9' or '0,4-7' as a set of CPU numbers; a clear error for anything else."""
    cpus: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        msg = f"a CPU list is numbers and ranges such as 0,1 or 2-9, got {text!r}"
        raise ValueError(msg) from None
    if not cpus:
        msg = f"a CPU list names at least one CPU, got {text!r}"
        raise ValueError(msg)
    return frozenset(cpus)


class Server:
    """`tierkit serve --models DIR --grpc 127.0.0.1:0 [args]` in its own process."""

    def __init__(self, models_dir: Path, *args: str, cpus: frozenset[int] | None = None) -> None:
        """`cpus`: the CPUs the server may run on (every thread it starts inherits them); None: any."""
        env = dict(os.environ)
        self.proc = subprocess.Popen([*pinned(cpus), sys.executable, "-m", "sdk.cli", "serve", "--models",
                                      str(models_dir), "--grpc", "127.0.0.1:0", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.address = self.metrics = ""
        end = time.monotonic() + 60
        assert self.proc.stdout is not None
        while time.monotonic() < end:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                msg = f"tierkit serve exited before ready: {err[-2000:]}"
                raise RuntimeError(msg)
            if line.startswith("grpc "):
                self.address = line.split()[1]
            if line.startswith("metrics "):
                self.metrics = line.split()[1]
            if line.strip() == "ready":
                return
        self.stop()
        msg = "tierkit serve was not ready within 60 s"
        raise RuntimeError(msg)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclasses.dataclass
class Load:
    """What N closed-loop callers got in `seconds`."""

    callers: int
    seconds: float
    deadline_s: float
    in_time: int = 0
    late: int = 0  # answers that came back after their deadline (the client waited past it)
    refused: int = 0  # RESOURCE_EXHAUSTED / UNAVAILABLE
    refused_ms: list[float] = dataclasses.field(default_factory=list)
    hints_ms: list[float] = dataclasses.field(default_factory=list)
    answer_ms: list[float] = dataclasses.field(default_factory=list)  # round trips of the answers (in time or late)
    expired: int = 0  # DEADLINE_EXCEEDED
    other: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.in_time / self.seconds

    @property
    def offered(self) -> int:
        return self.in_time + self.late + self.refused + self.expired + sum(self.other.values())

    def refusal_p(self, q: float) -> float:
        return float(np.percentile(self.refused_ms, q)) if self.refused_ms else 0.0

    def answer_p(self, q: float) -> float:
        return float(np.percentile(self.answer_ms, q)) if self.answer_ms else 0.0

    def answered(self, took_s: float) -> None:
        """One answer `took_s` after it was sent: in time or late against the deadline."""
        self.answer_ms.append(took_s * 1000)
        if took_s <= self.deadline_s:
            self.in_time += 1
        else:
            self.late += 1

    def refusal(self, took_s: float, hint_ms: float | None) -> None:
        """One refusal `took_s` after it was sent, with the server's retry hint if it gave one."""
        self.refused += 1
        self.refused_ms.append(took_s * 1000)
        if hint_ms is not None:
            self.hints_ms.append(hint_ms)

    def grpc_failure(self, exc: grpc.RpcError, took_s: float) -> tuple[bool, float | None]:
        """Count a failed gRPC call: a refusal (with its retry hint), an expiry, or another status.
        Returns whether it was a refusal, and its hint in ms."""
        code = exc.code()  # type: ignore[attr-defined]
        if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
            hint = _hint_ms(exc)
            self.refusal(took_s, hint)
            return True, hint
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.expired += 1
        else:
            self.other[code.name] = self.other.get(code.name, 0) + 1
        return False, None

    @classmethod
    def summed(cls, parts: list[Load], callers: int, seconds: float, deadline_s: float) -> Load:
        """One load of `callers` from the per-caller `parts`."""
        total = cls(callers, seconds, deadline_s)
        for part in parts:
            total.add(part)
        return total

    def add(self, other: Load) -> None:
        self.in_time += other.in_time
        self.late += other.late
        self.refused += other.refused
        self.refused_ms += other.refused_ms
        self.hints_ms += other.hints_ms
        self.answer_ms += other.answer_ms
        self.expired += other.expired
        for k, v in other.other.items():
            self.other[k] = self.other.get(k, 0) + v


def _hint_ms(exc: grpc.RpcError) -> float | None:
    """The refusal's retry hint: gRPC's `grpc-retry-pushback-ms` trailer, else the plain `retry-after-ms`."""
    hints = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
    for key in ("grpc-retry-pushback-ms", "retry-after-ms"):
        with contextlib.suppress(TypeError, ValueError):
            if key in hints:
                return float(hints[key])
    return None


def _backoff_s(hint_ms: float | None, end: float, *, honour_hints: bool) -> float:
    """How long a refused caller waits before it calls again (never past the end of the load)."""
    if not honour_hints:
        return 0.0
    return max(0.0, min(HINT_CAP_S, (hint_ms if hint_ms is not None else 1.0) / 1000, end - time.monotonic()))


_LOADS = itertools.count()


def caller_metadata(index: int, prefix: str) -> tuple[tuple[str, str], ...]:
    """Caller `index`'s gRPC metadata: a device id of its own (`cloud_service.callers`), as each agent has; the
    callers of one load share a channel, so the server could not tell them apart by peer address."""
    from cloud_service.callers import DEVICE_METADATA_KEY

    return ((DEVICE_METADATA_KEY, f"load-{prefix}-{index}"),)


def _load_prefix(prefix: str) -> str:
    """A prefix no other load of this process used (a later load's callers are other devices: a refused caller
    of an earlier load may still be inside its retry hint)."""
    return f"{prefix or 'load'}-{os.getpid()}-{next(_LOADS)}"


def closed_loop(address: str, payload: bytes, *, callers: int, seconds: float, deadline_s: float,
                max_calls: int = 100_000, honour_hints: bool = True, prefix: str = "", identified: bool = True) -> Load:
    """`callers` threads, each calling ModelInfer with `deadline_s` as soon as its last call ended (after a
    refusal: after the server's retry hint unless `honour_hints` is False), for `seconds`; at most `max_calls`
    each. Each caller sends a device id of its own (`caller_metadata`, named after `prefix`) unless
    `identified` is False (a plain client library's loop: no id, so the server's per-caller ledger cannot
    tell its callers apart)."""
    prefix = _load_prefix(prefix)
    channel = grpc.insecure_channel(address)
    call = channel.unary_unary(MODEL_INFER)
    grpc.channel_ready_future(channel).result(timeout=10)
    results = [Load(callers, seconds, deadline_s) for _ in range(callers)]
    start = threading.Barrier(callers + 1)
    end_at = [0.0]

    def caller(mine: Load, metadata: tuple[tuple[str, str], ...]) -> None:
        start.wait()
        for _ in range(max_calls):
            if time.monotonic() >= end_at[0]:
                return
            sent = time.monotonic()
            try:
                call(payload, timeout=deadline_s, metadata=metadata)
            except grpc.RpcError as exc:
                refused, hint = mine.grpc_failure(exc, time.monotonic() - sent)
                if refused:
                    time.sleep(_backoff_s(hint, end_at[0], honour_hints=honour_hints))
                continue
            mine.answered(time.monotonic() - sent)

    threads = [threading.Thread(target=caller, args=(r, caller_metadata(i, prefix) if identified else ()), daemon=True)
               for i, r in enumerate(results)]
    for t in threads:
        t.start()
    end_at[0] = time.monotonic() + seconds
    start.wait()
    for t in threads:
        t.join(seconds + 10 * deadline_s + 10)
    channel.close()
    return Load.summed(results, callers, seconds, deadline_s)


async def _aio_callers(address: str, payload: bytes, *, callers: int, seconds: float, deadline_s: float,
                       honour_hints: bool, prefix: str = "", identified: bool = True) -> Load:
    results = [Load(callers, seconds, deadline_s) for _ in range(callers)]
    prefix = _load_prefix(prefix)
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(MODEL_INFER)
        await asyncio.wait_for(channel.channel_ready(), 10)
        end = time.monotonic() + seconds

        async def caller(mine: Load, metadata: tuple[tuple[str, str], ...]) -> None:
            while time.monotonic() < end:
                sent = time.monotonic()
                try:
                    await call(payload, timeout=deadline_s, metadata=metadata)
                except grpc.aio.AioRpcError as exc:
                    refused, hint = mine.grpc_failure(exc, time.monotonic() - sent)
                    if refused:
                        await asyncio.sleep(_backoff_s(hint, end, honour_hints=honour_hints))
                    continue
                mine.answered(time.monotonic() - sent)

        await asyncio.wait_for(asyncio.gather(*(caller(r, caller_metadata(i, prefix) if identified else ())
                                                for i, r in enumerate(results))),
                               seconds + 10 * deadline_s + 10)
    return Load.summed(results, callers, seconds, deadline_s)


def aio_closed_loop(address: str, payload: bytes, *, callers: int, seconds: float, deadline_s: float,
                    honour_hints: bool = True, identified: bool = True) -> Load:
    """`closed_loop`'s callers as coroutines on one grpc.aio channel in one event loop, not a thread each:
    many calls in flight cost one thread's wake-ups, not a hundred threads' contention for the GIL."""
    return asyncio.run(_aio_callers(address, payload, callers=callers, seconds=seconds, deadline_s=deadline_s,
                                    honour_hints=honour_hints, identified=identified))


class HostStall:
    """How late this host wakes a thread that sleeps `tick_s` at a time, measured while a load runs (a context
    manager): the scheduling delay every thread of the callers, the broker and the server also sees. Timing
    bounds of a test add it, so other runs loading the cores move the bounds by what they measurably cost,
    and on a quiet host (stall ~0) the bounds are the stated ones."""

    def __init__(self, tick_s: float = 0.005) -> None:
        self.tick_s = tick_s
        self.late_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic()
            time.sleep(self.tick_s)
            self.late_s.append(max(0.0, time.monotonic() - asked - self.tick_s))

    def p(self, q: float) -> float:
        """The q-th percentile of the wake-up lateness, in seconds (0 before any tick)."""
        return float(np.percentile(self.late_s, q)) if self.late_s else 0.0

    def __enter__(self) -> HostStall:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def best_of(loads: Sequence[Load]) -> float:
    return max((load.goodput for load in loads), default=0.0)


async def _mqtt_callers(url: str, payload: bytes, *, callers: int, seconds: float, deadline_s: float,
                        honour_hints: bool) -> Load:
    from edge_agent.pushback import retry_hint_s
    from edge_agent.transports.base import TransportOptions, parse_cloud_url
    from edge_agent.transports.mqtt import MqttTransport
    from runtimes.errors import CloudTimeout, EscalationError

    request = pb.ModelInferRequest.FromString(payload)
    cloud = parse_cloud_url(url)
    results = [Load(callers, seconds, deadline_s) for _ in range(callers)]
    # one client id per caller and process: the bench splits callers over processes, and a broker drops the
    # older of two connections with one id
    transports = [MqttTransport(cloud, device_id=f"load-{os.getpid()}-{i}", options=TransportOptions())
                  for i in range(callers)]
    async with contextlib.AsyncExitStack() as stack:
        for t in transports:
            await stack.enter_async_context(t)
        end = time.monotonic() + seconds

        async def caller(transport: MqttTransport, mine: Load) -> None:
            while time.monotonic() < end:
                sent = time.monotonic()
                try:
                    await transport.escalate(request, timeout_s=deadline_s)
                except CloudTimeout:
                    mine.expired += 1
                    continue
                except EscalationError as exc:
                    code = str(getattr(exc, "code", ""))
                    if code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"):
                        hint = retry_hint_s(exc)
                        hint_ms = None if hint is None else hint * 1000
                        mine.refusal(time.monotonic() - sent, hint_ms)
                        await asyncio.sleep(_backoff_s(hint_ms, end, honour_hints=honour_hints))
                    else:
                        mine.other[code] = mine.other.get(code, 0) + 1
                    continue
                mine.answered(time.monotonic() - sent)

        await asyncio.gather(*(caller(t, r) for t, r in zip(transports, results, strict=True)))
    return Load.summed(results, callers, seconds, deadline_s)


def mqtt_closed_loop(url: str, payload: bytes, *, callers: int, seconds: float, deadline_s: float,
                     honour_hints: bool = True) -> Load:
    """`callers` MQTT devices (one paho client each, the agent's transport), each escalating with `deadline_s`
    as soon as its last escalation ended (after a refusal: after the retry hint unless `honour_hints` is
    False), for `seconds`."""
    return asyncio.run(_mqtt_callers(url, payload, callers=callers, seconds=seconds, deadline_s=deadline_s,
                                     honour_hints=honour_hints))
