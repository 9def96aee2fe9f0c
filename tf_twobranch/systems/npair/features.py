"""Inputs of the N-pair localization model (Das et al.) for every split.

Image side: the backbone's last convolutional map
(`tf_twobranch.features.backbones.build_spatial_backbone`): VGG-19
``block5_conv4`` from a local ImageNet weights file, or, on the embedded data,
the scene CNN trained once on the training images, captions and box crops
(`prepare.cached_scene_cnn`, the backbone of the deep fragment embeddings,
whose pooled features a linear probe reads digits from at ≥ 90 %). With a
frozen backbone the maps are computed once and cached (``backbone_maps``);
training it end to end needs the images themselves (``split_images``). Both
are built batch by batch into memory-mapped row arrays on disk
(`tf_twobranch.data.formats.row_arrays`), so memory is bounded by a batch and
a shard whatever the split's size, and an interrupted build resumes.
Every image file, whatever its size, is resized whole to the backbone's
square input (`load_images_at_size`), so map cell (r, c) covers the same
fraction of the original image whatever its aspect ratio.

Caption side: tokens of `tokenize_caption`, words kept when they have a word
vector (GloVe/word2vec file, or PPMI-SVD vectors trained on the training
captions) as the authors' code (unknown words are dropped, as the package's
`TokenCoder` does in the export), ``<start> words <end>`` padded with
``<end>`` to ``max_words + 2`` positions (the code pads with its end token).
The mask marks the words. Captions longer than ``max_words`` are left out of
training (the paper: "only captions of the said length or lower were
considered") and clipped for evaluation, where every caption must be ranked.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Mapping, Sequence

import keras
import numpy as np
from absl import logging

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats.word_vectors import load_word_vectors
from tf_twobranch.data.layout import DatasetLayout
from tf_twobranch.data.text_codes import build_text_vocabulary, initial_word_matrix
from tf_twobranch.data.tokenize import END_TOKEN, START_TOKEN, tokenize_caption
from tf_twobranch.data.formats.row_arrays import (FEATURE_DTYPES, SHARD_BYTES, ShardedRowWriter,
                                                 check_finite_once, open_rows, storage_dtype)
from tf_twobranch.errors import ConfigError, DataFormatError, UserInputError
from tf_twobranch.features import SCENE_CNN_EPOCHS
from tf_twobranch.features.backbones import build_spatial_backbone
from tf_twobranch.features.images import load_images_at_size
from tf_twobranch.features.prepare import cache_digest, cached_scene_cnn
from tf_twobranch.features.word_vectors import train_word_vectors

__all__ = ["NPairInputSpec", "NPairText", "CaptionTokens", "spatial_backbone", "backbone_input_size",
           "split_images", "backbone_maps", "caption_inputs", "encode_token_lists", "encode_words",
           "PhraseInputRows", "PhraseParsedCaptions", "phrase_parsed_captions"]

BACKBONES = ("scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152")


@dataclasses.dataclass
class NPairInputSpec:
    image_backbone: str = "scene_cnn"
    backbone_weights: str | None = None
    scene_cnn_epochs: int = SCENE_CNN_EPOCHS
    word_vectors: str | None = None
    word_dim: int = 300
    max_words: int = 20
    seed: int = 0
    feature_dtype: str = "float32"   # storage of the cached backbone maps (row_arrays.FEATURE_DTYPES)
    # The maps come from files (--backbone_maps): no backbone runs, so none needs weights.
    precomputed_maps: bool = False

    def validate(self) -> None:
        if self.image_backbone not in BACKBONES:
            raise ConfigError(f"image_backbone must be one of {BACKBONES}, got {self.image_backbone!r}")
        if self.image_backbone != "scene_cnn" and not self.backbone_weights and not self.precomputed_maps:
            raise UserInputError(f"image_backbone={self.image_backbone} needs --backbone_weights (a local "
                                 "ImageNet weights file, e.g. vgg19_weights_tf_dim_ordering_tf_kernels.h5; "
                                 "nothing is downloaded), or --image_backbone=scene_cnn")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ConfigError(f"feature_dtype must be one of {FEATURE_DTYPES}, got {self.feature_dtype!r}")
        if self.max_words < 1 or self.word_dim < 1:
            raise ConfigError(f"max_words and word_dim must be positive, got {self.max_words}, {self.word_dim}")


@dataclasses.dataclass
class CaptionTokens:
    """One split's captions: ids (N, T) int32, mask (N, T) of the words, and which fit training."""
    token_ids: np.ndarray
    token_mask: np.ndarray
    trainable: np.ndarray     # bool (N,): at most max_words words and at least one known word


