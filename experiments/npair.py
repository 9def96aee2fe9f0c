r"""Semi-supervised phrase localization (Das et al.): Tables 1 and 2.

    python -m experiments.npair --flagfile=experiments/configs/npair_table2_npair_word.cfg
    python -m experiments.npair --rows=all     # every row; prints Table 2 beside the paper

A caption–image retrieval model (spatial image map × per-token caption vectors → localization
volume → S_MaxImage) is trained on captions alone with the N-pair loss (or the triplet loss); no
box is used in training. Each row then reports retrieval through the one evaluation core (Table
1: folds of 100 images, `--protocol`) and the pointing game on the Flickr30K Entities phrases of
the evaluation split (Table 2), in word and phrase parse modes. Baseline rows (`--row_kind`) point at a random pixel, at the image
centre, at the maximum of the backbone map's channel mean, or use the untrained model.

Defaults where the paper is silent are the authors' code's (LocNet): SGD lr 1e-3 × 0.1 every
10 epochs of 100 steps, momentum 0.9, weight decay 1e-7, triplet margin 0.1, LSTM 300 → 1024,
3×3 conv 512 → 1024 + BN + ReLU on VGG-19 ``block5_conv4`` at 224², ``<start>``/``<end>``
tokens, 20 words. Its defects are not reproduced by default (BUILD_NOTES.md): the score's
maximum over rows only (``--aggregator=max_rows_code``), the L2 norms computed but not applied
(``--normalisation=none``), the swapped x/y of its hit test, I_r1 = C_r1.

Memory is bounded by a batch or a chunk: backbone maps (and training images
with --train_backbone) are memory-mapped, the evaluation goes chunk by chunk.
With no --dataset_dir the embedded digit scenes are used (profile below).

The flags become one typed recipe (`NPairRecipe` of `tf_twobranch.systems.npair.pipeline`),
stored in results.json; ``tf_twobranch.runs.load_run(run_dir)`` loads the row again
without flags. Tables and ``--rows`` (the one table runner): `experiments.npair_tables`.
"""
from __future__ import annotations

import sys

from absl import app, flags

from experiments import common, npair_tables
from tf_twobranch.systems.npair.tables import format_record
from tf_twobranch import table_runner
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.recipes import define_recipe_flags
from tf_twobranch.systems.npair import pipeline as npair
from tf_twobranch.systems.npair.pipeline import EMBEDDED_PROFILE, NPairRecipe

# The embedded profile (EMBEDDED_PROFILE) and why: tf_twobranch/systems/npair/pipeline.py.


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """The flags: the fields of `NPairRecipe` (`tf_twobranch.recipes.define_recipe_flags`)."""
    define_recipe_flags(NPairRecipe, fv)


def recipe_from_flags(fv: flags.FlagValues) -> tuple[NPairRecipe, dict]:
    """The row's recipe from its parsed flags (the embedded profile's values where the user typed
    none and gave no --dataset_dir), and the flags the user typed (results.json "typed_flags")."""
    typed = common.typed_flags(fv)
    return common.prepare_recipe(NPairRecipe.from_flags(fv), typed, EMBEDDED_PROFILE)[0], typed


def run(f: flags.FlagValues, flagfile: str | None = None) -> dict:
    """Runs the row of parsed flags `f` (its recipe is built here, once); returns its results record."""
    return npair.run(*recipe_from_flags(f), flagfile=flagfile)


def run_rows(f: flags.FlagValues, argv) -> dict:
    """--rows through `npair_tables.run_rows`: the flags of `argv` not the runner's go to every row."""
    return npair_tables.run_rows(f, argv, define_flags, run)


def _main() -> None:
    f = flags.FLAGS
    if f.rows:
        run_rows(f, sys.argv)
        return
    record = run(f, flagfile=table_runner.flagfile_of(sys.argv))
    print(format_record(record))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")
    print(npair_tables.follow_up(record))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
