"""A small CNN trained from scratch on the training captions' words.

No ImageNet weights can be downloaded at run time, and randomly initialised
VGG/ResNet features are useless.  For the small synthetic dataset shipped with
the package (digit scenes, ~96×96), this module trains a compact image encoder
on the fly, with weak supervision from the *training* captions only, in the
spirit of pretraining on image tags: the network predicts, with independent
sigmoids, which of the most frequent non-stop-words occur in the image's
captions (target = fraction of the image's captions containing the word).
The image feature is the batch-normalised pre-activation of the penultimate
layer (`feature_dim`-d, no ReLU: no dead units, suited to linear models).

Architecture: four conv–BN–ReLU blocks (a stride-2 3×3 conv, optionally
followed by 3×3 convs), after an extra input channel (colour distance from the
image's mean colour, see `ForegroundContrast`), then global max pooling concatenated with a coarse
`spatial_grid`×`spatial_grid` max pooling (so that layout words such as
"left"/"above" stay predictable; max rather than average pooling because the
digits cover a small part of the image), then FC `feature_dim` + BN (the
features), then ReLU, dropout and the word classifier (dropped from the
returned extractor).
"""
from __future__ import annotations

import collections
import os
import pathlib
import time
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from PIL import Image

from tf_twobranch.data.formats.images import image_file_shape, load_image
from tf_twobranch.data.formats.row_arrays import temp_beside
from tf_twobranch.data.phrases import build_phrase_examples
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError, DataFormatError

__all__ = [
    "STOP_WORDS",
    "build_caption_word_vocabulary",
    "caption_word_targets",
    "build_scene_cnn",
    "entity_region_crops",
    "masked_region_image",
    "square_region_crop",
    "train_scene_cnn",
    "save_scene_cnn",
    "load_scene_cnn",
]

# Function words that say nothing about image content.
STOP_WORDS = frozenset("""
a an the and or but nor of to in on at by for with from into onto over under
is are was were be been being am it its this that these those there here
he she they them his her their we you i me my our your who whom which what
as than then so too very just also not no yes do does did done has have had
up down out off about some any each every both all other another such only own
same can will would should could may might must while where when how why
one's s 's , . ; : ! ? " ' - ( )
""".split())

FEATURE_LAYER_NAME = "scene_features"


@keras.saving.register_keras_serializable(package="tf_twobranch")
class ForegroundContrast(keras.layers.Layer):
    """Appends each pixel's colour distance from the image's mean colour.

    The mean colour of a scene is essentially its background, so this channel
    outlines the objects whatever their hue; the digit *shapes* can then be
    learned once instead of once per (digit colour, background tint) pair.
    """

    def call(self, inputs):
        mean = keras.ops.mean(inputs, axis=(1, 2), keepdims=True)
        distance = keras.ops.sqrt(keras.ops.sum(keras.ops.square(inputs - mean), axis=-1, keepdims=True) + 1e-6)
        return keras.ops.concatenate([inputs, distance - 0.5], axis=-1)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], input_shape[-1] + 1)


def build_caption_word_vocabulary(token_lists_per_image: Sequence[Sequence[Sequence[str]]],
                                  *, vocab_size: int = 300, min_images: int = 2) -> list[str]:
    """The `vocab_size` content words occurring in the most images.

    Words are lower-cased; stop words and tokens without a letter are
    excluded; a word must occur in the captions of at least `min_images`
    images.  Ties are broken alphabetically (deterministic).
    """
    image_counts: collections.Counter[str] = collections.Counter()
    for captions in token_lists_per_image:
        words = {t.lower() for tokens in captions for t in tokens}
        image_counts.update(w for w in words if w not in STOP_WORDS and any(ch.isalnum() for ch in w))
    ranked = sorted((w for w, c in image_counts.items() if c >= min_images),
                    key=lambda w: (-image_counts[w], w))
    return ranked[:vocab_size]


def caption_word_targets(token_lists_per_image: Sequence[Sequence[Sequence[str]]],
                         vocabulary: Sequence[str]) -> np.ndarray:
    """(N, V) float32: fraction of each image's captions that contain each word."""
    index = {w: i for i, w in enumerate(vocabulary)}
    targets = np.zeros((len(token_lists_per_image), len(vocabulary)), dtype=np.float32)
    for row, captions in enumerate(token_lists_per_image):
        if not captions:
            continue
        for tokens in captions:
            for col in {index[t.lower()] for t in tokens if t.lower() in index}:
                targets[row, col] += 1.0
        targets[row] /= len(captions)
    return targets


