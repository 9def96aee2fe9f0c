"""Image loading and the crops used to feed CNN backbones.

Two implementations of the same geometry:

* NumPy/PIL (`load_image`, `resize`, `ten_crops`, `center_crop`) for the
  feature extractors, which read files one by one and validate them so that a
  bad file is reported as a `DataFormatError` naming it;
* TensorFlow (`tf_ten_crops`) for `tf.data` pipelines; images are decoded
  in TensorFlow by `tf_twobranch.image_decoding.tf_decode_image`.

`load_images_at_size` loads a folder's worth of images (of any sizes) into
one square uint8 array, for the networks trained on stacked images (the
scene CNN).

The ten-crop scheme is the one of Wang et al. (TPAMI 2018, §5.3) and Klein et
al.: the image is resized to `resize_to`×`resize_to` (256×256 in the paper,
aspect ratio not preserved), then cropped to `crop_size`×`crop_size` (224) at
the four corners and the centre, and the five crops are mirrored horizontally.
Crop order: top-left, top-right, bottom-left, bottom-right, centre, then the
mirror images of those five in the same order.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import tensorflow as tf
from absl import logging
from PIL import Image

from tf_twobranch.data.formats.images import image_file_shape, load_image
from tf_twobranch.errors import ConfigError

__all__ = [
    "CROP_NAMES",
    "DEFAULT_STACK_SIZE",
    "load_images_at_size",
    "resize",
    "resize_shorter_side",
    "center_crop",
    "crop_offsets",
    "ten_crops",
    "tf_ten_crops",
]

CROP_NAMES = (
    "top_left", "top_right", "bottom_left", "bottom_right", "center",
    "top_left_mirror", "top_right_mirror", "bottom_left_mirror",
    "bottom_right_mirror", "center_mirror",
)


# Side used by `load_images_at_size` when the images differ in size: the
# resolution the scene CNN's architecture was designed for (4 stride-2 blocks
# leave a 6x6 map for its 3x3 layout pooling) and that trains in minutes on a
# CPU.
DEFAULT_STACK_SIZE = 96


def load_images_at_size(paths: Sequence[str | os.PathLike], size: int | None = None, *,
                        default_size: int = DEFAULT_STACK_SIZE) -> np.ndarray:
    """Loads images of any sizes as one uint8 (N, S, S, 3) array.

    Each file is read with `load_image` and its *whole* image is resized
    (bilinear, antialiased by PIL when shrinking) to S×S; the aspect ratio is
    not kept.  This is the geometry of the ten-crop scheme (`ten_crops`, the
    paper's resize to 256×256) and of `extract_image_features` without ten
    crops, which is how networks trained on these arrays are later applied to
    the same files: training and feature extraction then see objects with the
    same distortion, and nothing is cut off (a centre crop of the shorter
    side would drop the edges of wide images, where captions often mention
    things).  Boxes in original pixel coordinates map to the array by scaling
    x by S/W and y by S/H.

    An image that already is S×S is not resized: its pixels are exactly
    those of `load_image`, so for equal-sized square images the result is
    bit-identical to ``np.stack([load_image(p) for p in paths])``.

    Args:
      paths: image files.
      size: the side S; None chooses it: the images' common side when they
        are all square and of the same size (no image is resized), otherwise
        `default_size`.  The choice is logged.
      default_size: the side used by ``size=None`` for images of different
        sizes or non-square images.

    Returns:
      uint8 array (N, S, S, 3), in the order of `paths`.

    Raises:
      DataFormatError: a file is missing or undecodable (named).
      ConfigError: a non-positive size.
    """
    paths = list(paths)
    if size is None:
        if default_size < 1:
            raise ConfigError(f"default_size must be positive, got {default_size}")
        shapes = {image_file_shape(p) for p in paths}
        if len(shapes) == 1 and len({*next(iter(shapes))}) == 1:
            size = next(iter(shapes))[0]
            logging.info("%d images, all %dx%d: stacked at their size", len(paths), size, size)
        else:
            size = default_size
            heights = [h for h, _ in shapes]
            widths = [w for _, w in shapes]
            logging.info("%d images of %d shape(s) (heights %d..%d, widths %d..%d), not all square "
                         "of one size: each resized to %dx%d (aspect ratio not kept; default_size)",
                         len(paths), len(shapes), min(heights, default=0), max(heights, default=0),
                         min(widths, default=0), max(widths, default=0), size, size)
    size = int(size)
    if size < 1:
        raise ConfigError(f"image size must be positive, got {size}")
    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    for index, path in enumerate(paths):
        image = load_image(path)
        out[index] = image if image.shape[:2] == (size, size) else resize(image, size, size)
    return out


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


def tf_ten_crops(image, crop_size: int = 224, resize_to: int = 256):
    """TensorFlow version of `ten_crops` for one (H, W, 3) image tensor.

    The resize uses bilinear filtering with antialiasing, so values differ
    slightly from the PIL version; the geometry and crop order are the same.

    Returns:
      float32 tensor (10, crop_size, crop_size, 3) in CROP_NAMES order, values
      in the input's range (0..255 for uint8 input).
    """
    if crop_size < 1 or resize_to < crop_size:
        raise ConfigError(f"need 1 <= crop_size <= resize_to, got crop_size={crop_size}, resize_to={resize_to}")
    image = tf.cast(image, tf.float32)
    resized = tf.image.resize(image, [resize_to, resize_to], method="bilinear", antialias=True)
    crops = [resized[t:t + crop_size, l:l + crop_size, :] for t, l in crop_offsets(resize_to, crop_size)]
    crops = tf.stack(crops, axis=0)
    return tf.concat([crops, tf.reverse(crops, axis=[2])], axis=0)
