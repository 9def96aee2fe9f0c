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

    python -m experiments.fragments_draw --run_dir=runs/fragments_table2_fragment_global_mil \
        --out_dir=figures --image_index=0,1,2 --top_sentences=5
"""
from __future__ import annotations

import os
import pathlib

from absl import app, flags

from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.errors import UserInputError
from tf_twobranch.figures import wrote_message
from tf_twobranch.systems.fragments.alignment import draw_row_alignments
from tf_twobranch.run_folders import require_run_task

# Like two_branch_draw, this module imports no TensorFlow at start-up (--help stays fast):
# the row is loaded, and TensorFlow imported, only when pictures are drawn.

FLAGS = flags.FLAGS


def _check_run_dir(run_dir: pathlib.Path) -> None:
    if not run_dir.is_dir():
        raise UserInputError(f"--run_dir={run_dir}: folder does not exist")
    require_run_task(run_dir, "fragments", "experiments.fragments_draw")
    if not (run_dir / "results.json").is_file():
        raise UserInputError(f"{run_dir}: no results.json; expected the run folder of a finished row of "
                             "python -m experiments.fragments (it writes results.json at the end)")


def draw_fragments(run_dir: str | os.PathLike, out_dir: str | os.PathLike, **options) -> list[pathlib.Path]:
    """The run folder checked (a finished fragment row), then its alignment pictures
    (`tf_twobranch.systems.fragments.alignment.draw_row_alignments`, which takes `options`)."""
    run_dir = pathlib.Path(run_dir)
    _check_run_dir(run_dir)
    return draw_row_alignments(run_dir, out_dir, **options)


def define_flags() -> None:
    flags.DEFINE_string("run_dir", None, "Run folder of a finished experiments.fragments row.")
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