def _image_and_box(image, box, caller: str) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """An (H, W, 3) image and an inclusive [x1, y1, x2, y2] box, checked."""
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[2] != 3:
        raise ConfigError(f"{caller} expects an (H, W, 3) image, got {image.shape}")
    x1, y1, x2, y2 = (float(v) for v in box)
    if not (x2 >= x1 and y2 >= y1):
        raise ConfigError(f"{caller}: box {list(box)} is not [x1, y1, x2, y2] with x2 >= x1, y2 >= y1")
    return image, (x1, y1, x2, y2)


def square_region_crop(image: np.ndarray, box: Sequence[float], size: int, *,
                       margin: float = 0.15, min_fraction: float = 0.0) -> np.ndarray:
    """A square crop around `box`, resized to `size`×`size` (uint8 RGB).

    `box` is ``[x1, y1, x2, y2]`` with inclusive 0-based pixel coordinates.
    The square's side is the box's longer side plus `margin` of it, so the
    object keeps its aspect ratio (digit shapes are not stretched); the
    square is shifted to stay inside the image and shrunk only when the image
    is smaller than it.  The side is at least `min_fraction` of the image's
    shorter side, which bounds the zoom factor (objects then keep a size
    closer to the one they have in whole images).
    """
    image, (x1, y1, x2, y2) = _image_and_box(image, box, "square_region_crop")
    height, width = image.shape[:2]
    side = int(round(max(x2 - x1 + 1, y2 - y1 + 1) * (1.0 + margin)))
    side = max(2, int(round(min_fraction * min(height, width))), min(side, height, width))
    side = min(side, height, width)
    centre_x, centre_y = (x1 + x2 + 1) / 2, (y1 + y2 + 1) / 2
    left = int(np.clip(round(centre_x - side / 2), 0, width - side))
    top = int(np.clip(round(centre_y - side / 2), 0, height - side))
    crop = np.ascontiguousarray(image[top:top + side, left:left + side].astype(np.uint8))
    return np.asarray(Image.fromarray(crop).resize((size, size), Image.BILINEAR), dtype=np.uint8)


def masked_region_image(image: np.ndarray, box: Sequence[float], size: int, *,
                        margin: float = 0.1) -> np.ndarray:
    """The image with everything outside `box` replaced by its median colour.

    Unlike `square_region_crop` the object keeps its position and scale in
    the image, so what a network learns from it transfers to whole images
    (where objects are small).  `box` is ``[x1, y1, x2, y2]``, inclusive
    0-based pixels, enlarged by `margin` of its size on each side.  The
    result is resized to `size`×`size` (uint8 RGB).
    """
    image, (x1, y1, x2, y2) = _image_and_box(image, box, "masked_region_image")
    height, width = image.shape[:2]
    pad_x, pad_y = margin * (x2 - x1 + 1), margin * (y2 - y1 + 1)
    left, right = int(max(0, np.floor(x1 - pad_x))), int(min(width, np.ceil(x2 + 1 + pad_x)))
    top, bottom = int(max(0, np.floor(y1 - pad_y))), int(min(height, np.ceil(y2 + 1 + pad_y)))
    out = np.empty_like(image, dtype=np.uint8)
    out[...] = np.median(image.reshape(-1, 3), axis=0).astype(np.uint8)
    out[top:bottom, left:right] = image[top:bottom, left:right]
    if (height, width) != (size, size):
        out = np.asarray(Image.fromarray(out).resize((size, size), Image.BILINEAR), dtype=np.uint8)
    return out


