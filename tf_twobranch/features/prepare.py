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

Cached features are written in the original code's layout — image features
in a ``.mat`` file under ``image_features`` (N, D), text features in an
HDF5 file under ``text_features`` stored column-major (D, N) — and read back
with the package's readers, so a user can drop in their own files with the
same names.
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
from tf_twobranch.data.formats import load_feature_matrix, save_feature_matrix
from tf_twobranch.data.formats.word_vectors import load_word_vectors
from tf_twobranch.data.layout import DatasetLayout
from tf_twobranch.data.tokenize import build_vocabulary, tokenize_caption
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.features.backbones import build_backbone
from tf_twobranch.features.image_features import extract_image_features
from tf_twobranch.features.images import load_images_at_size
from tf_twobranch.features.scene_cnn import entity_region_crops, load_scene_cnn, save_scene_cnn, train_scene_cnn
from tf_twobranch.features.text_features import build_text_encoder, encoder_needs_word_vectors
from tf_twobranch.features.word_vectors import train_word_vectors

SCENE_CNN_RECIPE = "2: region-supervised, binary targets"
IMAGE_BACKBONES = ("scene_cnn", "vgg19", "vgg16", "resnet50", "resnet152")
TEXT_ENCODERS = ("fisher_hglmm", "fisher_gmm", "mean_vector", "tfidf", "lstm")


@dataclasses.dataclass
class FeatureSpec:
    image_backbone: str = "scene_cnn"
    backbone_weights: str | None = None
    ten_crop: bool = True
    scene_cnn_epochs: int = 12
    text_encoder: str = "fisher_hglmm"
    word_vectors: str | None = None
    word_dim: int = 300
    fisher_components: int = 30
    pca_dim: int = 6000
    max_len: int = 32
    seed: int = 0

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
        for name in ("backbone_weights", "word_vectors"):
            path = getattr(self, name)
            if path and not pathlib.Path(path).exists():
                raise ConfigError(f"--{name}={path}: file not found")

    def image_key(self) -> dict:
        # The recipe version invalidates caches when the scene CNN's training
        # changes (e.g. region supervision from the Entities boxes).
        return {**{k: getattr(self, k) for k in ("image_backbone", "backbone_weights", "ten_crop",
                                                 "scene_cnn_epochs", "seed")},
                "recipe": SCENE_CNN_RECIPE if self.image_backbone == "scene_cnn" else None}

    def text_key(self) -> dict:
        return {k: getattr(self, k) for k in ("text_encoder", "word_vectors", "word_dim",
                                              "fisher_components", "pca_dim", "max_len", "seed")}


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


def cached_scene_cnn(layout: DatasetLayout, train: CaptionCorpus, cache_dir, *, epochs: int,
                     seed: int = 0):
    """The scene CNN trained on `train` (`train_scene_cnn_backbone`), trained once per
    (training images, epochs, seed) and kept in ``cache_dir/scene_cnn_<digest>/scene_cnn.keras``,
    so the models that share it (deep fragment embeddings, the N-pair localization model)
    train it once."""
    key = {"epochs": epochs, "seed": seed, "train": cache_digest({"ids": list(train.image_ids)})}
    path = pathlib.Path(cache_dir) / f"scene_cnn_{cache_digest(key)}" / "scene_cnn.keras"
    if path.exists():
        return load_scene_cnn(path)
    backbone, _ = train_scene_cnn_backbone(FeatureSpec(scene_cnn_epochs=epochs, seed=seed), train, layout)
    save_scene_cnn(backbone, path)
    return backbone


