r"""Deep fragment embeddings (Karpathy, Joulin & Fei-Fei, NIPS 2014): Tables 2 and 3.

    python -m experiments.fragments --flagfile=experiments/configs/fragments_table2_fragment_global_mil.cfg
    python -m experiments.fragments --rows=all          # every row, printed beside the paper

Image fragments (the whole image and its top 19 proposals through the CNN)
and sentence fragments (dependency triplets of the captions' CoNLL-U parses)
are embedded in one space; trained with C_F + β·C_G + α‖θ‖²; evaluated with
S_kl over every test image–sentence pair through the one evaluation core.

Schedule (§3.4): SGD with momentum 0.9, batches of 100 distinct images each
with one random sentence, `--epochs` 20. With `--mil` or `--fine_tune_cnn`
the run has two stages in ``<run_dir>/stage1`` and ``stage2``: the first
`--mil_start` epochs (paper: half; the authors' code: 0.75·epochs) with C_0
and the CNN frozen, the rest with MIL labels and (with `--fine_tune_cnn`)
the CNN's top layer trained. The learning rate drops ×0.1 for the last
`--lr_drop_epochs` epochs. `--init_from` starts from another run's weights.

With `--rows`, each row's flagfile (``fragments_table{2,3}_*.cfg``) runs with the other flags
given here in ``runs/<flagfile stem>`` (as alone; a table resumes: `tf_twobranch.table_runner`),
and the tables are printed beside the paper's numbers; the results go to `--out_json`.

The flags become a `FragmentRecipe` once per row (`recipe_from_flags`); the
data, model configuration, schedule and evaluation are the library's
(`tf_twobranch.systems.fragments.pipeline`), the tables
`experiments.fragments_tables`. A finished row loads with
``tf_twobranch.runs.load_run(run_dir)`` (no absl): its
``model.evaluate(run.evaluation_split())`` gives its results.json metrics.

With no --dataset_dir the embedded digit scenes are used (their
``captions.conllu`` parses, ``proposals.h5`` boxes and the scene CNN) with
the small profile below.
"""
from __future__ import annotations

import sys

from absl import app, flags

from experiments import common, fragments_tables
from tf_twobranch.systems.fragments.tables import format_record
from tf_twobranch import table_runner
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.recipes import define_recipe_flags
from tf_twobranch.systems.fragments import pipeline
from tf_twobranch.systems.fragments.pipeline import EMBEDDED_PROFILE, FragmentRecipe

# The embedded profile (EMBEDDED_PROFILE) and why: tf_twobranch/systems/fragments/pipeline.py.


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """The flags: the fields of `FragmentRecipe` (`tf_twobranch.recipes.define_recipe_flags`)."""
    define_recipe_flags(FragmentRecipe, fv)


def recipe_from_flags(f) -> tuple[FragmentRecipe, dict]:
    """The row's recipe (its flags' values, the embedded profile applied) and the flags the user typed."""
    typed = common.typed_flags(f)
    return common.prepare_recipe(FragmentRecipe.from_flags(f), typed, EMBEDDED_PROFILE)[0], typed


def run(f, flagfile: str | None = None) -> dict:
    """Runs one table row of the flags `f` (its recipe is built here, once); returns its results record."""
    return pipeline.run(*recipe_from_flags(f), flagfile=flagfile)


def run_rows(f, argv) -> dict:
    """--rows through `fragments_tables.run_rows`: the flags of `argv` not the runner's go to every row."""
    return fragments_tables.run_rows(f, argv, define_flags, run)


def _main() -> None:
    f = flags.FLAGS
    if f.rows:
        run_rows(f, sys.argv)
        return
    record = run(f, flagfile=table_runner.flagfile_of(sys.argv))
    print(format_record(record))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")
    print(fragments_tables.follow_up(record))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=parse_flags)
