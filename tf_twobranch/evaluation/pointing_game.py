"""The pointing game on Flickr30K Entities (Das et al., §4.2 "Evaluation Metric", Table 2).

A phrase's attention map is upsampled to its image; the pixel of the map's
maximum is a *Hit* when it lies inside a ground-truth box of the phrase and a
*Miss* otherwise; accuracy = 100 · #Hit / (#Hit + #Miss) (Table 2 reports a
percentage).  The paper's baselines are the image centre, a random pixel, and
the maps of other models (an averaged VGG map, the untrained model), all fed
through the same counting.

Which phrases are queried: exactly those kept by
:func:`tf_twobranch.data.phrases.phrase_examples_from_images` (not-visual
phrases, excluded types and chains without a box are left out), in its order.

What the paper leaves open and what we chose (the authors' LocNet code,
``visualizations/visualize_utils.py``, is the reference read for it):

* **Upsampling.**  LocNet resizes every map with ``cv2.resize(map, (224, 224))``
  (bilinear, half-pixel centres), scales the boxes by 224/W and 224/H and
  takes the arg-max in that 224×224 frame.  We upsample the map straight to the
  image's own W×H with the same bilinear half-pixel rule (identical to
  ``tf.image.resize(..., method="bilinear")`` without antialiasing and to
  ``cv2.INTER_LINEAR``), so boxes stay in their integer pixel coordinates.
* **Maximum** (``point_rule``, `POINT_RULES`).  The paper asks whether "the
  most confident region of the predicted attention map" falls in a box: the
  region is the arg-max *cell* of the h×w map.  ``"cell_centre"`` (default)
  points at the centre pixel of that cell, (⌊(c + ½)·W/w⌋, ⌊(r + ½)·H/h⌋)
  (ties: the first cell in row-major order).  For an inner cell this is where
  the bilinear-upsampled map peaks; for an edge cell the upsampled map is a
  clamped plateau (the edge half-cell holds the cell's value), and
  ``"argmax"`` — LocNet's ``np.argmax`` of ``cv2.resize``, the first maximal
  pixel of the upsampled map in row-major order — then lands on the image's
  edge pixel: the top-right cell of a 6×6 map on a 96-px image points at
  (88, 0) instead of its centre (88, 8), outside every box that does not
  touch the edge.  A constant map points at the first cell's centre
  (cell_centre) or at pixel (0, 0) (argmax).
* **Hit test.**  x is the column, compared with x1/x2; y the row, compared
  with y1/y2; box edges count as inside (boxes are 0-based inclusive pixel
  boxes, :mod:`tf_twobranch.boxes`).  LocNet compares the *row* with x1/x2 —
  its points come from ``np.unravel_index`` as (row, col) — a defect we do not
  reproduce.
* **Several boxes** ("we checked the metric across all such bounding boxes").
  ``counting="phrase"`` (default, the paper's rule): one trial per phrase, a
  hit when the point lies in *any* of its boxes.  ``counting="per_box"`` is
  LocNet's ``single_image_score``: one trial per ground-truth box of the
  phrase, a hit for each box that contains the point, so a phrase with two
  boxes and a point in one of them counts one hit and one miss.  LocNet then
  reports the *mean over captions* of each caption's hits / trials (a caption
  with no boxed phrase divides by zero there); :func:`evaluate_pointing_game`
  reports that as ``caption_mean_accuracy`` beside the pooled ``accuracy``.
* **Centre baseline.**  The pixel ((W − 1) // 2, (H − 1) // 2): the exact
  centre for odd sizes, rounded down (towards the top-left) for even sizes.
* **Word mode.**  A phrase's map is the mean of its words' maps
  (:func:`phrase_heat_map`, LocNet's ``caption_parser``); in phrase mode the
  model's map of the whole phrase is used as is.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from typing import Callable, Iterable, Sequence

import numpy as np

from tf_twobranch.data.formats.flickr30k_entities import NOTVISUAL_TYPE, ImagePhrases, read_entities_dataset
from tf_twobranch.data.phrases import phrase_examples_from_images
from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError

__all__ = [
    "COUNTING_MODES",
    "PointingQuery",
    "pointing_queries",
    "pointing_queries_from_images",
    "upsample_heat_map",
    "POINT_RULES",
    "DEFAULT_POINT_RULE",
    "heat_map_maximum",
    "point_hits_boxes",
    "pointing_game_counts",
    "pointing_game_accuracy",
    "random_points",
    "centre_points",
    "points_from_heat_maps",
    "phrase_heat_map",
    "evaluate_pointing_game",
    "evaluate_points",
    "box_centre_points",
]

#: "phrase": one trial per phrase (the paper); "per_box": one trial per ground-truth box (LocNet).
COUNTING_MODES = ("phrase", "per_box")
#: The pixel a heat map points at: "cell_centre" (the centre of the map's arg-max cell: the
#: paper's "most confident region") or "argmax" (LocNet: the first maximal pixel of the
#: bilinear-upsampled map, which lands on the image's edge pixel for an edge cell).
POINT_RULES = ("cell_centre", "argmax")
DEFAULT_POINT_RULE = "cell_centre"

Point = tuple[int, int]


@dataclasses.dataclass
class PointingQuery:
    """One phrase to localize by pointing.

    Attributes:
      image_id, sentence_index, phrase_index: as in
        :class:`tf_twobranch.data.phrases.PhraseExample` (the phrase index
        counts all phrases of the sentence, before any exclusion).
      caption_words: the Entities sentence's words, lower-cased.
      word_span: (start, stop) of the phrase in ``caption_words`` (stop exclusive).
      phrase: the phrase text as written in the sentence file.
      boxes: float32 (k, 4) 0-based inclusive boxes [x1, y1, x2, y2] of the
        phrase's chain (k > 1 for a plural entity).
      image_width, image_height: the image size from the annotation file.
      chain_id, phrase_types: the phrase's chain and coarse types (for
        per-type accuracies).
    """

    image_id: str
    sentence_index: int
    phrase_index: int
    caption_words: list[str]
    word_span: tuple[int, int]
    phrase: str
    boxes: np.ndarray
    image_width: int
    image_height: int
    chain_id: str = ""
    phrase_types: list[str] = dataclasses.field(default_factory=list)

    def __eq__(self, other):
        if not isinstance(other, PointingQuery):
            return NotImplemented
        fields = [f.name for f in dataclasses.fields(self) if f.name != "boxes"]
        return (all(getattr(self, name) == getattr(other, name) for name in fields)
                and np.array_equal(self.boxes, other.boxes))


# ----------------------------------------------------------------------------
# Queries


def pointing_queries_from_images(images: Iterable[ImagePhrases], *,
                                 exclude_types: Sequence[str] = (NOTVISUAL_TYPE,),
                                 strict: bool = False) -> list[PointingQuery]:
    """One query per phrase that ``phrase_examples_from_images`` keeps, in its order."""
    images = list(images)
    examples, _ = phrase_examples_from_images(images, exclude_types=exclude_types, strict=strict)
    by_id = {image.image_id: image for image in images}
    queries = []
    for example in examples:
        image = by_id[example.image_id]
        sentence = image.sentences[example.sentence_index]
        phrase = sentence.phrases[example.phrase_index]
        start = phrase.first_word_index
        stop = start + phrase.num_words
        words = [word.lower() for word in sentence.words]
        # The reader guarantees this for files; an in-memory sentence may not.
        if words[start:stop] != phrase.text.lower().split(" "):
            raise DataFormatError(image.sentence_path,
                                  f"phrase {phrase.text!r} does not match words {start}..{stop - 1} of "
                                  f"{sentence.text!r}", line=sentence.line)
        queries.append(PointingQuery(
            image_id=example.image_id, sentence_index=example.sentence_index,
            phrase_index=example.phrase_index, caption_words=words, word_span=(start, stop),
            phrase=example.phrase, boxes=np.asarray(example.gt_boxes, np.float32).reshape(-1, 4).copy(),
            image_width=int(image.annotation.width), image_height=int(image.annotation.height),
            chain_id=example.chain_id, phrase_types=list(example.phrase_types)))
    return queries


def pointing_queries(entities_root, image_ids, *, exclude_types: Sequence[str] = (NOTVISUAL_TYPE,),
                     strict: bool = False) -> list[PointingQuery]:
    """Pointing-game queries of ``image_ids`` read from a Flickr30K Entities folder.

    Args:
      entities_root: folder holding ``Sentences/`` and ``Annotations/``.
      image_ids: iterable of image ids, or the path of a split file (``test.txt``).
      exclude_types, strict: as in :func:`tf_twobranch.data.phrases.phrase_examples_from_images`.
    """
    images = read_entities_dataset(os.fspath(entities_root), image_ids)
    return pointing_queries_from_images(images, exclude_types=exclude_types, strict=strict)


# ----------------------------------------------------------------------------
# Maps and points


def _check_heat_map(heat_map) -> np.ndarray:
    try:
        array = np.asarray(heat_map, dtype=np.float64)
    except (TypeError, ValueError):
        raise UserInputError(f"a heat map must be a 2-D array of numbers, got {type(heat_map).__name__}") from None
    if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise UserInputError(f"a heat map must be a non-empty 2-D (h, w) array, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise UserInputError("the heat map holds NaN or infinite values; its maximum is undefined")
    return array


def _check_size(height, width) -> tuple[int, int]:
    if int(height) != height or int(width) != width or height < 1 or width < 1:
        raise UserInputError(f"image size must be positive integers, got height {height!r}, width {width!r}")
    return int(height), int(width)


def _source_positions(out_size: int, in_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lower/upper source cells and the weight of the upper one, for each output pixel.

    Half-pixel centres: output pixel i sits at source coordinate
    (i + 0.5) · in/out − 0.5, clamped to [0, in − 1] (the edge cells extend to
    the image border, as in tf.image.resize and cv2.resize).
    """
    # Multiplying before dividing keeps exact cases exact (67.5 · 2 / 90 = 1.5).
    position = (np.arange(out_size, dtype=np.float64) + 0.5) * in_size / out_size - 0.5
    position = np.clip(position, 0.0, in_size - 1)
    lower = np.floor(position).astype(np.int64)
    upper = np.minimum(lower + 1, in_size - 1)
    return lower, upper, position - lower


