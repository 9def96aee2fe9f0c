r"""Fig. 2-style pictures of the two-branch region–phrase model: phrases localized by ranked proposals (TPAMI 2018).

For each chosen test image, one PNG (``<out_dir>/region_phrase_<image id>.png``): for every caption (one row each), the
left panel shows each phrase's best-scoring proposal and the right panel the
phrase's ground-truth box(es), in matching colours; the caption is written
underneath with every localized phrase in the colour of its boxes.

Scores come from a region–phrase SavedModel written by
`tf_twobranch.systems.two_branch.region_phrase_export.export_region_phrase_model`
(``--saved_model``), or from a phrase-localization run directory
(``--run_dir`` alone: the run's ``results.json`` records the backbone, the
fitted phrase encoder and the dataset that made its features;
``--backbone``/``--backbone_weights``/``--text_encoder``/``--data_dir``
override them). A phrase-localization run's own export
(``--saved_model=<run>/export``) is such a SavedModel and names its dataset
too.

The data folder has the Flickr30K Entities layout (``Sentences/``,
``Annotations/``, ``<split>.txt``), the images (``images/<id>.jpg`` unless
``--images_dir``; found as every experiment finds them,
`tf_twobranch.data.layout`) and the proposals (``proposals.h5`` unless
``--proposals``); by default the embedded digit-scene dataset.

Example::

    python -m experiments.two_branch_draw --saved_model=/tmp/pl_export \
        --num_images=4 --out_dir=/tmp/fig2
"""
from __future__ import annotations

import json
import pathlib

from absl import app, flags

from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.errors import UserInputError
from tf_twobranch.figures import wrote_message
from tf_twobranch.systems.two_branch.region_phrase_figures import (  # noqa: F401  (re-exported)
    PHRASE_COLOURS, Scorer, draw_image_figure, draw_region_phrase, python_scorer,  # noqa: F401
    saved_model_scorer)
from tf_twobranch.run_folders import require_run_task

# Unlike the training experiments, this module imports no TensorFlow, scikit-learn or
# matplotlib at start-up (--help takes ~0.5 s, not ~7 s): the functions that need them do.

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("data_dir", None, "Flickr30K Entities-layout folder; default: the embedded dataset.")
    flags.DEFINE_string("out_dir", None, "Where the PNGs go (one per image, region_phrase_<image id>.png).")
    flags.DEFINE_string("saved_model", None, "Region-phrase SavedModel (export_region_phrase_model).")
    flags.DEFINE_string("run_dir", None, "Trained run directory (alternative to --saved_model).")
    flags.DEFINE_string("backbone", None, "With --run_dir: backbone name (see build_backbone); "
                        "default: the one the run recorded.")
    flags.DEFINE_string("backbone_weights", None, "With --run_dir: local backbone weights file; "
                        "default: the one the run recorded.")
    flags.DEFINE_string("text_encoder", None, "With --run_dir: the fitted text encoder .npz; "
                        "default: the one the run recorded.")
    flags.DEFINE_list("image_ids", None, "Image ids to draw (default: the first --num_images of --split).")
    flags.DEFINE_integer("num_images", 4, "Number of images when --image_ids is not given.")
    flags.DEFINE_string("split", "test", "Split file <data_dir>/<split>.txt to take images from.")
    flags.DEFINE_string("images_dir", None, "Image folder (default <data_dir>/images, "
                        "<data_dir>/flickr30k-images or <data_dir>).")
    flags.DEFINE_string("proposals", None, "Proposals file (default <data_dir>/proposals.h5).")
    flags.DEFINE_integer("max_captions", None, "Draw at most this many captions per image.")


def _run_inputs(run) -> dict:
    """The backbone, phrase encoder and dataset a phrase-localization run recorded in its results.json."""
    inputs = (run.results or {}).get("inputs")
    if inputs:
        return inputs
    if FLAGS.text_encoder and FLAGS.backbone:
        return {"backbone": None, "backbone_weights": None, "text_encoder": None, "dataset_dir": None}
    raise UserInputError(f"{run.run_dir}: its results.json records no inputs (written by an older "
                         "version?); pass --backbone, --backbone_weights and --text_encoder")


def _export_inputs(saved_model_dir) -> dict:
    """The dataset a phrase-localization run's export was trained on (its assets.extra/run_config.json)."""
    config_path = pathlib.Path(saved_model_dir) / "assets.extra" / "run_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        config = {}
    return {"dataset_dir": (config.get("inputs") or {}).get("dataset_dir")}


def _main() -> None:
    if not FLAGS.out_dir:
        raise app.UsageError("--out_dir is required")
    if bool(FLAGS.saved_model) == bool(FLAGS.run_dir):
        raise app.UsageError("give exactly one of --saved_model and --run_dir")
    try:
        if FLAGS.saved_model:
            scorer = saved_model_scorer(FLAGS.saved_model)
        else:
            # Only the --run_dir path needs load_run (it imports TensorFlow).
            require_run_task(FLAGS.run_dir, "two_branch_region_phrase", "experiments.two_branch_draw")
            from tf_twobranch.runs import load_run
            run = load_run(FLAGS.run_dir)
            inputs = _run_inputs(run)
            scorer = python_scorer(run.model, FLAGS.backbone or inputs["backbone"],
                                   FLAGS.backbone_weights or inputs["backbone_weights"],
                                   FLAGS.text_encoder or inputs["text_encoder"])
        if FLAGS.saved_model:
            inputs = _export_inputs(FLAGS.saved_model)
        data_dir = FLAGS.data_dir or inputs["dataset_dir"]   # None: the embedded dataset
        paths = draw_region_phrase(data_dir, FLAGS.out_dir, scorer, image_ids=FLAGS.image_ids,
                                  num_images=FLAGS.num_images, split=FLAGS.split, images_dir=FLAGS.images_dir,
                                  proposals_path=FLAGS.proposals, max_captions=FLAGS.max_captions)
    except UserInputError as err:
        raise app.UsageError(str(err)) from None
    print(wrote_message(paths, FLAGS.out_dir))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
