"""N-pair and hardest-negative triplet losses on image–caption score matrices (Das et al., §3.2).

Scores S(I, T) come from any scorer; `localization_batch_loss` uses the
localization volume's (`tf_twobranch.systems.npair.heat_map_volume`, eq. 1).
Every function takes two row-aligned views of the batch's score matrix:

* ``image_anchor_scores`` (B_l, N): row j = S(I_j, T_i) of anchor image j
  with every caption i of the (global) batch;
* ``text_anchor_scores`` (B_l, N): row j = S(I_i, T_j) of anchor caption j
  with every image i (default: the transpose of a square
  ``image_anchor_scores``);

and ``positive_index`` (B_l,): the column of each row's positive pair
(default 0..B_l−1; a replica's rows of the global batch start at
`distribute.local_row_offset`). Every other column is an impostor (§4.1: a
batch never holds two captions of one image).

* `npair_loss` (eqs. 5–7): per row L1 + L2, each −log softmax of the row at
  its positive column, logits = scores / temperature (`DEFAULT_TEMPERATURE`),
  computed with logsumexp so scores of ±1e4 stay finite. L = (1/N) Σ_j.
* `hardest_negative_triplet_loss` (eqs. 2–4) with online hardest-negative
  mining: the impostor of a row is its highest-scoring non-positive column;
  L1 = max(0, S(I_j, T^imp) − S(I_j, T_j) + η), L2 likewise for the caption
  anchor; L = (1/N) Σ_j (L1 + L2). A row without any impostor (N = 1) gives 0.
* `localization_batch_loss`: either loss on one training batch of image
  maps and token vectors under the package's global-batch contract
  (`tf_twobranch.distribute`).

`NPairLoss` and `HardestNegativeTripletLoss` are the Keras forms: ``y_true``
the positive column of each row (B,), ``y_pred`` a square (B, B) matrix
S(I_i, T_j); ``call`` returns the per-example values and Keras applies
``sample_weight`` and the reduction (default: their mean, the functions'
value).
"""
from __future__ import annotations

import keras
import tensorflow as tf

from tf_twobranch import distribute
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.systems.npair.heat_map_volume import pairwise_localization_scores

__all__ = ["BATCH_LOSSES", "DEFAULT_TEMPERATURE", "npair_loss", "hardest_negative_triplet_loss",
           "localization_batch_loss", "NPairLoss", "HardestNegativeTripletLoss"]

BATCH_LOSSES = ("npair", "triplet")

# The one default of the N-pair temperature (config, losses, --temperature). Eqs. 5–6 and
# LocNet's npairs_loss (exp(S) as it is) have none, i.e. 1; 0.1 because the default
# normalisation makes S a mean of cosines in [−1, 1], where at 1 the softmax over a batch
# of 64 captions stays near uniform (BUILD_NOTES.md, Das et al.).
DEFAULT_TEMPERATURE = 0.1


def _score_views(image_anchor_scores, text_anchor_scores, positive_index):
    """Float32 (B_l, N) views and the (B_l,) int32 positive columns, shapes checked."""
    image_anchor_scores = tf.cast(tf.convert_to_tensor(image_anchor_scores), tf.float32)
    if image_anchor_scores.shape.rank != 2:
        raise UserInputError(f"image_anchor_scores must be (rows, N), got shape "
                             f"{image_anchor_scores.shape}")
    if text_anchor_scores is None:
        rows, columns = image_anchor_scores.shape
        if rows is not None and columns is not None and rows != columns:
            raise UserInputError(f"without text_anchor_scores the score matrix must be square "
                                 f"(its transpose gives the caption anchors), got shape "
                                 f"{image_anchor_scores.shape}")
        text_anchor_scores = tf.transpose(image_anchor_scores)
    text_anchor_scores = tf.cast(tf.convert_to_tensor(text_anchor_scores), tf.float32)
    if not text_anchor_scores.shape.is_compatible_with(image_anchor_scores.shape):
        raise UserInputError(f"text_anchor_scores {text_anchor_scores.shape} and "
                             f"image_anchor_scores {image_anchor_scores.shape} must have one shape")
    rows = tf.shape(image_anchor_scores)[0]
    if positive_index is None:
        positive_index = tf.range(rows, dtype=tf.int32)
    positive_index = tf.cast(tf.reshape(positive_index, [-1]), tf.int32)
    if not positive_index.shape.is_compatible_with(image_anchor_scores.shape[:1]):
        raise UserInputError(f"positive_index must hold one column per row "
                             f"({image_anchor_scores.shape[0]}), got shape {positive_index.shape}")
    return image_anchor_scores, text_anchor_scores, positive_index


