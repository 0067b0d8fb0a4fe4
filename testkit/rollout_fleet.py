"""Real parts for rollouts end to end: digits releases, `tierkit agent` processes, a load driver.

- `DigitsModels`: ONNX graphs built from the trained digits logistic regression (the same weights; its
  logits scaled down: lower confidence; a heavy side branch: slower, same outputs), and a cycle of
  real digits test images whose escalation share is exact on every model (no sampling noise in the
  gates' escalation figures).
- `Agents`: N `tierkit agent` processes enrolled with tokens, each on a fixed loopback port, with a
  `fleet:` section naming the release key; stopped and restarted by index.
- `LoadDriver`: a background thread sending a bounded number of requests (count and time) to each
  running agent's Open Inference Protocol endpoint, at a fixed rate.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import grpc
import numpy as np

from cloud_service.protocol import encode_request, inference_pb2_grpc
from edge_agent.fleet_sync import enroll
from testkit.broker import _free_port
from testkit.fleet_process import ROOT

THRESHOLD = 0.8  # every release's threshold (calibrated max-probability, temperature 1)
LOW_CONFIDENCE_SCALE = 0.6  # release (b): the same model's logits times this


def _conf(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return np.asarray((p / p.sum(axis=1, keepdims=True)).max(axis=1))


class DigitsModels:
    """ONNX graphs of one trained logistic regression on digits (input x: batch x 1 x 8 x 8, output logits).

    Args:
        weight: (10, 64) and bias (10,) of the trained linear layer.
        x_test: the digits test images (real data), from which the request cycle is taken.
        y_test: their labels (`swap_target` picks a cycle image the model answers right).
    """

    def __init__(self, weight: np.ndarray, bias: np.ndarray, x_test: np.ndarray,
                 y_test: np.ndarray | None = None) -> None:
        self.w, self.b = weight.T.astype(np.float32), bias.astype(np.float32)
        z = x_test.reshape(len(x_test), -1) @ self.w + self.b
        base, low = _conf(z), _conf(z * LOW_CONFIDENCE_SCALE)
        # each kind kept well away from the threshold, so onnxruntime's rounding cannot move one across it
        escalate = np.flatnonzero(base < THRESHOLD - 0.08)[:4]  # unsure on every model
        flip = np.flatnonzero((base > THRESHOLD + 0.08) & (low < THRESHOLD - 0.08))[:4]  # unsure only when scaled
        sure = np.flatnonzero(low > THRESHOLD + 0.08)[:12]  # sure on every model
        assert (len(escalate), len(flip), len(sure)) == (4, 4, 12), "digits gave too few images of a kind"
        order = []
        for k in range(4):  # blocks of five: sure, unsure, sure, unsure-when-scaled, sure
            order += [sure[3 * k], escalate[k], sure[3 * k + 1], flip[k], sure[3 * k + 2]]
        self.cycle = x_test[np.array(order)].astype(np.float32)
        self.labels = None if y_test is None else np.asarray(y_test)[np.array(order)]
        self.escalated = np.isin(np.array(order), escalate)  # on the baseline model
        self.base_rate = 4 / 20  # escalations on the cycle: the baseline model
        self.low_rate = 8 / 20  # and the low-confidence one

    def linear(self, path: Path, *, scale: float = 1.0) -> Path:
        return self._save(path, [], scale=scale)

    def swap_target(self, *, escalated: bool) -> tuple[int, int, int]:
        """(image, a, b) for `swapped`: the first cycle image the baseline model escalates (or answers with
        confidence) and answers right, its class `a`, and the next class `b`."""
        if self.labels is None:
            msg = "DigitsModels was built without y_test: no image is known to be answered right"
            raise ValueError(msg)
        pred = (self.cycle.reshape(len(self.cycle), -1) @ self.w + self.b).argmax(axis=1)
        image = next(i for i in range(len(self.cycle)) if self.escalated[i] == escalated and pred[i] == self.labels[i])
        a = int(pred[image])
        return image, a, (a + 1) % 10

    def swapped(self, path: Path, image: int, a: int, b: int) -> Path:
        """A label-map bug on part of the inputs: the logits of classes `a` and `b` trade places where the input is
        cycle image `image`, and nowhere else. Every answer's confidence is the baseline's (the same escalations);
        that image's answer is `b` where it was `a`: one confident error in 20 (an image answered with confidence:
        only audits see it) or one escalation in four answered otherwise than the cloud answers it."""
        from onnx import helper

        perm = np.eye(10, dtype=np.float32)
        perm[[a, b]] = perm[[b, a]]
        extra = {"I": self.cycle[image].reshape(1, -1), "P": perm, "axes": np.array([1], np.int64),
                 "eps": np.array(1e-3, np.float32)}
        nodes = [helper.make_node("Sub", ["xf", "I"], ["d"]), helper.make_node("Abs", ["d"], ["ad"]),
                 helper.make_node("ReduceSum", ["ad", "axes"], ["dist"], keepdims=1),
                 helper.make_node("Less", ["dist", "eps"], ["hit"]),
                 helper.make_node("MatMul", ["lin", "P"], ["traded"])]
        return self._save(path, nodes, extra=extra, final=helper.make_node("Where", ["hit", "traded", "lin"],
                                                                           ["logits"]))

    def heavy(self, path: Path, layers: int, hidden: int = 1024) -> Path:
        """The same logits plus 1e-6 x an MLP branch (`layers` hidden layers of `hidden` units sharing one
        weight matrix, so the file stays small): same answers and confidence, `layers` times the work."""
        from onnx import helper

        rng = np.random.default_rng(0)
        extra = {"A": (rng.normal(size=(64, hidden)) / 8).astype(np.float32),
                 "H": (rng.normal(size=(hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
                 "B": (rng.normal(size=(hidden, 10)) * 1e-6).astype(np.float32)}
        nodes = [helper.make_node("MatMul", ["xf", "A"], ["h0"])]
        for i in range(layers):
            nodes += [helper.make_node("Tanh", [f"h{i}"], [f"t{i}"]),
                      helper.make_node("MatMul", [f"t{i}", "H"], [f"h{i + 1}"])]
        nodes.append(helper.make_node("MatMul", [f"h{layers}", "B"], ["side"]))
        return self._save(path, nodes, extra=extra, side="side")

    def _save(self, path: Path, branch: list[Any], *, scale: float = 1.0, extra: dict[str, np.ndarray] | None = None,
              side: str | None = None, final: Any = None) -> Path:
        """`branch` reads "xf" (the flattened input) and "lin" (the logits); the output is "lin" + `side`, or
        `final`'s (a node that writes "logits"), or "lin" itself."""
        import onnx
        from onnx import TensorProto, helper, numpy_helper

        inits = {"W": self.w * scale, "b": self.b * scale, **(extra or {})}
        last = side is not None or final is not None
        nodes = [helper.make_node("Flatten", ["x"], ["xf"]), helper.make_node("MatMul", ["xf", "W"], ["z"]),
                 helper.make_node("Add", ["z", "b"], ["lin" if last else "logits"]), *branch]
        if side:
            nodes.append(helper.make_node("Add", ["lin", side], ["logits"]))
        elif final is not None:
            nodes.append(final)
        graph = helper.make_graph(
            nodes, "digits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 8, 8])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
            [numpy_helper.from_array(v, k) for k, v in inits.items()])
        path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
        return path


