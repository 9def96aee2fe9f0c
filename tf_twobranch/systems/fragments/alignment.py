"""Fragment alignment pictures of the deep fragment embeddings (Karpathy et al., NIPS 2014, Figs. 4-5).

The model scores every image fragment i against every sentence fragment j
(vᵢᵀsⱼ); the picture shows, for each sentence fragment (a dependency
triplet), the image fragment it scores highest with: the fragment's box in
the triplet's colour, numbered, and a legend beside the image listing
``amod(seven, red) 1.30`` as the paper writes it. Optionally (the paper's
Fig. 4) the image's top retrieved sentences are listed under it, green when
they describe the image and red otherwise.

`best_image_fragments` is a pure function of an already computed (M, F)
score matrix; `draw_fragment_alignment` draws with matplotlib (Agg backend,
imported only when a figure is drawn) and writes the PNG atomically.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import textwrap
from typing import Sequence

import numpy as np
from absl import logging

from tf_twobranch.data.formats.row_arrays import temp_beside
from tf_twobranch.errors import UserInputError
from tf_twobranch.figures import figure_path

__all__ = ["RankedSentence", "best_image_fragments", "triplet_label", "draw_fragment_alignment",
           "FRAGMENT_COLOURS", "draw_row_alignments"]

# Distinct, saturated colours (matplotlib's tab10 without grey, as the localization pictures).
FRAGMENT_COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#e377c2", "#8c564b",
                    "#bcbd22")
CORRECT_COLOUR, WRONG_COLOUR = "#1a7f1a", "#c62828"
DISPLAY_SIZE = 384        # pixels of the image's longer side: the embedded 96×96 scenes upscaled 4×
_DPI = 100
_LINE = 0.25              # inches per text line


@dataclasses.dataclass(frozen=True)
class RankedSentence:
    """A retrieved sentence of the Fig. 4 view: its text, whether it describes the image, its S_kl."""

    text: str
    correct: bool
    score: float


def best_image_fragments(fragment_scores, image_mask=None, sentence_mask=None) -> tuple[np.ndarray, np.ndarray]:
    """For each sentence fragment j, the image fragment i maximising vᵢᵀsⱼ and that score.

    Args:
      fragment_scores: (M, F) scores vᵢᵀsⱼ of one image's M fragments and one sentence's F fragments.
      image_mask: (M,) bool, the image's real fragments (default all); padded ones are never chosen.
      sentence_mask: (F,) bool, the sentence's real fragments (default all).
    Returns:
      ``best`` (F,) int64 image fragment indices, ``scores`` (F,) float32; a padded sentence
      fragment gets -1 and NaN. Ties go to the lower index (the whole image first).
    """
    scores = np.asarray(fragment_scores, np.float32)
    if scores.ndim != 2:
        raise UserInputError(f"fragment scores must be an (image fragments, sentence fragments) matrix, "
                             f"got shape {scores.shape}")
    m, f = scores.shape
    image_mask = np.ones(m, bool) if image_mask is None else np.asarray(image_mask, bool)
    sentence_mask = np.ones(f, bool) if sentence_mask is None else np.asarray(sentence_mask, bool)
    if image_mask.shape != (m,) or sentence_mask.shape != (f,):
        raise UserInputError(f"masks must be ({m},) and ({f},) for scores of shape {scores.shape}, got "
                             f"{image_mask.shape} and {sentence_mask.shape}")
    best = np.full(f, -1, np.int64)
    best_scores = np.full(f, np.nan, np.float32)
    if not sentence_mask.any():
        return best, best_scores
    if not image_mask.any():
        raise UserInputError("the image mask marks no image fragment: nothing to align the sentence fragments to")
    masked = np.where(image_mask[:, None], scores, -np.inf)
    choice = np.argmax(masked, axis=0)
    best[sentence_mask] = choice[sentence_mask]
    best_scores[sentence_mask] = masked[choice, np.arange(f)][sentence_mask]
    return best, best_scores


def triplet_label(relation: str, word1: str, word2: str) -> str:
    """A sentence fragment as the paper writes it: ``amod(seven, red)``; a word (BOW) or a bigram as such."""
    if relation == "bow":
        return word1
    if relation == "bigram":
        return f"{word1} {word2}"
    return f"{relation}({word1}, {word2})"


def _check_inputs(image, boxes, triplet_labels, best, scores):
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8 or min(image.shape[:2]) < 1:
        raise UserInputError(f"the image must be an (H, W, 3) uint8 array, got shape {image.shape} "
                             f"and dtype {image.dtype}")
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4) if np.size(boxes) else np.zeros((0, 4), np.float32)
    best = np.asarray(best, np.int64).reshape(-1)
    scores = np.asarray(scores, np.float32).reshape(-1)
    if not len(triplet_labels) == len(best) == len(scores):
        raise UserInputError(f"one label, best image fragment and score per sentence fragment: got "
                             f"{len(triplet_labels)} labels, {len(best)} indices and {len(scores)} scores")
    if best.size and (best.min() < -1 or best.max() >= len(boxes)):
        raise UserInputError(f"best image fragment indices must be in [0, {len(boxes) - 1}] (or -1 for "
                             f"padding), got {best.min()}..{best.max()}")
    return image, boxes, list(triplet_labels), best, scores


def _score_text(score: float) -> str:
    return f"{score:.2f}" if abs(score) < 1000 else f"{score:.3g}"


def _write_png_atomically(fig, out_path: pathlib.Path) -> pathlib.Path:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # A reader (or an interrupted run) never sees half a PNG: written whole beside it, then renamed.
    tmp = temp_beside(out_path)
    try:
        fig.savefig(tmp, format="png", dpi=_DPI)
        os.replace(tmp, out_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out_path


def draw_fragment_alignment(image, boxes, triplet_labels: Sequence[str], best, scores,
                            out_path: str | os.PathLike, *, title: str | None = None,
                            sentences: Sequence[RankedSentence] | None = None,
                            display_size: int = DISPLAY_SIZE) -> pathlib.Path:
    """Writes one PNG: the image with each sentence fragment's best image fragment boxed.

    Args:
      image: (H, W, 3) uint8 pixels.
      boxes: (M, 4) inclusive pixel boxes ``x1, y1, x2, y2`` of the image fragments (0: the whole image).
      triplet_labels: one label per sentence fragment (`triplet_label`).
      best, scores: (F,) from `best_image_fragments`; fragments with ``best == -1`` are left out.
      title: drawn above (e.g. the image id and the aligned sentence), wrapped to the figure's width.
      sentences: the Fig. 4 view, the image's top retrieved sentences listed under the image.
      display_size: pixels of the image's longer side in the PNG (upscaled, nearest neighbour).
    Returns:
      The written path.
    """
    image, boxes, labels, best, scores = _check_inputs(image, boxes, triplet_labels, best, scores)
    # matplotlib only once a figure is drawn, not at import; Agg before pyplot: PNG files only.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt
    from matplotlib.transforms import offset_copy

    shown = [j for j in range(len(labels)) if best[j] >= 0]
    height, width = image.shape[:2]
    scale = display_size / max(height, width)
    image_w, image_h = width * scale / _DPI, height * scale / _DPI
    legend_w, margin = 4.4, 0.2
    fig_w = margin + image_w + 0.25 + legend_w + margin
    title_lines = textwrap.wrap(title, width=max(20, int(fig_w * 11))) if title else []
    title_h = (len(title_lines) + 0.6) * _LINE if title_lines else margin
    legend_h = (max(1, len(shown)) + 1) * _LINE
    body_h = max(image_h, legend_h)
    sentences = list(sentences or [])
    sentences_h = (len(sentences) + 1.5) * _LINE if sentences else 0.0
    fig_h = title_h + body_h + sentences_h + margin
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=_DPI)
    try:
        if title_lines:
            fig.text(margin / fig_w, 1 - 0.3 * _LINE / fig_h, "\n".join(title_lines), ha="left", va="top",
                     fontsize=10, fontweight="bold")
        body_top = fig_h - title_h
        ax = fig.add_axes([margin / fig_w, (body_top - image_h) / fig_h, image_w / fig_w, image_h / fig_h])
        ax.imshow(image, interpolation="nearest")
        ax.set_xlim(-0.5, width - 0.5)
        ax.set_ylim(height - 0.5, -0.5)
        ax.set_xticks([])
        ax.set_yticks([])
        colours = {j: FRAGMENT_COLOURS[rank % len(FRAGMENT_COLOURS)] for rank, j in enumerate(shown)}
        numbers = {j: rank + 1 for rank, j in enumerate(shown)}
        chosen_by: dict[int, list[int]] = {}
        for j in shown:
            chosen_by.setdefault(int(best[j]), []).append(j)
        for box_index, choosers in chosen_by.items():
            x1, y1, x2, y2 = (float(v) for v in boxes[box_index])
            x1, y1 = max(x1, 0.0), max(y1, 0.0)
            x2, y2 = min(x2, width - 1.0), min(y2, height - 1.0)
            # One rectangle per chosen image fragment, in the colour of the fragment that scores
            # highest with it; every fragment that chose it has a numbered tag in its corner
            # (nested rectangles, one per fragment, bury the image when many pick the whole
            # image). Inclusive pixel boxes span the outer pixel edges; the line sits just
            # inside them, so the whole-image box is not hidden under the frame.
            inset = 1.25 / scale
            top = max(choosers, key=lambda j: scores[j])
            ax.add_patch(patches.Rectangle((x1 - 0.5 + inset, y1 - 0.5 + inset), max(x2 - x1 + 1 - 2 * inset, 0.5),
                                           max(y2 - y1 + 1 - 2 * inset, 0.5), fill=False, edgecolor=colours[top],
                                           linewidth=2.5))
            box_dots = max((x2 - x1 + 1) * scale, 1.0)
            dx = dy = 0.0
            for j in choosers:
                tag_dots = 7.0 * len(str(numbers[j])) + 7.0
                if dx and dx + tag_dots > box_dots:
                    dx, dy = 0.0, dy - 14.0
                ax.text(x1 - 0.5, y1 - 0.5, str(numbers[j]), fontsize=8, color="white", fontweight="bold",
                        ha="left", va="top", clip_on=True,
                        bbox=dict(boxstyle="square,pad=0.15", facecolor=colours[j], edgecolor="none"),
                        transform=offset_copy(ax.transData, fig=fig, x=dx + 2.0, y=dy - 2.0, units="dots"))
                dx += tag_dots
        legend_left = (margin + image_w + 0.25) / fig_w
        y = body_top - 0.5 * _LINE
        if not shown:
            fig.text(legend_left, y / fig_h, "(the sentence has no fragment left after filtering)",
                     fontsize=9, color="dimgray", va="center")
        for rank, j in enumerate(shown):
            colour = FRAGMENT_COLOURS[rank % len(FRAGMENT_COLOURS)]
            where = "whole image" if best[j] == 0 else f"box {best[j]}"
            fig.text(legend_left, y / fig_h, f" {rank + 1} ", fontsize=9, color="white", fontweight="bold",
                     va="center", bbox=dict(boxstyle="square,pad=0.15", facecolor=colour, edgecolor="none"))
            fig.text(legend_left + 0.38 / fig_w, y / fig_h, f"{labels[j]}  {_score_text(scores[j])}", fontsize=10,
                     color=colour, fontweight="bold", va="center")
            fig.text(1 - margin / fig_w, y / fig_h, where, fontsize=8, color="dimgray", va="center", ha="right")
            y -= _LINE
        if sentences:
            y = body_top - body_h - 0.6 * _LINE
            fig.text(margin / fig_w, y / fig_h, f"Top {len(sentences)} retrieved sentences (S_kl):",
                     fontsize=9, color="dimgray", va="center")
            limit = max(30, int(fig_w * 12.5))
            for k, sentence in enumerate(sentences):
                y -= _LINE
                text = sentence.text if len(sentence.text) <= limit else sentence.text[:limit - 1] + "…"
                fig.text(margin / fig_w, y / fig_h, f"{k + 1}. {text}   ({_score_text(sentence.score)})", fontsize=9,
                         color=CORRECT_COLOUR if sentence.correct else WRONG_COLOUR, va="center")
        return _write_png_atomically(fig, pathlib.Path(out_path))
    finally:
        plt.close(fig)


def _chosen_images(image_ids: Sequence[str], image_indices: Sequence[int] | None,
                   chosen_ids: Sequence[str] | None, split: str) -> list[int]:
    """Indices into the split's images of `chosen_ids`, else of `image_indices` (default: the first)."""
    if chosen_ids:
        index = {image_id: n for n, image_id in enumerate(image_ids)}
        missing = [i for i in chosen_ids if str(i) not in index]
        if missing:
            raise UserInputError(f"image {missing[0]!r} is not in the row's {split} split "
                                 f"({len(image_ids)} images, e.g. {', '.join(image_ids[:3])})")
        return [index[str(i)] for i in chosen_ids]
    indices = [0] if image_indices is None else [int(i) for i in image_indices]
    for n in indices:
        if not 0 <= n < len(image_ids):
            raise UserInputError(f"image index {n} is out of range: the row's {split} split has "
                                 f"{len(image_ids)} images (indices 0..{len(image_ids) - 1})")
    return indices


