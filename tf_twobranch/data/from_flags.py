"""The dataset of a row, from its recipe's data fields: `--dataset_dir` or the embedded data,
checked, resolved once, and its splits cut to `--max_{train,test}_images`.

Written once here for every experiment::

    source, layout = dataset_from_flags(r.dataset_dir, images_dir=r.images_dir,
                                        caption_format=r.caption_format, proposals=r.proposals)
    splits = cut_splits(load_caption_splits(layout), ("train", "test"),
                        max_train_images=r.max_train_images, max_test_images=r.max_test_images)

A given folder that does not exist (or is a file, where a folder is needed)
is a `UserInputError` naming the flag and the path, raised before anything
else is read.
"""
from __future__ import annotations

import pathlib
from typing import Sequence

from tf_twobranch.errors import UserInputError


def dataset_folder(dataset_dir: str | pathlib.Path | None, *, flag: str = "--dataset_dir",
                   with_proposals: bool = True, allow_file: bool = False) -> pathlib.Path:
    """`dataset_dir` checked (it must be a folder; with `allow_file` also an existing file), or
    the embedded dataset (generated once; with its proposals when `with_proposals`)."""
    if not dataset_dir:
        from tf_twobranch.data.embedded import load_embedded_dataset
        return load_embedded_dataset(with_proposals=with_proposals)
    path = pathlib.Path(dataset_dir)
    if path.is_dir() or (allow_file and path.is_file()):
        return path
    what = "is not a folder" if path.exists() else "dataset folder does not exist"
    raise UserInputError(f"{flag}={path}: {what}")


def dataset_from_flags(dataset_dir: str | pathlib.Path | None, *, flag: str = "--dataset_dir",
                       with_proposals: bool = True, images_dir: str = "",
                       caption_format: str | None = None, proposals: str = "",
                       **resolve_kwargs):
    """(the dataset folder, its resolved `DatasetLayout`): `dataset_folder` then `resolve_dataset`
    (empty `images_dir` / `proposals` mean "the folder's own"; `caption_format` None or "auto":
    recognised from the files)."""
    from tf_twobranch.data.layout import resolve_dataset
    source = dataset_folder(dataset_dir, flag=flag, with_proposals=with_proposals)
    kwargs = dict(resolve_kwargs)
    if caption_format is not None:
        kwargs["caption_format"] = caption_format
    if proposals:
        kwargs["proposals"] = proposals
    return source, resolve_dataset(source, images_dir=images_dir or None, **kwargs)


def split_limit(split: str, max_train_images: int = 0, max_test_images: int = 0) -> int | None:
    """The image limit of a split (train: max_train_images, any other: max_test_images); None: all."""
    value = max_train_images if split == "train" else max_test_images
    return value or None


def cut_splits(corpora: dict, names: Sequence[str], *, max_train_images: int = 0,
               max_test_images: int = 0) -> dict:
    """`{name: corpus}` of the named splits, each cut to its first N images (0: all)."""
    out = {}
    for name in names:
        corpus, limit = corpora[name], split_limit(name, max_train_images, max_test_images)
        out[name] = corpus.subset(corpus.image_ids[:limit], source=corpus.source) if limit else corpus
    return out