def entity_region_crops(entities_root: str | os.PathLike, image_ids: Sequence[str],
                        images: np.ndarray, *, image_paths: Sequence[str | os.PathLike] | None = None
                        ) -> tuple[np.ndarray, list[list[list[str]]]] | None:
    """Crops of the entity boxes of `images` and the tokens of their phrases.

    Reads the Flickr30K-Entities files (``<entities_root>/Annotations`` and
    ``Sentences``) of `image_ids` (pass the *training* images only), and
    returns ``(crops, token_lists)`` for `train_scene_cnn`'s region
    supervision: one `square_region_crop` per distinct box, at the images'
    size, with the tokenised phrases of all the sentences referring to it.
    Returns None when ``<entities_root>/Annotations`` does not exist or no
    phrase has a box.

    The boxes are in the pixel coordinates of the image *files*.  When
    `images` were resized (`tf_twobranch.data.formats.images.load_images_at_size`
    on files of other sizes), pass the files as `image_paths`: the crop of a
    box is then taken from the original image (full resolution, the object's
    aspect ratio kept) and resized to the images' size.  Rows whose file
    already has the array's size are cropped from `images` directly (no
    second decoding, the same pixels).
    """
    entities_root = pathlib.Path(entities_root)
    if not (entities_root / "Annotations").is_dir():
        return None
    images = np.asarray(images)
    if images.ndim != 4 or len(images) != len(image_ids):
        raise ConfigError(f"entity_region_crops needs one (S, S, 3) image per id: got {len(image_ids)} ids "
                          f"and images of shape {images.shape}")
    if image_paths is not None and len(image_paths) != len(image_ids):
        raise ConfigError(f"entity_region_crops got {len(image_paths)} image paths for {len(image_ids)} ids")
    row = {image_id: i for i, image_id in enumerate(image_ids)}
    phrases_by_box: dict[tuple, list[list[str]]] = {}
    for example in build_phrase_examples(entities_root, list(image_ids)):
        key = (example.image_id, tuple(float(v) for v in example.gt_box))
        phrases_by_box.setdefault(key, []).append(tokenize_caption(example.phrase))
    if not phrases_by_box:
        return None
    size = images.shape[1]
    originals: dict[str, np.ndarray] = {}

    def source(image_id: str) -> np.ndarray:
        """The image whose pixel coordinates the boxes use."""
        if image_paths is None:
            return images[row[image_id]]
        if image_id not in originals:
            path = image_paths[row[image_id]]
            originals.clear()  # boxes come grouped by image: keep one decoded image
            originals[image_id] = (images[row[image_id]] if image_file_shape(path) == images.shape[1:3]
                                   else load_image(path))
        return originals[image_id]

    crops = np.stack([square_region_crop(source(image_id), box, size) for image_id, box in phrases_by_box])
    logging.info("scene_cnn region supervision: %d box crops of %d images from %s",
                 len(crops), len(image_ids), entities_root)
    return crops, list(phrases_by_box.values())


def build_scene_cnn(input_size: int, num_words: int, *, feature_dim: int = 1024,
                    widths: Sequence[int] = (16, 32, 64, 128), convs_per_block: Sequence[int] = (1, 1, 2, 2),
                    spatial_grid: int = 3, pooling: str = "max",
                    foreground_channel: bool = True) -> tuple[keras.Model, keras.Model]:
    """Builds (classifier, feature_extractor) sharing their layers.

    The models take (batch, input_size, input_size, 3) RGB in 0..255.  The
    features are the batch-normalised *pre-activation* of the feature layer
    (no ReLU), so that no unit is dead and they suit linear models.
    """
    if input_size < 2 ** len(widths) or feature_dim < 1 or num_words < 1:
        raise ConfigError(f"scene_cnn needs input_size >= {2 ** len(widths)}, feature_dim >= 1 and "
                          f"a non-empty vocabulary (got {input_size}, {feature_dim}, {num_words})")
    if pooling not in ("max", "avg"):
        raise ConfigError(f"scene_cnn pooling must be 'max' or 'avg', got {pooling!r}")
    images = keras.Input((input_size, input_size, 3), name="images")
    x = keras.layers.Rescaling(1.0 / 127.5, offset=-1.0, name="rescale")(images)
    if foreground_channel:
        x = ForegroundContrast(name="foreground_contrast")(x)
    if len(convs_per_block) != len(widths) or min(convs_per_block) < 1:
        raise ConfigError(f"convs_per_block {tuple(convs_per_block)} must give >= 1 conv for each of {len(widths)} blocks")
    for block, (width, num_convs) in enumerate(zip(widths, convs_per_block), start=1):
        # The first conv of a block halves the resolution; the others keep it.
        for conv, stride in enumerate([2] + [1] * (num_convs - 1), start=1):
            x = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False,
                                    name=f"block{block}_conv{conv}")(x)
            x = keras.layers.BatchNormalization(name=f"block{block}_bn{conv}")(x)
            x = keras.layers.ReLU(name=f"block{block}_relu{conv}")(x)
    # Digits cover a small part of the image: max pooling reports "is there a
    # red 4 somewhere" where average pooling dilutes it in the background.
    global_pool = keras.layers.GlobalMaxPooling2D if pooling == "max" else keras.layers.GlobalAveragePooling2D
    pooled = [global_pool(name="global_pool")(x)]
    side = x.shape[1]
    if spatial_grid > 1 and side >= spatial_grid:
        # Pooling into a coarse grid keeps layout (left/right, top/bottom).
        pool = side // spatial_grid
        grid_pool = keras.layers.MaxPooling2D if pooling == "max" else keras.layers.AveragePooling2D
        grid = grid_pool(pool, strides=pool, name="grid_pool")(x)
        pooled.append(keras.layers.Flatten(name="grid_flatten")(grid))
    x = keras.layers.Concatenate(name="pooled")(pooled) if len(pooled) > 1 else pooled[0]
    x = keras.layers.Dense(feature_dim, use_bias=False, name="feature_dense")(x)
    features = keras.layers.BatchNormalization(name=FEATURE_LAYER_NAME)(x)
    hidden = keras.layers.ReLU(name="feature_relu")(features)
    logits = keras.layers.Dense(num_words, name="word_logits")(keras.layers.Dropout(0.3, name="dropout")(hidden))
    classifier = keras.Model(images, logits, name="scene_cnn_word_classifier")
    extractor = keras.Model(images, features, name="scene_cnn_features")
    return classifier, extractor