@dataclasses.dataclass
class NPairText:
    vocabulary: list[str]           # "<pad>", "<unk>", "<start>", "<end>", words...
    word_matrix: np.ndarray         # (V, word_dim) initial word vectors
    splits: dict[str, CaptionTokens]
    max_words: int

    @property
    def max_tokens(self) -> int:
        return self.max_words + 2


# ---------------------------------------------------------------------------- images

def spatial_backbone(layout: DatasetLayout, train: CaptionCorpus, cache_dir, spec: NPairInputSpec) -> keras.Model:
    spec.validate()
    if spec.image_backbone == "scene_cnn":
        scene = cached_scene_cnn(layout, train, cache_dir, epochs=spec.scene_cnn_epochs, seed=spec.seed)
        return keras.Model(scene.input, scene.get_layer("global_pool").input, name="scene_cnn_map")
    return build_spatial_backbone(spec.image_backbone, weights_path=spec.backbone_weights)


def backbone_input_size(backbone: keras.Model) -> int:
    return int(backbone.input.shape[1])


def _build_rows(folder: pathlib.Path, num_rows: int, row_shape, dtype, load_batch, *, batch_size: int,
                shard_bytes: int, what: str):
    """A sharded row array of `num_rows` rows, ``load_batch(start, stop)`` (a batch of rows)
    appended batch by batch: memory holds one batch and one shard, never the split.

    A finished folder (its manifest written) is opened as it is; an interrupted build resumes:
    batches stay aligned at multiples of `batch_size` from row 0 (the rows already on disk are
    recomputed up to the batch boundary and dropped), so a resumed build feeds the backbone the
    same batches as an uninterrupted one and writes the same rows.
    """
    if (folder / "rows.json").exists():
        return open_rows(folder)
    start_time = time.time()
    writer = ShardedRowWriter(folder, row_shape, dtype, shard_bytes=shard_bytes)
    done = writer.rows_done
    if done > num_rows:
        raise DataFormatError(folder, f"an earlier build wrote {done} rows, the split has {num_rows}: "
                              "remove the folder")
    if done:
        logging.info("%s: resuming at row %d of %d", what, done, num_rows)
    for start in range(done // batch_size * batch_size, num_rows, batch_size):
        stop = min(start + batch_size, num_rows)
        rows = load_batch(start, stop)
        writer.append(rows[max(0, done - start):])
    rows = writer.finish()
    logging.info("%s (%d rows of %s, %s): %.1f s", what, num_rows, row_shape, np.dtype(dtype).name,
                 time.time() - start_time)
    return rows


def _split_paths(layout: DatasetLayout, corpus: CaptionCorpus) -> list[pathlib.Path]:
    return layout.image_paths(corpus.image_ids, file_names=getattr(corpus, "file_names", None),
                              source=corpus.source)


def split_images(layout: DatasetLayout, corpus: CaptionCorpus, size: int, cache_dir, *, batch_size: int = 64,
                 shard_bytes: int = SHARD_BYTES):
    """uint8 (N, size, size, 3): every image of the split resized whole to the backbone's input, cached
    on disk as a memory-mapped row array (what a backbone trained end to end reads batch by batch)."""
    paths = _split_paths(layout, corpus)
    folder = pathlib.Path(cache_dir) / f"npair_images_{size}_{cache_digest({'ids': list(corpus.image_ids)})}"
    return _build_rows(folder, len(paths), (size, size, 3), np.uint8,
                       lambda start, stop: load_images_at_size(paths[start:stop], size),
                       batch_size=batch_size, shard_bytes=shard_bytes, what=f"images at {size}x{size}")


def load_backbone_maps(path, *, expected_images: int | None = None):
    """Precomputed (N, h, w, C) backbone maps of a split (``.npy`` or a sharded row-array folder),
    memory-mapped as stored (float32 or float16); one row per image of the split, in split order.

    Raises DataFormatError naming the file for a missing or unreadable file, a shape other
    than (images, h, w, C), another dtype, a row count other than `expected_images`, or NaN/inf
    (naming the first bad image row; checked block by block).
    """
    maps = open_rows(path)
    if len(maps.shape) != 4 or maps.shape[1] < 1 or maps.shape[2] < 1:
        raise DataFormatError(path, f"expected backbone maps of shape (images, h, w, channels), got shape "
                              f"{tuple(maps.shape)}")
    if np.dtype(maps.dtype).name not in FEATURE_DTYPES:
        raise DataFormatError(path, f"backbone maps are read as stored, as one of {FEATURE_DTYPES}; got dtype "
                              f"{maps.dtype} (convert the file once, e.g. np.save(path, maps.astype(np.float16)))")
    if expected_images is not None and len(maps) != expected_images:
        raise DataFormatError(path, f"{len(maps)} images of backbone maps, expected {expected_images} (one per "
                              "image of the split, in split order)")
    check_finite_once(path, maps, what="images' maps")   # read whole once per version of the file
    return maps


def backbone_maps(layout: DatasetLayout, splits: Mapping[str, CaptionCorpus], cache_dir, spec: NPairInputSpec,
                  backbone: keras.Model, batch_size: int = 64, *, shard_bytes: int = SHARD_BYTES) -> dict:
    """(N, h, w, C) maps of the frozen backbone for every split, cached by what made them.

    The backbone runs over batches of image files and its maps are written as they come
    (`ShardedRowWriter`, stored in ``spec.feature_dtype``); an interrupted build resumes. Returns
    split -> the memory-mapped row array (`open_rows`).
    """
    dtype = storage_dtype(spec.feature_dtype)
    key = {"backbone": spec.image_backbone, "weights": spec.backbone_weights, "seed": spec.seed,
           "scene_cnn_epochs": spec.scene_cnn_epochs, "storage": dtype.name,
           "train": cache_digest({"ids": list(splits["train"].image_ids)})}
    folder = pathlib.Path(cache_dir) / f"npair_maps_{spec.image_backbone}_{cache_digest(key)}"
    size = backbone_input_size(backbone)
    row_shape = tuple(int(n) for n in backbone.output.shape[1:])
    out = {}
    for split, corpus in splits.items():
        paths = _split_paths(layout, corpus)

        def maps_of(start, stop, paths=paths):
            images = load_images_at_size(paths[start:stop], size)
            return np.asarray(backbone(images.astype(np.float32), training=False))

        out[split] = _build_rows(folder / f"{split}_{cache_digest({'ids': list(corpus.image_ids)})}", len(paths),
                                 row_shape, dtype, maps_of, batch_size=batch_size, shard_bytes=shard_bytes,
                                 what=f"backbone maps of {split}")
    return out


# ---------------------------------------------------------------------------- captions

def encode_words(words: Sequence[str], index: Mapping[str, int]) -> tuple[list[int], list[int]]:
    """(ids, positions in `words`) of the words that have a vector (the others are dropped)."""
    kept = [(index[w], i) for i, w in enumerate(words) if w in index]
    return [k for k, _ in kept], [i for _, i in kept]


#: The N-pair caption-length rule (`kept_caption_words`), as run configurations and docs state it.
CAPTION_LENGTH_RULE = ("words outside the vocabulary are dropped, then the first max_words known words are kept "
                       "(a longer caption is clipped, not refused)")


def kept_caption_words(known, max_words: int):
    """The one caption-length rule of the N-pair inputs: evaluation, the training inputs and the
    export (`tf_twobranch.systems.npair.export`) keep the first `max_words` known words.

    `known`: one caption's known word ids (a sequence; unknown words already dropped), or a
    batch of them as a `tf.RaggedTensor` (batch, None) (the export's graph).
    """
    if hasattr(known, "row_lengths"):     # tf.RaggedTensor: slice every row
        return known[:, :max_words]
    return known[:max_words]


def encode_token_lists(token_lists: Sequence[Sequence[str]], vocabulary: Sequence[str],
                       max_words: int) -> CaptionTokens:
    """``<start> words <end>`` ids padded with ``<end>`` to max_words + 2; longer captions clipped."""
    index = {w: i for i, w in enumerate(vocabulary) if i >= 4}
    start, end = vocabulary.index(START_TOKEN), vocabulary.index(END_TOKEN)
    n, width = len(token_lists), max_words + 2
    ids = np.full((n, width), end, np.int32)
    ids[:, 0] = start
    mask = np.zeros((n, width), bool)
    trainable = np.zeros(n, bool)
    for row, tokens in enumerate(token_lists):
        known, _ = encode_words(tokens, index)
        trainable[row] = 0 < len(known) <= max_words
        known = kept_caption_words(known, max_words)
        ids[row, 1:1 + len(known)] = known
        mask[row, 1:1 + len(known)] = True
    return CaptionTokens(ids, mask, trainable)


def caption_inputs(splits: Mapping[str, CaptionCorpus], spec: NPairInputSpec) -> NPairText:
    """Vocabulary, initial word vectors and token ids of every split."""
    spec.validate()
    tokens = {s: [tokenize_caption(c) for c in corpus.captions] for s, corpus in splits.items()}
    train_tokens = tokens["train"]
    if spec.word_vectors:
        words = {t for caption in train_tokens for t in caption}
        vectors = load_word_vectors(spec.word_vectors, vocabulary=words)
        if len(vectors) == 0:
            raise UserInputError(f"{spec.word_vectors}: none of the {len(words)} training words has a vector")
    else:
        vectors = train_word_vectors(train_tokens, dim=spec.word_dim, seed=spec.seed)
    base = build_text_vocabulary(train_tokens, vectors)
    vocabulary = base[:2] + [START_TOKEN, END_TOKEN] + base[2:]
    matrix = initial_word_matrix(vocabulary, vectors, seed=spec.seed)
    out = {s: encode_token_lists(t, vocabulary, spec.max_words) for s, t in tokens.items()}
    for s, split in out.items():
        empty = np.flatnonzero(~split.token_mask.any(axis=1))
        if len(empty) and s != "train":
            corpus = splits[s]
            i = int(empty[0])
            raise UserInputError(f"{corpus.source or s}: caption {i} of image "
                                 f"{corpus.image_ids[corpus.caption_image[i]]} ({corpus.captions[i]!r}) has no "
                                 "word with a vector in the training vocabulary; it cannot be scored")
    return NPairText(vocabulary, matrix, out, spec.max_words)


class PhraseInputRows:
    """(N, T, word_dim) float32 LSTM inputs of phrase-parsed captions, built when rows are read.

    Held as the captions' word ids (one int32 per known word), not as N·T·word_dim floats
    (Flickr30K: 150K captions × 22 × 300 floats = 4 GB): ``rows[indices]`` builds just those rows,
    with the same numpy operations the whole array was built with, so every row has the same bits.
    Indexes like an array (`row_gather.gather_op` reads a batch's rows).
    """

    def __init__(self, word_matrix: np.ndarray, start: int, end: int, words: np.ndarray,
                 item_starts: np.ndarray, caption_items: np.ndarray, width: int):
        self.word_matrix = word_matrix
        self._start, self._end = word_matrix[start], word_matrix[end]
        self._words, self._item_starts, self._caption_items = words, item_starts, caption_items
        self.shape = (len(caption_items) - 1, width, int(word_matrix.shape[1]))
        self.dtype = np.dtype(np.float32)
        self.ndim = 3

    def __len__(self) -> int:
        return self.shape[0]

    def _row(self, r: int, out: np.ndarray) -> None:
        out[:] = self._end
        out[0] = self._start
        first, last = int(self._caption_items[r]), int(self._caption_items[r + 1])
        last = min(last, first + self.shape[1] - 2)         # clipped to max_words items
        items = [self.word_matrix[self._words[self._item_starts[i]:self._item_starts[i + 1]]].mean(axis=0)
                 for i in range(first, last)]
        if items:
            out[1:1 + len(items)] = np.stack(items)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            return self[np.asarray([index])][0]
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        index = np.asarray(index, np.int64).reshape(-1)
        if len(index) and (index.min() < -len(self) or index.max() >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        index = np.where(index < 0, index + len(self), index)
        out = np.empty((len(index),) + self.shape[1:], np.float32)
        for k, r in enumerate(index):
            self._row(int(r), out[k])
        return out

    def __array__(self, dtype=None, copy=None):
        whole = self[0:len(self)]
        return whole if dtype is None else whole.astype(dtype)


@dataclasses.dataclass
class PhraseParsedCaptions:
    """Training captions in the code's phrase parse mode: LSTM inputs (N, T, word_dim), in which
    each annotated phrase is ONE input, the mean of its known words' vectors (built per row
    read: `PhraseInputRows`)."""
    word_inputs: PhraseInputRows
    token_mask: np.ndarray
    trainable: np.ndarray
    caption_image: np.ndarray


def phrase_parsed_captions(entities_root, image_ids: Sequence[str], vocabulary: Sequence[str],
                           word_matrix: np.ndarray, max_words: int) -> PhraseParsedCaptions:
    """The Flickr30K Entities sentences of `image_ids`, phrase-parsed (every annotated phrase, as the
    authors' caption parser does; words without a vector dropped, a phrase with none dropped)."""
    from tf_twobranch.data.formats.flickr30k_entities import read_entities_dataset

    index = {w: i for i, w in enumerate(vocabulary) if i >= 4}
    words, item_starts, caption_items, owners = [], [0], [0], []
    for row, image in enumerate(read_entities_dataset(entities_root, list(image_ids))):
        for sentence in image.sentences:
            starts = {p.first_word_index: p.num_words for p in sentence.phrases}
            tokens = [w.lower() for w in sentence.words]
            i = 0
            while i < len(tokens):
                span = starts.get(i, 1)
                known = [index[w] for w in tokens[i:i + span] if w in index]
                if known:
                    words.extend(known)
                    item_starts.append(len(words))
                i += span
            caption_items.append(len(item_starts) - 1)
            owners.append(row)
    caption_items = np.asarray(caption_items, np.int64)
    counts = np.diff(caption_items)
    n, width = len(counts), max_words + 2
    trainable = (counts > 0) & (counts <= max_words)
    mask = np.zeros((n, width), bool)
    mask[:, 1:] = np.arange(width - 1)[None, :] < np.minimum(counts, max_words)[:, None]
    inputs = PhraseInputRows(word_matrix, vocabulary.index(START_TOKEN), vocabulary.index(END_TOKEN),
                             np.asarray(words, np.int64), np.asarray(item_starts, np.int64), caption_items, width)
    return PhraseParsedCaptions(inputs, mask, trainable, np.asarray(owners, np.int32))
