"""torch specifics: the .io.json sidecar, TorchScript without one, thread settings."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from runtimes import BackendUnavailable, ConfigError, SessionOptions, open_session
from runtimes.errors import PackageError
from runtimes.session import io_sidecar_path, read_io_sidecar, write_io_sidecar
from testkit import zoo
from testkit.digits_specs import LOGITS_SPEC, X_SPEC

torch = pytest.importorskip("torch")


def test_sidecar_renames_a_program(digits_cnn_pt2: Path, tmp_path: Path, digits: zoo.Split,
                                   digits_cnn_reference: np.ndarray) -> None:
    artifact = Path(shutil.copy(digits_cnn_pt2, tmp_path / "named.pt2"))
    write_io_sidecar(artifact, [X_SPEC], [LOGITS_SPEC])
    assert read_io_sidecar(artifact) == ((X_SPEC,), (LOGITS_SPEC,))
    with open_session(artifact) as s:
        assert (s.inputs, s.outputs) == ((X_SPEC,), (LOGITS_SPEC,))
        np.testing.assert_allclose(s.run({"x": digits.x_test[:5]})["logits"], digits_cnn_reference[:5], atol=1e-4)


def test_sidecar_with_wrong_arity_is_refused(digits_cnn_pt2: Path, tmp_path: Path) -> None:
    artifact = Path(shutil.copy(digits_cnn_pt2, tmp_path / "two.pt2"))
    write_io_sidecar(artifact, [X_SPEC, X_SPEC], [LOGITS_SPEC])
    with pytest.raises(PackageError, match="lists 2 inputs / 1 outputs; the program has 1 / 1"):
        open_session(artifact)


def test_malformed_sidecar_is_a_package_error(digits_cnn_ts: Path, tmp_path: Path) -> None:
    artifact = Path(shutil.copy(digits_cnn_ts, tmp_path / "m.ts"))
    io_sidecar_path(artifact).write_text('{"inputs": [')
    with pytest.raises(PackageError, match=r"m\.ts\.io\.json"):
        open_session(artifact)


def test_torchscript_without_sidecar_says_what_to_write(digits_cnn_ts: Path, tmp_path: Path) -> None:
    artifact = Path(shutil.copy(digits_cnn_ts, tmp_path / "bare.pt"))
    with pytest.raises(PackageError, match=r"write 'bare\.pt\.io\.json'"):
        open_session(artifact)


def test_thread_count_is_set(digits_cnn_ts: Path) -> None:
    before = torch.get_num_threads()
    try:
        with open_session(digits_cnn_ts, options=SessionOptions(intra_op_threads=1)):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cuda_without_a_gpu_or_unknown_device(digits_cnn_ts: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        open_session(digits_cnn_ts, options=SessionOptions(device="cuda:0"))
    with pytest.raises(ConfigError, match="'NPU'"):
        open_session(digits_cnn_ts, options=SessionOptions(device="NPU"))


def test_corrupt_file_is_a_package_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.pt2"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(PackageError, match=r"broken\.pt2"):
        open_session(bad)
