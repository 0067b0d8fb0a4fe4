"""What keeps a rung's validation cheap without changing its verdict: outputs compared in blocks, calls sized by
bytes, a sequence validation stopped once its guard cannot pass, identical artifacts and shared passes not redone."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from compilers import PassSpec, Rung, Target, compile_model, fidelity
from compilers.fidelity import Guard, measure, measure_outputs
from compilers.ladder import REUSED_NOTE
from compilers.sequence import decode
from compilers.validation import SequenceStop, eval_batch, run_validation


def test_blocked_comparison_equals_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    ref = rng.random((37, 6, 50), dtype=np.float32)
    ref /= ref.sum(axis=2, keepdims=True)
    out = ref + rng.normal(0, 1e-3, ref.shape).astype(np.float32)
    out[5, 2] = 0.0  # one step of one row lost: the slice along axis 1 sees it
    state = rng.normal(size=(2, 37, 8)).astype(np.float32)
    refs, outs = {"p": ref, "state": state}, {"p": out, "state": state * 1.05}
    whole = measure(ref, out, None, task="sequence"), measure_outputs(refs, outs, sample_axes={"state": 1})
    monkeypatch.setattr(fidelity, "_BLOCK", 301)  # one row (300 values) a block
    blocked = measure(ref, out, None, task="sequence"), measure_outputs(refs, outs, sample_axes={"state": 1})
    assert blocked[0] == pytest.approx(whole[0], rel=1e-12)
    assert blocked[1][0] == pytest.approx(whole[1][0], rel=1e-12)
    assert blocked[1][1] == whole[1][1] == "p[axis 1 = 2]"
    bad = out.copy()
    bad[30, 0, 0] = np.nan  # in a later block
    assert measure_outputs({"p": ref}, {"p": bad})[0]["max_rel_error"] == float("inf")


def test_validation_calls_are_sized_by_bytes() -> None:
    recognizer_line = 3 * 48 * 320 * 4 + 40 * 6625 * 4  # input and per-step probabilities of one text line
    assert eval_batch(recognizer_line) == 8
    assert eval_batch(28 * 28 * 4 + 10 * 4) == 64  # a digit and its logits
    assert eval_batch(100 << 20) == 1
    assert eval_batch(0) == 64


class _Replay:
    """A runner that returns prepared outputs batch after batch, and counts the calls."""

    def __init__(self, outputs: np.ndarray) -> None:
        self.outputs, self.calls, self.at = outputs, 0, 0

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(inputs["x"])
        self.calls += 1
        self.at += n
        return {"p": self.outputs[self.at - n:self.at]}

    def close(self) -> None:
        pass


def _paths(rows: int, rng: np.random.Generator) -> np.ndarray:
    out = np.full((rows, 10, 5), 0.01, np.float32)
    for i in range(rows):
        out[i, np.arange(10), rng.integers(0, 5, 10)] = 0.96
    return out


def test_a_sequence_validation_stops_once_the_guard_cannot_pass() -> None:
    """100 rows at >= 99 % unchanged allow 1 changed row: 2 changed in the first batch end the run there; 1 changed
    in all runs every row."""
    rng = np.random.default_rng(1)
    ref = _paths(100, rng)
    batches = [{"x": np.zeros((8, 1), np.float32)} for _ in range(12)] + [{"x": np.zeros((4, 1), np.float32)}]
    allowed = int(np.floor((1 - 0.99) * 100 + 1e-9))
    bad = ref.copy()
    bad[[2, 5]] = np.roll(bad[[2, 5]], 1, axis=2)  # every step of two rows moved to the next symbol
    runner = _Replay(bad)
    run = run_validation(runner, batches, {}, primary="p", stop=SequenceStop(decode(ref), allowed, "ctc-greedy"))
    assert run.stopped
    assert run.samples == 8
    assert runner.calls == 1
    assert run.outputs["p"].shape == (8, 10, 5)
    assert "stopped after 8 rows: 2 decoded rows changed, more than the 1" in run.note
    fid = measure(ref[:8], run.outputs["p"], None, task="sequence")
    assert not Guard().check(fid, "sequence").passed  # the verdict on the rows run is the verdict on all
    assert not Guard().check(measure(ref, bad, None, task="sequence"), "sequence").passed

    one = ref.copy()
    one[50] = np.roll(one[50], 1, axis=1)
    runner = _Replay(one)
    run = run_validation(runner, batches, {}, primary="p", stop=SequenceStop(decode(ref), allowed, "ctc-greedy"))
    assert not run.stopped
    assert run.samples == 100
    assert runner.calls == 13
    assert Guard().check(measure(ref, run.outputs["p"], None, task="sequence"), "sequence").passed


def test_identical_artifacts_are_not_rerun_and_the_openvino_export_is_shared(
        digits_cnn_onnx: Path, digits_calibration: dict[str, np.ndarray], digits_validation: dict[str, np.ndarray],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("openvino")
    from compilers import ladder
    from compilers.passes import quantize_ov

    opened: list[tuple[str, str]] = []
    exports: list[Path] = []
    real_open, real_export = ladder.open_runner, quantize_ov.export

    def counting_open(artifact: Path, runtime: str, **kw: Any) -> Any:
        opened.append((Path(artifact).name, runtime))
        return real_open(artifact, runtime, **kw)

    def counting_export(artifact: Path, ctx: Any, **kw: Any) -> Any:
        exports.append(artifact)
        return real_export(artifact, ctx, **kw)

    monkeypatch.setattr(ladder, "open_runner", counting_open)
    monkeypatch.setattr(quantize_ov, "export", counting_export)
    target = Target("test-shared", ("onnxruntime", "openvino"), ("fp32", "int8"), (
        Rung("fp32", "onnxruntime"), Rung("fp32", "openvino", (PassSpec("export_openvino"),)),
        Rung("int8", "openvino", (PassSpec("export_openvino"), PassSpec("quantize_nncf", {"repair": False})))))
    vs = compile_model(digits_cnn_onnx, output=tmp_path / "vs", target=target, precisions=("fp32", "int8"),
                       calibration={"x": digits_calibration["x"][:64]}, validation=digits_validation, progress=False)
    assert len(exports) == 1, exports  # fp32-ov and int8-ov start from one export
    # the fp32-ort rung is the reference file: opened for the reference, for timing and for golden outputs,
    # never for a validation of its own
    source = digits_cnn_onnx.name
    assert opened.count((source, "onnxruntime")) <= 2, opened
    kept = {e.id for e in vs}
    assert "fp32-ort" in kept, vs.rejected
    assert {"name": "note", "text": REUSED_NOTE} in vs.open("fp32-ort").manifest.passes
    assert REUSED_NOTE not in str(vs.open("fp32-ov").manifest.passes)
    assert "fp32-ov" in kept, vs.rejected
