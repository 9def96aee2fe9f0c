"""Pieces shared by the two-branch ranking and region–phrase losses: distances and top-K hinges.

* Distances are Euclidean distances between L2-normalised embeddings computed
  as in the original implementation (`pairwise_distance`).
* "top-K in-batch violations": for each anchor, the hinge terms against all
  in-batch negatives are computed, only the K largest are kept (TPAMI 2018
  §5.1: "keep at most K triplets with highest non-negative loss"), and the
  result is averaged over anchors and K (`top_k_hinge`).
* The static-shape (XLA-compilable) form of "one row per positive pair,
  top-K hinge over the row's negatives" (`static_anchor_ranking_loss`) and
  its building blocks (`static_k`, `closest_negatives`, `first_positives`,
  `positive_caps`, `sum_over_capped_positives`), used by the image–sentence
  anchor terms and by the phrase-localization phrase- and region-anchor terms.
"""
from __future__ import annotations

import tensorflow as tf

# The original code adds this inside the square root so the gradient of the
# distance of a sentence to itself stays finite.
DISTANCE_EPSILON = 1e-4
# The original clips hinge values to [0, 1e6]; the upper bound never binds on
# unit vectors but is kept so values match the reference bit for bit.
HINGE_MAX = 1e6


def pairwise_distance(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Euclidean distances (len(a), len(b)) exactly as the original `pdist`."""
    a_sq = tf.reduce_sum(a * a, axis=1, keepdims=True)
    b_sq = tf.reduce_sum(b * b, axis=1, keepdims=True)
    sq = a_sq - 2.0 * tf.matmul(a, b, transpose_b=True) + tf.transpose(b_sq)
    # maximum() only guards against rounding below zero; the original has no
    # guard, and for unit vectors the +1e-4 already keeps the argument positive.
    return tf.sqrt(tf.maximum(sq + DISTANCE_EPSILON, 0.0))


def top_k_hinge(positive: tf.Tensor, negative: tf.Tensor, negative_mask: tf.Tensor,
                margin: float, k: int) -> tf.Tensor:
    """Mean of the k largest [margin + positive - negative]_+ per row.

    `positive` is (rows, 1) and `negative` (rows, cols); entries where
    `negative_mask` is False are not negatives and contribute 0. Since every
    hinge value is >= 0, filling non-negatives with 0 selects exactly the same
    top-k values as removing them, as long as a row has >= k negatives.
    """
    hinge = tf.clip_by_value(margin + positive - negative, 0.0, HINGE_MAX)
    hinge = tf.where(negative_mask, hinge, tf.zeros_like(hinge))
    k = min(int(k), int(hinge.shape[-1])) if hinge.shape[-1] is not None else int(k)
    k = tf.minimum(k, tf.shape(hinge)[-1])
    top = tf.math.top_k(hinge, k=k).values
    return tf.reduce_mean(top)


def static_k(values: tf.Tensor, k: int):
    """min(k, number of columns): a Python int when the column count is static.

    Otherwise a tensor of `tf.shape`, which XLA resolves at compile time.
    """
    cols = values.shape[-1]
    if cols is not None:
        return min(int(k), int(cols))
    return tf.minimum(int(k), tf.shape(values)[-1])


def closest_negatives(dist: tf.Tensor, negative: tf.Tensor, k):
    """Per row, the k smallest distances over `negative` columns, (..., k) each.

    Returns (distances, valid); `valid` is False where a row has fewer than k
    negatives (those slots hold a sentinel and must be masked out).
    """
    lowest = tf.constant(dist.dtype.min, dist.dtype)
    top = tf.math.top_k(tf.where(negative, -dist, lowest), k=k)
    valid = tf.gather(negative, top.indices, batch_dims=len(dist.shape) - 1)
    return -top.values, valid


# Positives per anchor row handled by the cheap static path; rows with more
# switch the term to a larger cap (see `sum_over_capped_positives`).
MAX_POSITIVES_PER_ANCHOR = 8
# Largest (anchors × positives-cap × candidates) tensor of the exact fallback.
FALLBACK_ELEMENTS = 1 << 24


def sum_over_capped_positives(positive: tf.Tensor, caps: list, total_for_cap) -> tf.Tensor:
    """`total_for_cap(cap)` for the smallest cap >= the most positives of any row.

    `caps` ascend; the last one is taken whenever the others are too small.
    Every branch of the `tf.cond` chain has static shapes, so XLA compiles
    it, and only the branch taken runs.
    """
    if len(caps) == 1:
        return total_for_cap(caps[0])
    most = tf.reduce_max(tf.reduce_sum(tf.cast(positive, tf.int32), axis=1))
    return tf.cond(most <= caps[0], lambda: total_for_cap(caps[0]),
                   lambda: sum_over_capped_positives(positive, caps[1:], total_for_cap))


def positive_caps(num_cols, max_positives: int, elements_per_positive) -> list:
    """Caps for `sum_over_capped_positives`: `max_positives`, then every column.

    The all-columns level is dropped when its tensor would exceed
    `FALLBACK_ELEMENTS` (then 8 × `max_positives` is the last level).
    """
    if num_cols is None:
        return [max_positives, None]
    num_cols = int(num_cols)
    if num_cols <= max_positives:
        return [num_cols]
    if elements_per_positive is None or num_cols * elements_per_positive <= FALLBACK_ELEMENTS:
        return [max_positives, num_cols]
    return [max_positives, min(num_cols, 8 * max_positives)]


def first_positives(positive: tf.Tensor, cap, dtype):
    """Column indices of the first `cap` positives of each row and their validity mask."""
    # A cap above the row length (fewer images or texts in a batch than MAX_POSITIVES_PER_ANCHOR,
    # with the batch size unknown when traced) would make top_k fail at run time.
    cap = tf.shape(positive)[-1] if cap is None else static_k(positive, cap)
    first = tf.math.top_k(tf.cast(positive, dtype), k=cap)
    return first.indices, first.values > 0


def static_anchor_ranking_loss(dist: tf.Tensor, positive: tf.Tensor, negative: tf.Tensor,
                               margin: float, k: int,
                               max_positives: int = MAX_POSITIVES_PER_ANCHOR) -> tf.Tensor:
    """Static-shape form of "one row per positive pair, top-k hinge over the row's negatives".

    Rows of `dist` are anchors, `positive` marks the positive pairs (a, c)
    and `negative` (rows × cols) the negatives of anchor a, the same for all
    of its positives. For a fixed pair the hinge [m + d(a, c) − d(a, n)]_+ is
    non-increasing in d(a, n), so its k largest values are those of the k
    *closest* negatives of a, found once per anchor; missing negatives
    (fewer than k) count as 0, like the zero-filled slots of `top_k_hinge`.
    The positives of each row are taken with a static cap: the first
    `max_positives` of the row (top_k of the 0/1 row, with a validity mask)
    give a (rows, cap, k) hinge tensor; when some row has more positives, a
    `tf.cond` switches to all columns, (rows, cols, k). The mean over the
    valid (pair, k) entries is thus the dynamic version's mean for any
    labels (any number of positives per row, duplicate images); only the
    summation order differs. No positive pair gives 0 (the dynamic
    `top_k_hinge`: NaN).
    """
    k = static_k(dist, k)
    closest, valid = closest_negatives(dist, negative, k)                   # (A, k)

    def total_for_cap(cap):
        indices, pair_valid = first_positives(positive, cap, dist.dtype)    # (A, P)
        positive_dist = tf.gather(dist, indices, batch_dims=1)
        hinge = tf.clip_by_value(margin + positive_dist[:, :, None] - closest[:, None, :],
                                 0.0, HINGE_MAX)                             # (A, P, k)
        keep = tf.logical_and(pair_valid[:, :, None], valid[:, None, :])
        return tf.reduce_sum(tf.where(keep, hinge, tf.zeros_like(hinge)))

    caps = positive_caps(dist.shape[-1], max_positives, None)
    total = sum_over_capped_positives(positive, caps, total_for_cap)
    count = tf.reduce_sum(tf.cast(positive, dist.dtype)) * tf.cast(k, dist.dtype)
    return tf.math.divide_no_nan(total, count)
