"""Mini-batches for image–sentence retrieval (TPAMI §5.1, original code).

Embedding network, as `lwwang/Two_branch_network/dataset_utils.py` does it:
every epoch the caption indices are shuffled; each batch takes
`batch_size` anchor captions, their images, and for every anchor
`sample_size − 1` further captions of the same image (neighbourhood
sampling: with `sample_size ≥ 2` every target image has ≥ 2 positive
sentences). Steps per epoch = num_captions // batch_size.

One deliberate difference: the original's label matrix is `eye` repeated,
so when two anchors of a batch share an image, that image's duplicate is
treated as a *negative* of its own sentences. Here labels are computed from
image identity, so duplicates are positives (documented in BUILD_NOTES.md).
With `unique_images=True` the batch draws distinct images instead (the
paper's "random permutation into mini-batches").

Similarity network: for each positive pair a negative pair with a random
caption of another image (balanced positives and negatives).

Batches carry *indices*; features are gathered by `attach_features`, so
feature matrices never enter the graph (MSCOCO features are ~17 GB, and a
graph constant is limited to 2 GB) and memory-mapped `.npy` files work.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError
from tf_twobranch.sampling.row_gather import gather_op


def _caption_table(caption_image: np.ndarray, num_images: int):
    """(num_images, max_captions) table of caption indices, -1 padded, and counts."""
    counts = np.bincount(caption_image, minlength=num_images)
    table = np.full((num_images, max(1, counts.max())), -1, np.int64)
    order = np.argsort(caption_image, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    for img in range(num_images):
        members = order[starts[img]:starts[img] + counts[img]]
        table[img, :len(members)] = members
    return table, counts


def image_sentence_batches(caption_image, num_images: int, *, batch_size: int = 500,
                           sample_size: int = 2, seed: int = 0,
                           unique_images: bool = False, start_step: int = 0) -> tf.data.Dataset:
    """An infinite, deterministic dataset of index batches for the embedding network.

    Yields dicts: ``image_index`` (batch_size,), ``text_index``
    (batch_size·sample_size,) with the captions of image b at rows
    b·sample_size … b·sample_size + sample_size − 1, and ``labels``
    bool (batch_size·sample_size, batch_size).
    """
    caption_image = np.asarray(caption_image, np.int64)
    if batch_size < 2:
        raise ConfigError(f"batch_size must be >= 2, got {batch_size}")
    if sample_size < 1:
        raise ConfigError(f"sample_size must be >= 1, got {sample_size}")
    table, counts = _caption_table(caption_image, num_images)
    if sample_size > counts[counts > 0].min():
        raise ConfigError(f"sample_size={sample_size} exceeds the smallest number of "
                          f"captions of an image ({counts[counts > 0].min()})")
    pool = np.flatnonzero(counts > 0) if unique_images else np.arange(len(caption_image))
    if len(pool) < batch_size:
        raise ConfigError(f"batch_size={batch_size} is larger than the number of training "
                          f"{'images' if unique_images else 'captions'} ({len(pool)})")
    steps_per_epoch = len(pool) // batch_size
    table_t = tf.constant(table)
    counts_t = tf.constant(counts, tf.int64)
    caption_image_t = tf.constant(caption_image)
    pool_t = tf.constant(pool, tf.int64)

    def make_batch(step):
        epoch = step // steps_per_epoch
        within = step % steps_per_epoch
        perm = tf.argsort(tf.random.stateless_uniform(
            [len(pool)], seed=tf.stack([tf.cast(seed, tf.int64), epoch])))
        chosen = tf.gather(pool_t, perm[within * batch_size:(within + 1) * batch_size])
        if unique_images:
            images = chosen
            anchors = None
        else:
            anchors = chosen
            images = tf.gather(caption_image_t, anchors)
        cand = tf.gather(table_t, images)                      # (B, max_caps)
        valid = tf.sequence_mask(tf.gather(counts_t, images), tf.shape(table_t)[1])
        if anchors is not None:
            valid &= tf.not_equal(cand, anchors[:, None])
        noise = tf.random.stateless_uniform(tf.shape(cand), seed=tf.stack([
            tf.cast(seed, tf.int64) + 7919, step]))
        noise = tf.where(valid, noise, 2.0)  # invalid slots sort last
        order = tf.argsort(noise, axis=1)
        n_extra = sample_size - (1 if anchors is not None else 0)
        picked = tf.gather(cand, order[:, :n_extra], batch_dims=1)
        if anchors is not None:
            picked = tf.concat([anchors[:, None], picked], axis=1)
        picked = tf.sort(picked, axis=1)  # the original keeps an image's sentences sorted
        text_index = tf.reshape(picked, [-1])
        text_image = tf.gather(caption_image_t, text_index)
        labels = tf.equal(text_image[:, None], images[None, :])
        return {"image_index": images, "text_index": text_index, "labels": labels}

    return tf.data.Dataset.counter(start_step).map(make_batch, num_parallel_calls=tf.data.AUTOTUNE,
                                         deterministic=True)


def steps_per_epoch(num_captions: int, num_images: int, batch_size: int,
                    unique_images: bool = False) -> int:
    """Steps of one epoch, as the original: num_captions // batch_size."""
    return (num_images if unique_images else num_captions) // batch_size


