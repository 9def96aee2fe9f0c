"""Training batches of the deep fragment embeddings (Karpathy et al., NIPS 2014, §3.4).

As the authors' code (`DeFragRun.m`): every step draws `batch_size`
*distinct* training images at random and one random sentence of each; an
epoch is ``ceil(num_sentences / batch_size)`` steps (one pass's worth of
sentences). Image k of a batch is paired with sentence k (the positive bag of
the fragment objective and the diagonal of the global ranking objective).

Every draw is a stateless function of (seed, step), so a resumed run sees
the same batches. Only the small per-image index arrays live in the graph; a
step reads its image-fragment and sentence rows by index from the arrays
where they are (in RAM or memory-mapped: `row_gather.gather_op`; at COCO size
the fragments are tens of GB and the padded sentences hundreds of MB), the
sentences padded to the split's longest so every batch has one shape (no
retracing).
"""
from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError
from tf_twobranch.sampling.distinct_images import draw_distinct_images, sentences_by_image
from tf_twobranch.sampling.row_gather import gather_op

__all__ = ["steps_per_epoch", "padded_sentence_arrays", "batch_indices", "draw_distinct_images", "sentences_by_image",
           "train_dataset"]


def steps_per_epoch(num_sentences: int, batch_size: int) -> int:
    return max(1, math.ceil(num_sentences / batch_size))


def padded_sentence_arrays(relation, word1, word2, row_splits) -> dict[str, np.ndarray]:
    """(S, F_max) id arrays and mask of ragged sentence fragments (F_max >= 1)."""
    row_splits = np.asarray(row_splits, np.int64)
    lengths = np.diff(row_splits)
    width = max(1, int(lengths.max(initial=0)))
    mask = np.arange(width)[None, :] < lengths[:, None]
    out = {"sentence_mask": mask}
    for name, values in (("relation", relation), ("word1", word1), ("word2", word2)):
        padded = np.zeros(mask.shape, np.int32)
        padded[mask] = np.asarray(values, np.int32)
        out[name] = padded
    return out


def batch_indices(caption_image, num_images: int, batch_size: int, step, seed: int):
    """(image rows, sentence rows) of one step: distinct images, a random sentence of each."""
    caption_image = np.asarray(caption_image, np.int64)
    order, starts, counts = sentences_by_image(caption_image, num_images)
    return draw_distinct_images(tf.constant(order), tf.constant(starts), tf.constant(counts), num_images, batch_size,
                 tf.cast(step, tf.int64), seed)


def train_dataset(image_fragments: np.ndarray, image_mask: np.ndarray, sentences: dict[str, np.ndarray],
                  caption_image, *, batch_size: int, seed: int, start_step: int = 0,
                  parallel_batches: int | None = None) -> tf.data.Dataset:
    """The infinite stream of training batches from step `start_step` on.

    Args:
      image_fragments: (num_images, M, D) CNN inputs of every fragment, any row-indexable array
        (a memory map, `row_arrays.ShardedRows`); float16 rows are widened to float32 per batch.
      image_mask: (num_images, M).
      sentences: `padded_sentence_arrays` of every training sentence.
      caption_image: the image of every sentence.
      parallel_batches: batches read at once (default ``tf.data.AUTOTUNE``, up to the cores). A batch
        is a function of its step and the order is kept, so every value gives the same stream; one
        batch at a time left an H100 idle 90-95 % of the step (benchmarks/bench_input_pipelines.py).
    """
    num_images = len(image_fragments)
    caption_image = np.asarray(caption_image, np.int64)
    if batch_size > num_images:
        raise ConfigError(f"batch_size {batch_size} exceeds the {num_images} training images "
                          "(a batch holds distinct images)")
    without = np.setdiff1d(np.arange(num_images), caption_image)
    if len(without):
        raise ConfigError(f"{len(without)} training image(s) have no sentence (e.g. row {without[0]})")
    order, starts, counts = (tf.constant(a) for a in sentences_by_image(caption_image, num_images))
    image_mask = np.asarray(image_mask, bool)

    def batch(step):
        images, chosen = draw_distinct_images(order, starts, counts, num_images, batch_size, step, seed)
        out = {"image_fragments": gather_op(image_fragments, images, np.float32),
               "image_mask": gather_op(image_mask, images)}
        out.update({k: gather_op(v, chosen) for k, v in sentences.items()})
        return out

    return (tf.data.Dataset.counter(start=start_step, dtype=tf.int64)
            .map(batch, num_parallel_calls=parallel_batches or tf.data.AUTOTUNE, deterministic=True).prefetch(2))
