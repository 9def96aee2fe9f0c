r"""Dual-path CNN with instance loss (Zheng et al.): Tables 1, 2, 5, 6, 7, 8.

    python -m experiments.dual_path --flagfile=experiments/configs/dual_path_table2_full_model.cfg

Trains from raw pixels and words: Stage I (instance loss only, image
backbone frozen) then Stage II (everything fine-tuned, ranking + instance
loss), each stage in its own run directory (``<run_dir>/stage1``,
``<run_dir>/stage2``) with checkpoints, backups and TensorBoard logs;
``--init_from`` starts a stage from another run's checkpoint.  Evaluates with
the shared retrieval core (cosine, image averaged with its flip), computes
the separability indicator S with its histogram PNG (Fig. 5), and exports
the image tower (JPEG bytes in) and the text tower (raw strings in).

With no --dataset_dir the embedded digit scenes are used (CUHK-PEDES layout
derived from them with --dataset_kind=pedes), with the small profile below.
"""
from __future__ import annotations

import sys

from absl import app, flags

from experiments import common
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.recipes import define_recipe_flags
from tf_twobranch.systems.dual_path import pipeline
from tf_twobranch.systems.dual_path.pipeline import (  # noqa: F401  (re-exported)
    EMBEDDED_PROFILE, PEDES_EMBEDDED_PROFILE, DualPathRecipe, format_record)
from tf_twobranch.table_runner import flagfile_of, next_command

# The embedded profile (EMBEDDED_PROFILE) and why: tf_twobranch/systems/dual_path/pipeline.py.


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """The flags: the fields of `DualPathRecipe` (`tf_twobranch.recipes.define_recipe_flags`)."""
    define_recipe_flags(DualPathRecipe, fv)


def recipe(f) -> DualPathRecipe:
    """The row recipe of parsed flags (built once, in the entry point)."""
    return common.recipe_from_flags(DualPathRecipe, f)


def check_dataset_dir(f) -> None:
    pipeline.check_dataset_dir(recipe(f))


def load_data(f, run_dir):
    """`pipeline.load_data` of parsed flags (the embedded profile is not applied)."""
    return pipeline.load_data(recipe(f), run_dir)


def pretrained_scene_cnn(f, train) -> str:
    """The embedded data's stand-in for an ImageNet backbone (`pipeline.pretrained_scene_cnn`)."""
    return pipeline.pretrained_scene_cnn(recipe(f), train)


def run(f, flagfile: str | None = None) -> dict:
    """Runs one row from parsed flags; returns the results record (also written as JSON)."""
    return pipeline.run(recipe(f), common.typed_flags(f), flagfile=flagfile)


def follow_up(record: dict) -> str:
    """What to run next on the row's run folder (load_run loads its last stage)."""
    commands = []
    if record.get("export_dir"):
        commands.append(f"python -m tf_twobranch.tools.saved_model_cli show --dir {record['export_dir']} --all")
    return next_command(record["run_dir"], *commands, load_run=bool(record["stages"]))


def _main() -> None:
    record = run(flags.FLAGS, flagfile=flagfile_of(sys.argv))
    print(format_record(record))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")
    print(follow_up(record))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
