"""`compile_model`: a model in, a variant set out (one verified package per rung that keeps accuracy).

The flow:

```
model (ONNX file | torch module + example inputs | torch.export program)
  -> fp32 reference ONNX (+ a pruned, recovered copy when prune= is given)
  -> data checked against the model's inputs; reference outputs on validation and calibration data
  -> for each rung of the target (precision, runtime, passes): build, validate, repair or reject
  -> time the survivors interleaved on the build host, per declared batch size
  -> recommend the fastest at the default batch size that is no slower than fp32
  -> write one package per variant (optionally signed) and the index (ladder.py)
```

Example:
    >>> vs = compile_model("digits.onnx", output="out/digits", target="x86-avx512",
    ...                    calibration="calib.npz", validation="val.npz", max_drop=1.0)
    >>> vs.recommended.id
    'int8-ort-static'
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from compilers.calibration import LABELS, CalibrationData, sample_axes
from compilers.fidelity import DEFAULT_MAX_SLICE_ERROR, Guard
from compilers.ladder import Ladder
from compilers.maps import DEFAULT_MIN_MAP_IOU
from compilers.package import sha256_file
from compilers.recipes import PruneConfig, Target, get_target
from compilers.sequence import DEFAULT_DECODER, DEFAULT_MIN_ROWS_UNCHANGED, check_decoder
from compilers.signing import load_private_key
from compilers.variants import VariantSet, is_variant_set
from runtimes.errors import ConfigError
from runtimes.spec import Precision, Task, TensorSpec

logger = logging.getLogger(__name__)

_TORCH_SUFFIXES = (".pt2",)
# Seconds one rung's repair may search. Each attempt is a build and a validation: about 3 to 10 s for
# OpenVINO (no re-calibration), and up to 50 s for onnxruntime's static QDQ of the 10 MB OCR recognizer
# on a loaded 2-core host, whose repair never came near the guard (16 % -> 27 % of lines unchanged).
DEFAULT_REPAIR_BUDGET = 60.0


@dataclass
class Source:
    """The fp32 reference: its ONNX file, specs, and the torch model it came from (if any)."""

    onnx: Path
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    kind: str
    torch_model: Any = None
    example_inputs: Any = None
    sha256: str = ""
    record: dict[str, Any] = field(default_factory=dict)


def compile_model(model: Any, *, output: str | Path, target: str | Target | Path = "auto",
                  precisions: Sequence[str] | str | None = None, calibration: Any = None,
                  validation: Any = None, example_inputs: Any = None, max_drop: float = 1.0,
                  min_cosine: float | None = None, max_slice_error: float = DEFAULT_MAX_SLICE_ERROR,
                  metric: Any = None, max_metric_drop: float = 0.01, prune: float | PruneConfig | None = None,
                  sign_key: Ed25519PrivateKey | str | Path | None = None, name: str | None = None,
                  version: str = "1", batch_sizes: Sequence[int] = (1,), task: str | None = None,
                  strict: bool = False, progress: bool = True, threads: int | None = None,
                  decoder: str | None = None, min_rows_unchanged: float = DEFAULT_MIN_ROWS_UNCHANGED,
                  max_char_error: float | None = None, min_map_iou: float = DEFAULT_MIN_MAP_IOU,
                  max_time: float | None = None,
                  repair_all: bool = False, repair_budget: float | None = DEFAULT_REPAIR_BUDGET) -> VariantSet:
    """Compile `model` into a ladder of variants for `target`, each checked against the fp32 reference.

    Args:
        model: an ONNX file path, a `.pt2` torch.export file, a torch `nn.Module` (give
            `example_inputs`), or a `torch.export.ExportedProgram`.
        output: the variant set directory (created; an existing variant set there is replaced).
        target: a target name (see `compilers.recipes.target_names()`), "auto", a `Target`, or a
            `.json`/`.yaml` target file.
        precisions: which precisions to build ("fp32", "fp16", "bf16", "int8"), as a sequence or
            "fp32,int8"; default fp32, bf16 (built only where the hardware computes it natively) and int8.
        calibration: calibration data: `.npz` path, dict of arrays, array or iterable (see
            `CalibrationData`); `labels` optional. With neither calibration nor validation data, fp32
            variants are built and checked on generated inputs (the manifest says so) and int8 is skipped.
        validation: held-out data for the accuracy guard (default: 20% of the calibration data).
        example_inputs: example inputs of a torch module (a tensor, tuple or dict).
        max_drop: accuracy points a classifier may lose (or disagree on, without labels).
        min_cosine: least mean cosine to the reference (embeddings default to 0.99).
        max_slice_error: most RMS error of any slice of any output relative to its own RMS (see
            `compilers.fidelity.measure_outputs`): a small-valued part of an output cannot die unseen.
        metric: a function `(outputs: dict[str, ndarray], labels | None) -> float`, higher is better (e.g.
            mAP); each variant's value may fall at most `max_metric_drop` below the reference's.
        max_metric_drop: see `metric`, in the metric's own units.
        prune: a channel ratio or `PruneConfig`: also build pruned, recovered variants (torch only).
        sign_key: an Ed25519 private key (or its PEM path) to sign every package.
        name: model name (default: the file stem or class name).
        version: model version recorded in every manifest.
        batch_sizes: batch sizes to time; the first is the default the recommendation is made for.
        task: "classification", "embedding", "regression", "sequence" or "segmentation" (default:
            inferred; an `[N, T, C]` output of per-step probabilities is a sequence, an `[N, C, H, W]` map a
            segmentation).
        decoder: how a sequence output is read ("ctc-greedy", the default, or "argmax"; see
            `compilers.sequence`); giving one makes the task a sequence.
        min_rows_unchanged: sequences: least share of validation rows whose decoded sequence must equal
            the reference's (default 0.99).
        max_char_error: sequences: most character error rate against the reference (default: unbounded
            beyond `min_rows_unchanged`).
        min_map_iou: segmentation maps: least IoU of the regions against the fp32 reference's, on every
            validation image (`compilers.maps`).
        max_time: seconds the rung search may take: once spent (and one rung kept), the rungs not yet
            built are refused ("cut short"), repair searches stop, and the best rung found so far is
            recommended; timing and writing follow.
        repair_all: repair every rung that fails the guard; by default one whose first build runs
            below 0.9x fp32's speed here at every timed batch size is refused unrepaired (a repair keeps
            more layers in fp32, so it could only be slower, and a rung slower than fp32 is never recommended).
        repair_budget: seconds one rung's repair search may take (default 60; None: no bound but
            `max_time`). The search keeps 1, 2, 4, ... of the most sensitive ops in fp32, each attempt one
            build and validation; once the budget is spent it stops, and a rung that still fails is refused
            with the attempts it made.
        strict: raise `FidelityError` as soon as a variant fails the guard after repair.
        progress: show a progress bar on stderr.
        threads: intra-op threads for validation and timing (default: all cores).

    Returns:
        The written `VariantSet`, cheapest first, exactly one entry recommended.

    Raises:
        ConfigError: an unknown target or precision, or data that does not fit the model.
        BackendUnavailable: no runtime of the target is installed.
        FidelityError: strict mode and a variant out of limits, or no variant within limits.
        CompileError: the reference could not be built or run.
    """
    spec = get_target(target)
    if precisions is None or precisions == "auto":
        rungs = spec.rungs_for(None)
        wanted = list(dict.fromkeys(r.precision for r in rungs))
    else:
        asked = [p.strip() for p in precisions.split(",")] if isinstance(precisions, str) else list(precisions)
        wanted = [Precision.parse(p).value for p in asked if p]
        rungs = spec.rungs_for(wanted)
    guard = Guard(max_drop=max_drop, min_cosine=min_cosine, max_slice_error=max_slice_error,
                  max_metric_drop=max_metric_drop, min_rows_unchanged=min_rows_unchanged,
                  max_char_error=max_char_error, min_map_iou=min_map_iou)
    if decoder is not None:
        check_decoder(decoder)
        task = task or Task.SEQUENCE.value
    for label, seconds in (("max_time", max_time), ("repair_budget", repair_budget)):
        if seconds is not None and seconds <= 0:
            msg = f"{label} {seconds!r} must be a number of seconds > 0"
            raise ConfigError(msg)
    if metric is not None and not callable(metric):
        metric = load_metric(str(metric))
    sizes = _batch_sizes(batch_sizes)
    prune_config = PruneConfig(float(prune)) if isinstance(prune, int | float) else prune
    key = load_private_key(sign_key) if isinstance(sign_key, str | Path) else sign_key
    if task is not None and task not in {t.value for t in Task}:
        msg = f"task {task!r} is not one of {', '.join(t.value for t in Task)}"
        raise ConfigError(msg)
    out = _prepare_output(Path(output))
    with tempfile.TemporaryDirectory(prefix="tierkit-compile-") as tmp:
        work = Path(tmp)
        source = _load_source(model, example_inputs, work, task,
                              _data_names(calibration) or _data_names(validation))
        if prune_config is not None and source.kind != "torch":
            msg = (f"prune= needs the model as a torch nn.Module (with example_inputs); a {source.kind} model "
                   "cannot be pruned")
            raise ConfigError(msg)
        calib, val = _data(calibration, validation, source.inputs)
        _check_batch_axis(source.inputs, sizes)
        ladder = Ladder(source=source, target=spec, rungs=rungs, calibration=calib, validation=val, guard=guard,
                        task=task, batch_sizes=sizes, threads=threads or os.cpu_count() or 1, work=work,
                        strict=strict, progress=progress, prune=prune_config, metric=metric,
                        generated_data=calib.origin == GENERATED_ORIGIN, decoder=decoder or DEFAULT_DECODER,
                        max_time=max_time, repair_all=repair_all, repair_budget=repair_budget)
        arguments = {"precisions": wanted, "max_drop": max_drop, "min_cosine": min_cosine, "batch_sizes": list(sizes),
                     "task": task, "strict": strict, "prune": prune_config.to_json() if prune_config else None,
                     "target": spec.name, "decoder": decoder, "max_time": max_time,
                     "repair_all": repair_all, "repair_budget": repair_budget}
        return ladder.run(out, name=name or _default_name(model), version=version, sign_key=key,
                          arguments=arguments)


def load_metric(spec: str) -> Any:
    """Import a user metric named `package.module:function`."""
    import importlib

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        msg = f"metric {spec!r} must be 'package.module:function'"
        raise ConfigError(msg)
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        msg = f"cannot import metric {spec!r}: {exc}"
        raise ConfigError(msg) from None
    if not callable(fn):
        msg = f"metric {spec!r} is not callable"
        raise ConfigError(msg)
    return fn


def _batch_sizes(batch_sizes: Iterable[int]) -> tuple[int, ...]:
    sizes = tuple(dict.fromkeys(int(b) for b in batch_sizes))
    if not sizes or any(b < 1 for b in sizes):
        msg = f"batch_sizes {list(batch_sizes)!r} must be a non-empty list of integers >= 1"
        raise ConfigError(msg)
    return sizes


def _prepare_output(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        msg = f"output {str(out)!r} is a file; give a directory for the variant set"
        raise ConfigError(msg)
    if out.is_dir() and any(out.iterdir()):
        if not is_variant_set(out):
            msg = f"output {str(out)!r} exists and is not a variant set; give an empty or new directory"
            raise ConfigError(msg)
        VariantSet.load(out)  # replaced only once the new set is built (report.write)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _default_name(model: Any) -> str:
    if isinstance(model, str | Path):
        return Path(model).stem
    return type(model).__name__.lower()


def _data(calibration: Any, validation: Any, specs: Sequence[TensorSpec]) -> tuple[CalibrationData, CalibrationData]:
    names = [s.name for s in specs]
    if calibration is None and validation is None:
        logger.warning("no calibration or validation data: checking fp32 variants on %d generated inputs; give "
                       "calibration= (an .npz keyed by %s) for int8 and a real accuracy check",
                       GENERATED_SAMPLES, names)
        generated = generate_inputs(specs, GENERATED_SAMPLES)
        return generated, generated
    calib = CalibrationData.of(calibration, input_names=names, specs=specs) if calibration is not None else None
    val = CalibrationData.of(validation, input_names=names, specs=specs) if validation is not None else None
    if calib is not None:
        calib.check(specs, what="calibration data")
    if val is not None:
        val.check(specs, what="validation data")
    if val is None:
        assert calib is not None
        if len(calib) < 10:
            msg = f"only {len(calib)} calibration samples and no validation data: give validation= to check accuracy"
            raise ConfigError(msg)
        logger.warning("no validation data: holding out 20%% of the %d calibration samples for the guard", len(calib))
        calib, val = calib.split(0.2)
    if calib is None:
        logger.warning("no calibration data: calibrating on the validation data")
        calib = val
    return calib, val


GENERATED_SAMPLES = 32
GENERATED_ORIGIN = "generated"


def generate_inputs(specs: Sequence[TensorSpec], samples: int, *, seed: int = 0) -> CalibrationData:
    """Inputs made from the specs alone, for a compile without data: floats uniform in [0, 1) (images and
    normalised features), integers 0 (ids and flags; an int scalar such as a sample rate needs real data),
    bools False. Named axes take `samples` on the sample axis and 64 elsewhere (spatial and sequence
    axes large enough for strided convolutions)."""
    rng = np.random.default_rng(seed)
    axes = sample_axes(specs)
    arrays = {}
    for spec in specs:
        shape = tuple(d if isinstance(d, int) else (samples if i == axes[spec.name] else 64)
                      for i, d in enumerate(spec.shape))
        if np.issubdtype(np.dtype(spec.dtype), np.floating):
            arrays[spec.name] = rng.random(shape).astype(spec.dtype)
        else:
            arrays[spec.name] = np.zeros(shape, dtype=spec.dtype)
    data = CalibrationData.from_arrays(arrays, sample_axes=axes)
    data.origin = GENERATED_ORIGIN
    return data


def _check_batch_axis(specs: Sequence[TensorSpec], sizes: Sequence[int]) -> None:
    axes = sample_axes(specs)
    for spec in specs:
        axis = axes[spec.name]
        if axis is None:
            continue  # a scalar every sample shares
        fixed = spec.shape[axis]
        if isinstance(fixed, int) and any(b != fixed for b in sizes):
            msg = (f"input {spec.name!r} has a fixed batch of {fixed}, but batch_sizes {list(sizes)} were "
                   "asked for: export the model with a dynamic batch axis, or ask for that batch size only")
            raise ConfigError(msg)


def onnx_specs(path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Input and output specs of an ONNX file (initializers are not inputs; unnamed dynamic axes get names)."""
    import onnx
    from onnx import helper

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for a file that is not ONNX
        msg = f"cannot read {str(path)!r} as ONNX: {exc}"
        raise ConfigError(msg) from None
    inits = {t.name for t in model.graph.initializer}

    def spec(vi: Any) -> TensorSpec:
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
        # -1 (PP-OCR writes it), 0, "?" and unnamed axes are all dynamic: TensorSpec names them
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or -1)
                     for d in tt.shape.dim)
        return TensorSpec(vi.name, dtype, dims)

    return (tuple(spec(v) for v in model.graph.input if v.name not in inits),
            tuple(spec(v) for v in model.graph.output))


