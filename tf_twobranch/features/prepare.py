"""Feature preparation for experiments: the same steps a user runs on real data.

Given caption splits and a dataset layout (`tf_twobranch.data.layout`: the
images folder, the Flickr30K Entities folder), compute (or load from cache):

* image features of every split's images with a CNN backbone (VGG-19 /
  ResNet from a local weights file, or the `scene_cnn` trained on the fly on
  the training images and captions) with 10-crop averaging;
* text features of every caption with a text encoder fitted on the
  training captions only (HGLMM/GMM Fisher vectors of word vectors + PCA,
  mean word vectors, tf-idf), with word vectors from a local word2vec/GloVe
  file or trained on the training captions when none is given;
* or, for the LSTM branch, token ids over the training vocabulary.

Cached features are row-major ``.npy`` files (``image_features_{split}.npy``,
``text_features_{split}.npy``) in the storage dtype ``FeatureSpec.feature_dtype``
(``--feature_dtype``: float32, or float16 for half the disk and memory),
written block by block and returned memory-mapped, so no split's features
are ever held whole in memory (COCO's 566K 6000-d sentence features are
13.6 GB in float32).  The original code's files (``.mat`` image features,
column-major HDF5 text features) are read by `load_feature_matrix` when a
user gives them (``--image_features_*`` / ``--text_features_*``).

The fitted text encoder is cached too, by a fingerprint of what its fit
depends on (training captions, word-vector file, settings:
`fitted_text_encoder`), so features of other captions or splits, and the
precomp layout's features, never refit Fisher vectors and PCA for the same
training captions.

A SavedModel that takes JPEG bytes and caption strings needs the pieces that
made a row's features: `serving_image_backbone` gives the backbone (the scene
CNN trained for the image cache is kept in it as ``scene_cnn.keras``; an
ImageNet backbone is rebuilt from its weights file) with its views
(`image_view_options`), `serving_text_encoder` the fitted encoder (from the
encoder cache, by fingerprint).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import time

import numpy as np
from absl import logging

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.formats import load_feature_matrix
from tf_twobranch.data.formats.row_arrays import (BLOCK_BYTES, RowWriter, check_finite_rows, open_rows,
                                                  storage_dtype, write_rows)
from tf_twobranch.data.formats.word_vectors import load_word_vectors
from tf_twobranch.data.layout import DatasetLayout
from tf_twobranch.data.tokenize import build_vocabulary, tokenize_caption
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.features import SCENE_CNN_EPOCHS
from tf_twobranch.features.backbones import backbone_input_size, build_backbone
from tf_twobranch.features.image_features import extract_image_features
from tf_twobranch.features.images import load_images_at_size
from tf_twobranch.features.scene_cnn import entity_region_crops, load_scene_cnn, save_scene_cnn, train_scene_cnn
from tf_twobranch.features.text_features import (TextEncoder, build_text_encoder, cached_text_encoder,
                                                  encoder_needs_word_vectors, text_encoder_fingerprint)
from tf_twobranch.features.word_vectors import train_word_vectors

SCENE_CNN_RECIPE = "2: region-supervised, binary targets"
# The scene CNN that computed an image cache's features, kept beside them for exports.
SCENE_CNN_FILE = "scene_cnn.keras"
IMAGE_BACKBONES = ("scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152")
TEXT_ENCODERS = ("fisher_hglmm", "fisher_gmm", "mean_vector", "tfidf", "lstm")


@dataclasses.dataclass
class FeatureSpec:
    image_backbone: str = "scene_cnn"
    backbone_weights: str | None = None
    ten_crop: bool = True
    scene_cnn_epochs: int = SCENE_CNN_EPOCHS
    text_encoder: str = "fisher_hglmm"
    word_vectors: str | None = None
    word_dim: int = 300
    fisher_components: int = 30
    pca_dim: int = 6000
    max_len: int = 32
    seed: int = 0
    feature_dtype: str = "float32"

    def validate(self):
        if self.image_backbone not in IMAGE_BACKBONES:
            raise ConfigError(f"image_backbone must be one of {IMAGE_BACKBONES}, "
                              f"got {self.image_backbone!r}")
        if self.text_encoder not in TEXT_ENCODERS:
            raise ConfigError(f"text_encoder must be one of {TEXT_ENCODERS}, "
                              f"got {self.text_encoder!r}")
        for name in ("word_dim", "fisher_components", "pca_dim", "max_len", "scene_cnn_epochs"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        storage_dtype(self.feature_dtype)
        for name in ("backbone_weights", "word_vectors"):
            path = getattr(self, name)
            if path and not pathlib.Path(path).exists():
                raise ConfigError(f"--{name}={path}: file not found")

    def image_key(self) -> dict:
        # The recipe version invalidates caches when the scene CNN's training
        # changes (e.g. region supervision from the Entities boxes).
        return {**{k: getattr(self, k) for k in ("image_backbone", "backbone_weights", "ten_crop",
                                                 "scene_cnn_epochs", "seed")},
                "recipe": SCENE_CNN_RECIPE if self.image_backbone == "scene_cnn" else None,
                **self._storage_key()}

    def text_key(self) -> dict:
        return {**{k: getattr(self, k) for k in ("text_encoder", "word_vectors", "word_dim",
                                                 "fisher_components", "pca_dim", "max_len", "seed")},
                **self._storage_key()}

    def text_encoder_settings(self) -> dict:
        """What a fitted text encoder depends on besides its training captions and word-vector file."""
        return {k: getattr(self, k) for k in ("word_dim", "fisher_components", "pca_dim", "seed")}

    def _storage_key(self) -> dict:
        # Only a non-default dtype enters the keys: float32 caches keep their names.
        return {} if self.feature_dtype == "float32" else {"dtype": self.feature_dtype}


def cache_digest(d: dict) -> str:
    """A short stable hash of a JSON-able dict: names feature cache folders by what made them."""
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


def train_scene_cnn_backbone(spec: FeatureSpec, train: CaptionCorpus, layout: DatasetLayout,
                             train_paths=None):
    """The scene CNN of `spec` trained on the training images and captions (and, when the
    layout has a Flickr30K Entities folder, the crops of their annotated boxes).

    Returns ``(backbone, image_size)``: the feature extractor and the side of
    the square images it was trained on.
    """
    if train_paths is None:
        train_paths = layout.image_paths(train.image_ids, file_names=getattr(train, "file_names", None),
                                         source=train.source)
    # Square images of one size (the embedded data) are used as they are;
    # real images of mixed sizes are resized to 96x96 (load_images_at_size).
    images = load_images_at_size(train_paths)
    tokens = [[tokenize_caption(c) for c in caps] for caps in train.captions_by_image()]
    regions = (entity_region_crops(layout.entities_dir, train.image_ids, images, image_paths=train_paths)
               if layout.entities_dir is not None else None)
    if regions is None:
        return train_scene_cnn(images, tokens, epochs=spec.scene_cnn_epochs, seed=spec.seed), images.shape[1]
    # Region supervision (the analogue of the paper's backbone being
    # fine-tuned on detection boxes): crops of the training boxes,
    # filled by their object, make object shapes learnable.  Epochs
    # are scaled so the number of training samples stays that of
    # `scene_cnn_epochs` passes over the images alone.
    crops, phrase_tokens = regions
    epochs = max(1, round(spec.scene_cnn_epochs * len(images) / (len(images) + len(crops))))
    backbone = train_scene_cnn(images, tokens, epochs=epochs, seed=spec.seed,
                               region_crops=crops, region_token_lists=phrase_tokens,
                               binary_targets=True)
    return backbone, images.shape[1]


def scene_cnn_path(train: CaptionCorpus, cache_dir, *, epochs: int, seed: int = 0) -> pathlib.Path:
    """Where `cached_scene_cnn` keeps the scene CNN of (training images, epochs, seed)."""
    key = {"epochs": epochs, "seed": seed, "train": cache_digest({"ids": list(train.image_ids)})}
    return pathlib.Path(cache_dir) / f"scene_cnn_{cache_digest(key)}" / "scene_cnn.keras"


def cached_scene_cnn(layout: DatasetLayout, train: CaptionCorpus, cache_dir, *, epochs: int,
                     seed: int = 0):
    """The scene CNN trained on `train` (`train_scene_cnn_backbone`), trained once per
    (training images, epochs, seed) and kept in ``cache_dir/scene_cnn_<digest>/scene_cnn.keras``,
    so the models that share it (deep fragment embeddings, the N-pair localization model)
    train it once."""
    path = scene_cnn_path(train, cache_dir, epochs=epochs, seed=seed)
    if path.exists():
        return load_scene_cnn(path)
    backbone, _ = train_scene_cnn_backbone(FeatureSpec(scene_cnn_epochs=epochs, seed=seed), train, layout)
    save_scene_cnn(backbone, path)
    return backbone


def image_view_options(spec: FeatureSpec, backbone) -> dict:
    """The views `extract_image_features` encodes for `spec`'s features (``ten_crop``,
    ``crop_size``, ``resize_to``; None = its defaults): what an export taking JPEG bytes needs."""
    if spec.image_backbone == "scene_cnn" and spec.ten_crop:
        # Ten crops of 7/8 of the image, as 224 of 256 in the paper; every
        # file (any size) is resized to size x size first, as in training.
        size = backbone_input_size(backbone)
        return {"ten_crop": True, "crop_size": size * 7 // 8, "resize_to": size}
    return {"ten_crop": spec.ten_crop, "crop_size": None, "resize_to": None}


def _image_cache_dir(spec: FeatureSpec, splits: dict[str, CaptionCorpus], cache_dir) -> pathlib.Path:
    key = {**spec.image_key(), "s": _splits_key(splits)}
    return pathlib.Path(cache_dir) / f"image_{spec.image_backbone}_{cache_digest(key)}"


def _image_features(spec: FeatureSpec, splits: dict[str, CaptionCorpus],
                    layout: DatasetLayout, image_dir: pathlib.Path) -> dict[str, np.ndarray]:
    paths = {s: layout.image_paths(c.image_ids, file_names=getattr(c, "file_names", None), source=c.source)
             for s, c in splits.items()}
    if spec.image_backbone == "scene_cnn":
        backbone, _ = train_scene_cnn_backbone(spec, splits["train"], layout, paths["train"])
        save_scene_cnn(backbone, image_dir / SCENE_CNN_FILE)
    else:
        backbone = build_backbone(spec.image_backbone, weights_path=spec.backbone_weights)
    views = image_view_options(spec, backbone)
    return {s: extract_image_features(p, backbone, **views) for s, p in paths.items()}


def serving_image_backbone(spec: FeatureSpec, splits: dict[str, CaptionCorpus], cache_dir
                           ) -> tuple[object | None, dict | None, str | None]:
    """The backbone that computed `prepare_retrieval_features`' image features and its views.

    Returns ``(backbone, image_view_options, None)``, or ``(None, None, why)``
    when the backbone cannot be had: an ImageNet backbone without its weights
    file was randomly initialised (a rebuilt one would differ), and a cache
    written before scene CNNs were kept lacks ``scene_cnn.keras``.
    """
    if spec.image_backbone == "scene_cnn":
        path = _image_cache_dir(spec, splits, cache_dir) / SCENE_CNN_FILE
        if not path.is_file():
            return None, None, (f"the scene CNN that computed the cached image features is missing ({path}; "
                                "prepare_retrieval_features recomputes the cache with it)")
        backbone = load_scene_cnn(path)
    elif not spec.backbone_weights:
        return None, None, (f"the {spec.image_backbone} backbone was randomly initialised (no "
                            "--backbone_weights), so a rebuilt one would not give the row's features")
    else:
        backbone = build_backbone(spec.image_backbone, weights_path=spec.backbone_weights)
    return backbone, image_view_options(spec, backbone), None


def serving_text_encoder(spec: FeatureSpec, train: CaptionCorpus, cache_dir) -> TextEncoder:
    """The fitted encoder of `prepare_text_features` (from the encoder cache, `fitted_text_encoder`)."""
    if spec.text_encoder == "lstm":
        raise ConfigError("the LSTM branch has no fitted sentence encoder; its export tokenizes captions itself")
    return fitted_text_encoder(spec, _tokenized({"train": train})["train"], cache_dir)


def _tokenized(splits: dict[str, CaptionCorpus]) -> dict[str, list[list[str]]]:
    tokens = {s: [tokenize_caption(c) for c in corpus.captions] for s, corpus in splits.items()}
    empty = [(s, i) for s, toks in tokens.items() for i, t in enumerate(toks) if not t]
    if empty:
        s, i = empty[0]
        corpus = splits[s]
        raise DataFormatError(corpus.source or s,
                              f"caption {i} of image {corpus.image_ids[corpus.caption_image[i]]} "
                              f"has no words ({len(empty)} empty caption(s) in all)")
    return tokens


def fit_text_encoder(spec: FeatureSpec, train_tokens: list[list[str]]) -> TextEncoder:
    """`spec.text_encoder` fitted on the training captions' tokens (word vectors read from
    `spec.word_vectors`, else trained on those captions)."""
    kwargs = {}
    if encoder_needs_word_vectors(spec.text_encoder):
        if spec.word_vectors:
            vocab = {w for t in train_tokens for w in t}
            wv = load_word_vectors(spec.word_vectors, vocabulary=vocab)
        else:
            num_words = len({w for t in train_tokens for w in t})
            dim = min(spec.word_dim, max(2, num_words - 1))
            logging.info("No --word_vectors file given: training %d-d PPMI-SVD word vectors on "
                         "the %d training captions (a word2vec/GloVe file gives the paper's setup)",
                         dim, len(train_tokens))
            wv = train_word_vectors(train_tokens, dim=dim, seed=spec.seed)
        kwargs["word_vectors"] = wv
    if spec.text_encoder.startswith("fisher"):
        kwargs.update(num_components=spec.fisher_components, seed=spec.seed)
        fv_dim = 2 * spec.fisher_components * kwargs["word_vectors"].dim
        kwargs["pca_dim"] = spec.pca_dim if fv_dim > spec.pca_dim else None
    encoder = build_text_encoder(spec.text_encoder, **kwargs)
    return encoder.fit(train_tokens)


def fitted_text_encoder(spec: FeatureSpec, train_tokens: list[list[str]], cache_dir) -> TextEncoder:
    """`fit_text_encoder`, fitted once per fingerprint of its inputs (the training captions'
    tokens, the word-vector file's path/size/mtime, `spec.text_encoder_settings()`) and kept in
    ``cache_dir/text_encoders/``; a later call with the same inputs loads it (and logs so)."""
    fingerprint = text_encoder_fingerprint(spec.text_encoder, train_tokens, spec.text_encoder_settings(),
                                           word_vectors_file=spec.word_vectors)
    return cached_text_encoder(pathlib.Path(cache_dir) / "text_encoders", spec.text_encoder, fingerprint,
                               lambda: fit_text_encoder(spec, train_tokens))


def write_sentence_features(encoder: TextEncoder, token_lists: list[list[str]], path, dtype) -> None:
    """Encodes `token_lists` block by block into a row-major ``.npy`` of `dtype` (NaN/inf checked).

    Blocks are about BLOCK_BYTES of output and, for encoders that encode in
    batches (Fisher vectors), whole batches, so every sentence is encoded in
    the same batch as by one `transform` call: the same numbers.
    """
    dim = encoder.output_dim
    rows = max(1, BLOCK_BYTES // (dim * 4))
    batch = getattr(encoder, "batch_size", None)
    if batch:
        rows = max(batch, rows // batch * batch)
    with RowWriter(path, (len(token_lists), dim), dtype) as out:
        for start in range(0, len(token_lists), rows):
            out[start:start + rows] = encoder.transform(token_lists[start:start + rows])
        check_finite_rows(out.array, path, what="sentence feature rows")


def _splits_key(splits: dict[str, CaptionCorpus]) -> dict:
    return {s: (c.num_images, c.num_captions, c.image_ids[0], c.image_ids[-1]) for s, c in splits.items()}


def _captions_digest(splits: dict[str, CaptionCorpus]) -> str:
    digest = hashlib.sha1()
    for s in sorted(splits):
        digest.update(f"\x1d{s}\x1d".encode())
        for caption in splits[s].captions:
            digest.update(caption.encode())
            digest.update(b"\x1e")
    return digest.hexdigest()[:16]


def prepare_text_features(splits: dict[str, CaptionCorpus], cache_dir, spec: FeatureSpec
                          ) -> tuple[dict, dict]:
    """Text inputs of every split (`spec.text_encoder`, fitted on the training captions), cached.

    Kept in ``cache_dir/text_{encoder}_{digest}/`` (digest of the settings,
    the splits and their captions): ``text_features_{split}.npy`` (row-major,
    ``spec.feature_dtype``), or ``token_ids_{split}.npy`` for the LSTM, and
    ``extras.json``.  The fitted encoder is cached by `fitted_text_encoder`.

    Returns (text inputs by split, read-only memory maps; extras: e.g. the
    LSTM vocabulary, and ``feature_files``: {split: {"text": {"file", "key"[, "reader"]}}}).
    """
    spec.validate()
    cache_dir = pathlib.Path(cache_dir)
    key = {**spec.text_key(), "s": _splits_key(splits), "captions": _captions_digest(splits)}
    text_dir = cache_dir / f"text_{spec.text_encoder}_{cache_digest(key)}"
    lstm = spec.text_encoder == "lstm"
    files = {s: text_dir / (f"token_ids_{s}.npy" if lstm else f"text_features_{s}.npy") for s in splits}
    if not all(f.exists() for f in files.values()) or not (text_dir / "extras.json").exists():
        start = time.time()
        tokens = _tokenized(splits)
        text_dir.mkdir(parents=True, exist_ok=True)
        if lstm:
            vocab = build_vocabulary(tokens["train"])
            index = {w: i for i, w in enumerate(vocab)}
            for s, toks in tokens.items():
                ids = np.zeros((len(toks), spec.max_len), np.int32)
                for r, t in enumerate(toks):
                    row = [index.get(w, 1) for w in t[:spec.max_len]]
                    ids[r, :len(row)] = row
                write_rows(files[s], ids)
            extra = {"vocabulary": vocab}
        else:
            encoder = fitted_text_encoder(spec, tokens["train"], cache_dir)
            for s, toks in tokens.items():
                write_sentence_features(encoder, toks, files[s], storage_dtype(spec.feature_dtype))
            extra = {}
        (text_dir / "extras.json").write_text(json.dumps(extra), encoding="utf-8")
        logging.info("text features (%s) computed in %.1f s", spec.text_encoder, time.time() - start)
    extras = json.loads((text_dir / "extras.json").read_text(encoding="utf-8"))
    # Where each split's inputs live, so a run can point at its evaluation
    # split instead of copying it (tf_twobranch.runs).
    extras["feature_files"] = {
        s: {"text": {"file": str(files[s].absolute()), "key": None, **({"reader": "npy"} if lstm else {})}}
        for s in splits}
    text = {}
    for s, corpus in splits.items():
        if lstm:
            text[s] = open_rows(files[s])
        else:  # checked for NaN/inf when written
            text[s] = load_feature_matrix(files[s], expected_rows=corpus.num_captions,
                                          check_finite=False)
    return text, extras


def prepare_retrieval_features(splits: dict[str, CaptionCorpus], layout: DatasetLayout, cache_dir,
                               spec: FeatureSpec) -> tuple[dict, dict, dict]:
    """Image and text inputs for every split, cached under `cache_dir` (memory-mapped).

    Image files are found with `layout.image_path`; the scene CNN gets region
    supervision from the layout's Flickr30K Entities folder when it has one.
    Text inputs: `prepare_text_features`.

    Returns (image_features by split, text inputs by split, extras) where
    extras holds e.g. the LSTM vocabulary and ``feature_files``: {split: {"image"|"text":
    {"file", "key"}}}, the cache files the inputs were read from.
    """
    spec.validate()
    cache_dir = pathlib.Path(cache_dir)
    image_dir = _image_cache_dir(spec, splits, cache_dir)
    image_files = {s: image_dir / f"image_features_{s}.npy" for s in splits}
    # The features are only servable with the scene CNN that made them: a cache
    # without it (written before it was kept) is recomputed whole.
    backbone_kept = spec.image_backbone != "scene_cnn" or (image_dir / SCENE_CNN_FILE).is_file()
    if not all(f.exists() for f in image_files.values()) or not backbone_kept:
        start = time.time()
        feats = _image_features(spec, splits, layout, image_dir)
        for s, f in feats.items():
            write_rows(image_files[s], f, storage_dtype(spec.feature_dtype))
        logging.info("image features (%s) computed in %.1f s", spec.image_backbone,
                     time.time() - start)
    text_feats, extras = prepare_text_features(splits, cache_dir, spec)
    image_feats = {}
    for s, corpus in splits.items():
        image_feats[s] = load_feature_matrix(image_files[s], expected_rows=corpus.num_images)
        extras["feature_files"][s]["image"] = {"file": str(image_files[s].absolute()), "key": None}
    return image_feats, text_feats, extras
