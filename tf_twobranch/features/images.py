"""Image loading and the crops used to feed CNN backbones.

Two implementations of the same geometry:

* NumPy/PIL (`load_image`, `resize`, `ten_crops`, `center_crop`) for the
  feature extractors, which read files one by one and validate them so that a
  bad file is reported as a `DataFormatError` naming it;
* TensorFlow (`tf_pil_resize`, `tf_ten_crops`) for graphs (`tf.data`
  pipelines, SavedModels); images are decoded in TensorFlow by
  `tf_twobranch.image_decoding.tf_decode_image` (pixels equal PIL's), and
  `tf_pil_resize` is bit-exact to PIL's bilinear resize of uint8 images, so a
  SavedModel that takes JPEG bytes sees exactly the pixels the NumPy/PIL
  feature extractors saw.

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
import PIL
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
    "tf_pil_resize",
    "tf_ten_crops",
    "image_views",
    "tf_image_views",
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


def image_views(image: np.ndarray, input_size: int, *, ten_crop: bool, crop_size: int,
                resize_to: int) -> np.ndarray:
    """The views of one image a backbone encodes (their outputs are averaged into its feature).

    With `ten_crop`, the `ten_crops` of `crop_size` out of `resize_to`, each
    resized to `input_size` when it differs (the scene CNN's 7/8 crops);
    otherwise the whole image resized to `input_size`. `tf_image_views` is the
    same in a graph.

    Returns:
      (10 or 1, input_size, input_size, 3) array of the image's dtype.
    """
    if not ten_crop:
        return resize(image, input_size, input_size)[None]
    crops = ten_crops(image, crop_size=crop_size, resize_to=resize_to)
    if crop_size != input_size:
        crops = np.stack([resize(c, input_size, input_size) for c in crops])
    return crops


# --------------------------------------------------------------------------
# TensorFlow versions for tf.data pipelines.


# PIL's fixed-point resampling: coefficients scaled by 2**22, the sum started at
# half a unit so that the shift rounds, the result clipped to 0..255.
_PIL_PRECISION_BITS = 22


def _pil_bilinear_coefficients(in_size, out_size):
    """(out_size, in_size) float64 matrix of PIL's fixed-point bilinear weights.

    The rule of Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc``
    (libImaging/Resample.c): output pixel o covers input pixels
    [xmin, xmax) around centre (o + 0.5)·scale with the triangle filter
    widened by the scale when shrinking (antialiasing); weights are divided
    by their sum (accumulated left to right, as PIL does: a cumulative sum,
    whose last column is the sequential sum) and rounded to integers of
    2**22. Every entry is an integer, so a float64 matmul of uint8 pixels by
    this matrix is exact.
    """
    in_f = tf.cast(in_size, tf.float64)
    scale = in_f / tf.cast(out_size, tf.float64)
    filterscale = tf.maximum(scale, 1.0)
    support = filterscale                       # the bilinear filter's support is 1
    center = (tf.range(out_size, dtype=tf.float64) + 0.5) * scale
    # C casts truncate; negative starts are clipped to 0 anyway, so floor is the same.
    xmin = tf.maximum(tf.floor(center - support + 0.5), 0.0)
    xmax = tf.minimum(tf.floor(center + support + 0.5), in_f)
    x = tf.range(in_size, dtype=tf.float64)[tf.newaxis, :]
    inside = (x >= xmin[:, tf.newaxis]) & (x < xmax[:, tf.newaxis])
    distance = tf.abs((x - center[:, tf.newaxis] + 0.5) * (1.0 / filterscale))
    weights = tf.where(inside & (distance < 1.0), 1.0 - distance, tf.zeros_like(distance))
    total = tf.math.cumsum(weights, axis=1)[:, -1:]
    weights = tf.where(total != 0.0, weights / tf.where(total != 0.0, total, 1.0), weights)
    return tf.floor(0.5 + weights * float(1 << _PIL_PRECISION_BITS))


def _pil_pass(image, coefficients, axis: int):
    """One PIL 8-bit resampling pass along `axis` (0 rows, 1 columns) of an (H, W, C) float64 image."""
    equation = "hwc,ow->hoc" if axis == 1 else "hwc,oh->owc"
    total = tf.einsum(equation, image, coefficients) + float(1 << (_PIL_PRECISION_BITS - 1))
    return tf.clip_by_value(tf.floor(total / float(1 << _PIL_PRECISION_BITS)), 0.0, 255.0)


def _pillow_picks_pass_order() -> bool:
    """Pillow 13 runs the vertical pass first when the height shrinks by more than twice
    the width's shrink (libImaging/Resample.c, ``horizontal_first``); older Pillows always
    start with the horizontal pass. The passes round in between, so the order shows."""
    return int(PIL.__version__.split(".")[0]) >= 13


def tf_pil_resize(image, height, width):
    """Resizes a uint8 (H, W, C) image to (height, width, C) exactly as PIL's bilinear resize.

    Bit-exact to ``Image.fromarray(image).resize((width, height), Image.BILINEAR)``
    (`resize` on uint8 images) with the installed Pillow: two fixed-point
    passes, each rounded to uint8 and skipped when that side keeps its size,
    in Pillow's order (the horizontal pass first, except — Pillow >= 13 —
    when the height shrinks by more than twice as many pixels as the width).
    `height` and `width` may be tensors.

    Returns:
      uint8 tensor (height, width, C).
    """
    image = tf.convert_to_tensor(image)
    if image.dtype != tf.uint8:
        raise ConfigError(f"tf_pil_resize takes uint8 images, got {image.dtype.name}")
    height = tf.convert_to_tensor(height, tf.int32)
    width = tf.convert_to_tensor(width, tf.int32)
    shape = tf.shape(image)
    pixels = tf.cast(image, tf.float64)

    def horizontal(x):
        return tf.cond(tf.equal(tf.shape(x)[1], width), lambda: x,
                       lambda: _pil_pass(x, _pil_bilinear_coefficients(tf.shape(x)[1], width), axis=1))

    def vertical(x):
        return tf.cond(tf.equal(tf.shape(x)[0], height), lambda: x,
                       lambda: _pil_pass(x, _pil_bilinear_coefficients(tf.shape(x)[0], height), axis=0))

    if _pillow_picks_pass_order():
        shrink_h, shrink_w = shape[0] - height, shape[1] - width
        vertical_first = (shrink_h > 0) & (shrink_h > 2 * shrink_w)
        pixels = tf.cond(vertical_first, lambda: horizontal(vertical(pixels)),
                         lambda: vertical(horizontal(pixels)))
    else:
        pixels = vertical(horizontal(pixels))
    return tf.cast(pixels, tf.uint8)


def tf_ten_crops(image, crop_size: int = 224, resize_to: int = 256):
    """TensorFlow version of `ten_crops` for one (H, W, 3) image tensor.

    A uint8 image is resized by `tf_pil_resize`, so the crops equal
    `ten_crops`' exactly; other dtypes are resized by TensorFlow's
    antialiased bilinear filter (values differ slightly from PIL's float
    resize; the geometry and crop order are the same).

    Returns:
      float32 tensor (10, crop_size, crop_size, 3) in CROP_NAMES order, values
      in the input's range (0..255 for uint8 input).
    """
    if crop_size < 1 or resize_to < crop_size:
        raise ConfigError(f"need 1 <= crop_size <= resize_to, got crop_size={crop_size}, resize_to={resize_to}")
    image = tf.convert_to_tensor(image)
    if image.dtype == tf.uint8:
        resized = tf.cast(tf_pil_resize(image, resize_to, resize_to), tf.float32)
    else:
        resized = tf.image.resize(tf.cast(image, tf.float32), [resize_to, resize_to],
                                  method="bilinear", antialias=True)
    crops = [resized[t:t + crop_size, l:l + crop_size, :] for t, l in crop_offsets(resize_to, crop_size)]
    crops = tf.stack(crops, axis=0)
    return tf.concat([crops, tf.reverse(crops, axis=[2])], axis=0)


def tf_image_views(image, input_size: int, *, ten_crop: bool, crop_size: int, resize_to: int):
    """`image_views` of one uint8 (H, W, 3) image tensor, bit-exact to it (`tf_pil_resize`).

    Returns:
      float32 tensor (10 or 1, input_size, input_size, 3), values 0..255.
    """
    image = tf.convert_to_tensor(image)
    if image.dtype != tf.uint8:
        raise ConfigError(f"tf_image_views takes uint8 images, got {image.dtype.name}")
    if not ten_crop:
        return tf.cast(tf_pil_resize(image, input_size, input_size), tf.float32)[tf.newaxis]
    crops = tf_ten_crops(image, crop_size=crop_size, resize_to=resize_to)
    if crop_size == input_size:
        return crops
    # PIL resizes every channel alone, so the ten crops resize as one image of
    # 30 channels: one pair of passes instead of ten, the same integers.
    channels = tf.reshape(tf.transpose(tf.cast(crops, tf.uint8), [1, 2, 0, 3]), [crop_size, crop_size, 30])
    resized = tf.reshape(tf_pil_resize(channels, input_size, input_size), [input_size, input_size, 10, 3])
    return tf.cast(tf.transpose(resized, [2, 0, 1, 3]), tf.float32)
