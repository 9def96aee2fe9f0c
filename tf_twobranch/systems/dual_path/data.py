"""Datasets of the dual-path CNN with instance loss (Zheng et al., §3.2, §6.1).

`DualPathData` is one split with everything the input pipeline
(`tf_twobranch.systems.dual_path.sampling`) needs: image files, captions, their word
codes (`tf_twobranch.data.text_codes`), and the instance-loss class of every
image -- one class per *training image* on Flickr30K / MSCOCO / the embedded
digit scenes (`dual_path_data_from_retrieval`), one per *person identity* on
CUHK-PEDES (`dual_path_data_from_pedes`; classes renumbered 0..n-1). Both
builders take a `tf_twobranch.data.layout.DatasetLayout` and validate
everything up front (image files exist and decode, caption lengths, empty
codes), reporting problems as `DataFormatError` naming the file and record.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from tf_twobranch.data.formats.cuhk_pedes import read_cuhk_pedes
from tf_twobranch.data.formats.images import load_image
from tf_twobranch.data.formats.word_vectors import load_word_vectors
from tf_twobranch.data.layout import DatasetLayout
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.data.text_codes import (LONG_CAPTION_POLICIES, build_text_vocabulary,
                                          check_caption_lengths, encode_captions)
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError, DataFormatError

__all__ = ["VALIDATE_MODES", "FULL_DECODE_LIMIT", "DATASET_KINDS", "DualPathData", "dual_path_data",
           "dual_path_data_from_retrieval", "dual_path_data_from_pedes", "validate_image_files",
           "check_num_classes"]

VALIDATE_MODES = ("auto", "header", "full")
#: "retrieval": one class per image (Flickr30K, MSCOCO, the embedded scenes);
#: "pedes": one class per person identity (CUHK-PEDES).
DATASET_KINDS = ("retrieval", "pedes")
#: With validate="auto", every image is fully decoded up front when the split
#: has at most this many images; larger splits get existence + header checks.
FULL_DECODE_LIMIT = 10_000


@dataclasses.dataclass(eq=False)
class DualPathData:
    """One split, ready for the dual-path pipeline.

    Attributes:
      image_paths: absolute image file paths, one per image.
      captions: raw caption strings, grouped by image.
      caption_image: int32 (num_captions,) image index of each caption.
      image_class: int32 (num_images,) instance-loss class of each image.
      num_classes: number of classes (max(image_class) + 1).
      vocabulary: the dictionary (``<pad>``, ``<unk>``, words).
      max_len: the text input length.
      codes: int32 word-index array per caption (validated, clipped per policy).
      image_ids: image identifiers (image ids, or CUHK-PEDES file paths).
      class_names: what each class is (image id, or person identity).
      split: "train", "val" or "test".
      source: the caption/annotation file the split was read from.
      images_root: where image files were looked up.
    """

    image_paths: list[str]
    captions: list[str]
    caption_image: np.ndarray
    image_class: np.ndarray
    num_classes: int
    vocabulary: list[str]
    max_len: int
    codes: list[np.ndarray]
    image_ids: list[str]
    class_names: list[str]
    split: str = "train"
    source: str = ""
    images_root: str = ""

    def __post_init__(self):
        self.caption_image = np.asarray(self.caption_image, np.int32).reshape(-1)
        self.image_class = np.asarray(self.image_class, np.int32).reshape(-1)
        if len(self.image_class) != len(self.image_paths):
            raise ConfigError(f"{len(self.image_class)} image classes for {len(self.image_paths)} images")
        if not (len(self.captions) == len(self.caption_image) == len(self.codes)):
            raise ConfigError(f"{len(self.captions)} captions, {len(self.caption_image)} caption "
                              f"images and {len(self.codes)} codes must agree")

    @property
    def num_images(self) -> int:
        return len(self.image_paths)

    @property
    def num_captions(self) -> int:
        return len(self.captions)

    @property
    def caption_class(self) -> np.ndarray:
        """int32 (num_captions,) class of each caption."""
        return self.image_class[self.caption_image]

    @property
    def vocabulary_size(self) -> int:
        return len(self.vocabulary)


def _check_validate(validate: str) -> None:
    if validate not in VALIDATE_MODES:
        raise ConfigError(f"validate must be one of {VALIDATE_MODES}, got {validate!r}")


def validate_image_files(image_paths: Sequence[str], *, image_ids: Sequence[str] | None = None,
                         source="", validate: str = "auto") -> None:
    """Checks image files up front so that training never meets a bad one.

    Every file must exist and have a readable image header (PIL); with
    validate="full" -- or "auto" and at most `FULL_DECODE_LIMIT` images --
    every file is also decoded completely.

    Raises:
      DataFormatError: for a missing file, the listing file (`source`) and
        the record (image id) with the expected path; for a corrupt file,
        the image file and the record.
    """
    _check_validate(validate)
    full = validate == "full" or (validate == "auto" and len(image_paths) <= FULL_DECODE_LIMIT)
    for i, path in enumerate(image_paths):
        record = image_ids[i] if image_ids is not None else f"image {i}"
        if not os.path.isfile(path):
            raise DataFormatError(source or path,
                                  f"image file {path} does not exist (listed for this record)",
                                  record=record)
        if full:
            try:
                load_image(path)
            except DataFormatError as err:
                raise DataFormatError(path, f"{err.args[0].split(': ', 1)[-1]} (record "
                                      f"{record!r} of {source})") from None
            continue
        try:
            with Image.open(path) as image:
                if image.size[0] < 1 or image.size[1] < 1:
                    raise DataFormatError(path, f"image has size {image.size} (record {record!r} "
                                          f"of {source})")
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            raise DataFormatError(path, f"cannot read the image header ({err}); expected a "
                                  f"JPEG/PNG image (record {record!r} of {source})") from None


def check_num_classes(data: DualPathData, num_classes: int) -> None:
    """Raises ConfigError when a configured class count differs from the data's."""
    if int(num_classes) != data.num_classes:
        unit = "person identity" if data.class_names and data.class_names != data.image_ids \
            else "training image"
        raise ConfigError(
            f"num_classes={num_classes} is configured, but the {data.split} split of "
            f"{data.source or 'the data'} has {data.num_classes} classes (one per {unit}); "
            f"set num_classes to {data.num_classes}")


