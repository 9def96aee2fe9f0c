"""What a system's run loader builds on: the loaded `Run`, its weights and results, and the
records of the split a run was evaluated on.

`tf_twobranch.runs.load_run` (the app) finds a folder's system through the registry
(`tf_twobranch.systems`) and calls that system's loader, which returns a `Run`. The experiments
record the evaluated split in ``results.json["evaluation"]`` (`record_feature_split`): feature
files by reference (the feature cache or the user's files, checked by a fingerprint when read
back) and arrays that exist nowhere else in ``<run>/evaluation/``. A system whose split is
rebuilt otherwise (the dual path from its dataset, fragments and N-pair from their recipes)
gives its `Run` a ``split_reader``.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable

import keras
import numpy as np

from tf_twobranch.data.formats import load_feature_matrix
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation.split import EvaluationSplit
from tf_twobranch.json_files import read_json_object

__all__ = ["Run", "run_weights", "run_results", "config_folder", "record_feature_split"]


@dataclasses.dataclass
class Run:
    run_dir: pathlib.Path      # the folder holding the loaded weights
    family: str                # the `ModelConfig.FAMILY` of its model
    model: keras.Model
    config: dict               # run_config.json: model, training and flag values
    results: dict | None       # results.json of the experiment, when written
    # Rebuilds the evaluation split where results.json["evaluation"] does not describe it.
    split_reader: Callable[["Run"], EvaluationSplit] | None = None

    def evaluation_split(self) -> EvaluationSplit:
        """The test split this run was evaluated on (what `self.model.evaluate` takes)."""
        if self.split_reader is not None:
            return self.split_reader(self)
        record = (self.results or {}).get("evaluation")
        if record is None:
            raise UserInputError(f"{self.run_dir}: results.json records no evaluation split "
                                 "(written by an older version, or the run did not finish)")
        if record.get("kind") == "features":
            return _read_feature_split(self.run_dir, record)
        raise UserInputError(f"{self.run_dir}: unknown evaluation record kind {record.get('kind')!r}")


def run_weights(folder: pathlib.Path, checkpoint: str) -> pathlib.Path:
    """``<folder>/checkpoints/<checkpoint>.weights.h5``, or an error listing what is there."""
    weights = folder / "checkpoints" / f"{checkpoint}.weights.h5"
    if not weights.exists():
        found = sorted(p.name for p in (folder / "checkpoints").glob("*.weights.h5"))
        raise UserInputError(f"{weights}: checkpoint not found (found: {found or 'none'})")
    return weights


def run_results(run_dir: pathlib.Path, folder: pathlib.Path) -> dict | None:
    """The experiment's results.json of a run (in its stage folder or the run folder)."""
    for candidate in (folder / "results.json", run_dir / "results.json"):
        if candidate.exists():
            return read_json_object(candidate, "experiment results")
    return None


def config_folder(run_dir: pathlib.Path, file_name: str,
                  stages: tuple[str, ...] = ("stage2", "stage1", ".")) -> pathlib.Path | None:
    """The first of `stages` (sub-folders of `run_dir`) that holds `file_name`, or None."""
    for stage in stages:
        if (run_dir / stage / file_name).is_file():
            return (run_dir / stage).resolve() if stage != "." else run_dir
    return None



# ------------------------------------------------------------------ evaluation split records

def _fingerprint(array: np.ndarray) -> list:
    """Shape and a cheap checksum: a cached file replaced since the run is noticed."""
    flat = np.asarray(array).reshape(-1)
    sample = flat[:: max(1, flat.size // 4096)].astype(np.float64)
    return [list(np.shape(array)), float(np.sum(sample)), float(np.sum(sample * sample))]


def _array_record(run_dir: pathlib.Path, name: str, array, source: dict | None) -> dict:
    array = np.asarray(array)
    if source and source.get("file"):
        return {"file": str(source["file"]), "key": source.get("key"),
                "reader": source.get("reader", "feature_matrix"), "fingerprint": _fingerprint(array)}
    folder = run_dir / "evaluation"
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / f"{name}.npy", array, allow_pickle=False)
    return {"file": f"evaluation/{name}.npy", "key": None, "reader": "npy",
            "fingerprint": _fingerprint(array)}


def record_feature_split(run_dir, split: EvaluationSplit, sources: dict | None = None) -> dict:
    """The ``results.json["evaluation"]`` entry of a split of precomputed inputs.

    `sources` maps "image"/"text" to ``{"file", "key"[, "reader"]}`` of the
    file each was read from unchanged (reader "feature_matrix", the default:
    `load_feature_matrix`; "npy": `np.load` as stored); other arrays are
    saved under ``<run_dir>/evaluation/``.
    """
    run_dir = pathlib.Path(run_dir)
    sources = sources or {}
    return {"kind": "features", "protocol": split.protocol,
            "image": _array_record(run_dir, "image", split.image, sources.get("image")),
            "text": _array_record(run_dir, "text", split.text, sources.get("text")),
            "caption_image": _array_record(run_dir, "caption_image", split.caption_image, None)}


def _read_array(run_dir: pathlib.Path, record: dict):
    path = pathlib.Path(record["file"])
    if not path.is_absolute():
        path = run_dir / path
    if not path.exists():
        raise UserInputError(f"{path}: the run's evaluation input is gone (results.json "
                             "'evaluation' names it); run the experiment again to recreate it")
    rows = record["fingerprint"][0][0]
    if record["reader"] == "npy":    # stored as is (token ids, indices, arrays of the run)
        array = np.load(path, allow_pickle=False)
    else:
        array = load_feature_matrix(path, record.get("key"), expected_rows=rows)
    if _fingerprint(array) != record["fingerprint"]:
        raise UserInputError(f"{path}: differs from the file the run was evaluated on (shape or "
                             "content changed since); run the experiment again")
    return array


def _read_feature_split(run_dir: pathlib.Path, record: dict) -> EvaluationSplit:
    caption_image = _read_array(run_dir, record["caption_image"])
    image = _read_array(run_dir, record["image"])
    text = _read_array(run_dir, record["text"])
    return EvaluationSplit(image, text, caption_image, protocol=record["protocol"])
