"""MQTT devices served by Triton through the bridge, against the same Triton called directly over gRPC.

(a) direct: tierkit's gRPC transport -> Triton Inference Server (PyTriton's `tritonserver`)
(b) bridge: tierkit's MQTT transport -> Mosquitto -> `tierkit serve --mqtt ... --forward grpc://TRITON`
    (its own process, default options: `--forward-mode unary`, one ModelInfer call per escalation)
    -> the same Triton
(c) bridge-stream: the same with `--forward-mode stream --forward-streams N` (requests over N
    long-lived ModelStreamInfer streams, answers matched by id)
(d) relay, the floor under (b): the same MQTT transport -> `paho_grpc_relay.py`, a bare paho -> unary
    gRPC relay of the same bytes with no tierkit code (no checks, cache, deadlines, metrics, limits;
    acknowledged on arrival) -> the same Triton
(e) stream-relay, the floor under (c): `paho_grpc_stream_relay.py`, the same over one ModelStreamInfer
    stream, answers matched by id
Each MQTT path has a Mosquitto of its own, since a second shared-subscription group on one broker
would receive every escalation too.

Throughput (answers/s) and p50 at each concurrency, for the digits CNN; blocks of the paths
alternate so that drift on a shared host hits them alike. Target: (b)/(a) >= 0.9 at concurrency 32;
(b)/(d) and (c)/(e) are what tierkit's bridge costs over the bare relays. CPU ms per answer by process
(the bench client, the brokers, the bridge or relay, Triton) says where a path's work goes.
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
from testkit.pytriton_path import SERVER_SCRIPT

TARGET = 0.9
PATHS = ("bridge", "bridge-stream", "relay", "stream-relay")  # the MQTT paths, each with a broker of its own
_SEQ = itertools.count(1)  # unique: a repeated seq would be answered from the bridge's duplicate cache


def _wait_ready(proc: subprocess.Popen[str], log: Path, seconds: float) -> str:
    """The `grpc HOST:PORT` the process printed (may be empty) once it printed `ready`."""
    for _ in range(int(seconds / 0.2)):
        text = log.read_text(errors="replace")
        if re.search(r"(?m)^ready", text):  # the server's log may run into the line's end
            # the server's own log lines share the file and may run into ours: search, not split
            found = re.search(r"grpc (127\.0\.0\.1:\d+)\s", text)
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


def _cpu_s(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds (user + system, all threads) used so far by each named group of processes ("client": this one).

    A process belongs to a group holding its pid or its process group id (the servers and relays start
    sessions of their own, so Triton's child processes count with it).
    """
    tick = os.sysconf("SC_CLK_TCK")
    used = dict.fromkeys(groups, 0.0)
    owner = {pgid: name for name, pgids in groups.items() for pgid in pgids}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # exited meanwhile
            continue
        name = owner.get(int(stat.parent.name)) or owner.get(int(fields[2]))  # pid, process group (stat field 5)
        if name is not None:
            used[name] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    times = os.times()
    used["client"] = times.user + times.system
    return used


