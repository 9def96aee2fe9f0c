"""The localization volume and its image–caption scores (Das et al., §3.1, eq. 1).

An image map A is (H, W, d), a_{r,c} ∈ R^d the vector of location (r, c); a
caption is T token vectors S (T, d), right-padded, with a boolean mask of its
real tokens. The localization volume is m_{r,c,t} = a_{r,c}·s_t: one spatial
map per token, whose maximum says where the token is.

Aggregators reduce a volume to one score S(I, T) (`AGGREGATORS`):

* "max_image" (eq. 1, S_MaxImage): the spatial max of each token's map,
  averaged over the tokens — (1/N) Σ_t max_{r,c} m_{r,c,t}.
* "max_text": the max over tokens at each location, averaged over the
  locations (the authors' code's ``Max_Text``).
* "mean_all": the mean over locations and tokens (the code's ``Avg_Both``).
* "max_rows_code": the authors' code's ``Max_Img`` as it runs, a known
  defect reproduced on purpose for comparison: the max over rows only, then
  the mean over columns and tokens. Never the default.

Token averages (`TOKEN_AVERAGES`): "real" averages over the caption's real
tokens only (the mask) and no padded token ever takes part in a max; "all"
treats all T positions as tokens, whatever vector the text tower produced
there (the code: captions are padded and every position counts) — the mask
is then not read.

A caption with no real token scores 0 with every image under "real" (no
error: the scores are also computed inside `tf.function`/XLA and under
distribution strategies, where an eager check cannot run).

Every image is scored with every caption by ONE matmul (Bi·H·W, d) ×
(Bt·T, d)ᵀ, reshaped to (Bi, H·W, Bt, T) and reduced; memory is
Bi·H·W·Bt·T floats, so evaluation scores galleries in chunks
(`tf_twobranch.systems.npair.retrieval`). Scores are computed in
float32 whatever the compute dtype of the inputs.

`normalise_localization_inputs` rescales the inputs before scoring
(`NORMALISATIONS`): "vector" (cosine volume), "map" (the L2 norms the code
computes, over the whole map and the whole padded caption, but never applies)
or "none" (the code as run).
"""
from __future__ import annotations

import tensorflow as tf

from tf_twobranch.errors import ConfigError, UserInputError

__all__ = ["AGGREGATORS", "TOKEN_AVERAGES", "NORMALISATIONS", "SCORE_DTYPES", "localization_volume",
           "pairwise_localization_scores", "paired_localization_scores",
           "packed_max_image_scores", "normalise_localization_inputs"]

AGGREGATORS = ("max_image", "max_text", "mean_all", "max_rows_code")
TOKEN_AVERAGES = ("real", "all")
NORMALISATIONS = ("vector", "map", "none")
# Matmul input dtypes of `packed_max_image_scores`: "bfloat16" is an opt-in for
# speed (oneDNN's bf16 matmul, several times float32 on CPUs with AMX/AVX-512
# BF16); its products come out rounded to bf16 (8 significant bits).
SCORE_DTYPES = ("float32", "bfloat16")

# Norms below this are treated as zero vectors (a ReLU map location that is
# all zeros, a zeroed padded token): they stay zero instead of becoming NaN.
_NORM_EPSILON = 1e-12


def _check_options(aggregator: str, token_average: str) -> None:
    if aggregator not in AGGREGATORS:
        raise ConfigError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")
    if token_average not in TOKEN_AVERAGES:
        raise ConfigError(f"token_average must be one of {TOKEN_AVERAGES}, got {token_average!r}")


