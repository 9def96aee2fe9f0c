"""The one retrieval evaluation core shared by every model of the package.

Everything reduces to one question per query: how many gallery items that are
*not* positives score strictly higher than the query's best positive? The
1-based rank of the query is one more than that count (ties favour the
positive, as a stable argsort does when positives come first). From ranks we
compute Recall@K, median and mean rank (the vsepp conventions: median rank is
`floor(median(rank0)) + 1`, mean rank `mean(rank0) + 1`).

The similarity matrix is never materialised whole: the gallery is processed
in chunks, so memory is bounded by `num_queries × chunk_size` and time grows
linearly in queries × gallery. Positive scores are computed from the pairs
directly, and positives are masked out of the counts, so rounding differences
between the pair scores and the chunked matmul cannot shift a rank.

Scorers:
* embeddings (cosine/dot, or negative Euclidean distance — the same ranking
  for L2-normalised vectors): `ranks_from_embeddings`.
* any model that scores (queries × gallery chunk) blocks (similarity
  network, combined distances, CCA): `ranks_from_score_fn`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tf_twobranch.errors import UserInputError

DEFAULT_KS = (1, 5, 10)
DEFAULT_CHUNK = 2048  # fastest here at MSCOCO-5K scale (benchmarks/)


@tf.function(jit_compile=True, reduce_retracing=True)
def _count_block(queries, gallery_chunk, threshold, query_group, gallery_group_chunk,
                 gallery_index_chunk, query_index, exclude_self):
    """Counts, per query and per gallery item, negatives above the threshold."""
    scores = tf.matmul(queries, gallery_chunk, transpose_b=True)
    return _counts_from_scores(scores, threshold, query_group, gallery_group_chunk,
                               gallery_index_chunk, query_index, exclude_self)


def _counts_from_scores(scores, threshold, query_group, gallery_group_chunk,
                        gallery_index_chunk, query_index, exclude_self):
    negative = tf.not_equal(query_group[:, None], gallery_group_chunk[None, :])
    excluded = tf.logical_and(exclude_self,
                              tf.equal(query_index[:, None], gallery_index_chunk[None, :]))
    beats = tf.logical_and(scores > threshold[:, None],
                           tf.logical_and(negative, tf.logical_not(excluded)))
    return tf.reduce_sum(tf.cast(beats, tf.int32), axis=1)


@tf.function(jit_compile=True, reduce_retracing=True)
def _cross_count_block(images, caption_chunk, image_threshold, caption_threshold,
                       caption_image_chunk):
    """One matmul serves both directions of image–text retrieval.

    Returns per-image counts of negative captions in the chunk above the
    image's best positive score, and per-caption counts of negative images
    above the caption's positive score.
    """
    scores = tf.matmul(images, caption_chunk, transpose_b=True)  # (I, c)
    image_ids = tf.range(tf.shape(images)[0])
    negative = tf.not_equal(image_ids[:, None], caption_image_chunk[None, :])
    img_beats = tf.logical_and(scores > image_threshold[:, None], negative)
    cap_beats = tf.logical_and(scores > caption_threshold[None, :], negative)
    return (tf.reduce_sum(tf.cast(img_beats, tf.int32), axis=1),
            tf.reduce_sum(tf.cast(cap_beats, tf.int32), axis=0))


def _as_matrix(x, name) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise UserInputError(f"{name} must be a 2-D array (n, d), got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        bad = int(np.argwhere(~np.isfinite(x))[0, 0])
        raise UserInputError(f"{name} has NaN/inf values (first at row {bad})")
    return x


def _check_caption_image(caption_image, num_images, num_captions) -> np.ndarray:
    caption_image = np.asarray(caption_image, dtype=np.int32)
    if caption_image.shape != (num_captions,):
        raise UserInputError(
            f"caption_image must have one entry per caption ({num_captions}), "
            f"got shape {caption_image.shape}")
    if num_captions and (caption_image.min() < 0 or caption_image.max() >= num_images):
        raise UserInputError(
            f"caption_image refers to image indices outside [0, {num_images})")
    return caption_image


def ranks_from_embeddings(image_embeds, text_embeds, caption_image, *,
                          chunk_size: int = DEFAULT_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """1-based ranks for image→text and text→image retrieval.

    Args:
      image_embeds: (num_images, d) embeddings; scores are dot products, so pass
        L2-normalised embeddings for cosine similarity.
      text_embeds: (num_captions, d).
      caption_image: (num_captions,) index of each caption's image.
      chunk_size: captions per block; peak memory ~ num_images × chunk_size × 5 bytes.

    Returns:
      (image_to_text_ranks (num_images,), text_to_image_ranks (num_captions,)).
      An image's rank is the best rank among its captions. Images without any
      caption get rank 0 and are excluded by `metrics_from_ranks`.
    """
    images = _as_matrix(image_embeds, "image_embeds")
    texts = _as_matrix(text_embeds, "text_embeds")
    if images.shape[1] != texts.shape[1]:
        raise UserInputError(f"embedding sizes differ: images {images.shape[1]}, "
                             f"texts {texts.shape[1]}")
    caption_image = _check_caption_image(caption_image, len(images), len(texts))
    positive_scores = np.einsum("nd,nd->n", texts, images[caption_image])
    best_positive = np.full(len(images), -np.inf, np.float32)
    np.maximum.at(best_positive, caption_image, positive_scores)
    has_caption = np.isfinite(best_positive)
    # Images without captions never count as "beaten", but a finite threshold
    # keeps XLA free of inf comparisons; their rank is reported as 0.
    image_threshold = np.where(has_caption, best_positive, np.float32(3e38))
    image_counts = np.zeros(len(images), np.int64)
    text_counts = np.empty(len(texts), np.int64)
    images_t = tf.constant(images)
    image_threshold_t = tf.constant(image_threshold)
    for start in range(0, len(texts), chunk_size):
        stop = min(start + chunk_size, len(texts))
        img_c, cap_c = _cross_count_block(
            images_t, tf.constant(texts[start:stop]), image_threshold_t,
            tf.constant(positive_scores[start:stop]), tf.constant(caption_image[start:stop]))
        image_counts += img_c.numpy()
        text_counts[start:stop] = cap_c.numpy()
    i2t = np.where(has_caption, image_counts + 1, 0)
    return i2t, text_counts + 1


def ranks_from_score_fn(score_fn: Callable[[int, int], np.ndarray], num_images: int,
                        caption_image, *, chunk_size: int = DEFAULT_CHUNK
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Ranks for any scorer that returns (num_images, stop-start) score blocks.

    `score_fn(start, stop)` scores every image against captions start..stop-1
    (higher is better). Two passes over the blocks: the first finds each
    query's positive scores, the second counts negatives above them.
    """
    caption_image = np.asarray(caption_image, dtype=np.int32)
    num_captions = len(caption_image)
    caption_image = _check_caption_image(caption_image, num_images, num_captions)
    positive_scores = np.empty(num_captions, np.float32)
    blocks = []
    for start in range(0, num_captions, chunk_size):
        stop = min(start + chunk_size, num_captions)
        block = np.asarray(score_fn(start, stop), np.float32)
        if block.shape != (num_images, stop - start):
            raise UserInputError(f"score_fn returned shape {block.shape}, expected "
                                 f"{(num_images, stop - start)}")
        positive_scores[start:stop] = block[caption_image[start:stop], np.arange(stop - start)]
        blocks.append((start, stop))
    best_positive = np.full(num_images, -np.inf, np.float32)
    np.maximum.at(best_positive, caption_image, positive_scores)
    has_caption = np.isfinite(best_positive)
    image_threshold = np.where(has_caption, best_positive, np.inf)
    image_counts = np.zeros(num_images, np.int64)
    text_counts = np.empty(num_captions, np.int64)
    image_ids = np.arange(num_images)
    for start, stop in blocks:
        block = np.asarray(score_fn(start, stop), np.float32)
        negative = image_ids[:, None] != caption_image[None, start:stop]
        image_counts += ((block > image_threshold[:, None]) & negative).sum(axis=1)
        text_counts[start:stop] = ((block > positive_scores[None, start:stop]) & negative).sum(0)
    return np.where(has_caption, image_counts + 1, 0), text_counts + 1


