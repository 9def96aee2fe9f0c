"""Inputs of the deep fragment embeddings (Karpathy et al., NIPS 2014) for every split.

Image side (§3.2): fragment 0 the whole image, then the top `detections`
boxes of the proposals file (the layout's ``proposals.h5`` or
``FragmentFeatureSpec.proposals``), each encoded by the CNN; or a
precomputed ``(N, 20, D)`` array per split (``fragment_features``) for users
who ran RCNN elsewhere. With the ``scene_cnn`` backbone (trained once on the
training images, captions and box crops, `prepare.train_scene_cnn_backbone`)
the cache holds the activation *below* the CNN's top layer and that layer's
weights (batch norm folded in): the features are one matmul away, and the
second stage of the paper can fine-tune that layer (`image_head`).

Nothing here holds a split's whole fragment array: the cache is built image
by image into a resumable sharded row array (``<split>.inputs/``, float32 or
``feature_dtype=float16``) and read memory-mapped, and the scene CNN's
features (inputs·kernel + bias) are written once, block by block, beside it.

Sentence side (§3.1): the dependency parses of the captions (CoNLL-U: the
layout's ``<captions>.conllu``, or ``FragmentTextSpec.parses``), fragments of
the chosen kind, relation types under 1 % of the training fragments dropped,
words without a vector dropped; word vectors from a local word2vec/GloVe file
or PPMI-SVD vectors trained on the training parses' words.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import pathlib
import time
from typing import Mapping

import keras
import numpy as np
from absl import logging

from tf_twobranch.data.corpus import CaptionCorpus
from tf_twobranch.data.embedded_parses import embedded_parses_path
from tf_twobranch.data.formats.conllu import read_conllu
from tf_twobranch.data.formats.row_arrays import RowWriter, open_rows, storage_dtype, temp_beside
from tf_twobranch.data.formats.word_vectors import WordVectors, load_word_vectors
from tf_twobranch.data.layout import DatasetLayout
from tf_twobranch.systems.fragments.sentence_fragments import (FRAGMENT_KINDS, EncodedFragments, caption_trees,
                                                  encode_fragments, frequent_relations, relation_counts,
                                                  tree_triplets)
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.features import SCENE_CNN_EPOCHS
from tf_twobranch.features.backbones import build_backbone
from tf_twobranch.systems.fragments.image_fragments import DETECTIONS, extract_fragment_features, load_fragment_features
from tf_twobranch.features.prepare import IMAGE_BACKBONES, cache_digest, cached_scene_cnn
from tf_twobranch.features.prepare_regions import read_split_proposals
from tf_twobranch.features.word_vectors import train_word_vectors
from tf_twobranch.vectors import l2_normalize_rows

__all__ = ["FragmentFeatureSpec", "FragmentImages", "image_fragment_inputs", "fragment_cnn", "FragmentTextSpec",
           "FragmentText", "sentence_fragment_inputs"]

# Layers of the scene CNN: the activation below its top layer, the top layer and its batch norm.
_CUT_LAYER, _TOP_LAYER, _TOP_NORM = "pooled", "feature_dense", "scene_features"


@dataclasses.dataclass
class FragmentFeatureSpec:
    image_backbone: str = "scene_cnn"
    backbone_weights: str | None = None
    scene_cnn_epochs: int = SCENE_CNN_EPOCHS
    proposals: str | None = None
    detections: int = DETECTIONS
    fragment_features: dict | None = None   # split -> precomputed (N, F, D) .npy/.h5 file
    seed: int = 0
    feature_dtype: str = "float32"          # storage of the cache (float16: half the disk and page cache)

    def validate(self) -> None:
        storage_dtype(self.feature_dtype)
        if self.image_backbone not in IMAGE_BACKBONES:
            raise ConfigError(f"image_backbone must be one of {IMAGE_BACKBONES}, got {self.image_backbone!r}")
        if self.detections < 0:
            raise ConfigError(f"detections must be >= 0, got {self.detections}")
        if self.image_backbone != "scene_cnn" and not self.backbone_weights and not self.fragment_features:
            raise ConfigError(f"image_backbone={self.image_backbone} needs --backbone_weights (a local "
                              "ImageNet weights file; nothing is downloaded), or precomputed "
                              "--fragment_features")


@dataclasses.dataclass
class FragmentImages:
    """Image fragments of one split: CNN inputs (N, M, D) (a memory-mapped row array, float32 or
    float16), mask (N, M).

    ``head``: (kernel, bias) of the CNN's top layer when `inputs` are the
    activations below it (scene CNN); then ``features()`` = inputs·kernel + bias,
    written once to a file named by `features_stem` (the cache) when there is one.
    """

    image_ids: list[str]
    inputs: np.ndarray
    mask: np.ndarray
    head: tuple[np.ndarray, np.ndarray] | None = None
    features_stem: pathlib.Path | None = None

    def features(self, chunk: int = 256):
        """The fragments' final CNN features (N, M, D'), row-indexable; masked fragments are zero.

        Without a head: `inputs` themselves (no copy). With one: computed
        `chunk` images at a time into ``<features_stem>.features_<mask digest>.npy``
        (memory-mapped; the mask is in the name because masked rows are
        zeroed, and the fullframe ablation masks more), or into RAM without
        `features_stem`.
        """
        if self.head is None:
            return self.inputs
        kernel, bias = self.head
        shape = tuple(self.inputs.shape[:2]) + (kernel.shape[1],)
        if self.features_stem is None:
            out = np.empty(shape, np.float32)
            self._apply_head(out, chunk)
            return out
        digest = hashlib.sha1(np.packbits(np.asarray(self.mask, bool)).tobytes()).hexdigest()[:10]
        path = self.features_stem.with_name(f"{self.features_stem.name}.features_{digest}.npy")
        if not path.exists():
            with RowWriter(path, shape, self.inputs.dtype) as out:
                self._apply_head(out.array, chunk)
        return open_rows(path)

    def _apply_head(self, out, chunk: int) -> None:
        kernel, bias = self.head
        for i in range(0, len(self.inputs), chunk):
            block = np.asarray(self.inputs[i:i + chunk], np.float32) @ kernel + bias
            block[~np.asarray(self.mask[i:i + chunk], bool)] = 0.0
            out[i:i + chunk] = block


def _folded_top_layer(backbone: keras.Model) -> tuple[np.ndarray, np.ndarray]:
    """The scene CNN's top layer with its (inference-mode) batch norm folded in: y = x·W + b."""
    kernel = backbone.get_layer(_TOP_LAYER).get_weights()[0]
    gamma, beta, mean, variance = backbone.get_layer(_TOP_NORM).get_weights()
    scale = gamma / np.sqrt(variance + backbone.get_layer(_TOP_NORM).epsilon)
    return (kernel * scale[None, :]).astype(np.float32), (beta - mean * scale).astype(np.float32)


