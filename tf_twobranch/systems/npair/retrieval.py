"""Image–caption retrieval with the localization-volume score S(I, T) (Das et al., eq. 1, Table 1).

S_MaxImage (and the other aggregators of
`tf_twobranch.systems.npair.heat_map_volume`) reduces the volume
m_{r,c,t} = a_{r,c}·s_t of a pair, so it is not a dot product of two global
vectors. `localization_score_fn` computes it block by block for the one
evaluation core (`tf_twobranch.evaluation.retrieval.ranks_from_score_fn`):
the core asks for the scores of every image against a window of captions;
inside a window each chunk of ``image_chunk`` images is read once and scored
against every caption block of the window by one matmul per block.

S_MaxImage (``aggregator="max_image"``, the default) multiplies only the
tokens that count: a caption block is the real tokens of consecutive
captions packed into a fixed number of slots (under ``token_average="all"``
every position counts), so the multiply-adds are H·W·d per counted token per
image — about half of the padded volume for COCO's ~11 words in 22
positions. The other aggregators score padded (``image_chunk`` ×
``caption_chunk`` captions × T) blocks. Every block of one scorer has one
shape (the last ones padded), so one traced function serves every call and a
pair's score does not depend on the block it falls in.

Memory is bounded by a block (``image_chunk × H·W × slots`` floats: about
90 MB at the defaults for 14×14 maps and ~11 words) and one window's scores,
whatever the gallery: the inputs may be memory-mapped row arrays
(`np.memmap`, `tf_twobranch.data.formats.row_arrays.ShardedRows`, any array
indexable by an index array and a slice); only the rows of the chunk being
scored are read (and cast to float32), and they are checked for NaN/inf
there, never the whole gallery at once.

``score_dtype="bfloat16"`` (S_MaxImage only, opt-in) runs the matmul in
bfloat16 — several times faster on CPUs with AMX/AVX-512 BF16 — at the cost
of bf16 rounding of every m_{r,c,t} (see `packed_max_image_scores`).

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
from tf_twobranch.systems.npair.heat_map_volume import (AGGREGATORS, SCORE_DTYPES, TOKEN_AVERAGES,
                                                      packed_max_image_scores,
                                                      pairwise_localization_scores)

__all__ = ["DEFAULT_IMAGE_CHUNK", "DEFAULT_CAPTION_CHUNK", "localization_score_fn",
           "evaluate_localization_retrieval", "token_slots"]

DEFAULT_IMAGE_CHUNK = 100
DEFAULT_CAPTION_CHUNK = 100
# Slot counts are rounded up to this multiple (matmul kernels work in such widths).
_SLOT_MULTIPLE = 16


def _shape(array) -> tuple:
    """The shape without reading the rows (memory-mapped and sharded arrays have one)."""
    return tuple(np.shape(array))


def _as_rows(array):
    """Row arrays as given (never copied whole); anything without a shape (lists) as float32."""
    return array if hasattr(array, "shape") else np.asarray(array, np.float32)


def _check(image_maps, token_vectors, token_mask):
    """Shapes of the inputs (the galleries are not read) and the token mask as bool."""
    image_maps, token_vectors = _as_rows(image_maps), _as_rows(token_vectors)
    token_mask = np.asarray(token_mask)
    map_shape, token_shape = _shape(image_maps), _shape(token_vectors)
    if len(map_shape) != 4:
        raise UserInputError(f"image maps must be (images, H, W, d), got shape {map_shape}")
    if len(token_shape) != 3 or token_shape[2] != map_shape[3]:
        raise UserInputError(f"token vectors must be (captions, T, {map_shape[3]}), got shape "
                             f"{token_shape}")
    if token_mask.shape != token_shape[:2]:
        raise UserInputError(f"token mask must be (captions, T) = {token_shape[:2]}, got "
                             f"shape {token_mask.shape}")
    return image_maps, token_vectors, token_mask.astype(bool)


def _check_chunk(name: str, value: int) -> int:
    if int(value) < 1:
        raise ConfigError(f"{name} must be positive, got {value}")
    return int(value)


def _read_rows(array, index: np.ndarray) -> np.ndarray:
    """Rows `index` of a (memory-mapped) array as float32: only those rows are read."""
    if len(index) and np.all(np.diff(index) == 1):
        rows = array[int(index[0]):int(index[-1]) + 1]      # a slice: one sequential read
    else:
        rows = array[index]
    return np.asarray(rows, np.float32)


def _check_finite(values: np.ndarray, index: np.ndarray, name: str) -> None:
    ok = np.isfinite(values).reshape(len(values), -1).all(axis=1)
    if not ok.all():
        raise UserInputError(f"{name} have NaN/inf values (row {int(index[np.flatnonzero(~ok)[0]])})")


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """`array` with zero rows appended up to `rows` (a padded caption has no real token)."""
    if len(array) == rows:
        return array
    pad = np.zeros((rows - len(array),) + array.shape[1:], array.dtype)
    return np.concatenate([array, pad])


def token_slots(token_counts: np.ndarray, caption_chunk: int) -> int:
    """Packed token slots per caption block: ``caption_chunk`` captions of the mean length, at least
    the longest caption, rounded up to a multiple of 16 (never more than all the tokens)."""
    slots = np.maximum(token_counts, 1)
    wanted = max(int(slots.max(initial=1)), int(np.ceil(caption_chunk * slots.mean()))
                 if len(slots) else 1)
    wanted = -(-wanted // _SLOT_MULTIPLE) * _SLOT_MULTIPLE
    return int(max(slots.max(initial=1), min(wanted, slots.sum())))


def _caption_blocks(counts: np.ndarray, slots: int, max_captions: int) -> list[tuple[int, int]]:
    """Consecutive (start, stop) caption ranges whose tokens fit `slots` (at most `max_captions`)."""
    blocks, start, used = [], 0, 0
    for k, n in enumerate(np.maximum(counts, 1)):
        if used + n > slots or k - start == max_captions:
            blocks.append((start, k))
            start, used = k, 0
        used += int(n)
    if start < len(counts):
        blocks.append((start, len(counts)))
    return blocks


def localization_score_fn(image_maps, token_vectors, token_mask, *,
                          images: np.ndarray | None = None, sentences: np.ndarray | None = None,
                          aggregator: str = "max_image", token_average: str = "real",
                          image_chunk: int = DEFAULT_IMAGE_CHUNK,
                          caption_chunk: int = DEFAULT_CAPTION_CHUNK,
                          score_dtype: str = "float32"):
    """A `score_fn(start, stop)` (the evaluation core's scorer) of S(I, T).

    Args:
      image_maps: (num_images, H, W, d) image maps a_{r,c}; any row-indexable
        array (e.g. memory-mapped), read chunk by chunk.
      token_vectors: (num_captions, T, d) token vectors s_t, likewise;
        `token_mask` (num_captions, T) their real tokens.
      images, sentences: the indices scored (default all), e.g. one protocol fold.
      aggregator, token_average: the score (see `localization_volume`).
      image_chunk: images per scored block.
      caption_chunk: captions per block; for S_MaxImage the block holds
        `token_slots` packed tokens (``caption_chunk`` captions of the mean
        length) and as many whole captions as fit.
      score_dtype: "float32", or "bfloat16" for S_MaxImage's matmul (faster
        where the CPU has bf16 units; scores change by bf16 rounding).

    Returns ``score(start, stop)``: the (len(images), stop − start) float32
    scores of every image against captions ``sentences[start:stop]``.
    """
    if aggregator not in AGGREGATORS:
        raise ConfigError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")
    if token_average not in TOKEN_AVERAGES:
        raise ConfigError(f"token_average must be one of {TOKEN_AVERAGES}, got {token_average!r}")
    if score_dtype not in SCORE_DTYPES:
        raise ConfigError(f"score_dtype must be one of {SCORE_DTYPES}, got {score_dtype!r}")
    packed = aggregator == "max_image"
    if score_dtype != "float32" and not packed:
        raise ConfigError(f"score_dtype={score_dtype!r} is offered for aggregator='max_image' only")
    image_chunk = _check_chunk("image_chunk", image_chunk)
    caption_chunk = _check_chunk("caption_chunk", caption_chunk)
    image_maps, token_vectors, token_mask = _check(image_maps, token_vectors, token_mask)
    images = np.arange(len(image_maps)) if images is None else np.asarray(images)
    sentences = np.arange(len(token_vectors)) if sentences is None else np.asarray(sentences)
    # Under "all" every position is a token that counts.
    counted = token_mask if token_average == "real" else np.ones_like(token_mask)
    # Never larger than needed: a small gallery is not padded up to the defaults.
    image_chunk = max(1, min(image_chunk, len(images)))
    num_tokens = token_mask.shape[1]
    slots = token_slots(counted[sentences].sum(axis=1), caption_chunk)
    max_captions = max(1, min(2 * caption_chunk, len(sentences)))
    matmul_dtype = tf.as_dtype(score_dtype)
    # Image chunks are checked for NaN/inf once (the first window that reads them).
    checked_images = set()

    @tf.function(reduce_retracing=True)
    def packed_block(maps, tokens, slot_index, counts):
        return packed_max_image_scores(maps, tokens, slot_index, counts, score_dtype=score_dtype)

    @tf.function(reduce_retracing=True)
    def padded_block(maps, tokens, mask):
        return pairwise_localization_scores(maps, tokens, mask, aggregator=aggregator,
                                            token_average=token_average)

    def image_chunk_at(i: int) -> tf.Tensor:
        picked = images[i:i + image_chunk]
        maps = _read_rows(image_maps, picked)
        if i not in checked_images:
            _check_finite(maps, picked, "image maps")
            checked_images.add(i)
        # Cast once here, not in every block that reuses the chunk.
        return tf.cast(tf.constant(_pad_rows(maps, image_chunk)), matmul_dtype)

    def packed_caption_blocks(rows: np.ndarray) -> list:
        """(first, count, tensors) of each packed block of the window's captions."""
        out = []
        for lo, hi in _caption_blocks(counted[rows].sum(axis=1), slots, max_captions):
            chosen = rows[lo:hi]
            vectors = _read_rows(token_vectors, chosen)
            real = counted[chosen]
            tokens = vectors[real]                                   # (R, d), caption order
            _check_finite(tokens, chosen[np.nonzero(real)[0]], "token vectors")
            counts = real.sum(axis=1)
            slot_index = np.full((max_captions, num_tokens), slots, np.int32)
            offsets = np.concatenate([[0], np.cumsum(counts)])
            for k, n in enumerate(counts):
                slot_index[k, :n] = np.arange(offsets[k], offsets[k] + n)
            tokens = tf.cast(tf.constant(_pad_rows(tokens, slots)), matmul_dtype)
            out.append((lo, hi - lo, (tokens, tf.constant(slot_index),
                                      tf.constant(_pad_rows(counts.astype(np.int32), max_captions)))))
        return out

    def padded_caption_blocks(rows: np.ndarray) -> list:
        out = []
        chunk = max(1, min(caption_chunk, len(rows)))
        for lo in range(0, len(rows), chunk):
            chosen = rows[lo:lo + chunk]
            vectors = _read_rows(token_vectors, chosen)
            _check_finite(vectors, chosen, "token vectors")
            out.append((lo, len(chosen), (tf.constant(_pad_rows(vectors, chunk)),
                                          tf.constant(_pad_rows(token_mask[chosen], chunk)))))
        return out

    def score(start: int, stop: int) -> np.ndarray:
        rows = sentences[start:stop]
        out = np.empty((len(images), len(rows)), np.float32)
        blocks = packed_caption_blocks(rows) if packed else padded_caption_blocks(rows)
        block_fn = packed_block if packed else padded_block
        # Images outer: each image chunk is read once per window.
        for i in range(0, len(images), image_chunk):
            maps = image_chunk_at(i)
            rows_here = min(image_chunk, len(images) - i)
            for lo, count, tensors in blocks:
                block = block_fn(maps, *tensors).numpy()
                out[i:i + rows_here, lo:lo + count] = block[:rows_here, :count]
        return out

    return score


