"""Phrase-localization data: one split of regions, phrases and coreference chains (TPAMI 2018 §4).

:class:`PhraseLocalizationData` is what the Algorithm 1 samplers
(`tf_twobranch.systems.two_branch.region_phrase_sampling`) and the evaluation
(`tf_twobranch.evaluation.phrase_localization`) read;
:func:`build_phrase_localization_data` assembles it from per-image arrays
(`tf_twobranch.features.prepare_regions.prepare_phrase_localization` does so
with cached region and phrase features).

Data model
----------
:class:`PhraseLocalizationData` holds one split in numpy:

* **Regions.** Every image ``i`` owns the contiguous block of regions
  ``image_region_offsets[i] : image_region_offsets[i + 1]``. The first
  ``num_proposals[i]`` of them are its region proposals (ranked as given);
  after them come its *ground-truth regions*, one per coreference chain with
  a box (``region_is_gt`` True), so that the "ground-truth region–phrase
  pairs" of Algorithm 1 step 1 have features. ``region_features`` (R, D)
  may be a ``numpy.memmap``.
* **Phrases.** One :class:`~tf_twobranch.data.phrases.PhraseExample` per
  phrase occurrence. Phrase features are ``phrase_features[phrase_feature_index[p]]``:
  identical phrase strings may share one feature row (pass a unique-string
  table and an index), or every occurrence may have its own row.
* **Chains.** Coreference chains are per image: two phrases are in the same
  chain iff they have the same image and the same ``chain_id``. They are
  numbered globally (``phrase_chain``); chain ``c`` has the ground-truth
  region ``chain_gt_region[c]`` and ``chain_region_iou[c, j]`` is the IoU
  (+1 pixel convention of :mod:`tf_twobranch.boxes`) of its ground-truth
  box with region ``image_region_offsets[chain_image[c]] + j`` (-1 beyond
  the image's regions).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from tf_twobranch.boxes import iou_matrix
from tf_twobranch.data.phrases import PhraseExample
from tf_twobranch.errors import ConfigError, DataFormatError

__all__ = ["PhraseLocalizationData", "ground_truth_regions", "unique_phrase_index",
           "build_phrase_localization_data"]


@dataclasses.dataclass
class PhraseLocalizationData:
    """One split of phrase-localization data (see the module docstring)."""

    image_ids: list[str]
    image_region_offsets: np.ndarray
    num_proposals: np.ndarray
    region_boxes: np.ndarray
    region_features: np.ndarray
    region_image: np.ndarray
    region_is_gt: np.ndarray
    examples: list[PhraseExample]
    phrase_features: np.ndarray
    phrase_feature_index: np.ndarray
    phrase_image: np.ndarray
    phrase_chain: np.ndarray
    phrase_key: np.ndarray
    chain_image: np.ndarray
    chain_gt_region: np.ndarray
    chain_region_iou: np.ndarray

    @property
    def num_phrases(self) -> int:
        return len(self.examples)

    @property
    def num_chains(self) -> int:
        return len(self.chain_image)

    def proposal_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(P, N_max) global region index of each proposal of each phrase's image, and its valid mask."""
        n_max = int(self.num_proposals.max()) if len(self.num_proposals) else 0
        columns = np.arange(n_max)
        starts = self.image_region_offsets[self.phrase_image]
        valid = columns[None, :] < self.num_proposals[self.phrase_image][:, None]
        index = np.where(valid, starts[:, None] + columns[None, :], 0)
        return index.astype(np.int64), valid

    def phrase_proposal_iou(self) -> tuple[np.ndarray, np.ndarray]:
        """(P, N_max) IoU of each phrase's ground-truth box with each proposal of its image, and the valid mask."""
        n_max = int(self.num_proposals.max()) if len(self.num_proposals) else 0
        iou = self.chain_region_iou[self.phrase_chain, :n_max]
        columns = np.arange(n_max)
        valid = columns[None, :] < self.num_proposals[self.phrase_image][:, None]
        return np.where(valid, iou, -1.0).astype(np.float32), valid

    def phrase_types(self) -> list[list[str]]:
        return [list(example.phrase_types) for example in self.examples]


def ground_truth_regions(examples: Sequence[PhraseExample]) -> dict[str, tuple[list[str], np.ndarray]]:
    """Per image: (chain ids, (G, 4) ground-truth boxes) in order of first appearance.

    Extract ground-truth region features in this order and pass them to
    :func:`build_phrase_localization_data` as ``gt_region_features``.
    """
    out: dict[str, tuple[list[str], list[np.ndarray]]] = {}
    for example in examples:
        chains, boxes = out.setdefault(example.image_id, ([], []))
        if example.chain_id not in chains:
            chains.append(example.chain_id)
            boxes.append(np.asarray(example.gt_box, np.float32).reshape(4))
    return {image: (chains, np.stack(boxes).astype(np.float32)) for image, (chains, boxes) in out.items()}


def unique_phrase_index(examples: Sequence[PhraseExample]) -> tuple[list[str], np.ndarray]:
    """Unique lower-cased phrase strings and, per example, the index of its string."""
    table: dict[str, int] = {}
    index = np.empty(len(examples), np.int64)
    for p, example in enumerate(examples):
        index[p] = table.setdefault(example.phrase.lower(), len(table))
    return list(table), index


