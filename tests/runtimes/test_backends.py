"""The same digits CNN through every CPU backend: same answers as torch, same errors for bad input."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from runtimes import InputError, Session, SessionOptions, open_session
from testkit import zoo


@dataclass(frozen=True)
class Case:
    backend: str
    fixture: str
    input: str
    output: str


CASES = [
    Case("onnxruntime", "digits_cnn_onnx", "x", "logits"),
    Case("openvino", "digits_cnn_ir", "x", "logits"),
    Case("openvino", "digits_cnn_onnx", "x", "logits"),  # ONNX read by OpenVINO when asked explicitly
    Case("torch", "digits_cnn_pt2", "input", "y0"),      # names from the program's signature
    Case("torch", "digits_cnn_ts", "x", "logits"),       # names from the .io.json sidecar
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c.backend}-{c.fixture.removeprefix('digits_cnn_')}")
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


@pytest.fixture(scope="module")
def session(case: Case, request: pytest.FixtureRequest) -> Iterator[Session]:
    artifact: Path = request.getfixturevalue(case.fixture)
    # torch's thread count is process-wide: leave it alone so that other suites keep theirs.
    options = SessionOptions() if case.backend == "torch" else SessionOptions(intra_op_threads=1)
    with open_session(artifact, backend=case.backend, options=options) as s:
        yield s


def test_matches_torch_reference(session: Session, case: Case, digits: zoo.Split,
                                 digits_cnn_reference: np.ndarray) -> None:
    logits = session.run({case.input: digits.x_test})[case.output]
    assert logits.shape == digits_cnn_reference.shape
    np.testing.assert_allclose(logits, digits_cnn_reference, atol=1e-4, rtol=1e-4)
    assert zoo.accuracy(logits, digits.y_test) > 0.95


@pytest.mark.parametrize("batch", [1, 64])
def test_dynamic_batch(session: Session, case: Case, digits: zoo.Split, digits_cnn_reference: np.ndarray,
                       batch: int) -> None:
    out = session.run({case.input: np.ascontiguousarray(digits.x_test[:batch])})
    assert list(out) == [case.output]
    np.testing.assert_allclose(out[case.output], digits_cnn_reference[:batch], atol=1e-4, rtol=1e-4)


def test_specs_name_dynamic_axes(session: Session, case: Case) -> None:
    assert session.backend == case.backend
    (inp,), (out,) = session.inputs, session.outputs
    assert (inp.name, inp.dtype, inp.shape) == (case.input, "float32", ("batch", 1, 8, 8))
    assert (out.name, out.dtype, out.shape) == (case.output, "float32", ("batch", 10))


def test_results_do_not_alias_between_calls(session: Session, case: Case, digits: zoo.Split) -> None:
    first = session.run({case.input: np.ascontiguousarray(digits.x_test[:4])})[case.output]
    kept = first.copy()
    session.run({case.input: np.ascontiguousarray(digits.x_test[4:8])})
    np.testing.assert_array_equal(first, kept)


def test_read_only_and_strided_inputs(session: Session, case: Case, digits: zoo.Split,
                                      digits_cnn_reference: np.ndarray) -> None:
    frozen = np.frombuffer(digits.x_test[:8].tobytes(), dtype=np.float32).reshape(8, 1, 8, 8)
    assert not frozen.flags.writeable
    np.testing.assert_allclose(session.run({case.input: frozen})[case.output], digits_cnn_reference[:8], atol=1e-4)
    every_other = digits.x_test[:16:2]
    np.testing.assert_allclose(session.run({case.input: every_other})[case.output],
                               digits_cnn_reference[:16:2], atol=1e-4)


def _bad_inputs(name: str) -> dict[str, tuple[dict[str, object], str]]:
    x = np.zeros((2, 1, 8, 8), np.float32)
    return {
        "wrong dtype": ({name: x.astype(np.float64)}, rf"input '{name}': dtype float64 given, float32 expected"),
        "wrong rank": ({name: np.zeros((2, 8, 8), np.float32)}, rf"input '{name}': shape \[2, 8, 8\] given"),
        "wrong size": ({name: np.zeros((2, 1, 9, 8), np.float32)}, rf"input '{name}': shape \[2, 1, 9, 8\] given"),
        "missing": ({}, rf"missing input '{name}'"),
        "unknown name": ({"nope": x}, r"unknown input\(s\) \['nope'\]"),
        "extra name": ({name: x, "extra": x}, r"unknown input\(s\) \['extra'\]"),
        "not an array": ({name: [[1.0]]}, rf"input '{name}'"),
    }


@pytest.mark.parametrize("kind", list(_bad_inputs("x")))
def test_bad_input_raises_input_error_naming_it(session: Session, case: Case, kind: str) -> None:
    feed, message = _bad_inputs(case.input)[kind]
    with pytest.raises(InputError, match=message):
        session.run(feed)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=message):
        session.run_checked(feed)  # type: ignore[arg-type]


def test_session_still_works_after_bad_input(session: Session, case: Case, digits: zoo.Split,
                                             digits_cnn_reference: np.ndarray) -> None:
    with pytest.raises(InputError):
        session.run({})
    np.testing.assert_allclose(session.run({case.input: digits.x_test[:3]})[case.output],
                               digits_cnn_reference[:3], atol=1e-4)


def test_close_is_idempotent(case: Case, request: pytest.FixtureRequest) -> None:
    s = open_session(request.getfixturevalue(case.fixture), backend=case.backend)
    with s:
        assert case.backend in repr(s)
    s.close()
