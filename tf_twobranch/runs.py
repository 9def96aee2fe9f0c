"""A trained run, loaded from its folder alone.

`load_run(run_dir)` reads the run's task from the folder
(`run_folders.read_run_task`: ``results.json["task"]`` or the files only
that kind of run writes) and hands the folder to the loader registered for
it in `RUN_LOADERS` (one per model family, imported only when needed):

* two-branch networks (image–sentence and phrase-localization runs):
  ``run_config.json`` with the model configuration, weights in
  ``checkpoints/<checkpoint>.weights.h5``;
* the dual path (instance-loss runs): ``dual_path_config.json`` beside
  ``run_config.json`` in a stage folder; given the run folder itself, its
  last stage (``stage2``, else ``stage1``) is loaded;
* deep fragment embeddings: ``fragment_config.json`` in the last stage
  folder (the frozen word vectors are part of the checkpoint);
* N-pair localization: ``npair_config.json``; the image backbone is rebuilt
  from the run's dataset.

The run's ``results.json`` (the metrics the experiment printed) comes with
it when present, and `Run.evaluation_split()` gives the test split the
run was evaluated on, so that ``run.model.evaluate(run.evaluation_split())``
returns the metrics of ``run.results["metrics"]``. The experiments
record that split in ``results.json["evaluation"]`` (`record_feature_split`,
`record_dual_path_split`): feature files by reference (the feature cache or
the user's files, checked by a fingerprint when read back), arrays that exist
nowhere else in ``<run>/evaluation/``, and for the dual path the recipe that
rebuilds its test images and token rows from the dataset. A family whose
split is rebuilt otherwise gives its `Run` a ``split_reader``.
"""
from __future__ import annotations

import dataclasses
import importlib
import pathlib
from typing import Callable

import keras
import numpy as np

from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.systems.dual_path.data import dual_path_data
from tf_twobranch.data.formats import load_feature_matrix
from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation.split import EvaluationSplit
from tf_twobranch.json_files import read_json_object
from tf_twobranch.systems.dual_path.model import DualPathConfig, load_dual_path_model
from tf_twobranch.systems.two_branch.model import TwoBranchConfig, build_model
from tf_twobranch.run_folders import read_run_task
from tf_twobranch.systems.dual_path.sampling import test_split

__all__ = ["Run", "load_run", "FAMILIES", "RUN_LOADERS", "record_feature_split",
           "record_dual_path_split", "dual_path_test_split", "run_weights", "run_results"]

FAMILIES = ("two_branch", "dual_path", "fragment_embedding", "npair_localization")

# The loader of each task's runs (run_folders.TASKS), as "module:function"
# taking (run_dir, checkpoint) and returning a `Run`.
RUN_LOADERS = {
    "image_sentence_retrieval": "tf_twobranch.runs:load_two_branch_run",
    "phrase_localization": "tf_twobranch.runs:load_two_branch_run",
    "dual_path": "tf_twobranch.runs:load_dual_path_run",
    "fragment_embeddings": "tf_twobranch.systems.fragments.pipeline:load_fragment_run",
    "npair_localization": "tf_twobranch.systems.npair.pipeline:load_npair_run",
}


@dataclasses.dataclass
class Run:
    run_dir: pathlib.Path      # the folder holding the loaded weights
    family: str                # one of FAMILIES (the `ModelConfig.FAMILY` of its model)
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
            if self.config.get("task") == "phrase_localization":
                raise UserInputError(
                    f"{self.run_dir}: a phrase-localization run has no retrieval split; it is "
                    "evaluated with tf_twobranch.evaluation.phrase_localization on its "
                    "dataset's test phrases (results.json['inputs'] names the dataset)")
            raise UserInputError(f"{self.run_dir}: results.json records no evaluation split "
                                 "(written by an older version, or the run did not finish)")
        if record.get("kind") == "features":
            return _read_feature_split(self.run_dir, record)
        if record.get("kind") == "dual_path":
            return _read_dual_path_split(record, self.config.get("vocabulary"))
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


def _config_folder(run_dir: pathlib.Path, file_name: str,
                   stages: tuple[str, ...] = ("stage2", "stage1", ".")) -> pathlib.Path | None:
    for stage in stages:
        if (run_dir / stage / file_name).is_file():
            return (run_dir / stage).resolve() if stage != "." else run_dir
    return None


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
    module, function = RUN_LOADERS[found[0].name].split(":")
    return getattr(importlib.import_module(module), function)(run_dir, checkpoint)