def _check_inputs(image_maps, token_vectors, token_mask=None):
    """Float32 tensors and a bool mask, with shapes checked where they are known statically."""
    image_maps = tf.cast(tf.convert_to_tensor(image_maps), tf.float32)
    token_vectors = tf.cast(tf.convert_to_tensor(token_vectors), tf.float32)
    if image_maps.shape.rank != 4:
        raise UserInputError(f"image maps must be (batch, H, W, d), got shape {image_maps.shape}")
    if token_vectors.shape.rank != 3:
        raise UserInputError(f"token vectors must be (batch, T, d), got shape {token_vectors.shape}")
    map_depth, token_depth = image_maps.shape[-1], token_vectors.shape[-1]
    if map_depth is not None and token_depth is not None and map_depth != token_depth:
        raise UserInputError(f"image map depth {map_depth} differs from token vector size "
                             f"{token_depth}")
    if token_mask is None:
        return image_maps, token_vectors, None
    token_mask = tf.convert_to_tensor(token_mask)
    if token_mask.dtype != tf.bool:
        token_mask = tf.not_equal(token_mask, tf.zeros((), token_mask.dtype))
    if token_mask.shape.rank != 2 or not token_mask.shape.is_compatible_with(token_vectors.shape[:2]):
        raise UserInputError(f"token mask must be (batch, T) = {token_vectors.shape[:2]}, got shape "
                             f"{token_mask.shape}")
    return image_maps, token_vectors, token_mask


def localization_volume(image_map, token_vectors) -> tf.Tensor:
    """m_{r,c,t} = a_{r,c}·s_t of image b with caption b: (B, H, W, T)."""
    image_map, token_vectors, _ = _check_inputs(image_map, token_vectors)
    return tf.einsum("bhwd,btd->bhwt", image_map, token_vectors)


def _token_mean(values, token_mask, token_average: str):
    """Mean over the last (token) axis; under "real" over the real tokens only (0 if none)."""
    if token_average == "all":
        return tf.reduce_mean(values, axis=-1)
    # tf.where, not a product with the mask: a padded value never enters the sum.
    total = tf.reduce_sum(tf.where(token_mask, values, tf.zeros_like(values)), axis=-1)
    count = tf.reduce_sum(tf.cast(token_mask, values.dtype), axis=-1)
    return tf.math.divide_no_nan(total, count)


def _aggregate(volume, token_mask, height, aggregator: str, token_average: str):
    """Score(s) of a volume (B, H·W, ..., T) whose mask broadcasts as (B or 1, 1, ..., T).

    Axis 1 runs over the H·W locations (row-major), the last axis over the
    tokens; the result drops both.
    """
    spatial_mask = token_mask                                   # broadcasts against the volume
    token_mask = tf.squeeze(token_mask, axis=1)                 # ... against a spatially reduced one
    if aggregator == "max_image":
        return _token_mean(tf.reduce_max(volume, axis=1), token_mask, token_average)
    if aggregator == "mean_all":
        return _token_mean(tf.reduce_mean(volume, axis=1), token_mask, token_average)
    if aggregator == "max_rows_code":
        shape = tf.shape(volume)
        rows = tf.reshape(volume, tf.concat([shape[:1], [height, -1], shape[2:]], axis=0))
        per_column = tf.reduce_max(rows, axis=1)                # max over rows only (the defect)
        return _token_mean(tf.reduce_mean(per_column, axis=1), token_mask, token_average)
    # max_text: the max over tokens must never pick a padded token, so padded
    # entries get the lowest finite float (finite: XLA never compares infinities).
    if token_average == "all":
        return tf.reduce_mean(tf.reduce_max(volume, axis=-1), axis=1)
    lowest = tf.constant(volume.dtype.min, volume.dtype)
    best_token = tf.reduce_max(tf.where(spatial_mask, volume, lowest), axis=-1)
    has_token = tf.reduce_any(token_mask, axis=-1)
    # A caption with no real token would average the fill: it scores 0.
    best_token = tf.where(tf.expand_dims(has_token, 1), best_token, tf.zeros_like(best_token))
    return tf.reduce_mean(best_token, axis=1)


