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
from tf_twobranch.json_files import read_json_object
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
    _refuse_a_cca_run(run_dir, found[0].name)
    return systems.for_task(found[0].name).load(run_dir, checkpoint)


def _refuse_a_cca_run(run_dir: pathlib.Path, task: str) -> None:
    """A CCA baseline row (``--model=cca``) trains no network and keeps no model: it fits CCA in
    closed form and evaluates it in the same process. Said plainly, with what the folder does
    hold, instead of "needs run_config.json"."""
    results = run_dir / "results.json"
    if task not in ("image_sentence_retrieval", "phrase_localization") or not results.is_file():
        return
    record = read_json_object(results, "experiment results")
    flags = record.get("flags") if isinstance(record.get("flags"), dict) else {}
    if flags.get("model") != "cca" or (run_dir / "run_config.json").exists():
        return
    metrics = record.get("metrics")
    summary = ""
    if isinstance(metrics, dict):
        shown = [f"{k} {v:.1f}" for k, v in metrics.items() if isinstance(v, (int, float))][:4]
        summary = f" ({', '.join(shown)}{', ...' if len(metrics) > len(shown) else ''})" if shown else ""
    raise UserInputError(
        f"{run_dir}: a CCA baseline run (--model=cca): CCA is fitted in closed form and evaluated in "
        f"the same run, so the folder keeps its metrics in results.json{summary} but no model for "
        "load_run to load (read the metrics with tf_twobranch.runs.run_results(run_dir, run_dir)). "
        "A loadable, exportable model comes from the same row with --model=embedding or --model=similarity")