def build_phrase_localization_data(
        examples: Sequence[PhraseExample], proposals: Mapping[str, np.ndarray],
        proposal_features: Mapping[str, np.ndarray], gt_region_features: Mapping[str, np.ndarray],
        phrase_features: np.ndarray, phrase_feature_index: np.ndarray | None = None
) -> PhraseLocalizationData:
    """Assembles a :class:`PhraseLocalizationData` from per-image arrays.

    Args:
      examples: phrase occurrences (from ``tf_twobranch.data.phrases``).
      proposals: image id → (N_i, 4) proposal boxes (best first).
      proposal_features: image id → (N_i, D) features of those proposals.
      gt_region_features: image id → (G_i, D) features of the image's
        ground-truth regions in the order of :func:`ground_truth_regions`.
      phrase_features: (U, Dt) phrase features; one row per example when
        ``phrase_feature_index`` is None.
      phrase_feature_index: optional (P,) row of ``phrase_features`` per
        example (e.g. from :func:`unique_phrase_index`, so identical strings
        share a row).
    """
    examples = list(examples)
    if not examples:
        raise ConfigError("no phrase examples: cannot build phrase-localization data")
    phrase_features = np.asarray(phrase_features) if not isinstance(phrase_features, np.memmap) \
        else phrase_features
    if phrase_features.ndim != 2:
        raise DataFormatError("<phrase_features>", f"expected a (num_phrases, dim) matrix, got shape "
                                                   f"{phrase_features.shape}")
    if phrase_feature_index is None:
        if len(phrase_features) != len(examples):
            raise DataFormatError("<phrase_features>", f"{len(phrase_features)} rows for {len(examples)} "
                                                       "phrase examples (pass phrase_feature_index to share rows)")
        phrase_feature_index = np.arange(len(examples), dtype=np.int64)
    phrase_feature_index = np.asarray(phrase_feature_index, np.int64)
    if phrase_feature_index.shape != (len(examples),) or (
            len(examples) and (phrase_feature_index.min() < 0
                               or phrase_feature_index.max() >= len(phrase_features))):
        raise DataFormatError("<phrase_feature_index>", f"expected {len(examples)} row indices in "
                                                        f"[0, {len(phrase_features)})")
    gt_regions = ground_truth_regions(examples)
    image_ids = list(gt_regions)
    feature_dim = None
    boxes_parts, feature_parts, is_gt_parts = [], [], []
    offsets = [0]
    num_proposals = []
    chain_lookup: dict[tuple[str, str], int] = {}
    chain_image, chain_gt_region = [], []
    for image_index, image_id in enumerate(image_ids):
        if image_id not in proposals:
            raise DataFormatError("<proposals>", "no proposals for this image", record=image_id)
        if image_id not in proposal_features:
            raise DataFormatError("<proposal_features>", "no proposal features for this image", record=image_id)
        if image_id not in gt_region_features:
            raise DataFormatError("<gt_region_features>", "no ground-truth region features for this image",
                                  record=image_id)
        boxes = np.asarray(proposals[image_id], np.float32).reshape(-1, 4)
        features = np.asarray(proposal_features[image_id])
        chains, gt_boxes = gt_regions[image_id]
        gt_features = np.asarray(gt_region_features[image_id])
        for name, array, rows in (("<proposal_features>", features, len(boxes)),
                                  ("<gt_region_features>", gt_features, len(gt_boxes))):
            if array.ndim != 2 or array.shape[0] != rows:
                raise DataFormatError(name, f"expected ({rows}, dim) features, got shape {array.shape}",
                                      record=image_id)
            if feature_dim is None:
                feature_dim = array.shape[1]
            elif array.shape[1] != feature_dim:
                raise DataFormatError(name, f"feature dimension {array.shape[1]} differs from {feature_dim}",
                                      record=image_id)
        if len(boxes) == 0:
            raise DataFormatError("<proposals>", "image has no proposals", record=image_id)
        base = offsets[-1]
        for g, chain_id in enumerate(chains):
            chain_lookup[(image_id, chain_id)] = len(chain_image)
            chain_image.append(image_index)
            chain_gt_region.append(base + len(boxes) + g)
        boxes_parts += [boxes, gt_boxes]
        feature_parts += [features, gt_features]
        is_gt_parts += [np.zeros(len(boxes), bool), np.ones(len(gt_boxes), bool)]
        num_proposals.append(len(boxes))
        offsets.append(base + len(boxes) + len(gt_boxes))
    offsets_array = np.asarray(offsets, np.int64)
    region_boxes = np.concatenate(boxes_parts)
    region_image = np.repeat(np.arange(len(image_ids)), np.diff(offsets_array))
    regions_per_image = np.diff(offsets_array)
    chain_image_array = np.asarray(chain_image, np.int64)
    chain_gt = np.asarray(chain_gt_region, np.int64)
    iou = np.full((len(chain_image), int(regions_per_image.max())), -1.0, np.float32)
    for c in range(len(chain_image)):
        lo, hi = offsets_array[chain_image_array[c]], offsets_array[chain_image_array[c] + 1]
        iou[c, :hi - lo] = iou_matrix(region_boxes[chain_gt[c]], region_boxes[lo:hi])[0]
    _, phrase_key = unique_phrase_index(examples)
    image_lookup = {image_id: i for i, image_id in enumerate(image_ids)}
    return PhraseLocalizationData(
        image_ids=image_ids, image_region_offsets=offsets_array,
        num_proposals=np.asarray(num_proposals, np.int64), region_boxes=region_boxes,
        region_features=np.concatenate(feature_parts), region_image=region_image.astype(np.int64),
        region_is_gt=np.concatenate(is_gt_parts), examples=examples, phrase_features=phrase_features,
        phrase_feature_index=phrase_feature_index,
        phrase_image=np.asarray([image_lookup[e.image_id] for e in examples], np.int64),
        phrase_chain=np.asarray([chain_lookup[(e.image_id, e.chain_id)] for e in examples], np.int64),
        phrase_key=phrase_key, chain_image=chain_image_array, chain_gt_region=chain_gt,
        chain_region_iou=iou)
