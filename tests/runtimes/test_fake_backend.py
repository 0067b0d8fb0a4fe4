"""The fake backend that the upper layers test against."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from runtimes import ConfigError, InferenceError, InputError, TensorSpec, open_session
from runtimes.errors import PackageError
from runtimes.fake_backend import FakeSession, write_fake_model

X = TensorSpec("x", "float32", ("batch", 4))
LOGITS = TensorSpec("logits", "float32", ("batch", 3))


def test_scripted_session_answers_and_counts() -> None:
    def fn(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": inputs["x"][:, :3] * 2}

    session = FakeSession(fn, [X], [LOGITS])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(session.run({"x": x})["logits"], x[:, :3] * 2)
    assert session.calls == 1
    with pytest.raises(InputError, match="input 'x': dtype float64"):
        session.run({"x": x.astype(np.float64)})
    assert session.calls == 2


def test_wrong_outputs_and_failures_are_inference_errors() -> None:
    x = {"x": np.zeros((1, 4), np.float32)}
    with pytest.raises(InferenceError, match="not the declared output 'logits'"):
        FakeSession(lambda _: {"other": np.zeros((1, 3), np.float32)}, [X], [LOGITS]).run(x)
    with pytest.raises(InferenceError, match=r"is float64\[1, 3\], declared float32"):
        FakeSession(lambda _: {"logits": np.zeros((1, 3))}, [X], [LOGITS]).run(x)

    def broken(_: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise ZeroDivisionError

    with pytest.raises(InferenceError, match="ZeroDivisionError"):
        FakeSession(broken, [X], [LOGITS]).run(x)


def test_fake_model_file_is_deterministic(tmp_path: Path) -> None:
    path = write_fake_model(tmp_path / "m.json", [X], [LOGITS], seed=3)
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    with open_session(path, backend="fake") as a, open_session(path, backend="fake") as b:
        assert (a.inputs, a.outputs, a.backend) == ((X,), (LOGITS,), "fake")
        ya, yb = a.run({"x": x})["logits"], b.run({"x": x})["logits"]
    np.testing.assert_array_equal(ya, yb)
    assert ya.shape == (5, 3)
    assert ya.dtype == np.float32
    assert not np.allclose(ya[0], ya[1])  # depends on the input
    other = write_fake_model(tmp_path / "n.json", [X], [LOGITS], seed=4)
    with open_session(other, backend="fake") as c:
        assert not np.allclose(c.run({"x": x})["logits"], ya)


def test_fake_model_needs_fixed_feature_axes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fixed other axes"):
        write_fake_model(tmp_path / "m.json", [TensorSpec("x", "float32", ("batch", "seq"))], [LOGITS])


def test_not_a_fake_model_is_a_package_error(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('{"inputs": []}')
    with pytest.raises(PackageError, match="not a fake model"):
        open_session(path, backend="fake")


def test_delay_is_validated() -> None:
    with pytest.raises(ConfigError, match="delay_s"):
        FakeSession(lambda _: {}, [X], [LOGITS], delay_s=-1)