def evaluate_localization_retrieval(image_maps, token_vectors, token_mask, caption_image,
                                    protocol: str = "full", *,
                                    ks: Sequence[int] = retrieval.DEFAULT_KS,
                                    aggregator: str = "max_image", token_average: str = "real",
                                    chunk_size: int = 1000,
                                    image_chunk: int = DEFAULT_IMAGE_CHUNK,
                                    caption_chunk: int = DEFAULT_CAPTION_CHUNK,
                                    score_dtype: str = "float32") -> dict:
    """Retrieval metrics of S(I, T) through the one evaluation core (R@K, median and mean rank, rsum).

    `caption_image` (num_captions,) is each caption's image index; `protocol`
    any of `retrieval.PROTOCOLS` ("folds_100": the paper's Table 1). The maps
    and token vectors may be memory-mapped row arrays: they are read chunk by
    chunk, never copied whole. `image_chunk`, `caption_chunk`, `score_dtype`:
    see `localization_score_fn`.
    """
    image_maps, token_vectors, token_mask = _check(image_maps, token_vectors, token_mask)

    def factory(images, sentences):
        return localization_score_fn(image_maps, token_vectors, token_mask, images=images,
                                     sentences=sentences, aggregator=aggregator,
                                     token_average=token_average, image_chunk=image_chunk,
                                     caption_chunk=caption_chunk, score_dtype=score_dtype)

    return retrieval.evaluate_protocol(np.arange(len(image_maps)), np.arange(len(token_vectors)),
                                       caption_image, protocol, ks=ks, chunk_size=chunk_size,
                                       score_fn_factory=factory)
