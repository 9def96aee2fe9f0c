"""Shared helpers of the experiment entry points: flag definitions, flag parsing per row,
flags -> recipe. Everything that needs no flags lives in the library and is re-exported here:
tables and protocols (`tf_twobranch.tables`), training set-up and records
(`tf_twobranch.run_records`), the table runner and run-folder rule
(`tf_twobranch.table_runner`), recipes and --smoke (`tf_twobranch.recipes`).
"""
from __future__ import annotations

from typing import Callable, Sequence

from absl import flags

from tf_twobranch import cli, recipes, table_runner
from tf_twobranch.cli import split_paths  # noqa: F401 (re-exported)
from tf_twobranch.errors import UserInputError  # re-exported for the experiments
from tf_twobranch.evaluation import retrieval
from tf_twobranch.run_records import is_chief, setup_training  # noqa: F401
from tf_twobranch.run_records import run_record as flag_record  # noqa: F401
from tf_twobranch.run_records import write_results as write_json  # noqa: F401
from tf_twobranch.recipes import from_flags, prepare_recipe, typed_flags  # noqa: F401
from tf_twobranch.recipes import define_smoke_flag  # noqa: F401  (--smoke: one definition for every experiment)
from tf_twobranch.table_runner import resolve_config  # noqa: F401
from tf_twobranch.tables import (groups_by_test_split, is_smoke, paper_beside_record,  # noqa: F401
                                 paper_numbers, resolve_protocol, table_title)

REPO_ROOT = table_runner.REPO_ROOT
CONFIG_DIR = table_runner.CONFIG_DIR


def parse_flagfile(define: Callable[[flags.FlagValues], None], flagfile: str,
                   overrides: Sequence[str] = ()) -> flags.FlagValues:
    """Parses one flagfile (plus overrides) into a fresh FlagValues.

    Lets one process run several table rows without the rows' flags leaking
    into each other. Unknown flags and out-of-range values raise
    UserInputError naming the flagfile and line, or the overrides, where the
    flag was written.
    """
    fv = flags.FlagValues()
    define(fv)
    arguments = [*cli.expand_flagfiles([f"--flagfile={flagfile}"]),
                 *cli.expand_flagfiles(overrides, origin="among the flags passed to every row")]
    try:
        leftover = fv(["row", *(a.text for a in arguments)])[1:]
    except flags.Error as e:
        raise UserInputError(f"{flagfile}: {cli.describe_flag_error(e, fv, arguments)}") from None
    if leftover:
        where = next(a.origin for a in arguments if a.text == leftover[0])
        raise UserInputError(f"{flagfile}: {leftover[0]!r} is not a flag ({where}); expected "
                             "--name=value")
    return fv


# ------------------------------------------------------------------ flags
# Each flag shared by several experiments is defined here, once; an
# experiment passes the defaults its paper uses (e.g. the phrase-localization
# branches are 1024 wide, the image-sentence ones 2048).


def define_output_flags(fv, *, paper_results_help: str, row_name: str = "",
                        verbose: int = 1) -> None:
    """Where a row's results go and how it is named: --run_dir, --row_name, --paper_results, --out_json, --verbose."""
    d = dict(flag_values=fv)
    flags.DEFINE_integer("verbose", verbose, "Keras progress bar (0 = silent).", **d)
    flags.DEFINE_string("run_dir", "", "Run directory (default runs/<row_name>).", **d)
    flags.DEFINE_string("row_name", row_name, "Name of the table row.", **d)
    flags.DEFINE_string("paper_results", "", paper_results_help, **d)
    flags.DEFINE_enum("paper_protocol", "", ["", *retrieval.PROTOCOLS], "Protocol the paper's "
                      "retrieval numbers were measured under (each flagfile declares it); they are "
                      "printed only beside a result of the same protocol.", **d)
    flags.DEFINE_string("out_json", "", "Results JSON (default <run_dir>/results.json).", **d)


def apply_embedded_profile(f, profile: dict) -> dict:
    """Sets a profile's values on flags the user did not set, when no --dataset_dir is given.

    The embedded digit scenes are much smaller than the papers' datasets;
    each experiment declares the defaults that suit them. Returns what was
    applied (the experiments log it).
    """
    applied = {}
    if f.dataset_dir:
        return applied
    for name, value in profile.items():
        if not f[name].present:
            f[name].value = value
            applied[name] = value
    return applied


def recipe_from_flags(cls, f):
    """The experiment's row recipe of parsed flags (`tf_twobranch.recipes.from_flags`)."""
    return from_flags(cls, f)


def runner_arguments(argv: Sequence[str], runner_flags) -> list[str]:
    """The flags of a table runner's command line (flagfiles expanded) that go to every row."""
    return table_runner.row_arguments([a.text for a in cli.expand_flagfiles(list(argv[1:]))],
                                      runner_flags)


def define_runner_flags(fv, *, rows_help: str, runs_dir: bool = True) -> None:
    """--rows, --runs_dir and --resume: the table runner's flags (tf_twobranch.table_runner)."""
    d = dict(flag_values=fv)
    flags.DEFINE_list("rows", [], rows_help, **d)
    if runs_dir:
        flags.DEFINE_string("runs_dir", "", recipes.RUNS_DIR_HELP, **d)
    flags.DEFINE_bool("resume", True, recipes.RESUME_HELP, **d)
