"""onnxruntime specifics: thread options, execution-provider choice and the silent-fallback warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from runtimes import ConfigError, SessionOptions, open_session, ort_backend
from runtimes.errors import PackageError

CPU, CUDA, TRT, OV = ("CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider",
                      "OpenVINOExecutionProvider")


def test_thread_counts_reach_onnxruntime(digits_cnn_onnx: Path) -> None:
    with open_session(digits_cnn_onnx, options=SessionOptions(intra_op_threads=1, inter_op_threads=2)) as s:
        assert s.session_options.intra_op_num_threads == 1
        assert s.session_options.inter_op_num_threads == 2
        assert s.providers == (CPU,)


@pytest.mark.parametrize(("spin", "entry"), [(False, "0"), (True, "1")])
def test_spinning_reaches_onnxruntime(digits_cnn_onnx: Path, spin: bool, entry: str) -> None:
    with open_session(digits_cnn_onnx, options=SessionOptions(spin=spin)) as s:
        for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
            assert s.session_options.get_session_config_entry(key) == entry


def test_spinning_left_to_onnxruntime_by_default(digits_cnn_onnx: Path) -> None:
    with open_session(digits_cnn_onnx) as s, pytest.raises(RuntimeError, match="does not have configuration"):
        s.session_options.get_session_config_entry("session.intra_op.allow_spinning")


@pytest.mark.parametrize(("device", "available", "expected"), [
    ("cpu", [TRT, CUDA, CPU], [CPU]),
    ("gpu", [TRT, CUDA, CPU], [(TRT, {"device_id": "0", "trt_timing_cache_enable": "True"}),
                               (CUDA, {"device_id": "0", "use_tf32": "0"}), CPU]),
    ("cuda:1", [CUDA, CPU], [(CUDA, {"device_id": "1", "use_tf32": "0"}), CPU]),
    ("gpu", ["AzureExecutionProvider", CPU], [CPU]),
    ("NPU", [OV, CPU], [(OV, {"device_type": "NPU"}), CPU]),
])
def test_providers_follow_device_and_availability(device: str, available: list[str], expected: list[object]) -> None:
    assert ort_backend.select_providers(SessionOptions(device=device), available) == expected


def test_tensorrt_provider_gets_an_engine_cache_and_batch_profiles(digits_cnn_onnx: Path) -> None:
    options = SessionOptions(device="cuda:0", precision="fp16", max_batch=32)
    trt, cuda, cpu = ort_backend.select_providers(options, [TRT, CUDA, CPU], artifact=digits_cnn_onnx)
    assert isinstance(trt, tuple)
    assert isinstance(cuda, tuple)
    opts = trt[1]
    assert opts["trt_engine_cache_enable"] == "True"
    assert Path(opts["trt_engine_cache_path"]).parent == digits_cnn_onnx.parent
    assert opts["trt_fp16_enable"] == "True"
    assert "trt_int8_enable" not in opts
    # every batch from 1 to max_batch is inside the one profile: no engine is built on the request path
    assert opts["trt_profile_min_shapes"] == "x:1x1x8x8"
    assert opts["trt_profile_max_shapes"] == "x:32x1x8x8"
    assert cuda[1]["use_tf32"] == "0"
    assert cpu == CPU


def test_explicit_providers_keep_their_order() -> None:
    options = SessionOptions(providers=(CUDA, CPU))
    assert ort_backend.select_providers(options, [TRT, CUDA, CPU]) == [CUDA, CPU]


def test_bad_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cuda:x"):
        ort_backend.select_providers(SessionOptions(device="cuda:x"), [CPU])
    with pytest.raises(ConfigError, match="not 'cpu'"):
        ort_backend.select_providers(SessionOptions(device="tpu"), [CPU])


def test_missing_gpu_provider_falls_back_with_a_warning(digits_cnn_onnx: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    # The CPU wheel has no CUDA provider; onnxruntime itself would fall back silently.
    with caplog.at_level(logging.WARNING, logger="runtimes.ort_backend"):
        session = open_session(digits_cnn_onnx, options=SessionOptions(providers=(CUDA, CPU)))
    with session:
        assert session.providers == (CPU,)
    assert any(CUDA in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)


def test_unreadable_model_is_a_package_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(PackageError, match=r"broken\.onnx"):
        open_session(bad)
