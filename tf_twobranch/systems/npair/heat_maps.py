"""Per-phrase heat maps of the N-pair localization model and the pointing game (Das et al., §4.2).

For a Flickr30K Entities phrase the caption is its sentence (the Entities
words, lower-cased; words without a vector are dropped as in training) and
the image map is the model's projected map a_{r,c}, both normalised as the
model's score normalises them. Two parse modes (the paper's "Parse Mode"):

* ``word``: the maps m_{·,·,t} of the phrase's words, averaged;
* ``phrase``: the phrase's words replaced in the caption by ONE input, the
  mean of their word vectors, and that token's map.

A phrase none of whose words has a vector (or that lies beyond the
``max_words`` clip) has no map: it counts as a miss, never skipped. The
baselines of Table 2 point without a model: a random pixel, the image
centre, or the maximum of the backbone map's channel mean (the paper's
"VGG baseline"); the untrained model is the model row with no training.
"""
from __future__ import annotations

import collections
import dataclasses
import pathlib
from typing import Mapping, Sequence

import numpy as np

from tf_twobranch.data.formats.row_arrays import RowWriter, open_rows

from tf_twobranch.data.tokenize import END_TOKEN, START_TOKEN
from tf_twobranch.errors import ConfigError
from tf_twobranch.evaluation import pointing_game
from tf_twobranch.systems.npair.features import kept_caption_words

__all__ = ["PARSE_MODES", "MAP_CHUNK", "projected_maps", "EvaluationMaps", "evaluation_maps", "token_vector_rows", "RowsById",
           "query_heat_maps", "pointing_results", "baseline_points",
           "channel_mean_heat_maps"]

PARSE_MODES = ("word", "phrase")
# Images projected per model call. Evaluation and pictures use the same chunks, so an image's
# projected map does not depend on which of them computed it.
MAP_CHUNK = 128


def _projected_chunks(model, backbone_maps, chunk: int):
    """(start, stop, (stop - start, h, w, d) a_{r,c}) chunk by chunk (inference mode); the chunks
    are the same however the result is stored, so every caller sees the same maps."""
    for start in range(0, len(backbone_maps), chunk):
        stop = min(start + chunk, len(backbone_maps))
        rows = np.asarray(backbone_maps[start:stop], np.float32)   # float16 storage widened
        yield start, stop, model.image_maps({"backbone_map": rows})


def _map_shape(model, backbone_maps) -> tuple:
    """(h, w, d) of a projected map: the 'same'-padded projection keeps the backbone map's h × w."""
    return tuple(int(n) for n in backbone_maps.shape[1:3]) + (int(model.config.embed_dim),)


def projected_maps(model, backbone_maps, chunk: int = MAP_CHUNK) -> np.ndarray:
    """(N, h, w, d) a_{r,c} of every image from its backbone map, in RAM: for a few images
    (`evaluation_maps` writes a whole evaluation split to disk instead)."""
    parts = [np.asarray(maps) for _, _, maps in _projected_chunks(model, backbone_maps, chunk)]
    return np.concatenate(parts) if parts else np.zeros((0,) + _map_shape(model, backbone_maps), np.float32)


@dataclasses.dataclass
class EvaluationMaps:
    """The evaluation split's image maps, memory-mapped row arrays computed once per evaluation.

    ``projected``: a_{r,c} as the model projects them (the pointing game normalises them together
    with each query's tokens); ``normalised``: as the model's score normalises them (what the
    retrieval scorer takes).
    """
    projected: np.ndarray
    normalised: np.ndarray


def _normalised_maps(model, maps):
    # The model normalises maps and tokens in one call; a map's normalisation reads only that map,
    # so one zero token stands in for the captions.
    tokens = np.zeros((1, 1, maps.shape[-1]), np.float32)
    return np.asarray(model.normalised(maps, tokens, np.ones((1, 1), bool))[0])


