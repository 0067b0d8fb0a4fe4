"""torch specifics: the .io.json sidecar, TorchScript without one, thread settings."""

from __future__ import annotations

import shutil
import threading
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


def test_ieee_fp32_is_held_while_any_call_runs_and_then_restored() -> None:
    # the flags are plain process settings, so this runs without a GPU; the GPU half is in test_gpu.py
    from runtimes import torch_backend as tb

    before = tb._read_precision()
    tf32 = ("tf32", "tf32") if tb._fp32_knobs() else (True, True)
    tb._write_precision(tf32)
    try:
        inside, release = threading.Event(), threading.Event()
        seen: list[tuple[object, ...]] = []

        def overlapping() -> None:
            with tb._ieee_fp32():
                inside.set()
                release.wait(5)
                seen.append(tb._read_precision())

        worker = threading.Thread(target=overlapping)
        worker.start()
        assert inside.wait(5)
        with tb._ieee_fp32():
            ieee = tb._read_precision()
        assert tb._read_precision() == ieee, "the first call to end must not restore under a call still running"
        release.set()
        worker.join(5)
        assert ieee == (("ieee", "ieee") if tb._fp32_knobs() else (False, False))
        assert seen == [ieee]
        assert tb._read_precision() == tf32
    finally:
        tb._write_precision(before)


def test_traced_convolutions_lose_their_tf32_flag(digits_cnn_ts: Path, digits: zoo.Split) -> None:
    # torch.jit.trace writes cuDNN's TF32 flag (on by default) into every convolution as a constant
    from runtimes import torch_backend as tb

    module = torch.jit.load(str(digits_cnn_ts)).eval()
    graph = module.inlined_graph  # a copy: held, or its nodes die with it
    traced = [list(n.inputs())[-1].toIValue() for n in graph.findAllNodes("aten::_convolution")]
    assert traced
    assert all(traced)
    exact = tb._exact_convolutions(module)
    assert [list(n.inputs())[-1].toIValue() for n in exact.graph.findAllNodes("aten::_convolution")] == \
        [False] * len(traced)
    x = torch.from_numpy(digits.x_test[:16])
    with torch.inference_mode():
        np.testing.assert_allclose(exact(x).numpy(), module(x).numpy(), atol=1e-5)  # freezing folds constants