def ranks_from_score_matrix(scores, caption_image) -> tuple[np.ndarray, np.ndarray]:
    """Ranks from a full (num_images, num_captions) score matrix (higher is better)."""
    scores = np.asarray(scores, np.float32)
    return ranks_from_score_fn(lambda a, b: scores[:, a:b], scores.shape[0], caption_image,
                               chunk_size=max(1, scores.shape[1]))


def group_ranks(query_embeds, gallery_embeds, query_group, gallery_group, *,
                exclude_same_index: bool = False,
                chunk_size: int = DEFAULT_CHUNK) -> np.ndarray:
    """Generic best-positive ranks: positives share a group id.

    Used for sentence-to-sentence retrieval (queries and gallery are the same
    captions, group = image, the query itself excluded) and any within-view
    retrieval.
    """
    queries = _as_matrix(query_embeds, "query_embeds")
    gallery = _as_matrix(gallery_embeds, "gallery_embeds")
    query_group = np.asarray(query_group, np.int32)
    gallery_group = np.asarray(gallery_group, np.int32)
    # Best positive score per query, computed without the chunked matmul.
    best = np.full(len(queries), -np.inf, np.float32)
    order = np.argsort(gallery_group, kind="stable")
    sorted_groups = gallery_group[order]
    for q_start in range(0, len(queries), chunk_size):
        q_stop = min(q_start + chunk_size, len(queries))
        for qi in range(q_start, q_stop):
            lo = np.searchsorted(sorted_groups, query_group[qi], "left")
            hi = np.searchsorted(sorted_groups, query_group[qi], "right")
            members = order[lo:hi]
            if exclude_same_index:
                members = members[members != qi]
            if len(members):
                best[qi] = np.max(gallery[members] @ queries[qi])
    has_positive = np.isfinite(best)
    threshold = np.where(has_positive, best, np.float32(3e38)).astype(np.float32)
    counts = np.zeros(len(queries), np.int64)
    queries_t = tf.constant(queries)
    query_index = tf.range(len(queries), dtype=tf.int32)
    for start in range(0, len(gallery), chunk_size):
        stop = min(start + chunk_size, len(gallery))
        counts += _count_block(
            queries_t, tf.constant(gallery[start:stop]), tf.constant(threshold),
            tf.constant(query_group), tf.constant(gallery_group[start:stop]),
            tf.range(start, stop, dtype=tf.int32), query_index,
            tf.constant(exclude_same_index)).numpy()
    return np.where(has_positive, counts + 1, 0)


