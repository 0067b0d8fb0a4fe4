"""What hostile traffic costs: how much malformed traffic one `tierkit serve` replica absorbs per
second while a valid client keeps its usual p99.

A digits CNN package is served by `tierkit serve` (a separate process). In each phase a valid client
(this process, one call in flight, raw bytes over grpc.aio) sends well-formed one-row ModelInfer
requests for a fixed time and records its latency; meanwhile a hostile client (another process) sends
malformed requests at a target rate: payloads that are not protobuf, shapes such as [0, 2**62] and
70 dimensions, wrong byte counts, unknown datatypes, 100 kB model names, unknown models. The first
phase has no hostile traffic: it is the baseline the other phases are compared with, in the same run.

Reported per phase: the hostile rate asked for and achieved (answers per second, every one of them
checked to be an error status a client can act on: INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED),
and the valid client's p50 and p99 with their ratio to the baseline's. The figure the issue asks for
is the highest achieved hostile rate whose valid p99 stays within 1.25x of the baseline.

Usage:
    python bench/bench_hostile.py [--quick] [--seconds S] [--rates R,R,...]

`--quick` (2 s phases, two rates) checks that the script works; its numbers are no measurement.
Run the real one on a quiet machine: timings on a shared host are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_cloud import digits_cnn, start_process, stop_process, write_package
from cloud_service.protocol import encode_request
from cloud_service.protocol import inference_pb2 as pb

METHOD = "/inference.GRPCInferenceService/ModelInfer"
ACCEPTABLE = {"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"}
P99_BOUND = 1.25


def hostile_payloads(model: str) -> list[bytes]:
    """Malformed requests, one of each kind the security suite found answered wrongly or slowly."""
    out = [b"\xff\xfe not protobuf", b"\x0a\xff\xff\xff\xff\x0f"]
    for shape, raw in (([0, 2**62], b""), ([1] * 70, b"\x00" * 4), ([2**31, 2**31, 8], b""), ([1, 1, 8, 8], b"\x00")):
        request = pb.ModelInferRequest(model_name=model)
        request.inputs.add(name="x", datatype="FP32", shape=shape)
        request.raw_input_contents.append(raw)
        out.append(request.SerializeToString())
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP8", shape=[1, 1, 8, 8])
    request.raw_input_contents.append(b"\x00" * 64)
    out.append(request.SerializeToString())
    out.append(encode_request("m" * 100_000, {"x": np.zeros((1, 1, 8, 8), np.float32)}).SerializeToString())
    out.append(encode_request("no-such-model", {"x": np.zeros((1, 1, 8, 8), np.float32)}).SerializeToString())
    return out


def _hostile(address: str, model: str, rate: float, seconds: float, result: Any) -> None:
    import grpc

    async def main() -> tuple[int, int, dict[str, int]]:
        payloads, codes, sent = hostile_payloads(model), {}, 0
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            loop = asyncio.get_running_loop()
            start = loop.time()
            pending: set[asyncio.Task[None]] = set()

            async def one(payload: bytes) -> None:
                try:
                    await call(payload, timeout=10.0)
                    name = "OK"
                except grpc.aio.AioRpcError as exc:
                    name = exc.code().name
                codes[name] = codes.get(name, 0) + 1

            while (now := loop.time()) - start < seconds:
                due = int((now - start) * rate) + 1
                while sent < due and len(pending) < 256:
                    task = loop.create_task(one(payloads[sent % len(payloads)]))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    sent += 1
                await asyncio.sleep(0.001)
            if pending:
                await asyncio.wait(pending, timeout=15)
            return sent, int((loop.time() - start) * 1000), codes

    result.put(asyncio.run(main()))


async def valid_client(address: str, payload: bytes, seconds: float) -> list[float]:
    import grpc

    latencies: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        await call(payload, timeout=10.0)  # warm
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await call(payload, timeout=10.0)
            latencies.append(time.perf_counter() - t0)
    return latencies


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def phase(address: str, model: str, payload: bytes, rate: float, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    result: Any = ctx.Queue()
    proc = None
    if rate > 0:
        proc = ctx.Process(target=_hostile, args=(address, model, rate, seconds, result))
        proc.start()
        time.sleep(0.5)  # the hostile client is sending before the valid one starts measuring
    latencies = asyncio.run(valid_client(address, payload, seconds - 0.5 if rate > 0 else seconds))
    sent, ms, codes = (0, 1, {}) if proc is None else result.get(timeout=60)
    if proc is not None:
        proc.join(30)
    answered = sum(codes.values())
    return {"rate": rate, "achieved": answered / (ms / 1000), "codes": codes, "valid": len(latencies),
            "lost": sent - answered,
            "p50": _pct(latencies, 0.50), "p99": _pct(latencies, 0.99),
            "bad_codes": {c: n for c, n in codes.items() if c not in ACCEPTABLE}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 s phases, two rates: checks the script works")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--rates", default="100,300,1000,3000,10000", help="hostile requests per second to try")
    args = parser.parse_args(argv)
    seconds = 2.0 if args.quick else args.seconds
    rates = [100.0, 1000.0] if args.quick else [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        work = Path(tmp)
        model = digits_cnn(work)
        models_dir = work / "models"
        write_package(model, models_dir)
        payload = encode_request(model.name, model.feed).SerializeToString()
        proc, address = start_process([sys.executable, "-m", "sdk.cli", "serve", "--models", str(models_dir),
                                       "--grpc", "127.0.0.1:0"])
        try:
            rows = [phase(address, model.name, payload, rate, seconds) for rate in [0.0, *rates]]
        finally:
            stop_process(proc)
    base = rows[0]
    print(f"valid client: one call in flight, {seconds:g} s per phase; baseline p50 {base['p50']:.2f} ms, "
          f"p99 {base['p99']:.2f} ms (no hostile traffic, same run)")
    print(f"{'hostile/s asked':>16} {'answered/s':>11} {'valid reqs':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'p99/base':>9} {'lost':>5}  unexpected statuses")
    absorbed = 0.0
    for row in rows:
        ratio = row["p99"] / base["p99"] if base["p99"] else float("nan")
        if row["rate"] and ratio <= P99_BOUND and not row["bad_codes"] and not row["lost"]:
            absorbed = max(absorbed, row["achieved"])
        print(f"{row['rate']:>16.0f} {row['achieved']:>11.0f} {row['valid']:>10} {row['p50']:>8.2f} "
              f"{row['p99']:>8.2f} {ratio:>9.2f} {row['lost']:>5}  {row['bad_codes'] or '-'}")
    print(f"absorbed: {absorbed:.0f} hostile requests/s with the valid p99 within {P99_BOUND}x of its baseline")
    bad = [r for r in rows if r["bad_codes"] or r["lost"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
