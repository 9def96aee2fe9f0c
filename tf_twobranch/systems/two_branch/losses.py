"""Two-branch image–sentence losses (Wang et al., TPAMI 2018; CVPR 2016).

Embedding network: the bidirectional ranking loss with neighbourhood
constraints (TPAMI eqs. 1–6) and the original implementation's
`embedding_loss`. Similarity network: the logistic pair loss (eq. 7) and its
masked form for padded batches.

Conventions:

* `labels` is a boolean matrix of shape (num_texts, num_images); entry (s, i)
  is True when text s and image i are a positive pair.
* Distances and the "top-K in-batch violations" selection are those of
  `tf_twobranch.losses.common` (`pairwise_distance`, `top_k_hinge`).

Keras: only `LogisticPairLoss` is a `keras.losses.Loss` (one value per pair,
reduced and weighted by Keras). There is deliberately no Keras class for
`bidirectional_ranking_loss` / `embedding_loss`: they are batch-level
objectives. The anchor terms average top-K hinges over the positive pairs,
with K capped by the size of the other modality; the neighbourhood terms
average over all texts and all images. These are anchor sets of different
sizes, combined with weights, and every hinge depends on the whole batch. No
per-example vector exists whose Keras "sum_over_batch_size" reduction is this
value and to which a `sample_weight` could apply. The models call the pure
function from their train step (`TwoBranchModel.objective`).
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tf_twobranch.errors import ConfigError
from tf_twobranch.losses.common import pairwise_distance, static_anchor_ranking_loss, top_k_hinge


def check_top_k_fits_batch(top_k: int, batch_images: int, *, top_k_name: str = "top_k",
                           batch_name: str = "batch_size") -> None:
    """Refuses a K larger than the images of a batch, naming both settings.

    Every text anchor draws its K most violating negatives from the batch's
    other images; with fewer images than K no anchor ever has K of them, so
    K does not select anything (the loss would silently average over fewer
    terms than asked). `top_k_name` / `batch_name` are how the caller's user
    spells them (e.g. the experiment's ``--top_k`` and ``--batch_size``).
    """
    if batch_images < top_k:
        raise ConfigError(
            f"{batch_name}={batch_images} is below {top_k_name}={top_k}: each text anchor keeps its "
            f"{top_k} most violating negatives among the batch's other images, and a batch of "
            f"{batch_images} images has {batch_images - 1}; give {batch_name} >= {top_k} or "
            f"{top_k_name} <= {batch_images}")


def text_anchor_ranking_loss(dist: tf.Tensor, labels: tf.Tensor, *, margin: float,
                             top_k: int, static_shapes: bool = False) -> tf.Tensor:
    """Text anchors: d(x_j', y_i') + m < d(x_k', y_i') (TPAMI eq. 2).

    One row per positive (text, image) pair; negatives are the images not
    matched to that text. `dist` is (num_texts, num_images).
    `static_shapes=True` computes the same value without data-dependent
    shapes (XLA-compilable; `static_anchor_ranking_loss`).
    """
    if static_shapes:
        return static_anchor_ranking_loss(dist, labels, tf.logical_not(labels), margin, top_k)
    pairs = tf.where(labels)
    rows = tf.gather(dist, pairs[:, 0])
    positive = tf.gather_nd(dist, pairs)[:, None]
    negative_mask = tf.logical_not(tf.gather(labels, pairs[:, 0]))
    return top_k_hinge(positive, rows, negative_mask, margin, top_k)


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
    return top_k_hinge(positive, dist, tf.logical_not(neighbours), margin, top_k)


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
        any labels (see `static_anchor_ranking_loss`). The neighbourhood
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


def logistic_pair_loss(logits: tf.Tensor, labels: tf.Tensor, *,
                       per_example: bool = False) -> tf.Tensor:
    """Similarity network loss (TPAMI eq. 7), mean of log(1 + exp(-z·p)).

    `labels` are 1 for positive pairs and 0 (or -1) for negative pairs.
    `per_example=True` returns the (num_pairs,) values, logits flattened,
    instead of their mean.
    """
    logits = tf.reshape(logits, [-1])
    z = tf.where(tf.reshape(labels, [-1]) > 0, 1.0, -1.0)
    z = tf.cast(z, logits.dtype)
    values = tf.nn.softplus(-z * logits)
    return values if per_example else tf.reduce_mean(values)


def masked_logistic_pair_loss(logits: tf.Tensor, labels: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
    """`logistic_pair_loss` averaged over the pairs where `mask` is True (padded batches); 0 if none."""
    logits = tf.reshape(logits, [-1])
    mask = tf.reshape(tf.cast(mask, tf.bool), [-1])
    z = tf.cast(tf.where(tf.reshape(labels, [-1]) > 0, 1.0, -1.0), logits.dtype)
    values = tf.where(mask, tf.nn.softplus(-z * logits), tf.zeros_like(logits))
    return tf.math.divide_no_nan(tf.reduce_sum(values), tf.reduce_sum(tf.cast(mask, logits.dtype)))


@keras.saving.register_keras_serializable(package="tf_twobranch")
class LogisticPairLoss(keras.losses.Loss):
    """Keras loss of `logistic_pair_loss`: `y_true` pair labels (1 vs 0 or -1), `y_pred` logits.

    `call` returns one value per pair (the flattened logits' order). Keras
    applies `sample_weight` and the reduction; the default
    "sum_over_batch_size" gives `logistic_pair_loss`'s mean.
    """

    def __init__(self, name="logistic_pair_loss", reduction="sum_over_batch_size", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true, y_pred):
        return logistic_pair_loss(y_pred, y_true, per_example=True)

    def get_config(self):
        config = super().get_config()
        config.update(dtype=self.dtype)
        return config
