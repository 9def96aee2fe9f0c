"""Dual-path CNN losses (Zheng et al. 2020, §4): instance loss and cosine ranking loss.

Both are per-example losses, so each has a Keras `Loss` class whose `call`
returns the unreduced per-example values: `InstanceLoss` (one
cross-entropy per example) and `CosineRankingLoss` (one value per anchor
row, image-anchor + text-anchor term). Keras applies `sample_weight` and
the reduction; the default "sum_over_batch_size" gives the functions' mean.
"""
from __future__ import annotations

import keras
import tensorflow as tf

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
    """Keras loss of `instance_loss`: `y_true` labels (B,), `y_pred` logits (B, num_classes).

    `call` returns the (B,) per-example cross-entropies; Keras applies
    `sample_weight` and the reduction (default: their mean).
    """

    def __init__(self, name="instance_loss", reduction="sum_over_batch_size", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true, y_pred):
        return instance_loss(y_pred, y_true)

    def get_config(self):
        config = super().get_config()
        config.update(dtype=self.dtype)
        return config


@keras.saving.register_keras_serializable(package="tf_twobranch")
class CosineRankingLoss(keras.losses.Loss):
    """Keras loss of `cosine_ranking_loss`, one value per row.

    `y_true` is the (B,) label vector shared by the image and the text of a
    row, or a tuple (image_labels, text_labels); `y_pred` is
    (image_embeds, text_embeds). The gallery is the batch itself.

    `call` returns the (B,) per-row values (`per_example=True`); Keras
    applies `sample_weight` and the reduction (default: their mean, i.e.
    `cosine_ranking_loss`). A weight scales its row's value only: a row
    with weight 0 still serves as a negative of the other rows.
    """

    def __init__(self, margin=1.0, negatives="in_batch", name="cosine_ranking_loss",
                 reduction="sum_over_batch_size", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
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
                                   margin=self.margin, negatives=self.negatives, per_example=True)

    def get_config(self):
        config = super().get_config()
        config.update(dtype=self.dtype, margin=self.margin, negatives=self.negatives)
        return config
