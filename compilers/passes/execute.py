"""Run a candidate artifact on arrays through `runtimes.open_session`.

The compiler validates and times every variant with the same sessions a device would use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from compilers.calibration import CalibrationData, sample_axes
from runtimes.errors import CompileError
from runtimes.session import SessionOptions
from runtimes.spec import TensorSpec


class Runner(Protocol):
    """What the compiler needs from a session: `run` and `close`."""

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def open_runner(artifact: Path, runtime: str, *, threads: int = 0, device: str = "cpu",
                precision: str = "fp32", static_shapes: int | None = None) -> Runner:
    """A session on `artifact` with `runtime`, `threads` intra-op threads (0 = the backend's default).

    `precision` is the variant's declared precision, pinned in the session exactly as a device pins it
    (`SessionOptions.precision`), so that validation and timing measure what will run there.
    `static_shapes` overrides `SessionOptions.static_shapes` (OpenVINO's fixed-shape copies; 0 where a
    session runs a few calls of changing shapes and a compile per shape would cost more than it saves).
    """
    from runtimes.registry import open_session

    options = SessionOptions(intra_op_threads=threads, device=device, precision=precision)
    if static_shapes is not None:
        options = replace(options, static_shapes=static_shapes)
    return open_session(artifact, backend=runtime, options=options)


def run_all(runner: Runner, batches: Any, axes: Mapping[str, int | None] | None = None) -> dict[str, np.ndarray]:
    """Run every batch of an iterable of input dicts; join each output along its sample axis.

    `axes` gives each output's sample axis (`output_axes`; 0 where it says nothing): a recurrent
    state `[layers, batch, hidden]` is joined on axis 1. An output whose axis is None does not hold
    samples (every batch gives the same one) and is taken from the first batch.
    """
    parts: dict[str, list[np.ndarray]] = {}
    for batch in batches:
        for name, value in runner.run(batch).items():
            parts.setdefault(name, []).append(np.asarray(value))
    return join_outputs(parts, axes)


def join_outputs(parts: Mapping[str, Sequence[np.ndarray]],
                 axes: Mapping[str, int | None] | None = None) -> dict[str, np.ndarray]:
    """Each output's per-batch values joined along its sample axis (`run_all`)."""
    axes = axes or {}
    out = {}
    for name, values in parts.items():
        axis = axes.get(name, 0)
        if axis is None or values[0].ndim == 0:
            out[name] = values[0]
            continue
        try:
            out[name] = np.concatenate(values, axis=axis)
        except ValueError as exc:
            shapes = [list(v.shape) for v in values]
            msg = (f"output {name!r} cannot be joined along axis {axis} across batches (shapes {shapes}): {exc}; "
                   "its sample axis is not where the compiler looked")
            raise CompileError(msg) from None
    return out


def output_axes(runner: Runner, data: CalibrationData, inputs: Sequence[TensorSpec],
                outputs: Sequence[TensorSpec]) -> dict[str, int | None]:
    """The sample axis of each output, found the way the inputs' are (`calibration.sample_axes`).

    Declared shapes are not trusted alone (Silero VAD declares its state output `[batch, ?, ?]` and
    returns `[2, batch, 128]`): where the model's batch is dynamic, it runs one and two samples and
    takes the axis that grows from 1 to 2; the declared shapes settle a tie (an output `[N, N]`) and
    decide where the batch is fixed. None for an output that does not change with the batch.
    """
    declared = _declared_output_axes(inputs, outputs)
    in_axes = sample_axes(inputs)
    first = next((s for s in inputs if in_axes.get(s.name) is not None), None)
    fixed = first is None or isinstance(first.shape[in_axes[first.name] or 0], int)
    if fixed or len(data) < 1:
        return declared
    one, two = runner.run(data.batch(1)), runner.run(data.batch(2))
    axes: dict[str, int | None] = {}
    for name, a in one.items():
        s1, s2 = np.shape(a), np.shape(two[name])
        grown = [i for i, (d1, d2) in enumerate(zip(s1, s2, strict=False)) if d1 == 1 and d2 == 2]
        if len(s1) != len(s2) or not grown:
            axes[name] = None if s1 == s2 else declared.get(name, 0)
        elif len(grown) == 1 or declared.get(name) not in grown:
            axes[name] = grown[0]
        else:
            axes[name] = declared[name]
    return axes


def _declared_output_axes(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> dict[str, int | None]:
    """Sample axes from declared shapes: the axis named like the inputs' batch axis, else 0 (None for scalars)."""
    in_axes = sample_axes(inputs)
    names = {s.shape[a] for s in inputs if (a := in_axes.get(s.name)) is not None and isinstance(s.shape[a], str)}
    axes: dict[str, int | None] = {}
    for spec in outputs:
        if not spec.shape:
            axes[spec.name] = None
            continue
        axes[spec.name] = next((i for i, d in enumerate(spec.shape) if d in names), 0)
    return axes


def samples_first(value: np.ndarray, axis: int | None) -> np.ndarray:
    """`value` with its sample axis moved to the front (unchanged when it holds no samples)."""
    if axis is None or axis == 0 or value.ndim <= axis:
        return value
    return np.moveaxis(value, axis, 0)


def take_samples(value: np.ndarray, axis: int | None, rows: int) -> np.ndarray:
    """The first `rows` samples of `value` along its sample axis, in the model's own layout."""
    if axis is None or value.ndim <= axis:
        return value
    return np.take(value, np.arange(min(rows, value.shape[axis])), axis=axis)
