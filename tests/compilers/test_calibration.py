"""CalibrationData: the forms data comes in, and the checks against the model's inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from compilers.calibration import CalibrationData, sample_axes
from runtimes.errors import ConfigError
from runtimes.spec import TensorSpec

SPECS = (TensorSpec("x", "float32", ("batch", 1, 8, 8)),)


def test_npz_with_labels(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((5, 1, 8, 8), np.float64), labels=np.arange(5))
    data = CalibrationData(path)
    data.check(SPECS)
    assert len(data) == 5
    assert data.inputs["x"].dtype == np.float32  # cast to the model's dtype
    np.testing.assert_array_equal(data.labels, np.arange(5))
    assert data.digest() == CalibrationData.from_arrays(data.inputs, data.labels).digest()


def test_iterable_of_single_samples_and_pairs() -> None:
    items = [(np.full((1, 8, 8), i, np.float32), i % 3) for i in range(7)]
    data = CalibrationData(items, input_names=["x"])
    data.check(SPECS)  # items without the batch axis are stacked
    assert data.inputs["x"].shape == (7, 1, 8, 8)
    np.testing.assert_array_equal(data.labels, [0, 1, 2, 0, 1, 2, 0])


def test_iterable_of_batches_with_transform() -> None:
    raw = [np.ones((4, 64), np.float32) * i for i in range(3)]
    data = CalibrationData(raw, lambda a: {"x": a.reshape(-1, 1, 8, 8)}, input_names=["x"])
    data.check(SPECS)
    assert data.inputs["x"].shape == (12, 1, 8, 8)
    assert data.labels is None


def test_split_subset_batch() -> None:
    data = CalibrationData({"x": np.arange(10, dtype=np.float32).reshape(10, 1), "labels": np.arange(10)})
    a, b = data.split(0.2)
    assert (len(a), len(b)) == (8, 2)
    assert sorted(np.concatenate([a.labels, b.labels]).tolist()) == list(range(10))
    assert len(data.subset(3)) == 3
    assert data.batch(25)["x"].shape == (25, 1)  # repeated for timing
    assert [len(b["x"]) for b in data.batches(4)] == [4, 4, 2]


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        CalibrationData(tmp_path / "none.npz")
    with pytest.raises(ConfigError, match="different numbers of samples"):
        CalibrationData({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ConfigError, match="the model takes 2 inputs"):
        CalibrationData(np.zeros((3, 2)), input_names=["a", "b"])
    data = CalibrationData({"x": np.zeros((3, 1, 8, 8), np.complex64)})
    with pytest.raises(ConfigError, match="dtype complex64, the model takes float32"):
        data.check(SPECS)
    with pytest.raises(ConfigError, match=r"holds arrays \['y'\] the model does not take"):
        CalibrationData({"x": np.zeros((3, 1, 8, 8)), "y": np.zeros((3, 1))}).check(SPECS)


def test_state_and_scalar_inputs_batch_along_their_own_axes() -> None:
    specs = [TensorSpec("input", "float32", (-1, 512)), TensorSpec("state", "float32", (2, "?", 128)),
             TensorSpec("sr", "int64", ())]
    axes = sample_axes(specs)
    assert axes == {"input": 0, "state": 1, "sr": None}
    rng = np.random.default_rng(0)
    x = rng.random((10, 512), np.float32)
    state = np.stack([np.full((2, 128), i, np.float32) for i in range(10)], axis=1)
    data = CalibrationData({"input": x, "state": state, "sr": np.array(16000)}, input_names=["input", "state", "sr"],
                           sample_axes=axes)
    data.check(specs)
    assert len(data) == 10
    batches = list(data.batches(4))
    assert [b["state"].shape for b in batches] == [(2, 4, 128), (2, 4, 128), (2, 2, 128)]
    assert all(b["sr"].shape == () and int(b["sr"]) == 16000 for b in batches)
    np.testing.assert_array_equal(batches[1]["state"][0, :, 0], [4, 5, 6, 7])  # samples stay aligned
    np.testing.assert_array_equal(batches[1]["input"], x[4:8])
    cal, val = data.split(0.3)
    assert len(cal) + len(val) == 10
    assert val.inputs["sr"].shape == ()
    assert data.batch(12)["state"].shape == (2, 12, 128)
