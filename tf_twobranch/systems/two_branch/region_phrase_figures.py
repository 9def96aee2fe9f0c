"""Fig. 2-style phrase localization pictures (TPAMI 2018, Fig. 2) of a region–phrase model: the
scorers (a SavedModel, or a loaded run's model with its backbone and phrase encoder), the
figure of one image and `draw_region_phrase` over a data folder. No flags:
`experiments.two_branch_draw` is the command.

Like that command, this module imports no TensorFlow, scikit-learn or matplotlib at
start-up: the functions that need them do.
"""
from __future__ import annotations

import io
import json
import os
import pathlib
from typing import Callable, Sequence

import numpy as np
from absl import logging
from PIL import Image

from tf_twobranch.data.formats.flickr30k_entities import read_entities_dataset
from tf_twobranch.data.formats.images import load_image
from tf_twobranch.data.formats.proposals import read_proposals
from tf_twobranch.data.from_flags import dataset_folder
from tf_twobranch.data.layout import PROPOSALS_FILE_NAME, resolve_dataset
from tf_twobranch.data.phrases import phrase_examples_from_images
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.figures import figure_path
from tf_twobranch.vectors import l2_normalize_rows

# Distinct, saturated colours (matplotlib's tab10 without grey).
PHRASE_COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#e377c2", "#8c564b",
                  "#bcbd22")

Scorer = Callable[[bytes, np.ndarray, Sequence[str]], np.ndarray]


# ---------------------------------------------------------------------------- scorers


def saved_model_scorer(saved_model_dir: str | os.PathLike) -> Scorer:
    """A scorer `(image bytes, inclusive proposals (N, 4), phrases) -> (P, N)` from a region–phrase SavedModel."""
    # Only the --saved_model path needs TensorFlow (kept out of the module's start-up).
    import tensorflow as tf
    import tensorflow_text

    del tensorflow_text  # imported only to register the tokenizer ops the SavedModel uses

    saved_model_dir = pathlib.Path(saved_model_dir)
    if not (saved_model_dir / "saved_model.pb").is_file():
        raise DataFormatError(saved_model_dir, "not a SavedModel folder (no saved_model.pb); expected the "
                              "output of export_region_phrase_model")
    convention = "inclusive"
    config_path = saved_model_dir / "assets.extra" / "run_config.json"
    if config_path.is_file():
        convention = json.loads(config_path.read_text(encoding="utf-8")).get(
            "region_phrase_export", {}).get("box_convention", "inclusive")
    loaded = tf.saved_model.load(str(saved_model_dir))
    if "score_proposals" not in loaded.signatures:
        raise DataFormatError(saved_model_dir, f"SavedModel has no 'score_proposals' signature (it has "
                              f"{sorted(loaded.signatures)}); expected a region-phrase export")
    signature = loaded.signatures["score_proposals"]
    offset = np.array([0, 0, 1, 1], np.float32) if convention == "half_open" else 0.0

    def score(image_bytes, proposals, phrases):
        out = signature(image_jpeg=tf.constant(image_bytes), proposals=tf.constant(proposals + offset, tf.float32),
                        phrases=tf.constant(list(phrases), tf.string))
        return out["scores"].numpy()

    return score


def python_scorer(model, backbone_name: str, backbone_weights: str | None, text_encoder_path: str) -> Scorer:
    """A scorer from a trained model (`load_run(...).model`), its backbone and its fitted text
    encoder (the Python path)."""
    # Only the --run_dir path needs these (TensorFlow, scikit-learn): kept out of the
    # module's start-up.
    from tf_twobranch.features.backbones import build_backbone
    from tf_twobranch.features.image_features import extract_region_features
    from tf_twobranch.features.text_features import load_text_encoder

    backbone = build_backbone(backbone_name, weights_path=backbone_weights)
    encoder = load_text_encoder(text_encoder_path)

    def score(image_bytes, proposals, phrases):
        image = np.asarray(Image.open(io.BytesIO(image_bytes)).convert("RGB"))
        features = extract_region_features(image, proposals + [0, 0, 1, 1], backbone)
        regions = l2_normalize_rows(model.embed_images(features))
        texts = l2_normalize_rows(model.embed_texts(encoder.transform([tokenize_caption(p) for p in phrases])))
        if model.similarity_head is None:
            return texts @ regions.T
        joint = (texts[:, None, :] * regions[None, :, :]).reshape(-1, regions.shape[1])
        return model.similarity_head(joint, training=False).numpy().reshape(len(texts), len(regions))

    return score


# ---------------------------------------------------------------------------- drawing


def _draw_boxes(ax, image, boxes_and_colours, title, thicker_first=False):
    # matplotlib only once a figure is drawn (draw_image_figure selects its Agg backend first).
    import matplotlib.patches as patches

    ax.imshow(image, interpolation="nearest")
    count = len(boxes_and_colours)
    for index, (box, colour) in enumerate(boxes_and_colours):
        x1, y1, x2, y2 = (float(v) for v in box)
        # Inclusive pixel boxes: the rectangle spans the outer pixel edges.
        ax.add_patch(patches.Rectangle((x1 - 0.5, y1 - 0.5), x2 - x1 + 1, y2 - y1 + 1, fill=False,
                                       # Earlier boxes are thicker, so identical
                                       # boxes of several phrases stay visible.
                                       edgecolor=colour,
                                       linewidth=2.0 + 2.0 * (count - 1 - index) if thicker_first else 2.5))
    ax.set_title(title, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])


