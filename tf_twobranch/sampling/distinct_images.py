"""Batches of distinct images, one random caption of each, drawn statelessly from (seed, step).

The deep fragment embeddings (`DeFragRun.m`) and the N-pair batches (LocNet) draw their steps
this way: a seeded permutation's head gives `batch_size` distinct images and a stateless uniform
picks one caption of each, so a resumed run sees the same batches.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["sentences_by_image", "draw_distinct_images"]


def sentences_by_image(caption_image: np.ndarray, num_images: int):
    order = np.argsort(caption_image, kind="stable").astype(np.int32)
    counts = np.bincount(caption_image, minlength=num_images)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    return order, starts, counts.astype(np.int32)


def draw_distinct_images(order, starts, counts, num_images, batch_size, step, seed):
    """Step `step`'s `batch_size` distinct images (a seeded permutation's head) and one random
    caption of each; `order`, `starts`, `counts` from `sentences_by_image`."""
    key = tf.stack([tf.constant(seed, tf.int64), step])
    images = tf.argsort(tf.random.stateless_uniform([num_images], seed=key))[:batch_size]
    pick = tf.random.stateless_uniform([batch_size], seed=key + [0, 1 << 40])
    count = tf.gather(counts, images)
    offset = tf.minimum(tf.cast(pick * tf.cast(count, tf.float32), tf.int32), count - 1)
    sentences = tf.gather(order, tf.gather(starts, images) + offset)
    return images, sentences
