"""Phrase-localization evaluation (TPAMI 2018 §4.4, Flickr30K Entities protocol).

For each phrase the proposals of its image are ranked by score (higher is
better); a proposal is correct when its IoU with the phrase's ground-truth
box (the box enclosing all boxes of a plural chain) is ≥ 0.5. The phrase's
rank is one more than the number of *incorrect* proposals scoring at least
as high as its best-scoring correct proposal — ties count against the
phrase, as in the retrieval core, so a model that scores every proposal
alike localizes nothing (R@1 0 unless every proposal is correct). R@K is the percentage of *all* phrases
with rank ≤ K (phrases without any correct proposal count as misses), and
the upper bound is the percentage of phrases with at least one correct
proposal (the paper's R@200 = 84.58).

Ranks are computed once (:func:`phrase_localization_ranks`) for any scorer:
the embedding network (score = −distance, or cosine: the same ranking for
L2-normalised vectors) and the similarity network (score = logit) share the
code path, so equal rankings give equal metrics. Recall comes from the shared
core (:func:`tf_twobranch.evaluation.retrieval.metrics_from_ranks`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import threadpoolctl
import tensorflow as tf

from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation.retrieval import DEFAULT_KS, metrics_from_ranks
from tf_twobranch.vectors import l2_normalize_rows

IOU_THRESHOLD = 0.5


def _pad_scores(scores, valid):
    if isinstance(scores, (list, tuple)):
        lengths = [len(np.ravel(s)) for s in scores]
        width = max(lengths) if lengths else 0
        padded = np.full((len(scores), width), -np.inf, np.float64)
        mask = np.zeros((len(scores), width), bool)
        for i, row in enumerate(scores):
            row = np.asarray(row, np.float64).ravel()
            padded[i, :len(row)] = row
            mask[i, :len(row)] = True
        if valid is not None:
            raise UserInputError("pass either a list of per-phrase scores or a padded matrix with `valid`, not both")
        return padded, mask
    padded = np.asarray(scores, np.float64)
    if padded.ndim != 2:
        raise UserInputError(f"scores must be a (num_phrases, num_proposals) matrix, got shape {padded.shape}")
    mask = np.ones(padded.shape, bool) if valid is None else np.asarray(valid, bool)
    if mask.shape != padded.shape:
        raise UserInputError(f"valid has shape {mask.shape}, scores {padded.shape}")
    return padded, mask


def phrase_localization_ranks(scores, proposal_iou, valid=None, *,
                              iou_threshold: float = IOU_THRESHOLD) -> np.ndarray:
    """1-based rank of each phrase's first correct proposal; 0 when none is correct.

    Args:
      scores: (P, N) scores (higher = better) with ``valid`` marking real
        proposals, or a list of P per-phrase score vectors.
      proposal_iou: (P, N) IoU of each proposal with the phrase's ground
        truth (a list of vectors when ``scores`` is a list).
      valid: optional (P, N) bool mask of real proposals.
      iou_threshold: a proposal is correct when IoU ≥ this.
    """
    scores, mask = _pad_scores(scores, valid)
    if isinstance(proposal_iou, (list, tuple)):
        iou, iou_mask = _pad_scores(proposal_iou, None)
        if iou.shape != scores.shape or not np.array_equal(iou_mask, mask):
            raise UserInputError("proposal_iou and scores have different numbers of proposals per phrase")
    else:
        iou = np.asarray(proposal_iou, np.float64)
        if iou.shape != scores.shape:
            raise UserInputError(f"proposal_iou has shape {iou.shape}, scores {scores.shape}")
    if np.any(np.isnan(scores[mask])):
        bad = int(np.argwhere(np.isnan(scores) & mask)[0, 0])
        raise UserInputError(f"scores of phrase {bad} contain NaN")
    correct = mask & (iou >= iou_threshold)
    has_correct = correct.any(axis=1)
    best_correct = np.where(correct, scores, -np.inf).max(axis=1, initial=-np.inf)
    beaten = mask & ~correct & (scores >= best_correct[:, None])
    return np.where(has_correct, beaten.sum(axis=1) + 1, 0).astype(np.int64)


def metrics_from_localization_ranks(ranks, ks: Sequence[int] = DEFAULT_KS, *,
                                    phrase_types: Sequence[Sequence[str]] | None = None,
                                    prefix: str = "") -> dict:
    """R@K (%) over all phrases, the upper bound (%) and an optional ``per_type`` breakdown.

    ``ranks`` are from :func:`phrase_localization_ranks` (0 = no correct
    proposal, a miss at every K). A phrase with several types counts in each.
    """
    ranks = np.asarray(ranks, np.int64)
    if ranks.ndim != 1 or len(ranks) == 0:
        raise UserInputError("no phrases to evaluate")
    out = _recalls(ranks, ks, prefix)
    if phrase_types is not None:
        if len(phrase_types) != len(ranks):
            raise UserInputError(f"{len(phrase_types)} phrase type lists for {len(ranks)} phrases")
        members: dict[str, list[int]] = {}
        for i, types in enumerate(phrase_types):
            for phrase_type in dict.fromkeys(types):
                members.setdefault(phrase_type, []).append(i)
        out["per_type"] = {t: _recalls(ranks[np.asarray(idx)], ks, prefix) for t, idx in sorted(members.items())}
    return out


def _recalls(ranks: np.ndarray, ks, prefix: str) -> dict:
    # Misses get a rank past every K so the core's R@K is over all phrases.
    sentinel = max(max(ks), int(ranks.max(initial=0))) + 1
    core = metrics_from_ranks(np.where(ranks > 0, ranks, sentinel), ks, prefix=prefix)
    out = {f"{prefix}r{k}": core[f"{prefix}r{k}"] for k in ks}
    out[f"{prefix}upper_bound"] = float(100.0 * np.mean(ranks > 0))
    out[f"{prefix}num_phrases"] = int(len(ranks))
    return out


def phrase_localization_recall(scores, proposal_iou, valid=None, *, ks: Sequence[int] = DEFAULT_KS,
                               iou_threshold: float = IOU_THRESHOLD,
                               phrase_types: Sequence[Sequence[str]] | None = None) -> dict:
    """R@K (%), upper bound (%) and per-type breakdown of phrase localization.

    ``scores`` are higher-is-better: pass −distance for the embedding network
    (or cosine similarity) and logits for the similarity network. See
    :func:`phrase_localization_ranks` for the inputs.
    """
    ranks = phrase_localization_ranks(scores, proposal_iou, valid, iou_threshold=iou_threshold)
    return metrics_from_localization_ranks(ranks, ks, phrase_types=phrase_types)


def score_phrases_with_model(model, data, batch_size: int = 1024,
                             pair_batch: int = 32768) -> tuple[np.ndarray, np.ndarray]:
    """(P, N_max) scores of every phrase against every proposal of its image, and the valid mask.

    Every proposal and every phrase feature row is embedded once through
    ``model.image_tower`` / ``model.text_tower``. Embedding network: dot
    product of the L2-normalised embeddings (cosine; the ranking of
    −Euclidean distance). Similarity network (``model.similarity_head`` not
    None): the head's logit on the element-wise product.

    ``data`` is a :class:`tf_twobranch.data.phrase_localization_data.PhraseLocalizationData`.
    """
    region_table, valid = data.proposal_table()
    proposals = np.flatnonzero(~data.region_is_gt)
    region_slot = np.full(len(data.region_is_gt), -1, np.int64)
    region_slot[proposals] = np.arange(len(proposals))
    region_embeds = l2_normalize_rows(model.embed_images(np.asarray(data.region_features[proposals]), batch_size))
    phrase_embeds = l2_normalize_rows(model.embed_texts(np.asarray(data.phrase_features), batch_size))
    slots = np.where(valid, region_slot[region_table], 0)
    num_phrases, width = slots.shape
    scores = np.full((num_phrases, width), -np.inf, np.float32)
    head = getattr(model, "similarity_head", None)
    if head is None:
        # One (phrases of the image) x (its proposals) matmul per image. Each
        # is tiny (~14x512x200): one BLAS thread is 10-20x faster than several
        # contending ones (benchmarks/bench_phrase_localization.py).
        with threadpoolctl.threadpool_limits(1, "blas"):
            for image, members in enumerate(_group_by(data.phrase_image, len(data.image_ids))):
                if len(members) == 0:
                    continue
                first = data.image_region_offsets[image]
                image_regions = region_embeds[region_slot[first:first + data.num_proposals[image]]]
                block = phrase_embeds[data.phrase_feature_index[members]] @ image_regions.T
                scores[members, :block.shape[1]] = block
        return scores, valid
    head_fn = tf.function(lambda joint: head(joint, training=False), reduce_retracing=True)
    rows_per_chunk = max(1, pair_batch // max(1, width))
    for start in range(0, num_phrases, rows_per_chunk):
        stop = min(start + rows_per_chunk, num_phrases)
        text = phrase_embeds[data.phrase_feature_index[start:stop]]   # (c, d)
        image = region_embeds[slots[start:stop]]                       # (c, N, d)
        joint = (image * text[:, None, :]).reshape(-1, image.shape[-1])
        block = head_fn(tf.constant(joint)).numpy().reshape(stop - start, width)
        scores[start:stop] = np.where(valid[start:stop], block, -np.inf)
    return scores, valid


def evaluate_phrase_localization(model, data, *, ks: Sequence[int] = DEFAULT_KS, batch_size: int = 1024,
                                 iou_threshold: float = IOU_THRESHOLD) -> dict:
    """R@K, upper bound and per-type recall of ``model`` on ``data`` (see :func:`score_phrases_with_model`)."""
    scores, valid = score_phrases_with_model(model, data, batch_size)
    iou, _ = data.phrase_proposal_iou()
    return phrase_localization_recall(scores, iou, valid, ks=ks, iou_threshold=iou_threshold,
                                      phrase_types=data.phrase_types())


def top_proposal_boxes(scores, valid, data) -> list[np.ndarray | None]:
    """Each phrase's top-ranked proposal box (4,) (ties: the first in the image's proposal order);
    None for a phrase whose image has no proposal. `scores`, `valid`: from
    :func:`score_phrases_with_model`; `data`: the same `PhraseLocalizationData`."""
    scores, mask = _pad_scores(scores, valid)
    table, _ = data.proposal_table()
    if table.shape != scores.shape:
        raise UserInputError(f"scores have shape {scores.shape}, the data's proposal table {table.shape}")
    top = np.argmax(np.where(mask, scores, -np.inf), axis=1)
    rows = np.arange(len(top))
    regions = table[rows, top]
    return [np.asarray(data.region_boxes[r], np.float32) if ok else None
            for r, ok in zip(regions.tolist(), mask[rows, top].tolist())]


def random_localization_metrics(data, *, ks: Sequence[int] = DEFAULT_KS, seed: int = 0,
                                iou_threshold: float = IOU_THRESHOLD) -> dict:
    """What random proposal scores get on ``data``: the chance level a model must beat."""
    iou, valid = data.phrase_proposal_iou()
    scores = np.random.default_rng(seed).uniform(size=iou.shape)
    return phrase_localization_recall(scores, iou, valid, ks=ks, iou_threshold=iou_threshold)


def _group_by(groups: np.ndarray, num_groups: int) -> list[np.ndarray]:
    order = np.argsort(groups, kind="stable")
    bounds = np.searchsorted(groups[order], np.arange(num_groups + 1))
    return [order[bounds[g]:bounds[g + 1]] for g in range(num_groups)]
