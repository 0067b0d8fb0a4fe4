"""The MQTT bridge forwarding to a real Triton Inference Server (PyTriton's `tritonserver`), slow.

Needs a Python with `nvidia-pytriton` and onnxruntime in a virtual environment of its own (its pins
conflict with tierkit's), named by TIERKIT_PYTRITON_PYTHON:

    python3.11 -m venv /tmp/pytriton-venv && /tmp/pytriton-venv/bin/pip install nvidia-pytriton onnxruntime
    TIERKIT_PYTRITON_PYTHON=/tmp/pytriton-venv/bin/python pytest -m slow tests/e2e/test_forward_triton.py -s
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cloud_service.config import MqttConfig, ServerConfig
from cloud_service.protocol import decode_outputs, encode_request, topics
from edge_agent.transports import Transport, open_transport
from tests.cloud_service.helpers import ServerThread

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "pytriton_server.py"
CONCURRENCY = 32
_SEQ = itertools.count(1)  # unique across rounds: a repeated seq would be answered from the bridge's cache


@pytest.fixture
def triton(digits_cnn_onnx: Path) -> Iterator[str]:
    python = os.environ.get("TIERKIT_PYTRITON_PYTHON", "")
    if not python or not Path(python).exists():
        pytest.skip("set TIERKIT_PYTRITON_PYTHON to a Python with nvidia-pytriton (see the module docstring)")
    env = dict(os.environ)
    libdir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, sysconfig.get_config_var("LIBDIR"),
                                                  env.get("LD_LIBRARY_PATH", "")) if p)
    proc = subprocess.Popen([python, str(SCRIPT), str(digits_cnn_onnx), "digits", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    address = ""
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    for line in proc.stdout:  # bounded: the process prints a few lines, then `ready` or exits
        kind, _, value = line.strip().partition(" ")
        address = value if kind == "grpc" else address
        if kind == "ready" or time.monotonic() > deadline:
            break
    if not address:
        proc.kill()
        pytest.fail("PyTriton's server did not become ready")
    try:
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def _throughput(cloud: Transport, x: np.ndarray, seconds: float) -> float:
    """Answers per second with CONCURRENCY escalations in flight for `seconds`."""
    stop = time.perf_counter() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await cloud.escalate(encode_request("digits", {"x": x}, parameters={topics.PARAM_SEQ: next(_SEQ)}),
                                 timeout_s=10)
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return done / (time.perf_counter() - started)


def test_mqtt_through_the_bridge_to_triton(triton: str, tmp_path: Path, digits_x: np.ndarray, broker) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "empty").mkdir()
    bridge = ServerThread(ServerConfig(models_dir=tmp_path / "empty", grpc_address=None, drain_timeout_s=5,
                                       forward=f"grpc://{triton}",
                                       mqtt=MqttConfig(url=broker.url, client_id="bridge-triton"))).start()
    x = digits_x[:1]
    rates: dict[str, float] = {}

    async def main() -> None:
        async with open_transport(f"grpc://{triton}/digits", device_id="cam-1") as direct, \
                open_transport(f"{broker.url}/digits", device_id="cam-2", boot_id="b") as device:
            for i in range(8):
                xi = digits_x[i:i + 1]
                want = decode_outputs(await direct.escalate(encode_request("digits", {"x": xi}), timeout_s=10))
                got = decode_outputs(await device.escalate(
                    encode_request("digits", {"x": xi}, parameters={topics.PARAM_SEQ: 10_000 + i}), timeout_s=10))
                np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
            for rnd in range(2):  # alternate, so that drift on a shared host hits both alike
                rates[f"direct{rnd}"] = await _throughput(direct, x, 4.0)
                rates[f"bridge{rnd}"] = await _throughput(device, x, 4.0)

    try:
        asyncio.run(main())
    finally:
        bridge.stop()
    direct_rate = (rates["direct0"] + rates["direct1"]) / 2
    bridge_rate = (rates["bridge0"] + rates["bridge1"]) / 2
    print(f"\nconcurrency {CONCURRENCY}: direct gRPC to Triton {direct_rate:.0f}/s, MQTT through the bridge "
          f"{bridge_rate:.0f}/s, ratio {bridge_rate / direct_rate:.2f}")
    assert bridge_rate >= 0.9 * direct_rate
