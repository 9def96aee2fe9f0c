"""Retrieval signatures: given a query, which k gallery items (issue 25 item 2).

An export built with a `RetrievalGallery` answers, besides its tower
signatures,

* ``retrieve_captions``: the image input of ``embed_images`` and ``k``
  int32 scalar → ``caption_ids`` string (batch, k), ``caption_index`` int32
  (batch, k) and ``scores`` float32 (batch, k), best first;
* ``retrieve_images``: the text input of ``embed_texts`` and ``k`` →
  ``image_ids``, ``image_index``, ``scores``.

The gallery's tower outputs are computed once, when the export is written,
with the model's own ``embed_images`` / ``embed_texts`` (what
`model.evaluate` feeds the evaluation core), and stored in the SavedModel as
constants. A query is scored against the whole gallery exactly as the core
scores that pair (the dot product of the tower outputs for the embedding
network, the similarity head's logit otherwise), so the order of
``retrieve_*`` is the core's ranking; among equal scores the lower gallery
index comes first (`tf.math.top_k`), where the core counts ties against the
query. ``k`` is chosen per request and must lie in 1..gallery size.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError
from tf_twobranch.models.evaluation_input import as_evaluation_split

__all__ = ["RetrievalGallery", "gallery_from_model", "add_retrieval_signatures", "K_SPEC"]

K_SPEC = tf.TensorSpec([], tf.int32, name="k")


@dataclasses.dataclass
class RetrievalGallery:
    """What a retrieval export ranks: ids and tower outputs of gallery images and captions."""
    image_ids: Sequence[str]
    image_embeddings: np.ndarray      # (num_images, d): the image tower's outputs
    caption_ids: Sequence[str]
    caption_embeddings: np.ndarray    # (num_captions, d): the text tower's outputs

    def __post_init__(self):
        for ids, embeds, what in ((self.image_ids, self.image_embeddings, "image"),
                                  (self.caption_ids, self.caption_embeddings, "caption")):
            embeds = np.asarray(embeds)
            if embeds.ndim != 2 or len(embeds) == 0:
                raise ConfigError(f"gallery {what} embeddings must be a non-empty (rows, d) array, "
                                  f"got shape {embeds.shape}")
            if len(ids) != len(embeds):
                raise ConfigError(f"{len(ids)} gallery {what} ids for {len(embeds)} {what} embeddings")
            if not np.all(np.isfinite(embeds)):
                raise ConfigError(f"gallery {what} embeddings contain NaN or inf")
        if np.shape(self.image_embeddings)[1] != np.shape(self.caption_embeddings)[1]:
            raise ConfigError("gallery image and caption embeddings differ in size: "
                              f"{np.shape(self.image_embeddings)[1]} vs {np.shape(self.caption_embeddings)[1]}")


def gallery_from_model(model, split, image_ids: Sequence[str], caption_ids: Sequence[str]) -> RetrievalGallery:
    """A gallery embedded by `model` exactly as its ``evaluate`` embeds `split` (an
    `EvaluationSplit`, or a dict with ``image``, ``text`` and ``caption_image``): the tower
    outputs of a two-branch model, the L2-normalised (flip-averaged) embeddings of a dual path."""
    split = as_evaluation_split(split)
    if hasattr(model, "retrieval_embeddings"):       # the dual path: normalised, flip-averaged
        images, texts = model.retrieval_embeddings(split)
    else:
        images, texts = model.embed_images(split.image), model.embed_texts(split.text)
    return RetrievalGallery([str(i) for i in image_ids], np.asarray(images, np.float32),
                            [str(c) for c in caption_ids], np.asarray(texts, np.float32))


def _top_k(scores, k, ids, what: str) -> tuple:
    size = tf.shape(scores)[1]
    check = tf.debugging.Assert(
        tf.logical_and(k >= 1, k <= size),
        [f"k must lie in 1..{what} gallery size; got k =", k, "for a gallery of", size])
    with tf.control_dependencies([check]):
        top = tf.math.top_k(scores, k=k, sorted=True)
    return tf.gather(ids, top.indices), top.indices, top.values


def add_retrieval_signatures(module: tf.Module, gallery: RetrievalGallery, *,
                             image_spec: tf.TensorSpec, text_spec: tf.TensorSpec,
                             embed_image: Callable, embed_text: Callable,
                             pair_scores: Callable) -> None:
    """Gives `module` the ``retrieve_captions`` / ``retrieve_images`` tf.functions.

    `embed_image` / `embed_text` map the signature inputs (validated) to
    tower outputs; `pair_scores(images, texts)` → (num_images, num_texts)
    scores, higher = better, as the evaluation core scores them.
    """
    module.gallery_image_ids = tf.constant([str(i) for i in gallery.image_ids], tf.string)
    module.gallery_caption_ids = tf.constant([str(c) for c in gallery.caption_ids], tf.string)
    module.gallery_images = tf.Variable(np.asarray(gallery.image_embeddings, np.float32),
                                        trainable=False, name="gallery_image_embeddings")
    module.gallery_captions = tf.Variable(np.asarray(gallery.caption_embeddings, np.float32),
                                          trainable=False, name="gallery_caption_embeddings")

    @tf.function(input_signature=[image_spec, K_SPEC])
    def retrieve_captions(images, k):
        scores = pair_scores(embed_image(images), module.gallery_captions)
        ids, index, values = _top_k(scores, k, module.gallery_caption_ids, "caption")
        return {"caption_ids": ids, "caption_index": index, "scores": values}

    @tf.function(input_signature=[text_spec, K_SPEC])
    def retrieve_images(texts, k):
        scores = tf.transpose(pair_scores(module.gallery_images, embed_text(texts)))
        ids, index, values = _top_k(scores, k, module.gallery_image_ids, "image")
        return {"image_ids": ids, "image_index": index, "scores": values}

    module.retrieve_captions = retrieve_captions
    module.retrieve_images = retrieve_images
