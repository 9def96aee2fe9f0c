"""Tests for tf_twobranch.boxes (golden values computed by hand, +1 pixel convention)."""
import numpy as np
import pytest

from tf_twobranch import boxes
from tf_twobranch.errors import DataFormatError


def test_box_area_plus_one_convention():
    # 10x10 pixels from 0..9; a single pixel; a degenerate box clamps to 0.
    areas = boxes.box_area([[0, 0, 9, 9], [3, 3, 3, 3], [5, 5, 3, 9]])
    np.testing.assert_allclose(areas, [100, 1, 0])
    assert boxes.box_area([0, 0, 1, 4]) == pytest.approx(10)


def test_iou_matrix_golden_values():
    a = np.array([[0, 0, 9, 9], [10, 10, 19, 19]], np.float32)
    b = np.array([[0, 0, 9, 9],      # identical -> 1
                  [5, 0, 14, 9],     # overlap 5x10=50, union 150 -> 1/3
                  [0, 0, 4, 4],      # inside: 25/100
                  [100, 100, 110, 110]], np.float32)  # disjoint -> 0
    iou = boxes.iou_matrix(a, b)
    assert iou.shape == (2, 4) and iou.dtype == np.float32
    np.testing.assert_allclose(iou[0], [1.0, 50 / 150, 0.25, 0.0], rtol=1e-6)
    # [10,10,19,19] vs [5,0,14,9]: y ranges 10..19 and 0..9 do not overlap.
    np.testing.assert_allclose(iou[1], [0.0, 0.0, 0.0, 0.0])
    # Touching edges share one pixel column with the inclusive convention.
    touching = boxes.iou_matrix([[0, 0, 9, 9]], [[9, 0, 18, 9]])
    np.testing.assert_allclose(touching, [[10 / 190]], rtol=1e-6)


def test_iou_pairwise_matches_matrix_diagonal():
    rng = np.random.default_rng(0)
    x1y1 = rng.uniform(0, 50, size=(6, 2))
    a = np.concatenate([x1y1, x1y1 + rng.uniform(1, 30, size=(6, 2))], axis=1)
    b = a + rng.uniform(-5, 5, size=a.shape)
    np.testing.assert_allclose(boxes.iou_pairwise(a, b), np.diag(boxes.iou_matrix(a, b)), rtol=1e-6)


def test_tf_iou_matrix_matches_numpy():
    a = np.array([[0, 0, 9, 9], [2, 3, 20, 15]], np.float32)
    b = np.array([[5, 0, 14, 9], [0, 0, 4, 4], [50, 50, 60, 60]], np.float32)
    np.testing.assert_allclose(boxes.tf_iou_matrix(a, b).numpy(), boxes.iou_matrix(a, b), rtol=1e-6)


def test_enclosing_box_and_clip():
    union = boxes.enclosing_box([[10, 20, 30, 40], [5, 25, 12, 60]])
    np.testing.assert_array_equal(union, [5, 20, 30, 60])
    assert union.dtype == np.float32
    clipped = boxes.clip_boxes([[-3, 2, 120, 50]], width=100, height=40)
    np.testing.assert_array_equal(clipped, [[0, 2, 99, 39]])
    with pytest.raises(ValueError):
        boxes.enclosing_box(np.zeros((0, 4)))


def test_validate_boxes_accepts_and_rejects():
    ok = boxes.validate_boxes([[0, 0, 99, 49]], 100, 50)
    assert ok.dtype == np.float32
    with pytest.raises(DataFormatError, match="outside the image"):
        boxes.validate_boxes([[0, 0, 100, 10]], 100, 50, path="p.xml", record="chain 7")
    with pytest.raises(DataFormatError, match="zero or negative area"):
        boxes.validate_boxes([[5, 5, 4, 10]], 100, 50)
    with pytest.raises(DataFormatError, match="NaN"):
        boxes.validate_boxes([[0, np.nan, 5, 5]], 100, 50)
    with pytest.raises(DataFormatError, match="negative coordinate"):
        boxes.validate_boxes([[-1, 0, 5, 5]])
    with pytest.raises(DataFormatError, match=r"shape \(N, 4\)"):
        boxes.validate_boxes([[1, 2, 3]])
    with pytest.raises(DataFormatError) as info:
        boxes.validate_boxes([[0, 0, 100, 10]], 100, 50, path="p.xml", record="chain 7")
    assert "p.xml" in str(info.value) and "chain 7" in str(info.value)


def test_non_max_suppression_is_greedy_and_deterministic():
    candidates = [[0, 0, 9, 9], [1, 0, 10, 9], [50, 50, 59, 59], [0, 0, 9, 9]]
    kept = boxes.non_max_suppression(candidates, [0.9, 0.8, 0.7, 0.9], iou_threshold=0.5)
    np.testing.assert_array_equal(kept, [0, 2])
    kept = boxes.non_max_suppression(candidates, [0.9, 0.8, 0.7, 0.9], iou_threshold=0.5, max_output=1)
    np.testing.assert_array_equal(kept, [0])
