"""A trained run, loaded from its folder alone.

`load_run(run_dir)` recognises the model family from what the experiment
wrote and rebuilds the trained model:

* two-branch networks (image–sentence and phrase-localization runs):
  ``run_config.json`` with the model configuration, weights in
  ``checkpoints/<checkpoint>.weights.h5``;
* the dual path (instance-loss runs): ``dual_path_config.json`` beside
  ``run_config.json`` in a stage folder; given the run folder itself, its
  last stage (``stage2``, else ``stage1``) is loaded.

The run's ``results.json`` (the metrics the experiment printed) comes with
it when present.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import keras

from tf_twobranch.errors import UserInputError
from tf_twobranch.models.dual_path import load_dual_path_model
from tf_twobranch.models.two_branch import TwoBranchConfig, build_model

__all__ = ["Run", "load_run", "FAMILIES"]

FAMILIES = ("two_branch", "dual_path")


@dataclasses.dataclass
class Run:
    run_dir: pathlib.Path      # the folder holding the loaded weights
    family: str                # one of FAMILIES
    model: keras.Model
    config: dict               # run_config.json: model, training and flag values
    results: dict | None       # results.json of the experiment, when written


def _read_json(path: pathlib.Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserInputError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(value, dict):
        raise UserInputError(f"{path}: expected a JSON object ({what})")
    return value


def _weights(folder: pathlib.Path, checkpoint: str) -> pathlib.Path:
    weights = folder / "checkpoints" / f"{checkpoint}.weights.h5"
    if not weights.exists():
        found = sorted(p.name for p in (folder / "checkpoints").glob("*.weights.h5"))
        raise UserInputError(f"{weights}: checkpoint not found (found: {found or 'none'})")
    return weights


def _results(run_dir: pathlib.Path, folder: pathlib.Path) -> dict | None:
    for candidate in (folder / "results.json", run_dir / "results.json"):
        if candidate.exists():
            return _read_json(candidate, "experiment results")
    return None


def load_run(run_dir, checkpoint: str = "latest") -> Run:
    """The model of a run folder, its configuration and results (see the module docstring)."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise UserInputError(f"{run_dir}: run folder does not exist")
    folder = run_dir
    if not (folder / "dual_path_config.json").exists():
        stages = [run_dir / s for s in ("stage2", "stage1") if (run_dir / s / "dual_path_config.json").exists()]
        if stages and not (run_dir / "run_config.json").exists():
            folder = stages[0]
    if (folder / "dual_path_config.json").exists():
        model = load_dual_path_model(folder / "dual_path_config.json", _weights(folder, checkpoint))
        config_path = folder / "run_config.json"
        config = _read_json(config_path, "run configuration") if config_path.exists() else {}
        return Run(folder, "dual_path", model, config, _results(run_dir, folder))
    config_path = folder / "run_config.json"
    if not config_path.exists():
        raise UserInputError(f"{run_dir}: not a run folder written by tf_twobranch: expected "
                             "run_config.json (two-branch runs) or dual_path_config.json / "
                             "stage1/, stage2/ (dual-path runs)")
    config = _read_json(config_path, "run configuration")
    if not isinstance(config.get("model"), dict):
        raise UserInputError(f"{config_path}: no 'model' configuration in it")
    model = build_model(TwoBranchConfig.from_dict(config["model"]))
    model.load_weights(_weights(folder, checkpoint))
    return Run(folder, "two_branch", model, config, _results(run_dir, folder))
