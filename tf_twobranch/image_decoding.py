"""The package's one TensorFlow image decoder (`tf_decode_image`) and its format check.

The tf.data pipelines (`tf_twobranch.systems.dual_path.sampling`) and the SavedModel
exports (`tf_twobranch.export.serving.decode_jpeg_batch`,
`tf_twobranch.systems.two_branch.region_phrase_export.decode_image_exact`) all decode with it. It
sits below `tf_twobranch.features`, `tf_twobranch.sampling` and
`tf_twobranch.export` so that none of them imports another for it. The
NumPy/PIL reader of image files is `tf_twobranch.data.formats.images.load_image`.
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tf_twobranch.errors import ConfigError

__all__ = ["TF_IMAGE_FORMATS", "describe_image_formats", "image_format", "tf_is_image_bytes", "tf_decode_image"]

# Magic bytes of the formats `tf_decode_image` reads, in the order they are
# named in error messages.
_IMAGE_MAGIC = {"JPEG": b"\xff\xd8\xff", "PNG": b"\x89PNG\r\n\x1a\n", "BMP": b"BM", "GIF": b"GIF"}
TF_IMAGE_FORMATS = tuple(_IMAGE_MAGIC)


def describe_image_formats(formats: Sequence[str] = TF_IMAGE_FORMATS) -> str:
    """"JPEG, PNG, BMP or GIF": the formats as error messages name them."""
    formats = list(formats)
    return formats[0] if len(formats) == 1 else ", ".join(formats[:-1]) + " or " + formats[-1]


def image_format(data: bytes, formats: Sequence[str] = TF_IMAGE_FORMATS) -> str | None:
    """The format among `formats` whose magic bytes `data` starts with, or None (the Python
    side of `tf_is_image_bytes`, for clients checking a request before sending it)."""
    data = bytes(data)
    return next((f for f in formats if data.startswith(_IMAGE_MAGIC[f])), None)


def tf_is_image_bytes(image_bytes, formats: Sequence[str] = TF_IMAGE_FORMATS):
    """Element-wise: does each string start with the magic bytes of one of `formats`?

    Args:
      image_bytes: a tf.string tensor of any shape.
      formats: names from `TF_IMAGE_FORMATS` ("JPEG", "PNG", "BMP", "GIF").

    Returns:
      a bool tensor of the shape of `image_bytes`.
    """
    unknown = [f for f in formats if f not in _IMAGE_MAGIC]
    if unknown or not formats:
        raise ConfigError(f"image formats must be some of {TF_IMAGE_FORMATS}, got {tuple(formats)!r}")
    image_bytes = tf.convert_to_tensor(image_bytes, tf.string)
    matches = [tf.strings.substr(image_bytes, 0, len(_IMAGE_MAGIC[f])) == _IMAGE_MAGIC[f] for f in formats]
    return tf.reduce_any(tf.stack(matches), axis=0)


def tf_decode_image(image_bytes, *, name: str | None = None, check_format: bool = True):
    """Decodes one encoded JPEG/PNG/BMP/GIF image into a uint8 (H, W, 3) tensor.

    JPEGs are decoded with libjpeg's accurate integer DCT, the decoder PIL
    uses, so pixels equal `tf_twobranch.data.formats.images.load_image`'s (TF's default fast DCT differs by up
    to ~20 grey levels); the other formats with `tf.io.decode_image` (the
    first frame of a GIF).  Grayscale is expanded to RGB, alpha dropped.

    Args:
      image_bytes: a scalar tf.string.
      name: names the image in the error message (default "image bytes").
      check_format: check the magic bytes first: bytes that are not a JPEG,
        PNG, BMP or GIF raise `tf.errors.InvalidArgumentError` "<name>:
        cannot decode image; expected JPEG, PNG, BMP or GIF bytes" before
        anything is decoded (in a graph too).  False for callers that have
        checked them already (`decode_jpeg_batch` checks a whole batch and
        names the bad element).  Bytes with valid magic bytes and a
        truncated or corrupt body fail with the decoder's own error.
    """
    image_bytes = tf.convert_to_tensor(image_bytes, tf.string)
    checks = []
    if check_format:
        label = name if name is not None else "image bytes"
        checks.append(tf.debugging.assert_equal(
            tf_is_image_bytes(image_bytes), True,
            message=f"{label}: cannot decode image; expected {describe_image_formats()} bytes"))
    with tf.control_dependencies(checks):
        image = tf.cond(
            tf.io.is_jpeg(image_bytes),
            lambda: tf.io.decode_jpeg(image_bytes, channels=3, dct_method="INTEGER_ACCURATE"),
            lambda: tf.ensure_shape(tf.io.decode_image(image_bytes, channels=3, expand_animations=False),
                                    [None, None, 3]))
    image.set_shape([None, None, 3])
    return image
