"""Image split files: one image id per line.

Used by Flickr30K Entities (``train.txt``: ``1000092795``), Multi30K
(``test_2016_images.txt``: ``1000092795.jpg``) and Flickr8K
(``Flickr_8k.testImages.txt``).  Image extensions are stripped.
"""
from __future__ import annotations

import os
from typing import Collection, Iterable

from tf_twobranch.data.formats._common import read_text, strip_image_extension
from tf_twobranch.errors import DataFormatError


def read_split_file(path: str | os.PathLike, known_ids: Collection[str] | None = None, *,
                    drop_unknown: bool = False) -> list[str]:
    """Reads image ids in file order.

    Args:
      path: the split file.
      known_ids: if given, every id must be in it (e.g. a CaptionCorpus's
        ``image_ids``; pass a set for speed).
      drop_unknown: silently skip ids not in `known_ids` instead of raising
        (the Multi30K caption file lacks some Flickr30K Entities images).
    Raises:
      DataFormatError with the line number for a line holding more than one
      word (one image id per line is expected), a repeated id or an unknown id.
    """
    path = os.fspath(path)
    if known_ids is not None and not isinstance(known_ids, (set, frozenset, dict)):
        known_ids = set(known_ids)
    ids: list[str] = []
    first_line: dict[str, int] = {}
    for line_number, line in enumerate(read_text(path).splitlines(), start=1):
        name = line.strip()
        if not name:
            continue
        if len(name.split()) > 1:
            raise DataFormatError(path, f"expected one image id per line, got {len(name.split())} words: "
                                  f"{name!r}", line=line_number)
        image_id = strip_image_extension(name)
        if image_id in first_line:
            raise DataFormatError(path, f"image id {image_id!r} is repeated (first on line "
                                  f"{first_line[image_id]})", line=line_number)
        first_line[image_id] = line_number
        if known_ids is not None and image_id not in known_ids:
            if drop_unknown:
                continue
            raise DataFormatError(path, f"unknown image id {image_id!r} (not among the "
                                  f"{len(known_ids)} known images)", line=line_number)
        ids.append(image_id)
    return ids


def write_split_file(path: str | os.PathLike, ids: Iterable[str], *, extension: str = "") -> None:
    """Writes one id per line, followed by `extension` (e.g. ".jpg" for Multi30K's layout)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{image_id}{extension}\n" for image_id in ids)