def _data_names(data: Any) -> list[str] | None:
    """Input names the data is keyed by (used to name a torch model's inputs), when it says."""
    if isinstance(data, CalibrationData):
        return list(data.inputs)
    if isinstance(data, Mapping):
        return [str(k) for k in data if k != LABELS]
    if isinstance(data, str | Path) and Path(data).is_file():
        try:
            with np.load(Path(data), allow_pickle=False) as npz:
                return [k for k in npz.files if k != LABELS]
        except (OSError, ValueError):
            return None
    return None


def _load_source(model: Any, example_inputs: Any, work: Path, task: str | None,
                 data_names: list[str] | None) -> Source:
    if isinstance(model, str | Path):
        path = Path(model)
        if not path.is_file():
            msg = f"model file {str(path)!r} does not exist"
            raise ConfigError(msg)
        if path.suffix.lower() == ".onnx":
            inputs, outputs = onnx_specs(path)
            record = {"name": "source", "kind": "onnx", "file": path.name}
            return Source(path, inputs, outputs, "onnx", sha256=sha256_file(path), record=record)
        if path.suffix.lower() not in _TORCH_SUFFIXES:
            msg = f"model {str(path)!r}: expected an .onnx file or a .pt2 torch.export program"
            raise ConfigError(msg)
        import torch

        model = torch.export.load(str(path))
    from compilers.passes import export

    output_name = {"embedding": "embedding", "regression": "output"}.get(task or "", "logits")
    onnx_path, _ = export.to_onnx(model, example_inputs, work / "reference.onnx", output_names=(output_name,),
                                  input_names=data_names)
    inputs, outputs = onnx_specs(onnx_path)
    kind = "torch.export" if type(model).__name__ == "ExportedProgram" else "torch"
    static = export.static_batch(model) if kind == "torch.export" else None
    if static is not None:
        # The program only runs at the batch size it was exported with; every variant keeps to it.
        inputs = tuple(TensorSpec(s.name, s.dtype, (static, *s.shape[1:])) for s in inputs)
        outputs = tuple(TensorSpec(s.name, s.dtype, (static, *s.shape[1:])) for s in outputs)
    return Source(onnx_path, inputs, outputs, kind, torch_model=model, example_inputs=example_inputs,
                  sha256=sha256_file(onnx_path), record={"name": "export_onnx", "kind": kind, "exporter": "torchscript",
                                                     "opset": 17})
