"""The digits CNN in every format the CPU backends read, built once per test session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtimes.session import write_io_sidecar
from testkit import zoo
from testkit.digits_specs import LOGITS_SPEC, X_SPEC


@pytest.fixture(scope="session")
def digits_cnn_ir(digits_cnn_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OpenVINO IR converted from the ONNX export, with fp32 weights.

    `save_model` compresses weights to fp16 unless told not to, which moves logits by ~1e-3.
    """
    ov = pytest.importorskip("openvino")
    path = tmp_path_factory.mktemp("ir") / "digits_cnn.xml"
    ov.save_model(ov.convert_model(digits_cnn_onnx), path, compress_to_fp16=False)
    return path


@pytest.fixture(scope="session")
def digits_cnn_pt2(digits_cnn, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    """A torch.export program with a dynamic batch axis, without a sidecar."""
    torch = pytest.importorskip("torch")
    batch = torch.export.Dim("batch", min=1, max=4096)
    example = (torch.from_numpy(digits.x_test[:2]),)
    program = torch.export.export(digits_cnn, example, dynamic_shapes=({0: batch},))
    path = tmp_path_factory.mktemp("pt2") / "digits_cnn.pt2"
    torch.export.save(program, path)
    return path


@pytest.fixture(scope="session")
def digits_cnn_ts(digits_cnn, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    """A TorchScript trace with its `.io.json` sidecar naming x -> logits."""
    torch = pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("ts") / "digits_cnn.ts"
    with torch.inference_mode():
        traced = torch.jit.trace(digits_cnn, (torch.from_numpy(digits.x_test[:2]),))
    torch.jit.save(traced, str(path))
    write_io_sidecar(path, [X_SPEC], [LOGITS_SPEC])
    return path


@pytest.fixture
def x_batch(digits: zoo.Split) -> np.ndarray:
    return np.ascontiguousarray(digits.x_test[:64])
