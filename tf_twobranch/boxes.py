"""Bounding-box utilities (vectorised numpy, plus a TensorFlow IoU).

Box convention used throughout the package:

* A box is ``[x1, y1, x2, y2]`` in 0-based pixel coordinates, stored as
  float32; ``(x1, y1)`` is the top-left pixel and ``(x2, y2)`` the bottom-right
  pixel, both *inclusive*.  This is what the official Flickr30K Entities
  Python parser returns (it subtracts 1 from the 1-based VOC-style XML
  coordinates, so ``xmax`` stays inclusive).
* Widths, heights and areas use the "+1 pixel" convention of the Flickr30K
  Entities / pl-clc evaluation code (``getIOU.m`` in BryanPlummer/pl-clc,
  used by the two-branch paper's phrase-localization numbers):
  ``w = x2 - x1 + 1``, ``h = y2 - y1 + 1``.  A box with ``x1 == x2`` is one
  pixel wide; a box has zero (or negative) area when ``x2 < x1`` or
  ``y2 < y1``.  IoU values therefore match the published evaluation.
* A box lies inside a ``width`` x ``height`` image when
  ``0 <= x1``, ``0 <= y1``, ``x2 <= width - 1`` and ``y2 <= height - 1``.
"""
from __future__ import annotations

import numpy as np

from tf_twobranch.errors import DataFormatError

#: Added to ``x2 - x1`` (and ``y2 - y1``) to get a width (height): the
#: inclusive-pixel convention of the Flickr30K Entities evaluation.
PIXEL_OFFSET = 1.0


def _as_boxes(boxes, name: str = "boxes") -> np.ndarray:
    array = np.asarray(boxes, dtype=np.float64)
    if array.ndim == 1 and array.shape[0] == 4:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] != 4:
        raise ValueError(f"{name} must have shape (N, 4), got {np.shape(boxes)}")
    return array


def box_area(boxes) -> np.ndarray:
    """Areas of (N, 4) boxes with the +1 pixel convention; invalid boxes get 0.

    Returns a float32 array of shape (N,) (or a scalar array for one (4,) box).
    """
    single = np.ndim(boxes) == 1
    array = _as_boxes(boxes)
    widths = np.maximum(array[:, 2] - array[:, 0] + PIXEL_OFFSET, 0.0)
    heights = np.maximum(array[:, 3] - array[:, 1] + PIXEL_OFFSET, 0.0)
    areas = (widths * heights).astype(np.float32)
    return areas[0] if single else areas


def iou_matrix(a, b) -> np.ndarray:
    """Intersection over union of every box in ``a`` (N, 4) with every box in ``b`` (M, 4).

    Uses the +1 pixel convention of the Flickr30K Entities evaluation.
    Returns float32 (N, M); pairs whose union is empty get 0.
    """
    boxes_a = _as_boxes(a, "a")
    boxes_b = _as_boxes(b, "b")
    inter_w = (np.minimum(boxes_a[:, None, 2], boxes_b[None, :, 2])
               - np.maximum(boxes_a[:, None, 0], boxes_b[None, :, 0]) + PIXEL_OFFSET)
    inter_h = (np.minimum(boxes_a[:, None, 3], boxes_b[None, :, 3])
               - np.maximum(boxes_a[:, None, 1], boxes_b[None, :, 1]) + PIXEL_OFFSET)
    intersection = np.maximum(inter_w, 0.0) * np.maximum(inter_h, 0.0)
    area_a = box_area(boxes_a).astype(np.float64)
    area_b = box_area(boxes_b).astype(np.float64)
    union = area_a[:, None] + area_b[None, :] - intersection
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, intersection / np.where(union > 0, union, 1.0), 0.0)
    return iou.astype(np.float32)