def upsample_heat_map(heat_map, height: int, width: int) -> np.ndarray:
    """The (h, w) map resized to (height, width), bilinear with half-pixel centres (float64).

    Matches ``tf.image.resize(map[..., None], (height, width), method="bilinear")``
    (antialias off).  A 1×1 map becomes a constant image.
    """
    array = _check_heat_map(heat_map)
    height, width = _check_size(height, width)
    rows_low, rows_high, row_weight = _source_positions(height, array.shape[0])
    cols_low, cols_high, col_weight = _source_positions(width, array.shape[1])
    # Separable: interpolate along columns, then along rows.
    along_cols = (array[:, cols_low] * (1.0 - col_weight)[None, :]
                  + array[:, cols_high] * col_weight[None, :])
    return (along_cols[rows_low, :] * (1.0 - row_weight)[:, None]
            + along_cols[rows_high, :] * row_weight[:, None])


def _check_point_rule(rule: str) -> str:
    if rule not in POINT_RULES:
        raise ConfigError(f"point rule must be one of {POINT_RULES}, got {rule!r}")
    return rule


def heat_map_maximum(heat_map, height: int, width: int, rule: str = DEFAULT_POINT_RULE) -> Point:
    """(x, y) = (column, row) of the pixel the map points at in a height × width image.

    rule "cell_centre" (default): the centre pixel (⌊(c + ½)·width/w⌋, ⌊(r + ½)·height/h⌋) of the
    map's arg-max cell (r, c), ties → the first cell in row-major order. rule "argmax" (LocNet):
    the first maximal pixel, in row-major order, of the map upsampled bilinearly to the image
    (an edge cell's maximum is then a clamped plateau whose first pixel is on the image's edge).
    """
    _check_point_rule(rule)
    if rule == "argmax":
        upsampled = upsample_heat_map(heat_map, height, width)
        row, column = np.unravel_index(int(np.argmax(upsampled)), upsampled.shape)
        return int(column), int(row)
    array = _check_heat_map(heat_map)
    height, width = _check_size(height, width)
    row, column = np.unravel_index(int(np.argmax(array)), array.shape)
    # Exact integer arithmetic: ⌊(2c + 1)·W / (2w)⌋ < W always.
    return ((2 * int(column) + 1) * width // (2 * array.shape[1]),
            (2 * int(row) + 1) * height // (2 * array.shape[0]))


def _check_boxes(boxes) -> np.ndarray:
    array = np.asarray(boxes, dtype=np.float64)
    if array.ndim == 1 and array.shape[0] == 4:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] != 4:
        raise UserInputError(f"boxes must be a (k, 4) array of [x1, y1, x2, y2], got shape {np.shape(boxes)}")
    if not np.isfinite(array).all():
        raise UserInputError("boxes hold NaN or infinite coordinates")
    return array


