"""Calibration and validation data: named input arrays, plus optional labels.

`CalibrationData` accepts what users have at hand, the way `nncf.Dataset(source, transform)` does:

- a path to an `.npz` file of arrays keyed by the model's input names, with an optional `labels`;
- a mapping of input name -> array (plus an optional "labels" key);
- a single array, for a model with one input;
- an iterable of items, each a mapping, an array, or an `(inputs, label)` pair; `transform`
  turns each raw item into one of those first.

Items are stacked along axis 0 (an item may hold one sample or a batch). Every array is checked
against the model's input specs before any pass runs.

Example:
    >>> data = CalibrationData("calib.npz")
    >>> data.check(specs, what="--calibration")
    >>> for batch in data.batches(32): ...
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtimes.errors import ConfigError
from runtimes.spec import TensorSpec

LABELS = "labels"


class CalibrationData:
    """Named input arrays (all with the same number of samples) and optional labels.

    Args:
        source: an `.npz` path, a mapping of arrays, one array, or an iterable of items.
        transform: applied to each item of an iterable source before it is read.
        input_names: the model's input names, used to name bare arrays and to order tuples.

    Raises:
        ConfigError: unreadable file, empty data, or arrays of unequal length.
    """

    def __init__(self, source: Any, transform: Callable[[Any], Any] | None = None, *,
                 input_names: Sequence[str] = ("x",), sample_axes: Mapping[str, int | None] | None = None) -> None:
        self.origin = str(source) if isinstance(source, str | Path) else type(source).__name__
        # Which axis of each input holds the samples: 0 unless the specs say otherwise (a recurrent state
        # [layers, batch, hidden] has them on axis 1); None for an input every sample shares (an int64 scalar
        # such as a sample rate), which is passed whole with every batch.
        self.sample_axes: dict[str, int | None] = dict(sample_axes or {})
        self._columns: dict[str, list[np.ndarray]] | None = None
        if isinstance(source, str | Path | Mapping | np.ndarray) and transform is None:
            inputs, labels = _read(source, list(input_names))
        else:
            self._columns, labels = _read_items(source, transform, list(input_names))
            inputs = _assemble(self._columns, {})
        self._set(inputs, labels)

    def _axis(self, name: str, array: np.ndarray) -> int | None:
        axis = self.sample_axes.get(name, 0)
        return None if axis is None or array.ndim == 0 or axis >= array.ndim else axis

    def _take(self, index: Any) -> dict[str, np.ndarray]:
        """Every input with `index` (a slice or an index array) applied on its sample axis."""
        out = {}
        for name, array in self.inputs.items():
            axis = self._axis(name, array)
            out[name] = array if axis is None else np.take(array, np.arange(array.shape[axis])[index], axis=axis)
        return out

    def _set(self, inputs: dict[str, np.ndarray], labels: np.ndarray | None) -> None:
        lengths = {name: a.shape[axis] for name, a in inputs.items()
                   if (axis := self._axis(name, a)) is not None}
        if not inputs or not lengths or not all(lengths.values()):
            msg = f"calibration/validation data from {self.origin} is empty: give at least one sample per input"
            raise ConfigError(msg)
        if len(set(lengths.values())) != 1:
            msg = f"inputs hold different numbers of samples {lengths}; every input needs one row per sample"
            raise ConfigError(msg)
        n = next(iter(lengths.values()))
        if labels is not None and len(labels) != n:
            msg = f"'labels' holds {len(labels)} entries for {n} samples; give one label per sample"
            raise ConfigError(msg)
        self.inputs: dict[str, np.ndarray] = inputs
        self.labels: np.ndarray | None = labels

    def __len__(self) -> int:
        return int(next(a.shape[axis] for name, a in self.inputs.items()
                        if (axis := self._axis(name, a)) is not None))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in self.inputs.items())
        return f"<CalibrationData {shapes} labels={self.labels is not None}>"

    @classmethod
    def of(cls, source: Any, *, input_names: Sequence[str],
           specs: Sequence[TensorSpec] | None = None) -> CalibrationData:
        """Return `source` itself when it is already a `CalibrationData`, else wrap it (sample axes from `specs`)."""
        if isinstance(source, CalibrationData):
            if specs is not None and not source.sample_axes:
                source.sample_axes = sample_axes(specs)
            return source
        return cls(source, input_names=input_names, sample_axes=sample_axes(specs) if specs else None)

    @classmethod
    def from_arrays(cls, inputs: Mapping[str, np.ndarray], labels: np.ndarray | None = None,
                    sample_axes: Mapping[str, int | None] | None = None) -> CalibrationData:
        data = dict(inputs)
        if labels is not None:
            data[LABELS] = labels
        return cls(data, input_names=list(inputs), sample_axes=sample_axes)

    def check(self, specs: Sequence[TensorSpec], *, what: str = "data") -> None:
        """Check names, ranks and fixed axes against the model's inputs; cast dtypes in place.

        Raises:
            ConfigError: a missing or unknown input name, or a shape the model cannot take.
        """
        names = [s.name for s in specs]
        if self._columns is not None:
            # Items of an iterable may be single samples (no batch axis) or batches: the spec's rank decides.
            ranks = {s.name: len(s.shape) for s in specs}
            self._set(_assemble(self._columns, ranks), self.labels)
            self._columns = None
        missing = [n for n in names if n not in self.inputs]
        if missing:
            msg = (f"{what} ({self.origin}) lacks input(s) {missing}; it holds {sorted(self.inputs)} and the model "
                   f"takes {names}: key the arrays by the model's input names")
            raise ConfigError(msg)
        unknown = sorted(set(self.inputs) - set(names))
        if unknown:
            msg = f"{what} ({self.origin}) holds arrays {unknown} the model does not take (inputs: {names})"
            raise ConfigError(msg)
        if not self.sample_axes:
            self.sample_axes = sample_axes(specs)
        for spec in specs:
            array = self.inputs[spec.name]
            sample_shape = tuple(spec.shape)
            axis = self._axis(spec.name, array)
            ok = array.ndim == len(sample_shape) and all(
                isinstance(d, str) or i == axis or d == n for i, (d, n) in enumerate(zip(sample_shape, array.shape,
                                                                                        strict=True)))
            if not ok:
                where = "a scalar shared by every sample" if axis is None else f"axis {axis} is the sample axis"
                msg = (f"{what} ({self.origin}): input {spec.name!r} has shape {list(array.shape)}, the model takes "
                       f"{list(spec.shape)} ({where}; named axes may take any size)")
                raise ConfigError(msg)
            if array.dtype.name != spec.dtype:
                if not np.can_cast(array.dtype, spec.dtype, casting="same_kind"):
                    msg = (f"{what} ({self.origin}): input {spec.name!r} has dtype {array.dtype.name}, "
                           f"the model takes {spec.dtype}; convert it first")
                    raise ConfigError(msg)
                self.inputs[spec.name] = array.astype(spec.dtype)

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Consecutive batches of at most `batch_size` samples."""
        for start in range(0, len(self), batch_size):
            yield self._take(slice(start, start + batch_size))

    def batch(self, size: int) -> dict[str, np.ndarray]:
        """The first `size` samples, repeated when there are fewer (for timing)."""
        return self._take(np.arange(size) % len(self))

    def subset(self, n: int) -> CalibrationData:
        """The first `n` samples (all of them when there are fewer)."""
        if n >= len(self):
            return self
        labels = None if self.labels is None else self.labels[:n]
        return CalibrationData.from_arrays(self._take(slice(0, n)), labels, self.sample_axes)

    def split(self, fraction: float, seed: int = 0) -> tuple[CalibrationData, CalibrationData]:
        """A deterministic shuffled split into (1 - fraction, fraction) parts."""
        order = np.random.default_rng(seed).permutation(len(self))
        cut = max(1, min(len(self) - 1, round(len(self) * (1 - fraction))))
        parts = []
        for idx in (np.sort(order[:cut]), np.sort(order[cut:])):
            labels = None if self.labels is None else self.labels[idx]
            parts.append(CalibrationData.from_arrays(self._take(idx), labels, self.sample_axes))
        return parts[0], parts[1]

    def digest(self) -> str:
        """sha256 over names, shapes, dtypes and bytes: recorded in the manifest to reproduce a build."""
        h = hashlib.sha256()
        items = sorted(self.inputs.items()) + ([(LABELS, self.labels)] if self.labels is not None else [])
        for name, array in items:
            h.update(f"{name}:{array.dtype.name}:{array.shape}".encode())
            h.update(np.ascontiguousarray(array).tobytes())
        return h.hexdigest()

    def save(self, path: str | Path) -> Path:
        """Write as `.npz` (the format the CLI reads)."""
        arrays: dict[str, np.ndarray] = dict(self.inputs)
        if self.labels is not None:
            arrays[LABELS] = self.labels
        np.savez(Path(path), **arrays)  # type: ignore[arg-type]
        return Path(path)


