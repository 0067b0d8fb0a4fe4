"""`tierkit serve` under overload: answers in time per second from 1x to 16x the model's capacity.

Each caller sends one request, waits for its answer (or refusal, or its deadline), and sends the next
at once; after a refusal it waits the server's retry hint (at most 5 s, the longest the agent honours), as a
device does. Every request carries the deadline (`--deadline-ms`, 100 by default: gRPC's deadline; over MQTT the
`tierkit.deadline_ms` parameter the agent's transport sets). Models, each served by one `tierkit serve`
process with gRPC and the MQTT bridge (through a Mosquitto started here on loopback):

- slow: PP-OCRv4's text detector on 128x256 pages (about 14 ms a request on two idle cores; a batch
  costs about its rows times one request, as on most CPUs);
- fast: the same detector on 32x64 pages (about 1 ms).

Load levels (`--load 1,2,4,8,16`) are multiples of the capacity measured at the start of each model and
protocol, in callers: closed loops of 1, 2, 4, ... callers run briefly until the answers in time per
second stop rising (or requests start being refused); the best rate is the capacity, and the fewest
callers that reach 90 % of it are "1x" (batching serves more callers than one: the unit is where the
model saturates, not one caller). Level m runs m units of callers (at most `--max-callers`; a capped
row says so in its load column). `--callers N,M` gives counts instead. The load generator runs in
processes of its own (`--loadgen process --loadgen-procs 2`, the default: a row's callers are split
among them; they still share the cores with the server on a small host), its gRPC callers coroutines
on one grpc.aio channel a process (`--grpc-callers aio`; `threads` is a thread a caller): its CPU use
and the server's are reported per row, in cores (1.0 = one core busy for the whole row).

No phase can hang the bench: a row whose callers do not finish within its length plus 30 s is printed
as `stuck` (its generator processes are killed and respawned), a server (Triton, the echo, the refuser)
not ready within 120 s is a row saying why with its stderr's tail, and Triton's whole process group
(PyTriton, `tritonserver`, its backend stubs) is ended and waited for before the next one starts.

Callers honour the retry hint of a refusal as a well-behaved client library does (gRPC's own retry
machinery waits `grpc-retry-pushback-ms`; the agent holds escalations back for `tierkit.retry_after_ms`):
a refused caller waits the hint, then calls again. One more row per model and protocol, "hostile", runs
the highest level's callers ignoring every hint (calling again at once): goodput must hold there too.
Over gRPC one more, "naive": the same callers ignoring hints and sending no device id, as a plain client
library's loop does (tritonclient's, say): the server cannot tell them apart, so its per-caller ledger
cannot hold them back, and every refusal is at once called again.

Over MQTT the transport's own floor is measured in the same run: the same callers and pages against a
bare echo through its own Mosquitto (`bench/mqtt_echo.py`: no model, no parsing, a reply of the model's
answer size), at 1x and the highest level; the MQTT rows are read against it ("mqtt-echo" rows).

The gRPC refusal's floor, in the same run: the same generator, payload and callers as the top level's
row against a bare grpcio server that refuses every call at once (`bench/grpc_refuser.py`, the median
retry hint tierkit gave): the "grpc-refuser" row is what a refusal costs the callers on this host with
no server work at all; the "server refusal p99" column is tierkit's own receipt-to-refusal time. With the
hostile rows on, a second "grpc-refuser ... naive" row drives the same bare server with callers ignoring
hints: the cores refusing alone takes at the rate such callers call, which no model is left to use.
The gRPC answers' floor, in the same run: the same generator, payload and callers as tierkit's best row and
its top row against the bare server answering every call at once with the model's answer size
(`grpc_refuser.py --echo`): the "grpc-echo" rows say how much of its own rate the transport, the load
generator and the host keep as the callers grow, with no model, no queue and nothing refused.

Columns: offered (requests sent per second), in-time/s (answers within their deadline: goodput),
ratio (in-time/s against the best rate measured at any load for that model and protocol in this run,
the capacity probe's included), refused (RESOURCE_EXHAUSTED / UNAVAILABLE answers), refusal p50/p99 (ms
from sending to the refusal), server refusal p99 (the bucket bound of `tierkit_refusal_seconds` under
which 99 % fell: receipt to refusal inside the server, over MQTT from paho's thread, for refusals at
admission; then the count and p99 of those shed after queueing, `stage="queued"`; what the callers'
figure adds is transport and the host), answer p50/p99 (ms, answers' round trip), late (answers whose
caller saw them after their deadline; in brackets the answers the server dropped before send because the
deadline had passed, `tierkit_answers_dropped_total`: gRPC itself ends a call at its deadline, so a late
answer on the caller's side was in time on the wire and is the caller's own delay), expired
(DEADLINE_EXCEEDED: no answer in time), loadgen and server cores (tierkit's rows add, from its metrics, the
model's run time a second of the row, all instances together, and its run time a row: a model kept busy that
answers less is running slower), checks (the targets a row misses).
Targets (issue), checked on every row but the floors': ratio >= 0.9 (only on rows at or past the measured
saturation, the fewest callers with refusals or expiries over 1 % or with 0.9 of the best rate: a row below
it is not overload, and says so), refusal p99 <= 10 ms, no answer after its deadline. Each caller sends a
device id of its own (`tierkit-device-id` metadata), as agents do: the "hostile" rows meet the server's
per-caller ledger (`cloud_service/callers.py`).

Triton, with `--pytriton-python PY` (a Python with `nvidia-pytriton` and onnxruntime, in a virtual
environment of its own: FACTS.md): Triton serving the same detector from a Python callable through
PyTriton (testkit/pytriton_server.py), dynamic batching on, with its queue policy set as its docs advise
for overload (`REJECT` after the request's timeout, `allow_timeout_override`, a bounded queue); each
request carries the deadline as its `timeout` parameter. gRPC only. Without it the table says so.

    PYTHONPATH=$PWD python bench/bench_overload.py --pytriton-python /tmp/pytriton-venv/bin/python  # ~7 min
    PYTHONPATH=$PWD python bench/bench_overload.py                 # without Triton, about 5 minutes
    PYTHONPATH=$PWD python bench/bench_overload.py --seconds 1 --load 1,4 --models slow --protocols grpc
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import queue
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np

from bench import cpu_name
from cloud_service.protocol import inference_pb2 as pb
from testkit.broker import Broker
from testkit.overload import (
    Load,
    Server,
    aio_closed_loop,
    closed_loop,
    cpu_list,
    mqtt_closed_loop,
    ocr_det_package,
    pinned,
    request_bytes,
)
from testkit.pytriton_path import SERVER_SCRIPT

MODELS = {"slow": (128, 256), "fast": (32, 64)}


def _cpus(cpus: frozenset[int] | None) -> str:
    return "any" if cpus is None else ",".join(map(str, sorted(cpus)))


def _timed(fn: Callable[..., Load], kwargs: dict[str, Any]) -> tuple[Load, float]:
    """`fn(**kwargs)` and the CPU it used, in cores (CPU seconds of this process per wall second)."""
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    load = fn(**kwargs)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - started
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return load, cpu / max(wall, 1e-9)


class Stuck(Exception):
    """A phase that did not finish within its bound: its row says so instead of the bench hanging."""


PHASE_SLACK_S = 30.0  # a load phase may run this much past its own length before it counts as stuck


class LoadGen:
    """Runs the closed loops here or in `procs` processes of their own (spawned once, reused for every row;
    a row's callers are split among them). A run that does not end within its length plus `PHASE_SLACK_S`
    raises `Stuck`: the processes are killed and fresh ones spawned for the next row."""

    def __init__(self, mode: str, procs: int = 1) -> None:
        self.mode, self.procs = mode, max(1, procs)
        self._pool = self._spawn()

    def _spawn(self) -> futures.ProcessPoolExecutor | None:
        if self.mode != "process":
            return None
        return futures.ProcessPoolExecutor(self.procs, mp_context=multiprocessing.get_context("spawn"))

    def run(self, fn: Callable[..., Load], **kwargs: Any) -> tuple[Load, float]:
        if self._pool is None:
            return _timed(fn, kwargs)
        callers = int(kwargs["callers"])
        shares = [callers // self.procs + (i < callers % self.procs) for i in range(min(self.procs, callers))]
        jobs = [self._pool.submit(_timed, fn, kwargs | {"callers": n}) for n in shares]
        bound = time.monotonic() + float(kwargs["seconds"]) + PHASE_SLACK_S
        try:
            done = [job.result(timeout=max(0.1, bound - time.monotonic())) for job in jobs]
        except (futures.TimeoutError, futures.process.BrokenProcessPool) as exc:
            self._restart()
            msg = f"the load generator did not finish within {kwargs['seconds']:g} + {PHASE_SLACK_S:g} s ({exc!r})"
            raise Stuck(msg) from None
        total = Load(callers, float(kwargs["seconds"]), float(kwargs["deadline_s"]))
        for load, _ in done:
            total.add(load)
        return total, sum(cores for _, cores in done)

    def _restart(self) -> None:
        assert self._pool is not None
        for proc in list(getattr(self._pool, "_processes", {}).values()):
            with contextlib.suppress(Exception):
                proc.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._spawn()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


@dataclasses.dataclass
class Started:
    proc: subprocess.Popen[str]
    address: str  # what it printed after `grpc ` ("" if nothing)
    log: Path  # its stderr


_ADDRESS = re.compile(r"(?:^|[^\w])grpc (\S+:\d+)\s*$")


def _start(cmd: list[str], log: Path, *, timeout_s: float, env: dict[str, str] | None = None,
           stdin: bool = False, group: bool = False, cpus: frozenset[int] | None = None) -> Started | str:
    """Start `cmd`, which prints `grpc ADDRESS` (optionally) and then `ready`; wait at most `timeout_s` for it.
    The started process, or why it did not start (with the tail of its stderr). Never blocks past the bound."""
    err = log.open("w")
    proc = subprocess.Popen([*pinned(cpus), *cmd], stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=group)
    err.close()
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    address, end = "", time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            why = f"not ready within {timeout_s:g} s"
            break
        if line is None:
            why = f"exited ({proc.poll()}) before ready"
            break
        if (found := _ADDRESS.search(line)) is not None:  # anywhere in a line: a child's log may share stdout
            address = found.group(1)
        if line.strip() == "ready":
            return Started(proc, address, log)
    _stop(proc, group=group)
    tail = " / ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-300:]
    return f"{Path(cmd[1]).name} {why}: {tail}"


def _alive(pid: int, *, group: bool) -> bool:
    if not group:
        return Path(f"/proc/{pid}").exists() and "Z" not in _state(Path(f"/proc/{pid}/stat"))
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pid and fields[0] != "Z":
                return True
    return False


def _state(stat: Path) -> str:
    with contextlib.suppress(OSError, IndexError):
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    return "Z"


def _stop(proc: subprocess.Popen[str], *, group: bool = False, grace_s: float = 20.0) -> None:
    """End `proc` (with `group`, every process of its process group: Triton's server and its backend stubs,
    which outlive PyTriton's own process when only it is waited for) and wait until they are gone: SIGTERM,
    then SIGKILL after `grace_s`. Bounded."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the echo and the refuser end when stdin closes
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(proc.pid, sig)
            elif proc.poll() is None:
                proc.send_signal(sig)
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            proc.poll()
            if not _alive(proc.pid, group=group):
                return
            time.sleep(0.1)


def _cpu_seconds(pid: int, *, group: bool = False) -> float:
    """User plus system CPU seconds so far of process `pid` (all its threads), or with `group` of every live
    process in its process group (Triton: PyTriton's process, `tritonserver` and its Python backend stubs)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat") if group else [Path(f"/proc/{pid}/stat")]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ..., utime (11), stime (12)
            if stat.parent.name == str(pid) or (group and int(fields[2]) == pid):
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclasses.dataclass
class Row:
    level: str  # "4x" (of the measured capacity) or "-" (a caller count given)
    load: Load
    loadgen_cores: float
    server_cores: float
    server_refusal_p99_ms: float | None = None  # receipt to refusal inside tierkit's server, at admission
    shed: tuple[float, float] | None = None  # refusals after queueing (shed as hopeless): (p99 bucket ms, count)
    dropped: int = 0  # answers the server dropped before send, their caller's deadline passed
    runs: tuple[float, float] | None = None  # the model's run time a second of the row, and per row run (ms)
    server: bool = False  # whether the server's own figures were read (tierkit's rows)
    stuck: str = ""  # why the row has no figures: its phase did not finish in time


@dataclasses.dataclass
class ServerCounts:
    """What tierkit's own metrics say, read before and after a row (one protocol, all models)."""

    refusals: dict[str, dict[float, float]]  # stage ("admission", "queued") -> cumulative count by bucket bound
    dropped: float  # answers ready after their caller's deadline, dropped before send
    run_s: float = 0.0  # the models' batches' run time, all instances (`tierkit_batch_run_seconds_sum`)
    rows: float = 0.0  # the rows those batches ran (`tierkit_batch_size_sum`)


def _server_counts(metrics: str, protocol: str) -> ServerCounts:
    if not metrics:
        return ServerCounts({}, 0.0)
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = ServerCounts({}, 0.0)
    for line in text.splitlines():
        if line.startswith("tierkit_batch_run_seconds_sum{"):
            out.run_s += float(line.rsplit(" ", 1)[1])
        elif line.startswith("tierkit_batch_size_sum{"):
            out.rows += float(line.rsplit(" ", 1)[1])
        if f'protocol="{protocol}"' not in line:
            continue
        if line.startswith("tierkit_refusal_seconds_bucket{"):
            stage = line.split('stage="', 1)[1].split('"', 1)[0] if 'stage="' in line else "admission"
            bound = float(line.split('le="', 1)[1].split('"', 1)[0])
            buckets = out.refusals.setdefault(stage, {})
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("tierkit_answers_dropped_total{"):
            out.dropped += float(line.rsplit(" ", 1)[1])
    return out


def _p99_ms(before: dict[float, float], after: dict[float, float]) -> tuple[float, float] | None:
    """(the bucket bound in ms under which 99 % of the refusals between two reads fell, their count); None
    without refusals."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    return next(bound * 1000 for bound, n in counts if n >= 0.99 * total), total


def _measure(gen: LoadGen, pid: int, fn: Callable[..., Load], level: str, *, group: bool = False,
             metrics: str = "", protocol: str = "", **kwargs: Any) -> Row:
    cpu, started, before = _cpu_seconds(pid, group=group), time.monotonic(), _server_counts(metrics, protocol)
    try:
        load, gen_cores = gen.run(fn, **kwargs)
    except Stuck as exc:
        empty = Load(int(kwargs["callers"]), float(kwargs["seconds"]), float(kwargs["deadline_s"]))
        return Row(level, empty, 0.0, 0.0, stuck=str(exc))
    wall = max(time.monotonic() - started, 1e-9)
    cores = (_cpu_seconds(pid, group=group) - cpu) / wall
    after = _server_counts(metrics, protocol)
    rows = after.rows - before.rows
    runs = ((after.run_s - before.run_s) / wall, 1000 * (after.run_s - before.run_s) / rows) if rows > 0 else None
    stages = {stage: _p99_ms(before.refusals.get(stage, {}), buckets) for stage, buckets in after.refusals.items()}
    admission, queued = stages.get("admission"), stages.get("queued")
    return Row(level, load, gen_cores, cores, None if admission is None else admission[0],
               shed=None if queued is None else queued, dropped=int(after.dropped - before.dropped),
               runs=runs, server=bool(metrics))


@dataclasses.dataclass
class Capacity:
    rate: float  # the best answers in time per second the probe saw
    callers: int  # the fewest callers that reached 90 % of it: "1x"


def _capacity(gen: LoadGen, fn: Callable[..., Load], args: argparse.Namespace, **kwargs: Any) -> Capacity | None:
    """Closed loops of 1, 2, 4, ... callers, briefly each, until the rate stops rising (two probes in a row
    within 5 % of the best) or the server refuses: the best rate and the fewest callers near it (None when
    even the warm-up was stuck)."""
    probe = min(1.5, args.seconds)
    seen: list[tuple[int, float]] = []
    flat, callers = 0, 1
    try:
        gen.run(fn, callers=1, seconds=0.5, **kwargs)  # warm up
    except Stuck as exc:
        print(f"# capacity probe stuck in its warm-up: {exc}", flush=True)
        return None
    while callers <= args.max_callers:
        try:
            load, _ = gen.run(fn, callers=callers, seconds=probe, **kwargs)
        except Stuck as exc:
            print(f"# capacity probe stuck at {callers} callers: {exc}", flush=True)
            break
        best = max((rate for _, rate in seen), default=0.0)
        seen.append((callers, load.goodput))
        flat = flat + 1 if load.goodput < 1.05 * best else 0
        if flat >= 2 or load.refused + load.expired > 0.05 * max(1, load.offered):
            break
        callers *= 2
    if not seen:
        return None
    rate = max(r for _, r in seen)
    unit = min(c for c, r in seen if r >= 0.9 * rate)
    print("# capacity probe: " + ", ".join(f"{c} callers {r:.1f}/s" for c, r in seen)
          + f": {rate:.1f}/s, reached by {unit} caller(s) (1x)", flush=True)
    return Capacity(rate, unit)


def _levels(args: argparse.Namespace, capacity: Capacity | None) -> list[tuple[str, int]]:
    """(level, callers) for each row: multiples of the callers at capacity, or the counts given (none when the
    capacity probe was stuck)."""
    if capacity is None and not args.callers:
        return []
    if capacity is None:
        return [("-", int(c)) for c in args.callers.split(",")]
    out = []
    for m in (float(x) for x in args.load.split(",")):
        want = max(1, round(m * capacity.callers))
        n = min(args.max_callers, want)
        out.append((f"{m:g}x" if n == want else f"{m:g}x (capped: {n / capacity.callers:.1f}x)", n))
    return out


def _checks(row: Row, best: float, *, judged: bool = True) -> list[str]:
    """The targets `row` misses: ratio >= 0.9 of the best rate (`judged`: at or past saturation), refusal p99
    <= 10 ms, no late answers."""
    load, failed = row.load, []
    if row.stuck:
        return [f"stuck ({row.stuck})"]
    if judged and best and load.goodput < 0.9 * best:
        failed.append(f"ratio {load.goodput / best:.2f} < 0.9")
    if load.refusal_p(99) > 10:
        failed.append(f"refusal p99 {load.refusal_p(99):.1f} > 10 ms")
    if load.late:
        failed.append(f"{load.late} late")
    return failed


def _row(model: str, protocol: str, row: Row, best: float, *, checked: bool = True, judged: bool = True) -> str:
    load = row.load
    if row.stuck:
        return f"| {model} | {protocol} | {row.level} | {load.callers} | stuck: {row.stuck} |" + " |" * 12
    ratio = load.goodput / best if best else 0.0
    server = "-" if row.server_refusal_p99_ms is None else f"≤ {row.server_refusal_p99_ms:g}"
    if row.shed is not None:
        server += f"; {row.shed[1]:.0f} shed after queueing ≤ {row.shed[0]:g}"
    late = f"{load.late} ({row.dropped} dropped)" if row.server else f"{load.late}"
    checks = ("; ".join(_checks(row, best, judged=judged)) or "ok") if checked else "(floor)"
    cores = f"{row.server_cores:.2f}"
    if row.runs is not None:
        cores += f" (runs {row.runs[0]:.2f} s/s, {row.runs[1]:.2f} ms a row)"
    if checked and not judged:
        checks += " (below saturation: ratio not judged)"
    return (f"| {model} | {protocol} | {row.level} | {load.callers} | {load.offered / load.seconds:.1f} | "
            f"{load.goodput:.1f} | {ratio:.2f} | {load.refused} | {load.refusal_p(50):.1f} | {load.refusal_p(99):.1f} "
            f"| {server} | {load.answer_p(50):.1f}/{load.answer_p(99):.1f} | {late} | {load.expired} "
            f"| {row.loadgen_cores:.2f} | {cores} | {checks} |")


def _saturation(rows: list[Row], best: float) -> int | None:
    """The fewest callers at which the model was saturated: a row with refusals or expiries (over 1 % of what
    it offered: the server said it was full) or answering at least 0.9 of the best rate. None: never."""
    full = [row.load.callers for row in rows if not row.stuck and (
        row.load.refused + row.load.expired > 0.01 * max(1, row.load.offered) or row.load.goodput >= 0.9 * best)]
    return min(full, default=None)


def _report(name: str, protocol: str, rows: list[Row], probe_best: float = 0.0) -> list[str]:
    """Print the rows of one model and protocol; the target misses, named. The goodput ratio is judged only
    on rows at or past the measured saturation: a row below it is not overload, whatever its ratio."""
    best = max([probe_best, *(row.load.goodput for row in rows)])
    saturated = _saturation(rows, best)
    print(f"# {name}/{protocol}: saturated from {saturated} callers (refusals, or 0.9 of the best {best:.1f}/s); "
          "rows below are not overload and their ratio is not judged", flush=True)
    failed = []
    for row in rows:
        judged = saturated is not None and row.load.callers >= saturated
        print(_row(name, protocol, row, best, judged=judged), flush=True)
        failed += [f"{name}/{protocol}/{row.level}/{row.load.callers}: {miss}"
                   for miss in _checks(row, best, judged=judged)]
    return failed


@contextlib.contextmanager
def _broker(workdir: Path) -> Iterator[Broker]:
    broker = Broker(workdir).start()
    try:
        yield broker
    finally:
        broker.stop()


START_S = 60.0  # a server (Triton, the echo, the refuser) not ready by then is a row saying so, not a hang


def _triton(args: argparse.Namespace, name: str, root: Path, gen: LoadGen, page: np.ndarray,
            deadline_s: float) -> list[str]:
    """Triton's rows for one model (gRPC, levels from its own capacity probe), its queue policy rejecting
    what waited past the request's timeout. Triton gives no retry hint: its callers call again at once.
    Its start and every row are bounded in time; its whole process group is ended before the next model's
    Triton starts (a `tritonserver` left from the previous model kept the next one from starting)."""
    from testkit.onnx_zoo import OCR_DET

    env = dict(os.environ)
    probe = "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"
    libdir = subprocess.run([args.pytriton_python, "-c", probe], capture_output=True, text=True, check=True,
                            timeout=60).stdout.strip()
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    script = SERVER_SCRIPT
    command = [args.pytriton_python, str(script), str(OCR_DET.path()), "ocrdet", "0", "--reject-after-us",
               str(int(deadline_s * 1e6))]
    # PyTriton's start now and then never reaches `ready` (seen on this host: no CPU, nothing on stderr, while
    # the same start alone takes 7-9 s): it is given up after START_S and tried once more
    for attempt in (1, 2):
        started = _start(command, root / f"triton-{name}-{attempt}.log", timeout_s=START_S, env=env, group=True,
                         cpus=args.server_cpus)
        if not isinstance(started, str) and not started.address:  # `ready` read, its address lost
            _stop(started.proc, group=True)
            started = "printed ready without its gRPC address"
        if not isinstance(started, str):
            break
        print(f"# {name}: Triton's start {attempt} failed: {started}", flush=True)
    if isinstance(started, str):
        print(f"| {name} | triton | - | - | absent: {started} |" + " |" * 12, flush=True)
        return [f"{name}/triton: {started}"]
    try:
        request = pb.ModelInferRequest.FromString(request_bytes("ocrdet", page))
        request.parameters["timeout"].int64_param = int(deadline_s * 1e6)  # Triton's per-request queue timeout
        kwargs: dict[str, Any] = {"address": started.address, "payload": request.SerializeToString(),
                                  "deadline_s": deadline_s}
        fn = _grpc_loop(args)
        capacity = None if args.callers else _capacity(gen, fn, args, **kwargs)
        rows = [_measure(gen, started.proc.pid, fn, level, group=True, callers=n, seconds=args.seconds, **kwargs)
                for level, n in _levels(args, capacity)]
        return _report(name, "triton", rows, capacity.rate if capacity else 0.0)
    finally:
        _stop(started.proc, group=True)


def _grpc_loop(args: argparse.Namespace) -> Callable[..., Load]:
    return aio_closed_loop if args.grpc_callers == "aio" else closed_loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="load duration of each row")
    parser.add_argument("--load", default="1,2,4,8,16", help="load levels, in multiples of the measured capacity")
    parser.add_argument("--callers", default="", help="closed-loop caller counts instead of --load")
    parser.add_argument("--max-callers", type=int, default=192, help="callers at most in one row")
    parser.add_argument("--deadline-ms", type=float, default=100.0)
    parser.add_argument("--models", default="slow,fast")
    parser.add_argument("--protocols", default="grpc,mqtt")
    parser.add_argument("--no-hostile", action="store_true", help="leave out the rows of callers ignoring hints")
    parser.add_argument("--no-echo", action="store_true", help="leave out the MQTT transport's floor (echo rows)")
    parser.add_argument("--loadgen", choices=("process", "thread"), default="process",
                        help="run the callers in processes of their own, or in this one")
    parser.add_argument("--loadgen-procs", type=int, default=2,
                        help="load generator processes (a row's callers are split among them)")
    parser.add_argument("--grpc-callers", choices=("aio", "threads"), default="aio",
                        help="gRPC callers as coroutines on one grpc.aio channel a process, or a thread each")
    parser.add_argument("--no-floor", action="store_true",
                        help="leave out the gRPC refusal's floor (a bare server refusing every call at once)")
    parser.add_argument("--serve-args", default="", help="extra `tierkit serve` flags, e.g. --no-admission")
    parser.add_argument("--pytriton-python", default="", help="a Python with nvidia-pytriton: add Triton's rows")
    parser.add_argument("--server-cpus", type=cpu_list, default=None,
                        help="CPUs the servers run on (tierkit, Triton, the floors), e.g. 0,1; default: any")
    parser.add_argument("--loadgen-cpus", type=cpu_list, default=None,
                        help="CPUs this process, the load generator and the brokers run on, e.g. 2-9; default: any")
    args = parser.parse_args(argv)
    if args.loadgen_cpus is not None:
        os.sched_setaffinity(0, args.loadgen_cpus)
    protocols = [p for p in args.protocols.split(",") if p]
    deadline_s = args.deadline_ms / 1000
    print(f"# bench_overload on {cpu_name()} ({os.cpu_count()} CPUs), Python {sys.version.split()[0]}; deadline "
          f"{args.deadline_ms:g} ms, {args.seconds:g} s a row; load generator: {args.loadgen} x{args.loadgen_procs}, "
          f"gRPC callers: {args.grpc_callers}; serve args: "
          f"{args.serve_args or '(defaults)'}; CPUs: server {_cpus(args.server_cpus)}, load generator "
          f"{_cpus(args.loadgen_cpus)}")
    print("| model | protocol | load | callers | offered/s | in-time/s | ratio | refused | refusal p50 ms "
          "| refusal p99 ms | server refusal p99 ms | answer p50/p99 ms | late (server dropped) | expired "
          "| loadgen cores | server cores | checks |")
    print("| --- " * 17 + "|")
    failed: list[str] = []
    gen = LoadGen(args.loadgen, args.loadgen_procs)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
            root = Path(tmp)
            with _broker(root / "broker") if "mqtt" in protocols else contextlib.nullcontext() as broker:
                for name in args.models.split(","):
                    failed += _model_rows(args, name, root, broker, gen, protocols, deadline_s)
    finally:
        gen.close()
    if not args.pytriton_python:
        print("| triton (PyTriton) | - | - | - | absent: PyTriton needs a virtual environment of its own "
              "(FACTS.md); give --pytriton-python PY to add it | | | | | | | | | | | | |")
    print(f"\n{len(failed)} target misses" + (": " + "; ".join(failed) if failed else ""))
    return 0


def _model_rows(args: argparse.Namespace, name: str, root: Path, broker: Broker | None, gen: LoadGen,
                protocols: list[str], deadline_s: float) -> list[str]:
    """Every row of one model: tierkit over each protocol (each transport's floor beside), then Triton."""
    height, width = MODELS[name]
    models = root / name
    page = ocr_det_package(models, height=height, width=width, name="ocrdet")
    payload = request_bytes("ocrdet", page)
    extra = ["--mqtt", broker.url] if broker is not None else []
    failed: list[str] = []
    with Server(models, "--metrics", "127.0.0.1:0", *extra, *args.serve_args.split(), cpus=args.server_cpus) as server:
        for protocol in protocols:
            kwargs: dict[str, Any]
            if protocol == "grpc":
                fn, kwargs = _grpc_loop(args), {"address": server.address}
            else:
                assert broker is not None
                fn, kwargs = mqtt_closed_loop, {"url": f"{broker.url}/ocrdet"}
            kwargs |= {"payload": payload, "deadline_s": deadline_s}
            failed += _protocol_rows(args, name, root, gen, server, protocol, fn, kwargs, page)
    if args.pytriton_python:
        failed += _triton(args, name, root, gen, page, deadline_s)
    return failed


def _ignores_hints(level: str) -> bool:
    """Whether a row's callers ignore retry hints: the "hostile" rows (each with a device id) and the "naive" one."""
    return level.endswith(("hostile", "naive"))


def _protocol_rows(args: argparse.Namespace, name: str, root: Path, gen: LoadGen, server: Server, protocol: str,
                   fn: Callable[..., Load], kwargs: dict[str, Any], page: np.ndarray) -> list[str]:
    """tierkit's rows over one protocol, then that transport's floor at the top level's caller count."""
    capacity = None if args.callers else _capacity(gen, fn, args, **kwargs)
    levels = _levels(args, capacity)
    if not levels:
        print(f"| {name} | {protocol} | - | - | stuck: no capacity measured |" + " |" * 12, flush=True)
        return [f"{name}/{protocol}: stuck in the capacity probe"]
    if not args.no_hostile:
        top_level, top_callers = levels[-1]
        levels.append((f"{top_level} hostile", top_callers))
        if protocol == "grpc":
            levels.append((f"{top_level} naive", top_callers))
    rows = [_measure(gen, server.proc.pid, fn, level, metrics=server.metrics, protocol=protocol, callers=n,
                     seconds=args.seconds, honour_hints=not _ignores_hints(level),
                     **({"identified": False} if level.endswith("naive") else {}), **kwargs)
            for level, n in levels]
    failed = _report(name, protocol, rows, capacity.rate if capacity else 0.0)
    top = [row for row in rows if not _ignores_hints(row.level)][-1]
    if protocol == "mqtt" and not args.no_echo:
        echo = _echo_rows(args, name, root, gen, kwargs["payload"], page, [levels[0], (top.level, top.load.callers)])
        if echo:
            print(f"# {name}: MQTT at {top.level} ({top.load.callers} callers) against its transport's floor: "
                  f"{top.load.goodput:.1f}/s in time (echo {echo[-1].load.goodput:.1f}/s), refusal p50/p99 "
                  f"{top.load.refusal_p(50):.1f}/{top.load.refusal_p(99):.1f} ms (echo round trip "
                  f"{echo[-1].load.answer_p(50):.1f}/{echo[-1].load.answer_p(99):.1f} ms)", flush=True)
    if protocol == "grpc" and not args.no_floor:
        best = max((row for row in rows if not _ignores_hints(row.level)), key=lambda row: row.load.goodput)
        echo = _grpc_echo_rows(args, name, root, gen, kwargs["payload"], page, [best, top])
        if len(echo) == 2 and echo[0].load.goodput > 0:
            print(f"# {name}: gRPC answers against the transport's floor: tierkit {top.load.goodput:.1f}/s at "
                  f"{top.load.callers} callers, {top.load.goodput / best.load.goodput:.2f} of its best "
                  f"({best.load.goodput:.1f}/s at {best.load.callers}); a bare echo {echo[1].load.goodput:.1f}/s at "
                  f"{top.load.callers}, {echo[1].load.goodput / echo[0].load.goodput:.2f} of its "
                  f"{echo[0].load.goodput:.1f}/s at {best.load.callers}", flush=True)
        floor = _refuser_row(args, name, root, gen, kwargs["payload"], top)
        if floor is not None:
            print(f"# {name}: gRPC refusals at {top.level} ({top.load.callers} callers): tierkit p50/p99 "
                  f"{top.load.refusal_p(50):.1f}/{top.load.refusal_p(99):.1f} ms caller-side, server-side p99 "
                  f"≤ {top.server_refusal_p99_ms} ms; a bare server refusing at once: p50/p99 "
                  f"{floor.load.refusal_p(50):.1f}/{floor.load.refusal_p(99):.1f} ms caller-side", flush=True)
        naive = None if args.no_hostile else _refuser_row(args, name, root, gen, kwargs["payload"], top, naive=True)
        if naive is not None:
            print(f"# {name}: callers ignoring hints at {top.load.callers}: a bare server refusing every call at once "
                  f"(no model) refuses {naive.load.refused / args.seconds:.1f}/s, lets {naive.load.expired} expire, "
                  f"on {naive.server_cores:.2f} cores beside the load generator's {naive.loadgen_cores:.2f}",
                  flush=True)
    return failed


def _refuser_row(args: argparse.Namespace, name: str, root: Path, gen: LoadGen, payload: bytes,
                 top: Row, *, naive: bool = False) -> Row | None:
    """The gRPC refusal's floor: the same generator, payload and callers as tierkit's row `top`, against a bare
    grpcio server that refuses every call at once with the median hint tierkit gave there (`grpc_refuser.py`).
    `naive`: the callers ignore the hint and send no device id, as in the "naive" row: what refusing alone,
    with no model, costs the host at the rate such callers call."""
    hint = float(np.median(top.load.hints_ms)) if top.load.hints_ms else 1.0
    started = _start([sys.executable, str(Path(__file__).with_name("grpc_refuser.py")), f"{hint:g}"],
                     root / f"refuser-{name}.log", timeout_s=START_S, stdin=True, cpus=args.server_cpus)
    if isinstance(started, str):
        print(f"| {name} | grpc-refuser | - | - | absent: {started} |" + " |" * 12, flush=True)
        return None
    try:
        kwargs: dict[str, Any] = {"address": started.address, "payload": payload, "deadline_s": top.load.deadline_s}
        if naive:
            kwargs.update(honour_hints=False, identified=False)
        level = f"{top.level} naive" if naive else f"{top.level} (hint {hint:g} ms)"
        row = _measure(gen, started.proc.pid, _grpc_loop(args), level, callers=top.load.callers,
                       seconds=args.seconds, **kwargs)
    finally:
        _stop(started.proc)
    print(_row(name, "grpc-refuser", row, 0.0, checked=False), flush=True)
    return row


def _grpc_echo_rows(args: argparse.Namespace, name: str, root: Path, gen: LoadGen, payload: bytes,
                    page: np.ndarray, compared: list[Row]) -> list[Row]:
    """The gRPC transport's floor for answers: the same generator, payload and callers as tierkit's rows
    `compared` (its best and its top), against a bare grpcio server that answers every call at once with the
    model's answer size (`grpc_refuser.py --echo`): how much of its own rate the transport keeps as callers grow."""
    reply_bytes = page.nbytes // page.shape[1]  # the detector answers one probability map a page
    started = _start([sys.executable, str(Path(__file__).with_name("grpc_refuser.py")), "--echo", str(reply_bytes)],
                     root / f"grpc-echo-{name}.log", timeout_s=START_S, stdin=True, cpus=args.server_cpus)
    if isinstance(started, str):
        print(f"| {name} | grpc-echo | - | - | absent: {started} |" + " |" * 12, flush=True)
        return []
    try:
        kwargs: dict[str, Any] = {"address": started.address, "payload": payload,
                                  "deadline_s": compared[0].load.deadline_s}
        with contextlib.suppress(Stuck):
            gen.run(_grpc_loop(args), callers=compared[0].load.callers, seconds=1.0, **kwargs)  # warm up
        echo = [_measure(gen, started.proc.pid, _grpc_loop(args), row.level, callers=row.load.callers,
                         seconds=args.seconds, **kwargs) for row in compared]
    finally:
        _stop(started.proc)
    return _floor_rows(name, "grpc-echo", echo)


def _echo_rows(args: argparse.Namespace, name: str, root: Path, gen: LoadGen, payload: bytes, page: np.ndarray,
               levels: list[tuple[str, int]]) -> list[Row]:
    """The MQTT transport's floor: the same callers and pages against a bare echo (`mqtt_echo.py`) through a
    Mosquitto of its own (a second shared subscription on the bridge's broker would take a copy of each)."""
    reply_bytes = page.nbytes // page.shape[1]  # the detector answers one probability map a page
    with _broker(root / f"echo-broker-{name}") as broker:
        started = _start([sys.executable, str(Path(__file__).with_name("mqtt_echo.py")), broker.url,
                          str(reply_bytes)], root / f"echo-{name}.log", timeout_s=START_S, stdin=True,
                         cpus=args.server_cpus)
        if isinstance(started, str):
            print(f"| {name} | mqtt-echo | - | - | absent: {started} |" + " |" * 12, flush=True)
            return []
        try:
            kwargs: dict[str, Any] = {"url": f"{broker.url}/ocrdet", "payload": payload,
                                      "deadline_s": args.deadline_ms / 1000}
            with contextlib.suppress(Stuck):
                gen.run(mqtt_closed_loop, callers=1, seconds=0.5, **kwargs)  # warm up
            rows = [_measure(gen, started.proc.pid, mqtt_closed_loop, level, callers=n, seconds=args.seconds,
                             **kwargs) for level, n in levels]
        finally:
            _stop(started.proc)
    return _floor_rows(name, "mqtt-echo", rows)


def _floor_rows(name: str, protocol: str, rows: list[Row]) -> list[Row]:
    """Print a floor's rows against their own best; those that did not get stuck."""
    best = max(row.load.goodput for row in rows)
    for row in rows:
        print(_row(name, protocol, row, best, checked=False), flush=True)
    return [row for row in rows if not row.stuck]


if __name__ == "__main__":
    raise SystemExit(main())