def _hits_per_box(x: float, y: float, boxes: np.ndarray) -> np.ndarray:
    return (boxes[:, 0] <= x) & (x <= boxes[:, 2]) & (boxes[:, 1] <= y) & (y <= boxes[:, 3])


def point_hits_boxes(x: float, y: float, boxes) -> bool:
    """Whether pixel (x = column, y = row) lies in any box, edges inclusive."""
    return bool(_hits_per_box(float(x), float(y), _check_boxes(boxes)).any())


# ----------------------------------------------------------------------------
# Counting


def _check_points(points, queries: Sequence[PointingQuery]) -> list[tuple[float, float]]:
    points = list(points)
    if len(points) != len(queries):
        raise UserInputError(f"got {len(points)} points for {len(queries)} queries; pass one (x, y) per query")
    checked = []
    for index, (point, query) in enumerate(zip(points, queries)):
        try:
            x, y = (float(value) for value in point)
        except (TypeError, ValueError):
            raise UserInputError(f"point {index} is {point!r}; expected an (x, y) pair of numbers") from None
        if not (0 <= x <= query.image_width - 1 and 0 <= y <= query.image_height - 1):
            # Most often a (row, column) pair or a point in a resized frame.
            raise UserInputError(
                f"point {index} (x={x:g}, y={y:g}) lies outside the {query.image_width}x{query.image_height} "
                f"image {query.image_id} (x is the column in [0, width - 1], y the row in [0, height - 1])")
        checked.append((x, y))
    return checked


