"""Segmentation maps judged by their regions: a map that keeps them passes, one that loses a region does not."""

from __future__ import annotations

import numpy as np
import pytest

from compilers.fidelity import Guard, measure, measure_outputs
from compilers.maps import looks_like_map, map_ious
from runtimes.errors import ConfigError

LINES = 10


def _page(rng: np.random.Generator, n: int = 8, h: int = 96, w: int = 160) -> tuple[np.ndarray, list]:
    """Text-detector-like probability maps [n, 1, h, w]: ten line boxes near 0.9 on a background near 0.02."""
    maps = np.full((n, 1, h, w), 0.02, np.float32)
    boxes = []
    for i in range(n):
        mine = []
        for k in range(LINES):
            top, left = 4 + k * 9, int(rng.integers(2, 40))
            right = left + int(rng.integers(60, 110))
            maps[i, 0, top:top + 6, left:right] = 0.9
            mine.append((top, left, right))
        boxes.append(mine)
    return maps, boxes


def _int8_like(maps: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """What int8 did to the PP-OCRv4 detector's map: the background moved a lot, the regions held."""
    out = maps + rng.normal(0, 0.09, maps.shape).astype(np.float32) * (maps < 0.5)
    out = np.clip(out, 0, 0.25 * (maps < 0.5) + (maps >= 0.5))
    return (out * np.where(maps >= 0.5, rng.uniform(0.85, 1.05, maps.shape), 1)).astype(np.float32)


def _judge(ref: np.ndarray, out: np.ndarray, task: str) -> tuple[dict[str, float], str, bool]:
    fid = measure(ref, out, None, task=task)
    judged = "map" if task == "segmentation" else None
    numeric, where = measure_outputs({"map": ref}, {"map": out}, judged_by_task=judged)
    fid.update(numeric)
    verdict = Guard().check(fid, task, where=where)
    return fid, verdict.reason, verdict.passed


def test_a_map_that_keeps_its_regions_passes_where_the_numeric_checks_refuse_it() -> None:
    rng = np.random.default_rng(0)
    ref, _ = _page(rng)
    out = _int8_like(ref, rng)
    fid, reason, passed = _judge(ref, out, "segmentation")
    assert passed, reason
    assert fid["map_iou_min"] == 1.0
    _, reason, passed = _judge(ref, out, "embedding")  # what the guard held a map to before
    assert not passed
    assert "slice error" in reason


def test_a_map_that_loses_one_line_of_ten_is_refused() -> None:
    rng = np.random.default_rng(1)
    ref, boxes = _page(rng)
    out = _int8_like(ref, rng)
    top, left, right = boxes[3][5]
    out[3, 0, top:top + 6, left:right] = 0.1  # one text line gone on one page
    fid, reason, passed = _judge(ref, out, "segmentation")
    assert not passed
    assert "map regions moved" in reason
    assert "of 8 images" in reason
    assert 0.85 < fid["map_iou_min"] < 0.92
    assert fid["map_iou_mean"] > 0.98  # a mean over pages would have hidden it


def test_a_map_whose_regions_shrink_at_the_lower_threshold_is_refused() -> None:
    # The regions hold at 0.5 but the soft edges a DB detector grows from 0.3 are gone.
    rng = np.random.default_rng(2)
    ref, _ = _page(rng)
    inside = ref >= 0.5
    edge = ~inside & (np.roll(inside, 1, 3) | np.roll(inside, -1, 3) | np.roll(inside, 1, 2) | np.roll(inside, -1, 2))
    ref[edge] = 0.4
    out = np.where(ref == np.float32(0.4), 0.02, ref).astype(np.float32)
    assert map_ious(ref, out, (0.5,)).min() == 1.0
    _, reason, passed = _judge(ref, out, "segmentation")
    assert not passed
    assert "map regions moved" in reason


def test_a_class_map_is_read_through_its_argmax() -> None:
    rng = np.random.default_rng(3)
    labels = np.zeros((4, 32, 32), np.int64)
    labels[:, 4:20, 4:20], labels[:, 22:30, 10:30] = 1, 2
    ref = np.eye(3, dtype=np.float32)[labels].transpose(0, 3, 1, 2) * 4 + rng.normal(0, 0.3, (4, 3, 32, 32))
    kept = ref + rng.normal(0, 0.2, ref.shape)
    assert _judge(ref.astype(np.float32), kept.astype(np.float32), "segmentation")[2]
    lost = kept.copy()
    lost[1, 2] -= 8.0  # class 2 gone on image 1
    fid, _, passed = _judge(ref.astype(np.float32), lost.astype(np.float32), "segmentation")
    assert not passed
    assert fid["map_iou_min"] < 0.7


def test_garbage_with_the_regions_right_fails_the_loose_numeric_check() -> None:
    rng = np.random.default_rng(4)
    ref, _ = _page(rng)
    out = np.where(ref >= 0.5, 1.0, -3.0).astype(np.float32)  # regions right at 0.3 and 0.5, background broken
    fid, reason, passed = _judge(ref, out, "segmentation")
    assert fid["map_iou_min"] == 1.0
    assert not passed
    assert "mean cosine" in reason


def test_what_is_read_as_a_map() -> None:
    rng = np.random.default_rng(5)
    assert looks_like_map(rng.uniform(0, 1, (2, 1, 32, 32)).astype(np.float32))  # probabilities
    assert looks_like_map(rng.normal(size=(2, 19, 32, 32)).astype(np.float32))  # class scores
    assert not looks_like_map(rng.normal(size=(2, 1, 32, 32)).astype(np.float32))  # one channel, not in [0, 1]
    assert not looks_like_map(rng.normal(size=(2, 512, 7, 7)).astype(np.float32))  # features
    assert not looks_like_map(rng.normal(size=(2, 84, 2100)).astype(np.float32))  # a detector's rows


def test_min_map_iou_out_of_range_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="min_map_iou"):
        Guard(min_map_iou=1.5)
