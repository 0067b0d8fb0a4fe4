"""MQTT devices served by Triton through the bridge, against the same Triton called directly over gRPC.

(a) direct: tierkit's gRPC transport -> Triton Inference Server (PyTriton's `tritonserver`)
(b) bridge: tierkit's MQTT transport -> Mosquitto -> `tierkit serve --mqtt ... --forward grpc://TRITON`
    (its own process) -> the same Triton
(c) relay, the floor under (b): the same MQTT transport -> a second Mosquitto -> `paho_grpc_relay.py`, a
    bare paho -> gRPC relay of the same bytes with no tierkit code (no checks, cache, deadlines, metrics,
    limits; acknowledged on arrival) -> the same Triton. A broker of its own, since a second shared-
    subscription group on one broker would receive every escalation too.

Throughput (answers/s) and p50 at each concurrency, for the digits CNN; blocks of (a), (b) and (c)
alternate so that drift on a shared host hits them alike. Target: (b)/(a) >= 0.9 at concurrency 32;
(b)/(c) is what tierkit's bridge costs over the bare relay.
PyTriton lives in a virtual environment of its own (its pins conflict with tierkit's):

    python3.11 -m venv /tmp/pytriton-venv && /tmp/pytriton-venv/bin/pip install nvidia-pytriton onnxruntime
    python bench/bench_forward.py --pytriton-python /tmp/pytriton-venv/bin/python [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_cloud import digits_cnn
from bench.bench_escalation import start_mosquitto
from cloud_service.protocol import encode_request, topics

TARGET = 0.9
_SEQ = itertools.count(1)  # unique: a repeated seq would be answered from the bridge's duplicate cache


def _wait_ready(proc: subprocess.Popen[str], log: Path, seconds: float) -> str:
    """The `grpc HOST:PORT` the process printed (may be empty) once it printed `ready`."""
    for _ in range(int(seconds / 0.2)):
        text = log.read_text(errors="replace")
        if "ready" in text.splitlines():
            # the server's own log lines share the file and may run into ours: search, not split
            found = re.search(r"\bgrpc (127\.0\.0\.1:\d+)\s", text)
            return found.group(1) if found else ""
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    msg = f"{proc.args!r} did not become ready:\n{log.read_text(errors='replace')[-2000:]}"
    raise RuntimeError(msg)


def _start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    with log.open("w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:  # exited already (it failed to start): the others still need stopping
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


async def _drive(cloud: Any, x: np.ndarray, concurrency: int, seconds: float) -> tuple[float, list[float]]:
    stop = time.perf_counter() + seconds
    latencies: list[float] = []

    async def worker() -> None:
        while time.perf_counter() < stop:
            request = encode_request("digits", {"x": x}, parameters={topics.PARAM_SEQ: next(_SEQ)})
            started = time.perf_counter()
            await cloud.escalate(request, timeout_s=10)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies) / (time.perf_counter() - started), latencies


async def run(triton: str, broker_url: str, relay_url: str, x: np.ndarray, levels: tuple[int, ...], seconds: float,
              rounds: int) -> dict[str, Any]:
    from edge_agent.transports import open_transport

    results: dict[str, Any] = {}
    async with open_transport(f"grpc://{triton}/digits", device_id="bench-direct") as direct, \
            open_transport(f"{broker_url}/digits", device_id="bench-device", boot_id="b") as device, \
            open_transport(f"{relay_url}/digits", device_id="bench-relayed", boot_id="b") as relayed:
        paths = (("direct", direct), ("bridge", device), ("relay", relayed))
        for _, cloud in paths:  # warm-up
            await _drive(cloud, x, 4, 0.5)
        for level in levels:
            rates: dict[str, list[float]] = {name: [] for name, _ in paths}
            lats: dict[str, list[float]] = {name: [] for name, _ in paths}
            for _ in range(rounds):
                for name, cloud in paths:
                    rate, latency = await _drive(cloud, x, level, seconds / rounds)
                    rates[name].append(rate)
                    lats[name] += latency
            entry = {name: {"per_s": float(np.mean(rates[name])), "p50_ms": float(np.median(lats[name]) * 1e3)}
                     for name in rates}
            entry["ratio"] = entry["bridge"]["per_s"] / entry["direct"]["per_s"]
            entry["relay_ratio"] = entry["relay"]["per_s"] / entry["direct"]["per_s"]
            results[str(level)] = entry
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pytriton-python", required=True, help="a Python with nvidia-pytriton and onnxruntime")
    parser.add_argument("--quick", action="store_true", help="short runs: checks that the bench works")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = (1, 32)
    seconds, rounds = (2.0, 2) if args.quick else (20.0, 4)
    with tempfile.TemporaryDirectory(prefix="bench-forward-") as tmp:
        work = Path(tmp)
        model = digits_cnn(work)
        broker = start_mosquitto(work)
        (work / "relay").mkdir()
        relay_broker = start_mosquitto(work / "relay")
        if broker is None or relay_broker is None:
            print("mosquitto not found (apt-get install mosquitto)", file=sys.stderr)
            return 1
        env = dict(os.environ)
        probe = "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"
        libdir = subprocess.run([args.pytriton_python, "-c", probe], capture_output=True, text=True,
                                check=True).stdout.strip()
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        triton_proc = _start([args.pytriton_python, str(Path(__file__).with_name("pytriton_server.py")),
                              str(model.onnx), "digits", "1"], work / "triton.log", env)
        procs = [broker[0], relay_broker[0], triton_proc]
        try:
            triton = _wait_ready(triton_proc, work / "triton.log", 180)
            broker_url = f"mqtt://127.0.0.1:{broker[1]}"
            bridge = _start([sys.executable, "-m", "sdk.cli", "serve", "--mqtt", broker_url, "--forward",
                             f"grpc://{triton}", "--mqtt-client-id", "bench-bridge"], work / "bridge.log")
            procs.append(bridge)
            _wait_ready(bridge, work / "bridge.log", 60)
            relay = _start([sys.executable, str(Path(__file__).with_name("paho_grpc_relay.py")), str(relay_broker[1]),
                            triton], work / "relay.log")
            procs.append(relay)
            _wait_ready(relay, work / "relay.log", 60)
            results = asyncio.run(run(triton, broker_url, f"mqtt://127.0.0.1:{relay_broker[1]}", model.feed["x"],
                                      levels, seconds, rounds))
        finally:
            for proc in reversed(procs):
                if proc in (broker[0], relay_broker[0]):
                    proc.terminate()
                    proc.wait(10)
                else:
                    _stop(proc)
    if args.json:
        print(json.dumps({"target": TARGET, "quick": args.quick, "results": results}, indent=2))
        return 0
    print(f"{'concurrency':>11} {'direct /s':>10} {'p50 ms':>7} {'bridge /s':>10} {'p50 ms':>7} {'ratio':>6} "
          f"{'relay /s':>9} {'p50 ms':>7} {'ratio':>6}")
    for level, e in results.items():
        print(f"{level:>11} {e['direct']['per_s']:10.0f} {e['direct']['p50_ms']:7.2f} "
              f"{e['bridge']['per_s']:10.0f} {e['bridge']['p50_ms']:7.2f} {e['ratio']:6.2f} "
              f"{e['relay']['per_s']:9.0f} {e['relay']['p50_ms']:7.2f} {e['relay_ratio']:6.2f}")
    top = results[str(levels[-1])]["ratio"]
    print(f"bridge/direct at concurrency {levels[-1]}: {top:.2f} (target >= {TARGET}: "
          f"{'ok' if top >= TARGET else 'UNDER TARGET'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