def evaluation_maps(model, backbone_maps, folder, chunk: int = MAP_CHUNK) -> EvaluationMaps:
    """Projects and normalises the maps of every image chunk by chunk, written as they come into
    ``folder`` (``projected.npy``, ``normalised.npy``): memory holds a chunk, not the split."""
    folder = pathlib.Path(folder)
    shape = (len(backbone_maps),) + _map_shape(model, backbone_maps)
    projected = RowWriter(folder / "projected.npy", shape, np.float32)
    normalised = RowWriter(folder / "normalised.npy", shape, np.float32)
    try:
        for start, stop, maps in _projected_chunks(model, backbone_maps, chunk):
            projected[start:stop] = np.asarray(maps)
            normalised[start:stop] = _normalised_maps(model, maps)
    except BaseException:
        projected.abort()
        normalised.abort()
        raise
    return EvaluationMaps(open_rows(projected.close()), open_rows(normalised.close()))


def token_vector_rows(model, token_ids, token_mask, path, chunk: int = 512) -> np.ndarray:
    """(num_captions, T, d) s_t of every caption, normalised as the model's score normalises them,
    chunk by chunk into the ``.npy`` file `path` (memory-mapped)."""
    token_mask = np.asarray(token_mask, bool)
    shape = (len(token_ids), int(token_mask.shape[1]), int(model.config.embed_dim))
    with RowWriter(path, shape, np.float32) as out:
        for start in range(0, len(token_ids), chunk):
            stop = min(start + chunk, len(token_ids))
            tokens = model.token_vectors(np.asarray(token_ids[start:stop]))
            dummy = np.zeros((1, 1, 1, shape[2]), np.float32)
            # As in `_normalised_maps`: a caption's normalisation reads only that caption.
            out[start:stop] = np.asarray(model.normalised(dummy, tokens, token_mask[start:stop])[1])
    return open_rows(path)


class RowsById(Mapping):
    """image id -> its row of a (memory-mapped) row array, read when asked: a lazy
    ``dict(zip(image_ids, rows))`` that never holds the split's maps."""

    def __init__(self, image_ids: Sequence[str], rows):
        if len(image_ids) != len(rows):
            raise ConfigError(f"{len(image_ids)} image ids for {len(rows)} rows")
        self._index = {image_id: i for i, image_id in enumerate(image_ids)}
        self._rows = rows

    def __getitem__(self, image_id):
        return self._rows[self._index[image_id]]

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def _caption_inputs(query, index: dict, max_words: int, mode: str, word_matrix: np.ndarray,
                    start: int, end: int):
    """(LSTM inputs (T, word_dim), word mask (T,), token positions of the phrase) of one query."""
    width = max_words + 2
    start_at, stop_at = query.word_span
    before = [index[w] for w in query.caption_words[:start_at] if w in index]
    inside = [index[w] for w in query.caption_words[start_at:stop_at] if w in index]
    after = [index[w] for w in query.caption_words[stop_at:] if w in index]
    if mode == "word":
        rows = [word_matrix[i] for i in before + inside + after]
        positions = list(range(1 + len(before), 1 + len(before) + len(inside)))
    else:
        phrase = [np.mean(word_matrix[inside], axis=0)] if inside else []
        rows = [word_matrix[i] for i in before] + phrase + [word_matrix[i] for i in after]
        positions = [1 + len(before)] if inside else []
    rows = kept_caption_words(rows, max_words)     # the one N-pair caption-length rule
    positions = [p for p in positions if p <= max_words]
    inputs = np.repeat(word_matrix[end][None, :], width, axis=0)
    inputs[0] = word_matrix[start]
    if rows:
        inputs[1:1 + len(rows)] = np.stack(rows)
    mask = np.zeros(width, bool)
    mask[1:1 + len(rows)] = True
    return inputs, mask, positions


