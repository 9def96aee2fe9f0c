r"""Image–sentence retrieval with two-branch networks (TPAMI Tables 2 and 3).

    python -m experiments.two_branch_retrieval \
        --flagfile=experiments/configs/two_branch_table2_b6_nonlinear_bidir_nbr_constraints.cfg

With no --dataset_dir the embedded digit-scene dataset is generated (once)
and used. For Flickr30K pass --dataset_dir with results_20130124.token and
the Flickr30K Entities train/val/test.txt (or dataset_flickr30k.json) plus
either --images_dir and --backbone_weights (VGG-19) or precomputed
--image_features_{train,test} / --text_features_{train,test} files.
"""
from __future__ import annotations

import sys

from absl import app, flags

from experiments import common
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.recipes import define_recipe_flags
from tf_twobranch.systems.two_branch import pipeline
from tf_twobranch.systems.two_branch.pipeline import EMBEDDED_PROFILE, RetrievalRecipe, format_record  # noqa: F401
from tf_twobranch.table_runner import flagfile_of, next_command

# The embedded profile (EMBEDDED_PROFILE) and why: tf_twobranch/systems/two_branch/pipeline.py.


def apply_embedded_profile(f) -> dict:
    return common.apply_embedded_profile(f, EMBEDDED_PROFILE)


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """The flags: the fields of `RetrievalRecipe` (`tf_twobranch.recipes.define_recipe_flags`)."""
    define_recipe_flags(RetrievalRecipe, fv)


def recipe(f) -> RetrievalRecipe:
    """The row recipe of parsed flags (built once, in the entry point)."""
    return common.recipe_from_flags(RetrievalRecipe, f)


def load_data(f):
    """`pipeline.load_data` of parsed flags as they are (no profile: e.g. a run's recorded flags)."""
    return pipeline.load_data(recipe(f))


def run(f, flagfile: str | None = None) -> dict:
    """Runs one table row from parsed flags; returns the results record (also written as JSON)."""
    return pipeline.run(recipe(f), common.typed_flags(f), flagfile=flagfile)


def follow_up(record: dict) -> str:
    """What to run next on the row's run folder."""
    run_dir = record.get("run_dir", "")
    commands = []
    if record.get("export_dir"):
        commands.append(f"python -m tf_twobranch.tools.saved_model_cli show --dir {record['export_dir']} --all")
    return next_command(run_dir, *commands, load_run=record["flags"]["model"] != "cca")


def print_record(record: dict) -> None:
    print(format_record(record))
    if "sentence_retrieval" in record:
        s = record["sentence_retrieval"]
        print(f"sentence-to-sentence R@1/5/10: {s['s2s_r1']:.1f} / {s['s2s_r5']:.1f} / "
              f"{s['s2s_r10']:.1f}")
    if record.get("export_dir"):
        inputs = record.get("export_inputs")
        print(f"SavedModel: {record['export_dir']}"
              + (f" (takes {inputs['image']} and {inputs['text']})" if inputs else ""))
        for note in (inputs or {}).get("notes", []):
            print(f"  {note}")


def _main() -> None:
    record = run(flags.FLAGS, flagfile=flagfile_of(sys.argv))
    print_record(record)
    print(follow_up(record))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
