"""The one retrieval evaluation core shared by every model of the package.

Everything reduces to one question per query: how many gallery items that are
*not* positives score at least as high as the query's best positive? The
1-based rank of the query is one more than that count. Ties count against the
query (ranks are pessimistic): a collapsed model whose scores are all equal
ranks every query last, never first, so it scores at (or below) chance. From
ranks we compute Recall@K, median and mean rank with the vsepp conventions
(median rank `floor(median(rank0)) + 1`, mean rank `mean(rank0) + 1`). On
tie-free scores the ranks equal vsepp's `i2t`/`t2i` exactly; where vsepp
breaks a tie by the order of `numpy.argsort`, we always break it against the
query.

A query's positive and negative scores always come out of the same matmul
call: the gallery is scored in blocks that hold whole query rows (`rows ×
gallery`), and the best positive is read from the same block as the negatives
it is compared with. Comparing an `einsum` of the pairs with a matmul (as
earlier versions did) lets rounding, which depends on the call's shapes,
break exact ties either way. Within one call identical gallery vectors get
identical scores, so duplicated captions tie exactly.

Memory is bounded by the block (`rows × gallery` scores), never the whole
similarity matrix; time grows linearly in queries × gallery. Image→text and
text→image are two passes (one per query side).

Scorers:
* embeddings (cosine/dot, or negative Euclidean distance — the same ranking
  for L2-normalised vectors): `ranks_from_embeddings`, `group_ranks`.
* any model that scores (images × caption chunk) blocks (similarity
  network, combined distances, CCA): `ranks_from_score_fn`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tf_twobranch.errors import UserInputError
from tf_twobranch.vectors import l2_normalize_rows

DEFAULT_KS = (1, 5, 10)
DEFAULT_CHUNK = 2048  # fastest here at MSCOCO-5K scale (benchmarks/)
# Score blocks of ranks_from_score_fn are kept (not recomputed) up to this size.
_KEEP_SCORE_BLOCKS_BYTES = 1 << 30
# Total variance across items below this fraction of the mean squared norm:
# every item is (nearly) the same vector.
_DEGENERATE_RELATIVE_VARIANCE = 1e-6
_DEGENERACY_BLOCK_ROWS = 2048
_NO_POSITIVE = np.float32(-3e38)  # finite, so XLA never compares infinities


@tf.function(jit_compile=True, reduce_retracing=True)
def _count_rows(queries, gallery, query_group, gallery_group, query_index, gallery_index,
                exclude_self):
    """Per query row: best positive score, whether it has one, negatives scoring >= it."""
    scores = tf.matmul(queries, gallery, transpose_b=True)  # (rows, G): one call
    same_group = tf.equal(query_group[:, None], gallery_group[None, :])
    excluded = tf.logical_and(exclude_self,
                              tf.equal(query_index[:, None], gallery_index[None, :]))
    positive = tf.logical_and(same_group, tf.logical_not(excluded))
    negative = tf.logical_and(tf.logical_not(same_group), tf.logical_not(excluded))
    best = tf.reduce_max(tf.where(positive, scores, _NO_POSITIVE), axis=1)
    has_positive = tf.reduce_any(positive, axis=1)
    beats = tf.logical_and(negative, scores >= best[:, None])
    return tf.reduce_sum(tf.cast(beats, tf.int32), axis=1), has_positive


def _as_matrix(x, name) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise UserInputError(f"{name} must be a 2-D array (n, d), got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        bad = int(np.argwhere(~np.isfinite(x))[0, 0])
        raise UserInputError(f"{name} has NaN/inf values (first at row {bad})")
    return x


def is_degenerate(embeds) -> bool:
    """True when the rows are (nearly) one vector: near-zero variance across items."""
    x = np.asarray(embeds)
    if x.ndim != 2 or len(x) < 2:
        return False
    # Centred sums in float64 over row blocks: the same figures as a whole-array
    # float64 `var`, without its full-size float64 copies (3.5x faster at 25,000 x 512).
    mean = x.mean(axis=0, dtype=np.float64)
    spread = scale = 0.0
    for start in range(0, len(x), _DEGENERACY_BLOCK_ROWS):
        block = np.asarray(x[start:start + _DEGENERACY_BLOCK_ROWS], np.float64)
        scale += float(np.einsum("ij,ij->", block, block))
        block -= mean
        spread += float(np.einsum("ij,ij->", block, block))
    spread, scale = spread / len(x), scale / len(x)
    return spread <= _DEGENERATE_RELATIVE_VARIANCE * scale or scale == 0.0


def warn_if_degenerate(embeds, name: str) -> bool:
    """Logs a warning (and returns True) when a split's embeddings have collapsed."""
    if is_degenerate(embeds):
        logging.warning(
            "%s are degenerate: %d rows with (near-)zero variance across items — a collapsed "
            "model or constant/zero input features. Ties count against the query, so its "
            "recalls are at or below chance.", name, len(embeds))
        return True
    return False


