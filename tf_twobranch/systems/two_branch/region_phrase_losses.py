"""Phrase-localization losses (TPAMI 2018 Algorithm 1; CVPR 2016).

The ranking loss of TPAMI eq. 6 on an Algorithm 1 batch
(`tf_twobranch.systems.two_branch.region_phrase_sampling`): phrase and region anchor
terms and masked neighbourhood terms over the batch's phrase–region masks,
in a dynamic form and a static-shape (XLA-compilable) form with the same
value. The distances and top-K hinges are those of
`tf_twobranch.losses.common`.

There is deliberately no Keras `Loss` class here: `phrase_localization_loss`
is a batch-level objective. Each term averages top-K hinges over its own
anchor set: positive pairs for the two anchor terms, target regions and
matched phrases for the neighbourhood terms. The terms are combined with
weights, and the negatives come from masks over the whole batch. No
per-example vector exists whose Keras reduction is this value and to which
a `sample_weight` could apply. The models call the pure function from their
train step (`TwoBranchModel.objective`, via
`phrase_localization_batch_loss`).
"""
from __future__ import annotations

import tensorflow as tf

from tf_twobranch.losses.common import (HINGE_MAX, MAX_POSITIVES_PER_ANCHOR, closest_negatives,
                                        first_positives, pairwise_distance, positive_caps,
                                        static_anchor_ranking_loss, static_k,
                                        sum_over_capped_positives, top_k_hinge)

# Margin: TPAMI 2018 states m = 0.05 only for its image-sentence experiments
# ("we fix the margin m=0.05 for all terms in our image-sentence
# experiments"); the phrase-localization margin is not given. CVPR 2016 used
# m = 0.1 for every experiment, phrase localization included. The default
# here is 0.05 (the two-branch paper's one stated value, and the original
# code's); pass margin=0.1 to follow the CVPR 2016 setting.


def _anchor_rows_top_k(positive: tf.Tensor, rows: tf.Tensor, negative_mask: tf.Tensor,
                       margin: float, k: int) -> tf.Tensor:
    """`top_k_hinge` that returns 0 (not NaN) when there are no anchor rows."""
    return tf.cond(tf.shape(rows)[0] > 0,
                   lambda: top_k_hinge(positive, rows, negative_mask, margin, k),
                   lambda: tf.constant(0.0, rows.dtype))


def _masked_neighbourhood_loss(dist: tf.Tensor, neighbours: tf.Tensor, anchors: tf.Tensor,
                               candidates: tf.Tensor, *, margin: float, top_k: int) -> tf.Tensor:
    """Neighbourhood term over the rows `anchors`; negatives are `candidates` outside the neighbourhood.

    As `ranking.neighbourhood_loss`, the positive distance of an anchor is its
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
    k = static_k(dist, top_k)
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
    `static_anchor_ranking_loss`: `max_positives`, then all R regions when
    P·R·P <= `FALLBACK_ELEMENTS`, else 8·`max_positives`. Exact (same value
    as the dynamic form) whenever no phrase has more positive regions than
    the last cap, always the case when P·R·P <= `FALLBACK_ELEMENTS`.
    """
    positive_t = tf.transpose(positive)
    k = static_k(positive_t, k)

    def total_for_cap(cap):
        # Transposed inside the branch: the gradient of the gather below is
        # then made dense inside the branch, where XLA knows its shape.
        dist_t = tf.transpose(dist)             # (R, P): row r = d(every phrase, r)
        regions, pair_valid = first_positives(positive, cap, dist.dtype)     # (P, cap)
        positive_dist = tf.gather(dist, regions, batch_dims=1)
        candidates = tf.gather(dist_t, regions)                               # (P, cap, P)
        negative = tf.logical_and(phrase_negative[:, None, :],
                                  tf.logical_not(tf.gather(positive_t, regions)))
        closest, valid = closest_negatives(candidates, negative, k)           # (P, cap, k)
        hinge = tf.clip_by_value(margin + positive_dist[:, :, None] - closest, 0.0, HINGE_MAX)
        keep = tf.logical_and(pair_valid[:, :, None], valid)
        return tf.reduce_sum(tf.where(keep, hinge, tf.zeros_like(hinge)))

    num_p = dist.shape[0]
    caps = positive_caps(dist.shape[1], max_positives,
                         None if num_p is None else int(num_p) * int(num_p))
    total = sum_over_capped_positives(positive, caps, total_for_cap)
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
    """TPAMI eq. 6 on an Algorithm 1 batch (`tf_twobranch.systems.two_branch.region_phrase_sampling`).

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
    # λ3: regions that are some phrase's positive (axis 0 of `positive`);
    # λ4: phrases with a positive region (axis 1).
    for name, weight, embeds, neighbours, axis in (
            ("region", region_neighbour_weight, region_embeds, region_neighbours, 0),
            ("phrase", phrase_neighbour_weight, phrase_embeds, phrase_neighbours, 1)):
        if not weight:
            continue
        if neighbours is None:
            raise ValueError(f"{name}_neighbour_weight > 0 needs {name}_neighbours")
        anchors = tf.reduce_any(positive, axis=axis)
        loss += weight * masked_loss(pairwise_distance(embeds, embeds), tf.cast(neighbours, tf.bool),
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
        loss += phrase_anchor_weight * static_anchor_ranking_loss(
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