def iou_pairwise(a, b) -> np.ndarray:
    """Row-wise IoU: ``iou_pairwise(a, b)[i] = IoU(a[i], b[i])`` for (N, 4) inputs.

    Returns float32 (N,).
    """
    boxes_a = _as_boxes(a, "a")
    boxes_b = _as_boxes(b, "b")
    if boxes_a.shape != boxes_b.shape:
        raise ValueError(f"iou_pairwise needs equal shapes, got {boxes_a.shape} and {boxes_b.shape}")
    inter_w = np.minimum(boxes_a[:, 2], boxes_b[:, 2]) - np.maximum(boxes_a[:, 0], boxes_b[:, 0]) + PIXEL_OFFSET
    inter_h = np.minimum(boxes_a[:, 3], boxes_b[:, 3]) - np.maximum(boxes_a[:, 1], boxes_b[:, 1]) + PIXEL_OFFSET
    intersection = np.maximum(inter_w, 0.0) * np.maximum(inter_h, 0.0)
    union = box_area(boxes_a).astype(np.float64) + box_area(boxes_b).astype(np.float64) - intersection
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, intersection / np.where(union > 0, union, 1.0), 0.0)
    return iou.astype(np.float32)


def enclosing_box(boxes) -> np.ndarray:
    """The smallest box enclosing all (k, 4) ``boxes`` (k >= 1), as float32 (4,).

    Flickr30K Entities plural phrases (one chain, several boxes) are evaluated
    against this union box (two-branch paper, footnote 2; pl-clc ``getGTBox``).
    """
    array = _as_boxes(boxes)
    if array.shape[0] == 0:
        raise ValueError("enclosing_box needs at least one box")
    return np.array([array[:, 0].min(), array[:, 1].min(),
                     array[:, 2].max(), array[:, 3].max()], dtype=np.float32)


def clip_boxes(boxes, width: int, height: int) -> np.ndarray:
    """Clips (N, 4) boxes to a ``width`` x ``height`` image (inclusive pixel bounds)."""
    array = _as_boxes(boxes).copy()
    array[:, [0, 2]] = np.clip(array[:, [0, 2]], 0, width - 1)
    array[:, [1, 3]] = np.clip(array[:, [1, 3]], 0, height - 1)
    return array.astype(np.float32)


