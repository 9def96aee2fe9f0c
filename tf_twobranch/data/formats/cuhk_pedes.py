"""CUHK-PEDES annotations (``reid_raw.json``).

A JSON list of image records::

    [{"split": "train", "captions": ["A woman ...", "..."],
      "file_path": "CUHK01/0363004.png", "processed_tokens": [["a", "woman", ...], ...],
      "id": 1}, ...]

`read_cuhk_pedes` returns one `PedesSplit` per split: a CaptionCorpus whose
image ids are the ``file_path`` strings, plus the person identity (``id``)
of every image.  A file path listed twice (with the same identity) has its
captions merged.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats._common import read_json, require_keys
from tf_twobranch.json_files import write_json
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import DataFormatError

SPLITS = ("train", "val", "test")


@dataclasses.dataclass(eq=False)
class PedesSplit:
    """One split of CUHK-PEDES.

    Attributes:
      corpus: captions grouped by image; image ids are file paths.
      identity: int64 (num_images,) person id of each image, as in the file.
    """

    corpus: CaptionCorpus
    identity: np.ndarray

    def __post_init__(self):
        self.identity = np.asarray(self.identity, dtype=np.int64).reshape(-1)
        if self.identity.shape[0] != self.corpus.num_images:
            raise DataFormatError(self.corpus.source or "(unnamed)",
                                  f"{self.identity.shape[0]} identities for "
                                  f"{self.corpus.num_images} images")

    @property
    def caption_identity(self) -> np.ndarray:
        """int64 (num_captions,) person id of each caption."""
        return self.identity[self.corpus.caption_image]

    def identity_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """(labels, identities): per-image labels 0..K-1 and the sorted original ids."""
        identities, labels = np.unique(self.identity, return_inverse=True)
        return labels.astype(np.int32), identities

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PedesSplit):
            return NotImplemented
        return self.corpus == other.corpus and np.array_equal(self.identity, other.identity)

    __hash__ = None


def read_cuhk_pedes(path: str | os.PathLike) -> dict[str, PedesSplit]:
    """Reads ``reid_raw.json`` into {split: PedesSplit} (splits in file order of first use).

    Raises DataFormatError naming the record (index and file path) for a
    missing key, an unknown split, a non-integer id, captions that are not a
    non-empty list of non-empty strings, or a file path listed with two
    different identities; and the line/column for malformed JSON.
    """
    path = os.fspath(path)
    records = read_json(path)
    if not isinstance(records, list):
        raise DataFormatError(path, f"expected a JSON list of image records, found "
                              f"{type(records).__name__}", record="top level")
    grouped: dict[str, dict[str, list[str]]] = {}
    identities: dict[str, dict[str, int]] = {}
    for i, record in enumerate(records):
        require_keys(path, record, ("split", "captions", "file_path", "id"), f"[{i}]")
        file_path = record["file_path"]
        where = f"[{i}] ({file_path})"
        if not isinstance(file_path, str) or not file_path:
            raise DataFormatError(path, f"file_path must be a non-empty string, got {file_path!r}",
                                  record=f"[{i}]")
        split = record["split"]
        if split not in SPLITS:
            raise DataFormatError(path, f"unknown split {split!r}; expected one of {SPLITS}",
                                  record=where)
        identity = record["id"]
        if isinstance(identity, bool) or not isinstance(identity, int):
            raise DataFormatError(path, f"id must be an integer, got {identity!r}", record=where)
        captions = record["captions"]
        if (not isinstance(captions, list) or not captions
                or not all(isinstance(c, str) and c.strip() for c in captions)):
            raise DataFormatError(path, "captions must be a non-empty list of non-empty strings",
                                  record=where)
        split_ids = identities.setdefault(split, {})
        if split_ids.setdefault(file_path, identity) != identity:
            raise DataFormatError(path, f"file_path listed again with id {identity}, earlier "
                                  f"with id {split_ids[file_path]}", record=where)
        grouped.setdefault(split, {}).setdefault(file_path, []).extend(c.strip() for c in captions)
    result = {}
    for split, by_image in grouped.items():
        corpus = CaptionCorpus._from_grouped(by_image, path)
        identity = np.array([identities[split][image_id] for image_id in corpus.image_ids],
                            dtype=np.int64)
        result[split] = PedesSplit(corpus, identity)
    return result


def write_cuhk_pedes(path: str | os.PathLike, splits: dict[str, PedesSplit]) -> None:
    """Writes splits in ``reid_raw.json`` layout (``processed_tokens`` from `tokenize_caption`)."""
    path = os.fspath(path)
    records = []
    for split, data in splits.items():
        if split not in SPLITS:
            raise DataFormatError(path, f"unknown split {split!r}; expected one of {SPLITS}")
        for image_id, identity, captions in zip(data.corpus.image_ids, data.identity.tolist(),
                                                data.corpus.captions_by_image()):
            records.append({"split": split, "captions": captions, "file_path": image_id,
                            "processed_tokens": [tokenize_caption(c) for c in captions],
                            "id": int(identity)})
    write_json(path, records, compact=True)
