"""Escalating a 224x224 photo over an emulated slow link (token-bucket proxy on loopback).

At 10 Mbit/s and 30 ms RTT: p95 and bytes per escalation for fp32, fp16, zstd, fp16+zstd and the raw
uint8 frame (plus zstd), against tierkit's server running a model whose manifest declares the
preprocessing. Then `wire_encoding="auto"` with a 150 ms budget while the rate steps from 50 to
5 Mbit/s: which encodings it picks, and how long until it switches. Run with `-s` to see the table.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from cloud_service.config import ServerConfig
from cloud_service.protocol import decode_outputs, inference_pb2
from cloud_service.protocol.encoding import encode_input
from cloud_service.protocol.preprocess import Preprocess
from edge_agent.transports import TransportOptions, open_transport
from runtimes.errors import CloudTimeout
from testkit.cloud_helpers import ServerThread
from testkit.frames import PREPROCESS, photo_frame, pool_package
from testkit.slowlink import SlowLink
from testkit.waiting import until

pytestmark = pytest.mark.slow

def _request(encoding: str, frame: np.ndarray, x: np.ndarray) -> inference_pb2.ModelInferRequest:
    request = inference_pb2.ModelInferRequest(model_name="pool")
    encode_input(request, "x", frame[None] if encoding.startswith("frame") else x, encoding)
    return request


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    pool_package(tmp_path / "models" / "pool-v1")
    thread = ServerThread(ServerConfig(models_dir=tmp_path / "models", grpc_address="127.0.0.1:0",
                                       drain_timeout_s=2)).start()
    yield thread
    thread.stop()
    shutil.rmtree(tmp_path / "models", ignore_errors=True)


def test_encodings_over_a_10_mbit_30_ms_link(server: ServerThread) -> None:
    frame = photo_frame()
    x = Preprocess.from_json(PREPROCESS).apply(frame)
    host, port = server.grpc.rsplit(":", 1)
    rows: dict[str, tuple[float, float]] = {}

    async def main() -> None:
        async with SlowLink(host, int(port), rate_bps=10e6, rtt_s=0.030) as link, \
                open_transport(f"grpc://127.0.0.1:{link.port}/pool", device_id="cam-1") as cloud:
            want = None
            for encoding in ("fp32", "fp16", "zstd", "fp16+zstd", "frame", "frame+zstd"):
                request = _request(encoding, frame, x)
                await cloud.escalate(request, timeout_s=10)  # warm: connection, first-call costs
                sent, times = link.bytes["up"], []
                for _ in range(6):
                    started = time.perf_counter()
                    reply = await cloud.escalate(request, timeout_s=10)
                    times.append(time.perf_counter() - started)
                y = decode_outputs(reply)["y"]
                want = y if want is None else want
                np.testing.assert_allclose(y, want, atol=2e-3 if "fp16" in encoding else 1e-4)
                rows[encoding] = (float(np.percentile(times, 95)) * 1e3, (link.bytes["up"] - sent) / 6)

    asyncio.run(main())
    print("\nencoding     p95 ms   bytes/escalation (10 Mbit/s, 30 ms RTT)")
    for encoding, (p95, nbytes) in rows.items():
        print(f"{encoding:<12} {p95:7.1f}   {nbytes:10.0f}")
    fp32 = rows["fp32"][1]
    assert rows["fp16"][1] == pytest.approx(fp32 / 2, rel=0.02)
    assert rows["frame"][1] == pytest.approx(fp32 / 4, rel=0.02)
    assert rows["zstd"][1] < fp32
    assert rows["frame+zstd"][1] < rows["frame"][1]
    # on a 10 Mbit/s link the bytes decide: each halving of the bytes shortens the round trip
    assert rows["fp16"][0] < rows["fp32"][0] * 0.75
    assert rows["frame"][0] < rows["fp16"][0] * 0.75


def test_auto_encoding_switches_when_the_rate_steps_down(server: ServerThread) -> None:
    frame = photo_frame()
    x = Preprocess.from_json(PREPROCESS).apply(frame)
    host, port = server.grpc.rsplit(":", 1)
    budget_s = 0.150
    picks: list[tuple[str, str, bool]] = []  # (rate, encoding, answered in time)
    switch_s: list[float] = []

    async def main() -> None:
        options = TransportOptions(wire_encoding="auto", retry_max_attempts=1)
        async with SlowLink(host, int(port), rate_bps=50e6, rtt_s=0.030) as link, \
                open_transport(f"grpc://127.0.0.1:{link.port}/pool", device_id="cam-1", options=options) as cloud:
            encoder = cloud.encoder  # type: ignore[attr-defined]
            request = _request("fp32", frame, x)

            async def once(rate: str) -> str:
                try:
                    await cloud.escalate(request, timeout_s=budget_s)
                    ok = True
                except CloudTimeout:
                    ok = False
                used = encoder.last.encoding if encoder.last is not None else "fp32"
                picks.append((rate, used, ok))
                await until("a timed-out transfer to drain from the link", link.idle, timeout=30)
                return used

            for _ in range(8):
                await once("50M")
            before = picks[-1][1]
            link.rate_bps = 5e6
            stepped = time.perf_counter()
            for _ in range(10):
                if await once("5M") != before:
                    switch_s.append(time.perf_counter() - stepped)
                    break

    asyncio.run(main())
    print("\nrate  encoding     in 150 ms")
    for rate, encoding, ok in picks:
        print(f"{rate:<5} {encoding:<12} {ok}")
    print(f"switched {switch_s[0]:.2f} s after the step" if switch_s else "never switched")
    at_50 = [p for p in picks if p[0] == "50M"][-4:]
    assert all(ok for _, _, ok in at_50), "at 50 Mbit/s the chosen encoding answers within the budget"
    assert switch_s, "the encoding changes after the rate steps down"
    assert switch_s[0] < 2.0