def metrics_from_ranks(ranks, ks: Sequence[int] = DEFAULT_KS, prefix: str = "") -> dict:
    """R@K (percent), median and mean rank from 1-based ranks (0 = no positive)."""
    ranks = np.asarray(ranks)
    ranks = ranks[ranks > 0]
    out = {}
    if len(ranks) == 0:
        raise UserInputError("no query has a positive in the gallery; cannot compute recall")
    for k in ks:
        out[f"{prefix}r{k}"] = float(100.0 * np.mean(ranks <= k))
    rank0 = ranks - 1
    out[f"{prefix}medr"] = float(np.floor(np.median(rank0)) + 1)
    out[f"{prefix}meanr"] = float(rank0.mean() + 1)
    return out


def retrieval_metrics_from_ranks(i2t_ranks, t2i_ranks, ks=DEFAULT_KS) -> dict:
    out = {}
    out.update(metrics_from_ranks(i2t_ranks, ks, prefix="i2t_"))
    out.update(metrics_from_ranks(t2i_ranks, ks, prefix="t2i_"))
    out["rsum"] = float(sum(out[f"i2t_r{k}"] + out[f"t2i_r{k}"] for k in ks))
    return out


def retrieval_metrics(image_embeds, text_embeds, caption_image, *, ks=DEFAULT_KS,
                      chunk_size: int = DEFAULT_CHUNK) -> dict:
    """Image→text and text→image R@K, medr, meanr and rsum from embeddings."""
    i2t, t2i = ranks_from_embeddings(image_embeds, text_embeds, caption_image,
                                     chunk_size=chunk_size)
    return retrieval_metrics_from_ranks(i2t, t2i, ks)