async def run(triton: str, brokers: dict[str, str], x: np.ndarray, levels: tuple[int, ...], seconds: float,
              rounds: int, groups: dict[str, list[int]]) -> dict[str, Any]:
    from contextlib import AsyncExitStack

    from edge_agent.transports import open_transport

    results: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        paths = [("direct", await stack.enter_async_context(open_transport(f"grpc://{triton}/digits",
                                                                          device_id="bench-direct")))]
        for name, url in brokers.items():
            paths.append((name, await stack.enter_async_context(
                open_transport(f"{url}/digits", device_id=f"bench-device-{name}", boot_id="b"))))
        for _, cloud in paths:  # warm-up
            await _drive(cloud, x, 4, 0.5)
        for level in levels:
            rates: dict[str, list[float]] = {name: [] for name, _ in paths}
            lats: dict[str, list[float]] = {name: [] for name, _ in paths}
            # CPU per answer by process while a path runs (the other paths' processes sit idle meanwhile):
            # unlike answers/s, it does not depend on what else shares the cores
            cpu: dict[str, dict[str, float]] = {name: dict.fromkeys([*groups, "client"], 0.0) for name, _ in paths}
            for _ in range(rounds):
                for name, cloud in paths:
                    before = _cpu_s(groups)
                    rate, latency = await _drive(cloud, x, level, seconds / rounds)
                    after = _cpu_s(groups)
                    for part in after:
                        cpu[name][part] += after[part] - before[part]
                    rates[name].append(rate)
                    lats[name] += latency
            direct_rate = float(np.mean(rates["direct"]))
            results[str(level)] = {name: {"per_s": float(np.mean(rates[name])),
                                          "p50_ms": float(np.median(lats[name]) * 1e3),
                                          "ratio": float(np.mean(rates[name])) / direct_rate,
                                          "cpu_ms": {part: 1e3 * used / max(len(lats[name]), 1)
                                                     for part, used in cpu[name].items()}}
                                   for name in rates}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pytriton-python", required=True, help="a Python with nvidia-pytriton and onnxruntime")
    parser.add_argument("--quick", action="store_true", help="short runs: checks that the bench works")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--forward-streams", type=int, default=1, metavar="N",
                        help="streams of the bridge in stream mode (default 1)")
    args = parser.parse_args()
    levels = (1, 32)
    seconds, rounds = (2.0, 2) if args.quick else (20.0, 4)
    with tempfile.TemporaryDirectory(prefix="bench-forward-") as tmp:
        work = Path(tmp)
        model = digits_cnn(work)
        brokers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        for name in PATHS:
            (work / name).mkdir()
            started = start_mosquitto(work / name)
            if started is None:
                print("mosquitto not found (apt-get install mosquitto)", file=sys.stderr)
                for proc, _ in brokers.values():
                    proc.terminate()
                    proc.wait(10)
                return 1
            brokers[name] = started
        env = dict(os.environ)
        probe = "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"
        libdir = subprocess.run([args.pytriton_python, "-c", probe], capture_output=True, text=True,
                                check=True).stdout.strip()
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
        triton_proc = _start([args.pytriton_python, str(SERVER_SCRIPT),
                              str(model.onnx), "digits", "1"], work / "triton.log", env)
        procs: list[subprocess.Popen[str]] = [triton_proc]
        try:
            triton = _wait_ready(triton_proc, work / "triton.log", 180)
            urls = {name: f"mqtt://127.0.0.1:{port}" for name, (_, port) in brokers.items()}
            here = Path(__file__).parent
            # one bench device stands for many: lift the per-device rate limit (default 500/s), which it would hit
            lifted = ["--mqtt-device-rate", "1000000"]
            argvs = {
                "bridge": [sys.executable, "-m", "sdk.cli", "serve", "--mqtt", urls["bridge"], "--forward",
                           f"grpc://{triton}", "--mqtt-client-id", "bench-bridge", *lifted],
                "bridge-stream": [sys.executable, "-m", "sdk.cli", "serve", "--mqtt", urls["bridge-stream"],
                                  "--forward", f"grpc://{triton}", "--mqtt-client-id", "bench-bridge-s",
                                  "--forward-mode", "stream", "--forward-streams", str(args.forward_streams), *lifted],
                "relay": [sys.executable, str(here / "paho_grpc_relay.py"), str(brokers["relay"][1]), triton],
                "stream-relay": [sys.executable, str(here / "paho_grpc_stream_relay.py"),
                                 str(brokers["stream-relay"][1]), triton],
            }
            for name in PATHS:
                procs.append(_start(argvs[name], work / f"{name}.log"))
                _wait_ready(procs[-1], work / f"{name}.log", 60)
            groups = {"triton": [triton_proc.pid], "brokers": [proc.pid for proc, _ in brokers.values()],
                      "forwarder": [proc.pid for proc in procs[1:]]}
            results = asyncio.run(run(triton, urls, model.feed["x"], levels, seconds, rounds, groups))
        finally:
            for proc in reversed(procs):
                _stop(proc)
            for proc, _ in brokers.values():
                proc.terminate()
                proc.wait(10)
    if args.json:
        print(json.dumps({"target": TARGET, "quick": args.quick, "results": results}, indent=2))
        return 0
    names = ("direct", *PATHS)
    print(f"{'concurrency':>11} " + " ".join(f"{name + ' /s':>16} {'p50 ms':>7} {'ratio':>5}" for name in names))
    for level, e in results.items():
        print(f"{level:>11} " + " ".join(f"{e[n]['per_s']:16.0f} {e[n]['p50_ms']:7.2f} {e[n]['ratio']:5.2f}"
                                         for n in names))
    top_level = str(levels[-1])
    print(f"\nCPU ms per answer at concurrency {top_level} (user + system, all threads; the bench client, "
          "the brokers, the bridge or relay, Triton):")
    parts = ("client", "brokers", "forwarder", "triton")
    print(f"{'path':>13} " + " ".join(f"{part:>9}" for part in parts) + f" {'total':>7}")
    for name in names:
        used = results[top_level][name]["cpu_ms"]
        print(f"{name:>13} " + " ".join(f"{used[part]:9.2f}" for part in parts) + f" {sum(used.values()):7.2f}")
    top = results[top_level]["bridge"]["ratio"]
    print(f"bridge/direct at concurrency {levels[-1]}: {top:.2f} (target >= {TARGET}: "
          f"{'ok' if top >= TARGET else 'UNDER TARGET'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
