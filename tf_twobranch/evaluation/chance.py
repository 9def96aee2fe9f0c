"""Chance levels as expected values (not one random draw): what random ranking scores on a
retrieval test split, and what a random point, the image centre and a random proposal score in
the grounding of the same phrases.

Retrieval under a protocol: each gallery of n images and C captions (m_i of image i), scores
random. Text-to-image: the caption's image is equally likely at every rank, P(rank <= r) = r / n.
Image-to-text: the image's m captions are a random m-subset of the C ranks, so its first one is
beyond rank r with probability C(C - m, r) / C(C, r) (hypergeometric). R@K is 100 P(rank <= K),
averaged over the queries and the folds; the median rank is the median of that rank distribution
(the value the median of many queries tends to), as `retrieval.metrics_from_ranks` reports it.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from tf_twobranch.boxes import enclosing_box, iou_matrix
from tf_twobranch.evaluation import retrieval
from tf_twobranch.evaluation.phrase_localization import IOU_THRESHOLD
from tf_twobranch.evaluation.pointing_game import centre_points, evaluate_points

__all__ = ["even_caption_counts", "expected_random_metrics", "random_point_accuracy", "centre_point_accuracy",
           "random_box_r1"]


def even_caption_counts(num_images: int, num_captions: int) -> np.ndarray:
    """Captions per image when only the totals are known: as even as possible (5 each for 5N)."""
    counts = np.full(num_images, num_captions // num_images, np.int64)
    counts[:num_captions % num_images] += 1
    return counts


def _first_positive_cdf(num_captions: int, positives: int) -> np.ndarray:
    """P(rank of the first of `positives` random positives among `num_captions` <= r), r = 1..C."""
    j = np.arange(num_captions, dtype=np.float64)
    miss = np.clip((num_captions - positives - j) / (num_captions - j), 0.0, None)
    return 1.0 - np.cumprod(miss)


def _gallery_metrics(counts: np.ndarray, ks: Sequence[int]) -> dict:
    counts = counts[counts > 0]
    n, c = len(counts), int(counts.sum())
    ranks_t2i = np.arange(1, n + 1)
    cdf_t2i = ranks_t2i / n
    values, weights = np.unique(counts, return_counts=True)
    cdf_i2t = sum(w * _first_positive_cdf(c, int(m)) for m, w in zip(values, weights)) / n
    out = {}
    for prefix, cdf in (("i2t_", cdf_i2t), ("t2i_", cdf_t2i)):
        for k in ks:
            out[f"{prefix}r{k}"] = float(100.0 * cdf[min(k, len(cdf)) - 1])
        out[f"{prefix}medr"] = float(np.searchsorted(cdf, 0.5 - 1e-12) + 1)
    out["rsum"] = float(sum(out[f"i2t_r{k}"] + out[f"t2i_r{k}"] for k in ks))
    return out


def expected_random_metrics(caption_counts, protocol: str = "full", ks: Sequence[int] = retrieval.DEFAULT_KS) -> dict:
    """The expected R@K, median rank and rsum of random scores on a test split whose image i has
    ``caption_counts[i]`` captions (in the split's order), under `protocol` (its folds and
    first-caption rule as `retrieval.evaluate_protocol` applies them)."""
    counts = np.asarray(caption_counts, np.int64)
    spec = retrieval.protocol_spec(protocol)
    if spec.first_caption_only:
        counts = np.minimum(counts, 1)
    if spec.fold_images is None:
        return _gallery_metrics(counts, ks)
    folds = spec.num_folds or len(counts) // spec.fold_images
    per_fold = [_gallery_metrics(counts[f * spec.fold_images:(f + 1) * spec.fold_images], ks) for f in range(folds)]
    return {key: float(np.mean([m[key] for m in per_fold])) for key in per_fold[0]}


# ---------------------------------------------------------------------------- grounding


def _union_pixels(boxes: np.ndarray, width: int, height: int) -> int:
    """Pixels (x, y) with x1 <= x <= x2 and y1 <= y <= y2 for some inclusive box (the hit rule)."""
    mask = np.zeros((height, width), bool)
    for x1, y1, x2, y2 in np.asarray(boxes, np.float64).reshape(-1, 4):
        c0, c1 = max(int(np.ceil(x1)), 0), min(int(np.floor(x2)), width - 1)
        r0, r1 = max(int(np.ceil(y1)), 0), min(int(np.floor(y2)), height - 1)
        if c0 <= c1 and r0 <= r1:
            mask[r0:r1 + 1, c0:c1 + 1] = True
    return int(mask.sum())


def random_point_accuracy(queries: Sequence) -> float:
    """Expected pointing accuracy (%) of a uniformly random pixel (`pointing_game.random_points`):
    the mean over phrases of the fraction of the image's pixels inside one of its boxes."""
    if not queries:
        return float("nan")
    return float(100.0 * np.mean([_union_pixels(q.boxes, q.image_width, q.image_height)
                                  / (q.image_width * q.image_height) for q in queries]))


def centre_point_accuracy(queries: Sequence) -> float:
    """Pointing accuracy (%) of the image's centre pixel (`pointing_game.centre_points`)."""
    return float(evaluate_points(queries, centre_points(queries))["accuracy"])


def random_box_r1(queries: Sequence, proposals: Mapping[str, np.ndarray], max_proposals: int | None = None) -> float:
    """Expected box R@1 at IoU >= 0.5 (%) of a random one of each image's first `max_proposals`
    proposals: the mean over phrases of the fraction of them that overlap the phrase's box
    (the enclosing box of its boxes, as `grounding` scores a box ranker)."""
    fractions = []
    for q in queries:
        boxes = np.asarray(proposals[q.image_id], np.float32).reshape(-1, 4)[:max_proposals or None]
        if len(boxes) == 0:
            fractions.append(0.0)
            continue
        target = enclosing_box(np.asarray(q.boxes, np.float32).reshape(-1, 4))[None]
        fractions.append(float(np.mean(iou_matrix(target, boxes)[0] >= IOU_THRESHOLD)))
    return float(100.0 * np.mean(fractions)) if fractions else float("nan")
