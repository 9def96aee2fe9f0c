"""Writing JSON files whole or not at all, and reading JSON objects with clear errors.

Every JSON file the package writes (run configurations, results, benchmark
reports, generated dataset files) goes through `write_json`: the text is
written to a temporary file beside the target and renamed over it, so a
reader (another worker, a resumed run, a test process) never sees half a
file. NumPy scalars and arrays are written as numbers and lists.
"""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any

import numpy as np

from tf_twobranch.errors import DataFormatError

__all__ = ["write_json", "read_json_object"]


def _plain(value: Any):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def write_json(path: str | os.PathLike, payload: Any, *, compact: bool = False) -> pathlib.Path:
    """Writes `payload` to `path` atomically; returns the path.

    Default: indented with sorted keys (run records, reports). `compact`:
    one line, keys in their order, non-ASCII kept (dataset files in the
    layouts of the original datasets).
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if compact:
        text = json.dumps(payload, ensure_ascii=False, default=_plain)
    else:
        text = json.dumps(payload, indent=2, sort_keys=True, default=_plain) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_json_object(path: str | os.PathLike, what: str) -> dict:
    """The JSON object in `path`; DataFormatError naming the file (and line) when it is
    missing, malformed or not an object (`what` says what the file should hold)."""
    # Imported here: the format readers import this module for write_json.
    from tf_twobranch.data.formats._common import read_json

    if not os.path.exists(path):
        raise DataFormatError(path, f"{what} file does not exist")
    value = read_json(path)  # with or without a byte-order mark; bad UTF-8/JSON names the line
    if not isinstance(value, dict):
        raise DataFormatError(path, f"expected a JSON object ({what})")
    return value