def _image_features(spec: FeatureSpec, splits: dict[str, CaptionCorpus],
                    layout: DatasetLayout) -> dict[str, np.ndarray]:
    paths = {s: layout.image_paths(c.image_ids, file_names=getattr(c, "file_names", None), source=c.source)
             for s, c in splits.items()}
    if spec.image_backbone == "scene_cnn":
        backbone, size = train_scene_cnn_backbone(spec, splits["train"], layout, paths["train"])
        # Ten crops of 7/8 of the image, as 224 of 256 in the paper; every
        # file (any size) is resized to size x size first, as in training.
        kwargs = dict(crop_size=size * 7 // 8, resize_to=size) if spec.ten_crop else {}
    else:
        backbone = build_backbone(spec.image_backbone, weights_path=spec.backbone_weights)
        kwargs = {}
    return {s: extract_image_features(p, backbone, ten_crop=spec.ten_crop, **kwargs)
            for s, p in paths.items()}


def sentence_features(spec: FeatureSpec, splits: dict[str, CaptionCorpus]):
    """Text inputs of every split (`spec.text_encoder`, fitted on the training captions), and extras.

    Not cached: `prepare_retrieval_features` caches them; the precomp layout
    calls this directly (it ships image features only).
    """
    tokens = {s: [tokenize_caption(c) for c in corpus.captions] for s, corpus in splits.items()}
    empty = [(s, i) for s, toks in tokens.items() for i, t in enumerate(toks) if not t]
    if empty:
        s, i = empty[0]
        corpus = splits[s]
        raise DataFormatError(corpus.source or s,
                              f"caption {i} of image {corpus.image_ids[corpus.caption_image[i]]} "
                              f"has no words ({len(empty)} empty caption(s) in all)")
    if spec.text_encoder == "lstm":
        vocab = build_vocabulary(tokens["train"])
        index = {w: i for i, w in enumerate(vocab)}
        out = {}
        for s, toks in tokens.items():
            ids = np.zeros((len(toks), spec.max_len), np.int32)
            for r, t in enumerate(toks):
                row = [index.get(w, 1) for w in t[:spec.max_len]]
                ids[r, :len(row)] = row
            out[s] = ids
        return out, {"vocabulary": vocab}
    kwargs = {}
    if encoder_needs_word_vectors(spec.text_encoder):
        if spec.word_vectors:
            vocab = {w for t in tokens["train"] for w in t}
            wv = load_word_vectors(spec.word_vectors, vocabulary=vocab)
        else:
            num_words = len({w for t in tokens["train"] for w in t})
            dim = min(spec.word_dim, max(2, num_words - 1))
            logging.info("No --word_vectors file given: training %d-d PPMI-SVD word vectors on "
                         "the %d training captions (a word2vec/GloVe file gives the paper's setup)",
                         dim, len(tokens["train"]))
            wv = train_word_vectors(tokens["train"], dim=dim, seed=spec.seed)
        kwargs["word_vectors"] = wv
    if spec.text_encoder.startswith("fisher"):
        kwargs.update(num_components=spec.fisher_components, seed=spec.seed)
        fv_dim = 2 * spec.fisher_components * kwargs["word_vectors"].dim
        kwargs["pca_dim"] = spec.pca_dim if fv_dim > spec.pca_dim else None
    encoder = build_text_encoder(spec.text_encoder, **kwargs)
    encoder.fit(tokens["train"])
    return {s: encoder.transform(t).astype(np.float32) for s, t in tokens.items()}, {}


def prepare_retrieval_features(splits: dict[str, CaptionCorpus], layout: DatasetLayout, cache_dir,
                               spec: FeatureSpec) -> tuple[dict, dict, dict]:
    """Image and text inputs for every split, cached under `cache_dir`.

    Image files are found with `layout.image_path`; the scene CNN gets region
    supervision from the layout's Flickr30K Entities folder when it has one.

    Returns (image_features by split, text inputs by split, extras) where
    extras holds e.g. the LSTM vocabulary and ``feature_files``: {split: {"image"|"text":
    {"file", "key"}}}, the cache files the inputs were read from.
    """
    spec.validate()
    cache_dir = pathlib.Path(cache_dir)
    splits_key = {s: (c.num_images, c.num_captions, c.image_ids[0], c.image_ids[-1])
                  for s, c in splits.items()}
    image_dir = cache_dir / f"image_{spec.image_backbone}_{cache_digest({**spec.image_key(), 's': splits_key})}"
    text_dir = cache_dir / f"text_{spec.text_encoder}_{cache_digest({**spec.text_key(), 's': splits_key})}"
    image_feats, text_feats, extras = {}, {}, {}
    if not all((image_dir / f"image_features_{s}.mat").exists() for s in splits):
        start = time.time()
        feats = _image_features(spec, splits, layout)
        image_dir.mkdir(parents=True, exist_ok=True)
        for s, f in feats.items():
            save_feature_matrix(image_dir / f"image_features_{s}.mat", f, key="image_features")
        logging.info("image features (%s) computed in %.1f s", spec.image_backbone,
                     time.time() - start)
    if not all((text_dir / f"text_features_{s}.h5").exists() for s in splits):
        start = time.time()
        feats, extra = sentence_features(spec, splits)
        text_dir.mkdir(parents=True, exist_ok=True)
        (text_dir / "extras.json").write_text(json.dumps(extra), encoding="utf-8")
        for s, f in feats.items():
            if spec.text_encoder == "lstm":
                np.save(text_dir / f"token_ids_{s}.npy", f)
            # The original stores sentence features column-major in HDF5.
            save_feature_matrix(text_dir / f"text_features_{s}.h5", f.astype(np.float32),
                                key="text_features", layout="columns")
        logging.info("text features (%s) computed in %.1f s", spec.text_encoder,
                     time.time() - start)
    extras = json.loads((text_dir / "extras.json").read_text(encoding="utf-8"))
    # Where each split's inputs live, so a run can point at its evaluation
    # split instead of copying it (tf_twobranch.runs).
    extras["feature_files"] = {
        s: {"image": {"file": str((image_dir / f"image_features_{s}.mat").absolute()),
                      "key": "image_features"},
            "text": ({"file": str((text_dir / f"token_ids_{s}.npy").absolute()), "key": None,
                      "reader": "npy"}
                     if spec.text_encoder == "lstm" else
                     {"file": str((text_dir / f"text_features_{s}.h5").absolute()),
                      "key": "text_features"})}
        for s in splits}
    for s, corpus in splits.items():
        image_feats[s] = load_feature_matrix(image_dir / f"image_features_{s}.mat",
                                             "image_features", expected_rows=corpus.num_images)
        if spec.text_encoder == "lstm":
            text_feats[s] = np.load(text_dir / f"token_ids_{s}.npy")
        else:
            text_feats[s] = load_feature_matrix(text_dir / f"text_features_{s}.h5",
                                                "text_features", expected_rows=corpus.num_captions)
    return image_feats, text_feats, extras
