"""onnxruntime specifics: thread options, execution-provider choice and the silent-fallback warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from runtimes import ConfigError, SessionOptions, open_session
from runtimes.errors import PackageError

pytest.importorskip("onnxruntime")  # the extra may be missing; a broken runtimes.ort_backend must fail, not skip
from runtimes import ort_backend

CPU, CUDA, TRT, OV = ("CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider",
                      "OpenVINOExecutionProvider")


def test_thread_counts_reach_onnxruntime(digits_cnn_onnx: Path) -> None:
    with open_session(digits_cnn_onnx, options=SessionOptions(intra_op_threads=1, inter_op_threads=2)) as s:
        assert s.session_options.intra_op_num_threads == 1
        assert s.session_options.inter_op_num_threads == 2
        assert s.providers == (CPU,)


@pytest.mark.parametrize(("device", "available", "expected"), [
    ("cpu", [TRT, CUDA, CPU], [CPU]),
    ("gpu", [TRT, CUDA, CPU], [(TRT, {"device_id": "0"}), (CUDA, {"device_id": "0"}), CPU]),
    ("cuda:1", [CUDA, CPU], [(CUDA, {"device_id": "1"}), CPU]),
    ("gpu", ["AzureExecutionProvider", CPU], [CPU]),
    ("NPU", [OV, CPU], [(OV, {"device_type": "NPU"}), CPU]),
])
def test_providers_follow_device_and_availability(device: str, available: list[str], expected: list[object]) -> None:
    assert ort_backend.select_providers(SessionOptions(device=device), available) == expected


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