def _scene_cnn_cut(backbone: keras.Model) -> keras.Model:
    """The scene CNN up to the activation below its top layer (what the cache stores for it)."""
    return keras.Model(backbone.input, backbone.get_layer(_CUT_LAYER).output)


def fragment_cnn(backbone: keras.Model, image_backbone: str, *, fine_tuned: bool) -> keras.Model:
    """The CNN from an image crop (S×S RGB 0..255) to the fragment model's image input, as this
    module computes the inputs of a row (`image_fragment_inputs` then
    `systems.fragments.pipeline.image_inputs`), for the raw-input export.

    `backbone`: the row's backbone (`build_backbone`, or the cached scene CNN);
    `image_backbone`: its name (``FragmentFeatureSpec.image_backbone``);
    `fine_tuned`: the row's model owns the CNN's top layer (``image_head_dim``
    > 0): its input is the activation below that layer. The scene CNN's top
    layer otherwise comes with its batch norm folded in, as `FragmentImages.features`
    applies it. Other backbones: the backbone itself.
    """
    if image_backbone != "scene_cnn":
        return backbone
    cut = _scene_cnn_cut(backbone)
    if fine_tuned:
        return cut
    kernel, bias = _folded_top_layer(backbone)
    top = keras.layers.Dense(kernel.shape[1], name="folded_top_layer")
    outputs = top(cut.output)
    top.set_weights([kernel, bias])
    return keras.Model(backbone.input, outputs, name="fragment_cnn")


