"""The retrieval gallery a model embeds, whatever its family (issue 25 item 2).

`gallery_from_model` gives the `RetrievalGallery` that an export's ``retrieve_*`` signatures
rank (`tf_twobranch.export.retrieval_signatures`, re-exported here): each family's items as its
``evaluate`` embeds them. It sits above the family exports, which build their galleries and
signatures from `retrieval_signatures` alone.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tf_twobranch.systems.fragments.export import fragment_gallery
from tf_twobranch.systems.npair.export import npair_gallery
from tf_twobranch.export.retrieval_signatures import K_SPEC, RetrievalGallery, add_retrieval_signatures, padded_rows
from tf_twobranch.models.evaluation_input import as_evaluation_split

__all__ = ["RetrievalGallery", "gallery_from_model", "add_retrieval_signatures", "padded_rows", "K_SPEC"]


def gallery_from_model(model, split, image_ids: Sequence[str], caption_ids: Sequence[str]) -> RetrievalGallery:
    """A gallery embedded by `model` exactly as its ``evaluate`` embeds `split`.

    Two-branch: the tower outputs (`split` an `EvaluationSplit` or a dict with
    ``image``, ``text`` and ``caption_image``); dual path: the L2-normalised,
    flip-averaged embeddings; deep fragment embeddings: the fragments of
    ``model.embed_split`` (`fragment_embedding.fragment_gallery`); N-pair: the
    normalised projected maps and token vectors (`npair_localization.npair_gallery`,
    `split` an `NPairEvaluationSplit`). One id per image row and per caption.
    """
    family = getattr(getattr(model, "config", None), "FAMILY", None)
    if family == "fragment_embedding":
        return fragment_gallery(model, split, image_ids, caption_ids)
    if family == "npair_localization":
        return npair_gallery(model, split, image_ids, caption_ids)
    split = as_evaluation_split(split)
    if hasattr(model, "retrieval_embeddings"):       # the dual path: normalised, flip-averaged
        images, texts = model.retrieval_embeddings(split)
    else:
        images, texts = model.embed_images(split.image), model.embed_texts(split.text)
    return RetrievalGallery([str(i) for i in image_ids], np.asarray(images, np.float32),
                            [str(c) for c in caption_ids], np.asarray(texts, np.float32))
