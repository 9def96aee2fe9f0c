"""The test split a model is evaluated on: what every model's `evaluate` takes.

An `EvaluationSplit` holds one input row per test image (``image``), one per
caption (``text``: features, strings or token ids — whatever the model's
text tower takes) and the image index of each caption (``caption_image``),
plus the protocol it is ranked under. Two optional fields serve the dual
path: ``caption_of_row`` when a caption has several text rows (its position
shifts, averaged per caption) and ``image_class`` when a caption's positives
are all images of its class (CUHK-PEDES identities). The fragment model
(S_kl over fragments) takes dicts of arrays there: ``image`` = {"fragments",
"mask"}, ``text`` = {"relation", "word1", "word2", "row_splits"}
(`systems.fragments.model`).

A plain dict with the same keys works wherever a split is taken
(`tf_twobranch.models.evaluation_input`); `load_run(...).evaluation_split()`
rebuilds the split a run was evaluated on.
"""
from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["EvaluationSplit"]


@dataclasses.dataclass
class EvaluationSplit:
    image: np.ndarray
    text: np.ndarray
    caption_image: np.ndarray
    protocol: str = "full"
    caption_of_row: np.ndarray | None = None
    image_class: np.ndarray | None = None

    @property
    def num_captions(self) -> int:
        return len(self.caption_image)
