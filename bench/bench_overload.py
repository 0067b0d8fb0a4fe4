"""`tierkit serve` under overload: answers in time per second from 1 to 16 closed-loop callers.

Each caller sends one request, waits for its answer (or refusal, or its deadline), and sends the next
at once; after a refusal it waits the server's retry hint (at most 50 ms), as a device does. Every
request carries the deadline (`--deadline-ms`, 100 by default: gRPC's deadline; over MQTT the
`tierkit.deadline_ms` parameter the agent's transport sets). Models, each served by one `tierkit serve`
process with gRPC and the MQTT bridge (through a Mosquitto started here on loopback):

- slow: PP-OCRv4's text detector on 128x256 pages (about 14 ms a request on two idle cores; a batch
  costs about its rows times one request, as on most CPUs);
- fast: the same detector on 32x64 pages (about 1 ms).

Columns: offered (requests sent per second), in-time/s (answers within their deadline: goodput),
ratio (in-time/s against the best rate measured at any load for that model and protocol in this run),
refused (RESOURCE_EXHAUSTED / UNAVAILABLE answers), refusal p50/p99 (ms from sending to the refusal),
late (answers that arrived after their deadline), expired (DEADLINE_EXCEEDED: no answer in time).
Targets (issue): ratio >= 0.9 at every load, refusal p99 <= 10 ms, no answer after its deadline.

Triton, with `--pytriton-python PY` (a Python with `nvidia-pytriton` and onnxruntime, in a virtual
environment of its own: FACTS.md): Triton serving the same detector from a Python callable through
PyTriton (bench/pytriton_server.py), dynamic batching on, with its queue policy set as its docs advise
for overload (`REJECT` after the request's timeout, `allow_timeout_override`, a bounded queue); each
request carries the deadline as its `timeout` parameter. gRPC only. Without it the table says so.

    PYTHONPATH=$PWD python bench/bench_overload.py                 # the recorded run, about 2 minutes
    PYTHONPATH=$PWD python bench/bench_overload.py --pytriton-python /tmp/pytriton-venv/bin/python
    PYTHONPATH=$PWD python bench/bench_overload.py --seconds 1 --callers 1,4 --models slow --protocols grpc
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cloud_service.protocol import inference_pb2 as pb
from edge_agent.pushback import retry_hint_s
from edge_agent.transports.base import TransportOptions, parse_cloud_url
from edge_agent.transports.mqtt import MqttTransport
from runtimes.errors import CloudTimeout, EscalationError
from tests.broker import Broker
from tests.cloud_service.overload import HINT_CAP_S, Load, Server, closed_loop, ocr_det_package, request_bytes

MODELS = {"slow": (128, 256), "fast": (32, 64)}


def _cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


async def _mqtt_loop(url: str, payload: bytes, *, callers: int, seconds: float, deadline_s: float) -> Load:
    """`callers` MQTT devices (one paho client each), closed loop, through tierkit's bridge."""
    request = pb.ModelInferRequest.FromString(payload)
    cloud = parse_cloud_url(url)
    results = [Load(callers, seconds, deadline_s) for _ in range(callers)]
    transports = [MqttTransport(cloud, device_id=f"bench-{i}", options=TransportOptions()) for i in range(callers)]
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
                    code = getattr(exc, "code", "")
                    if code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"):
                        mine.refused += 1
                        mine.refused_ms.append((time.monotonic() - sent) * 1000)
                        hint = retry_hint_s(exc)
                        await asyncio.sleep(min(HINT_CAP_S, hint if hint is not None else 0.001))
                    else:
                        mine.other[str(code)] = mine.other.get(str(code), 0) + 1
                    continue
                if time.monotonic() - sent <= deadline_s:
                    mine.in_time += 1
                else:
                    mine.late += 1

        await asyncio.gather(*(caller(t, r) for t, r in zip(transports, results, strict=True)))
    total = Load(callers, seconds, deadline_s)
    for r in results:
        total.add(r)
    return total


def _row(model: str, protocol: str, load: Load, best: float) -> str:
    ratio = load.goodput / best if best else 0.0
    return (f"| {model} | {protocol} | {load.callers} | {load.offered / load.seconds:.1f} | {load.goodput:.1f} | "
            f"{ratio:.2f} | {load.refused} | {load.refusal_p(50):.1f} | {load.refusal_p(99):.1f} | {load.late} | "
            f"{load.expired} |")


@contextlib.contextmanager
def _broker(workdir: Path) -> Iterator[Broker]:
    broker = Broker(workdir).start()
    try:
        yield broker
    finally:
        broker.stop()


