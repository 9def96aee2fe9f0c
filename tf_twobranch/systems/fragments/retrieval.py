"""Image–sentence retrieval with the fragment model's global score S_kl (eq. 6).

S_kl sums max(0, vᵢᵀsⱼ) over every image fragment i of image k and sentence
fragment j of sentence l, so it is not a dot product of two global vectors.
`fragment_score_fn` computes it block by block for the one evaluation core
(`tf_twobranch.evaluation.retrieval.ranks_from_score_fn`), which asks for the
scores of every image against a window of captions.

Captions share most of their fragments ("a dog", "in water": a sentence
fragment is a function of its triplet alone, so identical triplets embed to
identical rows): of the 42,243 kept fragments of the 5,000 Flickr8K test
captions, 39 % are distinct, 48 % within a window of 2,048 captions. A window
is therefore scored once per *distinct* fragment row u:
A_ku = Σ_{i∈g_k} max(0, vᵢᵀu) (the matmul, in chunks of distinct rows and
blocks of images), and S_kl = Σ_{j∈g_l} A_{k,u(j)} / normaliser (a sparse
count matrix). Every accumulation of `tf_twobranch.systems.fragments.losses.GLOBAL_SCORES`
(Σ or max over the image's fragments, with or without the ReLU) is a
function of the image and the row u alone, so each takes the same path with
its own A_ku (`accumulate_image_fragments`, the training objective's). The
result is the double sum exactly (summed in another order); memory is bounded by ``image_chunk × M × fragment_chunk`` floats and
the (images × window) block the core asks for, whatever the test size.
Identical captions get bit-identical scores (the same distinct rows, summed
in the same order), so the core's tie rule sees them as ties.

The per-fragment embeddings are computed once (`FragmentEmbeddingModel`
towers); the metrics come from `retrieval.evaluate_protocol`, with the items
passed as indices so that protocols with folds select their images and
captions as for every other model.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import scipy.sparse
import tensorflow as tf

from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.systems.fragments.losses import GLOBAL_SCORES, accumulate_image_fragments, global_score_denominators

__all__ = ["fragment_score_fn", "evaluate_fragment_retrieval", "distinct_rows"]


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


def distinct_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct, inverse): the distinct rows of a 2-D array (bit for bit) and each row's index among them.

    Rows are grouped by a digest of their bytes and compared in full, so the
    memory is one digest per row (sorting the rows as byte strings would copy
    the whole array twice).
    """
    rows = np.ascontiguousarray(rows)
    inverse = np.zeros(len(rows), np.int64)
    first: list[int] = []
    seen: dict[bytes, list[int]] = {}
    for r in range(len(rows)):
        candidates = seen.setdefault(hashlib.blake2b(rows[r], digest_size=16).digest(), [])
        for d in candidates:
            if np.array_equal(rows[first[d]], rows[r]):
                inverse[r] = d
                break
        else:
            candidates.append(len(first))
            inverse[r] = len(first)
            first.append(r)
    return rows[np.asarray(first, np.int64)], inverse


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges starts[i] .. starts[i] + lengths[i]."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(total, dtype=np.int64) + offsets


@tf.function(reduce_retracing=True)
def _accumulated_image_scores(image_fragments, image_mask, distinct_fragments, global_score):
    """A (Bi, U): e.g. Σ_i max(0, v_kiᵀu) over the valid fragments of every image k of the block, per distinct u."""
    return accumulate_image_fragments(tf.einsum("kmh,uh->kmu", image_fragments, distinct_fragments),
                                      image_mask, global_score=global_score)


