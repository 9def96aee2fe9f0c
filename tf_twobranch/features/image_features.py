"""Whole-image and region features from a CNN backbone.

* `extract_image_features`: one vector per image; with `ten_crop` the paper's
  ten views (§5.3: resize to 256×256, four corners + centre + mirrors of
  224×224) are encoded and their outputs averaged; without it the whole
  image is resized to the backbone input.
* `extract_region_features`: one vector per box of an image, each box cropped
  once and warped to the backbone input (§4.3: single-crop region features).

Backbones are the models of `tf_twobranch.features.backbones` (or a scene_cnn
extractor): float RGB 0..255 in, (batch, D) out.
"""
from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Sequence, Union

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tf_twobranch.batching import inference_function
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.features.backbones import backbone_input_size
from tf_twobranch.data.formats.images import load_image
from tf_twobranch.features.images import image_views, resize

__all__ = ["extract_image_features", "extract_region_features", "default_resize_to", "view_settings",
           "validate_boxes"]

ImageLike = Union[str, os.PathLike, np.ndarray]


def default_resize_to(crop_size: int) -> int:
    """The paper's 256/224 ratio between the resized image and its crops."""
    return int(round(crop_size * 256 / 224))


def view_settings(backbone: keras.Model, *, ten_crop: bool = True, crop_size: int | None = None,
                  resize_to: int | None = None) -> dict:
    """The views `extract_image_features` encodes, its defaults resolved: ``{"input_size",
    "ten_crop", "crop_size", "resize_to"}`` (the keyword arguments of
    `tf_twobranch.features.images.image_views` / ``tf_image_views``), so a
    SavedModel taking JPEG bytes computes the features this module computed.

    Raises:
      ConfigError: invalid sizes.
    """
    input_size = backbone_input_size(backbone)
    crop_size = input_size if crop_size is None else int(crop_size)
    resize_to = default_resize_to(crop_size) if resize_to is None else int(resize_to)
    if ten_crop and not 1 <= crop_size <= resize_to:
        raise ConfigError(f"need 1 <= crop_size <= resize_to, got crop_size={crop_size}, resize_to={resize_to}")
    return {"input_size": input_size, "ten_crop": bool(ten_crop), "crop_size": crop_size, "resize_to": resize_to}


def _as_image(item: ImageLike, index: int) -> tuple[np.ndarray, str]:
    if isinstance(item, np.ndarray):
        if item.ndim != 3 or item.shape[2] != 3 or item.shape[0] < 1 or item.shape[1] < 1:
            raise ConfigError(f"image #{index} is an array of shape {item.shape}; expected (H, W, 3)")
        return item, f"<image #{index}>"
    return load_image(item), os.fspath(item)


def _run_backbone(backbone: keras.Model, views: np.ndarray) -> np.ndarray:
    # One traced graph per backbone: an eager Keras call costs ~30 % more per
    # batch of views on CPU.
    outputs = inference_function(backbone)(tf.constant(np.asarray(views, dtype=np.float32)))
    return keras.ops.convert_to_numpy(outputs).astype(np.float32)


def extract_image_features(image_paths: Sequence[ImageLike], backbone: keras.Model, *,
                           ten_crop: bool = True, crop_size: int | None = None,
                           resize_to: int | None = None, batch_size: int = 32,
                           log_every: int = 20) -> np.ndarray:
    """Encodes whole images.

    Args:
      image_paths: image files (or already loaded uint8 (H, W, 3) arrays).
      backbone: a model taking (batch, S, S, 3) float RGB in 0..255.
      ten_crop: average the outputs of the paper's ten crops; otherwise
        encode the whole image resized to S×S.
      crop_size: side of the ten crops before they are resized to the
        backbone input; default S (224 for VGG/ResNet).
      resize_to: side the image is resized to before cropping; default
        `crop_size`·256/224 (256 for 224 crops, 110 for a 96-pixel scene_cnn).
      batch_size: images per backbone call (×10 views with ten_crop).
      log_every: log progress every this many batches.

    Returns:
      float32 (N, D).

    Raises:
      DataFormatError: an image file is missing or undecodable.
      ConfigError: invalid sizes.
    """
    views = view_settings(backbone, ten_crop=ten_crop, crop_size=crop_size, resize_to=resize_to)
    input_size, crop_size, resize_to = views["input_size"], views["crop_size"], views["resize_to"]
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    num_images = len(image_paths)
    dim = int(backbone.output_shape[-1])
    features = np.zeros((num_images, dim), dtype=np.float32)
    views_per_image = 10 if ten_crop else 1
    num_batches = (num_images + batch_size - 1) // batch_size
    start = time.time()
    logging.info("Extracting %s features of %d images (%s)", backbone.name, num_images,
                 f"ten crops {crop_size} of {resize_to}" if ten_crop else f"whole image at {input_size}")

    def batch_views(first):
        return np.concatenate([image_views(_as_image(image_paths[index], index)[0], **views)
                               for index in range(first, min(first + batch_size, num_images))], axis=0)

    # The next batch is decoded and cropped (PIL and numpy, which release the
    # GIL) while the backbone runs on this one: the same views, in the same
    # batches, a share of the extraction's time less.
    firsts = list(range(0, num_images, batch_size))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as prepare:
        pending = prepare.submit(batch_views, firsts[0]) if firsts else None
        for batch_index, first in enumerate(firsts):
            views_of_batch = pending.result()
            if batch_index + 1 < num_batches:
                pending = prepare.submit(batch_views, firsts[batch_index + 1])
            outputs = _run_backbone(backbone, views_of_batch)
            count = len(views_of_batch) // views_per_image
            features[first:first + count] = outputs.reshape(count, views_per_image, dim).mean(axis=1)
            if (batch_index + 1) % log_every == 0 or batch_index + 1 == num_batches:
                logging.info("  %d/%d images (%.1f s)", first + count, num_images, time.time() - start)
    return features


