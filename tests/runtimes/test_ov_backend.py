"""OpenVINO specifics: compile options, devices, and the checks OpenVINO itself skips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtimes import BackendUnavailable, ConfigError, InputError, SessionOptions, open_session
from runtimes.errors import PackageError

pytest.importorskip("openvino")


def test_threads_and_hint_reach_the_compiled_model(digits_cnn_ir: Path) -> None:
    options = SessionOptions(intra_op_threads=1, performance_hint="THROUGHPUT")
    with open_session(digits_cnn_ir, options=options) as s:
        assert s.get_property("INFERENCE_NUM_THREADS") == 1
        assert str(s.get_property("PERFORMANCE_HINT")) == "THROUGHPUT"
        assert s.device == "CPU"


def test_float64_is_refused_not_converted(digits_cnn_ir: Path) -> None:
    # OpenVINO alone would cast float64 to float32 silently.
    with open_session(digits_cnn_ir) as s, pytest.raises(InputError, match="dtype float64"):
        s.run({"x": np.zeros((1, 1, 8, 8))})


def test_missing_input_is_refused_not_reused(digits_cnn_ir: Path) -> None:
    # OpenVINO alone would run on the tensor left over from the previous call.
    with open_session(digits_cnn_ir) as s:
        s.run({"x": np.ones((2, 1, 8, 8), np.float32)})
        with pytest.raises(InputError, match="missing input 'x'"):
            s.run({})


def test_absent_device_is_backend_unavailable(digits_cnn_ir: Path) -> None:
    with pytest.raises(BackendUnavailable, match="'NPU' is not available here"):
        open_session(digits_cnn_ir, options=SessionOptions(device="NPU"))


def test_cuda_device_is_a_config_error(digits_cnn_ir: Path) -> None:
    with pytest.raises(ConfigError, match="does not run on CUDA"):
        open_session(digits_cnn_ir, options=SessionOptions(device="cuda:0"))


def test_unreadable_ir_is_a_package_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.xml"
    bad.write_text("<net>")
    with pytest.raises(PackageError, match=r"broken\.xml"):
        open_session(bad)


def test_other_suffix_is_a_config_error(digits_cnn_pt2: Path) -> None:
    with pytest.raises(ConfigError, match=r"OpenVINO reads \['.xml', '.onnx'\]"):
        open_session(digits_cnn_pt2, backend="openvino")


def test_each_new_shape_gets_a_fixed_shape_copy_within_the_budget(digits_cnn_ir: Path) -> None:
    # The digits CNN has a dynamic batch: the first two batch sizes get fixed-shape copies, a third runs
    # the dynamic model; every one computes the same logits as the dynamic model.
    x = np.random.default_rng(0).normal(size=(4, 1, 8, 8)).astype(np.float32)
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=0)) as plain:
        want = {n: plain.run({"x": x[:n]})["logits"] for n in (1, 2, 4)}
        assert plain.static_shapes == ()
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=2)) as s:
        for n in (1, 2, 1, 4, 2):
            np.testing.assert_allclose(s.run({"x": x[:n]})["logits"], want[n], rtol=1e-5, atol=1e-5)
        assert s.static_shapes == ({"x": (1, 1, 8, 8)}, {"x": (2, 1, 8, 8)})


def test_a_shape_the_model_cannot_take_is_refused_and_spends_no_budget(digits_cnn_ir: Path) -> None:
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=1)) as s:
        with pytest.raises(InputError):
            s.run({"x": np.zeros((1, 1, 9, 8), np.float32)})
        s.run({"x": np.zeros((3, 1, 8, 8), np.float32)})
        assert s.static_shapes == ({"x": (3, 1, 8, 8)},)


def test_negative_static_shapes_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="static_shapes must be >= 0"):
        SessionOptions(static_shapes=-1)
