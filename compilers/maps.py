"""Segmentation and probability maps judged by what their user reads: the regions, per image.

A map output `[N, C, H, W]` is read as regions, not as numbers: a one-channel probability map (a text
detector's, values in [0, 1]) through a threshold, a class map (C >= 2 scores per pixel) through the
argmax. Two maps agree when their regions overlap: the intersection over union (IoU) per image,
for a one-channel map at each of `DEFAULT_MAP_THRESHOLDS` (the user's threshold is not known; DB text
detectors use 0.3, a generic mask 0.5), for a class map averaged over the classes either image holds.
An image where neither map holds a region agrees (IoU 1).

Why not the numbers: an int8 PP-OCRv4 detector moved the background's probabilities enough for a mean
cosine of 0.91-0.92 and an RMS error of 0.40-0.43 of the map's own RMS, yet kept the text regions (IoU
0.97 at 0.3 on average, 0.94 on the worst of 32 pages). A map that loses a region loses its share of
the union: one text line dropped from a page of ten measures an IoU near 0.9 on that page, below
`DEFAULT_MIN_MAP_IOU`.

Example:
    >>> fid = measure_maps(reference, outputs)
    >>> fid["map_iou_min"], fid["map_iou_mean"]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_MAP_THRESHOLDS = (0.3, 0.5)
# Every image, every threshold. PP-OCRv4's detector on 32 rendered pages: OpenVINO int8 0.940 on the worst
# page (mean 0.972), onnxruntime static int8 0.854 (mean 0.90, its text regions grown or shrunk by a tenth).
DEFAULT_MIN_MAP_IOU = 0.92
# Beside the regions, a loose numeric check on the judged map: garbage (a flat or inverted map) fails it,
# a map whose background moved (int8 PP-OCRv4: 0.92) passes.
DEFAULT_MAP_MIN_COSINE = 0.8
_MIN_SIDE = 8  # spatial sides at least this long: a [N, C, 2, 2] tensor is features, not a map
_MAX_CLASSES = 256


def looks_like_map(ref: np.ndarray) -> bool:
    """`[N, C, H, W]` with H, W >= 8 and either one channel of probabilities in [0, 1] or 2 to 256 classes."""
    if ref.ndim != 4 or min(ref.shape[2:]) < _MIN_SIDE or not np.issubdtype(ref.dtype, np.floating):
        return False
    if ref.shape[1] == 1:
        return bool(ref.size) and float(ref.min()) >= 0.0 and float(ref.max()) <= 1.0
    return bool(ref.shape[1] <= _MAX_CLASSES)


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU per image of boolean maps `[N, ...]`; 1 where both are empty."""
    n = len(a)
    inter = np.logical_and(a, b).reshape(n, -1).sum(axis=1)
    union = np.logical_or(a, b).reshape(n, -1).sum(axis=1)
    ious: np.ndarray = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    return ious


def map_ious(reference: np.ndarray, outputs: np.ndarray,
             thresholds: Sequence[float] = DEFAULT_MAP_THRESHOLDS) -> np.ndarray:
    """Per image, the worst IoU of `outputs`' regions against `reference`'s (see the module docstring)."""
    ref, out = np.asarray(reference), np.asarray(outputs)
    if ref.shape[1] == 1:
        return np.asarray(np.min([_iou(ref >= t, out >= t) for t in thresholds], axis=0))
    ref_cls, out_cls = ref.argmax(axis=1), out.argmax(axis=1)
    total, count = np.zeros(len(ref)), np.zeros(len(ref))
    for c in range(ref.shape[1]):
        a, b = ref_cls == c, out_cls == c
        held = np.logical_or(a, b).reshape(len(ref), -1).any(axis=1)
        total += np.where(held, _iou(a, b), 0.0)
        count += held
    return np.where(count > 0, total / np.maximum(count, 1), 1.0)


def measure_maps(reference: np.ndarray, outputs: np.ndarray,
                 thresholds: Sequence[float] = DEFAULT_MAP_THRESHOLDS) -> dict[str, float]:
    """`map_iou_min` and `map_iou_mean` over the images (the worst threshold per image), and the image count."""
    ious = map_ious(reference, outputs, thresholds)
    return {"map_iou_min": float(ious.min()), "map_iou_mean": float(ious.mean()), "map_images": float(len(ious))}