def draw_row_alignments(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                   image_indices: Sequence[int] | None = None, image_ids: Sequence[str] | None = None,
                   sentence: int = 0, top_sentences: int = 0, align_top_sentence: bool = False,
                   proposals: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Draws the fragment alignment of the chosen evaluation images; returns the PNG paths (one per image).

    Args:
      run_dir: a finished row's run folder (`experiments.fragments`; `experiments.fragments_draw`
        checks it is one).
      image_indices, image_ids: the images of the row's evaluation split (by position or by id;
        default the first).
      sentence: which of each image's sentences is aligned (0-based).
      top_sentences: also list the image's top this many retrieved evaluation sentences.
      align_top_sentence: align the top retrieved sentence instead (needs `top_sentences`).
      proposals: the proposals file of the boxes, instead of the one the row used.
    """
    run_dir = pathlib.Path(run_dir)
    if sentence < 0:
        raise UserInputError(f"--sentence must be >= 0, got {sentence}")
    if top_sentences < 0:
        raise UserInputError(f"--top_sentences must be >= 0, got {top_sentences}")
    if align_top_sentence and not top_sentences:
        raise UserInputError("--align_top_sentence aligns the top retrieved sentence: give --top_sentences >= 1")
    # TensorFlow, the row and its data: only now (the draw tool's --help stays fast).
    from tf_twobranch.data.formats.images import load_image
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.systems.fragments.retrieval import fragment_score_fn
    from tf_twobranch.systems.fragments.image_fragments import fragment_boxes
    from tf_twobranch.systems.fragments.features import FragmentImages
    from tf_twobranch.features.prepare_regions import read_split_proposals
    from tf_twobranch.systems.fragments.losses import fragment_scores
    from tf_twobranch.systems.fragments import pipeline

    run = pipeline.load_fragment_run(run_dir)
    model, f = run.model, pipeline.FragmentRecipe.from_record(run.config, str(run.run_dir / "run_config.json"))
    source, _, caption_splits, images, text = pipeline.load_data(f)
    if model.config.representation != "fragments":
        raise UserInputError(f"{run_dir}: a {model.config.representation} row embeds whole images and "
                             "sentences, not fragments: there is nothing to align")
    split = f.eval_split
    corpus, split_images, fragments = caption_splits[split], images[split], text.splits[split]
    chosen = _chosen_images(split_images.image_ids, image_indices, image_ids, split)
    layout = resolve_dataset(source, caption_format=f.caption_format, images_dir=f.images_dir or None,
                             proposals=proposals or f.proposals or None)
    if f.fragment_features and not proposals:
        raise UserInputError(f"{run_dir}: the row was trained on precomputed --fragment_features, whose boxes "
                             "it does not know: pass --proposals=<the ranked boxes those features were "
                             "computed from>")
    if f.detections and layout.proposals is None:
        raise UserInputError(f"{layout.root}: no proposals file to draw the image fragments' boxes: pass --proposals")

    one = FragmentImages([split_images.image_ids[n] for n in chosen], split_images.inputs[chosen],
                         split_images.mask[chosen], split_images.head)
    v, v_mask, s, row_splits = model.embed_split(pipeline.image_inputs(one, model.config), one.mask, fragments)
    words, relations = text.word_vectors.words, text.relations
    out_dir = pathlib.Path(out_dir)
    written = []
    for k, n in enumerate(chosen):
        image_id = split_images.image_ids[n]
        own = np.flatnonzero(corpus.caption_image == n)
        if sentence >= len(own):
            raise UserInputError(f"--sentence={sentence} is out of range: image {image_id} has {len(own)} "
                                 f"sentences (0..{len(own) - 1})")
        ranked = []
        aligned = int(own[sentence])
        if top_sentences:
            global_scores = fragment_score_fn(v[k:k + 1], v_mask[k:k + 1], s, row_splits,
                                              **model.config.score_options())(0, len(row_splits) - 1)[0]
            order = np.argsort(-global_scores, kind="stable")[:top_sentences]
            ranked = [RankedSentence(corpus.captions[l], bool(corpus.caption_image[l] == n),
                                     float(global_scores[l])) for l in order]
            if align_top_sentence:
                aligned = int(order[0])
        start, stop = int(row_splits[aligned]), int(row_splits[aligned + 1])
        scores = np.asarray(fragment_scores(v[k:k + 1], s[None, start:stop]))[0, :, 0, :]
        best, best_scores = best_image_fragments(scores, v_mask[k])
        labels = [triplet_label(relations[r], words[a], words[b])
                  for r, a, b in zip(fragments.relation[start:stop], fragments.word1[start:stop],
                                     fragments.word2[start:stop])]

        pixels = load_image(layout.image_paths([image_id], file_names=getattr(corpus, "file_names", None),
                                                source=corpus.source)[0])
        boxes = fragment_boxes(read_split_proposals(layout.proposals, [image_id], f.detections)[image_id]
                               if f.detections else np.zeros((0, 4), np.float32),
                               pixels.shape[0], pixels.shape[1], f.detections)
        if np.any(v_mask[k, len(boxes):]):
            raise UserInputError(f"{layout.proposals}: image {image_id} has {len(boxes) - 1} proposals but the "
                                 f"row's features have {int(v_mask[k].sum())} fragments: not the proposals "
                                 "the row was trained with")
        whose = "top retrieved" if aligned not in own else f"sentence {list(own).index(aligned)}"
        title = f"{split} image {image_id} ({n}), {whose}: \"{corpus.captions[aligned]}\""
        written.append(draw_fragment_alignment(pixels, boxes, labels, best, best_scores,
                                               figure_path(out_dir, "fragments_draw", image_id),
                                               title=title, sentences=ranked))
        logging.info("Wrote %s", written[-1])
    return written