def _positive_scores(scores, positive_index):
    return tf.gather(scores, positive_index, axis=1, batch_dims=1)


def npair_loss(image_anchor_scores, text_anchor_scores=None, *, positive_index=None,
               temperature: float = DEFAULT_TEMPERATURE, per_example: bool = False) -> tf.Tensor:
    """N-pair loss (eqs. 5–7): L1 + L2 per row, (B_l,) if `per_example`, else their mean.

    Args:
      image_anchor_scores: (B_l, N), row j = S(I_j, T_i) over all N captions.
      text_anchor_scores: (B_l, N), row j = S(I_i, T_j) over all N images
        (default: the transpose of a square `image_anchor_scores`).
      positive_index: (B_l,) column of each row's positive (default arange).
      temperature: logits = scores / temperature (eqs. 5–6: 1; see `DEFAULT_TEMPERATURE`).
      per_example: return the per-row values instead of their mean.
    """
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ConfigError(f"temperature must be positive, got {temperature}")
    image_scores, text_scores, positive_index = _score_views(image_anchor_scores, text_anchor_scores,
                                                             positive_index)
    values = 0.0
    for scores in (image_scores, text_scores):
        logits = scores / tf.cast(temperature, tf.float32)
        # −log softmax at the positive = logsumexp(row) − positive logit (stable).
        values += tf.reduce_logsumexp(logits, axis=1) - _positive_scores(logits, positive_index)
    return values if per_example else tf.reduce_mean(values)


def _hardest_hinge(scores, positive_index, margin):
    """max(0, S_imp − S_pos + η) per row, S_imp the row's best non-positive score."""
    columns = tf.shape(scores)[1]
    is_positive = tf.equal(tf.range(columns)[None, :], positive_index[:, None])
    lowest = tf.constant(scores.dtype.min, scores.dtype)
    impostor = tf.reduce_max(tf.where(is_positive, lowest, scores), axis=1)
    hinge = tf.nn.relu(impostor - _positive_scores(scores, positive_index) + margin)
    # A row with no impostor (one column) has no triplet.
    return tf.where(columns > 1, hinge, tf.zeros_like(hinge))


def hardest_negative_triplet_loss(image_anchor_scores, text_anchor_scores=None, *,
                                  positive_index=None, margin: float = 0.1,
                                  per_example: bool = False) -> tf.Tensor:
    """Triplet loss with hardest in-batch impostors (eqs. 2–4): L1 + L2 per row, or their mean.

    Arguments as for `npair_loss`; `margin` is η (the authors' code: 0.1).
    """
    if isinstance(margin, (int, float)) and margin < 0:
        raise ConfigError(f"margin must be >= 0, got {margin}")
    image_scores, text_scores, positive_index = _score_views(image_anchor_scores, text_anchor_scores,
                                                             positive_index)
    margin = tf.cast(margin, tf.float32)
    values = (_hardest_hinge(image_scores, positive_index, margin)
              + _hardest_hinge(text_scores, positive_index, margin))
    return values if per_example else tf.reduce_mean(values)