def fragment_score_fn(image_fragments, image_mask, sentence_fragments, row_splits, *,
                      images: np.ndarray | None = None, sentences: np.ndarray | None = None,
                      smoothing: float = 5.0, normaliser: str = "paper", global_score: str = "sum_relu",
                      fragment_chunk: int = 2048, image_chunk: int = 250):
    """A `score_fn(start, stop)` (the evaluation core's scorer) of S_kl.

    Args:
      image_fragments: (num_images, M, h) embedded image fragments; `image_mask` (num_images, M).
      sentence_fragments: (total, h) embedded sentence fragments, sentence l owning rows
        ``row_splits[l]:row_splits[l + 1]`` (a sentence may have none: it scores 0).
      images, sentences: the indices scored (default all), e.g. one protocol fold.
      smoothing, normaliser, global_score: S_kl's settings (`FragmentEmbeddingConfig.score_options`).
      fragment_chunk, image_chunk: distinct sentence fragments and images per matmul (memory bound).
    """
    image_fragments, image_mask, sentence_fragments, row_splits = _check(
        image_fragments, image_mask, sentence_fragments, row_splits)
    images = np.arange(len(image_fragments)) if images is None else np.asarray(images)
    sentences = np.arange(len(row_splits) - 1) if sentences is None else np.asarray(sentences)
    if global_score not in GLOBAL_SCORES:
        raise UserInputError(f"global_score must be one of {GLOBAL_SCORES}, got {global_score!r}")
    image_blocks = [(tf.constant(image_fragments[images[i:i + image_chunk]]),
                     tf.constant(image_mask[images[i:i + image_chunk]]))
                    for i in range(0, len(images), image_chunk)]
    image_sizes = image_mask[images].sum(axis=1)
    distinct, distinct_of = distinct_rows(sentence_fragments)
    sentence_sizes = np.diff(row_splits)

    def score(start: int, stop: int) -> np.ndarray:
        rows = sentences[start:stop]
        lengths = sentence_sizes[rows]
        fragment_rows = _ranges(row_splits[rows], lengths)
        used, column = np.unique(distinct_of[fragment_rows], return_inverse=True)
        owner = np.repeat(np.arange(len(rows)), lengths)
        # counts[l, u]: how often caption l of the window holds distinct fragment u.
        counts = scipy.sparse.csc_matrix((np.ones(len(owner), np.float32), (owner, column.reshape(-1))),
                                         shape=(len(rows), len(used)))
        counts.sum_duplicates()
        totals = np.zeros((len(rows), len(images)), np.float32)
        for c in range(0, len(used), fragment_chunk):
            chunk = tf.constant(distinct[used[c:c + fragment_chunk]])
            accumulated = np.concatenate([_accumulated_image_scores(v, mask, chunk, global_score).numpy()
                                          for v, mask in image_blocks])
            totals += counts[:, c:c + fragment_chunk] @ accumulated.T
        denominators = global_score_denominators(image_sizes, lengths, smoothing=smoothing,
                                                 normaliser=normaliser).numpy()
        return totals.T / denominators

    return score


def evaluate_fragment_retrieval(image_fragments, image_mask, sentence_fragments, row_splits,
                                caption_image, protocol: str = "full", *,
                                ks: Sequence[int] = retrieval.DEFAULT_KS, smoothing: float = 5.0,
                                normaliser: str = "paper", global_score: str = "sum_relu",
                                chunk_size: int = 5000) -> dict:
    """Retrieval metrics of S_kl through the one evaluation core (R@K, median and mean rank, rsum).

    `chunk_size` captions are scored per call: wide, because the wider the
    window the fewer distinct fragments per caption it scores (Flickr8K test:
    53 % distinct in windows of 1,000 captions, 39 % in one of 5,000); the
    (images × window) block is what it costs in memory.
    """
    image_fragments, image_mask, sentence_fragments, row_splits = _check(
        image_fragments, image_mask, sentence_fragments, row_splits)
    num_images, num_sentences = len(image_fragments), len(row_splits) - 1

    def factory(images, sentences):
        return fragment_score_fn(image_fragments, image_mask, sentence_fragments, row_splits,
                                 images=images, sentences=sentences, smoothing=smoothing,
                                 normaliser=normaliser, global_score=global_score)

    return retrieval.evaluate_protocol(np.arange(num_images), np.arange(num_sentences), caption_image,
                                       protocol, ks=ks, chunk_size=chunk_size, score_fn_factory=factory)
