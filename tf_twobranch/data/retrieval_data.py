"""Caption splits of an image–sentence dataset directory, as users have them.

A dataset directory is recognised by its files (first match wins):

1. a Karpathy split file ``dataset_flickr30k.json`` / ``dataset_coco.json``
   (or any ``dataset_*.json``);
2. a Flickr30K caption file (``results_20130124.token`` or any ``*.token``)
   plus split lists ``train.txt`` / ``val.txt`` / ``test.txt``;
3. MSCOCO caption files ``annotations/captions_{train,val,test}*.json``;
4. the vsepp/SCAN "precomp" layout: ``train_caps.txt`` and ``test_caps.txt``
   (or ``testall_caps.txt``), each beside its ``{split}_ims.npy`` image
   features (`tf_twobranch.data.formats.precomp`). ``dev_caps.txt`` is the
   val split. When both ``testall`` and ``test`` exist (vsepp's
   ``coco_precomp``: the 5K test set and its first 1K images), the test
   split is ``testall``: the ``coco_1k`` protocol averages its five 1K folds
   and ``coco_5k`` uses all of it. This layout ships image features (use
   `load_precomp_splits`) but no sentence features.

Explicit paths override the detection. Each split becomes a
`CaptionCorpus`; features are attached by `RetrievalSplit`. A split file
or caption file that lists no images is an error naming that file.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats import (read_coco_captions, read_karpathy_json,
                                       read_precomp_corpus, read_precomp_split,
                                       read_split_file, read_token_file)
from tf_twobranch.data.formats.precomp import has_precomp_split
from tf_twobranch.errors import DataFormatError, UserInputError

SPLITS = ("train", "val", "test")
CAPTION_FORMATS = ("auto", "karpathy", "token", "coco", "precomp")


def _first(paths):
    paths = sorted(paths)
    return paths[0] if paths else None


def is_precomp_dir(dataset_dir) -> bool:
    """Whether `dataset_dir` has the precomp layout (``train_caps.txt`` + ``test[all]_caps.txt``)."""
    if not dataset_dir or not pathlib.Path(dataset_dir).is_dir():
        return False
    return has_precomp_split(dataset_dir, "train") and (
        has_precomp_split(dataset_dir, "testall") or has_precomp_split(dataset_dir, "test"))


def precomp_split_names(dataset_dir) -> dict[str, str]:
    """{package split: precomp split} of a precomp folder: train, val (dev, if
    present) and test (``testall`` when present, else ``test``)."""
    names = {"train": "train"}
    if has_precomp_split(dataset_dir, "val"):
        names["val"] = "val"
    names["test"] = "testall" if has_precomp_split(dataset_dir, "testall") else "test"
    return names


def detect_caption_format(dataset_dir, caption_format: str = "auto", captions_path=None) -> str:
    """The caption layout of `dataset_dir` ("karpathy", "token", "coco" or "precomp").

    An explicit `caption_format` other than "auto" is returned unchanged (after
    checking it is known); see the module docstring for the detection order.
    """
    root = pathlib.Path(dataset_dir) if dataset_dir else None
    if caption_format not in CAPTION_FORMATS:
        raise UserInputError(f"caption format must be one of {CAPTION_FORMATS}, "
                             f"got {caption_format!r}")
    if root is not None and not root.is_dir():
        raise DataFormatError(root, "dataset directory does not exist")
    if caption_format != "auto":
        return caption_format
    if captions_path is not None:
        suffix = pathlib.Path(captions_path).suffix
        return "karpathy" if suffix == ".json" else "token"
    if root is not None and _first(root.glob("dataset_*.json")):
        return "karpathy"
    if root is not None and _first(root.glob("*.token")):
        return "token"
    if root is not None and _first(root.glob("annotations/captions_*.json")):
        return "coco"
    if root is not None and is_precomp_dir(root):
        return "precomp"
    raise DataFormatError(
        root, "no caption files found: expected dataset_*.json (Karpathy split), "
        "a *.token Flickr30K caption file with train/val/test.txt, "
        "annotations/captions_*.json (MSCOCO), or the precomp layout "
        "(train_caps.txt and test_caps.txt / testall_caps.txt with {split}_ims.npy)")


def load_precomp_splits(dataset_dir, splits=("train", "test"), *, keep_regions: bool = False
                        ) -> tuple[dict[str, CaptionCorpus], dict[str, np.ndarray]]:
    """Captions and image features of a precomp folder, by package split name.

    The test split is ``testall`` when present (see the module docstring).
    Image features are (N, D), regions averaged, unless `keep_regions`
    (see `tf_twobranch.data.formats.read_precomp_split`).
    """
    if not is_precomp_dir(dataset_dir):
        raise DataFormatError(dataset_dir, "not a precomp folder: expected train_caps.txt and "
                              "test_caps.txt (or testall_caps.txt), each with its {split}_ims.npy")
    names = precomp_split_names(dataset_dir)
    corpora, images = {}, {}
    for split in splits:
        if split not in names:
            raise DataFormatError(pathlib.Path(dataset_dir) / "dev_caps.txt",
                                  f"the precomp folder has no {split!r} split")
        corpora[split], images[split] = read_precomp_split(dataset_dir, names[split],
                                                           keep_regions=keep_regions)
    return corpora, images


def _check_not_empty(corpora: dict[str, CaptionCorpus], root) -> dict[str, CaptionCorpus]:
    for split, corpus in corpora.items():
        if corpus.num_images == 0:
            raise DataFormatError(corpus.source or root or split,
                                  f"the {split!r} split has no images")
    return corpora


def load_caption_splits(dataset_dir, *, caption_format: str = "auto",
                        captions_path=None, split_files: dict | None = None,
                        restval_into_train: bool = True) -> dict[str, CaptionCorpus]:
    """Reads the train/val/test caption corpora of a dataset directory.

    Raises DataFormatError naming the file when a split file (or a split's
    caption file) lists no images.
    """
    root = pathlib.Path(dataset_dir) if dataset_dir else None
    fmt = detect_caption_format(dataset_dir, caption_format, captions_path)
    if fmt == "precomp":
        if root is None:
            raise UserInputError("the precomp caption format needs a dataset directory")
        if captions_path is not None or split_files:
            raise UserInputError("captions_path/split_files do not apply to the precomp layout: "
                                 "its files are <dataset_dir>/{split}_caps.txt")
        return _check_not_empty({split: read_precomp_corpus(root, name)
                                 for split, name in precomp_split_names(root).items()}, root)
    if fmt == "karpathy":
        path = captions_path or _first(root.glob("dataset_*.json"))
        corpora = read_karpathy_json(path, restval_into_train=restval_into_train)
        missing = [s for s in SPLITS if s not in corpora]
        if "test" in missing or "train" in missing:
            raise DataFormatError(path, f"split(s) {missing} have no images")
        return corpora
    if fmt == "token":
        path = captions_path or _first(root.glob("results_20130124.token")) or \
            _first(root.glob("*.token"))
        corpus = read_token_file(path)
        out = {}
        for split in SPLITS:
            split_path = (split_files or {}).get(split) or (root / f"{split}.txt" if root else None)
            if split_path is None or not pathlib.Path(split_path).exists():
                if split == "val":
                    continue
                raise DataFormatError(split_path or f"{split}.txt",
                                      f"split file for '{split}' not found")
            ids = read_split_file(split_path, known_ids=set(corpus.image_ids))
            if not ids:
                # Caught here: downstream an empty split only shows up as a
                # feature file with "0 rows expected".
                raise DataFormatError(split_path, f"split file for '{split}' lists no image ids "
                                      "(expected one image id per line)")
            out[split] = corpus.subset(ids, source=str(split_path))
        return out
    # MSCOCO captions, one file per split.
    out = {}
    for split in SPLITS:
        path = (split_files or {}).get(split) or _first(root.glob(f"annotations/captions_{split}*.json"))
        if path is None:
            if split == "val":
                continue
            raise DataFormatError(root / "annotations", f"no captions_{split}*.json file")
        out[split] = read_coco_captions(path)
    return _check_not_empty(out, root)


@dataclasses.dataclass
class RetrievalSplit:
    """One split's captions with model inputs aligned to them.

    ``image`` rows follow ``corpus.image_ids``; ``text`` rows follow
    ``corpus.captions``.
    """
    name: str
    corpus: CaptionCorpus
    image: np.ndarray
    text: np.ndarray

    def __post_init__(self):
        if len(self.image) != self.corpus.num_images:
            raise UserInputError(
                f"split {self.name}: {len(self.image)} image feature rows but "
                f"{self.corpus.num_images} images in {self.corpus.source or 'the captions'}")
        if len(self.text) != self.corpus.num_captions:
            raise UserInputError(
                f"split {self.name}: {len(self.text)} text rows but "
                f"{self.corpus.num_captions} captions in {self.corpus.source or 'the captions'}")

    @property
    def caption_image(self) -> np.ndarray:
        return self.corpus.caption_image

    def as_dict(self) -> dict:
        return {"image": self.image, "text": self.text, "caption_image": self.caption_image}
