"""Image loading and the crops used to feed CNN backbones.

Two implementations of the same geometry:

* NumPy/PIL (`load_image`, `resize`, `ten_crops`, `center_crop`) for the
  feature extractors, which read files one by one and validate them so that a
  bad file is reported as a `DataFormatError` naming it;
* TensorFlow (`tf_decode_image`, `tf_ten_crops`) for `tf.data` pipelines.

The ten-crop scheme is the one of Wang et al. (TPAMI 2018, §5.3) and Klein et
al.: the image is resized to `resize_to`×`resize_to` (256×256 in the paper,
aspect ratio not preserved), then cropped to `crop_size`×`crop_size` (224) at
the four corners and the centre, and the five crops are mirrored horizontally.
Crop order: top-left, top-right, bottom-left, bottom-right, centre, then the
mirror images of those five in the same order.
"""
from __future__ import annotations

import os
import pathlib

import numpy as np
from PIL import Image, UnidentifiedImageError

from tf_twobranch.errors import ConfigError, DataFormatError

__all__ = [
    "CROP_NAMES",
    "load_image",
    "resize",
    "resize_shorter_side",
    "center_crop",
    "crop_offsets",
    "ten_crops",
    "tf_decode_image",
    "tf_ten_crops",
]

CROP_NAMES = (
    "top_left", "top_right", "bottom_left", "bottom_right", "center",
    "top_left_mirror", "top_right_mirror", "bottom_left_mirror",
    "bottom_right_mirror", "center_mirror",
)


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


def _check_image_array(image: np.ndarray) -> np.ndarray:
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[2] != 3 or image.shape[0] < 1 or image.shape[1] < 1:
        raise ConfigError(f"expected an image array of shape (H, W, 3), got {image.shape}")
    return image


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resizes an (H, W, 3) image to (height, width, 3) with bilinear filtering.

    uint8 input stays uint8; float input is resized per channel in float32.
    """
    image = _check_image_array(image)
    if height < 1 or width < 1:
        raise ConfigError(f"resize target must be positive, got {height}x{width}")
    if image.shape[0] == height and image.shape[1] == width:
        return image.copy()
    if image.dtype == np.uint8:
        return np.asarray(Image.fromarray(image).resize((width, height), Image.BILINEAR))
    channels = [
        np.asarray(Image.fromarray(np.ascontiguousarray(image[:, :, c], dtype=np.float32), mode="F")
                   .resize((width, height), Image.BILINEAR))
        for c in range(3)
    ]
    return np.stack(channels, axis=-1)


def resize_shorter_side(image: np.ndarray, size: int) -> np.ndarray:
    """Resizes so that the shorter side equals `size`, keeping the aspect ratio."""
    image = _check_image_array(image)
    h, w = image.shape[:2]
    if h <= w:
        new_h, new_w = size, max(1, int(round(w * size / h)))
    else:
        new_h, new_w = max(1, int(round(h * size / w))), size
    return resize(image, new_h, new_w)


def center_crop(image: np.ndarray, crop_size: int) -> np.ndarray:
    """The central `crop_size`×`crop_size` window (the image must be large enough)."""
    image = _check_image_array(image)
    h, w = image.shape[:2]
    if crop_size > h or crop_size > w:
        raise ConfigError(f"crop_size {crop_size} is larger than the image ({h}x{w})")
    top, left = (h - crop_size) // 2, (w - crop_size) // 2
    return image[top:top + crop_size, left:left + crop_size].copy()


def crop_offsets(size: int, crop_size: int) -> list[tuple[int, int]]:
    """(top, left) of the five crops of a size×size image, in CROP_NAMES order."""
    far = size - crop_size
    mid = far // 2
    return [(0, 0), (0, far), (far, 0), (far, far), (mid, mid)]


def ten_crops(image: np.ndarray, crop_size: int = 224, resize_to: int = 256) -> np.ndarray:
    """The ten crops of the paper: corners, centre, and their horizontal mirrors.

    Args:
      image: (H, W, 3) array.
      crop_size: side of each square crop.
      resize_to: the image is first resized to resize_to×resize_to.

    Returns:
      (10, crop_size, crop_size, 3) array of the image's dtype, in CROP_NAMES order.
    """
    if crop_size < 1 or resize_to < crop_size:
        raise ConfigError(f"need 1 <= crop_size <= resize_to, got crop_size={crop_size}, resize_to={resize_to}")
    resized = resize(image, resize_to, resize_to)
    crops = [resized[t:t + crop_size, l:l + crop_size] for t, l in crop_offsets(resize_to, crop_size)]
    crops += [c[:, ::-1] for c in crops]
    return np.stack(crops, axis=0)


# --------------------------------------------------------------------------
# TensorFlow versions for tf.data pipelines.


def tf_decode_image(image_bytes, *, name: str | None = None):
    """Decodes JPEG/PNG/BMP/GIF bytes into a uint8 (H, W, 3) tensor.

    Grayscale is expanded to RGB, alpha dropped.  Undecodable bytes raise
    `tf.errors.InvalidArgumentError` whose message says which image (`name`,
    when given) could not be decoded and what was expected.
    """
    import tensorflow as tf

    label = name if name is not None else "image bytes"
    is_image = tf.logical_or(
        tf.logical_or(tf.io.is_jpeg(image_bytes), tf.strings.substr(image_bytes, 0, 8) == b"\x89PNG\r\n\x1a\n"),
        tf.logical_or(tf.strings.substr(image_bytes, 0, 2) == b"BM", tf.strings.substr(image_bytes, 0, 3) == b"GIF"),
    )
    tf.debugging.assert_equal(
        is_image, True,
        message=f"{label}: cannot decode image; expected JPEG, PNG, BMP or GIF bytes")
    # JPEGs are decoded with the accurate integer DCT so pixels equal PIL's
    # (load_image); TF's default fast DCT differs by up to ~20 grey levels.
    image = tf.cond(
        tf.io.is_jpeg(image_bytes),
        lambda: tf.io.decode_jpeg(image_bytes, channels=3, dct_method="INTEGER_ACCURATE"),
        lambda: tf.io.decode_image(image_bytes, channels=3, expand_animations=False))
    image.set_shape([None, None, 3])
    return image


def tf_ten_crops(image, crop_size: int = 224, resize_to: int = 256):
    """TensorFlow version of `ten_crops` for one (H, W, 3) image tensor.

    The resize uses bilinear filtering with antialiasing, so values differ
    slightly from the PIL version; the geometry and crop order are the same.

    Returns:
      float32 tensor (10, crop_size, crop_size, 3) in CROP_NAMES order, values
      in the input's range (0..255 for uint8 input).
    """
    import tensorflow as tf

    if crop_size < 1 or resize_to < crop_size:
        raise ConfigError(f"need 1 <= crop_size <= resize_to, got crop_size={crop_size}, resize_to={resize_to}")
    image = tf.cast(image, tf.float32)
    resized = tf.image.resize(image, [resize_to, resize_to], method="bilinear", antialias=True)
    crops = [resized[t:t + crop_size, l:l + crop_size, :] for t, l in crop_offsets(resize_to, crop_size)]
    crops = tf.stack(crops, axis=0)
    return tf.concat([crops, tf.reverse(crops, axis=[2])], axis=0)