def sentence_retrieval_metrics(text_embeds, caption_image, ks=DEFAULT_KS, *,
                               chunk_size: int = DEFAULT_CHUNK) -> dict:
    """Sentence-to-sentence retrieval (TPAMI §5.5, Table 4).

    Each caption queries all other captions; positives are the other captions
    of the same image. Embeddings should be L2-normalised (cosine).
    """
    texts = _as_matrix(text_embeds, "text_embeds")
    norms = np.linalg.norm(texts, axis=1, keepdims=True)
    texts = texts / np.maximum(norms, 1e-12)
    caption_image = np.asarray(caption_image, np.int32)
    ranks = group_ranks(texts, texts, caption_image, caption_image,
                        exclude_same_index=True, chunk_size=chunk_size)
    return metrics_from_ranks(ranks, ks, prefix="s2s_")


# --- Protocols -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Protocol:
    """How a test set is cut into galleries whose metrics are averaged."""
    name: str
    fold_images: int | None  # None = the whole test set is one gallery
    num_folds: int | None = None  # None = as many consecutive folds as fit


PROTOCOLS = {
    "full": Protocol("full", None),
    "flickr30k_1k": Protocol("flickr30k_1k", None),
    "coco_1k": Protocol("coco_1k", 1000, 5),
    "coco_5k": Protocol("coco_5k", None),
}


def evaluate_protocol(image_embeds, text_embeds, caption_image, protocol: str = "full", *,
                      ks=DEFAULT_KS, chunk_size: int = DEFAULT_CHUNK) -> dict:
    """Metrics under a named protocol.

    "coco_1k" averages five consecutive 1,000-image folds (and their
    captions) of the 5K test set; "coco_5k", "flickr30k_1k" and "full" use
    the whole given test set as one gallery.
    """
    if protocol not in PROTOCOLS:
        raise UserInputError(f"unknown protocol {protocol!r}; expected one of "
                             f"{sorted(PROTOCOLS)}")
    spec = PROTOCOLS[protocol]
    image_embeds = np.asarray(image_embeds, np.float32)
    text_embeds = np.asarray(text_embeds, np.float32)
    caption_image = np.asarray(caption_image, np.int32)
    if spec.fold_images is None:
        return retrieval_metrics(image_embeds, text_embeds, caption_image, ks=ks,
                                 chunk_size=chunk_size)
    num_folds = spec.num_folds or len(image_embeds) // spec.fold_images
    available = len(image_embeds) // spec.fold_images
    if available < 1:
        raise UserInputError(f"protocol {protocol} needs at least {spec.fold_images} test "
                             f"images, got {len(image_embeds)}")
    if available < num_folds:
        # A smaller test set (e.g. the embedded data) gets as many folds as fit.
        logging.warning("protocol %s: only %d of %d folds of %d images fit the %d test images",
                        protocol, available, num_folds, spec.fold_images, len(image_embeds))
        num_folds = available
    fold_metrics = []
    for f in range(num_folds):
        lo, hi = f * spec.fold_images, (f + 1) * spec.fold_images
        sel = (caption_image >= lo) & (caption_image < hi)
        fold_metrics.append(retrieval_metrics(image_embeds[lo:hi], text_embeds[sel],
                                              caption_image[sel] - lo, ks=ks,
                                              chunk_size=chunk_size))
    return {key: float(np.mean([m[key] for m in fold_metrics])) for key in fold_metrics[0]}
