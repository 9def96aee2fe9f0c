r"""Fragment alignment pictures of a deep-fragment-embedding row (Karpathy et al., NIPS 2014, Figs. 4-5).

For each chosen evaluation image, one PNG (``<out_dir>/fragments_<image id>.png``): the image (upscaled) with, for
every sentence fragment of one of its sentences (``--sentence``), the image
fragment that scores highest with it (vᵢᵀsⱼ) boxed in the fragment's colour,
and a legend listing the triplets with their scores (``amod(seven, red)
1.30``). Image fragment 0 is the whole image, 1..19 the top-ranked proposals
the row was trained with. With ``--top_sentences=k`` the image's top k
retrieved sentences (S_kl over every evaluation sentence) are listed under
it, green when they describe the image and red otherwise (the paper's
Fig. 4); ``--align_top_sentence`` then aligns the top retrieved sentence
instead of the image's own, as the paper's figure does.

The row is rebuilt from its run folder alone (`tf_twobranch.systems.
fragments.pipeline`: the last stage's model and checkpoint, and from its
recorded recipe the cached fragment features); the boxes come from the
proposals file the row used (or ``--proposals``).

Example::

    python -m experiments.draw_fragments --run_dir=runs/karpathy_table2_fragment_global_mil \
        --out_dir=figures --image_index=0,1,2 --top_sentences=5
"""
from __future__ import annotations

import os
import pathlib
from typing import Sequence

import numpy as np
from absl import app, flags, logging

from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.errors import UserInputError
from tf_twobranch.figures import figure_path, wrote_message
from tf_twobranch.systems.fragments.alignment import (RankedSentence, best_image_fragments,
                                                        draw_fragment_alignment, triplet_label)
from tf_twobranch.run_folders import require_run_task

# Like draw_localization, this module imports no TensorFlow at start-up (--help stays fast):
# the row is loaded, and TensorFlow imported, only when pictures are drawn.

FLAGS = flags.FLAGS


def _check_run_dir(run_dir: pathlib.Path) -> None:
    if not run_dir.is_dir():
        raise UserInputError(f"--run_dir={run_dir}: folder does not exist")
    require_run_task(run_dir, "fragment_embeddings", "experiments.draw_fragments")
    if not (run_dir / "results.json").is_file():
        raise UserInputError(f"{run_dir}: no results.json; expected the run folder of a finished row of "
                             "python -m experiments.fragment_embeddings (it writes results.json at the end)")


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


def draw_fragments(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                   image_indices: Sequence[int] | None = None, image_ids: Sequence[str] | None = None,
                   sentence: int = 0, top_sentences: int = 0, align_top_sentence: bool = False,
                   proposals: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Draws the fragment alignment of the chosen evaluation images; returns the PNG paths (one per image).

    Args:
      run_dir: a finished row's run folder (`experiments.fragment_embeddings`).
      image_indices, image_ids: the images of the row's evaluation split (by position or by id;
        default the first).
      sentence: which of each image's sentences is aligned (0-based).
      top_sentences: also list the image's top this many retrieved evaluation sentences.
      align_top_sentence: align the top retrieved sentence instead (needs `top_sentences`).
      proposals: the proposals file of the boxes, instead of the one the row used.
    """
    run_dir = pathlib.Path(run_dir)
    _check_run_dir(run_dir)
    if sentence < 0:
        raise UserInputError(f"--sentence must be >= 0, got {sentence}")
    if top_sentences < 0:
        raise UserInputError(f"--top_sentences must be >= 0, got {top_sentences}")
    if align_top_sentence and not top_sentences:
        raise UserInputError("--align_top_sentence aligns the top retrieved sentence: give --top_sentences >= 1")
    # TensorFlow, the row and its data: only now (see the note at the imports).
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
                                               figure_path(out_dir, "draw_fragments", image_id),
                                               title=title, sentences=ranked))
        logging.info("Wrote %s", written[-1])
    return written


def define_flags() -> None:
    flags.DEFINE_string("run_dir", None, "Run folder of a finished experiments.fragment_embeddings row.")
    flags.DEFINE_string("out_dir", None, "Where the PNGs go (one per image, fragments_<image id>.png).")
    flags.DEFINE_list("image_index", None, "Positions of the images in the row's evaluation split "
                      "(default: 0).")
    flags.DEFINE_list("image_id", None, "Image ids of the row's evaluation split (instead of --image_index).")
    flags.DEFINE_integer("sentence", 0, "Which of each image's sentences is aligned (0-based).")
    flags.DEFINE_integer("top_sentences", 0, "Also list the image's top this many retrieved evaluation "
                         "sentences, green if correct, red otherwise (the paper's Fig. 4).")
    flags.DEFINE_bool("align_top_sentence", False, "Align the top retrieved sentence instead of the "
                      "image's own (the paper's Fig. 4; needs --top_sentences).")
    flags.DEFINE_string("proposals", None, "Proposals file of the boxes (default: the one the row used).")


def _image_indices(values) -> list[int] | None:
    if values is None:
        return None
    try:
        return [int(v) for v in values]
    except ValueError:
        raise UserInputError(f"--image_index takes integers, got {','.join(values)}") from None


def _main() -> None:
    if not FLAGS.run_dir or not FLAGS.out_dir:
        raise app.UsageError("--run_dir and --out_dir are required")
    if FLAGS.image_index is not None and FLAGS.image_id is not None:
        raise app.UsageError("give at most one of --image_index and --image_id")
    paths = draw_fragments(FLAGS.run_dir, FLAGS.out_dir, image_indices=_image_indices(FLAGS.image_index),
                           image_ids=FLAGS.image_id, sentence=FLAGS.sentence, top_sentences=FLAGS.top_sentences,
                           align_top_sentence=FLAGS.align_top_sentence, proposals=FLAGS.proposals)
    print(wrote_message(paths, FLAGS.out_dir))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
