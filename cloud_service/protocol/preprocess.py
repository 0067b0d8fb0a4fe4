"""A package's declared preprocessing: how a model input is made from a raw uint8 frame.

The manifest's optional `preprocess` field holds it as JSON, e.g. for an ImageNet classifier:

    {"layout": "NCHW", "size": [224, 224], "resize": "bilinear", "scale": 0.00392156862745098,
     "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}

`apply` turns a `[N,] H, W, C` uint8 frame into the model's float32 input: resize to `size`
(nearest, or bilinear with half-pixel centres and no antialiasing, as OpenCV's INTER_LINEAR),
multiply by `scale`, subtract `mean`, divide by `std` (per channel), and transpose to `layout`.
The edge and the cloud run this same function, so an escalated frame becomes the same input the
edge's own variant saw.

Example:
    >>> pre = Preprocess.from_json({"size": [224, 224], "scale": 1 / 255})
    >>> x = pre.apply(frame)            # (480, 640, 3) uint8 -> (1, 3, 224, 224) float32
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cloud_service.protocol.codec import CodecError

__all__ = ["Preprocess"]

_LAYOUTS = ("NCHW", "NHWC")
_RESIZES = ("bilinear", "nearest")


@dataclass(frozen=True, slots=True)
class Preprocess:
    """Declared frame -> input preprocessing (see the module docstring for the JSON form).

    Args:
        size: (height, width) of the model input; None keeps the frame's size.
        resize: "bilinear" or "nearest".
        scale: multiplies the uint8 values first (1/255 maps them to [0, 1]).
        mean, std: per channel (or one value for all), applied after `scale`.
        layout: "NCHW" or "NHWC" of the model input.
    """

    size: tuple[int, int] | None = None
    resize: str = "bilinear"
    scale: float = 1.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    layout: str = "NCHW"

    def __post_init__(self) -> None:
        if self.size is not None and (len(self.size) != 2 or min(self.size) < 1):
            msg = f"preprocess size must be [height, width] of positive ints, got {list(self.size)}"
            raise CodecError(msg)
        if self.resize not in _RESIZES:
            msg = f"preprocess resize {self.resize!r} is not one of {list(_RESIZES)}"
            raise CodecError(msg)
        if self.layout not in _LAYOUTS:
            msg = f"preprocess layout {self.layout!r} is not one of {list(_LAYOUTS)}"
            raise CodecError(msg)
        if not self.mean or not self.std or any(s == 0 for s in self.std):
            msg = f"preprocess mean {list(self.mean)} and std {list(self.std)} must be non-empty, std non-zero"
            raise CodecError(msg)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Preprocess:
        """Parse the manifest's `preprocess` object; raises `CodecError` naming the bad field."""
        known = {"size", "resize", "scale", "mean", "std", "layout"}
        unknown = sorted(set(doc) - known)
        if unknown:
            msg = f"preprocess has unknown fields {unknown}; expected some of {sorted(known)}"
            raise CodecError(msg)
        try:
            size = doc.get("size")
            return cls(size=(int(size[0]), int(size[1])) if size is not None else None,
                       resize=str(doc.get("resize", "bilinear")), scale=float(doc.get("scale", 1.0)),
                       mean=_floats(doc.get("mean", 0.0)), std=_floats(doc.get("std", 1.0)),
                       layout=str(doc.get("layout", "NCHW")))
        except CodecError:
            raise
        except (TypeError, ValueError, IndexError) as exc:
            msg = f"preprocess {dict(doc)!r} is malformed ({exc})"
            raise CodecError(msg) from None

    def apply(self, frame: np.ndarray) -> np.ndarray:
        """`[N,] H, W, C` uint8 -> the model's float32 input in `layout`, with a batch axis."""
        frame = np.asarray(frame)
        if frame.dtype != np.uint8 or frame.ndim not in (3, 4):
            msg = f"a frame is a [N,] H, W, C uint8 array, got {frame.dtype.name} of shape {list(frame.shape)}"
            raise CodecError(msg)
        batch = frame if frame.ndim == 4 else frame[None]
        channels = batch.shape[3]
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, channels):
                msg = f"preprocess {name} has {len(values)} values for a frame of {channels} channels"
                raise CodecError(msg)
        x = batch.astype(np.float32)
        if self.size is not None and tuple(x.shape[1:3]) != self.size:
            x = _resize(x, self.size, self.resize)
        x *= np.float32(self.scale)
        x -= np.asarray(self.mean, dtype=np.float32)
        x /= np.asarray(self.std, dtype=np.float32)
        if self.layout == "NCHW":
            x = x.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(x)


def _floats(value: Any) -> tuple[float, ...]:
    if isinstance(value, int | float):
        return (float(value),)
    return tuple(float(v) for v in value)


def _axis_weights(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Half-pixel-centre source indices and weights along one axis (OpenCV INTER_LINEAR)."""
    src = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
    src = np.clip(src, 0, n_in - 1)
    lo = np.floor(src).astype(np.intp)
    hi = np.minimum(lo + 1, n_in - 1)
    return lo, hi, (src - lo).astype(np.float32)


def _resize(x: np.ndarray, size: tuple[int, int], how: str) -> np.ndarray:
    h, w = x.shape[1:3]
    out_h, out_w = size
    if how == "nearest":
        rows = np.minimum((np.arange(out_h) * h) // out_h, h - 1)
        cols = np.minimum((np.arange(out_w) * w) // out_w, w - 1)
        nearest: np.ndarray = x[:, rows][:, :, cols]
        return nearest
    r0, r1, rw = _axis_weights(h, out_h)
    c0, c1, cw = _axis_weights(w, out_w)
    rows = x[:, r0] * (1 - rw)[None, :, None, None] + x[:, r1] * rw[None, :, None, None]
    out: np.ndarray = rows[:, :, c0] * (1 - cw)[None, None, :, None] + rows[:, :, c1] * cw[None, None, :, None]
    return out