def _load_word_vectors(word_vectors, words):
    if word_vectors is None or not isinstance(word_vectors, (str, os.PathLike)):
        return word_vectors
    return load_word_vectors(word_vectors, vocabulary=words)


def _vocabulary(train_captions, vocabulary, word_vectors, min_count):
    if vocabulary is not None:
        return list(vocabulary)
    tokens = [tokenize_caption(c) for c in train_captions]
    word_vectors = _load_word_vectors(word_vectors, {t for ts in tokens for t in ts})
    return build_text_vocabulary(tokens, word_vectors, min_count=min_count)


def _codes(captions, caption_image, image_ids, vocabulary, max_len, long_captions, split, source):
    if long_captions not in LONG_CAPTION_POLICIES:
        raise ConfigError(f"long_captions must be one of {LONG_CAPTION_POLICIES}, got {long_captions!r}")
    codes = encode_captions(captions, vocabulary)
    # Records: "image <id>, caption <k>" with k the caption's rank within its image.
    caption_image = np.asarray(caption_image)
    firsts = np.searchsorted(caption_image, caption_image, side="left") if len(caption_image) else []
    records = [f"image {image_ids[img]}, caption {i - first}"
               for i, (img, first) in enumerate(zip(caption_image.tolist(), list(firsts)))]
    return check_caption_lengths(codes, max_len, long_captions, source=source, records=records,
                                 allow_empty=split != "train")


def _max_images(corpus, max_images):
    if max_images is None:
        return corpus
    if max_images < 1:
        raise ConfigError(f"max_images must be positive, got {max_images}")
    return corpus.subset(corpus.image_ids[:max_images], source=corpus.source)


def dual_path_data_from_retrieval(layout: DatasetLayout, split: str = "train", *,
                                  vocabulary: Sequence[str] | None = None, word_vectors=None,
                                  min_count: int = 1, max_len: int = 32,
                                  long_captions: str = "error", max_images: int | None = None,
                                  validate: str = "auto") -> DualPathData:
    """One split of Flickr30K / MSCOCO / the embedded digit scenes; one class per image.

    Args:
      layout: the dataset folder (`tf_twobranch.data.layout.resolve_dataset`);
        captions are read with `tf_twobranch.data.retrieval_data.load_caption_splits`
        and image files found with `DatasetLayout.image_path` (``<id>.jpg``,
        .jpeg/.png, COCO file names when the caption file lists them, and
        ``train2014/COCO_train2014_<12-digit id>.jpg``).
      split: "train", "val" or "test".
      vocabulary: the dictionary; default: built from the TRAINING split
        (`build_text_vocabulary` with `word_vectors` and `min_count`).
      word_vectors: `WordVectors`, a word2vec/GloVe file path, or None.
      max_len: text input length (32 in the paper).
      long_captions: "error" or "clip" (see `check_caption_lengths`).
      max_images: keep only the split's first `max_images` images (slices
        for smoke tests; the dictionary still comes from the whole training
        split).
      validate: image checks, see `validate_image_files`.

    The class of an image is its index in the split (for training: one class
    per training image, 29,783 on Flickr30K).
    """
    _check_validate(validate)
    corpora = load_caption_splits(layout)
    if split not in corpora:
        raise ConfigError(f"split {split!r} is not available; the dataset has {sorted(corpora)}")
    corpus = _max_images(corpora[split], max_images)
    if corpus.num_images == 0:
        raise DataFormatError(corpus.source or layout.root, f"split {split!r} has no images")
    # The dictionary always comes from the whole training split, so slices
    # of different splits share it.
    vocabulary = _vocabulary(corpora["train"].captions, vocabulary, word_vectors, min_count)
    source = corpus.source or str(layout.root)
    codes = _codes(corpus.captions, corpus.caption_image, corpus.image_ids, vocabulary, max_len,
                   long_captions, split, source)
    paths = [str(p) for p in layout.image_paths(corpus.image_ids, source=source,
                                                file_names=getattr(corpus, "file_names", None))]
    validate_image_files(paths, image_ids=corpus.image_ids, source=source, validate=validate)
    image_class = np.arange(corpus.num_images, dtype=np.int32)
    return DualPathData(paths, corpus.captions, corpus.caption_image, image_class,
                        corpus.num_images, vocabulary, int(max_len), codes,
                        list(corpus.image_ids), list(corpus.image_ids), split, source,
                        str(layout.images_dir))


