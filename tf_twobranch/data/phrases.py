"""Phrase-localization examples from Flickr30K Entities.

One :class:`PhraseExample` per annotated phrase that has a ground-truth box,
following the protocol of Plummer et al. used by the two-branch paper (§4 and
footnote 2) and the authors' pl-clc / cite code (``filterNonvisualPhrases``
keeps exactly the phrases whose chain has at least one box; ``getGTBox``
returns the union of the chain's boxes):

* non-visual phrases (chain ``0`` or a type in ``exclude_types``, by default
  ``notvisual``) are excluded;
* phrases whose chain has no box — chains flagged ``<scene>`` or
  ``<nobndbox>`` only — are excluded (pl-clc drops them the same way);
* a plural entity (a chain with several boxes) gets one ground-truth box
  enclosing all its boxes (``gt_box``); the individual boxes are kept in
  ``gt_boxes``;
* a phrase whose chain is absent from the annotation file altogether is an
  annotation inconsistency: it is skipped and counted (pl-clc silently drops
  it), or with ``strict=True`` raises DataFormatError naming the sentence file,
  line and chain.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
from typing import Iterable, Sequence

import numpy as np

from tf_twobranch.boxes import enclosing_box
from tf_twobranch.data.formats.flickr30k_entities import (
    NULL_CHAIN_ID, NOTVISUAL_TYPE, ImagePhrases, read_entities_dataset)
from tf_twobranch.errors import DataFormatError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PhraseExample:
    """A phrase with its ground-truth region.

    Attributes:
      image_id: Flickr30K image id.
      sentence_index: 0-based index of the sentence in ``Sentences/<id>.txt``
        (non-empty lines, as in the official parser).
      phrase_index: 0-based index of the phrase among *all* phrases of that
        sentence (before any exclusion), so it matches the official parser.
      phrase: phrase text (words joined by spaces).
      chain_id: coreference chain id.
      phrase_types: coarse types (for per-type breakdowns).
      gt_box: float32 (4,) box enclosing all of the chain's boxes.
      gt_boxes: float32 (k, 4) boxes of the chain.
    """

    image_id: str
    sentence_index: int
    phrase_index: int
    phrase: str
    chain_id: str
    phrase_types: list[str]
    gt_box: np.ndarray
    gt_boxes: np.ndarray


@dataclasses.dataclass
class PhraseExampleSummary:
    """Counts of the phrases seen and why some were not turned into examples."""

    num_phrases: int = 0
    num_examples: int = 0
    num_plural: int = 0
    excluded_not_visual: int = 0
    excluded_by_type: int = 0
    excluded_no_box: int = 0
    skipped_missing_chain: int = 0
    missing_chains: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    examples_per_type: dict[str, int] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return (f"{self.num_examples} phrase examples from {self.num_phrases} phrases "
                f"({self.num_plural} plural); excluded: {self.excluded_not_visual} not visual, "
                f"{self.excluded_by_type} by type, {self.excluded_no_box} without a box (scene/no-box chains); "
                f"skipped {self.skipped_missing_chain} whose chain is absent from the annotation")


def phrase_examples_from_images(images: Iterable[ImagePhrases], *,
                                exclude_types: Sequence[str] = (NOTVISUAL_TYPE,),
                                strict: bool = False) -> tuple[list[PhraseExample], PhraseExampleSummary]:
    """Builds phrase examples from already-read images; returns ``(examples, summary)``."""
    excluded = set(exclude_types)
    summary = PhraseExampleSummary()
    per_type: collections.Counter = collections.Counter()
    examples: list[PhraseExample] = []
    for image in images:
        annotation = image.annotation
        flagged = set(annotation.scene_chains) | set(annotation.nobox_chains)
        for sentence_index, sentence in enumerate(image.sentences):
            for phrase_index, phrase in enumerate(sentence.phrases):
                summary.num_phrases += 1
                # Chain 0 never has a box, whatever exclude_types says.
                if phrase.chain_id == NULL_CHAIN_ID or (
                        NOTVISUAL_TYPE in excluded and NOTVISUAL_TYPE in phrase.phrase_types):
                    summary.excluded_not_visual += 1
                    continue
                if excluded.intersection(phrase.phrase_types):
                    summary.excluded_by_type += 1
                    continue
                boxes = annotation.boxes.get(phrase.chain_id)
                if boxes is None or len(boxes) == 0:
                    if phrase.chain_id in flagged:
                        summary.excluded_no_box += 1
                        continue
                    if strict:
                        raise DataFormatError(
                            image.sentence_path,
                            f"phrase {phrase.text!r} refers to chain {phrase.chain_id}, which "
                            f"{image.annotation_path} neither boxes nor flags as scene/no-box",
                            line=sentence.line, record=phrase.chain_id)
                    summary.skipped_missing_chain += 1
                    summary.missing_chains.append((image.sentence_path, sentence.line or 0, phrase.chain_id))
                    continue
                boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
                if len(boxes) > 1:
                    summary.num_plural += 1
                examples.append(PhraseExample(
                    image_id=image.image_id, sentence_index=sentence_index, phrase_index=phrase_index,
                    phrase=phrase.text, chain_id=phrase.chain_id, phrase_types=list(phrase.phrase_types),
                    gt_box=enclosing_box(boxes), gt_boxes=boxes.copy()))
                per_type.update(phrase.phrase_types)
    summary.num_examples = len(examples)
    summary.examples_per_type = dict(sorted(per_type.items()))
    return examples, summary


def collect_phrase_examples(entities_root, image_ids, *, exclude_types: Sequence[str] = (NOTVISUAL_TYPE,),
                            strict: bool = False) -> tuple[list[PhraseExample], PhraseExampleSummary]:
    """Reads ``entities_root`` (``Sentences/``, ``Annotations/``) and returns ``(examples, summary)``.

    ``image_ids`` is an iterable of ids or the path of a split file.
    """
    images = read_entities_dataset(os.fspath(entities_root), image_ids)
    return phrase_examples_from_images(images, exclude_types=exclude_types, strict=strict)


def build_phrase_examples(entities_root, image_ids, *, exclude_types: Sequence[str] = (NOTVISUAL_TYPE,),
                          strict: bool = False) -> list[PhraseExample]:
    """Phrase-localization examples of ``image_ids`` (see the module docstring).

    Logs a summary of the excluded/skipped phrases at INFO level (a WARNING
    when phrases refer to chains absent from the annotations); use
    :func:`collect_phrase_examples` to get the summary as an object.
    """
    examples, summary = collect_phrase_examples(entities_root, image_ids, exclude_types=exclude_types,
                                                strict=strict)
    if summary.skipped_missing_chain:
        first = summary.missing_chains[0]
        logger.warning("%s (first: %s, line %d, chain %s)", summary, *first)
    else:
        logger.info("%s", summary)
    return examples


def phrase_fingerprint(phrases: Iterable) -> str:
    """The one fingerprint of a set of grounding phrases (every localizer's record carries it).

    `phrases`: :class:`PhraseExample` or
    :class:`tf_twobranch.evaluation.pointing_game.PointingQuery` objects (anything with
    ``image_id``, ``sentence_index``, ``phrase_index``, ``phrase`` and ``gt_boxes`` or
    ``boxes``). Hashed: each phrase's image id, sentence index, phrase index (among all
    phrases of its sentence), text and ground-truth boxes (rounded to 1/100 pixel), sorted
    by (image id, sentence index, phrase index), so two evaluations carry the same
    fingerprint exactly when they ask for the same phrases with the same boxes, whatever
    their order. Returns ``"sha256:<16 hex digits>"`` (as `corpus.split_fingerprint`).
    """
    rows = []
    for phrase in phrases:
        boxes = getattr(phrase, "gt_boxes", None)
        if boxes is None:
            boxes = phrase.boxes
        coordinates = ",".join(f"{v:.2f}" for v in np.asarray(boxes, np.float64).reshape(-1))
        rows.append((str(phrase.image_id), int(phrase.sentence_index), int(phrase.phrase_index),
                     f"{phrase.image_id}\x1f{phrase.sentence_index}\x1f{phrase.phrase_index}\x1f"
                     f"{phrase.phrase}\x1f{coordinates}"))
    digest = hashlib.sha256()
    for *_, text in sorted(rows):
        digest.update(text.encode("utf-8") + b"\x00")
    return "sha256:" + digest.hexdigest()[:16]
