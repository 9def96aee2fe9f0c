"""Caption splits of an image–sentence dataset directory, as users have them.

A dataset directory is recognised by its files (first match wins):

1. a Karpathy split file ``dataset_flickr30k.json`` / ``dataset_coco.json``
   (or any ``dataset_*.json``);
2. a Flickr30K caption file (``results_20130124.token`` or any ``*.token``)
   plus split lists ``train.txt`` / ``val.txt`` / ``test.txt``;
3. MSCOCO caption files ``annotations/captions_{train,val,test}*.json``.

Explicit paths override the detection. Each split becomes a
`CaptionCorpus`; features are attached by `RetrievalSplit`.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats import (read_coco_captions, read_karpathy_json,
                                       read_split_file, read_token_file)
from tf_twobranch.errors import DataFormatError, UserInputError

SPLITS = ("train", "val", "test")
CAPTION_FORMATS = ("auto", "karpathy", "token", "coco")


def _first(paths):
    paths = sorted(paths)
    return paths[0] if paths else None


def load_caption_splits(dataset_dir, *, caption_format: str = "auto",
                        captions_path=None, split_files: dict | None = None,
                        restval_into_train: bool = True) -> dict[str, CaptionCorpus]:
    """Reads the train/val/test caption corpora of a dataset directory."""
    root = pathlib.Path(dataset_dir) if dataset_dir else None
    if caption_format not in CAPTION_FORMATS:
        raise UserInputError(f"caption format must be one of {CAPTION_FORMATS}, "
                             f"got {caption_format!r}")
    if root is not None and not root.is_dir():
        raise DataFormatError(root, "dataset directory does not exist")
    fmt = caption_format
    if fmt == "auto":
        if captions_path is not None:
            suffix = pathlib.Path(captions_path).suffix
            fmt = "karpathy" if suffix == ".json" else "token"
        elif root is not None and _first(root.glob("dataset_*.json")):
            fmt = "karpathy"
        elif root is not None and _first(root.glob("*.token")):
            fmt = "token"
        elif root is not None and _first(root.glob("annotations/captions_*.json")):
            fmt = "coco"
        else:
            raise DataFormatError(
                root, "no caption files found: expected dataset_*.json (Karpathy split), "
                "a *.token Flickr30K caption file with train/val/test.txt, or "
                "annotations/captions_*.json (MSCOCO)")
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
    return out


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
