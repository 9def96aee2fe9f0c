"""Karpathy split files (``dataset_flickr30k.json``, ``dataset_flickr8k.json``,
``dataset_coco.json``).

Layout::

    {"images": [{"filepath": "val2014",            # COCO only
                 "filename": "1000092795.jpg",
                 "imgid": 0, "split": "train",        # train | val | test | restval
                 "sentids": [0, 1, 2, 3, 4],
                 "cocoid": 391895,                    # COCO only
                 "sentences": [{"tokens": [...], "raw": "...",
                                "imgid": 0, "sentid": 0}, ...]},
                ...],
     "dataset": "flickr30k"}

The image id is the file name without its extension, or ``str(cocoid)``
when the record has a ``cocoid``.
"""
from __future__ import annotations

import os

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats._common import read_json, require_keys, strip_image_extension
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import DataFormatError
from tf_twobranch.json_files import write_json

SPLITS = ("train", "val", "test", "restval")


def read_karpathy_json(path: str | os.PathLike, *,
                       restval_into_train: bool = False) -> dict[str, CaptionCorpus]:
    """Reads a Karpathy split file into one CaptionCorpus per split.

    Args:
      path: the JSON file.
      restval_into_train: add the 'restval' images to 'train' (in file
        order) instead of returning a separate 'restval' corpus; the usual
        COCO setting of Karpathy & Fei-Fei.
    Returns:
      {split: corpus} for the splits present, in the order 'train', 'val',
      'test', 'restval'.  Captions are the ``raw`` strings (stripped); a
      sentence without ``raw`` uses its ``tokens`` joined by spaces.
    Raises:
      DataFormatError naming the image record (index and file name) for
      missing keys, an unknown split, a repeated image id or an empty caption,
      and the line/column for malformed JSON.
    """
    path = os.fspath(path)
    data = read_json(path)
    require_keys(path, data, ("images",), "top level")
    images = data["images"]
    if not isinstance(images, list):
        raise DataFormatError(path, "'images' must be a list", record="images")
    if not images:
        raise DataFormatError(path, "the caption file is empty: 'images' lists no image (expected "
                              "one record per image with its split and sentences)", record="images")
    grouped: dict[str, dict[str, list[str]]] = {}
    split_of: dict[str, str] = {}
    for i, image in enumerate(images):
        where = f"images[{i}]"
        require_keys(path, image, ("filename", "split", "sentences"), where)
        where = f"images[{i}] ({image['filename']})"
        split = image["split"]
        if split not in SPLITS:
            raise DataFormatError(path, f"unknown split {split!r}; expected one of {SPLITS}",
                                  record=where)
        if restval_into_train and split == "restval":
            split = "train"
        image_id = (str(image["cocoid"]) if image.get("cocoid") is not None
                    else strip_image_extension(str(image["filename"])))
        if image_id in split_of:
            raise DataFormatError(path, f"image id {image_id!r} occurs twice", record=where)
        split_of[image_id] = split
        sentences = image["sentences"]
        if not isinstance(sentences, list):
            raise DataFormatError(path, "'sentences' must be a list", record=where)
        captions = []
        for j, sentence in enumerate(sentences):
            if not isinstance(sentence, dict) or ("raw" not in sentence and "tokens" not in sentence):
                raise DataFormatError(path, f"sentence {j} has neither 'raw' nor 'tokens'",
                                      record=where)
            raw = sentence.get("raw")
            caption = raw if isinstance(raw, str) else " ".join(map(str, sentence.get("tokens") or []))
            caption = caption.strip()
            if not caption:
                raise DataFormatError(path, f"sentence {j} is empty", record=where)
            captions.append(caption)
        grouped.setdefault(split, {})[image_id] = captions
    return {split: CaptionCorpus._from_grouped(grouped[split], path)
            for split in SPLITS if split in grouped}


def write_karpathy_json(path: str | os.PathLike, corpora_by_split: dict[str, CaptionCorpus],
                        dataset: str) -> None:
    """Writes corpora as a Karpathy split file (``tokens`` from `tokenize_caption`).

    For ``dataset == "coco"`` the image ids must be integers; each record
    gets ``cocoid``, ``filepath`` ("train2014" for train, else "val2014") and
    the COCO file name ``COCO_<filepath>_<id:012d>.jpg``.  Otherwise the file
    name is ``<id>.jpg``.
    """
    path = os.fspath(path)
    images = []
    sentid = 0
    for split, corpus in corpora_by_split.items():
        if split not in SPLITS:
            raise DataFormatError(path, f"unknown split {split!r}; expected one of {SPLITS}")
        captions_by_image = corpus.captions_by_image()
        for index, image_id in enumerate(corpus.image_ids):
            imgid = len(images)
            record: dict = {}
            if dataset == "coco":
                try:
                    cocoid = int(image_id)
                except ValueError:
                    raise DataFormatError(path, f"COCO image ids must be integers, got {image_id!r}",
                                          record=image_id) from None
                folder = "train2014" if split == "train" else "val2014"
                record["filepath"] = folder
                record["filename"] = f"COCO_{folder}_{cocoid:012d}.jpg"
            else:
                record["filename"] = f"{image_id}.jpg"
            captions = captions_by_image[index]
            sentences = []
            for caption in captions:
                sentences.append({"tokens": tokenize_caption(caption), "raw": caption,
                                  "imgid": imgid, "sentid": sentid})
                sentid += 1
            record.update(imgid=imgid, split=split, sentids=[s["sentid"] for s in sentences])
            if dataset == "coco":
                record["cocoid"] = cocoid
            record["sentences"] = sentences
            images.append(record)
    write_json(path, {"images": images, "dataset": dataset}, compact=True)