def _check_caption_image(caption_image, num_images, num_captions) -> np.ndarray:
    caption_image = np.asarray(caption_image)
    if caption_image.shape != (num_captions,):
        raise UserInputError(
            f"caption_image must have one entry per caption ({num_captions}), "
            f"got shape {caption_image.shape}")
    if num_captions and not np.issubdtype(caption_image.dtype, np.integer):
        raise UserInputError(f"caption_image must hold integer image indices, got "
                             f"dtype {caption_image.dtype}")
    caption_image = caption_image.astype(np.int32)
    if num_captions and (caption_image.min() < 0 or caption_image.max() >= num_images):
        raise UserInputError(
            f"caption_image refers to image indices outside [0, {num_images})")
    return caption_image


def group_ranks(query_embeds, gallery_embeds, query_group, gallery_group, *,
                exclude_same_index: bool = False, chunk_size: int = DEFAULT_CHUNK,
                max_block_elements: int | None = None, warn: bool = True) -> np.ndarray:
    """1-based best-positive ranks: gallery items sharing a query's group are its positives.

    Rank = 1 + the number of negatives scoring at least as high as the query's
    best positive (dot products; ties count against the query). Queries
    without a positive get rank 0 (excluded by `metrics_from_ranks`).

    Args:
      query_embeds, gallery_embeds: (Q, d) and (G, d).
      query_group, gallery_group: (Q,) and (G,) integer group ids.
      exclude_same_index: the query with index i is not compared with gallery
        item i (sentence-to-sentence retrieval, where both are the same set).
      chunk_size: queries per block (at most).
      max_block_elements: at most this many scores per block (default
        `chunk_size × G`); rows per block = max(1, this // G).
      warn: log a warning when the queries or the gallery are degenerate.
    """
    queries = _as_matrix(query_embeds, "query_embeds")
    gallery = _as_matrix(gallery_embeds, "gallery_embeds")
    if queries.shape[1] != gallery.shape[1]:
        raise UserInputError(f"embedding sizes differ: queries {queries.shape[1]}, "
                             f"gallery {gallery.shape[1]}")
    query_group = np.asarray(query_group, np.int32)
    gallery_group = np.asarray(gallery_group, np.int32)
    if query_group.shape != (len(queries),) or gallery_group.shape != (len(gallery),):
        raise UserInputError(f"need one group id per query ({len(queries)}) and per gallery "
                             f"item ({len(gallery)}), got {query_group.shape} and "
                             f"{gallery_group.shape}")
    num_queries, num_gallery = len(queries), len(gallery)
    if warn:
        warn_if_degenerate(queries, "query embeddings")
        if gallery is not queries:
            warn_if_degenerate(gallery, "gallery embeddings")
    if num_queries == 0:
        return np.zeros(0, np.int64)
    budget = max_block_elements or chunk_size * max(1, num_gallery)
    rows = int(max(1, min(chunk_size, budget // max(1, num_gallery), num_queries)))
    gallery_t = tf.constant(gallery)
    gallery_group_t = tf.constant(gallery_group)
    gallery_index_t = tf.range(num_gallery, dtype=tf.int32)
    exclude_t = tf.constant(exclude_same_index)
    counts = np.zeros(num_queries, np.int64)
    has_positive = np.zeros(num_queries, bool)
    for start in range(0, num_queries, rows):
        stop = min(start + rows, num_queries)
        block = queries[start:stop]
        group = query_group[start:stop]
        index = np.arange(start, stop, dtype=np.int32)
        if stop - start < rows:
            # Pad the last block to the compiled shape (no recompilation);
            # the padded rows' results are dropped below.
            pad = rows - (stop - start)
            block = np.concatenate([block, np.zeros((pad, block.shape[1]), np.float32)])
            group = np.concatenate([group, np.zeros(pad, np.int32)])
            index = np.concatenate([index, np.full(pad, -1, np.int32)])
        count, positive = _count_rows(tf.constant(block), gallery_t, tf.constant(group),
                                      gallery_group_t, tf.constant(index), gallery_index_t,
                                      exclude_t)
        counts[start:stop] = count.numpy()[:stop - start]
        has_positive[start:stop] = positive.numpy()[:stop - start]
    return np.where(has_positive, counts + 1, 0)


@tf.function(jit_compile=True, reduce_retracing=True)
def _score_caption_block(images, texts, caption_image):
    """One block of the pass: every image against a window of captions.

    Returns the (images, rows) scores, each caption's positive score (read
    from those scores) and its count of other images scoring >= it. The
    positive itself is among the images >= it, hence the -1; a padded row
    (image 0, a zero vector) is dropped by the caller. One fused pass over
    the block besides the matmul.
    """
    scores = tf.matmul(images, texts, transpose_b=True)  # (I, rows): one call
    rows = tf.range(tf.shape(texts)[0], dtype=caption_image.dtype)
    positive = tf.gather_nd(scores, tf.stack([caption_image, rows], axis=1))
    at_least = tf.reduce_sum(tf.cast(scores >= positive[None, :], tf.int32), axis=0)
    return scores, positive, at_least - 1


@tf.function(jit_compile=True, reduce_retracing=True)
def _count_at_least(scores, best, valid_rows):
    """Per image: captions among the window's first `valid_rows` scoring >= its best positive."""
    valid = tf.range(tf.shape(scores)[1]) < valid_rows
    beats = tf.logical_and(valid[None, :], scores >= best[:, None])
    return tf.reduce_sum(tf.cast(beats, tf.int32), axis=1)


def ranks_from_embeddings(image_embeds, text_embeds, caption_image, *,
                          chunk_size: int = DEFAULT_CHUNK,
                          keep_bytes: int = _KEEP_SCORE_BLOCKS_BYTES) -> tuple[np.ndarray, np.ndarray]:
    """1-based ranks for image→text and text→image retrieval, both from one pass of score blocks.

    Args:
      image_embeds: (num_images, d) embeddings; scores are dot products, so pass
        L2-normalised embeddings for cosine similarity.
      text_embeds: (num_captions, d).
      caption_image: (num_captions,) index of each caption's image.
      chunk_size: captions per block (a block holds num_images × chunk_size scores).
      keep_bytes: the blocks are kept (not scored again) while the whole
        score matrix fits in this many bytes; beyond it the image side
        scores each block a second time (same shapes, so the same scores).

    Each block scores every image against a window of captions in one matmul
    call: a caption's positive and its negatives come from that call; an
    image's best positive is the best over its captions' blocks, and its
    negatives are counted over the same blocks once every block is scored.

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
    caption_image = _check_caption_image(caption_image, len(images), len(texts)).astype(np.int32)
    warn_if_degenerate(images, "image embeddings")
    warn_if_degenerate(texts, "text embeddings")
    num_images, num_captions = len(images), len(texts)
    if num_images == 0 or num_captions == 0:
        return np.zeros(num_images, np.int64), np.zeros(num_captions, np.int64)
    rows = int(max(1, min(chunk_size, num_captions)))
    keep = num_images * num_captions * 4 <= keep_bytes
    images_t = tf.constant(images)

    def window(start):
        stop = min(start + rows, num_captions)
        block, owner = texts[start:stop], caption_image[start:stop]
        if stop - start < rows:
            # Padded to the compiled shape; padded rows' results are dropped.
            pad = rows - (stop - start)
            block = np.concatenate([block, np.zeros((pad, block.shape[1]), np.float32)])
            owner = np.concatenate([owner, np.zeros(pad, np.int32)])
        return tf.constant(block), tf.constant(owner), stop

    text_counts = np.zeros(num_captions, np.int64)
    positives = np.zeros(num_captions, np.float32)
    kept = []
    for start in range(0, num_captions, rows):
        block, owner, stop = window(start)
        scores, positive, counts = _score_caption_block(images_t, block, owner)
        text_counts[start:stop] = counts.numpy()[:stop - start]
        positives[start:stop] = positive.numpy()[:stop - start]
        kept.append((scores if keep else None, stop - start))
    best = np.full(num_images, _NO_POSITIVE, np.float32)
    np.maximum.at(best, caption_image, positives)
    best_t = tf.constant(best)
    at_least = np.zeros(num_images, np.int64)
    for k, (scores, valid) in enumerate(kept):
        if scores is None:
            scores = _score_caption_block(images_t, *window(k * rows)[:2])[0]
        at_least += _count_at_least(scores, best_t, valid).numpy()
    # The image's own captions among those >= its best positive are not negatives.
    own = np.bincount(caption_image, weights=positives >= best[caption_image],
                      minlength=num_images).astype(np.int64)
    image_counts = at_least - own
    has_caption = np.bincount(caption_image, minlength=num_images) > 0
    return np.where(has_caption, image_counts + 1, 0), text_counts + 1


def score_window(num_captions: int, chunk_size: int = DEFAULT_CHUNK,
                 columns_per_call: int | None = None) -> int:
    """Captions per `score_fn` call of `ranks_from_score_fn`: `chunk_size` (all captions when fewer).

    A scorer that scores `columns_per_call` captions at a time, padding its
    last call (the similarity head), gets a multiple of that width instead,
    as small as the same number of windows allows: the windows then cover
    the captions with the fewest of its calls. Otherwise the overlap of the
    last window is scored twice (5,000 captions in windows of 2,048 at 262
    per call: 24 calls where 21 do).
    """
    window = max(1, min(int(chunk_size), num_captions))
    if not columns_per_call or num_captions < 1:
        return window
    columns_per_call = int(columns_per_call)
    calls = -(-num_captions // columns_per_call)
    windows = -(-num_captions // window)
    return max(1, min(num_captions, columns_per_call * -(-calls // windows)))


def ranks_from_score_fn(score_fn: Callable[[int, int], np.ndarray], num_images: int,
                        caption_image, *, chunk_size: int = DEFAULT_CHUNK,
                        columns_per_call: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ranks for any scorer that returns (num_images, stop-start) score blocks.

    `score_fn(start, stop)` scores every image against captions start..stop-1
    (higher is better); it is always called with the same number of captions,
    `score_window(num_captions, chunk_size, columns_per_call)` (the last
    window overlaps), where `columns_per_call` defaults to the scorer's own
    attribute of that name (`TwoBranchModel.score_fn` has one). A caption's
    positive and negatives sit in one block.
    An image's best positive is read from the blocks of its captions; the
    blocks are kept for the image-side count when they fit in 1 GiB,
    otherwise scored again (and checked to reproduce the positives: a scorer
    that is not deterministic is reported).
    """
    caption_image = np.asarray(caption_image)
    num_captions = len(caption_image)
    caption_image = _check_caption_image(caption_image, num_images, num_captions)
    keep = num_images * num_captions * 4 <= _KEEP_SCORE_BLOCKS_BYTES
    positive_scores = np.empty(num_captions, np.float32)
    text_counts = np.empty(num_captions, np.int64)
    image_ids = np.arange(num_images)
    kept, spans = [], []
    flat = True

    chunk_size = score_window(num_captions, chunk_size,
                              columns_per_call or getattr(score_fn, "columns_per_call", None))

    def block_for(start, stop):
        # Every call asks for chunk_size captions (the last window overlaps
        # the one before): a scorer's rounding may depend on its input's
        # shape, and identical pairs must score identically across blocks.
        first = min(start, num_captions - chunk_size)
        block = np.asarray(score_fn(first, first + chunk_size), np.float32)
        if block.shape != (num_images, chunk_size):
            raise UserInputError(f"score_fn returned shape {block.shape}, expected "
                                 f"{(num_images, chunk_size)}")
        block = block[:, start - first:stop - first]
        if np.isnan(block).any():
            raise UserInputError(f"score_fn returned NaN scores for captions {start}..{stop - 1}")
        return block

    for start in range(0, num_captions, chunk_size):
        stop = min(start + chunk_size, num_captions)
        block = block_for(start, stop)
        flat = flat and bool(np.all(block == block.flat[0]))
        positives = block[caption_image[start:stop], np.arange(stop - start)]
        positive_scores[start:stop] = positives
        negative = image_ids[:, None] != caption_image[None, start:stop]
        text_counts[start:stop] = ((block >= positives[None, :]) & negative).sum(0)
        spans.append((start, stop))
        if keep:
            kept.append(block)
    if flat and num_images > 1 and num_captions:
        logging.warning("every score is the same (%d images x %d captions): a collapsed model "
                        "or constant inputs; ties count against the query, so recalls are at "
                        "or below chance", num_images, num_captions)
    best_positive = np.full(num_images, -np.inf, np.float32)
    np.maximum.at(best_positive, caption_image, positive_scores)
    has_caption = np.isfinite(best_positive)
    image_counts = np.zeros(num_images, np.int64)
    for k, (start, stop) in enumerate(spans):
        block = kept[k] if keep else block_for(start, stop)
        if not keep and not np.array_equal(
                block[caption_image[start:stop], np.arange(stop - start)],
                positive_scores[start:stop]):
            logging.warning("score_fn gave different scores for captions %d..%d when called "
                            "again; image-to-text ranks use the first call's positives",
                            start, stop - 1)
        negative = image_ids[:, None] != caption_image[None, start:stop]
        image_counts += ((block >= best_positive[:, None]) & negative).sum(axis=1)
    return np.where(has_caption, image_counts + 1, 0), text_counts + 1


def ranks_from_score_matrix(scores, caption_image) -> tuple[np.ndarray, np.ndarray]:
    """Ranks from a full (num_images, num_captions) score matrix (higher is better)."""
    scores = np.asarray(scores, np.float32)
    return ranks_from_score_fn(lambda a, b: scores[:, a:b], scores.shape[0], caption_image,
                               chunk_size=max(1, scores.shape[1]))


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
    texts = l2_normalize_rows(_as_matrix(text_embeds, "text_embeds"))
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
    # Hodosh et al.'s protocol (the `*` rows of Karpathy et al.): only each
    # image's first caption is kept, N sentences for N images instead of 5N.
    first_caption_only: bool = False
    # The test split's size the protocol is defined on (None: any size). A
    # figure under a sized protocol is comparable with the literature's only
    # on a split of that size, so any other size is refused.
    test_images: int | None = None

    @property
    def required_images(self) -> int | None:
        if self.test_images is not None:
            return self.test_images
        if self.fold_images is not None and self.num_folds is not None:
            return self.fold_images * self.num_folds
        return None


PROTOCOLS = {
    "full": Protocol("full", None),
    "flickr30k_1k": Protocol("flickr30k_1k", None, test_images=1000),
    "flickr8k_1k": Protocol("flickr8k_1k", None, test_images=1000),
    "coco_1k": Protocol("coco_1k", 1000, 5),
    "coco_5k": Protocol("coco_5k", None, test_images=5000),
    "first_caption": Protocol("first_caption", None, first_caption_only=True),
    "folds_100": Protocol("folds_100", 100),
}


def protocol_spec(protocol: str) -> Protocol:
    if protocol not in PROTOCOLS:
        raise UserInputError(f"unknown protocol {protocol!r}; expected one of "
                             f"{sorted(PROTOCOLS)}")
    return PROTOCOLS[protocol]


def protocol_fits(protocol: str, num_images: int) -> bool:
    """Whether `protocol` can be applied to a test split of `num_images` images."""
    spec = protocol_spec(protocol)
    if spec.required_images is not None:
        return num_images == spec.required_images
    return spec.fold_images is None or num_images >= spec.fold_images


def protocol_mismatch(protocol: str, num_images: int, *, split: str = "the test split") -> str | None:
    """Why `protocol` cannot be applied to a test split of `num_images` images (None: it can)."""
    spec = protocol_spec(protocol)
    if protocol_fits(protocol, num_images):
        return None
    if spec.required_images is not None:
        expected = f"exactly {spec.required_images} test images"
        if spec.fold_images:
            expected += f" ({spec.num_folds} folds of {spec.fold_images})"
    else:
        expected = f"at least {spec.fold_images} test images (folds of {spec.fold_images})"
    return f"protocol {protocol} needs {expected}, but {split} has {num_images}"


def check_protocol(protocol: str, num_images: int, *, split: str = "the test split") -> None:
    """Refuses a protocol applied to a test split of the wrong size (naming both)."""
    reason = protocol_mismatch(protocol, num_images, split=split)
    if reason:
        raise UserInputError(f"{reason}; pass --protocol=full to score this split as one gallery")


def describe_protocol(protocol: str, num_images: int) -> str:
    """What a figure under `protocol` on `num_images` test images is, for table titles."""
    spec = protocol_spec(protocol)
    if spec.first_caption_only:
        return f"protocol {protocol}: one gallery of {num_images} test images, each with its first caption"
    if spec.fold_images is None:
        return f"protocol {protocol}: one gallery of {num_images} test images"
    folds = spec.num_folds or num_images // spec.fold_images
    return (f"protocol {protocol}: mean (± std) of {folds} folds of {spec.fold_images} images "
            f"of the {num_images} test images")


def protocols_agree(protocol: str, num_images: int, other: str | None) -> bool:
    """Whether a figure under `protocol` on `num_images` test images is measured like one
    under `other` (e.g. the paper's): the same protocol, or "full" on exactly the
    test-split size of a single-gallery protocol (one gallery of 5,000 is coco_5k)."""
    if not other:
        return False
    if other == protocol:
        return True
    spec = protocol_spec(other)
    return (protocol == "full" and spec.fold_images is None and not spec.first_caption_only
            and spec.required_images == num_images)


def first_caption_rows(caption_image) -> np.ndarray:
    """Indices of each image's first caption (in caption order), in caption order."""
    caption_image = np.asarray(caption_image)
    _, first = np.unique(caption_image, return_index=True)
    return np.sort(first)


def evaluate_protocol(image_embeds, text_embeds, caption_image, protocol: str = "full", *,
                      ks=DEFAULT_KS, chunk_size: int = DEFAULT_CHUNK,
                      score_fn_factory: Callable | None = None) -> dict:
    """Metrics under a named protocol.

    "coco_1k" averages the five consecutive 1,000-image folds (and their
    captions) of the 5K test set; "coco_5k" (5,000 images), "flickr30k_1k"
    and "flickr8k_1k" (1,000 images) and "full" (any size) use the whole
    given test set as one gallery; "first_caption" (Hodosh et al., the `*`
    rows of Karpathy et al.) keeps only each image's first caption, one
    gallery of N images and N captions; "folds_100" (Das et al., Table 1)
    averages as many consecutive 100-image folds as fit. A sized protocol
    applied to a test set of another size is refused (`check_protocol`).

    Fold protocols also give the spread of the folds: `num_folds` and, per
    metric, `<metric>_fold_std` (population standard deviation over folds).

    Models whose score is not a dot product of the two embeddings (the
    similarity network) pass `score_fn_factory(image_embeds, text_embeds)`,
    which returns a `ranks_from_score_fn` scorer for those rows; every fold
    is then ranked through it. The embeddings may then be any per-item
    arrays the factory understands.
    """
    spec = protocol_spec(protocol)
    check_protocol(protocol, len(image_embeds))
    if score_fn_factory is None:
        image_embeds = np.asarray(image_embeds, np.float32)
        text_embeds = np.asarray(text_embeds, np.float32)
    caption_image = np.asarray(caption_image, np.int32)

    def metrics(images, texts, groups):
        if score_fn_factory is None:
            return retrieval_metrics(images, texts, groups, ks=ks, chunk_size=chunk_size)
        i2t, t2i = ranks_from_score_fn(score_fn_factory(images, texts), len(images), groups,
                                       chunk_size=chunk_size)
        return retrieval_metrics_from_ranks(i2t, t2i, ks)

    if spec.first_caption_only:
        keep = first_caption_rows(caption_image)
        return metrics(image_embeds, text_embeds[keep], caption_image[keep])
    if spec.fold_images is None:
        return metrics(image_embeds, text_embeds, caption_image)
    num_folds = spec.num_folds or len(image_embeds) // spec.fold_images
    fold_metrics = []
    for f in range(num_folds):
        lo, hi = f * spec.fold_images, (f + 1) * spec.fold_images
        sel = (caption_image >= lo) & (caption_image < hi)
        fold_metrics.append(metrics(image_embeds[lo:hi], text_embeds[sel], caption_image[sel] - lo))
    out = {key: float(np.mean([m[key] for m in fold_metrics])) for key in fold_metrics[0]}
    out.update({f"{key}_fold_std": float(np.std([m[key] for m in fold_metrics]))
                for key in fold_metrics[0]})
    out["num_folds"] = num_folds
    return out


def random_baseline_metrics(num_images: int, caption_image, *, protocol: str = "full",
                            dim: int = 64, seed: int = 0, ks=DEFAULT_KS) -> dict:
    """What random embeddings score on a test split: the chance level a model must beat.

    Random unit vectors (`dim`-d, seeded) for the images and captions, ranked
    by the same core and protocol as a trained model.
    """
    rng = np.random.default_rng(seed)
    caption_image = np.asarray(caption_image)
    images = rng.normal(size=(num_images, dim)).astype(np.float32)
    texts = rng.normal(size=(len(caption_image), dim)).astype(np.float32)
    return evaluate_protocol(l2_normalize_rows(images), l2_normalize_rows(texts), caption_image, protocol, ks=ks)
