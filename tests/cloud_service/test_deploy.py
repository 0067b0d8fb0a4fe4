"""deploy/: the Kubernetes manifests are well formed and use flags `tierkit serve` has."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from cloud_service.cli import add_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _docs(name: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_manifest_has_deployment_headless_service_hpa_and_pdb() -> None:
    docs = _docs("tierkit-cloud.yaml")
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= set(docs)
    assert docs["Service"]["spec"]["clusterIP"] == "None"
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"]["service"] == "inference.GRPCInferenceService"
    env = {e["name"] for e in container["env"]}
    assert "TIERKIT_MQTT_PASSWORD" in env


def test_manifest_args_are_valid_serve_flags() -> None:
    container = _docs("tierkit-cloud.yaml")["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(container["args"])
    assert args.grpc == "0.0.0.0:8001"
    assert args.mqtt.startswith("mqtts://")


def test_queue_depth_hpa_uses_the_exported_metric() -> None:
    hpa = _docs("hpa-queue-depth.yaml")["HorizontalPodAutoscaler"]
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert names == ["tierkit_queue_depth"]


def test_mosquitto_config_has_the_settings_that_matter() -> None:
    lines = {line.strip() for line in (DEPLOY / "mosquitto" / "mosquitto.conf").read_text().splitlines()}
    assert {"set_tcp_nodelay true", "persistence true", "allow_anonymous false", "use_username_as_clientid true",
            "require_certificate true"} <= lines
    assert any(line.startswith("plugin ") and "dynamic_security" in line for line in lines)
    assert not any(line.startswith("acl_file") for line in lines)  # 2.0's acl_file grants every SUBSCRIBE