def pairwise_localization_scores(image_maps, token_vectors, token_mask, *,
                                 aggregator: str = "max_image",
                                 token_average: str = "real") -> tf.Tensor:
    """S(I_i, T_j) of every image with every caption: (Bi, Bt) float32.

    Args:
      image_maps: (Bi, H, W, d) image maps a_{r,c}.
      token_vectors: (Bt, T, d) token vectors s_t, right-padded.
      token_mask: (Bt, T) bool (or 0/1) mask of the real tokens.
      aggregator: one of `AGGREGATORS` ("max_image" = eq. 1).
      token_average: "real" or "all" (see the module docstring).
    """
    _check_options(aggregator, token_average)
    image_maps, token_vectors, token_mask = _check_inputs(image_maps, token_vectors, token_mask)
    map_shape, token_shape = tf.shape(image_maps), tf.shape(token_vectors)
    num_images, height, width, depth = map_shape[0], map_shape[1], map_shape[2], map_shape[3]
    num_captions, num_tokens = token_shape[0], token_shape[1]
    # One matmul for every (location, token) pair of every (image, caption) pair.
    volume = tf.matmul(tf.reshape(image_maps, [-1, depth]), tf.reshape(token_vectors, [-1, depth]),
                       transpose_b=True)
    volume = tf.reshape(volume, [num_images, height * width, num_captions, num_tokens])
    return _aggregate(volume, token_mask[None, None, :, :], height, aggregator, token_average)


def paired_localization_scores(image_maps, token_vectors, token_mask, *,
                               aggregator: str = "max_image",
                               token_average: str = "real") -> tf.Tensor:
    """S(I_b, T_b) of each image with its own caption: (B,) float32, without the (B, B) matrix."""
    _check_options(aggregator, token_average)
    image_maps, token_vectors, token_mask = _check_inputs(image_maps, token_vectors, token_mask)
    map_shape = tf.shape(image_maps)
    height = map_shape[1]
    volume = tf.einsum("bpd,btd->bpt",
                       tf.reshape(image_maps, [map_shape[0], -1, map_shape[3]]), token_vectors)
    return _aggregate(volume, token_mask[:, None, :], height, aggregator, token_average)


def packed_max_image_scores(image_maps, packed_tokens, slot_index, token_counts, *,
                            score_dtype: str = "float32") -> tf.Tensor:
    """S_MaxImage of every image with every caption whose tokens are packed: (Bi, C) float32.

    Only the tokens that count are multiplied: the real tokens of C captions
    are concatenated into ``packed_tokens`` (P, d) (unused slots may hold
    anything finite, e.g. zeros), so one matmul (Bi·H·W, d) × (P, d)ᵀ costs
    H·W·d multiply-adds per counted token per image — no padded position is
    scored. Then the spatial max of each token's map, and each caption's
    tokens averaged: ``slot_index`` (C, L) int32 lists caption c's slots in
    its token order, filled up with P (an extra slot holding 0), and
    ``token_counts`` (C,) their number; a caption with no token scores 0.
    Summing the caption's own L entries (its tokens first, then zeros) keeps
    the order of `pairwise_localization_scores`' token mean, and a caption's
    score does not depend on where its tokens sit in the packing (the max
    is exact and the matmul's reduction runs over d only).

    score_dtype "bfloat16" casts the inputs to bfloat16 for the matmul; the
    volume then comes out rounded to bfloat16 (TensorFlow's CPU matmul has
    no bf16 → float32 kernel), the max is taken on those values and the mean
    in float32: scores change by bf16 rounding (relative ~2⁻⁹ per token max)
    and near-equal scores can tie.
    """
    if score_dtype not in SCORE_DTYPES:
        raise ConfigError(f"score_dtype must be one of {SCORE_DTYPES}, got {score_dtype!r}")
    dtype = tf.as_dtype(score_dtype)
    image_maps = tf.convert_to_tensor(image_maps)
    map_shape = tf.shape(image_maps)
    # The matmul outside XLA: TensorFlow's oneDNN kernel (AMX/AVX-512 for bf16), which
    # XLA's CPU dot is not.
    volume = tf.matmul(tf.cast(tf.reshape(image_maps, [-1, map_shape[3]]), dtype),
                       tf.cast(packed_tokens, dtype), transpose_b=True)      # (Bi·H·W, P)
    volume = tf.reshape(volume, [map_shape[0], map_shape[1] * map_shape[2], -1])
    return _packed_token_means(volume, slot_index, token_counts)


