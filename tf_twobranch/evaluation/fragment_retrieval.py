"""Image–sentence retrieval with the fragment model's global score S_kl (eq. 6).

S_kl sums max(0, vᵢᵀsⱼ) over every image fragment i of image k and sentence
fragment j of sentence l, so it is not a dot product of two global vectors.
`fragment_score_fn` computes it block by block for the one evaluation core
(`tf_twobranch.evaluation.retrieval.ranks_from_score_fn`): the core asks for
the scores of every image against a window of captions; inside a window the
captions are sorted by fragment count and scored in sub-chunks padded to
their own longest sentence, so padding costs little and memory is bounded by
``image_chunk × M × sentence_chunk × F_max`` floats whatever the test size.

The per-fragment embeddings are computed once (`FragmentEmbeddingModel`
towers); the metrics come from `retrieval.evaluate_protocol`, with the items
passed as indices so that protocols with folds select their images and
captions as for every other model.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.losses.fragment import global_scores

__all__ = ["fragment_score_fn", "evaluate_fragment_retrieval", "pad_ragged"]


def pad_ragged(flat: np.ndarray, row_splits: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows `rows` of a ragged (flat, row_splits) array, padded: (len(rows), F, h) and mask (len(rows), F)."""
    lengths = row_splits[rows + 1] - row_splits[rows]
    width = max(1, int(lengths.max(initial=0)))
    out = np.zeros((len(rows), width, flat.shape[1]), flat.dtype)
    mask = np.arange(width)[None, :] < lengths[:, None]
    for i, (r, n) in enumerate(zip(rows, lengths)):
        out[i, :n] = flat[row_splits[r]:row_splits[r] + n]
    return out, mask


def _check(image_fragments, image_mask, sentence_fragments, row_splits):
    image_fragments = np.asarray(image_fragments, np.float32)
    image_mask = np.asarray(image_mask, bool)
    sentence_fragments = np.asarray(sentence_fragments, np.float32)
    row_splits = np.asarray(row_splits, np.int64)
    if image_fragments.ndim != 3 or image_mask.shape != image_fragments.shape[:2]:
        raise UserInputError(f"image fragments must be (images, M, h) with a (images, M) mask, got "
                             f"{image_fragments.shape} and {image_mask.shape}")
    if sentence_fragments.ndim != 2 or sentence_fragments.shape[1] != image_fragments.shape[2]:
        raise UserInputError(f"sentence fragments must be (total, {image_fragments.shape[2]}), got "
                             f"{sentence_fragments.shape}")
    if row_splits.ndim != 1 or row_splits[0] != 0 or row_splits[-1] != len(sentence_fragments) \
            or np.any(np.diff(row_splits) < 0):
        raise UserInputError("row_splits must rise from 0 to the number of sentence fragments")
    return image_fragments, image_mask, sentence_fragments, row_splits


def fragment_score_fn(image_fragments, image_mask, sentence_fragments, row_splits, *,
                      images: np.ndarray | None = None, sentences: np.ndarray | None = None,
                      smoothing: float = 5.0, normaliser: str = "paper",
                      sentence_chunk: int = 128, image_chunk: int = 250):
    """A `score_fn(start, stop)` (the evaluation core's scorer) of S_kl.

    Args:
      image_fragments: (num_images, M, h) embedded image fragments; `image_mask` (num_images, M).
      sentence_fragments: (total, h) embedded sentence fragments, sentence l owning rows
        ``row_splits[l]:row_splits[l + 1]`` (a sentence may have none: it scores 0).
      images, sentences: the indices scored (default all), e.g. one protocol fold.
    """
    image_fragments, image_mask, sentence_fragments, row_splits = _check(
        image_fragments, image_mask, sentence_fragments, row_splits)
    images = np.arange(len(image_fragments)) if images is None else np.asarray(images)
    sentences = np.arange(len(row_splits) - 1) if sentences is None else np.asarray(sentences)
    image_blocks = [(tf.constant(image_fragments[images[i:i + image_chunk]]),
                     tf.constant(image_mask[images[i:i + image_chunk]]))
                    for i in range(0, len(images), image_chunk)]

    def score(start: int, stop: int) -> np.ndarray:
        rows = sentences[start:stop]
        order = np.argsort(np.diff(row_splits)[rows], kind="stable")
        out = np.empty((len(images), len(rows)), np.float32)
        for c in range(0, len(rows), sentence_chunk):
            chosen = order[c:c + sentence_chunk]
            padded, mask = pad_ragged(sentence_fragments, row_splits, rows[chosen])
            s, sm = tf.constant(padded), tf.constant(mask)
            blocks = [global_scores(v, vm, s, sm, smoothing=smoothing, normaliser=normaliser).numpy()
                      for v, vm in image_blocks]
            out[:, chosen] = np.concatenate(blocks, axis=0)
        return out

    return score


def evaluate_fragment_retrieval(image_fragments, image_mask, sentence_fragments, row_splits,
                                caption_image, protocol: str = "full", *,
                                ks: Sequence[int] = retrieval.DEFAULT_KS, smoothing: float = 5.0,
                                normaliser: str = "paper", chunk_size: int = 1000) -> dict:
    """Retrieval metrics of S_kl through the one evaluation core (R@K, median and mean rank, rsum)."""
    image_fragments, image_mask, sentence_fragments, row_splits = _check(
        image_fragments, image_mask, sentence_fragments, row_splits)
    num_images, num_sentences = len(image_fragments), len(row_splits) - 1

    def factory(images, sentences):
        return fragment_score_fn(image_fragments, image_mask, sentence_fragments, row_splits,
                                 images=images, sentences=sentences, smoothing=smoothing,
                                 normaliser=normaliser)

    return retrieval.evaluate_protocol(np.arange(num_images), np.arange(num_sentences), caption_image,
                                       protocol, ks=ks, chunk_size=chunk_size, score_fn_factory=factory)