def layer_ms(models: DigitsModels, tmp: Path, layers: int = 20) -> float:
    """Milliseconds one hidden layer of `heavy` adds here (one thread, median of 30 runs)."""
    from runtimes.registry import open_session
    from runtimes.session import SessionOptions

    times = []
    with open_session(models.heavy(tmp / "probe.onnx", layers), options=SessionOptions(intra_op_threads=1)) as session:
        x = {"x": models.cycle[:1]}
        for _ in range(35):
            t = time.perf_counter()
            session.run(x)
            times.append(time.perf_counter() - t)
    return float(np.median(times[5:])) * 1e3 / layers


class Agents:
    """`n` enrolled `tierkit agent` processes (index i: port `ports[i]`, state `tmp/agent{i}/state`).

    Args:
        tmp: where their directories go.
        fleet_url: the fleet's HTTP address; `token()` makes one enrollment token each.
        model: the configured local model (a variant set).
        broker: (host, port) of Mosquitto.
        cloud: the cloud tier's URL (grpc://ADDR/MODEL).
        release_key: the operators' public key file (fleet.release_keys).
    """

    def __init__(self, tmp: Path, n: int, *, fleet_url: str, token: Any, model: Path, broker: tuple[str, int],
                 cloud: str, release_key: Path) -> None:
        self.tmp, self.n = tmp, n
        self.ports = [_free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.logs: list[IO[bytes] | None] = [None] * n
        self.device_ids: list[str] = []
        for i in range(n):
            d = tmp / f"agent{i}"
            d.mkdir(parents=True, exist_ok=True)
            ident = enroll(fleet_url, token(), d / "state")  # one token each, through the fleet's HTTP API
            self.device_ids.append(ident.device_id)
            (d / "agent.yaml").write_text(
                f"model: {model}\nlisten: 127.0.0.1:{self.ports[i]}\nbroker: mqtt://{broker[0]}:{broker[1]}\n"
                f"cloud: {cloud}\npolicy: {{threshold: {THRESHOLD}}}\ntelemetry_interval_s: 1\nthreads: 1\n"
                f"fleet: {{url: '{fleet_url}', state_dir: '{d / 'state'}', release_keys: ['{release_key}']}}\n")

    def start(self, indices: list[int] | None = None, *, timeout: float = 90.0) -> None:
        indices = list(range(self.n)) if indices is None else indices
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        seen = {i: len(self.log_text(i)) for i in indices}  # a restart appends: look past the last run's lines
        for i in indices:
            d = self.tmp / f"agent{i}"
            log = (d / "agent.log").open("ab")
            self.logs[i] = log
            self.procs[i] = subprocess.Popen(
                [sys.executable, "-m", "sdk.cli", "agent", "--config", str(d / "agent.yaml")],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        for i in indices:
            want = re.compile(rf"serving .* on 127\.0\.0\.1:{self.ports[i]}")
            while not want.search(self.log_text(i)[seen[i]:]):
                proc = self.procs[i]
                if proc is None or proc.poll() is not None or time.monotonic() > deadline:
                    msg = f"agent {i} did not start: {self.log_text(i)[-2000:]}"
                    raise AssertionError(msg)
                time.sleep(0.1)

    def log_text(self, i: int) -> str:
        path = self.tmp / f"agent{i}" / "agent.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, indices: list[int] | None = None, *, timeout: float = 30.0) -> list[int | None]:
        """SIGTERM, wait (SIGKILL past `timeout`), close the log; the exit codes."""
        indices = [i for i in (range(self.n) if indices is None else indices) if self.procs[i] is not None]
        for i in indices:
            proc = self.procs[i]
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for i in indices:
            proc = self.procs[i]
            assert proc is not None
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                codes.append(None)
            self.procs[i] = None
            log = self.logs[i]
            if log is not None:
                log.close()
                self.logs[i] = None
        return codes

    def journal(self, i: int) -> dict[str, Any]:
        return dict(json.loads((self.tmp / f"agent{i}" / "state" / "swap.json").read_text()))

    def running(self, i: int) -> str | None:
        """The release agent i runs, from its own swap journal (None: its configured model)."""
        j = self.journal(i)
        return None if j["active"] is None else j["slots"][j["active"]]

    def ran(self, i: int, digest: str) -> bool:
        """Whether agent i ever served from `digest` (its swap log has an `active` step for it)."""
        path = self.tmp / f"agent{i}" / "state" / "swap.log"
        if not path.exists():
            return False
        return any((e := json.loads(line)).get("state") == "active" and e.get("target") == digest
                   for line in path.read_text().splitlines() if line.strip())


class LoadDriver:
    """Requests to each agent in `active`, `rate_rps` each, the images of `cycle` in order; at most
    `max_s` seconds and `rate_rps * max_s` requests per agent. `sent[i]` / `failed[i]` count them."""

    def __init__(self, ports: list[int], cycle: np.ndarray, *, rate_rps: float, max_s: float) -> None:
        self.ports, self.cycle, self.rate, self.max_s = ports, cycle, rate_rps, max_s
        self.max_requests = math.ceil(rate_rps * max_s)
        self.active = set(range(len(ports)))
        self.sent = [0] * len(ports)
        self.failed = [0] * len(ports)
        self.errors: dict[tuple[int, str], str] = {}  # (agent, status code) -> the first message
        self._generation = [0] * len(ports)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="load-driver", daemon=True)

    def __enter__(self) -> LoadDriver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def pause(self, indices: list[int]) -> None:
        self.active -= set(indices)

    def resume(self, indices: list[int]) -> None:
        for i in indices:
            self._generation[i] += 1  # a fresh channel: the old one may be in a long reconnect backoff
        self.active |= set(indices)

    async def _main(self) -> None:
        await asyncio.gather(*(self._one(i) for i in range(len(self.ports))))

    async def _one(self, i: int) -> None:
        options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        end = time.monotonic() + self.max_s
        channel: grpc.aio.Channel | None = None
        generation = -1
        k = 0
        try:
            next_at = time.monotonic()
            while not self._stop.is_set() and time.monotonic() < end and k < self.max_requests:
                if i not in self.active:
                    await asyncio.sleep(0.1)
                    continue
                if generation != self._generation[i] or channel is None:
                    if channel is not None:
                        await channel.close()
                    channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.ports[i]}", options=options)
                    generation = self._generation[i]
                stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
                x = self.cycle[k % len(self.cycle)][None]
                k += 1
                try:
                    await stub.ModelInfer(encode_request("digits", {"x": x}, request_id=str(k)), timeout=5)
                    self.sent[i] += 1
                except grpc.aio.AioRpcError as exc:
                    self.failed[i] += 1
                    self.errors.setdefault((i, exc.code().name), f"{time.time():.2f} {exc.details()}"[:300])
                    await asyncio.sleep(0.2)
                next_at = max(next_at + 1 / self.rate, time.monotonic())
                await asyncio.sleep(next_at - time.monotonic())
        finally:
            if channel is not None:
                await channel.close()