def _triton(args: argparse.Namespace, name: str, models: Path, page: np.ndarray, callers: list[int],
            deadline_s: float) -> list[str]:
    """Triton's rows for one model (gRPC), its queue policy rejecting what waited past the request's timeout."""
    from tests.compilers.zoo import OCR_DET

    env = dict(os.environ)
    probe = "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"
    libdir = subprocess.run([args.pytriton_python, "-c", probe], capture_output=True, text=True, check=True,
                            timeout=60).stdout.strip()
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    script = Path(__file__).with_name("pytriton_server.py")
    proc = subprocess.Popen([args.pytriton_python, str(script), str(OCR_DET.path()), "ocrdet", "0",
                             "--reject-after-us", str(int(deadline_s * 1e6))], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        address = ""
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("grpc "):
                address = line.split()[1]
            if line.strip() == "ready":
                break
        if not address:
            print(f"| {name} | triton | - | absent: PyTriton's server did not start | | | | | | | |")
            return []
        request = pb.ModelInferRequest.FromString(request_bytes("ocrdet", page))
        request.parameters["timeout"].int64_param = int(deadline_s * 1e6)  # Triton's per-request queue timeout
        payload = request.SerializeToString()
        closed_loop(address, payload, callers=1, seconds=1.0, deadline_s=deadline_s)  # warm up
        loads = [closed_loop(address, payload, callers=n, seconds=args.seconds, deadline_s=deadline_s)
                 for n in callers]
        best = max(load.goodput for load in loads)
        for load in loads:
            print(_row(name, "triton", load, best), flush=True)
        return []
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="load duration of each row")
    parser.add_argument("--callers", default="1,2,4,8,16", help="closed-loop callers per row")
    parser.add_argument("--deadline-ms", type=float, default=100.0)
    parser.add_argument("--models", default="slow,fast")
    parser.add_argument("--protocols", default="grpc,mqtt")
    parser.add_argument("--serve-args", default="", help="extra `tierkit serve` flags, e.g. --no-admission")
    parser.add_argument("--pytriton-python", default="", help="a Python with nvidia-pytriton: add Triton's rows")
    args = parser.parse_args(argv)
    callers = [int(c) for c in args.callers.split(",")]
    protocols = [p for p in args.protocols.split(",") if p]
    deadline_s = args.deadline_ms / 1000
    print(f"# bench_overload on {_cpu()}, Python {sys.version.split()[0]}; deadline {args.deadline_ms:g} ms, "
          f"{args.seconds:g} s a row; serve args: {args.serve_args or '(defaults)'}")
    print("| model | protocol | callers | offered/s | in-time/s | ratio | refused | refusal p50 ms | refusal p99 ms "
          "| late | expired |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        root = Path(tmp)
        with _broker(root / "broker") if "mqtt" in protocols else contextlib.nullcontext() as broker:
            for name in args.models.split(","):
                height, width = MODELS[name]
                models = root / name
                page = ocr_det_package(models, height=height, width=width, name="ocrdet")
                payload = request_bytes("ocrdet", page)
                extra = ["--mqtt", broker.url] if broker is not None else []
                with Server(models, *extra, *args.serve_args.split()) as server:
                    for protocol in protocols:
                        loads = []
                        for n in callers:
                            if protocol == "grpc":
                                load = closed_loop(server.address, payload, callers=n, seconds=args.seconds,
                                                   deadline_s=deadline_s)
                            else:
                                assert broker is not None
                                load = asyncio.run(_mqtt_loop(f"{broker.url}/ocrdet", payload, callers=n,
                                                              seconds=args.seconds, deadline_s=deadline_s))
                            loads.append(load)
                        best = max(load.goodput for load in loads)
                        for load in loads:
                            print(_row(name, protocol, load, best), flush=True)
                            if best and load.goodput < 0.9 * best:
                                failed.append(f"{name}/{protocol}/{load.callers}: ratio {load.goodput / best:.2f}")
                            if load.refusal_p(99) > 10:
                                failed.append(f"{name}/{protocol}/{load.callers}: refusal p99 "
                                              f"{load.refusal_p(99):.1f} ms")
                            if load.late:
                                failed.append(f"{name}/{protocol}/{load.callers}: {load.late} late answers")
                if args.pytriton_python:
                    failed += _triton(args, name, models, page, callers, deadline_s)
    if not args.pytriton_python:
        print("| triton (PyTriton) | - | - | absent: PyTriton needs a virtual environment of its own (FACTS.md); "
              "give --pytriton-python PY to add it | | | | | | | |")
    print(f"\n{len(failed)} target misses" + (": " + "; ".join(failed) if failed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
