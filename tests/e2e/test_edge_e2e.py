"""End to end on real data: the SDK over real loopback gRPC and a real Mosquitto to the real cloud service.

Tiered accuracy on digits' held-out split must come within 0.5 points of the cloud model alone at an
escalation rate of at most 25%, with the threshold chosen on the package's validation data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sdk
from compilers.variants import VariantSet
from edge_agent.agent import AgentOptions
from edge_agent.policy import Policy
from sdk.demo import CloudThread
from testkit import zoo
from testkit.packages import compiled

POLICY = Policy("margin", target_accuracy=1.0, max_rate=0.2)


@pytest.fixture(scope="module")
def models(digits_linear: Any, digits_cnn: Any, digits: zoo.Split,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(edge variant set, cloud models directory), both compiled by the real compiler."""
    root = tmp_path_factory.mktemp("e2e")
    edge = compiled(digits_linear, digits, root, "digits", ("fp32", "int8"))
    compiled(digits_cnn, digits, root / "cloud_models", "digits-cloud", ("fp32",))
    return edge, root / "cloud_models"


def _cloud_accuracy(models_dir: Path, digits: zoo.Split) -> float:
    with VariantSet.load(models_dir / "digits-cloud").open().open_session() as session:
        return zoo.accuracy(session.run({"x": digits.x_test})["logits"], digits.y_test)


def _stream(edge: Path, url: str, digits: zoo.Split) -> list[sdk.Prediction]:
    with sdk.load(edge, cloud=url, budget=sdk.Budget(latency_ms=250), policy=POLICY,
                  options=AgentOptions(device_id="e2e-dev")) as model:
        return [model.predict(x) for x in digits.x_test]


def _check(preds: list[sdk.Prediction], digits: zoo.Split, cloud_acc: float) -> None:
    labels = np.array([p.outputs["logits"].argmax() for p in preds])
    tiered = float((labels == digits.y_test).mean())
    wanted = np.mean([p.tier == "cloud" or p.degraded for p in preds])
    degraded = sum(p.degraded for p in preds)
    assert degraded <= 2, f"{degraded} escalations failed on a healthy loopback link"
    assert wanted <= 0.25, f"escalation rate {wanted:.3f}"
    assert tiered >= cloud_acc - 0.005, f"tiered {tiered:.4f} vs cloud {cloud_acc:.4f} at rate {wanted:.3f}"


def test_tiered_over_grpc_meets_the_accuracy_check(models: tuple[Path, Path], digits: zoo.Split) -> None:
    edge, models_dir = models
    cloud = CloudThread(models_dir)
    try:
        address = cloud.start()["grpc"]
        preds = _stream(edge, f"grpc://{address}/digits-cloud", digits)
    finally:
        cloud.stop()
    _check(preds, digits, _cloud_accuracy(models_dir, digits))
    assert {p.tier for p in preds} == {"edge", "cloud"}


@pytest.mark.mqtt
def test_tiered_over_mqtt_meets_the_accuracy_check(models: tuple[Path, Path], digits: zoo.Split,
                                                   broker: Any) -> None:
    edge, models_dir = models
    cloud = CloudThread(models_dir, grpc=False, mqtt_url=broker.url)
    try:
        cloud.start()
        preds = _stream(edge, f"{broker.url}/digits-cloud", digits)
    finally:
        cloud.stop()
    _check(preds, digits, _cloud_accuracy(models_dir, digits))
