"""Retrieval signatures: given a query, which k gallery items (issue 25 item 2).

An export built with a `RetrievalGallery` answers, besides its tower
signatures,

* ``retrieve_captions``: the image input of ``embed_images`` and ``k``
  int32 scalar → ``caption_ids`` string (batch, k), ``caption_index`` int32
  (batch, k) and ``scores`` float32 (batch, k), best first;
* ``retrieve_images``: the text input of ``embed_texts`` and ``k`` →
  ``image_ids``, ``image_index``, ``scores``.

The gallery's tower outputs are computed once, when the export is written,
with what the model's ``evaluate`` feeds the evaluation core
(`tf_twobranch.run_export.gallery_from_model`), and stored in the SavedModel as variables. A query
is scored against the whole gallery exactly as the core scores that pair,
so the order of ``retrieve_*`` is the core's ranking; among equal scores the
lower gallery index comes first (`tf.math.top_k`), where the core counts
ties against the query. ``k`` is chosen per request and must lie in
1..gallery size.

What a gallery item holds depends on the family's scorer:

* two-branch / dual path: one vector per image and per caption (the dot
  product of the tower outputs, the similarity head's logit, the cosine);
* deep fragment embeddings: each image's fragment embeddings (M, h) with
  their mask and each caption's sentence-fragment embeddings (F, h) with
  theirs, scored by S_kl (`tf_twobranch.systems.fragments.export`);
* N-pair localization: each image's normalised projected map (H, W, d) and
  each caption's normalised token vectors (T, d) with the mask of its
  words, scored by S_MaxImage or the model's aggregator
  (`tf_twobranch.systems.npair.export`).

A side with a mask reaches the family's ``pair_scores`` as the pair
``(embeddings, mask)``, a side without one as the embeddings alone. With
``block_rows`` the gallery is scored ``block_rows`` items at a time (a loop
in the graph), so that a query's score volume stays bounded whatever the
gallery size (N-pair: H·W·T products per caption and query image); a pair's
score does not depend on the block it falls in.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError
from tf_twobranch.export import serving

__all__ = ["RetrievalGallery", "add_retrieval_signatures", "padded_rows", "K_SPEC"]

K_SPEC = tf.TensorSpec([], tf.int32, name="k")


@dataclasses.dataclass
class RetrievalGallery:
    """What a retrieval export ranks: ids and tower outputs of gallery images and captions.

    ``image_embeddings`` / ``caption_embeddings`` have one row per item
    (rows first, any rank >= 2; the last dimension is the joint space's).
    ``image_mask`` / ``caption_mask`` (optional, bool (rows, slots)): which
    slots of a row (fragments, tokens) are real, for the scorers that read
    them.
    """
    image_ids: Sequence[str]
    image_embeddings: np.ndarray      # (num_images, ..., d)
    caption_ids: Sequence[str]
    caption_embeddings: np.ndarray    # (num_captions, ..., d)
    image_mask: np.ndarray | None = None      # (num_images, slots)
    caption_mask: np.ndarray | None = None    # (num_captions, slots)

    def __post_init__(self):
        for ids, embeds, mask, what in ((self.image_ids, self.image_embeddings, self.image_mask, "image"),
                                        (self.caption_ids, self.caption_embeddings, self.caption_mask, "caption")):
            embeds = np.asarray(embeds)
            if embeds.ndim < 2 or len(embeds) == 0:
                raise ConfigError(f"gallery {what} embeddings must be a non-empty (rows, ..., d) array, "
                                  f"got shape {embeds.shape}")
            if len(ids) != len(embeds):
                raise ConfigError(f"{len(ids)} gallery {what} ids for {len(embeds)} {what} embeddings")
            if not np.all(np.isfinite(embeds)):
                raise ConfigError(f"gallery {what} embeddings contain NaN or inf")
            if mask is not None and (np.asarray(mask).ndim != 2
                                     or np.shape(mask) != embeds.shape[:2]):
                raise ConfigError(f"gallery {what} mask must be (rows, slots) = {embeds.shape[:2]}, "
                                  f"got shape {np.shape(mask)}")
        if np.shape(self.image_embeddings)[-1] != np.shape(self.caption_embeddings)[-1]:
            raise ConfigError("gallery image and caption embeddings differ in size: "
                              f"{np.shape(self.image_embeddings)[-1]} vs {np.shape(self.caption_embeddings)[-1]}")


def padded_rows(rows: np.ndarray, row_splits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(items, max slots, ...) zero-padded rows and their (items, max slots) mask, from ragged
    `rows` where item i owns ``rows[row_splits[i]:row_splits[i + 1]]`` (at least one slot)."""
    rows, row_splits = np.asarray(rows), np.asarray(row_splits, np.int64)
    lengths = np.diff(row_splits)
    width = max(1, int(lengths.max(initial=0)))
    mask = np.arange(width)[None, :] < lengths[:, None]
    out = np.zeros((len(lengths), width) + rows.shape[1:], rows.dtype)
    out[mask] = rows
    return out, mask


def _top_k(scores, k, ids, what: str) -> tuple:
    size = tf.shape(scores)[1]
    check = tf.debugging.Assert(
        tf.logical_and(k >= 1, k <= size),
        [f"k must lie in 1..{what} gallery size; got k =", k, "for a gallery of", size])
    with tf.control_dependencies([check]):
        top = tf.math.top_k(scores, k=k, sorted=True)
    return tf.gather(ids, top.indices), top.indices, top.values


class _GallerySide:
    """One side of the gallery as variables, padded to whole blocks of `block_rows` when blocked."""

    def __init__(self, module: tf.Module, embeddings, mask, what: str, block_rows: int | None):
        embeddings = np.asarray(embeddings, np.float32)
        self.size = len(embeddings)
        self.block_rows = None if block_rows is None else max(1, min(int(block_rows), self.size))
        if self.block_rows is not None:
            blocks = -(-self.size // self.block_rows)
            pad = blocks * self.block_rows - self.size
            # Zero rows with an all-False mask: scored like any item, then cut off before top-k.
            embeddings = np.concatenate([embeddings, np.zeros((pad,) + embeddings.shape[1:], np.float32)])
            if mask is not None:
                mask = np.concatenate([np.asarray(mask, bool), np.zeros((pad,) + np.shape(mask)[1:], bool)])
        self.embeddings = tf.Variable(embeddings, trainable=False, name=f"gallery_{what}_embeddings")
        self.mask = None if mask is None else tf.Variable(np.asarray(mask, bool), trainable=False,
                                                          name=f"gallery_{what}_mask")

    def rows(self, start=None, stop=None):
        """The gallery rows [start, stop) as `pair_scores` takes them (all rows without bounds)."""
        def part(v):
            return tf.convert_to_tensor(v) if start is None else v[start:stop]
        embeddings = part(self.embeddings)
        return embeddings if self.mask is None else (embeddings, part(self.mask))

    def scores(self, score_block: Callable, query_rows: tf.Tensor) -> tf.Tensor:
        """(query rows, gallery size) scores: ``score_block(gallery rows)`` -> (query rows, block)."""
        if self.block_rows is None:
            return score_block(self.rows())
        blocks = int(self.embeddings.shape[0]) // self.block_rows

        def block(i):
            start = i * self.block_rows
            return score_block(self.rows(start, start + self.block_rows))

        # One block at a time (parallel_iterations=1): the point is a bounded score volume.
        per_block = tf.map_fn(block, tf.range(blocks), parallel_iterations=1,
                              fn_output_signature=tf.TensorSpec([None, self.block_rows], tf.float32))
        scores = tf.reshape(tf.transpose(per_block, [1, 0, 2]), [query_rows, blocks * self.block_rows])
        return scores[:, :self.size]


def _as_specs(spec) -> list[tf.TensorSpec]:
    return [spec] if isinstance(spec, tf.TensorSpec) else list(spec)


def _query_rows(side) -> tf.Tensor:
    return tf.shape(side[0] if isinstance(side, tuple) else side)[0]


def add_retrieval_signatures(module: tf.Module, gallery: RetrievalGallery, *,
                             image_spec, text_spec, embed_image: Callable, embed_text: Callable,
                             pair_scores: Callable, block_rows: int | None = None) -> None:
    """Gives `module` the ``retrieve_captions`` / ``retrieve_images`` tf.functions.

    `image_spec` / `text_spec`: the query input spec, or a list of them (e.g.
    image bytes, boxes and box counts); `embed_image(*inputs)` /
    `embed_text(*inputs)` map them (validated) to tower outputs — the
    embeddings, or ``(embeddings, mask)`` where the gallery side has a mask;
    `pair_scores(images, texts)` → (num_images, num_texts) scores, higher =
    better, as the evaluation core scores them. `block_rows`: score the
    gallery that many items at a time (None: all at once). Both are
    `serving.signature_function`s (no AutoGraph).
    """
    if block_rows is not None and int(block_rows) < 1:
        raise ConfigError(f"block_rows must be positive, got {block_rows}")
    module.gallery_image_ids = tf.constant([str(i) for i in gallery.image_ids], tf.string)
    module.gallery_caption_ids = tf.constant([str(c) for c in gallery.caption_ids], tf.string)
    images = _GallerySide(module, gallery.image_embeddings, gallery.image_mask, "image", block_rows)
    captions = _GallerySide(module, gallery.caption_embeddings, gallery.caption_mask, "caption", block_rows)
    module.gallery_images, module.gallery_captions = images.embeddings, captions.embeddings
    module.gallery_image_mask, module.gallery_caption_mask = images.mask, captions.mask

    @serving.signature_function(*_as_specs(image_spec), K_SPEC)
    def retrieve_captions(*inputs):
        *query, k = inputs
        query = embed_image(*query)
        scores = captions.scores(lambda rows: pair_scores(query, rows), _query_rows(query))
        ids, index, values = _top_k(scores, k, module.gallery_caption_ids, "caption")
        return {"caption_ids": ids, "caption_index": index, "scores": values}

    @serving.signature_function(*_as_specs(text_spec), K_SPEC)
    def retrieve_images(*inputs):
        *query, k = inputs
        query = embed_text(*query)
        scores = images.scores(lambda rows: tf.transpose(pair_scores(rows, query)), _query_rows(query))
        ids, index, values = _top_k(scores, k, module.gallery_image_ids, "image")
        return {"image_ids": ids, "image_index": index, "scores": values}

    module.retrieve_captions = retrieve_captions
    module.retrieve_images = retrieve_images
