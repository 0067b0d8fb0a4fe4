"""Backend lookup: names, suffixes, and the errors that say what to install."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from runtimes import BackendUnavailable, ConfigError, available_backends, backend_for, get_backend, open_session


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown backend 'tflite'; expected one of \['fake', 'onnxruntime'"):
        get_backend("tflite")


@pytest.mark.parametrize(("name", "backend"), [
    ("m.onnx", "onnxruntime"), ("m.xml", "openvino"), ("m.engine", "tensorrt"), ("m.plan", "tensorrt"),
    ("m.pt2", "torch"), ("m.pt", "torch"), ("m.TS", "torch"),
])
def test_backend_follows_the_suffix(name: str, backend: str) -> None:
    assert backend_for(name) == backend


def test_unknown_suffix_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="known artifact suffixes"):
        backend_for("model.tflite")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        open_session(tmp_path / "absent.onnx")


@pytest.mark.parametrize(("backend", "module", "library", "extra"), [
    ("openvino", "runtimes.ov_backend", "openvino", "openvino"),
    ("torch", "runtimes.torch_backend", "torch", "torch"),
])
def test_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch, backend: str, module: str,
                                         library: str, extra: str) -> None:
    # None in sys.modules makes `import <library>` fail as if it were not installed.
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, library, None)
    with pytest.raises(BackendUnavailable, match=rf"needs '{library}': pip install 'tierkit\[{extra}\]'"):
        get_backend(backend)


def test_tensorrt_absent_here_names_its_extra() -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed")
    with pytest.raises(BackendUnavailable, match=r"pip install 'tierkit\[tensorrt\]'"):
        get_backend("tensorrt")


def test_available_backends_reports_versions_without_importing() -> None:
    found = available_backends()
    assert set(found) == {"onnxruntime", "openvino", "tensorrt", "torch"}
    assert found["onnxruntime"]  # a core dependency
    assert "fake" not in found
