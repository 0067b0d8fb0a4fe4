"""Compile passes: one module per pass, each a function `(artifact, ctx, **params) -> PassResult`.

Passes are looked up by name and imported only when a rung uses them, so `import compilers`
never pulls onnxruntime.quantization, openvino, nncf, tensorrt or torch.

| name              | module            | does                                                          |
| ----------------- | ----------------- | ------------------------------------------------------------- |
| fuse              | fuse.py           | onnxslim / onnxruntime offline graph optimization, kept if faster |
| fp16              | fp16.py           | fp16 weights and compute, fp32 inputs and outputs              |
| quantize_ort      | quantize_ort.py   | onnxruntime static QDQ (MinMax/Entropy/Percentile) or dynamic int8 |
| export_openvino   | quantize_ov.py    | ONNX -> OpenVINO IR (optionally f16 weights)                   |
| quantize_nncf     | quantize_ov.py    | NNCF int8, then NNCF's accuracy-controlled mode when the guard fails |
| tensorrt_engine   | trt_engine.py     | TensorRT engine (fp32/fp16/int8) with dynamic-shape profiles   |
| export_torch      | export.py         | torch.export program (.pt2)                                    |

Pruning and ONNX export act on the torch model before the rungs and live in prune.py / export.py.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compilers.calibration import CalibrationData
from compilers.fidelity import Guard, Verdict
from runtimes.errors import BackendUnavailable, CompileError
from runtimes.spec import TensorSpec

_PASSES: dict[str, str] = {
    "fuse": "compilers.passes.fuse:fuse",
    "fp16": "compilers.passes.fp16:convert",
    "quantize_ort": "compilers.passes.quantize_ort:quantize",
    "export_openvino": "compilers.passes.quantize_ov:export",
    "quantize_nncf": "compilers.passes.quantize_ov:quantize",
    "tensorrt_engine": "compilers.passes.trt_engine:build",
    "export_torch": "compilers.passes.export:to_pt2",
}


class PassSkipped(CompileError):
    """A pass does not apply to this model (e.g. dynamic int8 without MatMul); the rung is left out."""


Evaluate = Callable[[Path, str], tuple[dict[str, float], Verdict]]


@dataclass
class PassContext:
    """What every pass may read: data, reference outputs, the guard, and where to write.

    Attributes:
        workdir: a scratch directory for this rung.
        source: the fp32 ONNX model the rung starts from.
        specs: the model's input specs.
        calibration, validation: the data.
        task: classification, embedding or regression.
        guard: the accuracy limits.
        evaluate: runs an artifact on the validation data; returns (fidelity, verdict).
        threads: intra-op threads for timing and validation sessions.
        batch_sizes: declared batch sizes (TensorRT profiles, timing).
        torch_model: the torch module, when the model came as one (export_torch).
        example_inputs: the torch example inputs, when given.
        device: the device the target runs on ("cpu", "cuda", an OpenVINO device name).
        reference: the reference's first output on the validation inputs.
        outputs: the model's output specs.
        deadline: `time.monotonic()` value past which repair searches stop with what they have.
        repair_pays: (artifact, runtime) -> "" when a first low-precision build that failed the guard runs
            faster than fp32 here, else why repairing it cannot give a rung worth keeping.
        repair_budget: seconds one rung's repair search may take (None: unbounded but for `deadline`).
    """

    workdir: Path
    source: Path
    specs: tuple[TensorSpec, ...]
    calibration: CalibrationData
    validation: CalibrationData
    task: str
    guard: Guard
    evaluate: Evaluate
    threads: int = 0
    batch_sizes: tuple[int, ...] = (1,)
    torch_model: Any = None
    example_inputs: Any = None
    device: str = "cpu"
    reference: np.ndarray | None = None
    outputs: tuple[TensorSpec, ...] = field(default_factory=tuple)
    deadline: float | None = None  # time.monotonic() past which a repair search stops (compile's max_time)
    decoder: str = "ctc-greedy"  # how a sequence task's output is read (compilers.sequence)
    repair_pays: Callable[[Path, str], str] | None = None
    repair_budget: float | None = None

    def repair_deadline(self) -> float | None:
        """When a repair search that starts now must stop: its budget or the compile's deadline, the earlier."""
        budget = None if self.repair_budget is None else time.monotonic() + self.repair_budget
        ends = [d for d in (self.deadline, budget) if d is not None]
        return min(ends) if ends else None

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.outputs)


@dataclass
class PassResult:
    """The artifact a pass wrote, and a record for the manifest (name, parameters, measurements)."""

    artifact: Path
    record: dict[str, Any]


# top-level module of a missing library -> the extra that installs it
_EXTRAS = {"openvino": "openvino", "nncf": "openvino", "torch": "torch", "torch_pruning": "torch",
           "onnxscript": "torch", "tensorrt": "tensorrt", "onnxslim": "fuse"}


def run_pass(name: str, artifact: Path, ctx: PassContext, params: Mapping[str, Any]) -> PassResult:
    """Import pass `name` and run it on `artifact`.

    Raises:
        BackendUnavailable: the pass needs a library that is not installed; names the extra.
    """
    module_name, _, func = _PASSES[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in _EXTRAS:
            raise
        msg = f"pass {name!r} needs {missing!r}: pip install 'tierkit[{_EXTRAS[missing]}]'"
        raise BackendUnavailable(msg) from None
    result: PassResult = getattr(module, func)(artifact, ctx, **dict(params))
    return result


__all__ = ["PassContext", "PassResult", "PassSkipped", "run_pass"]
