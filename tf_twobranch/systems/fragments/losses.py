"""Deep fragment embedding objectives (Karpathy, Joulin & Fei-Fei, NIPS 2014, §3.3).

A batch holds B images and B sentences, image k paired with sentence k.
Fragments are padded: image fragments ``v`` (B, M, h) with ``image_mask``
(B, M) and sentence fragments ``s`` (B, F, h) with ``sentence_mask`` (B, F).
The fragment scores vᵢᵀsⱼ of every pair form a (B, M, B, F) tensor; padded
entries never count.

* `fragment_alignment_labels`: y = +1 inside a positive bag (same pair),
  −1 elsewhere (eq. 4); with ``mil`` the mi-SVM heuristic of eq. 5 inside
  positive bags: y = sign(vᵀs), and a sentence fragment whose bag has no
  positive gets its best-scoring image fragment as the positive. A score of
  exactly 0 (an all-zero ReLU sentence fragment) is a negative by default
  (``mil_zero_score="negative"``); the authors' code (`DeFragCost.m`) keeps
  MATLAB's sign(0) = 0, and a forced positive of score 0 becomes 2: neither
  is ±1, so such pairs carry no weight (``mil_zero_score="ignored"``,
  label 0).
* `fragment_alignment_objective`: C₀ = Σ max(0, margin − y·vᵀs) over all
  valid fragment pairs with y ≠ 0 (eq. 4; margin 1), or the authors' code's
  class-balanced form (per sentence fragment, positives weighted 1/#pos and
  negatives 1/#neg; ``class_balanced=True``).
* `global_scores`: S_kl = Σ_{j∈g_l} acc_{i∈g_k}(vᵢᵀsⱼ) / (|g_k|(|g_l| + n))
  (eq. 6, n = 5), or the code's 1/(|g_l| + n) (``normaliser="code"``,
  smoothnum 10 there). The accumulation ``global_score`` (`GLOBAL_SCORES`):
  ``sum_relu`` Σ_i max(0, vᵢᵀsⱼ) (the paper; the code's thrglobalscore=1,
  maxaccum=0); ``sum`` Σ_i vᵢᵀsⱼ (thrglobalscore=0); ``max_relu``
  max_i max(0, vᵢᵀsⱼ) (maxaccum=1): each sentence fragment takes its best
  image fragment; ``max`` max_i vᵢᵀsⱼ (the code's `DriverSetParams.m`
  defaults, thrglobalscore=0 and maxaccum=1, "the CVPR implementation").
  A sentence without fragments scores 0 with every image.
* `global_ranking_objective`: C_G = Σ_k [Σ_{l≠k} max(0, S_kl − S_kk + Δ) +
  Σ_{l≠k} max(0, S_lk − S_kk + Δ)] (eq. 7).

All are pure functions of tensors; the model adds C_F + β·C_G (+ α‖θ‖² as
weight decay). Sums, not means, as in the paper; the learning rate absorbs
the scale.
"""
from __future__ import annotations

import tensorflow as tf

__all__ = ["NORMALISERS", "GLOBAL_SCORES", "MIL_ZERO_SCORES", "fragment_scores", "fragment_alignment_labels",
           "fragment_alignment_objective", "global_scores", "global_scores_from_fragment_scores",
           "global_score_denominators", "accumulate_image_fragments",
           "global_ranking_objective"]

NORMALISERS = ("paper", "code")
GLOBAL_SCORES = ("sum_relu", "sum", "max_relu", "max")
MIL_ZERO_SCORES = ("negative", "ignored")


def _check_choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def fragment_scores(image_fragments, sentence_fragments) -> tf.Tensor:
    """vᵢᵀsⱼ for every image fragment of every image and sentence fragment of every sentence: (Bi, M, Bs, F)."""
    return tf.einsum("kmh,lfh->kmlf", image_fragments, sentence_fragments)


def _pair_masks(image_mask, sentence_mask):
    image_mask = tf.cast(image_mask, tf.bool)
    sentence_mask = tf.cast(sentence_mask, tf.bool)
    valid = image_mask[:, :, None, None] & sentence_mask[None, None, :, :]
    b = tf.shape(image_mask)[0]
    same_pair = tf.eye(b, tf.shape(sentence_mask)[0], dtype=tf.bool)[:, None, :, None]
    return valid, valid & same_pair


def fragment_alignment_labels(scores, image_mask, sentence_mask, *, mil: bool = False,
                              mil_zero_score: str = "negative") -> tf.Tensor:
    """y ∈ {−1, 0, +1} of every fragment pair, shaped like `scores` (see the module docstring).

    0 only with ``mil`` and ``mil_zero_score="ignored"``: a positive-bag pair scoring exactly 0.
    """
    _check_choice("mil_zero_score", mil_zero_score, MIL_ZERO_SCORES)
    scores = tf.convert_to_tensor(scores)
    _, positive_bag = _pair_masks(image_mask, sentence_mask)
    if not mil:
        return tf.where(positive_bag, 1.0, -1.0)
    positive = positive_bag & (scores > 0)
    # Bags of a sentence fragment: its own image's valid fragments (axis 1 of
    # the diagonal block). A bag with no positive gets its arg-max forced.
    has_positive = tf.reduce_any(positive, axis=1, keepdims=True)
    in_bag = tf.where(positive_bag, scores, tf.fill(tf.shape(scores), scores.dtype.min))
    best = tf.one_hot(tf.argmax(in_bag, axis=1), tf.shape(scores)[1], axis=1) > 0
    bag_exists = tf.reduce_any(positive_bag, axis=1, keepdims=True)
    forced = best & positive_bag & ~has_positive & bag_exists
    if mil_zero_score == "negative":
        return tf.where(positive | forced, 1.0, -1.0)
    # The code: Y = sign(score) in the bag, +2 on the forced arg-max; only ±1 are weighted.
    zero = positive_bag & tf.equal(scores, 0.0)
    return tf.where(positive | (forced & ~zero), 1.0, tf.where(zero, 0.0, -1.0))


