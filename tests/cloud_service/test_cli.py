"""`tierkit serve` as operators run it: a process that prints its addresses, serves, and stops on SIGTERM."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from cloud_service.cli import add_parser, build_config
from cloud_service.protocol import encode_request
from cloud_service.protocol import inference_pb2_grpc as pbg
from runtimes.errors import ConfigError
from testkit.cloud_helpers import ServeProcess
from testkit.waiting import wait_for


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_prints_addresses_serves_and_exits_cleanly_on_sigterm(models_dir: Path) -> None:
    server = ServeProcess("--models", str(models_dir), "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0")
    try:
        assert server.addresses["models"] == "digits:1"
        with grpc.insecure_channel(server.addresses["grpc"]) as channel:
            reply = pbg.GRPCInferenceServiceStub(channel).ModelInfer(
                encode_request("digits", {"x": np.zeros((2, 1, 8, 8), np.float32)}), timeout=10)
        assert reply.outputs[0].shape == [2, 10]
        with urllib.request.urlopen(f"http://{server.addresses['metrics']}/metrics", timeout=10) as page:
            text = page.read().decode()
        assert 'tierkit_requests_total{model="digits",protocol="grpc"} 1.0' in text
        assert "tierkit_queue_depth" in text
    finally:
        code, out, err = server.stop(signal.SIGTERM)
    assert code == 0, err
    assert "stopping" in out


def test_serve_stops_on_sigint(models_dir: Path) -> None:
    server = ServeProcess("--models", str(models_dir), "--grpc", "127.0.0.1:0")
    code, _, err = server.stop(signal.SIGINT)
    assert code == 0, err


def test_a_port_in_use_is_a_clear_error(models_dir: Path) -> None:
    first = ServeProcess("--models", str(models_dir), "--grpc", "127.0.0.1:0")
    try:
        done = subprocess.run([sys.executable, "-m", "sdk.cli", "serve", "--models", str(models_dir), "--grpc",
                               first.addresses["grpc"]], check=False, capture_output=True, text=True, timeout=60)
    finally:
        first.stop()
    assert done.returncode == 1
    assert "cannot listen on" in done.stderr


def test_build_config_from_flags_environment_and_model_config(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text(
        "defaults:\n  max_queue_size: 64\nmodels:\n  digits:\n    max_batch_size: 8\n"
        "    preferred_batch_sizes: [4, 8]\n    max_queue_delay_us: 500\n    allow_non_finite: true\n")
    args = _parse("--models", str(tmp_path), "--mqtt", "mqtt://127.0.0.1:1884", "--mqtt-username", "tierkit-cloud",
                  "--max-batch-size", "16", "--model-config", str(tmp_path / "models.yaml"), "--metrics",
                  "127.0.0.1:9100", "--grpc", "127.0.0.1:8001")
    config = build_config(args, {"TIERKIT_MQTT_PASSWORD": "pw"})
    assert config.grpc_address == "127.0.0.1:8001"
    assert config.defaults.batching.max_batch_size == 16
    assert config.defaults.batching.max_queue_size == 64
    digits = config.options_for("digits")
    assert digits.batching.max_batch_size == 8
    assert digits.batching.preferred_batch_sizes == (4, 8)
    assert digits.batching.max_queue_size == 64
    assert digits.allow_non_finite
    assert config.options_for("other") == config.defaults
    assert config.mqtt is not None
    assert config.mqtt.password == "pw"
    # a broker that pins client ids to accounts (deploy/mosquitto) needs the account name as the client id
    assert config.mqtt.client_id == "tierkit-cloud"
    anonymous = build_config(_parse("--models", "m", "--mqtt", "mqtt://127.0.0.1:1884", "--grpc", "127.0.0.1:8001"), {})
    assert anonymous.mqtt is not None
    assert anonymous.mqtt.client_id.endswith("-8001")
    assert config.mqtt.session_expiry_s == 5  # outlives a broker restart; short, for shared subscriptions
    assert not build_config(_parse("--models", "m", "--no-batching"), {}).defaults.batching.max_batch_size > 1


def test_spinning_from_a_flag_and_per_model(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text("models:\n  fast:\n    spin: true\n")
    config = build_config(_parse("--models", "m", "--no-spin", "--model-config", str(tmp_path / "models.yaml")), {})
    assert config.defaults.spin is False
    assert config.options_for("fast").spin is True
    assert build_config(_parse("--models", "m"), {}).defaults.spin is None
    (tmp_path / "bad.yaml").write_text("defaults:\n  spin: 1\n")
    with pytest.raises(ConfigError, match="spin must be true, false or absent"):
        build_config(_parse("--models", "m", "--model-config", str(tmp_path / "bad.yaml")), {})


@pytest.mark.parametrize(("argv", "words"), [
    (("--grpc", "localhost"), "HOST:PORT"),
    (("--max-batch-size", "0"), "max_batch_size must be >= 1"),
    (("--preferred-batch-sizes", "64"), "preferred_batch_sizes [64]"),
    (("--grpc-cert", "x.pem"), "needs both --grpc-cert and --grpc-key"),
    (("--mqtt", "http://broker:1883"), "mqtt://HOST:PORT"),
])
def test_bad_flags_are_config_errors(argv: tuple[str, ...], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        build_config(_parse("--models", "m", *argv), {})


def test_sighup_rescans_the_models_directory(tmp_path: Path, digits_cnn_onnx: Path) -> None:
    from cloud_service.protocol import inference_pb2 as pb
    from testkit.cloud_helpers import make_package

    (tmp_path / "models").mkdir()
    server = ServeProcess("--models", str(tmp_path / "models"), "--grpc", "127.0.0.1:0")
    try:
        assert server.addresses["models"] == "none"
        make_package(tmp_path / "models" / "digits", digits_cnn_onnx)
        server.proc.send_signal(signal.SIGHUP)
        with grpc.insecure_channel(server.addresses["grpc"]) as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)
            wait_for("SIGHUP to load the new package",
                     lambda: stub.ModelReady(pb.ModelReadyRequest(name="digits"), timeout=5).ready, timeout=30)
    finally:
        code, _, err = server.stop()
    assert code == 0, err
