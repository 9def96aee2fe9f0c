"""Training batches of the N-pair localization model (Das et al., §3.1 and §4.1).

"A caption is sampled randomly from the pool of available captions while
constructing the training mini-batch ... We avoid sampling captions from the
same image to avoid multiple positive samples": every step draws
`batch_size` (64) *distinct* images and one random caption of each, so the
batch's N×N score matrix has exactly one positive per row and column. The
draw is the deep fragment embeddings' (`fragment_batches.draw_distinct_images`),
a stateless function of (seed, step): a resumed run sees the same batches.

Only captions that fit training (`CaptionTokens.trainable`: 1..max_words
known words) are drawn; an image none of whose captions fits is left out.
An epoch is `steps_per_epoch` steps (the authors' code: 100).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError
from tf_twobranch.sampling.distinct_images import draw_distinct_images, sentences_by_image
from tf_twobranch.sampling.row_gather import gather_op

__all__ = ["trainable_pairs", "batch_rows", "train_dataset"]


def trainable_pairs(caption_image, trainable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The drawable pool: (images with a trainable caption, those caption rows, each row's
    index into those images)."""
    caption_image = np.asarray(caption_image, np.int64)
    rows = np.flatnonzero(np.asarray(trainable, bool))
    images, local = np.unique(caption_image[rows], return_inverse=True)
    return images, rows, local


def batch_rows(caption_image, trainable, batch_size: int, step, seed: int):
    """(image rows, caption rows) of step `step`: distinct images, one trainable caption each."""
    images, rows, local = trainable_pairs(caption_image, trainable)
    order, starts, counts = sentences_by_image(local, len(images))
    chosen_images, chosen = draw_distinct_images(tf.constant(order), tf.constant(starts), tf.constant(counts),
                                                 len(images), batch_size, tf.cast(step, tf.int64), seed)
    return tf.gather(images, chosen_images), tf.gather(rows, chosen)


def train_dataset(image_inputs, token_ids, token_mask, caption_image, trainable, *, batch_size: int, seed: int,
                  start_step: int = 0, image_key: str = "backbone_map",
                  token_key: str = "token_ids", parallel_batches: int | None = None) -> tf.data.Dataset:
    """The infinite stream of batches from step `start_step` on.

    Each batch's rows are read by index from the arrays where they live (in RAM, memory-mapped
    or sharded on disk: `row_gather.gather_op`), so memory is bounded by the batch, not the
    dataset, and no array enters the graph as a constant.

    Args:
      image_inputs: per image, the frozen backbone's map (``image_key`` "backbone_map"; float16
        storage is widened) or the uint8 image (``"image"``, for a backbone trained end to end);
        both reach the model as float32.
      token_ids, token_mask: (num_captions, T) of every training caption; with ``token_key``
        "word_inputs", `token_ids` are (num_captions, T, word_dim) LSTM inputs (phrase-parsed).
      caption_image: the image row of every caption; trainable: which captions may be drawn.
      parallel_batches: batches read at once (default ``tf.data.AUTOTUNE``, up to the cores). A batch
        is a function of its step and the order is kept, so every value gives the same stream; one
        batch at a time left an H100 idle 90-95 % of the step (benchmarks/bench_input_pipelines.py).
    """
    images, rows, local = trainable_pairs(caption_image, trainable)
    if batch_size > len(images):
        raise ConfigError(f"batch_size {batch_size} exceeds the {len(images)} training images with a usable "
                          "caption (a batch holds distinct images)")
    order, starts, counts = (tf.constant(a) for a in sentences_by_image(local, len(images)))
    # The draw indexes the pool (images with a trainable caption, those captions); these map it
    # back to rows of the full arrays.
    image_rows, caption_rows = tf.constant(images), tf.constant(rows)
    token_dtype = np.float32 if token_key == "word_inputs" else np.int32

    def batch(step):
        chosen_images, chosen = draw_distinct_images(order, starts, counts, len(images), batch_size, step, seed)
        picked = tf.gather(caption_rows, chosen)
        pixels = gather_op(image_inputs, tf.gather(image_rows, chosen_images))
        return {image_key: tf.cast(pixels, tf.float32), token_key: gather_op(token_ids, picked, token_dtype),
                "token_mask": gather_op(token_mask, picked, bool)}

    return (tf.data.Dataset.counter(start=start_step, dtype=tf.int64)
            .map(batch, num_parallel_calls=parallel_batches or tf.data.AUTOTUNE, deterministic=True).prefetch(2))
