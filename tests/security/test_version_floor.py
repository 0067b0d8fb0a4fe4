"""Version floor: an older signed package is refused on devices (the agent's loader) and servers
(`tierkit serve`) unless it is an explicit, signed rollback."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from compilers import signing
from compilers.manifest import MANIFEST_FILE, Manifest
from compilers.package import ModelPackage, write_package
from compilers.version_floor import ROLLBACK_KEY, VersionFloor, version_key
from edge_agent.variants import load_packages
from runtimes.errors import IntegrityError, SignatureError
from testkit.cloud_helpers import ServerThread, make_package, metric_value


@pytest.fixture
def key(tmp_path: Path) -> tuple[Any, Any]:
    priv, pub = signing.generate_keypair(tmp_path / "ops")
    return signing.load_private_key(priv), signing.load_public_key(pub)


def _signed(root: Path, onnx: Path, version: str, key: Any, *, rollback_from: str | None = None) -> Path:
    directory = make_package(root / f"digits-{version}-{rollback_from}", onnx, version=version)
    if rollback_from is not None:
        manifest = Manifest.loads((directory / MANIFEST_FILE).read_bytes(), where="test")
        write_package(directory, manifest.replace(build={**manifest.build, ROLLBACK_KEY: rollback_from}),
                      sign_key=key)
    else:
        write_package(directory, Manifest.loads((directory / MANIFEST_FILE).read_bytes(), where="test"),
                      sign_key=key)
    return directory


def test_versions_order_as_release_numbers() -> None:
    assert version_key("10") > version_key("9")
    assert version_key("1.10") > version_key("1.9")
    assert version_key("2") > version_key("1.9")


def test_older_signed_versions_are_refused_unless_a_signed_rollback(
        tmp_path: Path, digits_cnn_onnx: Path, key: tuple[Any, Any]) -> None:
    priv, pub = key
    floor = VersionFloor(tmp_path / "floor.json")
    v1, v2 = _signed(tmp_path, digits_cnn_onnx, "1", priv), _signed(tmp_path, digits_cnn_onnx, "2", priv)
    ModelPackage.open(v2, trusted_keys=[pub], floor=floor)
    assert json.loads((tmp_path / "floor.json").read_text()) == {"digits": "2"}
    with pytest.raises(IntegrityError, match="older than version '2'"):
        ModelPackage.open(v1, trusted_keys=[pub], floor=VersionFloor(tmp_path / "floor.json"))  # survives restarts
    rollback = _signed(tmp_path, digits_cnn_onnx, "1", priv, rollback_from="2")
    ModelPackage.open(rollback, trusted_keys=[pub], floor=floor)
    assert floor.get("digits") == "1"
    ModelPackage.open(_signed(tmp_path, digits_cnn_onnx, "3", priv), trusted_keys=[pub], floor=floor)
    with pytest.raises(IntegrityError, match="signed rollback"):  # the old rollback, replayed after 3
        ModelPackage.open(rollback, trusted_keys=[pub], floor=floor)


def test_a_rollback_marker_added_without_the_key_breaks_the_signature(
        tmp_path: Path, digits_cnn_onnx: Path, key: tuple[Any, Any]) -> None:
    priv, pub = key
    v1 = _signed(tmp_path, digits_cnn_onnx, "1", priv)
    doc = json.loads((v1 / MANIFEST_FILE).read_text())
    doc["build"][ROLLBACK_KEY] = "9"
    (v1 / MANIFEST_FILE).write_text(json.dumps(doc))
    with pytest.raises(SignatureError):
        ModelPackage.open(v1, trusted_keys=[pub], floor=VersionFloor(tmp_path / "floor.json"))


def test_the_agent_loader_refuses_an_older_version(tmp_path: Path, digits_cnn_onnx: Path,
                                                   key: tuple[Any, Any]) -> None:
    priv, pub = key
    floor = VersionFloor(tmp_path / "floor.json")
    load_packages(_signed(tmp_path, digits_cnn_onnx, "2", priv), trusted_keys=[pub], floor=floor)
    with pytest.raises(IntegrityError, match="older"):
        load_packages(_signed(tmp_path, digits_cnn_onnx, "1", priv), trusted_keys=[pub], floor=floor)


def test_serve_refuses_and_counts_an_older_version(tmp_path: Path, digits_cnn_onnx: Path, key: tuple[Any, Any],
                                                   serve: Callable[..., ServerThread]) -> None:
    priv, _ = key
    pub_path = tmp_path / "ops.pub"
    floor = tmp_path / "floor.json"
    floor.write_text(json.dumps({"digits": "2"}))
    models = tmp_path / "models"
    models.mkdir()
    old = _signed(tmp_path, digits_cnn_onnx, "1", priv)
    old.rename(models / "digits-1")
    server = serve(models, trusted_keys=(pub_path,), version_floor=floor)
    assert list(server.service.repository) == []
    assert metric_value(server.metrics_text, "tierkit_model_loads_total", outcome="refused") == 1


def test_serve_flags_reach_the_config(tmp_path: Path) -> None:
    import argparse

    from cloud_service.cli import add_parser, build_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--models", str(tmp_path), "--mqtt", "mqtt://127.0.0.1:1883",
                              "--mqtt-device-inflight", "4", "--mqtt-device-rate", "5",
                              "--version-floor", str(tmp_path / "floor.json")])
    config = build_config(args, {})
    assert config.mqtt is not None
    assert (config.mqtt.device_max_inflight, config.mqtt.device_rate_per_s) == (4, 5.0)
    assert config.version_floor == tmp_path / "floor.json"