def _augmented_dataset(images: np.ndarray, targets: np.ndarray, batch_size: int, seed: int,
                       max_scale: float):
    """Random zoom-in (scale 1..max_scale) and crop: mimics the ten-crop views.

    Applied per batch (one scale and offset per batch) to keep the CPU cost
    negligible next to training.
    """
    size = images.shape[1]

    def augment(batch, target):
        scale = tf.random.uniform([], 1.0, max_scale)
        side = tf.cast(tf.math.round(scale * size), tf.int32)
        batch = tf.image.resize(tf.cast(batch, tf.float32), [side, side])
        top = tf.random.uniform([], 0, side - size + 1, dtype=tf.int32)
        left = tf.random.uniform([], 0, side - size + 1, dtype=tf.int32)
        return batch[:, top:top + size, left:left + size, :], target

    dataset = tf.data.Dataset.from_tensor_slices((images, targets))
    dataset = dataset.shuffle(len(images), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.batch(batch_size).map(augment, num_parallel_calls=1)
    return dataset.prefetch(2)


def train_scene_cnn(images: np.ndarray, token_lists_per_image: Sequence[Sequence[Sequence[str]]], *,
                    feature_dim: int = 1024, epochs: int = 12, batch_size: int = 32,
                    learning_rate: float = 5e-3, vocab_size: int = 300,
                    widths: Sequence[int] = (32, 64, 128, 128), convs_per_block: Sequence[int] = (1, 1, 1, 1),
                    spatial_grid: int = 3, pooling: str = "max", foreground_channel: bool = True,
                    augment_max_scale: float = 1.15,
                    region_crops: np.ndarray | None = None,
                    region_token_lists: Sequence[Sequence[Sequence[str]]] | None = None,
                    binary_targets: bool = False,
                    seed: int = 0) -> keras.Model:
    """Trains the scene CNN on caption words and returns its feature extractor.

    Args:
      images: uint8 (N, S, S, 3) training images (square, all the same size;
        `tf_twobranch.data.formats.images.load_images_at_size` brings files of
        any sizes to this form).
      token_lists_per_image: for each image, its captions as token lists
        (training captions only: the features must not see test text).
      feature_dim: dimension of the returned features.
      epochs, batch_size, learning_rate: Adam training schedule (cosine decay).
      vocab_size: number of caption words predicted (most frequent non-stop-words).
      widths, convs_per_block: channels and number of convolutions of the
        conv blocks (each block starts with a stride-2 convolution).
      spatial_grid: side of the coarse layout pooling (1 = global pooling only).
      augment_max_scale: random zoom-in range used as augmentation (1 = none).
      region_crops: optional uint8 (R, S, S, 3) crops of annotated object
        boxes of the training images (see `square_region_crop`), trained on
        together with the whole images -- the analogue of a backbone
        fine-tuned on detection boxes.  Objects fill a crop, so their shapes
        (digit identities) become learnable, not only their colours.
      region_token_lists: for each crop, the token lists of the phrases
        describing its box (e.g. ``[["small", "red", "seven"]]``); required
        with `region_crops`.
      binary_targets: target 1 when a word occurs in any caption/phrase of
        the image/crop, instead of the fraction of captions containing it.
      seed: seeds Keras/TF/NumPy global generators (`keras.utils.set_random_seed`).

    Returns:
      A `keras.Model` (S×S×3 RGB in 0..255 → `feature_dim` features) whose
      attribute `vocabulary` lists the predicted words (not saved with it).
    """
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[3] != 3 or images.shape[1] != images.shape[2]:
        raise ConfigError(f"train_scene_cnn expects square RGB images (N, S, S, 3), got {images.shape}; "
                          "load image files of any sizes with tf_twobranch.data.formats.images.load_images_at_size")
    if images.dtype != np.uint8:
        raise ConfigError(f"train_scene_cnn expects uint8 images, got {images.dtype}")
    if len(token_lists_per_image) != len(images):
        raise ConfigError(f"got {len(images)} images but captions for {len(token_lists_per_image)}")
    if epochs < 1 or batch_size < 1:
        raise ConfigError(f"epochs and batch_size must be positive, got {epochs}, {batch_size}")
    if (region_crops is None) != (region_token_lists is None):
        raise ConfigError("train_scene_cnn needs both region_crops and region_token_lists, or neither")
    if region_crops is not None:
        region_crops = np.asarray(region_crops)
        if region_crops.dtype != np.uint8 or region_crops.ndim != 4 or region_crops.shape[1:] != images.shape[1:]:
            raise ConfigError(f"region_crops must be uint8 of shape (R, {images.shape[1]}, {images.shape[2]}, 3) "
                              f"like the images, got {region_crops.dtype} {region_crops.shape}")
        if len(region_token_lists) != len(region_crops):
            raise ConfigError(f"got {len(region_crops)} region crops but phrases for {len(region_token_lists)}")
        all_token_lists = list(token_lists_per_image) + list(region_token_lists)
    else:
        all_token_lists = list(token_lists_per_image)
    vocabulary = build_caption_word_vocabulary(all_token_lists, vocab_size=vocab_size)
    if not vocabulary:
        raise ConfigError("no caption word occurs in two or more training images; cannot train scene_cnn")
    targets = caption_word_targets(all_token_lists, vocabulary)
    if binary_targets:
        targets = (targets > 0).astype(np.float32)
    if region_crops is not None and len(region_crops):
        images = np.concatenate([images, region_crops])

    keras.utils.set_random_seed(seed)
    classifier, extractor = build_scene_cnn(images.shape[1], len(vocabulary), feature_dim=feature_dim,
                                            widths=widths, convs_per_block=convs_per_block,
                                            spatial_grid=spatial_grid, pooling=pooling,
                                            foreground_channel=foreground_channel)
    steps = epochs * int(np.ceil(len(images) / batch_size))
    schedule = keras.optimizers.schedules.CosineDecay(learning_rate, decay_steps=steps, alpha=0.05)
    classifier.compile(optimizer=keras.optimizers.Adam(schedule),
                       loss=keras.losses.BinaryCrossentropy(from_logits=True),
                       jit_compile=False)  # XLA is 2-3x slower for this model on CPU
    if augment_max_scale > 1.0:
        data = _augmented_dataset(images, targets, batch_size, seed, augment_max_scale)
    else:
        data = (tf.data.Dataset.from_tensor_slices((images.astype(np.float32), targets))
                .shuffle(len(images), seed=seed).batch(batch_size))
    logging.info("Training scene_cnn on %d images of %dx%d (%d region crops), %d caption words, %d epochs",
                 len(images), images.shape[1], images.shape[2],
                 0 if region_crops is None else len(region_crops), len(vocabulary), epochs)
    start = time.time()
    history = classifier.fit(data, epochs=epochs, verbose=0, shuffle=False)  # shuffled by tf.data
    logging.info("scene_cnn trained in %.1f s, final loss %.4f", time.time() - start,
                 history.history["loss"][-1])
    extractor.vocabulary = list(vocabulary)
    return extractor


def save_scene_cnn(model: keras.Model, path: str | os.PathLike) -> None:
    """Saves a scene_cnn feature extractor to a ``.keras`` file."""
    path = pathlib.Path(path)
    if path.suffix != ".keras":
        raise ConfigError(f"scene_cnn models are saved as .keras files, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole, then renamed: a concurrent reader (another test worker or
    # run sharing the cache) never sees a partial file.
    tmp = temp_beside(path)
    model.save(tmp)
    os.replace(tmp, path)


def load_scene_cnn(path: str | os.PathLike) -> keras.Model:
    """Loads a feature extractor saved by `save_scene_cnn`.

    Raises:
      DataFormatError: missing file, not a ``.keras`` archive, or a model that
        is not an image feature extractor.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise DataFormatError(path, "scene_cnn model file does not exist; expected a .keras file "
                              "written by save_scene_cnn")
    if path.suffix != ".keras":
        raise DataFormatError(path, "expected a .keras model file written by save_scene_cnn")
    try:
        model = keras.saving.load_model(path, compile=False)
    except Exception as err:  # noqa: BLE001 - Keras raises many types for bad archives
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataFormatError(path, f"cannot load Keras model ({first_line})") from None
    shape = model.input_shape
    if not (isinstance(shape, tuple) and len(shape) == 4 and shape[3] == 3 and shape[1] and shape[1] == shape[2]):
        raise DataFormatError(path, f"expected an image model with square RGB input, found input shape {shape}")
    return model
