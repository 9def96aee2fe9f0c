"""The retrieval gallery a model embeds, whatever its system (issue 25 item 2).

`gallery_from_model` gives the `RetrievalGallery` that an export's ``retrieve_*`` signatures
rank (`tf_twobranch.export.retrieval_signatures`, re-exported here): the items of `split` as the
model's ``evaluate`` embeds them, by the gallery function of the model's system
(`tf_twobranch.systems` registry, `System.gallery`).
"""
from __future__ import annotations

from typing import Sequence

from tf_twobranch import systems
from tf_twobranch.export.retrieval_signatures import K_SPEC, RetrievalGallery, add_retrieval_signatures, padded_rows

__all__ = ["RetrievalGallery", "gallery_from_model", "add_retrieval_signatures", "padded_rows", "K_SPEC"]


def gallery_from_model(model, split, image_ids: Sequence[str], caption_ids: Sequence[str]) -> RetrievalGallery:
    """A gallery embedded by `model` exactly as its ``evaluate`` embeds `split`.

    Two-branch: the tower outputs (`split` an `EvaluationSplit` or a dict with ``image``, ``text``
    and ``caption_image``); dual path: the L2-normalised, flip-averaged embeddings; deep fragment
    embeddings: the fragments of ``model.embed_split``; N-pair: the normalised projected maps and
    token vectors (`split` an `NPairEvaluationSplit`). One id per image row and per caption.
    """
    return systems.for_model(model).gallery(model, split, image_ids, caption_ids)
