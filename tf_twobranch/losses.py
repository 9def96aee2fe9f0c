"""Losses of the two-branch networks.

Each loss is a pure function of tensors plus a thin serializable Keras class
(`keras.losses.Loss` subclass) so it can be named in a config and saved with a
model. Conventions shared by every function here:

* `labels` is a boolean matrix of shape (num_texts, num_images); entry (s, i)
  is True when text s and image i are a positive pair.
* Distances are Euclidean distances between L2-normalised embeddings computed
  as in the original implementation (`pairwise_distance`).
* "top-K in-batch violations": for each anchor, the hinge terms against all
  in-batch negatives are computed, only the K largest are kept (TPAMI 2018
  §5.1: "keep at most K triplets with highest non-negative loss"), and the
  result is averaged over anchors and K.
"""
from __future__ import annotations

import keras
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


def _top_k_hinge(positive: tf.Tensor, negative: tf.Tensor, negative_mask: tf.Tensor,
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


def _static_k(values: tf.Tensor, k: int):
    """min(k, number of columns): a Python int when the column count is static.

    Otherwise a tensor of `tf.shape`, which XLA resolves at compile time.
    """
    cols = values.shape[-1]
    if cols is not None:
        return min(int(k), int(cols))
    return tf.minimum(int(k), tf.shape(values)[-1])


def _closest_negatives(dist: tf.Tensor, negative: tf.Tensor, k):
    """Per row, the k smallest distances over `negative` columns, (..., k) each.

    Returns (distances, valid); `valid` is False where a row has fewer than k
    negatives (those slots hold a sentinel and must be masked out).
    """
    lowest = tf.constant(dist.dtype.min, dist.dtype)
    top = tf.math.top_k(tf.where(negative, -dist, lowest), k=k)
    valid = tf.gather(negative, top.indices, batch_dims=len(dist.shape) - 1)
    return -top.values, valid


# Positives per anchor row handled by the cheap static path; rows with more
# switch the term to a larger cap (see `_sum_over_capped_positives`).
MAX_POSITIVES_PER_ANCHOR = 8
# Largest (anchors × positives-cap × candidates) tensor of the exact fallback.
FALLBACK_ELEMENTS = 1 << 24


def _sum_over_capped_positives(positive: tf.Tensor, caps: list, total_for_cap) -> tf.Tensor:
    """`total_for_cap(cap)` for the smallest cap >= the most positives of any row.

    `caps` ascend; the last one is taken whenever the others are too small.
    Every branch of the `tf.cond` chain has static shapes, so XLA compiles
    it, and only the branch taken runs.
    """
    if len(caps) == 1:
        return total_for_cap(caps[0])
    most = tf.reduce_max(tf.reduce_sum(tf.cast(positive, tf.int32), axis=1))
    return tf.cond(most <= caps[0], lambda: total_for_cap(caps[0]),
                   lambda: _sum_over_capped_positives(positive, caps[1:], total_for_cap))


def _positive_caps(num_cols, max_positives: int, elements_per_positive) -> list:
    """Caps for `_sum_over_capped_positives`: `max_positives`, then every column.

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


def _first_positives(positive: tf.Tensor, cap, dtype):
    """Column indices of the first `cap` positives of each row and their validity mask."""
    if cap is None:
        cap = tf.shape(positive)[-1]
    first = tf.math.top_k(tf.cast(positive, dtype), k=cap)
    return first.indices, first.values > 0


def _static_anchor_ranking_loss(dist: tf.Tensor, positive: tf.Tensor, negative: tf.Tensor,
                                margin: float, k: int,
                                max_positives: int = MAX_POSITIVES_PER_ANCHOR) -> tf.Tensor:
    """Static-shape form of "one row per positive pair, top-k hinge over the row's negatives".

    Rows of `dist` are anchors, `positive` marks the positive pairs (a, c)
    and `negative` (rows × cols) the negatives of anchor a, the same for all
    of its positives. For a fixed pair the hinge [m + d(a, c) − d(a, n)]_+ is
    non-increasing in d(a, n), so its k largest values are those of the k
    *closest* negatives of a, found once per anchor; missing negatives
    (fewer than k) count as 0, like the zero-filled slots of `_top_k_hinge`.
    The positives of each row are taken with a static cap: the first
    `max_positives` of the row (top_k of the 0/1 row, with a validity mask)
    give a (rows, cap, k) hinge tensor; when some row has more positives, a
    `tf.cond` switches to all columns, (rows, cols, k). The mean over the
    valid (pair, k) entries is thus the dynamic version's mean for any
    labels (any number of positives per row, duplicate images); only the
    summation order differs. No positive pair gives 0 (the dynamic
    `_top_k_hinge`: NaN).
    """
    k = _static_k(dist, k)
    closest, valid = _closest_negatives(dist, negative, k)                  # (A, k)

    def total_for_cap(cap):
        indices, pair_valid = _first_positives(positive, cap, dist.dtype)   # (A, P)
        positive_dist = tf.gather(dist, indices, batch_dims=1)
        hinge = tf.clip_by_value(margin + positive_dist[:, :, None] - closest[:, None, :],
                                 0.0, HINGE_MAX)                             # (A, P, k)
        keep = tf.logical_and(pair_valid[:, :, None], valid[:, None, :])
        return tf.reduce_sum(tf.where(keep, hinge, tf.zeros_like(hinge)))

    caps = _positive_caps(dist.shape[-1], max_positives, None)
    total = _sum_over_capped_positives(positive, caps, total_for_cap)
    count = tf.reduce_sum(tf.cast(positive, dist.dtype)) * tf.cast(k, dist.dtype)
    return tf.math.divide_no_nan(total, count)


def text_anchor_ranking_loss(dist: tf.Tensor, labels: tf.Tensor, *, margin: float,
                             top_k: int, static_shapes: bool = False) -> tf.Tensor:
    """Text anchors: d(x_j', y_i') + m < d(x_k', y_i') (TPAMI eq. 2).

    One row per positive (text, image) pair; negatives are the images not
    matched to that text. `dist` is (num_texts, num_images).
    `static_shapes=True` computes the same value without data-dependent
    shapes (XLA-compilable; `_static_anchor_ranking_loss`).
    """
    if static_shapes:
        return _static_anchor_ranking_loss(dist, labels, tf.logical_not(labels), margin, top_k)
    pairs = tf.where(labels)
    rows = tf.gather(dist, pairs[:, 0])
    positive = tf.gather_nd(dist, pairs)[:, None]
    negative_mask = tf.logical_not(tf.gather(labels, pairs[:, 0]))
    return _top_k_hinge(positive, rows, negative_mask, margin, top_k)


def image_anchor_ranking_loss(dist: tf.Tensor, labels: tf.Tensor, *, margin: float,
                              top_k: int, static_shapes: bool = False) -> tf.Tensor:
    """Image anchors: d(x_i, y_j) + m < d(x_i, y_k) (TPAMI eq. 1).

    One row per positive (text, image) pair; negatives are the texts not
    matched to that image.
    """
    # The text-anchor term of the transposed problem: images become anchors.
    return text_anchor_ranking_loss(tf.transpose(dist), tf.transpose(labels), margin=margin,
                                    top_k=top_k, static_shapes=static_shapes)


def neighbourhood_loss(embeds: tf.Tensor, neighbours: tf.Tensor, *, margin: float,
                       top_k: int) -> tf.Tensor:
    """Within-modality neighbourhood constraint (TPAMI eqs. 4-5).

    `neighbours` is a boolean (n, n) matrix, True where two items share a
    match (it includes the diagonal). As in the original code, the positive
    distance of an anchor is its largest distance to any neighbour (itself
    included), and the negatives are all non-neighbours.
    """
    dist = pairwise_distance(embeds, embeds)
    positive = tf.reduce_max(tf.where(neighbours, dist, tf.zeros_like(dist)), axis=1,
                             keepdims=True)
    return _top_k_hinge(positive, dist, tf.logical_not(neighbours), margin, top_k)


def bidirectional_ranking_loss(image_embeds: tf.Tensor, text_embeds: tf.Tensor,
                               labels: tf.Tensor, *, margin: float = 0.05,
                               top_k: int = 10, image_anchor_weight: float = 1.0,
                               text_anchor_weight: float = 1.5,
                               image_neighbour_weight: float = 0.0,
                               text_neighbour_weight: float = 0.05,
                               static_shapes: bool = False) -> tf.Tensor:
    """TPAMI eq. 6: λ1·image-anchor + λ2·text-anchor + λ3·image-nbr + λ4·text-nbr.

    Args:
      image_embeds: (num_images, d) L2-normalised image (or region) embeddings.
      text_embeds: (num_texts, d) L2-normalised sentence (or phrase) embeddings.
      labels: bool (num_texts, num_images) positive-pair mask.
      margin: m of the hinge.
      top_k: K, the number of largest in-batch violations kept per anchor.
      image_anchor_weight: λ1 (image target, text positive/negative).
      text_anchor_weight: λ2 (text target, image positive/negative).
      image_neighbour_weight: λ3; images are neighbours when they share a text.
      text_neighbour_weight: λ4; texts are neighbours when they share an image.
      static_shapes: compute the anchor terms without data-dependent shapes
        (needed under XLA, `jit_compile=True`); the value is the same for
        any labels (see `_static_anchor_ranking_loss`). The neighbourhood
        terms have static shapes either way.
    """
    labels = tf.cast(labels, tf.bool)
    dist = pairwise_distance(text_embeds, image_embeds)
    loss = tf.constant(0.0, dtype=dist.dtype)
    if text_anchor_weight:
        loss += text_anchor_weight * text_anchor_ranking_loss(
            dist, labels, margin=margin, top_k=top_k, static_shapes=static_shapes)
    if image_anchor_weight:
        loss += image_anchor_weight * image_anchor_ranking_loss(
            dist, labels, margin=margin, top_k=top_k, static_shapes=static_shapes)
    labels_f = tf.cast(labels, dist.dtype)
    if text_neighbour_weight:
        text_nbrs = tf.matmul(labels_f, labels_f, transpose_b=True) > 0
        loss += text_neighbour_weight * neighbourhood_loss(
            text_embeds, text_nbrs, margin=margin, top_k=top_k)
    if image_neighbour_weight:
        image_nbrs = tf.matmul(labels_f, labels_f, transpose_a=True) > 0
        image_nbrs = tf.logical_or(image_nbrs, tf.eye(tf.shape(labels)[1], dtype=tf.bool))
        loss += image_neighbour_weight * neighbourhood_loss(
            image_embeds, image_nbrs, margin=margin, top_k=top_k)
    return loss


def embedding_loss(im_embeds: tf.Tensor, sent_embeds: tf.Tensor, labels: tf.Tensor, *,
                   margin: float = 0.05, num_neg_sample: int = 10,
                   im_loss_factor: float = 1.5,
                   sent_only_loss_factor: float = 0.05,
                   static_shapes: bool = False) -> tf.Tensor:
    """The original implementation's `embedding_loss`, same inputs → same value.

    Naming follows `lwwang/Two_branch_network/retrieval_model.py`:
    `im_loss` is the sentence-anchor term (its negatives are images) and is
    weighted by `im_loss_factor`; the image-anchor term has weight 1; the
    sentence-only term is the text neighbourhood constraint. `labels` is the
    (num_sent, num_img) boolean matrix with exactly one True per row.
    """
    return bidirectional_ranking_loss(
        im_embeds, sent_embeds, labels, margin=margin, top_k=num_neg_sample,
        image_anchor_weight=1.0, text_anchor_weight=im_loss_factor,
        image_neighbour_weight=0.0, text_neighbour_weight=sent_only_loss_factor,
        static_shapes=static_shapes)


def logistic_pair_loss(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Similarity network loss (TPAMI eq. 7), mean of log(1 + exp(-z·p)).

    `labels` are 1 for positive pairs and 0 (or -1) for negative pairs.
    """
    logits = tf.reshape(logits, [-1])
    z = tf.where(tf.reshape(labels, [-1]) > 0, 1.0, -1.0)
    z = tf.cast(z, logits.dtype)
    return tf.reduce_mean(tf.nn.softplus(-z * logits))


@keras.saving.register_keras_serializable(package="tf_twobranch")
class BidirectionalRankingLoss(keras.losses.Loss):
    """Keras wrapper of `bidirectional_ranking_loss`.

    `y_true` is the label matrix; `y_pred` is a tuple (image_embeds,
    text_embeds). Used by the models' `train_step`, which passes both.
    """

    def __init__(self, margin=0.05, top_k=10, image_anchor_weight=1.0,
                 text_anchor_weight=1.5, image_neighbour_weight=0.0,
                 text_neighbour_weight=0.05, name="bidirectional_ranking_loss",
                 reduction="sum_over_batch_size", **kwargs):
        super().__init__(name=name, reduction=reduction, **kwargs)
        self.margin = margin
        self.top_k = top_k
        self.image_anchor_weight = image_anchor_weight
        self.text_anchor_weight = text_anchor_weight
        self.image_neighbour_weight = image_neighbour_weight
        self.text_neighbour_weight = text_neighbour_weight

    def call(self, y_true, y_pred):
        image_embeds, text_embeds = y_pred
        return bidirectional_ranking_loss(
            image_embeds, text_embeds, y_true, margin=self.margin, top_k=self.top_k,
            image_anchor_weight=self.image_anchor_weight,
            text_anchor_weight=self.text_anchor_weight,
            image_neighbour_weight=self.image_neighbour_weight,
            text_neighbour_weight=self.text_neighbour_weight)

    def __call__(self, y_true, y_pred, sample_weight=None):
        return self.call(y_true, y_pred)

    def get_config(self):
        config = super().get_config()
        config.update(margin=self.margin, top_k=self.top_k,
                      image_anchor_weight=self.image_anchor_weight,
                      text_anchor_weight=self.text_anchor_weight,
                      image_neighbour_weight=self.image_neighbour_weight,
                      text_neighbour_weight=self.text_neighbour_weight)
        return config


@keras.saving.register_keras_serializable(package="tf_twobranch")
class LogisticPairLoss(keras.losses.Loss):
    """Keras wrapper of `logistic_pair_loss` (labels 1/0 or 1/-1, logits)."""

    def __init__(self, name="logistic_pair_loss", reduction="sum_over_batch_size", **kwargs):
        super().__init__(name=name, reduction=reduction, **kwargs)

    def call(self, y_true, y_pred):
        return logistic_pair_loss(y_pred, y_true)

    def __call__(self, y_true, y_pred, sample_weight=None):
        return self.call(y_true, y_pred)


# --- Phrase localization (TPAMI 2018 Algorithm 1; CVPR 2016) -----------------
#
# Margin: TPAMI 2018 states m = 0.05 only for its image-sentence experiments
# ("we fix the margin m=0.05 for all terms in our image-sentence
# experiments"); the phrase-localization margin is not given. CVPR 2016 used
# m = 0.1 for every experiment, phrase localization included. The default
# here is 0.05 (the two-branch paper's one stated value, and the original
# code's); pass margin=0.1 to follow the CVPR 2016 setting.


def _anchor_rows_top_k(positive: tf.Tensor, rows: tf.Tensor, negative_mask: tf.Tensor,
                       margin: float, k: int) -> tf.Tensor:
    """`_top_k_hinge` that returns 0 (not NaN) when there are no anchor rows."""
    return tf.cond(tf.shape(rows)[0] > 0,
                   lambda: _top_k_hinge(positive, rows, negative_mask, margin, k),
                   lambda: tf.constant(0.0, rows.dtype))


def _masked_neighbourhood_loss(dist: tf.Tensor, neighbours: tf.Tensor, anchors: tf.Tensor,
                               candidates: tf.Tensor, *, margin: float, top_k: int) -> tf.Tensor:
    """Neighbourhood term over the rows `anchors`; negatives are `candidates` outside the neighbourhood.

    As `neighbourhood_loss`, the positive distance of an anchor is its
    largest distance to any neighbour (itself included).
    """
    rows_index = tf.where(anchors)[:, 0]
    rows = tf.gather(dist, rows_index)
    nbrs = tf.gather(neighbours, rows_index)
    positive = tf.reduce_max(tf.where(nbrs, rows, tf.zeros_like(rows)), axis=1, keepdims=True)
    negative_mask = tf.logical_and(tf.logical_not(nbrs), candidates[None, :])
    return _anchor_rows_top_k(positive, rows, negative_mask, margin, top_k)


def _static_masked_neighbourhood_loss(dist: tf.Tensor, neighbours: tf.Tensor, anchors: tf.Tensor,
                                      candidates: tf.Tensor, *, margin: float, top_k: int) -> tf.Tensor:
    """`_masked_neighbourhood_loss` without gathering the anchor rows (exactly the same value).

    Every row gets its top-k hinge sum; the rows outside `anchors` are then
    dropped from the mean. No anchor gives 0, as in the dynamic form.
    """
    k = _static_k(dist, top_k)
    positive = tf.reduce_max(tf.where(neighbours, dist, tf.zeros_like(dist)), axis=1, keepdims=True)
    negative_mask = tf.logical_and(tf.logical_not(neighbours), candidates[None, :])
    hinge = tf.clip_by_value(margin + positive - dist, 0.0, HINGE_MAX)
    hinge = tf.where(negative_mask, hinge, tf.zeros_like(hinge))
    row_sums = tf.reduce_sum(tf.math.top_k(hinge, k=k).values, axis=1)
    total = tf.reduce_sum(tf.where(anchors, row_sums, tf.zeros_like(row_sums)))
    count = tf.reduce_sum(tf.cast(anchors, dist.dtype)) * tf.cast(k, dist.dtype)
    return tf.math.divide_no_nan(total, count)


def _static_region_anchor_loss(dist: tf.Tensor, positive: tf.Tensor, phrase_negative: tf.Tensor,
                               margin: float, k: int,
                               max_positives: int = MAX_POSITIVES_PER_ANCHOR) -> tf.Tensor:
    """Static-shape λ1 term of `phrase_localization_loss` (region anchors).

    `dist` and `positive` are (P, R). A positive pair (p, r) ranks r's
    distance to p against its distances to the phrases q with
    `phrase_negative[p, q]` and not `positive[q, r]`: the negatives depend on
    the pair, not on the anchor alone, so the pairs are enumerated per
    phrase with a static cap on positive regions per phrase, giving a
    (P, cap, P) candidate tensor; top-k over its last axis. Caps as in
    `_static_anchor_ranking_loss`: `max_positives`, then all R regions when
    P·R·P <= `FALLBACK_ELEMENTS`, else 8·`max_positives`. Exact (same value
    as the dynamic form) whenever no phrase has more positive regions than
    the last cap, always the case when P·R·P <= `FALLBACK_ELEMENTS`.
    """
    positive_t = tf.transpose(positive)
    k = _static_k(positive_t, k)

    def total_for_cap(cap):
        # Transposed inside the branch: the gradient of the gather below is
        # then made dense inside the branch, where XLA knows its shape.
        dist_t = tf.transpose(dist)             # (R, P): row r = d(every phrase, r)
        regions, pair_valid = _first_positives(positive, cap, dist.dtype)    # (P, cap)
        positive_dist = tf.gather(dist, regions, batch_dims=1)
        candidates = tf.gather(dist_t, regions)                               # (P, cap, P)
        negative = tf.logical_and(phrase_negative[:, None, :],
                                  tf.logical_not(tf.gather(positive_t, regions)))
        closest, valid = _closest_negatives(candidates, negative, k)          # (P, cap, k)
        hinge = tf.clip_by_value(margin + positive_dist[:, :, None] - closest, 0.0, HINGE_MAX)
        keep = tf.logical_and(pair_valid[:, :, None], valid)
        return tf.reduce_sum(tf.where(keep, hinge, tf.zeros_like(hinge)))

    num_p = dist.shape[0]
    caps = _positive_caps(dist.shape[1], max_positives,
                          None if num_p is None else int(num_p) * int(num_p))
    total = _sum_over_capped_positives(positive, caps, total_for_cap)
    count = tf.reduce_sum(tf.cast(positive, dist.dtype)) * tf.cast(k, dist.dtype)
    return tf.math.divide_no_nan(total, count)


def phrase_localization_loss(region_embeds: tf.Tensor, phrase_embeds: tf.Tensor,
                             phrase_region_positive: tf.Tensor, phrase_region_negative: tf.Tensor,
                             phrase_phrase_negative: tf.Tensor, region_neighbours: tf.Tensor | None = None,
                             phrase_neighbours: tf.Tensor | None = None, *, margin: float = 0.05,
                             top_k: int = 30, region_anchor_weight: float = 1.0,
                             phrase_anchor_weight: float = 4.0, region_neighbour_weight: float = 0.1,
                             phrase_neighbour_weight: float = 0.1,
                             static_shapes: bool = False) -> tf.Tensor:
    """TPAMI eq. 6 on an Algorithm 1 batch (`tf_twobranch.sampling.phrase_localization`).

    Every True entry (p, r) of `phrase_region_positive` is a positive pair
    (x = region r, y = phrase p) and one anchor row of each ranking term:

    * λ1, region anchor (x, y, y′): y′ ranges over phrases q with
      `phrase_phrase_negative[p, q]` (outside y's coreference chain) that are
      not themselves positives of r;
    * λ2, phrase anchor (y, x, x′): x′ ranges over regions with
      `phrase_region_negative[p, :]` (IoU < 0.3 in y's image, hard negatives);
    * λ3, region neighbourhood: anchors are the target regions (those with a
      positive), neighbours `region_neighbours`, negatives the other target
      regions;
    * λ4, phrase neighbourhood: anchors are the phrases with a positive,
      neighbours `phrase_neighbours` (same chain), negatives the other such
      phrases.

    Each term keeps, per anchor row, the `top_k` (K = 30) largest hinge
    values [m + d(pos) − d(neg)]_+ and averages over rows and K, like the
    image–sentence loss; a term with no anchor rows is 0. Padded slots are
    never True in the masks. Neighbourhood terms need the neighbour masks
    (from a batch built with neighbourhood sampling) when their weight is > 0.

    `static_shapes=True` computes the terms without data-dependent shapes
    (needed under XLA): λ2, λ3 and λ4 give exactly the same value; λ1 too
    unless a phrase has more than 64 positive regions in a batch with
    P·R·P > 2^24 slots (`_static_region_anchor_loss`).
    """
    positive = tf.cast(phrase_region_positive, tf.bool)
    dist = pairwise_distance(phrase_embeds, region_embeds)  # (P, R)
    loss = tf.constant(0.0, dtype=dist.dtype)
    if static_shapes:
        return _static_phrase_localization_loss(
            region_embeds, phrase_embeds, dist, positive, phrase_region_negative,
            phrase_phrase_negative, region_neighbours, phrase_neighbours, margin=margin,
            top_k=top_k, region_anchor_weight=region_anchor_weight,
            phrase_anchor_weight=phrase_anchor_weight,
            region_neighbour_weight=region_neighbour_weight,
            phrase_neighbour_weight=phrase_neighbour_weight)
    pairs = tf.where(positive)
    positive_dist = tf.gather_nd(dist, pairs)[:, None]
    if phrase_anchor_weight:
        rows = tf.gather(dist, pairs[:, 0])
        negative_mask = tf.gather(tf.cast(phrase_region_negative, tf.bool), pairs[:, 0])
        loss += phrase_anchor_weight * _anchor_rows_top_k(positive_dist, rows, negative_mask, margin, top_k)
    if region_anchor_weight:
        dist_t = tf.transpose(dist)
        rows = tf.gather(dist_t, pairs[:, 1])
        negative_mask = tf.logical_and(
            tf.gather(tf.cast(phrase_phrase_negative, tf.bool), pairs[:, 0]),
            tf.logical_not(tf.gather(tf.transpose(positive), pairs[:, 1])))
        loss += region_anchor_weight * _anchor_rows_top_k(positive_dist, rows, negative_mask, margin, top_k)
    return loss + _neighbour_terms(region_embeds, phrase_embeds, positive, region_neighbours,
                                   phrase_neighbours, margin=margin, top_k=top_k,
                                   region_neighbour_weight=region_neighbour_weight,
                                   phrase_neighbour_weight=phrase_neighbour_weight,
                                   masked_loss=_masked_neighbourhood_loss)


def _neighbour_terms(region_embeds, phrase_embeds, positive, region_neighbours, phrase_neighbours,
                     *, margin, top_k, region_neighbour_weight, phrase_neighbour_weight,
                     masked_loss) -> tf.Tensor:
    """λ3/λ4 neighbourhood terms of Algorithm 1 batches (dynamic or static `masked_loss`)."""
    loss = tf.constant(0.0, dtype=region_embeds.dtype)
    if region_neighbour_weight:
        if region_neighbours is None:
            raise ValueError("region_neighbour_weight > 0 needs region_neighbours")
        targets = tf.reduce_any(positive, axis=0)
        loss += region_neighbour_weight * masked_loss(
            pairwise_distance(region_embeds, region_embeds), tf.cast(region_neighbours, tf.bool),
            targets, targets, margin=margin, top_k=top_k)
    if phrase_neighbour_weight:
        if phrase_neighbours is None:
            raise ValueError("phrase_neighbour_weight > 0 needs phrase_neighbours")
        anchors = tf.reduce_any(positive, axis=1)
        loss += phrase_neighbour_weight * masked_loss(
            pairwise_distance(phrase_embeds, phrase_embeds), tf.cast(phrase_neighbours, tf.bool),
            anchors, anchors, margin=margin, top_k=top_k)
    return loss


def _static_phrase_localization_loss(region_embeds, phrase_embeds, dist, positive,
                                     phrase_region_negative, phrase_phrase_negative,
                                     region_neighbours, phrase_neighbours, *, margin, top_k,
                                     region_anchor_weight, phrase_anchor_weight,
                                     region_neighbour_weight, phrase_neighbour_weight) -> tf.Tensor:
    """The `static_shapes=True` branch of `phrase_localization_loss`."""
    loss = tf.constant(0.0, dtype=dist.dtype)
    if phrase_anchor_weight:
        loss += phrase_anchor_weight * _static_anchor_ranking_loss(
            dist, positive, tf.cast(phrase_region_negative, tf.bool), margin, top_k)
    if region_anchor_weight:
        loss += region_anchor_weight * _static_region_anchor_loss(
            dist, positive, tf.cast(phrase_phrase_negative, tf.bool), margin, top_k)
    return loss + _neighbour_terms(region_embeds, phrase_embeds, positive, region_neighbours,
                                   phrase_neighbours, margin=margin, top_k=top_k,
                                   region_neighbour_weight=region_neighbour_weight,
                                   phrase_neighbour_weight=phrase_neighbour_weight,
                                   masked_loss=_static_masked_neighbourhood_loss)


def phrase_localization_batch_loss(region_embeds: tf.Tensor, phrase_embeds: tf.Tensor, batch: dict,
                                   **kwargs) -> tf.Tensor:
    """`phrase_localization_loss` with the masks taken from an Algorithm 1 batch dict."""
    return phrase_localization_loss(
        region_embeds, phrase_embeds, batch["phrase_region_positive"], batch["phrase_region_negative"],
        batch["phrase_phrase_negative"], batch.get("region_neighbours"), batch.get("phrase_neighbours"),
        **kwargs)


def masked_logistic_pair_loss(logits: tf.Tensor, labels: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """`logistic_pair_loss` averaged over the pairs where `mask` is True (padded batches); 0 if none."""
    logits = tf.reshape(logits, [-1])
    mask = tf.reshape(tf.cast(mask, tf.bool), [-1])
    z = tf.cast(tf.where(tf.reshape(labels, [-1]) > 0, 1.0, -1.0), logits.dtype)
    values = tf.where(mask, tf.nn.softplus(-z * logits), tf.zeros_like(logits))
    return tf.math.divide_no_nan(tf.reduce_sum(values), tf.reduce_sum(tf.cast(mask, logits.dtype)))


_PHRASE_MASK_KEYS = ("phrase_region_positive", "phrase_region_negative", "phrase_phrase_negative",
                     "region_neighbours", "phrase_neighbours")


@keras.saving.register_keras_serializable(package="tf_twobranch")
class PhraseLocalizationLoss(keras.losses.Loss):
    """Keras wrapper of `phrase_localization_loss`.

    `y_true` is the batch dict (or a tuple of the five masks in the order of
    the function's arguments); `y_pred` is (region_embeds, phrase_embeds).
    """

    def __init__(self, margin=0.05, top_k=30, region_anchor_weight=1.0, phrase_anchor_weight=4.0,
                 region_neighbour_weight=0.1, phrase_neighbour_weight=0.1,
                 name="phrase_localization_loss", reduction="sum_over_batch_size", **kwargs):
        super().__init__(name=name, reduction=reduction, **kwargs)
        self.margin = margin
        self.top_k = top_k
        self.region_anchor_weight = region_anchor_weight
        self.phrase_anchor_weight = phrase_anchor_weight
        self.region_neighbour_weight = region_neighbour_weight
        self.phrase_neighbour_weight = phrase_neighbour_weight

    def _kwargs(self):
        return dict(margin=self.margin, top_k=self.top_k, region_anchor_weight=self.region_anchor_weight,
                    phrase_anchor_weight=self.phrase_anchor_weight,
                    region_neighbour_weight=self.region_neighbour_weight,
                    phrase_neighbour_weight=self.phrase_neighbour_weight)

    def call(self, y_true, y_pred):
        region_embeds, phrase_embeds = y_pred
        masks = [y_true.get(k) for k in _PHRASE_MASK_KEYS] if isinstance(y_true, dict) else list(y_true)
        return phrase_localization_loss(region_embeds, phrase_embeds, *masks, **self._kwargs())

    def __call__(self, y_true, y_pred, sample_weight=None):
        return self.call(y_true, y_pred)

    def get_config(self):
        config = super().get_config()
        config.update(self._kwargs())
        return config


# --- Dual-path CNN with instance loss (Zheng et al. 2020, §4) -----------------
#
# Both functions return one value per *local* anchor so a model can follow the
# global-batch contract of `tf_twobranch.distribute`: anchors are this
# replica's rows, galleries are the all-gathered rows of every replica, and the
# loss is ``sum(per_example) / distribute.global_count(n_local)``.
#
# Ranking negatives (paper eq. 4 has one negative per anchor; the reference
# code picks, for each anchor image, the hardest of 256 random training
# captions, and for each anchor caption a random other image of the batch):
#
# ============  =================================  ===============================
# negatives     image anchor (negatives: texts)    text anchor (negatives: images)
# ============  =================================  ===============================
# "in_batch"    mean hinge over all its negatives  mean hinge over all negatives
#  (default)    = E[eq. 4] for a uniformly random  (same)
#               negative of the gallery
# "hardest"     hinge of its most similar negative hinge of its most similar
#               (hardest-in-gallery, VSE++ style)  negative
# "reference"   hardest (reference: hardest of N   mean (reference: a random
#               random captions)                   other image of the batch)
# ============  =================================  ===============================
#
# Negatives of an image anchor are the gallery texts with a different label
# plus `extra_negative_text_embeds` (the reference's N random captions; with
# `extra_negative_text_labels`, those sharing the anchor's label are skipped).
# Items with the anchor's label (CUHK-PEDES identities repeat within a batch)
# are neither positives nor negatives: the positive of row b is its own pair
# (image b, text b). An anchor without any negative contributes 0.

RANKING_NEGATIVES = ("in_batch", "hardest", "reference")


def instance_loss(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Instance loss (eqs. 5-8): per-example softmax cross-entropy, shape (batch,).

    `logits` (batch, num_classes) are W_share applied to one branch's
    features; `labels` (batch,) the image/text group (or identity) ids.
    Computed in float32 whatever the compute dtype of the logits.
    """
    logits = tf.cast(logits, tf.float32)
    labels = tf.cast(tf.reshape(labels, [-1]), tf.int32)
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def cosine_similarity_matrix(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Cosine similarities (len(a), len(b)) in float32 (the paper's D)."""
    a = tf.math.l2_normalize(tf.cast(a, tf.float32), axis=-1, epsilon=1e-12)
    b = tf.math.l2_normalize(tf.cast(b, tf.float32), axis=-1, epsilon=1e-12)
    return tf.matmul(a, b, transpose_b=True)


def _aggregate_hinge(hinge: tf.Tensor, negatives: tf.Tensor, mode: str) -> tf.Tensor:
    """Per-row mean (mode "mean") or hardest (mode "max") hinge over masked negatives."""
    mask = tf.cast(negatives, hinge.dtype)
    if mode == "mean":
        return tf.math.divide_no_nan(tf.reduce_sum(hinge * mask, axis=1),
                                     tf.reduce_sum(mask, axis=1))
    # Hinge is monotone in the negative's similarity, so the largest hinge is
    # the hinge of the most similar (hardest) negative; rows with no negative
    # give max(0, ...) = 0.
    return tf.reduce_max(hinge * mask, axis=1)


def cosine_ranking_loss(image_embeds: tf.Tensor, text_embeds: tf.Tensor,
                        image_labels: tf.Tensor, text_labels: tf.Tensor, *,
                        gallery_image_embeds: tf.Tensor | None = None,
                        gallery_text_embeds: tf.Tensor | None = None,
                        gallery_image_labels: tf.Tensor | None = None,
                        gallery_text_labels: tf.Tensor | None = None,
                        extra_negative_text_embeds: tf.Tensor | None = None,
                        extra_negative_text_labels: tf.Tensor | None = None,
                        margin: float = 1.0, negatives: str = "in_batch",
                        per_example: bool = False) -> tf.Tensor:
    """Bidirectional hinge on cosine similarity (Zheng et al. eq. 4).

    Row b of the anchors is a positive pair (image b, text b). For each row::

        image anchor: [α − (D(I_b, T_b) − D(I_b, T_n))]_+ over negative texts T_n
        text anchor:  [α − (D(T_b, I_b) − D(T_b, I_n))]_+ over negative images I_n

    aggregated over negatives as set by `negatives` (see the table above).

    Args:
      image_embeds, text_embeds: (B, d) the local anchors (unnormalised; the
        cosine normalises them).
      image_labels, text_labels: (B,) group ids of the anchors.
      gallery_*: the gathered global batch (`distribute.cross_replica_concat`
        of the anchors and labels); default: the anchors themselves.
      extra_negative_text_embeds: optional (N, d) further negative texts of
        every image anchor (the reference's N random captions).
      extra_negative_text_labels: optional (N,) their labels, to skip those
        sharing an anchor's label; without them all N are negatives.
      margin: α (1 in the paper).
      negatives: "in_batch", "hardest" or "reference".
      per_example: return the (B,) per-row values (image-anchor + text-anchor
        term) instead of their mean.
    """
    if negatives not in RANKING_NEGATIVES:
        raise ValueError(f"negatives must be one of {RANKING_NEGATIVES}, got {negatives!r}")
    image_mode = "mean" if negatives == "in_batch" else "max"
    text_mode = "max" if negatives == "hardest" else "mean"
    if gallery_image_embeds is None:
        gallery_image_embeds, gallery_image_labels = image_embeds, image_labels
    if gallery_text_embeds is None:
        gallery_text_embeds, gallery_text_labels = text_embeds, text_labels
    image_labels = tf.reshape(tf.cast(image_labels, tf.int32), [-1])
    text_labels = tf.reshape(tf.cast(text_labels, tf.int32), [-1])
    gallery_image_labels = tf.reshape(tf.cast(gallery_image_labels, tf.int32), [-1])
    gallery_text_labels = tf.reshape(tf.cast(gallery_text_labels, tf.int32), [-1])

    image_unit = tf.math.l2_normalize(tf.cast(image_embeds, tf.float32), axis=-1, epsilon=1e-12)
    text_unit = tf.math.l2_normalize(tf.cast(text_embeds, tf.float32), axis=-1, epsilon=1e-12)
    positive = tf.reduce_sum(image_unit * text_unit, axis=1, keepdims=True)  # (B, 1)

    # Image anchors against texts.
    sim_texts = cosine_similarity_matrix(image_embeds, gallery_text_embeds)
    text_negative = tf.not_equal(image_labels[:, None], gallery_text_labels[None, :])
    if extra_negative_text_embeds is not None:
        sim_extra = cosine_similarity_matrix(image_embeds, extra_negative_text_embeds)
        if extra_negative_text_labels is not None:
            extra_labels = tf.reshape(tf.cast(extra_negative_text_labels, tf.int32), [-1])
            extra_negative = tf.not_equal(image_labels[:, None], extra_labels[None, :])
        else:
            extra_negative = tf.ones(tf.shape(sim_extra), tf.bool)
        sim_texts = tf.concat([sim_texts, sim_extra], axis=1)
        text_negative = tf.concat([text_negative, extra_negative], axis=1)
    image_term = _aggregate_hinge(tf.nn.relu(margin - positive + sim_texts), text_negative,
                                  image_mode)

    # Text anchors against images.
    sim_images = cosine_similarity_matrix(text_embeds, gallery_image_embeds)
    image_negative = tf.not_equal(text_labels[:, None], gallery_image_labels[None, :])
    text_term = _aggregate_hinge(tf.nn.relu(margin - positive + sim_images), image_negative,
                                 text_mode)

    values = image_term + text_term
    return values if per_example else tf.reduce_mean(values)


@keras.saving.register_keras_serializable(package="tf_twobranch")
class InstanceLoss(keras.losses.Loss):
    """Keras wrapper of `instance_loss`: `y_true` labels, `y_pred` logits; mean."""

    def __init__(self, name="instance_loss", reduction="sum_over_batch_size", **kwargs):
        super().__init__(name=name, reduction=reduction, **kwargs)

    def call(self, y_true, y_pred):
        return instance_loss(y_pred, y_true)

    def __call__(self, y_true, y_pred, sample_weight=None):
        return tf.reduce_mean(self.call(y_true, y_pred))


@keras.saving.register_keras_serializable(package="tf_twobranch")
class CosineRankingLoss(keras.losses.Loss):
    """Keras wrapper of `cosine_ranking_loss` (mean over rows).

    `y_true` is the (B,) label vector shared by the image and the text of a
    row, or a tuple (image_labels, text_labels); `y_pred` is
    (image_embeds, text_embeds).
    """

    def __init__(self, margin=1.0, negatives="in_batch", name="cosine_ranking_loss",
                 reduction="sum_over_batch_size", **kwargs):
        super().__init__(name=name, reduction=reduction, **kwargs)
        if negatives not in RANKING_NEGATIVES:
            raise ValueError(f"negatives must be one of {RANKING_NEGATIVES}, got {negatives!r}")
        self.margin = margin
        self.negatives = negatives

    def call(self, y_true, y_pred):
        image_embeds, text_embeds = y_pred
        if isinstance(y_true, (tuple, list)):
            image_labels, text_labels = y_true
        else:
            image_labels = text_labels = y_true
        return cosine_ranking_loss(image_embeds, text_embeds, image_labels, text_labels,
                                   margin=self.margin, negatives=self.negatives)

    def __call__(self, y_true, y_pred, sample_weight=None):
        return self.call(y_true, y_pred)

    def get_config(self):
        config = super().get_config()
        config.update(margin=self.margin, negatives=self.negatives)
        return config
