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
import pathlib
from typing import Sequence

import numpy as np

from tf_twobranch.data.tokenize import END_TOKEN, START_TOKEN
from tf_twobranch.errors import ConfigError
from tf_twobranch.evaluation import pointing_game

__all__ = ["PARSE_MODES", "projected_maps", "query_heat_maps", "pointing_results", "baseline_points",
           "channel_mean_heat_maps", "draw_phrase_heat_maps"]

PARSE_MODES = ("word", "phrase")


def projected_maps(model, backbone_maps: np.ndarray, chunk: int = 128) -> np.ndarray:
    """(N, h, w, d) a_{r,c} of every image from its backbone map (inference mode)."""
    return np.concatenate([np.asarray(model.image_maps({"backbone_map": backbone_maps[i:i + chunk]}))
                           for i in range(0, len(backbone_maps), chunk)]) if len(backbone_maps) else \
        np.zeros((0,) + tuple(model.projection.output.shape[1:]), np.float32)


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
    rows = rows[:max_words]
    positions = [p for p in positions if p <= max_words]
    inputs = np.repeat(word_matrix[end][None, :], width, axis=0)
    inputs[0] = word_matrix[start]
    if rows:
        inputs[1:1 + len(rows)] = np.stack(rows)
    mask = np.zeros(width, bool)
    mask[1:1 + len(rows)] = True
    return inputs, mask, positions


def query_heat_maps(model, maps_by_image: dict, queries: Sequence, vocabulary: Sequence[str], *,
                    mode: str = "word", max_words: int = 20, chunk: int = 256) -> list[np.ndarray | None]:
    """The (h, w) heat map of every query (None: no word of the phrase has a vector).

    Args:
      maps_by_image: image id → (h, w, d) projected map (`projected_maps`).
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


def channel_mean_heat_maps(backbone_maps_by_image: dict, queries: Sequence) -> list[np.ndarray]:
    """The paper's "VGG baseline": the backbone map averaged over channels, the same for every phrase."""
    return [np.asarray(backbone_maps_by_image[q.image_id], np.float64).mean(axis=-1) for q in queries]


def baseline_points(queries: Sequence, kind: str, seed: int = 0) -> list:
    if kind == "random_point":
        return pointing_game.random_points(queries, seed)
    if kind == "centre_point":
        return pointing_game.centre_points(queries)
    raise ConfigError(f"unknown pointing baseline {kind!r}")


def pointing_results(queries: Sequence, heat_maps: Sequence[np.ndarray | None] | None = None, *,
                     points: Sequence | None = None, counting: str = "phrase") -> dict:
    """Pointing-game results; a query without a map is a miss (counted, not skipped)."""
    if points is None:
        points = [None if m is None else
                  pointing_game.heat_map_maximum(m, q.image_height, q.image_width)
                  for m, q in zip(heat_maps, queries)]
    mapped = [i for i, p in enumerate(points) if p is not None]
    unmapped = len(points) - len(mapped)
    if mapped:
        result = pointing_game.evaluate_pointing_game([queries[i] for i in mapped], [points[i] for i in mapped],
                                                      counting=counting)
    else:
        result = {"counting": counting, "hits": 0, "misses": 0, "trials": 0}
    unmapped_trials = sum(1 if counting == "phrase" else len(queries[i].boxes)
                          for i, p in enumerate(points) if p is None)
    result["misses"] += unmapped_trials
    result["trials"] += unmapped_trials
    result["queries_without_map"] = unmapped
    result["accuracy"] = pointing_game.pointing_game_accuracy(result["hits"], result["misses"])
    return result


def draw_phrase_heat_maps(image: np.ndarray, queries: Sequence, heat_maps: Sequence[np.ndarray | None],
                          path, *, title: str = "") -> pathlib.Path:
    """One PNG: the image, then per phrase its heat map over the image (the paper's Figs. 1 and 5),
    the pointing-game maximum (a cross) and the phrase's ground-truth boxes (green: hit, red: miss)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    path = pathlib.Path(path)
    panels = len(queries) + 1
    fig, axes = plt.subplots(1, panels, figsize=(3.2 * panels, 3.6), squeeze=False)
    axes[0, 0].imshow(image)
    axes[0, 0].set_title(title or "image", fontsize=8)
    for ax, query, heat in zip(axes[0, 1:], queries, heat_maps):
        ax.imshow(image)
        hit = False
        if heat is not None:
            up = pointing_game.upsample_heat_map(heat, query.image_height, query.image_width)
            ax.imshow(up, cmap="jet", alpha=0.45, extent=(-0.5, query.image_width - 0.5,
                                                          query.image_height - 0.5, -0.5))
            x, y = pointing_game.heat_map_maximum(heat, query.image_height, query.image_width)
            hit = pointing_game.point_hits_boxes(x, y, query.boxes)
            ax.plot([x], [y], marker="x", color="white", markersize=12, markeredgewidth=3)
        for x1, y1, x2, y2 in np.asarray(query.boxes):
            ax.add_patch(Rectangle((x1 - 0.5, y1 - 0.5), x2 - x1 + 1, y2 - y1 + 1, fill=False,
                                   edgecolor="lime" if hit else "red", linewidth=2))
        verdict = "no map" if heat is None else ("hit" if hit else "miss")
        ax.set_title(f"{query.phrase!r}: {verdict}", fontsize=8)
    for ax in axes[0]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