def query_heat_maps(model, maps_by_image: Mapping, queries: Sequence, vocabulary: Sequence[str], *,
                    mode: str = "word", max_words: int = 20, chunk: int = 256) -> list[np.ndarray | None]:
    """The (h, w) heat map of every query (None: no word of the phrase has a vector).

    Args:
      maps_by_image: image id → (h, w, d) projected map (`projected_maps`; or `RowsById` over
        ``EvaluationMaps.projected``: only the maps of a chunk's images are read).
      vocabulary: the model's vocabulary (``<pad>, <unk>, <start>, <end>, words...``).
    """
    if mode not in PARSE_MODES:
        raise ConfigError(f"parse mode must be one of {PARSE_MODES}, got {mode!r}")
    index = {w: i for i, w in enumerate(vocabulary) if i >= 4}
    start, end = vocabulary.index(START_TOKEN), vocabulary.index(END_TOKEN)
    word_matrix = np.asarray(model.word_embedding.embeddings)
    # In word mode the queries of one sentence share one LSTM pass.
    groups: dict = collections.OrderedDict()
    for q, query in enumerate(queries):
        key = (query.image_id, query.sentence_index) if mode == "word" else q
        groups.setdefault(key, []).append(q)
    keys = list(groups)
    out: list[np.ndarray | None] = [None] * len(queries)
    for c in range(0, len(keys), chunk):
        block = keys[c:c + chunk]
        built = [_caption_inputs(queries[groups[k][0]], index, max_words, mode, word_matrix, start, end)
                 for k in block]
        inputs = np.stack([b[0] for b in built]).astype(np.float32)
        mask = np.stack([b[1] for b in built])
        images = np.stack([maps_by_image[queries[groups[k][0]].image_id] for k in block]).astype(np.float32)
        tokens = model.token_vectors_from_inputs(inputs)
        maps, tokens = model.normalised(images, tokens, mask)
        volume = np.einsum("bhwd,btd->bthw", np.asarray(maps), np.asarray(tokens))
        for b, k in enumerate(block):
            for q in groups[k]:
                if mode == "word":
                    _, _, positions = _caption_inputs(queries[q], index, max_words, mode, word_matrix, start, end)
                else:
                    positions = built[b][2]
                if positions:
                    out[q] = volume[b, positions].mean(axis=0)
    return out


def channel_mean_heat_maps(backbone_maps_by_image: Mapping, queries: Sequence) -> list[np.ndarray]:
    """The paper's "VGG baseline": the backbone map averaged over channels, the same for every phrase.

    `backbone_maps_by_image`: image id → (h, w, C) map, e.g. `RowsById` over the memory-mapped
    backbone maps (each query reads its image's map)."""
    return [np.asarray(backbone_maps_by_image[q.image_id], np.float64).mean(axis=-1) for q in queries]


def baseline_points(queries: Sequence, kind: str, seed: int = 0) -> list:
    if kind == "random_point":
        return pointing_game.random_points(queries, seed)
    if kind == "centre_point":
        return pointing_game.centre_points(queries)
    raise ConfigError(f"unknown pointing baseline {kind!r}")


def _heat_map_points(queries: Sequence, heat_maps: Sequence[np.ndarray | None], rule: str) -> list:
    return [None if m is None else pointing_game.heat_map_maximum(m, q.image_height, q.image_width, rule)
            for m, q in zip(heat_maps, queries)]


def pointing_results(queries: Sequence, heat_maps: Sequence[np.ndarray | None] | None = None, *,
                     points: Sequence | None = None, counting: str = "phrase",
                     point_rule: str = pointing_game.DEFAULT_POINT_RULE) -> dict:
    """Pointing-game results; a query without a map is a miss (counted, not skipped).

    Heat maps point by `point_rule` (`pointing_game.POINT_RULES`); the results also hold
    ``accuracy_by_point_rule``, the accuracy under every rule (the maps are the same), and
    ``point_rule``. Given `points` (a baseline's pixels) no rule applies: ``point_rule`` is None.
    """
    by_rule = None
    if points is None:
        if point_rule not in pointing_game.POINT_RULES:
            raise ConfigError(f"point rule must be one of {pointing_game.POINT_RULES}, got {point_rule!r}")
        heat_maps = list(heat_maps)
        by_rule = {rule: pointing_game.evaluate_points(queries, _heat_map_points(queries, heat_maps, rule),
                                                       counting=counting)
                   for rule in pointing_game.POINT_RULES}
        result = by_rule[point_rule]
    else:
        result = pointing_game.evaluate_points(queries, points, counting=counting)
    result["queries_without_map"] = result.pop("queries_without_point")
    result["point_rule"] = point_rule if by_rule else None
    if by_rule:
        result["accuracy_by_point_rule"] = {rule: r["accuracy"] for rule, r in by_rule.items()}
    return result