def _check_counting(counting: str) -> str:
    if counting not in COUNTING_MODES:
        raise ConfigError(f"counting must be one of {COUNTING_MODES}, got {counting!r}")
    return counting


def _trial_outcomes(points, queries: Sequence[PointingQuery], counting: str) -> list[tuple[int, int]]:
    """(hits, trials) of each query."""
    counting = _check_counting(counting)
    outcomes = []
    for (x, y), query in zip(_check_points(points, queries), queries):
        inside = _hits_per_box(x, y, _check_boxes(query.boxes))
        if counting == "phrase":
            outcomes.append((int(inside.any()), 1))
        else:
            outcomes.append((int(inside.sum()), len(inside)))
    return outcomes


def pointing_game_counts(points, queries: Sequence[PointingQuery], *,
                         counting: str = "phrase") -> tuple[int, int]:
    """(hits, misses) of ``points`` (one (x, y) per query).

    ``counting="phrase"`` (the paper): one trial per phrase, a hit when its
    point lies in any of its boxes.  ``counting="per_box"`` (LocNet's
    ``single_image_score``): one trial per ground-truth box of each phrase,
    a hit for every box that contains the phrase's point.
    """
    outcomes = _trial_outcomes(points, queries, counting)
    hits = sum(h for h, _ in outcomes)
    trials = sum(t for _, t in outcomes)
    return hits, trials - hits


def pointing_game_accuracy(hits: int, misses: int) -> float:
    """100 · hits / (hits + misses), the percentage of Table 2."""
    if hits < 0 or misses < 0:
        raise UserInputError(f"hits and misses must be non-negative, got {hits} and {misses}")
    if hits + misses == 0:
        raise UserInputError("the pointing game has no trials (no queries, or no ground-truth boxes); "
                             "accuracy is undefined")
    return 100.0 * hits / (hits + misses)


def evaluate_pointing_game(queries: Sequence[PointingQuery], points, *, counting: str = "phrase") -> dict:
    """Pointing-game results of ``points`` (one (x, y) per query).

    Returns a dict with ``counting``, ``trials``, ``hits``, ``misses``,
    ``accuracy`` (pooled over all trials), ``caption_mean_accuracy`` (the
    mean over captions of each caption's hits / trials — LocNet's averaging),
    and ``accuracy_per_type`` / ``trials_per_type`` (a phrase with several
    types counts under each of them).
    """
    queries = list(queries)
    outcomes = _trial_outcomes(points, queries, counting)
    hits = sum(h for h, _ in outcomes)
    trials = sum(t for _, t in outcomes)
    accuracy = pointing_game_accuracy(hits, trials - hits)

    per_caption: dict[tuple[str, int], list[int]] = collections.defaultdict(lambda: [0, 0])
    per_type: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for (query_hits, query_trials), query in zip(outcomes, queries):
        caption = per_caption[(query.image_id, query.sentence_index)]
        caption[0] += query_hits
        caption[1] += query_trials
        for phrase_type in query.phrase_types:
            per_type[phrase_type][0] += query_hits
            per_type[phrase_type][1] += query_trials
    caption_mean = float(np.mean([100.0 * h / t for h, t in per_caption.values()]))
    return {
        "counting": counting,
        "trials": trials,
        "hits": hits,
        "misses": trials - hits,
        "accuracy": accuracy,
        "caption_mean_accuracy": caption_mean,
        "accuracy_per_type": {name: 100.0 * h / t for name, (h, t) in sorted(per_type.items())},
        "trials_per_type": {name: t for name, (_, t) in sorted(per_type.items())},
    }


