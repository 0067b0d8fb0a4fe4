"""The MQTT bridge forwarding to a real Triton Inference Server (PyTriton's `tritonserver`), slow.

Needs a Python with `nvidia-pytriton` and onnxruntime in a virtual environment of its own (its pins
conflict with tierkit's), named by TIERKIT_PYTRITON_PYTHON:

    python3.11 -m venv /tmp/pytriton-venv && /tmp/pytriton-venv/bin/pip install nvidia-pytriton onnxruntime
    TIERKIT_PYTRITON_PYTHON=/tmp/pytriton-venv/bin/python pytest -m slow tests/e2e/test_forward_triton.py -s
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cloud_service.protocol import decode_outputs, encode_request, topics
from edge_agent.transports import Transport, open_transport
from runtimes.errors import EscalationError
from testkit.pytriton_path import SERVER_SCRIPT
from testkit.waiting import wait_for

pytestmark = pytest.mark.slow

CONCURRENCY = 32
_SEQ = itertools.count(1)  # unique across rounds: a repeated seq would be answered from the bridge's cache


@pytest.fixture
def triton(digits_cnn_onnx: Path, tmp_path: Path) -> Iterator[str]:
    python = os.environ.get("TIERKIT_PYTRITON_PYTHON", "")
    if not python or not Path(python).exists():
        pytest.skip("set TIERKIT_PYTRITON_PYTHON to a Python with nvidia-pytriton (see the module docstring)")
    env = dict(os.environ)
    libdir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, sysconfig.get_config_var("LIBDIR"),
                                                  env.get("LD_LIBRARY_PATH", "")) if p)
    log = tmp_path / "triton.log"
    # the server's output goes to a file: a pipe nobody reads once it is ready would fill and stall Triton
    with log.open("w") as out:
        proc = subprocess.Popen([python, str(SERVER_SCRIPT), str(digits_cnn_onnx), "digits", "1"], stdout=out,
                                stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)

    def ready() -> bool:  # the server's own log lines share the file and may run into ours: search, not split
        return re.search(r"(?m)^ready", log.read_text(errors="replace")) is not None

    with contextlib.suppress(AssertionError):  # the failure below shows the log
        wait_for("PyTriton's server to be ready or to exit", lambda: ready() or proc.poll() is not None,
                 timeout=180, interval=0.2)
    found = re.search(r"grpc (127\.0\.0\.1:\d+)\s", log.read_text(errors="replace"))
    address = found.group(1) if found else ""
    if not address or not ready():
        proc.kill()
        pytest.fail(f"PyTriton's server did not become ready:\n{log.read_text(errors='replace')[-2000:]}")
    try:
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # PyTriton, its tritonserver and the Python backend's stub
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
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


@pytest.fixture
def bridge(triton: str, broker, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """`tierkit serve --mqtt ... --forward grpc://TRITON` in its own process, as an operator runs it
    (with `--forward-mode` from an indirect parameter, else the default)."""
    log = tmp_path / "bridge.log"
    mode = getattr(request, "param", None)
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sdk.cli", "serve", "--mqtt", broker.url, "--forward",
                                 f"grpc://{triton}", "--mqtt-client-id", "bridge-triton",
                                 *(["--forward-mode", mode] if mode else [])],
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    with contextlib.suppress(AssertionError):  # the failure below shows the log
        wait_for("tierkit serve --forward to be ready or to exit",
                 lambda: "ready" in log.read_text().splitlines() or proc.poll() is not None, timeout=60, interval=0.2)
    if "ready" not in log.read_text().splitlines():
        proc.kill()
        pytest.fail(f"tierkit serve --forward did not start:\n{log.read_text()[-2000:]}")
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("bridge", ["unary", "stream"], indirect=True)
def test_mqtt_answers_through_the_bridge_equal_triton_direct(triton: str, bridge: None, digits,  # type: ignore[no-untyped-def]
                                                             broker) -> None:
    x = np.ascontiguousarray(digits.x_test[:8])

    async def main() -> None:
        async with open_transport(f"grpc://{triton}/digits", device_id="cam-1") as direct, \
                open_transport(f"{broker.url}/digits", device_id="cam-2", boot_id="b") as device:
            for i in range(len(x)):
                want = decode_outputs(await direct.escalate(encode_request("digits", {"x": x[i:i + 1]}), timeout_s=10))
                got = decode_outputs(await device.escalate(
                    encode_request("digits", {"x": x[i:i + 1]}, parameters={topics.PARAM_SEQ: next(_SEQ)}),
                    timeout_s=10))
                np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
            # Triton's own error for one request, among others in flight (on a stream: matched to its
            # request, then asked again by a unary call for the status)
            answers = await asyncio.gather(
                device.escalate(encode_request("nope", {"x": x[:1]}), timeout_s=10),
                *(device.escalate(encode_request("digits", {"x": x[i:i + 1]},
                                                 parameters={topics.PARAM_SEQ: next(_SEQ)}), timeout_s=10)
                  for i in range(4)), return_exceptions=True)
            assert isinstance(answers[0], EscalationError)
            assert answers[0].code == "NOT_FOUND"
            assert all(not isinstance(a, BaseException) for a in answers[1:]), answers

    asyncio.run(main())


@pytest.mark.xfail(reason="0.40x measured on 2 shared cores, where a bare paho -> gRPC relay with no tierkit code "
                          "reaches 0.45x (unary) and 0.49x (one stream) in the same run: the MQTT path costs ~3.1 ms "
                          "of CPU an answer against ~1.3 ms direct (bench/bench_forward.py)",
                   strict=False)
def test_bridge_throughput_at_concurrency_32_is_near_direct_grpc(triton: str, bridge: None, digits,  # type: ignore[no-untyped-def]
                                                                 broker) -> None:
    x = np.ascontiguousarray(digits.x_test[:1])
    rates: dict[str, float] = {}

    async def main() -> None:
        async with open_transport(f"grpc://{triton}/digits", device_id="cam-1") as direct, \
                open_transport(f"{broker.url}/digits", device_id="cam-2", boot_id="b") as device:
            for rnd in range(2):  # alternate, so that drift on a shared host hits both alike
                rates[f"direct{rnd}"] = await _throughput(direct, x, 4.0)
                rates[f"bridge{rnd}"] = await _throughput(device, x, 4.0)

    asyncio.run(main())
    direct_rate = (rates["direct0"] + rates["direct1"]) / 2
    bridge_rate = (rates["bridge0"] + rates["bridge1"]) / 2
    print(f"\nconcurrency {CONCURRENCY}: direct gRPC to Triton {direct_rate:.0f}/s, MQTT through the bridge "
          f"{bridge_rate:.0f}/s, ratio {bridge_rate / direct_rate:.2f}")
    assert bridge_rate >= 0.9 * direct_rate