def dual_path_data_from_pedes(layout: DatasetLayout, split: str = "train", *,
                              vocabulary: Sequence[str] | None = None, word_vectors=None,
                              min_count: int = 1, max_len: int = 56, long_captions: str = "error",
                              max_images: int | None = None, validate: str = "auto") -> DualPathData:
    """One split of a CUHK-PEDES ``reid_raw.json``; one class per person identity.

    Args:
      layout: a CUHK-PEDES folder (``resolve_dataset(folder)``, or with
        ``caption_format="cuhk_pedes", captions_path=<reid_raw.json>``); the
        images folder its ``file_path`` entries are relative to is
        ``<folder>/imgs`` when it exists, else the folder (or ``images_dir``).
      split: "train", "val" or "test".
      vocabulary / word_vectors / min_count: as `dual_path_data_from_retrieval`
        (the dictionary comes from the training split).
      max_len: text input length (56 for CUHK-PEDES in the paper).
      max_images: keep only the split's first `max_images` images.

    Classes are the split's identities renumbered 0..n-1 in increasing id
    order (``class_names`` holds the original ids).
    """
    _check_validate(validate)
    if layout.caption_format != "cuhk_pedes":
        raise ConfigError(f"{layout.root}: expected a CUHK-PEDES folder (reid_raw.json), "
                          f"found the {layout.caption_format or 'unknown'} caption layout")
    layout.require("captions", purpose="CUHK-PEDES data")
    reid_raw_json = layout.caption_file
    splits = read_cuhk_pedes(reid_raw_json)
    if split not in splits:
        raise ConfigError(f"split {split!r} is not in {reid_raw_json}; it has {sorted(splits)}")
    if "train" not in splits and vocabulary is None:
        raise DataFormatError(reid_raw_json, "no 'train' records to build the dictionary from "
                              "(pass vocabulary=...)")
    pedes = splits[split]
    corpus = _max_images(pedes.corpus, max_images)
    identity = pedes.identity[:corpus.num_images]
    train_captions = splits["train"].corpus.captions if "train" in splits else []
    vocabulary = _vocabulary(train_captions, vocabulary, word_vectors, min_count)
    codes = _codes(corpus.captions, corpus.caption_image, corpus.image_ids, vocabulary, max_len,
                   long_captions, split, str(reid_raw_json))
    paths = [str(p) for p in layout.image_paths(corpus.image_ids, source=str(reid_raw_json))]
    validate_image_files(paths, image_ids=corpus.image_ids, source=str(reid_raw_json),
                         validate=validate)
    identities, image_class = np.unique(identity, return_inverse=True)
    return DualPathData(paths, corpus.captions, corpus.caption_image, image_class.astype(np.int32),
                        len(identities), vocabulary, int(max_len), codes, list(corpus.image_ids),
                        [str(i) for i in identities.tolist()], split, str(reid_raw_json),
                        str(layout.images_dir))


def dual_path_data(layout: DatasetLayout, split: str, *, dataset_kind: str = "retrieval",
                   **kwargs) -> DualPathData:
    """One split of a dataset of `dataset_kind` (see `DATASET_KINDS`); `kwargs` go to
    `dual_path_data_from_retrieval` or `dual_path_data_from_pedes`."""
    if dataset_kind not in DATASET_KINDS:
        raise ConfigError(f"dataset_kind must be one of {DATASET_KINDS}, got {dataset_kind!r}")
    build = dual_path_data_from_pedes if dataset_kind == "pedes" else dual_path_data_from_retrieval
    return build(layout, split, **kwargs)