def validate_boxes(boxes, width: float | None = None, height: float | None = None, *,
                   path=None, record=None, tolerance: float = 0.0, hint: str = "") -> np.ndarray:
    """Checks (N, 4) boxes and returns them as float32.

    Raises DataFormatError (naming ``path``, ``record`` and the first bad box)
    when the array is not (N, 4), holds NaN/inf, a box has zero or negative
    area (``x2 < x1`` or ``y2 < y1``), or — when ``width``/``height`` are given —
    a box extends outside the image (see the module docstring for the bounds)
    by more than ``tolerance`` pixels.  ``hint`` is appended to the message of
    an out-of-image box (e.g. what to do about it).
    """
    where = path if path is not None else "<boxes>"
    try:
        array = np.asarray(boxes, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise DataFormatError(where, f"boxes are not numeric: {error}", record=record) from None
    if array.ndim == 1 and array.size == 0:
        array = array.reshape(0, 4)
    if array.ndim != 2 or array.shape[1] != 4:
        raise DataFormatError(where, f"expected boxes of shape (N, 4) as [x1, y1, x2, y2], got shape {array.shape}",
                              record=record)

    def fail(index: int, reason: str):
        box = ", ".join(f"{v:g}" for v in array[index])
        raise DataFormatError(where, f"box {index} [{box}] {reason}", record=record)

    finite = np.isfinite(array).all(axis=1)
    if not finite.all():
        fail(int(np.argmin(finite)), "contains NaN or infinity")
    degenerate = (array[:, 2] < array[:, 0]) | (array[:, 3] < array[:, 1])
    if degenerate.any():
        fail(int(np.argmax(degenerate)), "has zero or negative area (expected x2 >= x1 and y2 >= y1, "
                                          "inclusive pixel coordinates)")
    negative = (array[:, 0] < 0) | (array[:, 1] < 0)
    if negative.any():
        fail(int(np.argmax(negative)), "has a negative coordinate (expected 0-based pixel coordinates)")
    size = f"{width:g} x {height:g}" if width is not None and height is not None else None
    for column, name, extent, axis in ((2, "x2", width, "width"), (3, "y2", height, "height")):
        if extent is None:
            continue
        outside = array[:, column] > extent - 1 + tolerance
        if outside.any():
            reason = f"extends outside the image: {name} > {axis} - 1 = {extent - 1:g}"
            if tolerance:
                reason += f" (by more than the {tolerance:g}-pixel tolerance)"
            if size:
                reason += f"; the image is {size} pixels (width x height)"
            fail(int(np.argmax(outside)), reason + (f"; {hint}" if hint else ""))
    return array.astype(np.float32)


def _iou_above(boxes_a: np.ndarray, areas_a: np.ndarray, boxes_b: np.ndarray, areas_b: np.ndarray,
               threshold: float) -> np.ndarray:
    """Boolean (N, M) matrix ``IoU(a_i, b_j) > threshold`` for float64 boxes and their areas.

    Float64 IoU with the +1 pixel convention (zero-union pairs have IoU 0),
    computed in place to spare temporaries.
    """
    boxes_a, boxes_b = boxes_a.T[:, :, None], boxes_b.T[:, None, :]
    intersection = np.minimum(boxes_a[2], boxes_b[2])
    intersection -= np.maximum(boxes_a[0], boxes_b[0])
    intersection += PIXEL_OFFSET
    np.maximum(intersection, 0.0, out=intersection)
    inter_h = np.minimum(boxes_a[3], boxes_b[3])
    inter_h -= np.maximum(boxes_a[1], boxes_b[1])
    inter_h += PIXEL_OFFSET
    np.maximum(inter_h, 0.0, out=inter_h)
    intersection *= inter_h
    union = np.add(areas_a[:, None], areas_b[None, :], out=inter_h)
    union -= intersection
    positive = union > 0
    np.maximum(union, 1e-12, out=union)
    np.divide(intersection, union, out=intersection)
    above = intersection > threshold
    if threshold < 0:  # a zero-union pair has IoU 0
        above |= ~positive
    else:
        above &= positive
    return above


def _greedy_keep(overlaps: np.ndarray) -> np.ndarray:
    """Greedy NMS decisions for candidates in rank order, given ``overlaps[i, j]`` = "i suppresses j".

    Candidate j is kept iff no kept i < j overlaps it.  That recursion has a
    unique solution, reached by iterating the rule from "keep all" until it
    stops changing (at most once per link of the longest suppression chain,
    usually a handful of matrix-vector products instead of a Python loop).
    """
    earlier = np.triu(overlaps, 1).astype(np.float32)
    keep = np.ones(len(overlaps), dtype=bool)
    while True:
        updated = keep.astype(np.float32) @ earlier == 0
        if np.array_equal(updated, keep):
            return keep
        keep = updated


def descending_order_prefix(scores, count: int) -> np.ndarray:
    """``np.argsort(-scores, kind="stable")[:count]`` (ties: lower index first), without sorting everything."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    count = max(0, int(count))
    if count >= len(scores) or not np.isfinite(scores).all():
        return np.argsort(-scores, kind="stable")[:count]
    if count == 0:
        return np.zeros(0, np.int64)
    negated = -scores
    cutoff = np.partition(negated, count - 1)[count - 1]
    # Everything up to the cutoff, ties included, in index order; a stable sort
    # of that subset is a prefix of the stable sort of all scores.
    selected = np.flatnonzero(negated <= cutoff)
    return selected[np.argsort(negated[selected], kind="stable")][:count]


def non_max_suppression(boxes, scores, iou_threshold: float, max_output: int | None = None) -> np.ndarray:
    """Greedy NMS: indices of kept boxes in decreasing score order.

    A box is suppressed when its IoU with an already kept, higher-ranked box
    exceeds ``iou_threshold``.  Ties in score are broken by the lower index, so
    the result is deterministic.  At most ``max_output`` indices are returned.
    """
    array = _as_boxes(boxes)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if len(scores) != len(array):
        raise ValueError(f"scores has {len(scores)} entries for {len(array)} boxes")
    limit = len(array) if max_output is None else int(max_output)
    # Candidates are visited in rank order, one block at a time: a block is
    # first filtered against the boxes kept so far, then greedy NMS runs
    # inside the block on its IoU matrix.  This gives exactly the classic
    # one-box-at-a-time result, but costs O(kept x visited) instead of
    # O(kept x all), which matters when only the top few hundred of many
    # thousand candidates are wanted; for the same reason only a prefix of the
    # rank order is sorted unless more is needed.
    block_size = 64
    order = descending_order_prefix(scores, max(8 * limit, 1024))
    kept_boxes = np.zeros((0, 4), np.float64)
    kept_areas = np.zeros(0, np.float64)
    kept: list[np.ndarray] = []
    num_kept = 0
    start = 0
    while start < len(array) and num_kept < limit:
        if start + block_size > len(order) and len(order) < len(array):
            order = np.argsort(-scores, kind="stable")
        block = order[start:start + block_size]
        start += block_size
        block_boxes = array[block]
        block_areas = box_area(block_boxes).astype(np.float64)
        if num_kept:
            alive = ~_iou_above(kept_boxes, kept_areas, block_boxes, block_areas, iou_threshold).any(axis=0)
            block, block_boxes, block_areas = block[alive], block_boxes[alive], block_areas[alive]
        if not len(block):
            continue
        keep = _greedy_keep(_iou_above(block_boxes, block_areas, block_boxes, block_areas, iou_threshold))
        keep = np.flatnonzero(keep)[: limit - num_kept]
        kept.append(block[keep])
        num_kept += len(keep)
        kept_boxes = np.concatenate([kept_boxes, block_boxes[keep]])
        kept_areas = np.concatenate([kept_areas, block_areas[keep]])
    if not kept:
        return np.zeros(0, np.int64)
    return np.concatenate(kept).astype(np.int64)


def tf_iou_matrix(a, b):
    """TensorFlow version of :func:`iou_matrix` for tf.data pipelines and graphs.

    ``a`` (N, 4) and ``b`` (M, 4) float tensors; returns float32 (N, M) with the
    same +1 pixel convention.
    """
    # TensorFlow only here: the numpy box code (used by the data readers) stays light.
    import tensorflow as tf

    boxes_a = tf.cast(tf.convert_to_tensor(a), tf.float32)
    boxes_b = tf.cast(tf.convert_to_tensor(b), tf.float32)
    ax1, ay1, ax2, ay2 = tf.unstack(boxes_a[:, None, :], axis=-1)
    bx1, by1, bx2, by2 = tf.unstack(boxes_b[None, :, :], axis=-1)
    inter_w = tf.maximum(tf.minimum(ax2, bx2) - tf.maximum(ax1, bx1) + PIXEL_OFFSET, 0.0)
    inter_h = tf.maximum(tf.minimum(ay2, by2) - tf.maximum(ay1, by1) + PIXEL_OFFSET, 0.0)
    intersection = inter_w * inter_h
    area_a = tf.maximum(ax2 - ax1 + PIXEL_OFFSET, 0.0) * tf.maximum(ay2 - ay1 + PIXEL_OFFSET, 0.0)
    area_b = tf.maximum(bx2 - bx1 + PIXEL_OFFSET, 0.0) * tf.maximum(by2 - by1 + PIXEL_OFFSET, 0.0)
    union = area_a + area_b - intersection
    return tf.math.divide_no_nan(intersection, union)
