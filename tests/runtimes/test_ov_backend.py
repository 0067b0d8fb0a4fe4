"""OpenVINO specifics: compile options, devices, and the checks OpenVINO itself skips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtimes import BackendUnavailable, ConfigError, InputError, SessionOptions, open_session
from runtimes.errors import PackageError

pytest.importorskip("openvino")


def test_threads_and_hint_reach_the_compiled_model(digits_cnn_ir: Path) -> None:
    options = SessionOptions(intra_op_threads=1, performance_hint="THROUGHPUT")
    with open_session(digits_cnn_ir, options=options) as s:
        assert s.get_property("INFERENCE_NUM_THREADS") == 1
        assert str(s.get_property("PERFORMANCE_HINT")) == "THROUGHPUT"
        assert s.device == "CPU"


@pytest.mark.parametrize("pinning", [True, False])
def test_cpu_pinning_reaches_the_compiled_model_and_its_fixed_shape_copies(digits_cnn_ir: Path, pinning: bool) -> None:
    with open_session(digits_cnn_ir, options=SessionOptions(cpu_pinning=pinning, static_shapes=1)) as s:
        assert s.get_property("ENABLE_CPU_PINNING") is pinning
        s.run({"x": np.zeros((1, 1, 8, 8), np.float32)})
        copy = s._static[((1, 1, 8, 8),)]
        assert copy is not None
        assert copy.request.get_compiled_model().get_property("ENABLE_CPU_PINNING") is pinning


def test_float64_is_refused_not_converted(digits_cnn_ir: Path) -> None:
    # OpenVINO alone would cast float64 to float32 silently.
    with open_session(digits_cnn_ir) as s, pytest.raises(InputError, match="dtype float64"):
        s.run({"x": np.zeros((1, 1, 8, 8))})


def test_missing_input_is_refused_not_reused(digits_cnn_ir: Path) -> None:
    # OpenVINO alone would run on the tensor left over from the previous call.
    with open_session(digits_cnn_ir) as s:
        s.run({"x": np.ones((2, 1, 8, 8), np.float32)})
        with pytest.raises(InputError, match="missing input 'x'"):
            s.run({})


def test_absent_device_is_backend_unavailable(digits_cnn_ir: Path) -> None:
    with pytest.raises(BackendUnavailable, match="'NPU' is not available here"):
        open_session(digits_cnn_ir, options=SessionOptions(device="NPU"))


def test_cuda_device_is_a_config_error(digits_cnn_ir: Path) -> None:
    with pytest.raises(ConfigError, match="does not run on CUDA"):
        open_session(digits_cnn_ir, options=SessionOptions(device="cuda:0"))


def test_unreadable_ir_is_a_package_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.xml"
    bad.write_text("<net>")
    with pytest.raises(PackageError, match=r"broken\.xml"):
        open_session(bad)


def test_other_suffix_is_a_config_error(digits_cnn_pt2: Path) -> None:
    with pytest.raises(ConfigError, match=r"OpenVINO reads \['.xml', '.onnx'\]"):
        open_session(digits_cnn_pt2, backend="openvino")


def test_last_latency_is_openvinos_own_time_of_the_request_that_ran(digits_cnn_ir: Path) -> None:
    # The part of a call inside OpenVINO's C++ request (what benchmark_app reports): the fixed-shape copy's
    # for a shape it has, the dynamic model's for one past the budget; never more than the call's wall time.
    import time

    x = np.zeros((3, 1, 8, 8), np.float32)
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=1)) as s:
        assert s.last_latency_ms is None
        for n in (1, 3, 1):
            t0 = time.perf_counter()
            s.run({"x": x[:n]})
            wall_ms = (time.perf_counter() - t0) * 1e3
            assert s.last_latency_ms is not None
            assert 0 < s.last_latency_ms <= wall_ms
            assert s._last is (s._generic if n == 3 else s._static[((1, 1, 8, 8),)])


def test_each_new_shape_gets_a_fixed_shape_copy_within_the_budget(digits_cnn_ir: Path) -> None:
    # The digits CNN has a dynamic batch: the first two batch sizes get fixed-shape copies, a third runs
    # the dynamic model; every one computes the same logits as the dynamic model.
    x = np.random.default_rng(0).normal(size=(4, 1, 8, 8)).astype(np.float32)
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=0)) as plain:
        want = {n: plain.run({"x": x[:n]})["logits"] for n in (1, 2, 4)}
        assert plain.static_shapes == ()
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=2)) as s:
        for n in (1, 2, 1, 4, 2):
            np.testing.assert_allclose(s.run({"x": x[:n]})["logits"], want[n], rtol=1e-5, atol=1e-5)
        assert s.static_shapes == ({"x": (1, 1, 8, 8)}, {"x": (2, 1, 8, 8)})


def test_a_shape_the_model_cannot_take_is_refused_and_spends_no_budget(digits_cnn_ir: Path) -> None:
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=1)) as s:
        with pytest.raises(InputError):
            s.run({"x": np.zeros((1, 1, 9, 8), np.float32)})
        s.run({"x": np.zeros((3, 1, 8, 8), np.float32)})
        assert s.static_shapes == ({"x": (3, 1, 8, 8)},)


def test_negative_static_shapes_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="static_shapes must be >= 0"):
        SessionOptions(static_shapes=-1)


def _inputs(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 1, 8, 8)).astype(np.float32)


@pytest.fixture(params=["copied", "shared"])
def input_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    # new arrays are copied into the fixed-shape request's own buffers up to COPY_IN_BYTES; above it they are shared
    if request.param == "shared":
        monkeypatch.setattr("runtimes.ov_request.COPY_IN_BYTES", 0)
    return str(request.param)


def test_fixed_shape_outputs_outlive_the_next_call_and_shape_changes(digits_cnn_ir: Path, input_mode: str) -> None:
    # The fixed-shape request reuses its output buffers: what a call returned must not change when the next
    # call (of the same or another shape) overwrites them, and each shape keeps its own buffers.
    xs = {(n, seed): _inputs(n, seed) for n in (1, 3) for seed in (0, 1)}
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=0)) as plain:
        want = {k: plain.run({"x": x})["logits"] for k, x in xs.items()}
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=2)) as s:
        got = {k: s.run({"x": xs[k]})["logits"] for k in [(1, 0), (3, 0), (1, 1), (3, 1)]}
        for k, value in got.items():
            np.testing.assert_allclose(value, want[k], rtol=1e-5, atol=1e-5)
        assert s.static_shapes == ({"x": (1, 1, 8, 8)}, {"x": (3, 1, 8, 8)})
        assert s._static[((1, 1, 8, 8),)].copy_in is (input_mode == "copied")  # type: ignore[attr-defined, union-attr]


def test_non_contiguous_and_read_only_inputs_run_as_their_contiguous_copy(digits_cnn_ir: Path,
                                                                          input_mode: str) -> None:
    x = _inputs(2, 3)
    strided = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # same values, F-ordered axes
    assert not strided.flags.c_contiguous
    frozen = x.copy()
    frozen.flags.writeable = False
    with open_session(digits_cnn_ir) as s:
        want = s.run({"x": x})["logits"]
        np.testing.assert_array_equal(s.run({"x": strided})["logits"], want)
        np.testing.assert_array_equal(s.run({"x": frozen})["logits"], want)
        np.testing.assert_array_equal(x, _inputs(2, 3))  # the caller's array is left as it was


def test_an_array_refilled_in_place_between_calls_is_read_anew(digits_cnn_ir: Path, input_mode: str) -> None:
    # A shared input stays pointed at the caller's array while the caller passes that same array: a call must
    # read what it holds now, not what it held at the call that pointed the request at it.
    xs = [_inputs(1, seed) for seed in range(3)]
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=0)) as plain:
        want = [plain.run({"x": x})["logits"] for x in xs]
    buffer = np.empty((1, 1, 8, 8), np.float32)
    with open_session(digits_cnn_ir) as s:
        for i in (0, 1, 2, 0):
            buffer[...] = xs[i]
            np.testing.assert_allclose(s.run({"x": buffer})["logits"], want[i], rtol=1e-5, atol=1e-5)
        other = xs[1].copy()
        np.testing.assert_allclose(s.run({"x": other})["logits"], want[1], rtol=1e-5, atol=1e-5)
        other[...] = xs[2]  # no longer the array of the last call but one: its old contents must not come back
        np.testing.assert_allclose(s.run({"x": buffer})["logits"], want[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(s.run({"x": other})["logits"], want[2], rtol=1e-5, atol=1e-5)


def test_a_strided_array_refilled_in_place_is_read_anew(digits_cnn_ir: Path, input_mode: str) -> None:
    # A non-contiguous array is shared as a copy made for the call: passing the same array object again after
    # changing it must not run the stale copy.
    xs = [_inputs(1, seed) for seed in (4, 5)]
    base = np.zeros((1, 1, 8, 16), np.float32)
    strided = base[..., ::2]
    with open_session(digits_cnn_ir) as s:
        want = [s.run({"x": x})["logits"] for x in xs]
        for i in (0, 1, 0):
            strided[...] = xs[i]
            np.testing.assert_allclose(s.run({"x": strided})["logits"], want[i], rtol=1e-6, atol=1e-6)


def test_concurrent_calls_each_get_their_own_result(digits_cnn_ir: Path, input_mode: str) -> None:
    # One session shared by threads: the lock keeps each call's copy-in, run and copy-out together.
    import threading

    xs = [_inputs(1, seed) for seed in range(4)]
    with open_session(digits_cnn_ir) as s:
        want = [s.run({"x": x})["logits"] for x in xs]
        wrong: list[int] = []

        def worker(i: int) -> None:
            for _ in range(30):
                if not np.array_equal(s.run({"x": xs[i]})["logits"], want[i]):
                    wrong.append(i)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
    assert wrong == []


def test_a_fixed_shape_model_runs_its_shape_and_refuses_another(digits_cnn_ir: Path, tmp_path: Path) -> None:
    ov = pytest.importorskip("openvino")
    model = ov.Core().read_model(str(digits_cnn_ir))
    model.reshape({"x": ov.PartialShape([2, 1, 8, 8])})
    fixed = tmp_path / "digits_b2.xml"
    ov.save_model(model, str(fixed), compress_to_fp16=False)
    x = _inputs(2, 5)
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=0)) as plain:
        want = plain.run({"x": x})["logits"]
    with open_session(fixed) as s:
        assert s._fixed is not None  # type: ignore[attr-defined]
        np.testing.assert_allclose(s.run({"x": x})["logits"], want, rtol=1e-5, atol=1e-5)
        with pytest.raises(InputError, match="'x'"):
            s.run({"x": _inputs(1, 5)})
        np.testing.assert_allclose(s.run({"x": x})["logits"], want, rtol=1e-5, atol=1e-5)


def test_calls_of_one_shape_take_the_short_path_and_return_arrays_the_next_call_leaves_alone(
        digits_cnn_ir: Path, input_mode: str) -> None:
    # A one-input model called again with the last call's shape and dtype skips the general checks: its results
    # must still be the caller's to keep, and a shape change must leave the short path for the new shape.
    xs = [_inputs(1, seed) for seed in range(3)] + [_inputs(2, 3)]
    with open_session(digits_cnn_ir, options=SessionOptions(static_shapes=0)) as plain:
        want = [plain.run({"x": x})["logits"] for x in xs]
    with open_session(digits_cnn_ir) as s:
        got = [s.run({"x": x})["logits"] for x in xs[:3]]
        assert s._fast is not None  # type: ignore[attr-defined]
        for value, expected in zip(got, want, strict=False):
            np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(s.run({"x": xs[3]})["logits"], want[3], rtol=1e-5, atol=1e-5)
        assert s._fast[1] == (2, 1, 8, 8)  # type: ignore[attr-defined]
        np.testing.assert_allclose(s.run({"x": xs[0]})["logits"], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("inputs", "match"), [
    ({"x": np.zeros((1, 1, 8, 8))}, "dtype float64"),
    ({"x": np.zeros((1, 1, 8, 8), np.float32), "y": np.zeros(1, np.float32)}, "'y'"),
    ({"x": np.zeros((1, 1, 8, 8), np.float32).tolist()}, "'x'"),
    ({}, "missing input 'x'"),
])
def test_bad_input_after_a_good_call_is_refused_by_name(digits_cnn_ir: Path, inputs: dict[str, object],
                                                        match: str) -> None:
    # The short path taken after a good call must not let a wrong dtype, an extra input or a non-array through.
    good = _inputs(1, 7)
    with open_session(digits_cnn_ir) as s:
        want = s.run({"x": good})["logits"]
        with pytest.raises(InputError, match=match):
            s.run(inputs)  # type: ignore[arg-type]
        np.testing.assert_array_equal(s.run({"x": good})["logits"], want)


def test_latency_sessions_are_not_pinned_unless_asked(digits_cnn_ir: Path) -> None:
    # OpenVINO pins by default; tierkit's LATENCY sessions run unpinned (SessionOptions.cpu_pinning says why).
    with open_session(digits_cnn_ir) as s:
        assert s.get_property("ENABLE_CPU_PINNING") is False
        s.run({"x": np.zeros((1, 1, 8, 8), np.float32)})
        copy = s._static[((1, 1, 8, 8),)]  # type: ignore[attr-defined]
        assert copy.request.get_compiled_model().get_property("ENABLE_CPU_PINNING") is False
