r"""Phrase localization with two-branch networks (TPAMI Table 1, §4).

    python -m experiments.two_branch_region_phrase \
        --flagfile=experiments/configs/two_branch_table1_b5_nonlinear_augm_pos_bidir_nbr_sampling.cfg
    python -m experiments.two_branch_region_phrase --rows=all      # every Table 1 row, then the table

Either way a row's run folder is runs/<flagfile stem> (tf_twobranch.table_runner);
rows that finished earlier with the same arguments are reused (--noresume).

With no --dataset_dir the embedded digit-scene dataset is generated (once)
and used, with its proposals.h5. For Flickr30K Entities pass --dataset_dir
(Sentences/, Annotations/, train/val/test.txt, images/), --proposals
(200 EdgeBoxes per image; HDF5 or a directory, see
tf_twobranch.data.formats.proposals) and --image_backbone=vgg16
--backbone_weights=<local file>.

Training follows §4.3: Adam 1e-3, batches of 100 ground-truth
region–phrase pairs (Algorithm 1), no dropout, branches 4096→1024→512;
``--epochs`` with the bi-directional terms (and neighbourhood sampling when
on), then ``--constraint_epochs`` more with λ3/λ4 switched on when
``--neighbourhood_constraints``; optionally ``--hard_negative_epochs`` of the
CVPR 2016 stage (≤ 50 mined hard negatives per unique phrase, λ3 = λ4 = 0).
The test split is scored with R@1/5/10 at IoU ≥ 0.5, the proposals' upper
bound and a per-type breakdown.
"""
from __future__ import annotations

import sys
import time

from absl import app, flags

from experiments import common
from tf_twobranch import table_runner
from tf_twobranch.cli import absl_main, parse_flags
from tf_twobranch.recipes import define_recipe_flags
from tf_twobranch.systems.two_branch import region_phrase_pipeline as pipeline
from tf_twobranch.systems.two_branch.region_phrase_pipeline import (  # noqa: F401  (re-exported)
    EMBEDDED_PROFILE, SIMILARITY_HEADS, TABLE_COLUMNS, LocalizationRecipe, _table_row, format_chance,  # noqa: F401
    format_localization_table, format_per_type, table_marks)  # noqa: F401

# The embedded profile (EMBEDDED_PROFILE) and why: tf_twobranch/systems/two_branch/region_phrase_pipeline.py.
RUNNER_FLAGS = ("rows", "resume", "flagfile", "runs_dir")


def apply_embedded_profile(f) -> dict:
    return common.apply_embedded_profile(f, EMBEDDED_PROFILE)


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """The flags: the fields of `LocalizationRecipe` (`tf_twobranch.recipes.define_recipe_flags`)."""
    define_recipe_flags(LocalizationRecipe, fv)


def recipe(f) -> LocalizationRecipe:
    """The row recipe of parsed flags (built once, in the entry point)."""
    return common.recipe_from_flags(LocalizationRecipe, f)


def feature_spec(f):
    return pipeline.feature_spec(recipe(f))


def dataset_layout(f, dataset_dir=None):
    return pipeline.dataset_layout(recipe(f), dataset_dir)


def load_data(f):
    """`pipeline.load_data` of parsed flags as they are (no profile: e.g. a run's recorded flags)."""
    return pipeline.load_data(recipe(f))


def run(f, flagfile: str | None = None) -> dict:
    """Runs one Table 1 row from parsed flags; returns the results record (also written as JSON)."""
    return pipeline.run(recipe(f), common.typed_flags(f), flagfile=flagfile)


def follow_up(record: dict) -> str:
    """What to run next on the row's run folder (two_branch_draw, TF Serving)."""
    run_dir = record.get("run_dir", "")
    if record["flags"]["model"] == "cca":
        return table_runner.next_command(run_dir, load_run=False)
    commands = [f"python -m experiments.two_branch_draw --run_dir={run_dir} --out_dir=figures"]
    if record.get("export_dir"):
        commands.append(f"python -m experiments.two_branch_draw --saved_model={record['export_dir']} "
                        "--out_dir=figures")
    return table_runner.next_command(run_dir, *commands, load_run=False)


def _run_row(cfg, arguments) -> dict:
    fv = common.parse_flagfile(define_flags, str(cfg), arguments)
    print(f"{cfg.name}: {fv.row_name}", flush=True)
    return run(fv)


def run_rows(configs, overrides=(), export_row: str = "b5", out_json=None, runs_dir=None,
             resume: bool = True) -> list[dict]:
    """Runs several flagfiles (each in its own FlagValues) and prints the Table 1 layout."""
    start = time.time()
    records = table_runner.run_table(
        configs, _run_row, overrides=overrides, runs_dir=runs_dir, resume=resume,
        extra_arguments=lambda cfg: [f"--export={str(bool(export_row) and export_row in cfg.stem).lower()}"],
        announce=lambda cfg, record, _: print(format_localization_table(cfg.stem, [_table_row(record)]),
                                              flush=True),
        is_chief=common.is_chief)
    first = records[0]
    print()
    print(format_localization_table(
        f"Table 1-style phrase localization on {first['dataset_dir']} ({first['num_test_phrases']} test "
        f"phrases, {first['proposals_per_image']:.0f} proposals per image); paper numbers: Flickr30K Entities",
        [_table_row(r) for r in records]))
    print(format_chance(first))
    parent = runs_dir or next((o.split("=", 1)[1] for o in overrides if o.startswith("--run_dir=")), None)
    out = out_json or table_runner.run_folder(parent, None, "two_branch_table1").with_suffix(".json")
    common.write_json(out, {"rows": records, "seconds": time.time() - start})
    print(f"results: {out} ({time.time() - start:.0f} s)")
    last = next((r for r in reversed(records) if r.get("export_dir")), records[-1])
    print(follow_up(last))
    return records


def _main() -> None:
    f = flags.FLAGS
    if f.rows:
        overrides = common.runner_arguments(sys.argv, RUNNER_FLAGS)
        run_rows(table_runner.select_rows(f.rows, pattern="two_branch_table1_*.cfg"), overrides,
                 out_json=f.out_json or None, runs_dir=f.runs_dir or None, resume=f.resume)
        return
    record = run(f, flagfile=table_runner.flagfile_of(sys.argv))
    print(format_localization_table(
        f"Phrase localization ({record['num_test_phrases']} test phrases); paper numbers: Flickr30K Entities",
        [_table_row(record)]))
    print(format_chance(record))
    print(format_per_type(record["metrics"]))
    if record.get("export_dir"):
        print(f"SavedModel: {record['export_dir']}")
    print(follow_up(record))


main = absl_main(_main)


if __name__ == "__main__":
    define_flags()
    common.define_runner_flags(flags.FLAGS, rows_help=(
        "Run these Table 1 flagfiles (names in experiments/configs or paths; 'all' = every "
        "two_branch_table1_*.cfg) and print the whole table; other flags go to every row."))
    app.run(main, flags_parser=parse_flags)
