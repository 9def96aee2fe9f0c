"""Caption splits of a dataset folder, read from its `DatasetLayout`.

The folder is recognised once by `tf_twobranch.data.layout.resolve_dataset`
(Karpathy JSON, Flickr30K token file + split lists, MSCOCO caption files,
the vsepp/SCAN precomp layout, CUHK-PEDES); the functions here read the
caption files it found. Each split becomes a `CaptionCorpus` (a model's test
inputs travel as `tf_twobranch.evaluation.split.EvaluationSplit`). A missing caption or split file is one error
listing what the folder has and lacks (`DatasetLayout.require`); a split
file or caption file that lists no images is an error naming that file.

The precomp layout ships image features (use `load_precomp_splits`) but no
sentence features.
"""
from __future__ import annotations

import os

import numpy as np

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats import (read_coco_captions, read_cuhk_pedes, read_karpathy_json,
                                       read_precomp_corpus, read_precomp_split, read_token_file)
from tf_twobranch.data.layout import SPLITS, DatasetLayout, resolve_dataset
from tf_twobranch.errors import DataFormatError

CAPTIONS = "image-sentence captions"


def as_layout(dataset: DatasetLayout | str | os.PathLike) -> DatasetLayout:
    """`dataset` itself when it is a `DatasetLayout`, else ``resolve_dataset(dataset)``."""
    return dataset if isinstance(dataset, DatasetLayout) else resolve_dataset(dataset)


def load_precomp_splits(dataset: DatasetLayout | str | os.PathLike, splits=("train", "test"), *,
                        keep_regions: bool = False, dtype: str | None = None, cache_dir=None
                        ) -> tuple[dict[str, CaptionCorpus], dict[str, np.ndarray]]:
    """Captions and image features of a precomp folder, by package split name.

    `dataset`: a `DatasetLayout`, or a folder to resolve. The test split is
    ``testall`` when present (see `tf_twobranch.data.layout`). Image features
    are (N, D), regions averaged, unless `keep_regions` (see
    `tf_twobranch.data.formats.read_precomp_split`, which also says what
    `dtype` and `cache_dir` do: features are memory-mapped).
    """
    layout = as_layout(dataset)
    if layout.caption_format != "precomp" or not layout.has("captions"):
        raise DataFormatError(layout.root, "not a precomp folder: expected train_caps.txt and "
                              "test_caps.txt (or testall_caps.txt), each with its {split}_ims.npy")
    corpora, images = {}, {}
    for split in splits:
        if split not in layout.precomp_splits:
            raise DataFormatError(layout.root / "dev_caps.txt",
                                  f"the precomp folder has no {split!r} split")
        corpora[split], images[split] = read_precomp_split(layout.root, layout.precomp_splits[split],
                                                           keep_regions=keep_regions, dtype=dtype,
                                                           cache_dir=cache_dir)
    return corpora, images


def _check_not_empty(corpora: dict[str, CaptionCorpus], root) -> dict[str, CaptionCorpus]:
    for split, corpus in corpora.items():
        if corpus.num_images == 0:
            raise DataFormatError(corpus.source or root or split,
                                  f"the {split!r} split has no images")
    return corpora


def load_caption_splits(dataset: DatasetLayout | str | os.PathLike, *,
                        restval_into_train: bool = True) -> dict[str, CaptionCorpus]:
    """Reads the train/val/test caption corpora of a dataset folder.

    Args:
      dataset: a `DatasetLayout`, or a folder to resolve (``resolve_dataset``
        with its defaults).
      restval_into_train: Karpathy JSON: "restval" images join the train split.

    Raises DataFormatError listing the pieces found and missing when the
    caption file (or a token file's train/test split list) is missing, and
    naming the file when a split file (or a split's caption file) lists no
    images.
    """
    layout = as_layout(dataset)
    fmt, root = layout.caption_format, layout.root
    if fmt is None:
        layout.require("captions", purpose=CAPTIONS)
    if fmt == "precomp":
        return _check_not_empty({split: read_precomp_corpus(root, name)
                                 for split, name in layout.precomp_splits.items()}, root)
    if fmt == "karpathy":
        layout.require("captions", purpose=CAPTIONS)
        path = layout.caption_file
        corpora = read_karpathy_json(path, restval_into_train=restval_into_train)
        missing = [s for s in SPLITS if s not in corpora]
        if "test" in missing or "train" in missing:
            raise DataFormatError(path, f"split(s) {missing} have no images")
        return corpora
    if fmt == "token":
        layout.require("captions", "train", "test", purpose=CAPTIONS)
        corpus = read_token_file(layout.caption_file)
        known = set(corpus.image_ids)
        return {split: corpus.subset(layout.split_ids(split, known_ids=known),
                                     source=str(layout.split_files[split]))
                for split in SPLITS if layout.has(split)}
    if fmt == "cuhk_pedes":
        layout.require("captions", purpose=CAPTIONS)
        return {split: pedes.corpus for split, pedes in read_cuhk_pedes(layout.caption_file).items()}
    # MSCOCO captions, one file per split.
    out = {}
    for split in SPLITS:
        path = layout.split_caption_files.get(split)
        if path is None:
            if split == "val":
                continue
            raise DataFormatError(root / "annotations" if root is not None else "annotations",
                                  f"no captions_{split}*.json file")
        out[split] = read_coco_captions(path)
    return _check_not_empty(out, root)