def fragment_alignment_objective(scores, labels, image_mask, sentence_mask, *, margin: float = 1.0,
                                 class_balanced: bool = False) -> tf.Tensor:
    """C₀ (or C_F given MIL labels): hinge over every valid fragment pair labelled ±1 (scalar)."""
    valid, _ = _pair_masks(image_mask, sentence_mask)
    labels = tf.cast(labels, scores.dtype)
    validf = tf.cast(valid, scores.dtype)
    positives = tf.cast(labels > 0, scores.dtype) * validf
    negatives = tf.cast(labels < 0, scores.dtype) * validf
    # tf.where, not a product with the mask: a padded pair's score may be anything.
    hinge = tf.where(valid & tf.not_equal(labels, 0.0), tf.nn.relu(margin - labels * scores),
                     tf.zeros_like(scores))
    if not class_balanced:
        return tf.reduce_sum(hinge)
    # Per sentence fragment (axes 2, 3): counts over all image fragments (axes 0, 1).
    num_pos = tf.reduce_sum(positives, axis=[0, 1], keepdims=True)
    num_neg = tf.reduce_sum(negatives, axis=[0, 1], keepdims=True)
    weights = positives / tf.maximum(num_pos, 1.0) + negatives / tf.maximum(num_neg, 1.0)
    return tf.reduce_sum(weights * hinge)


def accumulate_image_fragments(scores, image_mask, *, global_score: str = "sum_relu") -> tf.Tensor:
    """Each image's valid fragments (axis 1 of `scores`, masked by `image_mask` (Bi, M)) accumulated.

    `scores` is (Bi, M, ...) and the result (Bi, ...): Σ_i or max_i of vᵢᵀsⱼ,
    thresholded at 0 first for the ``_relu`` variants (`GLOBAL_SCORES`). An
    image without a valid fragment accumulates 0. Shared by the training
    objective and the retrieval scorer, so both rank with the same S_kl.
    """
    _check_choice("global_score", global_score, GLOBAL_SCORES)
    if global_score.endswith("_relu"):
        scores = tf.nn.relu(scores)
    if global_score.startswith("sum"):
        # The mask as the weights of one contraction: no second temporary of the scores' size.
        return tf.einsum("km...,km->k...", scores, tf.cast(image_mask, scores.dtype))
    mask = tf.cast(image_mask, tf.bool)
    mask = tf.reshape(mask, tf.concat([tf.shape(mask), tf.ones([scores.shape.rank - 2], tf.int32)], 0))
    best = tf.reduce_max(tf.where(mask, scores, tf.fill(tf.shape(scores), tf.constant(-float("inf"), scores.dtype))),
                         axis=1)
    return tf.where(tf.reduce_any(mask, axis=1), best, tf.zeros_like(best))


def global_scores_from_fragment_scores(scores, image_mask, sentence_mask, *, smoothing: float = 5.0,
                                       normaliser: str = "paper", global_score: str = "sum_relu") -> tf.Tensor:
    """S (Bi, Bs) of eq. 6 from the fragment scores (see the module docstring)."""
    sentence_weight = tf.cast(sentence_mask, scores.dtype)
    per_sentence_fragment = accumulate_image_fragments(scores, image_mask, global_score=global_score)
    total = tf.einsum("klf,lf->kl", per_sentence_fragment, sentence_weight)
    return total / global_score_denominators(tf.reduce_sum(tf.cast(image_mask, scores.dtype), axis=1),
                                             tf.reduce_sum(sentence_weight, axis=1),
                                             smoothing=smoothing, normaliser=normaliser,
                                             dtype=scores.dtype)


def global_score_denominators(image_sizes, sentence_sizes, *, smoothing: float = 5.0,
                              normaliser: str = "paper", dtype=tf.float32) -> tf.Tensor:
    """The (Bi, Bs) normaliser of eq. 6 from |g_k| (Bi,) and |g_l| (Bs,): (|g_k|)(|g_l| + n) or |g_l| + n."""
    _check_choice("normaliser", normaliser, NORMALISERS)
    denominator = (tf.cast(sentence_sizes, dtype) + smoothing)[None, :]
    image_sizes = tf.cast(image_sizes, dtype)
    if normaliser == "paper":
        return tf.maximum(image_sizes, 1.0)[:, None] * denominator
    return tf.ones_like(image_sizes)[:, None] * denominator


def global_scores(image_fragments, image_mask, sentence_fragments, sentence_mask, *,
                  smoothing: float = 5.0, normaliser: str = "paper", global_score: str = "sum_relu") -> tf.Tensor:
    """S (Bi, Bs) of eq. 6 between every image and every sentence."""
    return global_scores_from_fragment_scores(
        fragment_scores(image_fragments, sentence_fragments), image_mask, sentence_mask,
        smoothing=smoothing, normaliser=normaliser, global_score=global_score)


def global_ranking_objective(global_score_matrix, *, margin: float) -> tf.Tensor:
    """C_G of eq. 7 for a square S whose diagonal holds the true pairs (scalar)."""
    s = global_score_matrix
    diagonal = tf.linalg.diag_part(s)
    off_diagonal = 1.0 - tf.eye(tf.shape(s)[0], dtype=s.dtype)
    rank_sentences = tf.nn.relu(s - diagonal[:, None] + margin)   # S_kl vs S_kk, row k
    rank_images = tf.nn.relu(s - diagonal[None, :] + margin)      # S_lk vs S_kk, column k
    return tf.reduce_sum((rank_sentences + rank_images) * off_diagonal)