def sample_axes(specs: Sequence[TensorSpec]) -> dict[str, int | None]:
    """The sample axis of each input; None for scalars, which every sample shares.

    Axis 0 unless the first input has a dynamic batch axis and this input's axis 0 is fixed: then the
    axis named like that batch axis, else this input's first dynamic axis (a recurrent state
    `[layers, ?, hidden]`, whose dimensions exporters often leave unnamed).
    """
    first = specs[0].shape[0] if specs and specs[0].shape else None
    batch = first if isinstance(first, str) else None
    axes: dict[str, int | None] = {}
    for spec in specs:
        if not spec.shape:
            axes[spec.name] = None
        elif batch is None or isinstance(spec.shape[0], str):
            axes[spec.name] = 0
        elif batch in spec.shape[1:]:
            axes[spec.name] = spec.shape.index(batch)
        else:
            axes[spec.name] = next((i for i, d in enumerate(spec.shape) if isinstance(d, str)), 0)
    return axes


def _read(source: Any, names: list[str]) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    if isinstance(source, str | Path):
        return _read_npz(Path(source))
    if isinstance(source, Mapping):
        return _split_labels({str(k): np.asarray(v) for k, v in source.items()})
    return _bare_array(source, names), None


def _read_npz(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    if not path.is_file():
        msg = f"data file {str(path)!r} does not exist; give an .npz of arrays keyed by the model's input names"
        raise ConfigError(msg)
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        msg = f"cannot read {str(path)!r} as .npz ({exc}); save the arrays with numpy.savez"
        raise ConfigError(msg) from None
    return _split_labels(arrays)


def _split_labels(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    labels = arrays.pop(LABELS, None)
    return arrays, None if labels is None else np.asarray(labels)


def _bare_array(array: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    if len(names) != 1:
        msg = f"a bare array was given, but the model takes {len(names)} inputs {names}: key the arrays by name"
        raise ConfigError(msg)
    return {names[0]: np.asarray(array)}


def _read_items(source: Any, transform: Callable[[Any], Any] | None,
                names: list[str]) -> tuple[dict[str, list[np.ndarray]], np.ndarray | None]:
    if not isinstance(source, Iterable):
        msg = (f"cannot read calibration/validation data from a {type(source).__name__}: give an .npz path, "
               "a dict of arrays, an array or an iterable")
        raise ConfigError(msg)
    columns: dict[str, list[np.ndarray]] = {}
    labels: list[np.ndarray] = []
    for raw in source:
        item = transform(raw) if transform is not None else raw
        label = None
        if isinstance(item, tuple) and len(item) == 2:
            item, label = item
        fields = ({str(k): np.asarray(v) for k, v in item.items()} if isinstance(item, Mapping)
                  else _bare_array(np.asarray(item), names))
        if LABELS in fields:
            label = fields.pop(LABELS)
        for name, array in fields.items():
            columns.setdefault(name, []).append(array)
        if label is not None:
            labels.append(np.atleast_1d(np.asarray(label)))
    return columns, (np.concatenate(labels) if labels else None)


def _assemble(columns: dict[str, list[np.ndarray]], ranks: dict[str, int]) -> dict[str, np.ndarray]:
    inputs = {}
    for name, arrays in columns.items():
        rank = ranks.get(name)
        try:
            if rank is not None and all(a.ndim == rank - 1 for a in arrays):
                inputs[name] = np.stack(arrays)
            else:
                inputs[name] = np.concatenate([np.atleast_1d(a) for a in arrays])
        except ValueError as exc:
            msg = f"items of input {name!r} have mismatched shapes ({exc}); give every item the same shape"
            raise ConfigError(msg) from None
    return inputs
