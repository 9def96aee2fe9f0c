"""Image–caption retrieval with the localization-volume score S(I, T) (Das et al., eq. 1, Table 1).

S_MaxImage (and the other aggregators of
`tf_twobranch.losses.localization_volume`) reduces the volume
m_{r,c,t} = a_{r,c}·s_t of a pair, so it is not a dot product of two global
vectors. `localization_score_fn` computes it block by block for the one
evaluation core (`tf_twobranch.evaluation.retrieval.ranks_from_score_fn`):
the core asks for the scores of every image against a window of captions,
and inside a window images and captions are scored in fixed-size chunks
(``image_chunk`` × ``caption_chunk`` pairs, the last chunks padded to the
same shape so one traced function serves every call and a pair's score does
not depend on where it falls). Memory is bounded by
``image_chunk × H·W × caption_chunk × T`` floats whatever the gallery size —
about 170 MB at the defaults for the paper's 14×14 maps and 22 tokens, so
1,000 images × 5,000 captions fit in well under a few GB besides the inputs.

The inputs are what the model scores: image maps and token vectors after
the model's normalisation (`normalise_localization_inputs`). The metrics come
from `retrieval.evaluate_protocol`, with the items passed as indices so that
protocols with folds (e.g. "folds_100", the paper's galleries of 100 images)
select their images and captions as for every other model.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.losses.localization_volume import (AGGREGATORS, TOKEN_AVERAGES,
                                                      pairwise_localization_scores)

__all__ = ["DEFAULT_IMAGE_CHUNK", "DEFAULT_CAPTION_CHUNK", "localization_score_fn",
           "evaluate_localization_retrieval"]

DEFAULT_IMAGE_CHUNK = 100
DEFAULT_CAPTION_CHUNK = 100


def _check(image_maps, token_vectors, token_mask):
    image_maps = np.asarray(image_maps, np.float32)
    token_vectors = np.asarray(token_vectors, np.float32)
    token_mask = np.asarray(token_mask)
    if image_maps.ndim != 4:
        raise UserInputError(f"image maps must be (images, H, W, d), got shape {image_maps.shape}")
    if token_vectors.ndim != 3 or token_vectors.shape[2] != image_maps.shape[3]:
        raise UserInputError(f"token vectors must be (captions, T, {image_maps.shape[3]}), got shape "
                             f"{token_vectors.shape}")
    if token_mask.shape != token_vectors.shape[:2]:
        raise UserInputError(f"token mask must be (captions, T) = {token_vectors.shape[:2]}, got "
                             f"shape {token_mask.shape}")
    for name, values in (("image maps", image_maps), ("token vectors", token_vectors)):
        if not np.all(np.isfinite(values)):
            raise UserInputError(f"{name} have NaN/inf values")
    return image_maps, token_vectors, token_mask.astype(bool)


def _check_chunk(name: str, value: int) -> int:
    if int(value) < 1:
        raise ConfigError(f"{name} must be positive, got {value}")
    return int(value)


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """`array` with zero rows appended up to `rows` (a padded caption has no real token)."""
    if len(array) == rows:
        return array
    pad = np.zeros((rows - len(array),) + array.shape[1:], array.dtype)
    return np.concatenate([array, pad])


def localization_score_fn(image_maps, token_vectors, token_mask, *,
                          images: np.ndarray | None = None, sentences: np.ndarray | None = None,
                          aggregator: str = "max_image", token_average: str = "real",
                          image_chunk: int = DEFAULT_IMAGE_CHUNK,
                          caption_chunk: int = DEFAULT_CAPTION_CHUNK):
    """A `score_fn(start, stop)` (the evaluation core's scorer) of S(I, T).

    Args:
      image_maps: (num_images, H, W, d) image maps a_{r,c}.
      token_vectors: (num_captions, T, d) token vectors s_t; `token_mask`
        (num_captions, T) their real tokens.
      images, sentences: the indices scored (default all), e.g. one protocol fold.
      aggregator, token_average: the score (see `localization_volume`).
      image_chunk, caption_chunk: images and captions per scored block.

    Returns ``score(start, stop)``: the (len(images), stop − start) float32
    scores of every image against captions ``sentences[start:stop]``.
    """
    if aggregator not in AGGREGATORS:
        raise ConfigError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")
    if token_average not in TOKEN_AVERAGES:
        raise ConfigError(f"token_average must be one of {TOKEN_AVERAGES}, got {token_average!r}")
    image_chunk = _check_chunk("image_chunk", image_chunk)
    caption_chunk = _check_chunk("caption_chunk", caption_chunk)
    image_maps, token_vectors, token_mask = _check(image_maps, token_vectors, token_mask)
    images = np.arange(len(image_maps)) if images is None else np.asarray(images)
    sentences = np.arange(len(token_vectors)) if sentences is None else np.asarray(sentences)
    # Never larger than needed: a small gallery is not padded up to the defaults.
    image_chunk = max(1, min(image_chunk, len(images)))

    @tf.function(reduce_retracing=True)
    def block_scores(maps, tokens, mask):
        return pairwise_localization_scores(maps, tokens, mask, aggregator=aggregator,
                                            token_average=token_average)

    def score(start: int, stop: int) -> np.ndarray:
        rows = sentences[start:stop]
        chunk = max(1, min(caption_chunk, len(rows)))
        out = np.empty((len(images), len(rows)), np.float32)
        for c in range(0, len(rows), chunk):
            chosen = rows[c:c + chunk]
            tokens = tf.constant(_pad_rows(token_vectors[chosen], chunk))
            mask = tf.constant(_pad_rows(token_mask[chosen], chunk))
            for i in range(0, len(images), image_chunk):
                picked = images[i:i + image_chunk]
                maps = tf.constant(_pad_rows(image_maps[picked], image_chunk))
                block = block_scores(maps, tokens, mask).numpy()
                out[i:i + len(picked), c:c + len(chosen)] = block[:len(picked), :len(chosen)]
        return out

    return score


def evaluate_localization_retrieval(image_maps, token_vectors, token_mask, caption_image,
                                    protocol: str = "full", *,
                                    ks: Sequence[int] = retrieval.DEFAULT_KS,
                                    aggregator: str = "max_image", token_average: str = "real",
                                    chunk_size: int = 1000) -> dict:
    """Retrieval metrics of S(I, T) through the one evaluation core (R@K, median and mean rank, rsum).

    `caption_image` (num_captions,) is each caption's image index; `protocol`
    any of `retrieval.PROTOCOLS` ("folds_100": the paper's Table 1).
    """
    image_maps, token_vectors, token_mask = _check(image_maps, token_vectors, token_mask)

    def factory(images, sentences):
        return localization_score_fn(image_maps, token_vectors, token_mask, images=images,
                                     sentences=sentences, aggregator=aggregator,
                                     token_average=token_average)

    return retrieval.evaluate_protocol(np.arange(len(image_maps)), np.arange(len(token_vectors)),
                                       caption_image, protocol, ks=ks, chunk_size=chunk_size,
                                       score_fn_factory=factory)