def image_fragment_inputs(layout: DatasetLayout, splits: Mapping[str, CaptionCorpus], cache_dir,
                          spec: FragmentFeatureSpec) -> dict[str, FragmentImages]:
    """`FragmentImages` of every split (computed once, then read from `cache_dir`)."""
    spec.validate()
    if spec.fragment_features:
        out = {}
        for split, corpus in splits.items():
            path = spec.fragment_features.get(split)
            if not path:
                raise UserInputError(f"--fragment_features gives no file for the {split} split "
                                     f"(given: {sorted(spec.fragment_features)})")
            inputs, mask = load_fragment_features(path, expected_images=corpus.num_images,
                                                  cache_dir=pathlib.Path(cache_dir) / "fragment_features",
                                                  dtype=spec.feature_dtype)
            out[split] = FragmentImages(list(corpus.image_ids), inputs, mask)
        return out
    proposals_path = pathlib.Path(spec.proposals) if spec.proposals else layout.proposals
    if proposals_path is None:
        raise UserInputError(f"{layout.root}: image fragments need region proposals: pass --proposals=<HDF5 "
                             "file or folder of ranked boxes> (or put proposals.h5 in the dataset folder), "
                             "or precomputed --fragment_features")
    key = {"backbone": spec.image_backbone, "weights": spec.backbone_weights, "seed": spec.seed,
           "scene_cnn_epochs": spec.scene_cnn_epochs, "proposals": str(proposals_path.resolve()),
           "detections": spec.detections,
           "train": cache_digest({"ids": list(splits["train"].image_ids)})}
    if spec.feature_dtype != "float32":
        key["dtype"] = spec.feature_dtype     # float32 caches keep the names they had
    folder = pathlib.Path(cache_dir) / f"fragments_{spec.image_backbone}_{cache_digest(key)}"
    backbone = None
    out = {}
    for split, corpus in splits.items():
        ids = list(corpus.image_ids)
        stem = folder / f"{split}_{cache_digest({'ids': ids})}"
        mask_path, legacy = stem.with_suffix(".mask.npy"), stem.with_suffix(".inputs.npy")
        # A complete cache of the earlier single-file layout is read as it is.
        inputs_path = legacy if legacy.exists() and mask_path.exists() else stem.with_suffix(".inputs")
        if not (mask_path.exists() and (inputs_path == legacy or (inputs_path / "rows.json").exists())):
            if backbone is None:
                folder.mkdir(parents=True, exist_ok=True)
                backbone = (cached_scene_cnn(layout, splits["train"], folder.parent, epochs=spec.scene_cnn_epochs,
                                             seed=spec.seed) if spec.image_backbone == "scene_cnn"
                            else build_backbone(spec.image_backbone, weights_path=spec.backbone_weights))
                if spec.image_backbone == "scene_cnn":
                    np.savez(folder / "head.npz", *_folded_top_layer(backbone))
                    encoder = _scene_cnn_cut(backbone)
                else:
                    encoder = backbone
            start = time.time()
            proposals = read_split_proposals(proposals_path, ids, spec.detections) if spec.detections else \
                {i: np.zeros((0, 4), np.float32) for i in ids}
            paths = layout.image_paths(ids, file_names=getattr(corpus, "file_names", None), source=corpus.source)
            _, mask = extract_fragment_features(dict(zip(ids, paths)), proposals, encoder, image_ids=ids,
                                                detections=spec.detections, out=inputs_path,
                                                dtype=storage_dtype(spec.feature_dtype))
            tmp = temp_beside(mask_path)
            np.save(tmp, mask)
            tmp.rename(mask_path)
            logging.info("image fragments of %s (%d images, %d fragments): %.1f s", split, len(ids),
                         int(mask.sum()), time.time() - start)
        head = None
        if (folder / "head.npz").exists():
            with np.load(folder / "head.npz") as arrays:
                head = (arrays["arr_0"], arrays["arr_1"])
        out[split] = FragmentImages(ids, open_rows(inputs_path), np.load(mask_path), head, stem)
    return out


# ---------------------------------------------------------------------------- sentences


@dataclasses.dataclass
class FragmentTextSpec:
    fragments: str = "dependency"
    collapse_prepositions: bool = False
    min_relation_fraction: float = 0.01
    parses: str | None = None
    word_vectors: str | None = None
    word_dim: int = 200
    seed: int = 0

    def validate(self) -> None:
        if self.fragments not in FRAGMENT_KINDS:
            raise ConfigError(f"fragments must be one of {FRAGMENT_KINDS}, got {self.fragments!r}")
        if not 0 <= self.min_relation_fraction < 1:
            raise ConfigError(f"min_relation_fraction must be in [0, 1), got {self.min_relation_fraction}")
        for name in ("parses", "word_vectors"):
            path = getattr(self, name)
            if path and not pathlib.Path(path).is_file():
                raise UserInputError(f"--{name}={path}: file not found")


