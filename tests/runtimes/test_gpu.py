"""On an NVIDIA GPU: the torch backend computes fp32 as the CPU does, and NVML measures the GPU's energy.

Deselected by default (`-m gpu` runs them); each skips where torch sees no CUDA device.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from runtimes import SessionOptions, open_session, torch_backend
from runtimes.energy import NVIDIA_GPU, EnergyMeter
from testkit import zoo

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]


@pytest.mark.parametrize("fixture", ["digits_cnn_ts", "digits_cnn_pt2"])
def test_fp32_on_cuda_matches_the_cpu_reference(fixture: str, request: pytest.FixtureRequest, digits: zoo.Split,
                                                digits_cnn_reference: np.ndarray) -> None:
    # TF32 keeps 10 bits of mantissa: a convolution run in it moves these logits by ~1e-2, so an fp32
    # session that let cuDNN or cuBLAS use TF32 fails here.
    artifact: Path = request.getfixturevalue(fixture)
    with open_session(artifact, options=SessionOptions(device="cuda:0")) as s:
        got = next(iter(s.run({s.inputs[0].name: digits.x_test}).values()))
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, digits_cnn_reference, atol=1e-4, rtol=1e-4)
    assert (got.argmax(1) == digits_cnn_reference.argmax(1)).all()


def test_a_cuda_session_leaves_the_process_tf32_settings_alone(digits_cnn_ts: Path, digits: zoo.Split) -> None:
    before = torch_backend._read_precision()
    with open_session(digits_cnn_ts, options=SessionOptions(device="cuda:0")) as s:
        s.run({"x": digits.x_test[:8]})
    assert torch_backend._read_precision() == before


def test_nvml_measures_gpu_work() -> None:
    pytest.importorskip("pynvml")
    meter = EnergyMeter.auto(NVIDIA_GPU, device="cuda:0")
    try:
        assert meter.label == "measured:nvml"
        a = torch.randn(4096, 4096, device="cuda:0")
        idle_j = busy_j = 0.0
        with meter.measure() as idle:
            time.sleep(0.5)
        deadline = time.perf_counter() + 1.0
        with meter.measure() as busy:
            while time.perf_counter() < deadline:
                for _ in range(20):
                    a = (a @ a).clamp_(-1, 1)
                torch.cuda.synchronize()
        assert idle.reading is not None
        assert busy.reading is not None
        idle_j, busy_j = idle.reading.joules, busy.reading.joules
        assert busy.reading.label == "measured:nvml"
        # NVML's counter is in mJ and updates every few ms: a loaded data-centre GPU draws 100s of watts
        assert 20.0 < busy.reading.watts < 2000.0, busy.reading
        assert busy_j / busy.reading.seconds > idle_j / max(idle.reading.seconds, 1e-9)
    finally:
        meter.close()
