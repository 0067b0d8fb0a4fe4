"""TensorRT engines: the optimization profile logic here; engine builds only where TensorRT and a GPU exist."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from compilers.calibration import CalibrationData
from compilers.passes.trt_engine import shape_profiles
from runtimes.spec import TensorSpec


def test_profile_spans_every_declared_batch_size() -> None:
    specs = (TensorSpec("input_ids", "int64", ("batch", "sequence")), TensorSpec("x", "float32", ("batch", 3, 8)))
    data = CalibrationData({"input_ids": np.zeros((10, 128), np.int64), "x": np.zeros((10, 3, 8), np.float32)})
    profiles = shape_profiles(specs, data, (8, 1, 64))
    assert profiles["input_ids"] == ((1, 128), (8, 128), (64, 128))
    assert profiles["x"] == ((1, 3, 8), (8, 3, 8), (64, 3, 8))
    override = shape_profiles(specs, data, (1,), {"input_ids": [[1, 16], [4, 64], [32, 256]]})
    assert override["input_ids"] == ((1, 16), (4, 64), (32, 256))


@pytest.mark.tensorrt
@pytest.mark.gpu
def test_tensorrt_ladder_builds_engines(digits_cnn_onnx: Path, digits_calibration: dict[str, np.ndarray],
                                        digits_validation: dict[str, np.ndarray], tmp_path: Path) -> None:
    pytest.importorskip("tensorrt")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from compilers import compile_model

    vs = compile_model(digits_cnn_onnx, output=tmp_path / "trt", target="nvidia-tensorrt",
                       precisions=("fp32", "fp16", "int8"), calibration=digits_calibration,
                       validation=digits_validation, batch_sizes=(1, 64), progress=False)
    assert {"fp32-trt", "fp16-trt", "int8-trt"} <= {e.id for e in vs}
    int8 = vs.open("int8-trt")
    assert (int8.directory / "model.calib").is_file()
    record = next(p for p in int8.manifest.passes if p["name"] == "tensorrt_engine")
    assert record["profiles"]["x"] == [[1, 1, 8, 8], [1, 1, 8, 8], [64, 1, 8, 8]]
    for entry in vs:
        assert entry.fidelity["drop_points"] <= 1.0
