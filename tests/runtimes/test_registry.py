"""Backend lookup: names, suffixes, and the errors that say what to install."""

from __future__ import annotations

import importlib.util
import subprocess
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


@pytest.mark.parametrize(("backend", "modules", "library", "extra"), [
    ("openvino", ("runtimes.ov_backend", "runtimes.ov_request", "runtimes.ov_import"), "openvino", "openvino"),
    ("torch", ("runtimes.torch_backend",), "torch", "torch"),
])
def test_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch, backend: str, modules: tuple[str, ...],
                                         library: str, extra: str) -> None:
    # None in sys.modules makes `import <library>` fail as if it were not installed; the backend's modules that
    # import it are dropped from the cache so that they import it again.
    for module in modules:
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


def test_the_product_ships_no_test_double() -> None:
    assert importlib.util.find_spec("runtimes.fake_backend") is None
    assert importlib.util.find_spec("edge_agent.transports.fake") is None
    code = "import runtimes.registry as r; print(r.backend_names())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "fake" not in out  # only the test suite plugs it in


def test_a_manifest_naming_a_runtime_the_product_lacks_is_refused() -> None:
    from compilers.manifest import Manifest
    from runtimes.errors import PackageError

    doc = {"schema_version": 1, "name": "m", "version": "1", "target": "x86", "precision": "fp32",
           "runtime": "tflite", "artifact": "model.tflite",
           "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
           "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 2]}]}
    with pytest.raises(PackageError, match="runtime 'tflite', which this tierkit does not have"):
        Manifest.from_json(doc)


def test_built_in_backends_cannot_be_replaced() -> None:
    from runtimes.registry import register_backend

    with pytest.raises(ConfigError, match="built in"):
        register_backend("onnxruntime", "evil.module:Backend")
