"""Feature preparation for phrase localization (TPAMI §4): regions and phrases.

For each split of a Flickr30K-Entities-style dataset folder (``Sentences/``,
``Annotations/``, ``train.txt``/``val.txt``/``test.txt``, the images), given
as its `tf_twobranch.data.layout.DatasetLayout` (``resolve_dataset``):

* phrase examples (:func:`tf_twobranch.data.phrases.build_phrase_examples`:
  non-visual phrases excluded, plural chains merged into one box);
* region proposals, from ``RegionFeatureSpec.proposals`` (HDF5 file or
  directory, :mod:`tf_twobranch.data.formats.proposals`), else the layout's
  (``<dataset_dir>/proposals.h5``), else generated once with the built-in
  generator (:mod:`tf_twobranch.data.proposal_generator`) and cached;
* one feature vector per proposal and per ground-truth region (single crop
  warped to the backbone input, §4.3), one image at a time, with the
  ``scene_cnn`` backbone trained once on the training images and captions
  (saved in the cache) or a VGG/ResNet backbone from ``backbone_weights``;
* phrase features: Fisher vectors (HGLMM/GMM) / mean word vectors / tf-idf of
  the phrase words, the encoder fitted on the *training phrases*, with word
  vectors from a local file or trained on the training captions.

Everything is cached under ``cache_dir`` in directories named by a digest of
the settings; region features are ``.npy`` files read back as memory maps.
:func:`prepare_phrase_localization` returns one
:class:`~tf_twobranch.data.phrase_localization_data.PhraseLocalizationData`
per split; :func:`load_phrase_encoder` and :func:`split_region_features`
give the same encoder / proposal features to other experiments (Table 5).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Sequence

import numpy as np
from absl import logging
from PIL import Image

from tf_twobranch.boxes import clip_boxes
from tf_twobranch.data.formats.images import load_image
from tf_twobranch.data.formats.proposals import IMAGE_TOLERANCE, fit_proposals_to_images, read_proposals
from tf_twobranch.data.formats.row_arrays import temp_beside
from tf_twobranch.data.formats.word_vectors import load_word_vectors
from tf_twobranch.data.layout import SPLITS, DatasetLayout
from tf_twobranch.data.phrase_localization_data import (build_phrase_localization_data, ground_truth_regions,
                                                        unique_phrase_index)
from tf_twobranch.data.phrases import build_phrase_examples
from tf_twobranch.data.proposal_generator import generate_proposals_for_images
from tf_twobranch.data.retrieval_data import load_caption_splits
from tf_twobranch.data.tokenize import tokenize_caption
from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.features import SCENE_CNN_EPOCHS
from tf_twobranch.features.backbones import build_backbone
from tf_twobranch.features.image_features import extract_region_features
from tf_twobranch.features.images import load_images_at_size
from tf_twobranch.features.prepare import IMAGE_BACKBONES, cache_digest
from tf_twobranch.features.scene_cnn import load_scene_cnn, save_scene_cnn, train_scene_cnn
from tf_twobranch.features.text_features import build_text_encoder, encoder_needs_word_vectors, load_text_encoder
from tf_twobranch.features.word_vectors import train_word_vectors

PHRASE_ENCODERS = ("fisher_hglmm", "fisher_gmm", "mean_vector", "tfidf")


@dataclasses.dataclass
class RegionFeatureSpec:
    """Settings of the region and phrase features (all part of the cache key)."""
    image_backbone: str = "scene_cnn"
    backbone_weights: str | None = None
    scene_cnn_epochs: int = SCENE_CNN_EPOCHS
    proposals: str | None = None
    max_proposals: int = 200
    text_encoder: str = "fisher_hglmm"
    word_vectors: str | None = None
    word_dim: int = 300
    fisher_components: int = 30
    pca_dim: int = 6000
    max_images: dict | None = None   # split -> keep only its first N images (quick runs)
    seed: int = 0
    # Clip proposals that extend outside their image (crops and IoU both use
    # the clipped boxes) instead of refusing them.  Not part of the cache key:
    # crops were always clipped, so the features do not depend on it.
    clip_proposals: bool = False

    def validate(self) -> None:
        if self.image_backbone not in IMAGE_BACKBONES:
            raise ConfigError(f"image_backbone must be one of {IMAGE_BACKBONES}, got {self.image_backbone!r}")
        if self.text_encoder not in PHRASE_ENCODERS:
            raise ConfigError(f"phrase text_encoder must be one of {PHRASE_ENCODERS}, got {self.text_encoder!r}")
        for name in ("scene_cnn_epochs", "max_proposals", "word_dim", "fisher_components", "pca_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("backbone_weights", "word_vectors", "proposals"):
            path = getattr(self, name)
            if path and not pathlib.Path(path).exists():
                raise ConfigError(f"--{name}={path}: file not found")
        if self.image_backbone != "scene_cnn" and not self.backbone_weights:
            raise ConfigError(f"image_backbone={self.image_backbone} needs --backbone_weights (a local "
                              "ImageNet weights file; nothing is downloaded)")


# --------------------------------------------------------------------------- inputs


def _split_ids(layout: DatasetLayout, split: str, spec: RegionFeatureSpec) -> list[str]:
    """Image ids of the split list (`DatasetLayout.split_ids`), the first
    ``spec.max_images[split]`` of them when set."""
    ids = layout.split_ids(split)
    limit = (spec.max_images or {}).get(split)
    return ids[:limit] if limit else ids


def _proposals_source(layout: DatasetLayout, cache_dir: pathlib.Path, spec: RegionFeatureSpec,
                      all_ids: Sequence[str]) -> pathlib.Path:
    if spec.proposals:
        return pathlib.Path(spec.proposals)
    if layout.proposals is not None:
        return layout.proposals
    generated = cache_dir / f"proposals_generated_{spec.max_proposals}_{cache_digest({'ids': list(all_ids)})}.h5"
    if not generated.exists():
        logging.info("No proposals file: generating %d proposals for %d images into %s",
                     spec.max_proposals, len(all_ids), generated)
        generated.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_beside(generated)
        generate_proposals_for_images(layout.image_paths(all_ids), tmp,
                                      num_proposals=spec.max_proposals, seed=spec.seed, image_ids=list(all_ids))
        tmp.rename(generated)
    return generated


def read_split_proposals(path, image_ids: Sequence[str], max_proposals: int) -> dict[str, np.ndarray]:
    """Proposals of ``image_ids`` (best ``max_proposals`` first).

    Missing images (all of them counted in one error naming the first), an
    unreadable file or an invalid box are DataFormatErrors naming the file.
    """
    path = pathlib.Path(path)
    boxes = read_proposals(path, list(image_ids))
    out = {}
    for image_id in image_ids:
        b = boxes[image_id][:max_proposals]
        if len(b) == 0:
            raise DataFormatError(path, f"image {image_id} has no proposals", record=image_id)
        out[image_id] = b
    return out


def _half_open(boxes: np.ndarray, height: int, width: int) -> np.ndarray:
    """Inclusive-pixel boxes (tf_twobranch.boxes) → half-open crops inside the image.

    Boxes are clipped with :func:`tf_twobranch.boxes.clip_boxes` first, the
    same clipping that :func:`split_region_features` applies to the proposals
    used for IoU (there it is a no-op: those boxes are already inside).
    """
    b = clip_boxes(boxes, width, height).astype(np.float64)
    b[:, 2:] += 1
    return b


# --------------------------------------------------------------------------- backbone


def region_backbone(layout: DatasetLayout, region_dir: pathlib.Path, spec: RegionFeatureSpec):
    """The CNN used for region crops: scene_cnn trained once (cached), or a VGG/ResNet from local weights."""
    if spec.image_backbone != "scene_cnn":
        return build_backbone(spec.image_backbone, weights_path=spec.backbone_weights)
    path = region_dir / "scene_cnn.keras"
    if path.exists():
        return load_scene_cnn(path)
    # Same training inputs as the image-sentence features (tf_twobranch.features.prepare):
    # the training images and their captions.
    train = load_caption_splits(layout)["train"]
    # Square images of one size (the embedded data) are used as they are; real
    # images of mixed sizes are resized to 96x96.  Region crops of any size are
    # then warped to the network's input by extract_region_features.
    images = load_images_at_size(layout.image_paths(train.image_ids, source=train.source,
                                                    file_names=getattr(train, "file_names", None)))
    tokens = [[tokenize_caption(c) for c in caps] for caps in train.captions_by_image()]
    backbone = train_scene_cnn(images, tokens, epochs=spec.scene_cnn_epochs, seed=spec.seed)
    region_dir.mkdir(parents=True, exist_ok=True)
    save_scene_cnn(backbone, path)
    return backbone


# --------------------------------------------------------------------------- region features


def _region_key(spec: RegionFeatureSpec, proposals_path: pathlib.Path) -> dict:
    return {"backbone": spec.image_backbone, "weights": spec.backbone_weights,
            "scene_cnn_epochs": spec.scene_cnn_epochs, "proposals": str(proposals_path.resolve()),
            "max_proposals": spec.max_proposals, "seed": spec.seed}


def split_region_features(layout: DatasetLayout, split: str, cache_dir, spec: RegionFeatureSpec, *,
                          examples=None):
    """Proposals and region features of one split (computed once, then memory-mapped).

    Returns a dict with ``image_ids`` (the split file's order), ``proposals``
    {id: (N_i, 4)}, ``proposal_features`` {id: (N_i, D)} and
    ``gt_region_features`` {id: (G_i, D)} in the order of
    :func:`~tf_twobranch.data.phrase_localization_data.ground_truth_regions`.

    Before any feature is computed the proposals are checked against their
    image's size (:func:`~tf_twobranch.data.formats.proposals.fit_proposals_to_images`):
    a box outside the image by more than 1 pixel is a DataFormatError unless
    ``spec.clip_proposals``; the returned ``proposals`` are the boxes clipped
    to the image, i.e. exactly the boxes that were cropped, so IoU with the
    ground truth and the region features agree.
    """
    spec.validate()
    cache_dir = pathlib.Path(cache_dir)
    ids = _split_ids(layout, split, spec)
    if examples is None:
        layout.require("entities", purpose="phrase localization")
        examples = build_phrase_examples(layout.entities_dir, ids)
    proposals_path, region_dir = _region_cache(layout, cache_dir, spec)
    proposals = read_split_proposals(proposals_path, ids, spec.max_proposals)
    gt = ground_truth_regions(examples)
    stem = f"{split}_{cache_digest({'ids': ids})}"
    index_path = region_dir / f"{stem}_index.json"
    # Image sizes (width, height): from the cache index, else from the image headers (cheap, no decoding).
    cached_sizes = (json.loads(index_path.read_text(encoding="utf-8")).get("image_sizes")
                    if index_path.exists() else None)
    if cached_sizes is not None:
        sizes = {i: tuple(size) for i, size in zip(ids, cached_sizes)}
    else:
        sizes = {}
        for image_id, path in zip(ids, layout.image_paths(ids)):
            try:
                with Image.open(path) as handle:
                    sizes[image_id] = tuple(handle.size)
            except (OSError, ValueError, SyntaxError):
                height, width = load_image(path).shape[:2]  # a DataFormatError naming the file
                sizes[image_id] = (width, height)
    proposals, clipped = fit_proposals_to_images(proposals_path, proposals, sizes, clip=spec.clip_proposals)
    if clipped:
        logging.info("%d of %d proposal boxes of the %s split (%s) extended outside their image and were "
                     "clipped to it (%s); crops and IoU use the clipped boxes", clipped,
                     sum(len(b) for b in proposals.values()), split, proposals_path,
                     "clip_proposals is set" if spec.clip_proposals
                     else f"within the {IMAGE_TOLERANCE:g}-pixel tolerance")
    if not index_path.exists():
        backbone = region_backbone(layout, region_dir, spec)
        dim = int(backbone.output_shape[-1])
        counts = [len(proposals[i]) for i in ids]
        gt_counts = [len(gt[i][1]) if i in gt else 0 for i in ids]
        region_dir.mkdir(parents=True, exist_ok=True)
        tmp_p, tmp_g = temp_beside(region_dir / f"{stem}_proposals.npy"), temp_beside(region_dir / f"{stem}_gt.npy")
        prop = np.lib.format.open_memmap(tmp_p, "w+", np.float32, (sum(counts), dim))
        gtf = np.lib.format.open_memmap(tmp_g, "w+", np.float32, (max(1, sum(gt_counts)), dim))
        start, p_at, g_at = time.time(), 0, 0
        for n, (image_id, path) in enumerate(zip(ids, layout.image_paths(ids))):
            image = load_image(path)
            h, w = image.shape[:2]
            boxes = proposals[image_id]
            if image_id in gt:
                boxes = np.concatenate([boxes, gt[image_id][1]])
            feats = extract_region_features(image, _half_open(boxes, h, w), backbone, batch_size=256,
                                            source=f"{proposals_path} (image {image_id})")
            c, g = counts[n], gt_counts[n]
            prop[p_at:p_at + c] = feats[:c]
            gtf[g_at:g_at + g] = feats[c:]
            p_at, g_at = p_at + c, g_at + g
            if (n + 1) % 100 == 0:
                logging.info("region features (%s): %d/%d images, %.0f s", split, n + 1, len(ids),
                             time.time() - start)
        prop.flush()
        gtf.flush()
        del prop, gtf
        tmp_p.rename(region_dir / f"{stem}_proposals.npy")
        tmp_g.rename(region_dir / f"{stem}_gt.npy")
        index_path.write_text(json.dumps({"image_ids": ids, "proposal_counts": counts, "gt_counts": gt_counts,
                                          "image_sizes": [list(sizes[i]) for i in ids]}), encoding="utf-8")
        logging.info("region features of %s computed in %.1f s", split, time.time() - start)
    index = json.loads(index_path.read_text(encoding="utf-8"))
    prop = np.load(region_dir / f"{stem}_proposals.npy", mmap_mode="r")
    gtf = np.load(region_dir / f"{stem}_gt.npy", mmap_mode="r")
    p_off = np.concatenate([[0], np.cumsum(index["proposal_counts"])])
    g_off = np.concatenate([[0], np.cumsum(index["gt_counts"])])
    return {"image_ids": ids, "proposals": proposals, "proposals_path": str(proposals_path),
            "examples": examples,
            "proposal_features": {i: prop[p_off[n]:p_off[n + 1]] for n, i in enumerate(ids)},
            "gt_region_features": {i: gtf[g_off[n]:g_off[n + 1]] for n, i in enumerate(ids)}}


# --------------------------------------------------------------------------- phrase features


def _phrase_key(spec: RegionFeatureSpec, train_ids: Sequence[str]) -> dict:
    return {"encoder": spec.text_encoder, "word_vectors": spec.word_vectors, "word_dim": spec.word_dim,
            "fisher_components": spec.fisher_components, "pca_dim": spec.pca_dim, "seed": spec.seed,
            "train": cache_digest({"ids": list(train_ids)})}


def _region_cache(layout: DatasetLayout, cache_dir: pathlib.Path, spec: RegionFeatureSpec):
    """(proposals file, region-feature cache folder) of a layout and spec: the folder holds the
    region features of every split and, for scene_cnn, the region backbone."""
    all_ids = [i for s in SPLITS if layout.has(s) for i in layout.split_ids(s)]
    proposals_path = _proposals_source(layout, cache_dir, spec, all_ids)
    return proposals_path, cache_dir / f"regions_{spec.image_backbone}_{cache_digest(_region_key(spec, proposals_path))}"


def _phrase_encoder_path(cache_dir: pathlib.Path, spec: RegionFeatureSpec, train_ids) -> pathlib.Path:
    """Where the phrase encoder fitted on these training images is cached."""
    return cache_dir / f"phrases_{spec.text_encoder}_{cache_digest(_phrase_key(spec, train_ids))}" / "phrase_encoder.npz"


def load_phrase_encoder(layout: DatasetLayout, cache_dir, spec: RegionFeatureSpec, train_examples=None):
    """The phrase encoder fitted on the training phrases (cached as .npz).

    Word vectors come from ``spec.word_vectors`` or are trained on the
    training *captions* (more context than phrases alone).
    """
    spec.validate()
    cache_dir = pathlib.Path(cache_dir)
    train_ids = _split_ids(layout, "train", spec)
    path = _phrase_encoder_path(cache_dir, spec, train_ids)
    if path.exists():
        return load_text_encoder(path)
    if train_examples is None:
        layout.require("entities", purpose="phrase localization")
        train_examples = build_phrase_examples(layout.entities_dir, train_ids)
    phrase_tokens = [tokenize_caption(e.phrase) for e in train_examples]
    phrase_tokens = [t for t in phrase_tokens if t]
    kwargs = {}
    if encoder_needs_word_vectors(spec.text_encoder):
        if spec.word_vectors:
            wv = load_word_vectors(spec.word_vectors, vocabulary={w for t in phrase_tokens for w in t})
        else:
            train = load_caption_splits(layout)["train"]
            keep = set(train_ids)
            caption_tokens = [tokenize_caption(c) for c, i in zip(train.captions, train.caption_image)
                              if train.image_ids[i] in keep]
            num_words = len({w for t in caption_tokens for w in t})
            wv = train_word_vectors(caption_tokens, dim=min(spec.word_dim, max(2, num_words - 1)),
                                    seed=spec.seed)
        kwargs["word_vectors"] = wv
    if spec.text_encoder.startswith("fisher"):
        kwargs.update(num_components=spec.fisher_components, seed=spec.seed)
        fv_dim = 2 * spec.fisher_components * kwargs["word_vectors"].dim
        kwargs["pca_dim"] = spec.pca_dim if fv_dim > spec.pca_dim else None
    encoder = build_text_encoder(spec.text_encoder, **kwargs)
    encoder.fit(phrase_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    encoder.save(path)
    return encoder


def encode_phrases(encoder, phrases: Sequence[str]) -> np.ndarray:
    """float32 features of phrase strings (a phrase without words gets a zero row)."""
    tokens = [tokenize_caption(p) for p in phrases]
    out = np.zeros((len(tokens), encoder.output_dim), np.float32)
    nonempty = [i for i, t in enumerate(tokens) if t]
    if nonempty:
        out[nonempty] = encoder.transform([tokens[i] for i in nonempty]).astype(np.float32)
    return out


# --------------------------------------------------------------------------- assembly


def phrase_localization_inputs(layout: DatasetLayout, cache_dir, spec: RegionFeatureSpec) -> dict:
    """What a trained run needs besides its weights to score new images: the region
    backbone (name and weights file) and the fitted phrase encoder, as prepared (and
    cached) by `prepare_phrase_localization` for this layout and spec."""
    cache_dir = pathlib.Path(cache_dir)
    encoder = _phrase_encoder_path(cache_dir, spec, _split_ids(layout, "train", spec))
    inputs = {"dataset_dir": str(layout.root), "backbone": spec.image_backbone,
              "backbone_weights": spec.backbone_weights, "text_encoder": str(encoder.absolute())}
    if spec.image_backbone == "scene_cnn":
        _, region_dir = _region_cache(layout, cache_dir, spec)
        inputs["backbone_weights"] = str((region_dir / "scene_cnn.keras").absolute())
    return inputs


def prepare_phrase_localization(layout: DatasetLayout, cache_dir, spec: RegionFeatureSpec,
                                splits: Sequence[str] = ("train", "test")) -> dict:
    """``{split: PhraseLocalizationData}`` with cached region and phrase features.

    The layout must have the Flickr30K Entities folders and the split lists
    of ``train`` and `splits` (one error lists what the folder has and lacks).
    """
    spec.validate()
    layout.require(*dict.fromkeys(("train", *splits)), "entities", purpose="phrase localization")
    examples = {s: build_phrase_examples(layout.entities_dir, _split_ids(layout, s, spec))
                for s in set(splits) | {"train"}}
    for s in splits:
        if not examples[s]:
            raise DataFormatError(layout.split_files[s], f"the {s} split has no phrase with a box")
    encoder = load_phrase_encoder(layout, cache_dir, spec, train_examples=examples["train"])
    out = {}
    for s in splits:
        regions = split_region_features(layout, s, cache_dir, spec, examples=examples[s])
        strings, index = unique_phrase_index(examples[s])
        out[s] = build_phrase_localization_data(
            examples[s], regions["proposals"], regions["proposal_features"], regions["gt_region_features"],
            encode_phrases(encoder, strings), index)
    return out