def _coloured_caption(fig, renderer, words, word_colours, left, top, width, fontsize=11):
    """Writes words left to right from (left, top) in figure coordinates, wrapping at `width`."""
    x, y = left, top
    fig_width = fig.get_window_extent(renderer).width
    line_height = None
    for word, colour in zip(words, word_colours):
        text = fig.text(x, y, word + " ", color=colour or "black", fontsize=fontsize, va="top", ha="left",
                        fontweight="bold" if colour else "normal")
        extent = text.get_window_extent(renderer)
        line_height = line_height or extent.height / fig.get_window_extent(renderer).height
        advance = extent.width / fig_width
        if x + advance > left + width and x > left:
            x, y = left, y - 1.3 * line_height
            text.set_position((x, y))
        x += advance


def draw_image_figure(image: np.ndarray, captions: list[dict], out_path: str | os.PathLike, *,
                      title: str = "") -> pathlib.Path:
    """Writes one PNG: a row per caption (prediction | ground truth, caption underneath).

    `captions` items: ``words`` (list of str), ``phrases``: list of dicts with
    ``first_word_index``, ``num_words``, ``pred_box`` (4,), ``gt_boxes`` (k, 4).
    """
    # matplotlib only once a figure is drawn, not at import or --help; the Agg backend is
    # selected here, before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(1, len(captions))
    aspect = image.shape[0] / image.shape[1]
    panel = 3.6
    row_height = panel * aspect + 1.2
    header = 0.6
    fig = plt.figure(figsize=(2 * panel + 0.4, rows * row_height + header), dpi=100)
    renderer = fig.canvas.get_renderer()
    if title:
        fig.suptitle(title, fontsize=11, y=1 - 0.08 / (rows * row_height + header))
    total = rows * row_height + header
    for row, caption in enumerate(captions):
        top = 1 - (header + row * row_height) / total
        panel_height = panel * aspect / total
        axes = [fig.add_axes([0.03 + col * 0.49, top - panel_height - 0.02 / rows, 0.45, panel_height])
                for col in range(2)]
        word_colours = [None] * len(caption["words"])
        pred, truth = [], []
        for index, phrase in enumerate(caption["phrases"]):
            colour = PHRASE_COLOURS[index % len(PHRASE_COLOURS)]
            start = phrase["first_word_index"]
            for w in range(start, min(start + phrase["num_words"], len(word_colours))):
                word_colours[w] = colour
            pred.append((phrase["pred_box"], colour))
            truth.extend((box, colour) for box in np.asarray(phrase["gt_boxes"]).reshape(-1, 4))
        _draw_boxes(axes[0], image, pred, "prediction (best-scoring proposal)", thicker_first=True)
        _draw_boxes(axes[1], image, truth, "ground truth")
        _coloured_caption(fig, renderer, caption["words"], word_colours, 0.04,
                          top - panel_height - 0.05 / rows, 0.92)
    out_path = pathlib.Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    plt.close(fig)
    return out_path


# ---------------------------------------------------------------------------- the command


def draw_region_phrase(data_dir, out_dir, scorer: Scorer, *, image_ids: Sequence[str] | None = None,
                      num_images: int = 4, split: str = "test", images_dir=None, proposals_path=None,
                      max_captions: int | None = None) -> list[pathlib.Path]:
    """Scores and draws the chosen images; returns the written PNG paths (one per image).

    The data folder is resolved once (`tf_twobranch.data.layout.resolve_dataset`,
    with `images_dir` and `proposals_path`). Images: `image_ids`, else the
    first `num_images` of ``<data_dir>/<split>.txt``. Only phrases with a
    ground-truth box are drawn (the evaluation protocol).
    """
    layout = resolve_dataset(dataset_folder(data_dir, flag="--data_dir"), images_dir=images_dir,
                             proposals=proposals_path)
    if not image_ids:
        if num_images < 1:
            raise ConfigError(f"num_images must be positive, got {num_images}")
        image_ids = layout.split_ids(split)[:num_images]
    image_ids = [str(i) for i in image_ids]
    proposals = read_proposals(layout.proposals or layout.root / PROPOSALS_FILE_NAME, image_ids)
    layout.require("entities", purpose="drawing phrase localization")
    images = read_entities_dataset(layout.entities_dir, image_ids)
    out_dir = pathlib.Path(out_dir)
    written = []
    for image in images:
        image_path = layout.image_path(image.image_id)
        pixels = load_image(image_path)
        examples, _ = phrase_examples_from_images([image])
        by_sentence: dict[int, list] = {}
        for example in examples:
            by_sentence.setdefault(example.sentence_index, []).append(example)
        sentence_indices = sorted(by_sentence)[:max_captions] if max_captions else sorted(by_sentence)
        if not sentence_indices:
            logging.warning("Image %s has no phrase with a ground-truth box; skipped", image.image_id)
            continue
        boxes = np.asarray(proposals[image.image_id], np.float32)
        flat = [e for s in sentence_indices for e in by_sentence[s]]
        scores = scorer(image_path.read_bytes(), boxes, [e.phrase for e in flat])
        best = np.argmax(scores, axis=1)
        captions, k = [], 0
        for s in sentence_indices:
            sentence = image.sentences[s]
            phrases = []
            for example in by_sentence[s]:
                phrase = sentence.phrases[example.phrase_index]
                phrases.append({"first_word_index": phrase.first_word_index, "num_words": phrase.num_words,
                                "pred_box": boxes[best[k]], "gt_boxes": example.gt_boxes})
                k += 1
            captions.append({"words": sentence.words, "phrases": phrases})
        written.append(draw_image_figure(pixels, captions, figure_path(out_dir, "two_branch_draw", image.image_id),
                                         title=f"image {image.image_id}"))
        logging.info("Wrote %s", written[-1])
    return written


