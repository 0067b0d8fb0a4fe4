"""Sequence outputs read through a decoder, outputs whose samples are not on axis 0, the compile's seconds
and `max_time`, and a readable variant set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compilers import VariantSet, compile_model
from compilers.calibration import CalibrationData
from compilers.fidelity import Guard, measure
from compilers.ladder import REUSED_NOTE
from compilers.passes.execute import open_runner, output_axes, run_all
from compilers.sequence import decode, edit_distance, looks_like_sequence, measure_sequences
from runtimes.errors import ConfigError
from testkit.rungs import ort_target, static_rung


def _one_hot(paths: list[list[int]], symbols: int = 5) -> np.ndarray:
    out = np.full((len(paths), len(paths[0]), symbols), 0.01, np.float32)
    for i, path in enumerate(paths):
        out[i, np.arange(len(path)), path] = 0.96
    return out


def test_greedy_ctc_collapses_repeats_and_drops_blanks() -> None:
    scores = _one_hot([[0, 1, 1, 0, 1, 2, 2, 0], [3, 3, 3, 0, 0, 4, 0, 0]])
    assert decode(scores, "ctc-greedy") == [(1, 1, 2), (3, 4)]
    assert decode(scores, "argmax")[1] == (3, 3, 3, 0, 0, 4, 0, 0)
    with pytest.raises(ConfigError, match="beam"):
        decode(scores, "beam")


def test_edit_distance() -> None:
    assert edit_distance((1, 2, 3), (1, 2, 3)) == 0
    assert edit_distance((1, 2, 3), (1, 3)) == 1
    assert edit_distance((), (4, 4)) == 2
    assert edit_distance((1, 2, 3, 4), (2, 1, 3, 5)) == 3


def test_one_flipped_step_changes_a_row_that_per_step_agreement_hides() -> None:
    """40 steps per row, one step flipped in 10 of 100 rows: 99.75 % of steps agree, 10 % of rows change."""
    rng = np.random.default_rng(0)
    paths = rng.integers(0, 5, (100, 40)).tolist()
    flipped = [list(p) for p in paths]
    for i in range(10):
        flipped[i][7] = (flipped[i][7] + 1) % 5 or 1  # never to a blank that repeats a neighbour by chance
        flipped[i][6] = flipped[i][8] = 0
        paths[i][6] = paths[i][8] = 0
    ref = _one_hot(paths)
    out = _one_hot(flipped)
    steps = float((ref.argmax(2) == out.argmax(2)).mean())
    assert steps >= 0.997
    fid = measure_sequences(ref, out)
    assert fid["sequence_rows_unchanged"] == pytest.approx(0.9)
    assert 0 < fid["char_error_rate"] < 0.01
    full = measure(ref, out, None, task="sequence")
    verdict = Guard().check(full, "sequence")
    assert not verdict.passed
    assert "decoded sequences changed on 10.0% of rows (10 of 100" in verdict.reason
    assert Guard().check(measure(ref, ref.copy(), None, task="sequence"), "sequence").passed
    assert Guard(min_rows_unchanged=0.85).check(full, "sequence").passed
    assert not Guard(min_rows_unchanged=0.85, max_char_error=0.001).check(full, "sequence").passed


def test_sequence_is_recognised_by_per_step_probabilities() -> None:
    probs = _one_hot([[0, 1, 2, 3]] * 3)
    probs /= probs.sum(axis=2, keepdims=True)
    assert looks_like_sequence(probs)
    assert not looks_like_sequence(np.random.default_rng(0).normal(size=(3, 4, 8)))  # token embeddings
    assert not looks_like_sequence(probs[:, 0])
    with pytest.raises(ConfigError, match="min_rows_unchanged"):
        Guard(min_rows_unchanged=1.5)


def _state_model(path: Path) -> Path:
    """y = x @ W ([N, 4]); state [2, N, 3] computed from x, declared [N, ?, ?] as Silero VAD declares it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    s = helper.make_tensor_value_info("state", TensorProto.FLOAT, ["batch", "a", "b"])
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(size=(2, 4, 3)).astype(np.float32), "V")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]),
             helper.make_node("MatMul", ["x", "V"], ["state"])]  # [2, N, 4] @ ... broadcast: [2, N, 3]
    model = helper.make_model(helper.make_graph(nodes, "state", [x], [y, s], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return path


def test_output_axes_come_from_running_two_batch_sizes(tmp_path: Path) -> None:
    from compilers.compile import onnx_specs

    path = _state_model(tmp_path / "state.onnx")
    inputs, outputs = onnx_specs(path)
    data = CalibrationData({"x": np.random.default_rng(1).normal(size=(10, 4)).astype(np.float32)})
    runner = open_runner(path, "onnxruntime", threads=1)
    try:
        axes = output_axes(runner, data, inputs, outputs)
        assert axes == {"y": 0, "state": 1}
        joined = run_all(runner, data.batches(4), axes)  # 4 + 4 + 2
    finally:
        runner.close()
    assert joined["y"].shape == (10, 4)
    assert joined["state"].shape == (2, 10, 3)


def test_compile_reports_seconds_and_max_time_cuts_the_search_short(digits_cnn_onnx: Path,
                                                                      digits_calibration: dict[str, np.ndarray],
                                                                      digits_validation: dict[str, np.ndarray],
                                                                      tmp_path: Path) -> None:
    target = ort_target(static_rung(), static_rung("static2", per_channel=False))
    vs = compile_model(digits_cnn_onnx, output=tmp_path / "vs", target=target, precisions=("fp32", "int8"),
                       calibration={"x": digits_calibration["x"][:64]}, validation=digits_validation,
                       max_time=1e-6, progress=False)  # spent by any reference: timing-independent
    assert [e.id for e in vs] == ["fp32-ort"]
    cut = [r for r in vs.rejected if r["stage"] == "cut short"]
    assert {r["id"] for r in cut} == {"int8-ort-static", "int8-ort-static2"}
    assert "max_time 1e-06 s" in vs.build["cut_short"]
    assert set(vs.build["seconds"]) == {"reference", "rungs", "timing", "write", "total"}
    kept = next(r for r in vs.build["report"] if r["id"] == "fp32-ort")
    assert set(kept["seconds"]) == {"build", "validate", "time"}
    # the rung's graph is the reference file itself: its validation outputs are the reference's, not rerun
    assert kept["seconds"]["validate"] >= 0
    assert {"name": "note", "text": REUSED_NOTE} in vs.open("fp32-ort").manifest.passes
    assert kept["seconds"]["time"] > 0
    assert "int8-ort-static: not built: max_time" in str(vs)
    with pytest.raises(ConfigError, match="max_time"):
        compile_model(digits_cnn_onnx, output=tmp_path / "bad", target=target, max_time=0,
                      calibration=digits_calibration)


def test_variant_set_repr_is_short_and_str_is_the_table(digits_ladder: VariantSet) -> None:
    text = repr(digits_ladder)
    assert len(text) < 300
    assert "\n" not in text
    assert f"recommended={digits_ladder.recommended.id!r}" in text
    table = str(digits_ladder)
    assert table.splitlines()[0] == text
    assert "build s" in table.splitlines()[1]
    assert all(e.id in table for e in digits_ladder)
    assert len(repr(digits_ladder.recommended)) < 120