def similarity_pair_batches(caption_image, num_images: int, *, batch_size: int = 500,
                            seed: int = 0, start_step: int = 0) -> tf.data.Dataset:
    """Balanced pairs for the similarity network (TPAMI §5.1).

    Each batch holds `batch_size` positive (image, caption) pairs and, for
    each, one negative pair (same image, a random caption of another image).
    Yields ``image_index`` (2B,), ``text_index`` (2B,), ``labels`` (2B,) 0/1.
    """
    caption_image = np.asarray(caption_image, np.int64)
    num_captions = len(caption_image)
    if num_captions < batch_size:
        raise ConfigError(f"batch_size={batch_size} exceeds the number of captions "
                          f"({num_captions})")
    steps = num_captions // batch_size
    caption_image_t = tf.constant(caption_image)

    def make_batch(step):
        epoch = step // steps
        within = step % steps
        perm = tf.argsort(tf.random.stateless_uniform(
            [num_captions], seed=tf.stack([tf.cast(seed, tf.int64), epoch])))
        pos_text = perm[within * batch_size:(within + 1) * batch_size]
        pos_text = tf.cast(pos_text, tf.int64)
        images = tf.gather(caption_image_t, pos_text)
        # Redraw clashing negatives a few times (an image owns a tiny share
        # of all captions, so clashes vanish quickly).
        neg = tf.random.stateless_uniform([batch_size], seed=tf.stack([
            tf.cast(seed, tf.int64) + 104729, step]), maxval=num_captions, dtype=tf.int64)
        for r in range(8):
            clash = tf.equal(tf.gather(caption_image_t, neg), images)
            redraw = tf.random.stateless_uniform([batch_size], seed=tf.stack([
                tf.cast(seed, tf.int64) + 104729 + r + 1, step]), maxval=num_captions,
                dtype=tf.int64)
            neg = tf.where(clash, redraw, neg)
        return {"image_index": tf.concat([images, images], 0),
                "text_index": tf.concat([pos_text, neg], 0),
                # A negative still clashing after the redraws is labelled
                # truthfully (as positive) rather than mislabelled.
                "labels": tf.concat([tf.ones([batch_size], tf.int32),
                                     tf.cast(tf.equal(tf.gather(caption_image_t, neg),
                                                      images), tf.int32)], 0)}

    return tf.data.Dataset.counter(start_step).map(make_batch, num_parallel_calls=tf.data.AUTOTUNE,
                                         deterministic=True)


def attach_features(dataset: tf.data.Dataset, image_inputs: np.ndarray,
                    text_inputs: np.ndarray, *, prefetch: int = 2) -> tf.data.Dataset:
    """Replaces index batches by model inputs gathered from (possibly memory-mapped) arrays."""

    def gather(batch):
        return {**batch, "image": gather_op(image_inputs, batch["image_index"]),
                "text": gather_op(text_inputs, batch["text_index"])}

    return dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=True).prefetch(prefetch)
