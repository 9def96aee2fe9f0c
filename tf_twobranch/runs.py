"""A trained run, loaded from its folder alone: `load_run(run_dir)`.

The run's task comes from the folder (`run_folders.read_run_task`: ``results.json["task"]`` or
the files only that system's runs write); the system that writes it (`tf_twobranch.systems`
registry) loads it and returns a `Run` (`tf_twobranch.run_loading`): its model, configuration
and the experiment's ``results.json``. `Run.evaluation_split()` gives the split the run was
evaluated on, so that ``run.model.evaluate(run.evaluation_split())`` returns the metrics of
``run.results["metrics"]``.
"""
from __future__ import annotations

import pathlib

from tf_twobranch import systems
from tf_twobranch.errors import UserInputError
from tf_twobranch.run_folders import read_run_task
from tf_twobranch.run_loading import Run, config_folder, record_feature_split, run_results, run_weights

__all__ = ["Run", "load_run", "record_feature_split", "run_weights", "run_results", "config_folder"]


def load_run(run_dir, checkpoint: str = "latest") -> Run:
    """The model of a run folder, its configuration and results (see the module docstring)."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise UserInputError(f"{run_dir}: run folder does not exist")
    found = read_run_task(run_dir)
    if found is None:
        raise UserInputError(f"{run_dir}: not a run folder written by tf_twobranch: expected "
                             "results.json or run_config.json with its task, or a model "
                             "configuration (run_config.json, dual_path_config.json, "
                             "fragment_config.json, npair_config.json) here or in stage1/, stage2/")
    return systems.for_task(found[0].name).load(run_dir, checkpoint)
