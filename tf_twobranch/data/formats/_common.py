"""Helpers shared by the format readers (file access and JSON decoding)."""
from __future__ import annotations

import json
import os
from typing import Any

from tf_twobranch.errors import DataFormatError

# Extensions stripped from image file names to obtain image ids.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff")


def strip_image_extension(name: str) -> str:
    """'1000092795.jpg' -> '1000092795'; names without an image extension are kept."""
    lower = name.lower()
    for extension in IMAGE_EXTENSIONS:
        if lower.endswith(extension) and len(name) > len(extension):
            return name[: -len(extension)]
    return name


def check_exists(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataFormatError(path, "file does not exist")
    if os.path.isdir(path):
        raise DataFormatError(path, "is a directory, expected a file")
    return path


def read_text(path: str | os.PathLike) -> str:
    """Reads a UTF-8 text file; errors name the file (and the line of a bad byte)."""
    path = check_exists(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataFormatError(path, f"is not valid UTF-8 text (byte {e.start}: {e.reason})",
                              line=line) from None


def read_json(path: str | os.PathLike) -> Any:
    """Parses a JSON file; malformed JSON reports the file, line and column."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataFormatError(path, f"malformed JSON at column {e.colno}: {e.msg}",
                              line=e.lineno) from None


def require_keys(path, record: Any, keys: tuple[str, ...], where: str) -> None:
    """Raises DataFormatError when the JSON object `record` lacks one of `keys`."""
    if not isinstance(record, dict):
        raise DataFormatError(path, f"expected a JSON object, found {type(record).__name__}",
                              record=where)
    missing = [k for k in keys if k not in record]
    if missing:
        raise DataFormatError(path, f"missing key(s) {', '.join(map(repr, missing))}; "
                              f"found {sorted(record)}", record=where)