def validate_boxes(boxes, image_height: int, image_width: int, *, source: str = "<image>") -> np.ndarray:
    """Checks (R, 4) boxes [x1, y1, x2, y2] in 0-based pixel coordinates.

    Boxes are half-open: the box covers columns x1 .. x2-1, so 0 <= x1 < x2 <=
    W and 0 <= y1 < y2 <= H. Fractional coordinates are allowed and expanded
    outward to whole pixels.

    Returns:
      int64 (R, 4) pixel boxes.

    Raises:
      DataFormatError naming `source` and the offending box index.
    """
    boxes = np.asarray(boxes, dtype=np.float64)
    if boxes.size == 0:
        return np.zeros((0, 4), dtype=np.int64)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise DataFormatError(source, f"expected boxes of shape (R, 4) as [x1, y1, x2, y2], got {boxes.shape}")
    for index, (x1, y1, x2, y2) in enumerate(boxes):
        if not np.all(np.isfinite([x1, y1, x2, y2])):
            raise DataFormatError(source, f"box has non-finite coordinates {boxes[index].tolist()}", record=index)
        if not (x1 < x2 and y1 < y2):
            raise DataFormatError(source, f"box {boxes[index].tolist()} is empty; expected x1 < x2 and y1 < y2",
                                  record=index)
        if x1 < 0 or y1 < 0 or x2 > image_width or y2 > image_height:
            raise DataFormatError(
                source, f"box {boxes[index].tolist()} lies outside the {image_width}x{image_height} image; "
                f"expected 0 <= x1 < x2 <= {image_width} and 0 <= y1 < y2 <= {image_height} "
                "(0-based, [x1, y1, x2, y2])", record=index)
    pixels = np.concatenate([np.floor(boxes[:, :2]), np.ceil(boxes[:, 2:])], axis=1).astype(np.int64)
    return pixels


def extract_region_features(image: ImageLike, boxes, backbone: keras.Model, *,
                            crop_size: int | None = None, batch_size: int = 64,
                            source: str | None = None) -> np.ndarray:
    """Encodes image regions, one single crop per box.

    Each box `image[y1:y2, x1:x2]` is warped (aspect ratio not kept, as in
    R-CNN/Fast R-CNN) to the backbone input size and encoded.

    Args:
      image: an image file or a uint8 (H, W, 3) array.
      boxes: (R, 4) [x1, y1, x2, y2], 0-based, half-open (see `validate_boxes`).
      backbone: a model taking (batch, S, S, 3) float RGB in 0..255.
      crop_size: side the regions are warped to; must equal the backbone
        input size S (the default).
      batch_size: regions per backbone call.
      source: name used in error messages for array input.

    Returns:
      float32 (R, D).

    Raises:
      DataFormatError: unreadable image or a box outside the image.
    """
    input_size = backbone_input_size(backbone)
    if crop_size is not None and crop_size != input_size:
        raise ConfigError(f"crop_size {crop_size} differs from the backbone input size {input_size}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    pixels, name = _as_image(image, 0)
    if source is not None:
        name = source
    boxes = validate_boxes(boxes, pixels.shape[0], pixels.shape[1], source=name)
    dim = int(backbone.output_shape[-1])
    features = np.zeros((len(boxes), dim), dtype=np.float32)
    for first in range(0, len(boxes), batch_size):
        crops = [resize(pixels[y1:y2, x1:x2], input_size, input_size)
                 for x1, y1, x2, y2 in boxes[first:first + batch_size]]
        features[first:first + len(crops)] = _run_backbone(backbone, np.stack(crops))
    logging.log_every_n(logging.INFO, "Encoded %d regions of %s", 100, len(boxes), name)
    return features
