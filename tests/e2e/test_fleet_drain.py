"""A fleet reconnecting at once: 200 devices drain their journals into a cloud already at capacity.

The cloud is `tierkit serve` with a slow real model (PP-OCRv4's text detector on 64x128 pages, about
10 ms a request on two idle cores), kept at capacity by live closed-loop callers with 100 ms deadlines.
Each simulated device is the agent's replay path and nothing else: a real journal (SQLite) holding
escalations, `journal.drain` paced by `DrainPace`, the cloud's busy refusals noted by `Pushback`, and
its own gRPC channel (`GrpcTransport`). They all start draining at the same moment. The live callers run in
a process of their own, as the devices they stand for are other machines: in the fleet's process their threads
waited for its interpreter behind 200 devices' replay, and their goodput measured that, not the server.

Checked: every journaled escalation is answered, none lost (each device's journal ends empty and the
answers name every sequence number once), and the live callers' goodput while the fleet drains stays
near what they got alone.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from cloud_service.protocol import get_parameters, topics
from cloud_service.protocol import inference_pb2 as pb
from edge_agent.journal import Journal, JournalEntry, drain
from edge_agent.pushback import DrainPace, Pushback
from edge_agent.transports.base import TransportOptions, parse_cloud_url
from edge_agent.transports.grpc import GrpcTransport
from runtimes.errors import EscalationError
from testkit.overload import Load, Server, closed_loop, ocr_det_package, request_bytes

pytestmark = pytest.mark.slow

DEVICES = 200
ENTRIES = 3  # journaled escalations per device
DRAIN_DEADLINE_S = 5.0  # what the agent gives a journaled escalation (AgentOptions.drain_timeout_s)
LIVE_DEADLINE_S = 0.1
LIVE_CALLERS = 4


def _instances(address: str) -> int:
    """How many instances of the model the server opened (its layout is chosen from the model's run time)."""
    import grpc

    from cloud_service.protocol import inference_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        config = inference_pb2_grpc.GRPCInferenceServiceStub(channel).ModelConfig(
            pb.ModelConfigRequest(name="ocrdet"), timeout=10).config
    return sum(group.count for group in config.instance_group)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Device:
    """One device's journal replay, as `EdgeAgent.drain_journal` runs it."""

    def __init__(self, index: int, root: Path, payload: bytes, address: str) -> None:
        self.name = f"dev-{index:03d}"
        self.journal = Journal(root / f"{self.name}.db")
        request = pb.ModelInferRequest.FromString(payload)
        for seq in range(ENTRIES):
            request.parameters[topics.PARAM_SEQ].int64_param = seq
            self.journal.append("escalation", request.SerializeToString(), device=self.name, boot_id="b", seq=seq)
        self.transport = GrpcTransport(parse_cloud_url(f"grpc://{address}/ocrdet"), device_id=self.name,
                                       options=TransportOptions(retry_max_attempts=1))
        self.pushback = Pushback()
        self.pace = DrainPace(20.0)
        self.answered: list[int] = []
        self.refusals = 0

    async def send(self, entry: JournalEntry) -> None:
        request = pb.ModelInferRequest.FromString(entry.payload)
        try:
            response = await self.transport.escalate(request, timeout_s=DRAIN_DEADLINE_S)
        except EscalationError as exc:
            if self.pushback.note(exc):
                self.refusals += 1
                self.pace.on_busy()
            raise
        self.pace.on_answer()
        self.answered.append(int(get_parameters(request.parameters)[topics.PARAM_SEQ]))
        assert response.outputs

    async def replay(self, until: float) -> None:
        while self.journal.count() and time.monotonic() < until:
            if (wait := self.pushback.remaining_s()) > 0:
                await asyncio.sleep(wait)  # the device honours the cloud's retry hint: the behaviour under test
            await drain(self.journal, self.send, window=4, pace=self.pace)
            if self.journal.count() and not self.pushback.active():
                await asyncio.sleep(0.05)  # a failure that was not a refusal: the agent's drain interval

    async def aclose(self) -> None:
        await self.transport.aclose()
        self.journal.close()


def test_a_reconnecting_fleet_drains_every_journal_without_starving_live_escalations(tmp_path: Path) -> None:
    from testkit.onnx_zoo import NotInstalled

    models = tmp_path / "models"
    try:
        page = ocr_det_package(models, height=64, width=128)
    except NotInstalled as exc:
        pytest.skip(str(exc))
    payload = request_bytes("ocrdet", page)
    with Server(models, "--no-batching") as server, ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as callers:
        def load(seconds: float) -> Load:  # the live callers, in their own process
            return callers.submit(closed_loop, server.address, payload, callers=LIVE_CALLERS, seconds=seconds,
                                  deadline_s=LIVE_DEADLINE_S).result(timeout=seconds + 60)

        load(0.5)  # warm up: the process, its channel, the server
        instances = _instances(server.address)
        alone = load(3.0)
        devices = [Device(i, tmp_path, payload, server.address) for i in range(DEVICES)]
        live: list[Load] = []
        stop = threading.Event()

        def live_load() -> None:  # live escalations, in 2 s slices, for as long as the fleet drains
            while not stop.is_set():
                live.append(load(2.0))

        async def reconnect() -> float:
            started = time.monotonic()
            try:
                await asyncio.gather(*(d.replay(started + 120) for d in devices))
            finally:
                for d in devices:
                    await d.aclose()
            return time.monotonic() - started

        thread = threading.Thread(target=live_load, daemon=True)
        cpu = (_cpu_s(server.proc.pid), time.process_time())
        thread.start()
        took = asyncio.run(reconnect())
        cpu = ((_cpu_s(server.proc.pid) - cpu[0]) / took, (time.process_time() - cpu[1]) / took)
        stop.set()
        thread.join(30)
    left = {d.name: d.journal.count() for d in devices if d.journal.count()}
    assert not left, f"journals not drained within 120 s: {left}"
    for d in devices:
        assert sorted(d.answered) == list(range(ENTRIES)), (d.name, d.answered)  # each answered once, none lost
    during = Load(LIVE_CALLERS, sum(s.seconds for s in live), LIVE_DEADLINE_S)
    for s in live:
        during.add(s)
    refusals = sum(d.refusals for d in devices)
    summary = (f"drained {DEVICES * ENTRIES} escalations of {DEVICES} devices in {took:.1f} s with {refusals} "
               f"refusals; live goodput alone {alone.goodput:.1f}/s, while draining {during.goodput:.1f}/s; CPU while "
               f"draining: the server {cpu[0]:.2f} cores ({instances} instance(s) of the model), the 200 devices "
               f"{cpu[1]:.2f}")
    print(summary)
    assert during.goodput >= 0.5 * alone.goodput, summary
