"""Input pipeline of the dual-path CNN with instance loss (Zheng et al., §3.2, §6.1-6.2).

The data of a split is a `tf_twobranch.systems.dual_path.data.DualPathData`
(image files, captions, word codes, the instance-loss class of every image;
built and validated by `dual_path_data_from_retrieval` /
`dual_path_data_from_pedes` there). This module turns it into batches.

Training batches (as the reference implementation, layumi/Image-Text-Embedding):

* an epoch is a random permutation of the training IMAGES (num_images //
  batch_size steps); each image is paired with a random caption of its class
  (one of its own captions; on CUHK-PEDES any caption of the same person);
* images: shorter side resized to 256, random 224 crop, random horizontal
  flip (§6.2); float32 RGB 0..255 (the model normalises);
* text: the code placed at a uniformly random offset in [0, max_len - len]
  with zeros before and after (position shift, §3.2), or left-aligned;
* optional ranking negatives: `num_negative_captions` (256 in the reference)
  random captions, one random caption each of random training images whose
  class is not in the batch, also position-shifted.

Every random choice is a stateless function of (seed, step) -- and, when
loading, of the row's image/caption index -- so a restarted run draws the
same batches, and splitting a global index batch between replicas
(`tf_twobranch.distribute.split_global_batch`: ``image_index`` and
``text_index`` are row keys) does not change any row's augmentation.

Test time (§6.2 and the reference's test scripts): the image feature is the
average of the image's and its horizontal flip's; the reference feeds the
whole image (no crop), so `test_image` resizes the whole image to
crop_size x crop_size by default ("full"; a fixed input size needs a square)
and offers the centre crop as an option. The reference sums the text feature
over every legal position shift of the code (`all_shifts`); `test_datasets`
produces those rows together with the caption each row belongs to.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_twobranch.systems.dual_path.data import DualPathData
from tf_twobranch.distribute import distribute_global_batches, without_autotuning
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.evaluation.split import EvaluationSplit
from tf_twobranch.image_decoding import tf_decode_image

logger = logging.getLogger(__name__)

__all__ = [
    "TEXT_SHIFTS", "TEST_IMAGE_MODES",
    "position_shift", "left_align", "all_shifts",
    "train_image", "test_image", "flip",
    "TrainData", "steps_per_epoch", "global_batch_indices", "index_batches", "batch_loader",
    "train_dataset", "distributed_train_dataset", "TestData", "test_datasets", "test_split",
]

TEXT_SHIFTS = ("position_shift", "left_align")
TEST_IMAGE_MODES = ("full", "center_crop")

_MASK32 = 0xFFFFFFFF


# --------------------------------------------------------------------------
# Text placement
# --------------------------------------------------------------------------

def _as_ragged(ids) -> tf.RaggedTensor:
    """Ragged (B, None) int32 codes; a dense (B, L) input is read as 0-padded rows."""
    if isinstance(ids, tf.RaggedTensor):
        return tf.cast(ids, tf.int32)
    ids = tf.convert_to_tensor(ids)
    ids = tf.cast(ids, tf.int32)
    if ids.shape.rank != 2:
        raise ConfigError(f"token ids must be a (batch, length) tensor, got shape {ids.shape}")
    return tf.RaggedTensor.from_tensor(ids, padding=0)


def _place(ids: tf.RaggedTensor, offsets, max_len: int) -> tf.Tensor:
    """Writes row b of `ids` at columns offsets[b] .. offsets[b] + len - 1 of a zero (B, max_len)."""
    lengths = tf.cast(ids.row_lengths(), tf.int32)
    tf.debugging.assert_less_equal(
        lengths, tf.constant(max_len, tf.int32),
        message=f"a caption code is longer than max_len={max_len}; codes are never truncated "
                "here (clip them upstream with long_captions='clip')")
    starts = tf.cast(ids.row_starts(), tf.int32)
    positions = tf.range(max_len, dtype=tf.int32)[None, :] - tf.cast(offsets, tf.int32)[:, None]
    valid = (positions >= 0) & (positions < lengths[:, None])
    flat = ids.flat_values
    index = tf.clip_by_value(starts[:, None] + positions, 0, tf.maximum(tf.size(flat) - 1, 0))
    values = tf.gather(tf.concat([flat, tf.zeros([1], tf.int32)], 0), index)
    return tf.where(valid, values, tf.zeros_like(values))


def _offsets_from_uniform(uniform, lengths, max_len: int):
    room = tf.maximum(max_len - lengths, 0) + 1  # number of legal offsets
    offsets = tf.cast(tf.floor(uniform * tf.cast(room, tf.float32)), tf.int32)
    return tf.minimum(offsets, room - 1)


def _seed_pair(seed):
    seed = tf.convert_to_tensor(seed)
    if seed.shape.rank == 0:
        return tf.stack([tf.cast(seed, tf.int64), tf.constant(0, tf.int64)])
    return tf.cast(seed, tf.int64)


def position_shift(ids, max_len: int, seed) -> tf.Tensor:
    """Position shift (§3.2): each code at a uniformly random offset in [0, max_len - len].

    Args:
      ids: tf.RaggedTensor (B, None) of word indices, or a dense (B, L) int
        tensor whose rows are left-aligned and 0-padded.
      max_len: the fixed text input length.
      seed: an int or a shape-(2,) int tensor (stateless RNG seed).

    Returns:
      int32 (B, max_len): zeros before and after every code. A code longer
      than `max_len` fails a TF assertion -- codes are never truncated here.
    """
    ids = _as_ragged(ids)
    lengths = tf.cast(ids.row_lengths(), tf.int32)
    uniform = tf.random.stateless_uniform(tf.shape(lengths), seed=_seed_pair(seed))
    return _place(ids, _offsets_from_uniform(uniform, lengths, max_len), max_len)


def left_align(ids, max_len: int) -> tf.Tensor:
    """The baseline placement (§6.4): codes start at column 0, zeros after."""
    ids = _as_ragged(ids)
    return _place(ids, tf.zeros_like(ids.row_lengths(), tf.int32), max_len)


def all_shifts(ids_1d, max_len: int) -> tf.Tensor:
    """Every legal placement of one code: int32 (max_len - len + 1, max_len), offset k in row k.

    The reference implementation sums the text features of all these rows at
    test time (averaging gives the same cosine ranking).
    """
    ids_1d = tf.cast(tf.reshape(tf.convert_to_tensor(ids_1d), [-1]), tf.int32)
    length = tf.size(ids_1d)
    tf.debugging.assert_less_equal(length, max_len, message=(
        f"a caption code is longer than max_len={max_len}; clip it upstream"))
    count = max_len - length + 1
    rows = tf.RaggedTensor.from_row_lengths(tf.tile(ids_1d, [count]),
                                            tf.fill([count], length))
    return _place(rows, tf.range(count, dtype=tf.int32), max_len)


def _all_shifts_numpy(code: np.ndarray, max_len: int) -> np.ndarray:
    count = max_len - len(code) + 1
    out = np.zeros((count, max_len), np.int32)
    for k in range(count):
        out[k, k:k + len(code)] = code
    return out


# --------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------

def _check_sizes(resize_to: int, crop_size: int) -> None:
    if crop_size < 1 or resize_to < crop_size:
        raise ConfigError(f"need 1 <= crop_size <= resize_to, got crop_size={crop_size}, "
                          f"resize_to={resize_to}")


def _decode(image_bytes, name=None):
    return tf_decode_image(image_bytes, name=name)


def _resize_shorter_side(image, size: int):
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    scale = size / tf.reduce_min(shape)
    new_shape = tf.maximum(tf.cast(tf.round(shape * scale), tf.int32), size)
    resized = tf.image.resize(tf.cast(image, tf.float32), new_shape, method="bilinear",
                              antialias=True)
    return tf.clip_by_value(resized, 0.0, 255.0)


def train_image(jpeg_bytes, *, resize_to: int = 256, crop_size: int = 224, seed) -> tf.Tensor:
    """Training augmentation (§6.2): decode → shorter side `resize_to` → random
    `crop_size` square crop → random horizontal flip.

    Args:
      jpeg_bytes: scalar tf.string of JPEG/PNG/BMP/GIF bytes.
      seed: shape-(2,) int tensor (or int) of the stateless RNG.

    Returns:
      float32 (crop_size, crop_size, 3), RGB values 0..255.
    """
    _check_sizes(resize_to, crop_size)
    seed = _seed_pair(seed)
    image = _resize_shorter_side(_decode(jpeg_bytes), resize_to)
    image = tf.image.stateless_random_crop(image, [crop_size, crop_size, 3], seed=seed)
    flip_seed = tf.stack([seed[0] + 1, seed[1]])
    image = tf.image.stateless_random_flip_left_right(image, seed=flip_seed)
    return tf.ensure_shape(image, [crop_size, crop_size, 3])


def test_image(jpeg_bytes, resize_to: int = 256, crop_size: int = 224,
               mode: str = "full") -> tf.Tensor:
    """Test-time image: float32 (crop_size, crop_size, 3), RGB 0..255.

    mode "full" (default): the whole image resized to crop_size x crop_size.
      The reference tests on the entire image (no crop; fully convolutional
      ResNet with global pooling); with a fixed square input the whole
      field of view needs a resize (the aspect ratio is not kept, as the
      reference's CUHK-PEDES images, resized to 256x256).
    mode "center_crop": shorter side to resize_to, central crop_size square
      (the usual ImageNet evaluation; loses the image borders).
    """
    _check_sizes(resize_to, crop_size)
    if mode not in TEST_IMAGE_MODES:
        raise ConfigError(f"test image mode must be one of {TEST_IMAGE_MODES}, got {mode!r}")
    image = tf.cast(_decode(jpeg_bytes), tf.float32)
    if mode == "full":
        image = tf.image.resize(image, [crop_size, crop_size], method="bilinear", antialias=True)
        image = tf.clip_by_value(image, 0.0, 255.0)
    else:
        image = _resize_shorter_side(image, resize_to)
        shape = tf.shape(image)
        top = (shape[0] - crop_size) // 2
        left = (shape[1] - crop_size) // 2
        image = image[top:top + crop_size, left:left + crop_size, :]
    return tf.ensure_shape(image, [crop_size, crop_size, 3])


def flip(images) -> tf.Tensor:
    """Horizontal mirror of an (H, W, C) image or an (B, H, W, C) batch (test-time flip)."""
    images = tf.convert_to_tensor(images)
    return tf.reverse(images, axis=[-2])


# --------------------------------------------------------------------------
# Training batches: global index batches first, then loading
# --------------------------------------------------------------------------

class _Tables:
    """The split as graph constants (paths, codes as a flat array with row starts)."""

    def __init__(self, data: DualPathData):
        lengths = np.asarray([len(c) for c in data.codes], np.int64)
        if np.any(lengths > data.max_len):
            raise ConfigError(f"codes longer than max_len={data.max_len}; build the data with "
                              "long_captions='clip' or a larger max_len")
        flat = np.concatenate([np.asarray(c, np.int32) for c in data.codes]) if len(lengths) \
            else np.zeros([0], np.int32)
        self.codes = tf.RaggedTensor.from_row_lengths(tf.constant(flat, tf.int32),
                                                      tf.constant(lengths, tf.int64))
        self.paths = tf.constant(data.image_paths, tf.string)
        self.image_class = tf.constant(data.image_class, tf.int32)
        self.caption_image = tf.constant(data.caption_image, tf.int64)
        # (num_classes, max captions per class) table of caption indices.
        caption_class = data.caption_class.astype(np.int64)
        counts = np.bincount(caption_class, minlength=data.num_classes)
        table = np.zeros((data.num_classes, max(1, int(counts.max(initial=0)))), np.int64)
        order = np.argsort(caption_class, kind="stable")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        for cls in range(data.num_classes):
            table[cls, :counts[cls]] = order[starts[cls]:starts[cls] + counts[cls]]
        self.class_captions = tf.constant(table)
        self.class_caption_count = tf.constant(counts, tf.int64)
        image_counts = np.bincount(data.caption_image, minlength=data.num_images)
        image_table = np.zeros((data.num_images, max(1, int(image_counts.max(initial=0)))), np.int64)
        order = np.argsort(data.caption_image, kind="stable")
        starts = np.concatenate([[0], np.cumsum(image_counts)[:-1]])
        for img in range(data.num_images):
            image_table[img, :image_counts[img]] = order[starts[img]:starts[img] + image_counts[img]]
        self.image_captions = tf.constant(image_table)
        self.image_caption_count = tf.constant(image_counts, tf.int64)


def _hash32(x):
    # A 32-bit integer mixing function (Mueller's "hash32"), computed in int64:
    # the multiplier is below 2**27, so products stay below 2**59.
    x = tf.bitwise.bitwise_and(x, _MASK32)
    for _ in range(2):
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))
        x = tf.bitwise.bitwise_and(x * 0x45D9F3B, _MASK32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))


def _row_hash(seed, step, index, salt: int):
    """A 32-bit hash of (seed, step, row index, salt); int64 tensor shaped like `index`."""
    index = tf.cast(index, tf.int64)
    step = tf.cast(step, tf.int64)
    h = _hash32(tf.cast(seed, tf.int64) + (0x9E3779B9 ^ salt))
    for value in (step, tf.bitwise.right_shift(step, 32)):
        h = _hash32(tf.bitwise.bitwise_xor(h, value) + salt)
    h = h + tf.zeros_like(index)
    for value in (index, tf.bitwise.right_shift(index, 32)):
        h = _hash32(tf.bitwise.bitwise_xor(h, value) + salt)
    return h


def _row_uniform(seed, step, index, salt: int):
    return tf.cast(_row_hash(seed, step, index, salt), tf.float32) / float(1 << 32)


def steps_per_epoch(data: DualPathData, batch_size: int) -> int:
    """Steps of one epoch: every training image once, num_images // batch_size."""
    return data.num_images // batch_size


def _check_batch(data: DualPathData, batch_size: int, num_negative_captions: int) -> None:
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    if data.num_images < batch_size:
        raise ConfigError(f"batch_size={batch_size} is larger than the number of images "
                          f"({data.num_images}) of {data.source or 'the split'}")
    if num_negative_captions < 0:
        raise ConfigError(f"num_negative_captions must be >= 0, got {num_negative_captions}")
    if num_negative_captions and data.num_classes <= batch_size:
        raise ConfigError(f"negative captions come from classes outside the batch; with "
                          f"{data.num_classes} classes the batch size must be smaller than that, "
                          f"got {batch_size}")
    empty = [i for i, c in enumerate(data.codes) if len(c) == 0]
    if empty:
        i = empty[0]
        raise DataFormatError(data.source or "(captions)", "caption has no dictionary word; "
                              "it cannot be used for training",
                              record=f"image {data.image_ids[data.caption_image[i]]}, caption {i}")


def global_batch_indices(data: DualPathData, *, batch_size: int = 32, seed: int = 0,
                         num_negative_captions: int = 0):
    """``step -> index batch`` (a TF function of a scalar int64 step).

    The index batch: ``step`` (scalar), ``image_index`` (B,), ``text_index``
    (B,) -- a random caption of the image's class -- and, with negatives,
    ``negative_text_index`` (N,): one random caption each of N random
    training images (with replacement, as the reference's ``randi``) whose
    class is not in the batch.
    Deterministic in (seed, step); image order is a fresh permutation of
    the images each epoch.
    """
    _check_batch(data, batch_size, num_negative_captions)
    tables = _Tables(data)
    num_images = data.num_images
    steps = steps_per_epoch(data, batch_size)
    seed64 = tf.constant(int(seed), tf.int64)

    def indices(step):
        step = tf.cast(step, tf.int64)
        epoch, within = step // steps, step % steps
        perm = tf.argsort(tf.random.stateless_uniform([num_images], seed=tf.stack([seed64, epoch])))
        images = tf.cast(perm[within * batch_size:(within + 1) * batch_size], tf.int64)
        classes = tf.cast(tf.gather(tables.image_class, images), tf.int64)
        u = tf.random.stateless_uniform([batch_size], seed=tf.stack([seed64 + 7919, step]))
        count = tf.gather(tables.class_caption_count, classes)
        pick = tf.minimum(tf.cast(tf.floor(u * tf.cast(count, tf.float32)), tf.int64), count - 1)
        text = tf.gather_nd(tables.class_captions, tf.stack([classes, pick], 1))
        out = {"step": step, "image_index": images, "text_index": text}
        if num_negative_captions:
            n = num_negative_captions
            # Uniform over the training images whose class is not in the batch.
            in_batch = tf.scatter_nd(classes[:, None], tf.ones_like(classes, tf.int32),
                                     [data.num_classes]) > 0
            allowed = tf.where(~tf.gather(in_batch, tables.image_class))[:, 0]
            pick = tf.random.stateless_uniform([n], seed=tf.stack([seed64 + 104729, step]),
                                               maxval=tf.shape(allowed, out_type=tf.int64)[0],
                                               dtype=tf.int64)
            neg_images = tf.gather(allowed, pick)
            u = tf.random.stateless_uniform([n], seed=tf.stack([seed64 + 15485863, step]))
            count = tf.gather(tables.image_caption_count, neg_images)
            pick = tf.minimum(tf.cast(tf.floor(u * tf.cast(count, tf.float32)), tf.int64), count - 1)
            out["negative_text_index"] = tf.gather_nd(tables.image_captions,
                                                      tf.stack([neg_images, pick], 1))
        return out

    return indices


def index_batches(data: DualPathData, *, batch_size: int = 32, seed: int = 0,
                  num_negative_captions: int = 0, start_step: int = 0) -> tf.data.Dataset:
    """Infinite dataset of global index batches (`global_batch_indices`), from `start_step`."""
    fn = global_batch_indices(data, batch_size=batch_size, seed=seed,
                              num_negative_captions=num_negative_captions)
    return tf.data.Dataset.counter(start=start_step).map(fn)


def batch_loader(data: DualPathData, *, resize_to: int = 256, crop_size: int = 224, seed: int = 0,
                 text_shift: str = "position_shift"):
    """``index batch -> model batch``: reads and augments the rows of an index batch.

    Returns a function for ``dataset.map`` producing ``image`` float32
    (B, crop_size, crop_size, 3) RGB 0..255, ``token_ids`` int32 (B, max_len),
    ``label`` int32 (B,) (the class of the image, which is also the
    caption's), and with negatives ``negative_token_ids`` int32 (N, max_len)
    and ``negative_label`` int32 (N,). Each row's crop, flip and text offset
    depend only on (seed, step, the row's image / caption index), so
    applying it to a replica's slice of a global batch gives that slice of
    the global result.
    """
    _check_sizes(resize_to, crop_size)
    if text_shift not in TEXT_SHIFTS:
        raise ConfigError(f"text_shift must be one of {TEXT_SHIFTS}, got {text_shift!r}")
    tables = _Tables(data)
    max_len = data.max_len
    seed64 = tf.constant(int(seed), tf.int64)

    def place_text(text_index, step, salt):
        codes = tf.gather(tables.codes, text_index)
        if text_shift == "left_align":
            return _place(codes, tf.zeros(tf.shape(text_index), tf.int32), max_len)
        lengths = tf.cast(codes.row_lengths(), tf.int32)
        uniform = _row_uniform(seed64, step, text_index, salt)
        return _place(codes, _offsets_from_uniform(uniform, lengths, max_len), max_len)

    def load_one(args):
        image_index, step = args
        row_seed = tf.stack([_row_hash(seed64, step, image_index, 11),
                             _row_hash(seed64, step, image_index, 12)])
        jpeg = tf.io.read_file(tf.gather(tables.paths, image_index))
        return train_image(jpeg, resize_to=resize_to, crop_size=crop_size, seed=row_seed)

    def load(batch):
        step = batch["step"]
        image_index = tf.cast(batch["image_index"], tf.int64)
        text_index = tf.cast(batch["text_index"], tf.int64)
        images = tf.map_fn(load_one, (image_index, tf.fill(tf.shape(image_index), step)),
                           fn_output_signature=tf.TensorSpec([crop_size, crop_size, 3], tf.float32))
        out = {"image": images,
               "token_ids": place_text(text_index, step, 21),
               "label": tf.gather(tables.image_class, image_index)}
        if "negative_text_index" in batch:
            negative = tf.cast(batch["negative_text_index"], tf.int64)
            out["negative_token_ids"] = place_text(negative, step, 22)
            out["negative_label"] = tf.gather(tables.image_class,
                                              tf.gather(tables.caption_image, negative))
        return out

    return load


class TrainData(NamedTuple):
    """`train_dataset`'s result: the infinite batch dataset and the steps of one epoch."""
    dataset: tf.data.Dataset
    steps_per_epoch: int


def train_dataset(data: DualPathData, *, batch_size: int = 32, resize_to: int = 256,
                  crop_size: int = 224, seed: int = 0, text_shift: str = "position_shift",
                  num_negative_captions: int = 0, start_step: int = 0,
                  prefetch: int = 2) -> TrainData:
    """The infinite, deterministic training stream (see the module docstring).

    Batches are dicts ``image`` float32 (B, crop_size, crop_size, 3) RGB
    0..255, ``token_ids`` int32 (B, max_len) 0-padded, ``label`` int32 (B,),
    and with ``num_negative_captions`` = N > 0 also ``negative_token_ids``
    int32 (N, max_len) and ``negative_label`` int32 (N,).
    `start_step` resumes a run: batch k of the stream is global step
    start_step + k, identical to an uninterrupted run's.
    """
    if data.split != "train":
        logger.warning("train_dataset on the %r split of %s", data.split, data.source)
    indices = index_batches(data, batch_size=batch_size, seed=seed,
                            num_negative_captions=num_negative_captions, start_step=start_step)
    load = batch_loader(data, resize_to=resize_to, crop_size=crop_size, seed=seed,
                        text_shift=text_shift)
    dataset = indices.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return TrainData(dataset.prefetch(prefetch), steps_per_epoch(data, batch_size))


def distributed_train_dataset(strategy: tf.distribute.Strategy, data: DualPathData, *,
                              batch_size: int = 32, resize_to: int = 256, crop_size: int = 224,
                              seed: int = 0, text_shift: str = "position_shift",
                              num_negative_captions: int = 0, start_step: int = 0):
    """`train_dataset` under a `tf.distribute` strategy (global batch of `batch_size`).

    Global index batches are split between replicas first (``image_index``
    / ``text_index`` rows; the negatives are shared by every replica), then
    each replica loads only its rows, via
    `tf_twobranch.distribute.distribute_global_batches`. Replica r's rows
    equal rows r·B/R … (r+1)·B/R − 1 of the single-device batch.
    """
    replicas = strategy.num_replicas_in_sync
    if batch_size % replicas:
        raise ConfigError(f"batch_size={batch_size} is not divisible by the {replicas} replicas")
    load = batch_loader(data, resize_to=resize_to, crop_size=crop_size, seed=seed,
                        text_shift=text_shift)
    return distribute_global_batches(
        strategy,
        lambda: index_batches(data, batch_size=batch_size, seed=seed,
                              num_negative_captions=num_negative_captions, start_step=start_step),
        lambda ds: ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(2))


# --------------------------------------------------------------------------
# Evaluation inputs
# --------------------------------------------------------------------------

class TestData(NamedTuple):
    """Evaluation inputs of one split.

    images: dataset of {"image": (b, S, S, 3), "image_flipped": (b, S, S, 3)
      (with flip=True), "image_index": (b,)} in image order.
    texts: dataset of {"token_ids": (b, max_len), "caption_index": (b,)}; with
      text_shift="all_shifts" a caption has several rows (one per legal
      offset) -- average the text features per `caption_index`.
    caption_of_row: int32 (rows,) caption index of every text row.
    caption_image: int32 (num_captions,) image of every caption.
    """
    __test__ = False  # not a pytest class

    images: tf.data.Dataset
    texts: tf.data.Dataset
    caption_of_row: np.ndarray
    caption_image: np.ndarray


def test_datasets(data: DualPathData, *, batch_size: int = 64, resize_to: int = 256,
                  crop_size: int = 224, image_mode: str = "full", flip_images: bool = True,
                  text_shift: str = "left_align") -> TestData:
    """Images (+ their mirrors) and caption codes for evaluation (§6.2).

    Args:
      image_mode: "full" or "center_crop" (see `test_image`).
      flip_images: add "image_flipped" (average its feature with the image's).
      text_shift: "left_align" (one row per caption) or "all_shifts" (every
        legal offset, the reference implementation's test-time text feature).
    """
    if text_shift not in ("left_align", "all_shifts"):
        raise ConfigError(f"test text_shift must be 'left_align' or 'all_shifts', got {text_shift!r}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    _check_sizes(resize_to, crop_size)
    if image_mode not in TEST_IMAGE_MODES:
        raise ConfigError(f"image_mode must be one of {TEST_IMAGE_MODES}, got {image_mode!r}")
    too_long = [i for i, c in enumerate(data.codes) if len(c) > data.max_len]
    if too_long:
        raise ConfigError(f"caption {too_long[0]} is longer than max_len={data.max_len}")

    def load(path, index):
        image = test_image(tf.io.read_file(path), resize_to, crop_size, image_mode)
        out = {"image": image, "image_index": index}
        if flip_images:
            out["image_flipped"] = flip(image)
        return out

    images = tf.data.Dataset.from_tensor_slices(
        (tf.constant(data.image_paths, tf.string), tf.range(data.num_images, dtype=tf.int32)))
    images = images.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    images = without_autotuning(images.batch(batch_size).prefetch(2))

    if text_shift == "left_align":
        rows = np.zeros((data.num_captions, data.max_len), np.int32)
        for i, code in enumerate(data.codes):
            rows[i, :len(code)] = code
        caption_of_row = np.arange(data.num_captions, dtype=np.int32)
    else:
        blocks = [_all_shifts_numpy(np.asarray(c, np.int32), data.max_len) for c in data.codes]
        rows = np.concatenate(blocks) if blocks else np.zeros((0, data.max_len), np.int32)
        caption_of_row = np.repeat(np.arange(data.num_captions, dtype=np.int32),
                                   [len(b) for b in blocks])
    texts = tf.data.Dataset.from_tensor_slices({"token_ids": rows, "caption_index": caption_of_row})
    return TestData(images, texts.batch(batch_size), caption_of_row,
                    data.caption_image.copy())


def test_split(data: DualPathData, *, resize_to: int = 256, crop_size: int = 224,
               text_shift: str = "left_align", protocol: str = "full",
               by_identity: bool = False) -> EvaluationSplit:
    """The evaluation split as arrays, what `DualPathModel.evaluate` takes.

    Images are decoded and cropped as `test_datasets` does (the model adds
    the mirrored image itself); with ``text_shift="all_shifts"`` the split
    carries ``caption_of_row``. `by_identity` (CUHK-PEDES) adds
    ``image_class``: a caption's positives are all images of its identity.
    """
    test = test_datasets(data, resize_to=resize_to, crop_size=crop_size, text_shift=text_shift,
                         flip_images=False)
    images = np.concatenate([b["image"].numpy() for b in test.images])
    rows = np.concatenate([b["token_ids"].numpy() for b in test.texts])
    several_rows = len(rows) != data.num_captions
    return EvaluationSplit(images, rows, test.caption_image, protocol=protocol,
                           caption_of_row=test.caption_of_row if several_rows else None,
                           image_class=np.asarray(data.image_class) if by_identity else None)