def _order_keys(bfloat16_values):
    """int16 keys that order like the bfloat16 values (sign-magnitude to two's complement); the
    map is its own inverse. XLA reduces int16 vectorised, bfloat16 not."""
    bits = tf.bitcast(bfloat16_values, tf.int16)
    magnitude = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 15),
                                       tf.constant(0x7FFF, tf.int16))
    return tf.bitwise.bitwise_xor(bits, magnitude)


@tf.function(jit_compile=True, reduce_retracing=True)
def _packed_token_means(volume, slot_index, token_counts):
    """(Bi, C) caption means of the spatial maxima of a (Bi, H·W, P) volume, one fused pass
    (the volume is far larger than the cache: read once)."""
    if volume.dtype == tf.bfloat16:
        best = tf.bitcast(_order_keys(tf.reduce_max(_order_keys(volume), axis=1)), tf.bfloat16)
    else:
        best = tf.reduce_max(volume, axis=1)
    best = tf.cast(best, tf.float32)                                            # (Bi, P)
    best = tf.concat([best, tf.zeros([tf.shape(best)[0], 1], tf.float32)], axis=1)  # slot P: 0
    per_caption = tf.gather(best, slot_index, axis=1)                           # (Bi, C, L)
    return tf.math.divide_no_nan(tf.reduce_sum(per_caption, axis=-1),
                                 tf.cast(token_counts, tf.float32)[None, :])


def _inverse_norm(squared_norm):
    """1/‖x‖, and 0 for a (near-)zero x: it stays zero, with finite gradients (no sqrt(0))."""
    floor = tf.constant(_NORM_EPSILON ** 2, squared_norm.dtype)
    return tf.where(squared_norm > floor, tf.math.rsqrt(tf.maximum(squared_norm, floor)),
                    tf.zeros_like(squared_norm))


def normalise_localization_inputs(image_maps, token_vectors, token_mask,
                                  mode: str = "vector") -> tuple[tf.Tensor, tf.Tensor]:
    """Rescaled (image_maps, token_vectors) for scoring, float32.

    * "vector": every a_{r,c} and every s_t L2-normalised, so m_{r,c,t} is a
      cosine in [−1, 1] (zero vectors stay zero).
    * "map": LocNet's L2 norms (models/models.py, `x.view(B, -1).norm(dim=1)`),
      applied: each image map scaled to unit Frobenius norm over all H·W·d
      entries, and each caption's token matrix to unit Frobenius norm over
      all T·d entries, every position counted (<start>, the words, <end> and
      the <end> padding: the code's LSTM output at every position). The
      mask does not enter: the scale of a caption does not depend on which
      of its positions are words. A zero map or caption stays zero.
    * "none": unchanged (the code as run: it computes these norms and
      returns the unnormalised tensors).

    This function only rescales: padded token positions are rescaled like
    the others (by the caption's factor under "map", to unit length under
    "vector") and never zeroed, because token_average="all" scores them;
    under "real" the scorer ignores them.
    """
    if mode not in NORMALISATIONS:
        raise ConfigError(f"normalisation must be one of {NORMALISATIONS}, got {mode!r}")
    image_maps, token_vectors, token_mask = _check_inputs(image_maps, token_vectors, token_mask)
    if mode == "none":
        return image_maps, token_vectors
    if mode == "vector":
        return (tf.math.l2_normalize(image_maps, axis=-1, epsilon=_NORM_EPSILON),
                tf.math.l2_normalize(token_vectors, axis=-1, epsilon=_NORM_EPSILON))
    map_scale = _inverse_norm(tf.reduce_sum(tf.square(image_maps), axis=[1, 2, 3], keepdims=True))
    caption_scale = _inverse_norm(tf.reduce_sum(tf.square(token_vectors), axis=[1, 2], keepdims=True))
    return image_maps * map_scale, token_vectors * caption_scale