def _refuse_a_cca_run(run_dir: pathlib.Path, task: str) -> None:
    """A CCA baseline row (``--model=cca``) trains no network and keeps no model: it fits CCA in
    closed form and evaluates it in the same process. Said plainly, with what the folder does
    hold, instead of "needs run_config.json"."""
    results = run_dir / "results.json"
    if task not in ("image_sentence_retrieval", "phrase_localization") or not results.is_file():
        return
    record = read_json_object(results, "experiment results")
    flags = record.get("flags") if isinstance(record.get("flags"), dict) else {}
    if flags.get("model") != "cca" or (run_dir / TwoBranchConfig.FILE_NAME).exists():
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


def load_two_branch_run(run_dir: pathlib.Path, checkpoint: str) -> Run:
    config_path = run_dir / TwoBranchConfig.FILE_NAME
    if not config_path.exists():
        raise UserInputError(f"{run_dir}: a two-branch run folder needs {config_path.name}")
    config = read_json_object(config_path, "run configuration")
    if not isinstance(config.get("model"), dict):
        raise UserInputError(f"{config_path}: no 'model' configuration in it")
    model = build_model(TwoBranchConfig.from_dict(config["model"]))
    load_checkpoint(model, run_weights(run_dir, checkpoint))
    return Run(run_dir, TwoBranchConfig.FAMILY, model, config, run_results(run_dir, run_dir))


def load_dual_path_run(run_dir: pathlib.Path, checkpoint: str) -> Run:
    folder = _config_folder(run_dir, DualPathConfig.FILE_NAME, (".", "stage2", "stage1"))
    if folder is None:
        raise UserInputError(f"{run_dir}: a dual-path run folder needs {DualPathConfig.FILE_NAME} "
                             "(in it, or in stage2/ or stage1/)")
    model = load_dual_path_model(folder / DualPathConfig.FILE_NAME, run_weights(folder, checkpoint))
    config_path = folder / "run_config.json"
    config = read_json_object(config_path, "run configuration") if config_path.exists() else {}
    return Run(folder, DualPathConfig.FAMILY, model, config, run_results(run_dir, folder))




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


def record_dual_path_split(layout, *, split: str, dataset_kind: str, max_len: int,
                           long_captions: str, max_images: int | None, resize_to: int,
                           crop_size: int, text_shift: str, protocol: str) -> dict:
    """The ``results.json["evaluation"]`` entry of a dual-path run: how its test
    images and token rows are rebuilt from the dataset (images are too large to copy)."""
    return {"kind": "dual_path", "dataset_dir": str(layout.root), "caption_format": layout.caption_format,
            "caption_file": str(layout.caption_file) if layout.caption_file else None,
            "images_dir": str(layout.images_dir) if layout.images_dir else None,
            "split": split, "dataset_kind": dataset_kind, "max_len": max_len,
            "long_captions": long_captions, "max_images": max_images, "resize_to": resize_to,
            "crop_size": crop_size, "text_shift": text_shift, "protocol": protocol}


def dual_path_test_split(record: dict, data) -> EvaluationSplit:
    """The split a `record_dual_path_split` recipe describes, from its loaded `DualPathData`."""
    return test_split(data, resize_to=record["resize_to"], crop_size=record["crop_size"],
                      text_shift=record["text_shift"], protocol=record["protocol"],
                      by_identity=record["dataset_kind"] == "pedes")


def _read_dual_path_split(record: dict, vocabulary) -> EvaluationSplit:
    if not vocabulary:
        raise UserInputError("the dual-path run's run_config.json has no vocabulary")
    pedes = record["dataset_kind"] == "pedes"
    layout = resolve_dataset(record["dataset_dir"], caption_format=record["caption_format"],
                             images_dir=record["images_dir"],
                             captions_path=record["caption_file"] if pedes else None)
    data = dual_path_data(layout, record["split"], dataset_kind=record["dataset_kind"],
                          vocabulary=vocabulary, max_len=record["max_len"],
                          long_captions=record["long_captions"], max_images=record["max_images"])
    return dual_path_test_split(record, data)
