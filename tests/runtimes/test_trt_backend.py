"""TensorRT on a real NVIDIA GPU: build an engine from the digits ONNX export, run it, compare.

Skipped where `tensorrt` is not installed or no GPU is visible.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtimes import InputError, SessionOptions, open_session
from testkit import zoo

pytestmark = [pytest.mark.gpu, pytest.mark.tensorrt]

trt = pytest.importorskip("tensorrt")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("TensorRT tests need a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def digits_cnn_engine(digits_cnn_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An fp32 engine (TF32 off) with a batch profile 1..64, built from the ONNX export."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(digits_cnn_onnx.read_bytes()), [parser.get_error(i) for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    config.clear_flag(trt.BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 1, 8, 8), (8, 1, 8, 8), (64, 1, 8, 8))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    assert serialized is not None
    path = tmp_path_factory.mktemp("trt") / "digits_cnn.engine"
    path.write_bytes(bytes(serialized))
    return path


@pytest.mark.parametrize("batch", [1, 64])
def test_engine_matches_torch(digits_cnn_engine: Path, digits: zoo.Split, digits_cnn_reference: np.ndarray,
                              batch: int) -> None:
    with open_session(digits_cnn_engine, options=SessionOptions(device="cuda:0")) as s:
        assert s.backend == "tensorrt"
        assert s.inputs[0].shape == ("batch", 1, 8, 8)
        assert s.outputs[0].shape == ("batch", 10)
        out = s.run({"x": np.ascontiguousarray(digits.x_test[:batch])})["logits"]
    np.testing.assert_allclose(out, digits_cnn_reference[:batch], atol=1e-3, rtol=1e-3)


def test_batch_outside_the_profile_says_so(digits_cnn_engine: Path) -> None:
    with open_session(digits_cnn_engine) as s, pytest.raises(InputError, match="outside the engine's optimization"):
        s.run({"x": np.zeros((65, 1, 8, 8), np.float32)})


def test_bad_dtype_names_the_input(digits_cnn_engine: Path) -> None:
    with open_session(digits_cnn_engine) as s, pytest.raises(InputError, match="input 'x': dtype float64"):
        s.run({"x": np.zeros((1, 1, 8, 8))})