@dataclasses.dataclass
class FragmentText:
    """Sentence fragments of every split, with the vocabularies they index."""

    relations: list[str]
    word_vectors: WordVectors
    splits: dict[str, EncodedFragments]
    stats: dict


def _parses_path(layout: DatasetLayout, spec: FragmentTextSpec) -> pathlib.Path:
    if spec.parses:
        return pathlib.Path(spec.parses)
    if layout.parses is not None:
        return layout.parses
    if layout.embedded:
        return embedded_parses_path(layout.root)
    raise UserInputError(f"{layout.root}: no dependency parses of the captions: pass --parses=<file.conllu> "
                         "(CoreNLP, Stanza, UDPipe or spaCy output, one sentence per caption with "
                         "`# sent_id = <image>#<k>`), put <caption file stem>.conllu beside the caption "
                         "file, or parse with --parser=spacy --spacy_model=<model>")


def sentence_fragment_inputs(layout: DatasetLayout, splits: Mapping[str, CaptionCorpus],
                             spec: FragmentTextSpec, *, parses: str | pathlib.Path | None = None) -> FragmentText:
    """Fragments of every split's captions (the paper's filtering; see the module docstring)."""
    spec.validate()
    path = pathlib.Path(parses) if parses else _parses_path(layout, spec)
    trees = read_conllu(path)
    split_trees = {split: caption_trees(trees, corpus, path) for split, corpus in splits.items()}
    triplets = {split: [tree_triplets(t, spec.fragments, collapse_prepositions=spec.collapse_prepositions)
                        for t in split_trees[split]]
                for split in splits}
    counts = relation_counts(triplets["train"])
    relations = frequent_relations(counts, spec.min_relation_fraction)
    train_words = [[w.lower() for w in t.words] for t in split_trees["train"]]
    if spec.word_vectors:
        wanted = {t.word1 for s in triplets["train"] for t in s} | {t.word2 for s in triplets["train"] for t in s}
        vectors = load_word_vectors(spec.word_vectors, vocabulary=wanted)
        if vectors.dim != spec.word_dim:
            raise UserInputError(f"{spec.word_vectors}: word vectors have {vectors.dim} dimensions but "
                                 f"--word_dim={spec.word_dim}")
    else:
        vectors = train_word_vectors(train_words, dim=spec.word_dim, seed=spec.seed)
        # PPMI-SVD rows (U·sqrt(S)) have norms spanning orders of magnitude
        # with word frequency, unlike word2vec's; unit rows keep the
        # directions (as the dual-path experiment does).
        vectors = WordVectors(vectors.words, l2_normalize_rows(vectors.vectors, epsilon=1e-8))
        if vectors.dim != spec.word_dim:
            raise UserInputError(f"only {vectors.dim + 1} distinct training words: --word_dim={spec.word_dim} "
                                 f"PPMI-SVD vectors cannot be trained; pass --word_dim={vectors.dim} or less")
    # The evaluated splits keep their parsed words (grounding maps Entities phrases onto them);
    # the training split, the large one, does not.
    encoded = {split: encode_fragments(t, relations, vectors.index, words=None if split == "train" else
                                       [tree.words for tree in split_trees[split]])
               for split, t in triplets.items()}
    del split_trees
    stats = {"parses": str(path), "relation_types_before_filter": len(counts),
             "relation_types_after_filter": len(relations), "relations": relations,
             "relation_counts": dict(collections.Counter(counts).most_common())}
    for split, e in encoded.items():
        stats[f"{split}_fragments_per_sentence"] = float(e.lengths.mean()) if e.num_sentences else 0.0
        stats[f"{split}_sentences_without_fragments"] = int(len(e.empty))
        if len(e.empty):
            # The paper's code scores such a sentence 0 against every image
            # (S_kl's numerator is an empty sum): it stays in the ranking.
            logging.warning("%s split: %d of %d sentences have no fragment after filtering (e.g. %r); "
                            "they score 0 with every image", split, len(e.empty), e.num_sentences,
                            splits[split].captions[int(e.empty[0])][:60])
    logging.info("sentence fragments (%s%s): %d relation types, %d after the %.0f%% filter; %s",
                 spec.fragments, ", prepositions collapsed" if spec.collapse_prepositions else "",
                 len(counts), len(relations), 100 * spec.min_relation_fraction,
                 json.dumps({k: v for k, v in stats.items() if k.endswith(("per_sentence", "fragments"))}))
    return FragmentText(relations, vectors, encoded, stats)
