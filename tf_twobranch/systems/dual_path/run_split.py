"""The split a dual-path run was evaluated on: recorded as the recipe that rebuilds its test
images and token rows from the dataset (images are too large to copy), and rebuilt from it."""
from __future__ import annotations

from tf_twobranch.data.layout import resolve_dataset
from tf_twobranch.errors import UserInputError
from tf_twobranch.evaluation.split import EvaluationSplit
from tf_twobranch.systems.dual_path.data import dual_path_data
from tf_twobranch.systems.dual_path.sampling import test_split

__all__ = ["record_dual_path_split", "dual_path_test_split", "rebuild_dual_path_data", "read_dual_path_split"]


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


def rebuild_dual_path_data(record: dict, vocabulary):
    """The `DualPathData` of the split a `record_dual_path_split` recipe describes."""
    pedes = record["dataset_kind"] == "pedes"
    layout = resolve_dataset(record["dataset_dir"], caption_format=record["caption_format"],
                             images_dir=record["images_dir"],
                             captions_path=record["caption_file"] if pedes else None)
    data = dual_path_data(layout, record["split"], dataset_kind=record["dataset_kind"],
                          vocabulary=vocabulary, max_len=record["max_len"],
                          long_captions=record["long_captions"], max_images=record["max_images"])
    return data


def read_dual_path_split(record: dict, vocabulary) -> EvaluationSplit:
    """The evaluated split of a dual-path run, rebuilt from its dataset (`Run.split_reader`)."""
    if not vocabulary:
        raise UserInputError("the dual-path run's run_config.json has no vocabulary")
    return dual_path_test_split(record, rebuild_dual_path_data(record, vocabulary))