def evaluate_points(queries: Sequence[PointingQuery], points, *, counting: str = "phrase") -> dict:
    """:func:`evaluate_pointing_game` where a query's point may be None (the system gave no answer
    for it: no heat map, no sentence fragment): a miss, counted, never dropped.

    Adds ``queries_without_point`` (how many) to the results; accuracy is over every query.
    """
    queries, points = list(queries), list(points)
    if len(points) != len(queries):
        raise UserInputError(f"got {len(points)} points for {len(queries)} queries; pass one (x, y) or None "
                             "per query")
    answered = [i for i, p in enumerate(points) if p is not None]
    if answered:
        result = evaluate_pointing_game([queries[i] for i in answered], [points[i] for i in answered],
                                        counting=counting)
    else:
        result = {"counting": _check_counting(counting), "hits": 0, "misses": 0, "trials": 0}
    unanswered = sum(1 if counting == "phrase" else len(queries[i].boxes)
                     for i, p in enumerate(points) if p is None)
    result["misses"] += unanswered
    result["trials"] += unanswered
    result["queries_without_point"] = len(points) - len(answered)
    result["accuracy"] = pointing_game_accuracy(result["hits"], result["misses"])
    return result


def box_centre_points(queries: Sequence[PointingQuery], boxes) -> list[Point | None]:
    """The point of a system that answers with a box: its centre pixel
    (⌊(x1 + x2) / 2⌋, ⌊(y1 + y2) / 2⌋) of the inclusive box, clipped to the query's image
    (a proposal may stick out of it); None where the box is None (no answer: a miss)."""
    boxes = list(boxes)
    if len(boxes) != len(queries):
        raise UserInputError(f"got {len(boxes)} boxes for {len(queries)} queries; pass one box or None per query")
    points: list[Point | None] = []
    for index, (box, query) in enumerate(zip(boxes, queries)):
        if box is None:
            points.append(None)
            continue
        x1, y1, x2, y2 = (float(v) for v in _check_boxes(box)[0])
        if x2 < x1 or y2 < y1:
            raise UserInputError(f"box {index} {[x1, y1, x2, y2]} of image {query.image_id} is empty "
                                 "(x2 < x1 or y2 < y1)")
        points.append((int(min(max(np.floor((x1 + x2) / 2), 0), query.image_width - 1)),
                       int(min(max(np.floor((y1 + y2) / 2), 0), query.image_height - 1))))
    return points


# ----------------------------------------------------------------------------
# Baselines and model maps


def random_points(queries: Sequence[PointingQuery], seed: int) -> list[Point]:
    """A uniformly random pixel of each query's image (numpy Generator seeded with ``seed``)."""
    generator = np.random.default_rng(seed)
    return [(int(generator.integers(0, q.image_width)), int(generator.integers(0, q.image_height)))
            for q in queries]


def centre_points(queries: Sequence[PointingQuery]) -> list[Point]:
    """The centre pixel ((W − 1) // 2, (H − 1) // 2) of each query's image (rounded down for even sizes)."""
    return [((q.image_width - 1) // 2, (q.image_height - 1) // 2) for q in queries]


def points_from_heat_maps(queries: Sequence[PointingQuery],
                          heat_map_fn: Callable[[PointingQuery], np.ndarray], *,
                          rule: str = DEFAULT_POINT_RULE) -> list[Point]:
    """The point (`heat_map_maximum` under `rule`) of ``heat_map_fn(query)`` (an (h, w) map) in each
    query's image."""
    return [heat_map_maximum(heat_map_fn(q), q.image_height, q.image_width, rule) for q in queries]


def phrase_heat_map(word_maps, word_span: tuple[int, int]) -> np.ndarray:
    """The mean of the phrase's word maps ``word_maps[start:stop]`` (word parse mode); word_maps is (T, h, w)."""
    maps = np.asarray(word_maps, dtype=np.float64)
    if maps.ndim != 3:
        raise UserInputError(f"word maps must be a (words, h, w) array, got shape {maps.shape}")
    try:
        start, stop = (int(v) for v in word_span)
    except (TypeError, ValueError):
        raise UserInputError(f"word_span must be a (start, stop) pair of integers, got {word_span!r}") from None
    if not 0 <= start < stop <= len(maps):
        raise UserInputError(f"word span ({start}, {stop}) is not a non-empty range of the {len(maps)} word maps")
    return maps[start:stop].mean(axis=0)
