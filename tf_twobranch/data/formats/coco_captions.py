"""MSCOCO caption annotation files (``captions_train2014.json``, ``captions_val2014.json``).

Layout::

    {"info": {...}, "licenses": [...],
     "images": [{"id": 391895, "file_name": "COCO_val2014_000000391895.jpg",
                 "height": 360, "width": 640, ...}, ...],
     "annotations": [{"id": 770337, "image_id": 391895, "caption": "..."}, ...]}

`read_coco_captions` returns a `CocoCaptionCorpus`: a `CaptionCorpus`
(image ids ``str(image["id"])`` in the order of ``images``; captions in
annotation order within each image) that also carries ``file_names``
(id -> file name) and ``sizes`` (id -> (height, width), when present).
Images without annotations are kept (with no captions).
"""
from __future__ import annotations

import dataclasses
import os

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats._common import read_json, require_keys
from tf_twobranch.json_files import write_json
from tf_twobranch.errors import DataFormatError


@dataclasses.dataclass(eq=False)
class CocoCaptionCorpus(CaptionCorpus):
    """A CaptionCorpus with COCO's per-image file names and (height, width) sizes."""

    file_names: dict[str, str] = dataclasses.field(default_factory=dict)
    sizes: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)


def read_coco_captions(path: str | os.PathLike) -> CocoCaptionCorpus:
    """Reads a COCO caption file.

    Raises DataFormatError naming the record (``images[i]`` /
    ``annotations[i] (id ...)``) for missing keys, repeated image ids,
    annotations referring to an unknown image id and empty captions, and the
    line/column for malformed JSON.
    """
    path = os.fspath(path)
    data = read_json(path)
    require_keys(path, data, ("images", "annotations"), "top level")
    for key in ("images", "annotations"):
        if not isinstance(data[key], list):
            raise DataFormatError(path, f"{key!r} must be a list", record=key)
        if not data[key]:
            raise DataFormatError(path, f"the caption file is empty: {key!r} is an empty list "
                                  "(expected a COCO captions file, e.g. captions_train2014.json)", record=key)
    grouped: dict[str, list[str]] = {}
    file_names: dict[str, str] = {}
    sizes: dict[str, tuple[int, int]] = {}
    for i, image in enumerate(data["images"]):
        require_keys(path, image, ("id",), f"images[{i}]")
        image_id = str(image["id"])
        if image_id in grouped:
            raise DataFormatError(path, f"image id {image_id} occurs twice", record=f"images[{i}]")
        grouped[image_id] = []
        if "file_name" in image:
            file_names[image_id] = str(image["file_name"])
        if "height" in image and "width" in image:
            sizes[image_id] = (int(image["height"]), int(image["width"]))
    for i, annotation in enumerate(data["annotations"]):
        require_keys(path, annotation, ("image_id", "caption"), f"annotations[{i}]")
        where = f"annotations[{i}]" + (f" (id {annotation['id']})" if "id" in annotation else "")
        image_id = str(annotation["image_id"])
        if image_id not in grouped:
            raise DataFormatError(path, f"annotation refers to image_id {annotation['image_id']!r}, "
                                  "which is not listed in 'images'", record=where)
        caption = annotation["caption"]
        if not isinstance(caption, str) or not caption.strip():
            raise DataFormatError(path, f"empty or non-string caption {caption!r}", record=where)
        grouped[image_id].append(caption.strip())
    base = CaptionCorpus._from_grouped(grouped, path)
    return CocoCaptionCorpus(base.image_ids, base.captions, base.caption_image, path,
                             file_names=file_names, sizes=sizes)


def write_coco_captions(path: str | os.PathLike, corpus: CaptionCorpus, *,
                        file_names: dict[str, str] | None = None,
                        sizes: dict[str, tuple[int, int]] | None = None) -> None:
    """Writes `corpus` in COCO caption layout.

    Image ids must be integers.  `file_names` / `sizes` default to those of
    a CocoCaptionCorpus; missing file names become ``<id>.jpg`` and
    ``height``/``width`` are written only when a size is known.  Annotation
    ids are 1, 2, ... in corpus order.
    """
    path = os.fspath(path)
    if file_names is None:
        file_names = getattr(corpus, "file_names", None) or {}
    if sizes is None:
        sizes = getattr(corpus, "sizes", None) or {}
    numeric_ids = []
    for image_id in corpus.image_ids:
        try:
            numeric_ids.append(int(image_id))
        except ValueError:
            raise DataFormatError(path, f"COCO image ids must be integers, got {image_id!r}",
                                  record=image_id) from None
    images = []
    for image_id, numeric_id in zip(corpus.image_ids, numeric_ids):
        record = {"id": numeric_id, "file_name": file_names.get(image_id, f"{image_id}.jpg")}
        if image_id in sizes:
            record["height"], record["width"] = (int(v) for v in sizes[image_id])
        images.append(record)
    annotations = [{"id": i + 1, "image_id": numeric_ids[index], "caption": caption}
                   for i, (caption, index) in enumerate(zip(corpus.captions, corpus.caption_image.tolist()))]
    write_json(path, {"info": {}, "licenses": [], "images": images, "annotations": annotations},
               compact=True)
