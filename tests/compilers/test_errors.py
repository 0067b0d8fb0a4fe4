"""Bad inputs give a ConfigError (or BackendUnavailable) that names the problem, before any pass runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from compilers import compile_model
from runtimes.errors import BackendUnavailable, CompileError, ConfigError


def _compile(model: Path, out: Path, **kwargs) -> None:  # type: ignore[no-untyped-def]
    kwargs.setdefault("target", "x86-avx512")
    kwargs.setdefault("progress", False)
    compile_model(model, output=out, **kwargs)


def test_unknown_target(digits_cnn_onnx: Path, tmp_path: Path, digits_calibration: dict[str, np.ndarray]) -> None:
    with pytest.raises(ConfigError, match=r"unknown target 'riscv'.*x86-avx512.*auto"):
        _compile(digits_cnn_onnx, tmp_path, target="riscv", calibration=digits_calibration)


def test_unknown_precision(digits_cnn_onnx: Path, tmp_path: Path, digits_calibration: dict[str, np.ndarray]) -> None:
    with pytest.raises(ConfigError, match=r"precision 'int4' is not one of fp32, fp16, bf16, int8"):
        _compile(digits_cnn_onnx, tmp_path, precisions=("fp32", "int4"), calibration=digits_calibration)


def test_precision_the_target_does_not_build(digits_cnn_onnx: Path, tmp_path: Path,
                                             digits_calibration: dict[str, np.ndarray]) -> None:
    with pytest.raises(ConfigError, match=r"target 'torch' has no int8 variant; it builds fp32"):
        _compile(digits_cnn_onnx, tmp_path, target="torch", precisions="fp32,int8", calibration=digits_calibration)


def test_npz_missing_an_input_name(digits_cnn_onnx: Path, tmp_path: Path, digits_calibration: dict) -> None:
    bad = tmp_path / "calib.npz"
    np.savez(bad, images=digits_calibration["x"])
    with pytest.raises(ConfigError, match=r"lacks input\(s\) \['x'\]; it holds \['images'\]"):
        _compile(digits_cnn_onnx, tmp_path / "out", calibration=bad)


def test_mismatched_calibration_shape(digits_cnn_onnx: Path, tmp_path: Path) -> None:
    wrong = {"x": np.zeros((20, 1, 28, 28), np.float32)}
    expected = r"input 'x' has shape \[20, 1, 28, 28\], the model takes \['batch', 1, 8, 8\]"
    with pytest.raises(ConfigError, match=expected):
        _compile(digits_cnn_onnx, tmp_path, calibration=wrong)


def test_inputs_of_unequal_length(digits_cnn_onnx: Path, tmp_path: Path) -> None:
    data = {"x": np.zeros((20, 1, 8, 8), np.float32), "labels": np.zeros(19, np.int64)}
    with pytest.raises(ConfigError, match="'labels' holds 19 entries for 20 samples"):
        _compile(digits_cnn_onnx, tmp_path, calibration=data)


def test_int8_without_data_says_what_to_give(digits_cnn_onnx: Path, tmp_path: Path) -> None:
    # without data only fp32 can be checked (on generated inputs); int8 alone keeps nothing, and says why
    with pytest.raises(CompileError, match="int8-ort-static: int8 needs calibration data"):
        _compile(digits_cnn_onnx, tmp_path, precisions=("int8",))


def test_prune_needs_a_torch_model(digits_cnn_onnx: Path, tmp_path: Path, digits_calibration: dict) -> None:
    with pytest.raises(ConfigError, match=r"prune= needs the model as a torch nn\.Module"):
        _compile(digits_cnn_onnx, tmp_path, calibration=digits_calibration, prune=0.5)


def test_bad_prune_ratio_and_limits(digits_cnn_onnx: Path, tmp_path: Path, digits_calibration: dict) -> None:
    with pytest.raises(ConfigError, match=r"prune ratio 1.5 must be in \(0, 1\)"):
        _compile(digits_cnn_onnx, tmp_path, calibration=digits_calibration, prune=1.5)
    with pytest.raises(ConfigError, match=r"max_drop -1 must be in \[0, 100\]"):
        _compile(digits_cnn_onnx, tmp_path, calibration=digits_calibration, max_drop=-1)
    with pytest.raises(ConfigError, match="batch_sizes"):
        _compile(digits_cnn_onnx, tmp_path, calibration=digits_calibration, batch_sizes=(0,))


def test_output_that_is_not_a_variant_set(digits_cnn_onnx: Path, tmp_path: Path, digits_calibration: dict) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not a variant set"):
        _compile(digits_cnn_onnx, tmp_path, calibration=digits_calibration)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_missing_model_file(tmp_path: Path, digits_calibration: dict) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        _compile(tmp_path / "nope.onnx", tmp_path / "out", calibration=digits_calibration)


def test_tensorrt_target_without_tensorrt(digits_cnn_onnx: Path, tmp_path: Path, digits_calibration: dict) -> None:
    pytest.importorskip("sys")
    try:
        import tensorrt  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        pytest.skip("tensorrt is installed here")
    with pytest.raises(BackendUnavailable, match=r"pip install 'tierkit\[tensorrt\]'"):
        _compile(digits_cnn_onnx, tmp_path, target="nvidia-tensorrt", calibration=digits_calibration)
