"""Shared vocabulary: tensor specs, element types (`DTYPES`, the one dtype table), precisions, tasks.

A `TensorSpec` shape holds ints for fixed axes and strings for named dynamic axes
(ONNX `dim_param` style, e.g. ``("batch", 1, 8, 8)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from runtimes.errors import ConfigError, InputError


class Precision(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"

    @classmethod
    def parse(cls, value: str | Precision) -> Precision:
        try:
            return cls(str(value).lower())
        except ValueError:
            msg = f"precision {value!r} is not one of {', '.join(p.value for p in cls)}"
            raise ConfigError(msg) from None


class Task(StrEnum):
    CLASSIFICATION = "classification"
    EMBEDDING = "embedding"
    REGRESSION = "regression"
    SEQUENCE = "sequence"  # [N, T, C] per-step scores read through a decoder (compilers.sequence)
    SEGMENTATION = "segmentation"  # [N, C, H, W] maps read as regions (compilers.maps)


Dim = int | str



@dataclass(frozen=True, slots=True)
class DType:
    """One tensor element type under every name tierkit meets it by.

    Attributes:
        name: the numpy name, as `TensorSpec.dtype` holds it.
        oip: the Open Inference Protocol datatype on the wire.
        onnx: onnxruntime's type string.
        openvino: OpenVINO's element type name.
        wire: whether the wire codec carries it: numpy has the type (bfloat16 has none), so a tensor of
            it can be encoded and decoded. A model with a tensor that is not `wire` cannot be served.
    """

    name: str
    oip: str
    onnx: str
    openvino: str
    wire: bool = True


# The one dtype table: backends, the wire codec and the cloud server all read it.
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("bool", "BOOL", "tensor(bool)", "boolean"),
    DType("uint8", "UINT8", "tensor(uint8)", "u8"),
    DType("uint16", "UINT16", "tensor(uint16)", "u16"),
    DType("uint32", "UINT32", "tensor(uint32)", "u32"),
    DType("uint64", "UINT64", "tensor(uint64)", "u64"),
    DType("int8", "INT8", "tensor(int8)", "i8"),
    DType("int16", "INT16", "tensor(int16)", "i16"),
    DType("int32", "INT32", "tensor(int32)", "i32"),
    DType("int64", "INT64", "tensor(int64)", "i64"),
    DType("float16", "FP16", "tensor(float16)", "f16"),
    DType("float32", "FP32", "tensor(float)", "f32"),
    DType("float64", "FP64", "tensor(double)", "f64"),
    DType("bfloat16", "BF16", "tensor(bfloat16)", "bf16", wire=False),
)}
_DTYPES = frozenset(DTYPES)


def _dim(name: str, index: int, dim: Any) -> Dim:
    """One axis as exporters write it: an int >= 0 is fixed; -1, None, "", "?" and "-1" are dynamic and get
    the conventional name ("batch" for axis 0, else "dim<i>"); any other string is a named dynamic axis."""
    if isinstance(dim, bool) or (not isinstance(dim, int | str) and dim is not None):
        msg = f"TensorSpec {name!r}: dimension {dim!r} must be an int, -1 or a name"
        raise ConfigError(msg)
    if dim is None or (isinstance(dim, int) and dim < 0) or (isinstance(dim, str) and dim.strip() in ("", "?", "-1")):
        if isinstance(dim, int) and dim < -1:
            msg = f"TensorSpec {name!r}: dimension {dim} must be >= 0, or -1 for a dynamic axis"
            raise ConfigError(msg)
        return "batch" if index == 0 else f"dim{index}"
    return dim


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, numpy dtype name and shape of one model input or output.

    Example:
        >>> TensorSpec("x", "float32", ("batch", 64)).matches(np.zeros((3, 64), np.float32))
        True
    """

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self) -> None:
        if not self.name:
            msg = "TensorSpec needs a non-empty name"
            raise ConfigError(msg)
        if self.dtype not in _DTYPES:
            msg = f"TensorSpec {self.name!r}: dtype {self.dtype!r} is not one of {sorted(_DTYPES)}"
            raise ConfigError(msg)
        shape = tuple(_dim(self.name, i, d) for i, d in enumerate(self.shape))
        object.__setattr__(self, "shape", shape)

    @property
    def dynamic_batch(self) -> bool:
        """True when axis 0 is a named (dynamic) axis."""
        return bool(self.shape) and isinstance(self.shape[0], str)

    @property
    def oip_shape(self) -> list[int]:
        """The shape with dynamic axes as -1, the Open Inference Protocol convention."""
        return [d if isinstance(d, int) else -1 for d in self.shape]

    def matches(self, array: np.ndarray) -> bool:
        if array.dtype.name != self.dtype or array.ndim != len(self.shape):
            return False
        return all(isinstance(d, str) or d == n for d, n in zip(self.shape, array.shape, strict=True))

    def check(self, array: np.ndarray) -> None:
        """Raise `InputError` naming what is wrong with `array`."""
        if array.dtype.name != self.dtype:
            msg = f"input {self.name!r}: dtype {array.dtype.name} given, {self.dtype} expected; cast it first"
            raise InputError(msg)
        if not self.matches(array):
            msg = (f"input {self.name!r}: shape {list(array.shape)} given, {list(self.shape)} expected "
                   "(named axes may take any size)")
            raise InputError(msg)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorSpec:
        try:
            return cls(str(data["name"]), str(data["dtype"]), tuple(data["shape"]))
        except KeyError as exc:
            msg = f"tensor spec {dict(data)!r} lacks {exc.args[0]!r}"
            raise ConfigError(msg) from None


def check_inputs(specs: Sequence[TensorSpec], inputs: Mapping[str, np.ndarray]) -> None:
    """Check every declared input is present and well formed, and nothing unknown is given."""
    names = {s.name for s in specs}
    unknown = set(inputs) - names
    if unknown:
        msg = f"unknown input(s) {sorted(unknown)}; the model takes {sorted(names)}"
        raise InputError(msg)
    for spec in specs:
        if spec.name not in inputs:
            msg = f"missing input {spec.name!r}; the model takes {sorted(names)}"
            raise InputError(msg)
        spec.check(np.asarray(inputs[spec.name]))


def input_error(specs: Sequence[TensorSpec], inputs: Mapping[str, np.ndarray]) -> InputError | None:
    """The `InputError` naming what is wrong with `inputs`, or None when they match `specs`.

    Backends call it after their library rejected a call, to turn its message into one that names
    the input; a value numpy cannot even read also gives None (the caller's generic message stands).
    """
    try:
        check_inputs(specs, inputs)
    except InputError as exc:
        return exc
    except (ValueError, TypeError):
        return None
    return None
