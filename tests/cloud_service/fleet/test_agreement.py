"""Edge/cloud agreement on escalated inputs: a real agent escalating to a real cloud over loopback gRPC counts,
among escalations the cloud answered, those whose top-1 equals the edge's; telemetry windows carry it per window,
and the fleet stores and serves it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest

from cloud_service.fleet.ca import FleetCA
from cloud_service.fleet.registry import Registry
from cloud_service.fleet.store import FleetStore
from cloud_service.fleet.telemetry import TelemetryStore
from edge_agent.agent import AgentOptions, EdgeAgent
from edge_agent.budget import Budget
from edge_agent.fleet_sync import TelemetryWindows, generate_key_and_csr
from edge_agent.policy import Policy
from edge_agent.stats import Observation, Stats, top1_agreed
from runtimes.registry import open_session
from sdk.demo import CloudThread
from testkit import zoo
from testkit.packages import make_package


def test_top1_agreement_applies_to_classification_outputs_only() -> None:
    edge = np.array([[0.1, 0.9], [0.8, 0.2]], np.float32)
    assert top1_agreed(edge, edge[:, ::-1].copy()) is False
    assert top1_agreed(edge, edge * 3) is True
    assert top1_agreed(np.array([[0.3], [0.7]]), np.array([[0.9], [0.1]])) is None  # one value a row: regression
    assert top1_agreed(np.float32(0.3).reshape(()), np.float32(0.9).reshape(())) is None
    s = Stats()
    for agreed in (True, None, False, True):
        s.add(Observation("v", 1.0, 1.0, 1.0, "modeled", 1, 1, "cloud", False, "", 2.0, 100, agreed, 3.0, False, 0.5))
    snap = s.snapshot()
    assert (snap["escalations_compared"], snap["escalations_agreed"]) == (3, 2)
    assert snap["agreement"] == pytest.approx(2 / 3)
    assert Stats().snapshot()["agreement"] is None


def test_agent_counts_agreement_and_windows_carry_it(digits_linear_onnx: Path, digits_cnn_onnx: Path,
                                                      digits: zoo.Split, tmp_path: Path) -> None:
    edge = make_package(digits_linear_onnx, tmp_path / "edge" / "digits", name="digits", x_val=digits.x_val,
                        y_val=digits.y_val)
    make_package(digits_cnn_onnx, tmp_path / "cloud" / "digits-cloud", name="digits-cloud", x_val=digits.x_val,
                 y_val=digits.y_val)
    with open_session(digits_linear_onnx) as s:
        edge_top1 = s.run({"x": digits.x_test})["logits"].argmax(axis=1)
    x = digits.x_test[:160]
    cloud = CloudThread(tmp_path / "cloud")
    windows = TelemetryWindows("boot-1")

    async def main() -> tuple[list[list[bool]], list[dict[str, object]], dict[str, object]]:
        # max_prob under 0.995 escalates the linear model's unsure half or so; a generous budget so that
        # a loaded host degrades none of them (a degraded escalation has no cloud answer to compare)
        async with EdgeAgent(edge, cloud=f"grpc://{address}/digits-cloud", policy=Policy("max_prob", threshold=0.995),
                             budget=Budget(latency_ms=5000), options=AgentOptions(device_id="dev-agree")) as agent:
            halves: list[list[bool]] = [[], []]
            docs = []
            for half, rows in enumerate((range(80), range(80, 160))):
                for i in rows:
                    pred = await agent.infer(x[i])
                    if pred.tier == "cloud":  # answered by the cloud: the answer is the cloud's top-1
                        halves[half].append(int(pred.outputs["logits"].argmax()) == int(edge_top1[i]))
                docs.append(windows.window(agent.snapshot()))
            return halves, docs, agent.snapshot()

    try:
        address = cloud.start()["grpc"]
        halves, docs, snap = asyncio.run(main())
    finally:
        cloud.stop()
    compared = halves[0] + halves[1]
    assert len(compared) >= 20, f"only {len(compared)} escalations answered"
    assert 0 < sum(compared) < len(compared), "the two models should agree on some escalated inputs, not all"
    assert snap["escalations_compared"] == len(compared)
    assert snap["escalations_agreed"] == sum(compared)
    assert snap["agreement"] == pytest.approx(np.mean(compared))
    for doc, half in zip(docs, halves, strict=True):  # per window, from the cumulative counters
        assert doc["agreement"] == (pytest.approx(np.mean(half)) if half else None)

    # the fleet stores the windows' agreement and serves it back
    store = FleetStore.open(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        registry = Registry(store, FleetCA.load_or_create(tmp_path / "ca"))
        device = registry.enroll(registry.create_token({}), generate_key_and_csr()[1], hardware={},
                                 agent_version="t").device_id
        tel = TelemetryStore(store)
        res = tel.ingest([(device, json.dumps({**d, "device": device}).encode(), time.time()) for d in docs])
        assert res.stored == 2
        assert [w["agreement"] for w in tel.windows([device])] == [d["agreement"] for d in docs]
    finally:
        store.close()
