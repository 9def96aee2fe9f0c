"""Flickr30K / Flickr8K caption token files (``results_20130124.token``,
``Flickr8k.token.txt``).

One caption per line: ``<image file name>#<k>\\t<caption>``, e.g.
``1000092795.jpg#0\\tTwo young guys with shaggy hair ...``.  The image id is
the file name without its image extension; ``k`` is the caption number.
"""
from __future__ import annotations

import os

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats._common import read_text, strip_image_extension
from tf_twobranch.errors import DataFormatError


def read_token_file(path: str | os.PathLike) -> CaptionCorpus:
    """Reads a token file into a CaptionCorpus (images in order of first appearance).

    Blank lines are skipped; captions are stripped of surrounding white space.
    Raises DataFormatError for a file without captions, and (with the line
    number) for a line without a tab,
    a file name without ``#<k>`` or with a non-numeric ``k``, a repeated
    ``(image, k)``, or an empty caption.
    """
    path = os.fspath(path)
    grouped: dict[str, list[str]] = {}
    seen_numbers: set[tuple[str, str]] = set()
    for line_number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        name_part, tab, caption = line.partition("\t")
        if not tab:
            raise DataFormatError(path, "expected '<image>.jpg#<k>' and a caption separated by a tab, "
                                  "found no tab", line=line_number)
        file_name, hash_sign, number = name_part.strip().rpartition("#")
        if not hash_sign or not file_name:
            raise DataFormatError(path, f"expected '<image>.jpg#<k>' before the tab, found {name_part!r}",
                                  line=line_number)
        if not number.isdigit():
            raise DataFormatError(path, f"caption number after '#' must be a non-negative integer, "
                                  f"found {number!r}", line=line_number)
        caption = caption.strip()
        if not caption:
            raise DataFormatError(path, f"empty caption for {name_part!r}", line=line_number)
        image_id = strip_image_extension(file_name)
        key = (image_id, number)
        if key in seen_numbers:
            raise DataFormatError(path, f"caption {file_name}#{number} occurs twice", line=line_number)
        seen_numbers.add(key)
        grouped.setdefault(image_id, []).append(caption)
    if not grouped:
        # Refused here: an empty corpus would surface later as "unknown image id" in a split list.
        raise DataFormatError(path, "the caption file is empty (expected one "
                              "'<image>.jpg#<k><TAB><caption>' line per caption)")
    return CaptionCorpus._from_grouped(grouped, path)


def write_token_file(path: str | os.PathLike, corpus: CaptionCorpus, *,
                     extension: str = ".jpg") -> None:
    """Writes `corpus` as ``<id><extension>#<k>\\t<caption>`` lines, k = 0, 1, ... per image."""
    path = os.fspath(path)
    counters = [0] * corpus.num_images
    lines = []
    for i, (caption, image_index) in enumerate(zip(corpus.captions, corpus.caption_image)):
        if "\t" in caption or "\n" in caption or "\r" in caption or not caption.strip():
            raise DataFormatError(path, "cannot write a caption that is empty or contains a tab "
                                  f"or line break: {caption!r}", record=f"caption {i}")
        k = counters[image_index]
        counters[image_index] += 1
        lines.append(f"{corpus.image_ids[image_index]}{extension}#{k}\t{caption}\n")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)