def localization_batch_loss(image_maps, token_vectors, token_mask, *, loss: str = "npair",
                            aggregator: str = "max_image", token_average: str = "real",
                            temperature: float = DEFAULT_TEMPERATURE, margin: float = 0.1) -> tf.Tensor:
    """The loss of one batch (image b paired with caption b) over the global batch.

    Inside a replica context the replica's maps, tokens and masks are
    all-gathered: its LOCAL images are scored against ALL captions and ALL
    images against its LOCAL captions, so the rows span the N×N matrix of
    the global batch; the per-example values are summed and divided by the
    global number of pairs. Keras sums the replicas' gradients, which then
    equal the gradient of the loss on the whole batch on one device (what
    this function returns under no strategy).

    Args:
      image_maps: (B_l, H, W, d) this replica's (normalised) image maps.
      token_vectors, token_mask: (B_l, T, d) and (B_l, T) its captions.
      loss: "npair" (eqs. 5–7) or "triplet" (eqs. 2–4, hardest negatives).
      aggregator, token_average: the score (see `localization_volume`).
      temperature: of the N-pair loss; margin: η of the triplet loss.
    """
    if loss not in BATCH_LOSSES:
        raise ConfigError(f"loss must be one of {BATCH_LOSSES}, got {loss!r}")
    image_maps = tf.cast(tf.convert_to_tensor(image_maps), tf.float32)
    token_vectors = tf.cast(tf.convert_to_tensor(token_vectors), tf.float32)
    # Gathered as float: collectives need not support bool.
    token_mask = tf.cast(tf.convert_to_tensor(token_mask), tf.float32)
    local_rows = tf.shape(image_maps)[0]
    all_maps = distribute.cross_replica_concat(image_maps)
    all_tokens = distribute.cross_replica_concat(token_vectors)
    all_mask = distribute.cross_replica_concat(token_mask)
    score_options = dict(aggregator=aggregator, token_average=token_average)
    image_anchor_scores = pairwise_localization_scores(image_maps, all_tokens, all_mask > 0,
                                                       **score_options)
    if distribute.num_replicas() == 1:
        # One replica: both directions read the same N×N matrix (scoring it twice doubles the
        # step's largest matmul; benchmarks/bench_npair.py).
        text_anchor_scores = tf.transpose(image_anchor_scores)
    else:
        text_anchor_scores = tf.transpose(pairwise_localization_scores(all_maps, token_vectors,
                                                                       token_mask > 0, **score_options))
    positive_index = distribute.local_row_offset(local_rows) + tf.range(local_rows, dtype=tf.int32)
    if loss == "npair":
        per_example = npair_loss(image_anchor_scores, text_anchor_scores,
                                 positive_index=positive_index, temperature=temperature,
                                 per_example=True)
    else:
        per_example = hardest_negative_triplet_loss(image_anchor_scores, text_anchor_scores,
                                                    positive_index=positive_index, margin=margin,
                                                    per_example=True)
    return tf.reduce_sum(per_example) / distribute.global_count(local_rows)


def _keras_views(y_true, y_pred):
    """(scores, positive columns) of a Keras call: a square (B, B) matrix and (B,) indices."""
    scores = tf.convert_to_tensor(y_pred)
    # Keras hands y_true over in the loss dtype: round back to column indices.
    positive_index = tf.cast(tf.round(tf.reshape(tf.cast(y_true, tf.float32), [-1])), tf.int32)
    return scores, positive_index


@keras.saving.register_keras_serializable(package="tf_twobranch")
class NPairLoss(keras.losses.Loss):
    """Keras loss of `npair_loss`: `y_true` positive columns (B,), `y_pred` S(I_i, T_j) (B, B).

    `call` returns the (B,) per-row values L1 + L2; Keras applies
    `sample_weight` and the reduction (default: their mean, eq. 7). A row
    with weight 0 still serves as an impostor of the other rows.
    """

    def __init__(self, temperature=DEFAULT_TEMPERATURE, name="npair_loss", reduction="sum_over_batch_size",
                 dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        if temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {temperature}")
        self.temperature = temperature

    def call(self, y_true, y_pred):
        scores, positive_index = _keras_views(y_true, y_pred)
        return npair_loss(scores, positive_index=positive_index, temperature=self.temperature,
                          per_example=True)

    def get_config(self):
        config = super().get_config()
        config.update(dtype=self.dtype, temperature=self.temperature)
        return config


@keras.saving.register_keras_serializable(package="tf_twobranch")
class HardestNegativeTripletLoss(keras.losses.Loss):
    """Keras loss of `hardest_negative_triplet_loss`: `y_true` (B,) columns, `y_pred` (B, B).

    `call` returns the (B,) per-row values L1 + L2; Keras applies
    `sample_weight` and the reduction (default: their mean, eq. 4).
    """

    def __init__(self, margin=0.1, name="hardest_negative_triplet_loss",
                 reduction="sum_over_batch_size", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        if margin < 0:
            raise ConfigError(f"margin must be >= 0, got {margin}")
        self.margin = margin

    def call(self, y_true, y_pred):
        scores, positive_index = _keras_views(y_true, y_pred)
        return hardest_negative_triplet_loss(scores, positive_index=positive_index,
                                             margin=self.margin, per_example=True)

    def get_config(self):
        config = super().get_config()
        config.update(dtype=self.dtype, margin=self.margin)
        return config
