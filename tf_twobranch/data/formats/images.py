"""Image files: reading one as an RGB array, and its size from the header.

The one reader of image files for the NumPy side of the package (the
TensorFlow side decodes with `tf_twobranch.image_decoding`); a file that is
missing, empty or undecodable is a `DataFormatError` naming it.
"""
from __future__ import annotations

import os
import pathlib

import numpy as np
from PIL import Image, UnidentifiedImageError

from tf_twobranch.errors import DataFormatError

__all__ = ["load_image", "image_file_shape"]


def load_image(path: str | os.PathLike) -> np.ndarray:
    """Reads an image file as RGB.

    Grayscale, palette, CMYK and RGBA images are converted to RGB (alpha is
    dropped).

    Args:
      path: a JPEG/PNG/... file readable by PIL.

    Returns:
      uint8 array of shape (H, W, 3).

    Raises:
      DataFormatError: the file is missing, empty, or cannot be decoded.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataFormatError(path, "image file does not exist" if not path.exists()
                              else "expected an image file, found a directory")
    if path.stat().st_size == 0:
        raise DataFormatError(path, "image file is empty (0 bytes)")
    try:
        with Image.open(path) as pil_image:
            pil_image.load()  # forces decoding so that truncated files fail here
            rgb = pil_image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise DataFormatError(path, f"cannot decode image ({err}); expected a JPEG/PNG image") from None
    array = np.asarray(rgb, dtype=np.uint8)
    if array.ndim != 3 or array.shape[0] == 0 or array.shape[1] == 0:
        raise DataFormatError(path, f"decoded image has unusable shape {array.shape}")
    return array


def image_file_shape(path: str | os.PathLike) -> tuple[int, int]:
    """(height, width) of an image file, read from its header (no decoding).

    Equals ``load_image(path).shape[:2]`` (no EXIF rotation is applied by
    either).  A file whose header cannot be read is decoded with `load_image`,
    so that the error is its `DataFormatError` naming the file.
    """
    try:
        with Image.open(path) as pil_image:
            width, height = pil_image.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        height, width = load_image(path).shape[:2]
    return int(height), int(width)
