"""Grounding of Flickr30K Entities phrases by every system that localizes, under one rule.

Every localizer answers the same phrases — the pointing-game queries of the
test images (:func:`tf_twobranch.evaluation.pointing_game.pointing_queries`:
the phrases :func:`tf_twobranch.data.phrases.phrase_examples_from_images`
keeps, i.e. visual phrases whose chain has a box, Plummer et al.'s protocol
used by all three papers) — and its record carries their fingerprint
(:func:`tf_twobranch.data.phrases.phrase_fingerprint`), so a table puts two
grounding numbers side by side only when they are over the same phrases.

The rule: the **pointing game** (`pointing_game.evaluate_points`: a hit when
the system's point lies in a ground-truth box of the phrase) for every
localizer, with each system's point

* N-pair heat maps (Das et al.): the maximum of the phrase's map;
* two-branch region–phrase models (Wang et al.): the centre of the
  top-ranked proposal box (`pointing_game.box_centre_points`);
* deep fragment embeddings (Karpathy et al.): the centre of the box of the
  image fragment best aligned with the phrase (:func:`fragment_grounding`);

and, for the systems that rank boxes (the region models' proposals, the
fragment model's image-fragment boxes), **box R@1 at IoU ≥ 0.5** with the
phrase's box (`phrase_localization.phrase_localization_ranks`).

Fragment grounding (what the paper leaves to the reader; its Figs. 4–5
show the best image fragment of each *sentence* fragment): a phrase (a
word span of its Entities sentence) takes the caption's sentence fragments
(dependency triplets, after the paper's filtering) whose governor or
dependent word lies inside the span; image fragment i scores
maxⱼ vᵢᵀsⱼ over those triplets (the model's own alignment scores); the
best image fragment's box is the answer (ties: the lower index, the whole
image first). A phrase with no such triplet — every word's triplets
filtered out — or whose sentence has no parse that matches its words is a
miss, counted in the record (``phrases_without_fragment``,
``phrases_without_parse``), never dropped.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from tf_twobranch.boxes import enclosing_box, iou_matrix
from tf_twobranch.data.phrases import phrase_fingerprint
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation.phrase_localization import (IOU_THRESHOLD, metrics_from_localization_ranks,
                                                         phrase_localization_ranks)
from tf_twobranch.evaluation.pointing_game import PointingQuery, box_centre_points, evaluate_points

__all__ = ["POINT_RULES", "grounding_summary", "box_grounding", "align_words", "phrase_fragments",
           "fragment_box_scores", "fragment_grounding"]

#: How each kind of localizer points (stated in every record and under the leaderboard).
POINT_RULES = {
    "heat_map": "the maximum of the phrase's heat map",
    "top_proposal": "the centre of the top-ranked proposal box",
    "random_point": "a random pixel of the image (a baseline)",
    "centre_point": "the centre pixel of the image (a baseline)",
    "best_fragment": "the centre of the box of the image fragment best aligned with the phrase "
                     "(max over the phrase's dependency triplets of v_i.s_j; no triplet: a miss)",
}


def grounding_summary(fingerprint: str, num_phrases: int, pointing: dict, *, rule: str,
                      box_metrics: dict | None = None, **counts) -> dict:
    """The ``grounding`` entry of a results record: the phrases' fingerprint
    (`data.phrases.phrase_fingerprint` of the queries) and number, the rule
    (a key of `POINT_RULES`), the pointing-game results (``pointing``, from `evaluate_points` or the
    N-pair model's), and for box rankers ``box_r1`` / ``box_upper_bound`` (%); `counts`: further
    counts of the system (e.g. phrases it could not answer)."""
    if rule not in POINT_RULES:
        raise UserInputError(f"unknown grounding rule {rule!r}; expected one of {sorted(POINT_RULES)}")
    out = {"phrase_fingerprint": fingerprint, "num_phrases": int(num_phrases), "rule": rule,
           "point": POINT_RULES[rule], "pointing_accuracy": float(pointing["accuracy"]), "pointing": pointing}
    if box_metrics is not None:
        out["box_r1"] = float(box_metrics["r1"])
        out["box_upper_bound"] = float(box_metrics["upper_bound"])
        out["iou_threshold"] = IOU_THRESHOLD
    out.update(counts)
    return out


def _box_metrics(queries: Sequence[PointingQuery], box_scores: Sequence[np.ndarray | None],
                 boxes: Sequence[np.ndarray]) -> dict:
    """R@1 at IoU >= 0.5 over each phrase's ranked boxes (None scores: a miss) and the upper bound."""
    ious = [iou_matrix(enclosing_box(np.asarray(q.boxes, np.float32).reshape(-1, 4))[None], b)[0]
            for q, b in zip(queries, boxes)]
    scored = [i for i, s in enumerate(box_scores) if s is not None]
    ranks = np.zeros(len(queries), np.int64)
    if scored:
        ranks[scored] = phrase_localization_ranks([box_scores[i] for i in scored], [ious[i] for i in scored])
    out = metrics_from_localization_ranks(ranks, ks=(1,))
    out["upper_bound"] = float(100.0 * np.mean([bool(np.any(iou >= IOU_THRESHOLD)) for iou in ious]))
    return out


def box_grounding(queries: Sequence[PointingQuery], top_boxes: Sequence[np.ndarray | None], *,
                  counting: str = "phrase") -> dict:
    """Pointing results of a box ranker: the centre of each phrase's top-ranked box (None: a miss)."""
    return evaluate_points(queries, box_centre_points(queries, top_boxes), counting=counting)


# ---------------------------------------------------------------------------- fragments


def _letters(word: str) -> str:
    return "".join(word.lower().split())


def align_words(parse_words: Sequence[str], entity_words: Sequence[str]) -> np.ndarray | None:
    """For each parsed word, the index of the Entities sentence word it falls in (by its first
    letter), matching the two tokenisations letter by letter (lower-cased, spaces ignored);
    None when they are not the same text (the parse is of another sentence)."""
    parse = [_letters(w) for w in parse_words]
    entity = [_letters(w) for w in entity_words]
    if "".join(parse) != "".join(entity):
        return None
    owner = np.repeat(np.arange(len(entity), dtype=np.int64), [len(w) for w in entity])
    out, position = np.full(len(parse), -1, np.int64), 0
    for i, word in enumerate(parse):
        if word:
            out[i] = owner[position]
        position += len(word)
    return out


def phrase_fragments(positions, entity_word_of_parse_word, word_span: tuple[int, int]) -> np.ndarray:
    """Indices of the sentence fragments whose governor or dependent word lies in the phrase.

    `positions`: (F, 2) parsed-word positions of each fragment's two words (-1 unknown);
    `entity_word_of_parse_word`: from `align_words`; `word_span`: the phrase's (start, stop)
    in the Entities sentence's words (stop exclusive).
    """
    positions = np.asarray(positions, np.int64).reshape(-1, 2)
    owner = np.asarray(entity_word_of_parse_word, np.int64)
    if positions.size and positions.max() >= len(owner):
        raise UserInputError(f"a sentence fragment points at word {int(positions.max())} of a "
                             f"{len(owner)}-word parse")
    words = np.where(positions >= 0, owner[np.clip(positions, 0, None)] if len(owner) else -1, -1)
    start, stop = (int(v) for v in word_span)
    return np.flatnonzero(((words >= start) & (words < stop)).any(axis=1))


def fragment_box_scores(image_fragments, image_mask, sentence_fragments) -> np.ndarray:
    """Each image fragment's score for a phrase: the max over its sentence fragments of vᵢᵀsⱼ.

    `image_fragments` (M, h), `image_mask` (M,), `sentence_fragments` (k, h) with k >= 1.
    Padded image fragments get -inf (never chosen).
    """
    v = np.asarray(image_fragments, np.float32)
    s = np.asarray(sentence_fragments, np.float32).reshape(-1, v.shape[-1])
    if len(s) == 0:
        raise UserInputError("a phrase with no sentence fragment has no fragment scores (count it as a miss)")
    return np.where(np.asarray(image_mask, bool), (v @ s.T).max(axis=1), -np.inf)


def fragment_grounding(queries: Sequence[PointingQuery], *, image_ids: Sequence[str], caption_image,
                       caption_words: Sequence[Sequence[str]], image_fragments, image_mask,
                       sentence_fragments, row_splits, positions,
                       image_boxes: Mapping[str, np.ndarray], counting: str = "phrase") -> dict:
    """The grounding summary of a fragment model on `queries` (see the module docstring).

    Args:
      queries: the phrases (`pointing_game.pointing_queries`).
      image_ids, caption_image: the split's image ids (rows of `image_fragments`) and each
        caption's image row; an image's p-th caption is its Entities sentence p when its parsed
        words (`caption_words`) match, else the first of its captions that does.
      image_fragments, image_mask: v (N, M, h) of the split's images and their (N, M) mask.
      sentence_fragments, row_splits, positions: s (total, h) of the split's sentence fragments,
        caption l owning rows ``row_splits[l]:row_splits[l + 1]``, and each fragment's (total, 2)
        parsed-word positions (`EncodedFragments.positions`).
      image_boxes: image id -> (M', 4) inclusive boxes of its image fragments (fragment 0 the
        whole image; `features.image_fragments.fragment_boxes`), M' >= its real fragments.
    """
    queries = list(queries)
    row_of = {str(image_id): n for n, image_id in enumerate(image_ids)}
    caption_image = np.asarray(caption_image, np.int64)
    row_splits = np.asarray(row_splits, np.int64)
    positions = np.asarray(positions, np.int64).reshape(-1, 2)
    sentence_fragments = np.asarray(sentence_fragments, np.float32)
    captions_of: dict[int, list[int]] = {}
    for caption, image in enumerate(caption_image.tolist()):
        captions_of.setdefault(image, []).append(caption)
    top_boxes, box_scores, boxes_of_query = [], [], []
    without_parse = without_fragment = 0
    for index, query in enumerate(queries):
        if query.image_id not in row_of:
            raise UserInputError(f"phrase {index} ({query.phrase!r}) is of image {query.image_id}, which is "
                                 f"not among the split's {len(row_of)} images")
        n = row_of[query.image_id]
        mask = np.asarray(image_mask[n], bool)
        boxes = np.asarray(image_boxes[query.image_id], np.float32).reshape(-1, 4)
        if mask.any() and np.flatnonzero(mask).max() >= len(boxes):
            raise UserInputError(f"image {query.image_id}: {len(boxes)} fragment boxes for "
                                 f"{int(np.flatnonzero(mask).max()) + 1} image fragments")
        real = np.flatnonzero(mask)       # the image's fragments (a prefix: the whole image first)
        boxes_of_query.append(boxes[real])
        own = captions_of.get(n, [])
        preferred = [own[query.sentence_index]] if query.sentence_index < len(own) else []
        aligned = None
        for caption in preferred + [c for c in own if c not in preferred]:
            aligned = align_words(caption_words[caption], query.caption_words)
            if aligned is not None:
                break
        if aligned is None:
            without_parse += 1
            top_boxes.append(None)
            box_scores.append(None)
            continue
        start, stop = int(row_splits[caption]), int(row_splits[caption + 1])
        chosen = phrase_fragments(positions[start:stop], aligned, query.word_span)
        if len(chosen) == 0:
            without_fragment += 1
            top_boxes.append(None)
            box_scores.append(None)
            continue
        scores = fragment_box_scores(image_fragments[n], mask, sentence_fragments[start + chosen])
        top_boxes.append(boxes[int(np.argmax(scores))])
        box_scores.append(scores[real])
    pointing = box_grounding(queries, top_boxes, counting=counting)
    return grounding_summary(phrase_fingerprint(queries), len(queries), pointing, rule="best_fragment",
                             box_metrics=_box_metrics(queries, box_scores, boxes_of_query),
                             phrases_without_parse=without_parse, phrases_without_fragment=without_fragment)
