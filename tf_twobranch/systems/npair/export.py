"""SavedModel export of the N-pair localization model (Das et al.): JPEG bytes and captions in,
the pair's score S(I, T) and its per-word localization maps out.

Signature ``localize`` (also ``serving_default``), validated in the graph
(`tf_twobranch.export.serving`):

* inputs ``image_jpeg`` string (B,) of JPEG/PNG bytes and ``caption`` string
  (B,) of raw sentences; pair b is image b with caption b.
* ``score`` float32 (B,): S(I_b, T_b) exactly as the model's ``call`` (eq. 1
  with the model's aggregator, token average and normalisation).
* ``heat_maps`` float32 (B, T, h, w): the localization volume m_{r,c,t} =
  a_{r,c}·s_t (§3.1) of the normalised inputs, one map per token position;
  positions that are not words (``<start>``, ``<end>``, padding) are zero.
* ``token_mask`` bool (B, T): the word positions.
* ``tokens`` string (B, T): the vocabulary word at each word position, ""
  elsewhere.
* ``points`` int32 (B, T, 2): (x, y) = (column, row) in the model's S×S input
  image of each map's maximum, by the run's point rule (`point_rule`, the
  rules of `tf_twobranch.evaluation.pointing_game.heat_map_maximum`, §4.2):
  the centre pixel of the arg-max cell (default), or LocNet's first maximal
  pixel of the map upsampled bilinearly; ties to the first in row-major
  order. A position that is not a word points at (0, 0); read
  ``token_mask``. Scale x by W/S and y by H/S for the original image.

Images: decoded (JPEGs with the accurate DCT, as PIL) and resized whole to the
backbone's square input S (aspect ratio not kept, nothing cropped) by
`tf_twobranch.features.images.tf_pil_resize`: exactly the uint8 pixels of
`tf_twobranch.features.images.load_images_at_size` (PIL's bilinear resize)
that the backbone maps were computed from (an S×S image is not changed).

Captions: encoded as `tf_twobranch.systems.npair.features.encode_token_lists`
does for evaluation: tokenized in the graph (`TokenCoder`, the tokens of
`tokenize_caption`), words outside the vocabulary DROPPED (the ``tokens``
output shows the words kept), then the first max_words known words kept
(`tf_twobranch.systems.npair.features.kept_caption_words`, the one
caption-length rule of evaluation and the export: a longer caption is
clipped, not refused), ids ``<start> words <end>`` padded with ``<end>``
to ``max_tokens`` (= max_words + 2).

Retrieval (exported with ``gallery=``, `npair_gallery` /
`tf_twobranch.run_export.gallery_from_model`): ``retrieve_captions``
(``image_jpeg`` (B,), ``k``) and ``retrieve_images`` (``caption`` (B,), ``k``)
→ the top-k gallery ``caption_ids`` / ``image_ids``, their indices and
scores, best first (`tf_twobranch.export.retrieval_signatures`). The gallery holds each
gallery image's projected map and each gallery caption's token vectors (with
the mask of its words), both normalised as the model's score normalises
them, computed as ``model.evaluate`` computes them; a query is scored
against them with the model's aggregator (S_MaxImage by default) and token
average, the score ``evaluate`` ranks by. Gallery captions are the split's
token rows as evaluated (clipped to max_words); a query caption is
clipped by the same rule, as by ``localize``. The gallery is H·W·d floats per
image and T·d per caption (5,000 VGG maps at d = 1,024: 4 GB).

Bad requests fail with ``InvalidArgumentError`` naming the input and the
index of the first bad element: bytes that are not a JPEG/PNG or do not
decode, an empty (whitespace-only) caption, a caption with no word of the
vocabulary, batches of different sizes, empty batches or a wrong rank.

Inside the SavedModel: the vocabulary in word-vector row order (variable
``vocabulary``) and the model configuration JSON (variable ``config_json``);
``assets.extra`` holds ``run_config.json`` (with the vocabulary) and the TF
Serving warm-up file. The graph uses tensorflow-text's tokenizer ops:
``import tensorflow_text`` before loading (``tf_twobranch.tools.saved_model_cli``).
"""
from __future__ import annotations

import collections
import json
import pathlib
import tempfile
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_twobranch.data.text_codes import TokenCoder
from tf_twobranch.data.tokenize import PAD_TOKEN, UNK_TOKEN, tokenize_caption
from tf_twobranch.errors import ConfigError
from tf_twobranch.systems.npair import heat_maps as localization_maps
from tf_twobranch.evaluation.pointing_game import DEFAULT_POINT_RULE, POINT_RULES
from tf_twobranch.export import serving
from tf_twobranch.export.retrieval_signatures import RetrievalGallery, add_retrieval_signatures
from tf_twobranch.export.run_gallery import RunExport, batched, caption_keys, gallery_caption_ids, plain_captions
from tf_twobranch.export.saved_model import save_module_atomically, warmup_jpeg
from tf_twobranch.features.backbones import backbone_input_size
from tf_twobranch.systems.npair.features import CAPTION_LENGTH_RULE, kept_caption_words
from tf_twobranch.systems.npair import heat_map_volume as volume
from tf_twobranch.systems.npair.model import END_TOKEN, START_TOKEN, NPairLocalizationModel

__all__ = ["RESERVED_TOKENS", "NPairServingModule", "export_npair_model", "npair_gallery", "run_export"]

# Products of one gallery block per query row (H·W·T per image–caption pair): bounds a retrieval request's memory.
BLOCK_PRODUCTS = 2 ** 22

#: The first four vocabulary entries (`tf_twobranch.systems.npair.features.caption_inputs`); words follow.
RESERVED_TOKENS = (PAD_TOKEN, UNK_TOKEN, START_TOKEN, END_TOKEN)
FIRST_WORD_ID = len(RESERVED_TOKENS)
START_ID, END_ID = RESERVED_TOKENS.index(START_TOKEN), RESERVED_TOKENS.index(END_TOKEN)


def _check_vocabulary(vocabulary: Sequence[str], vocabulary_size: int) -> list[str]:
    vocabulary = list(vocabulary)
    if len(vocabulary) != vocabulary_size:
        raise ConfigError(f"vocabulary: got {len(vocabulary)} entries but the model's vocabulary_size is "
                          f"{vocabulary_size} (the rows of its word-vector table)")
    if tuple(vocabulary[:FIRST_WORD_ID]) != RESERVED_TOKENS:
        raise ConfigError(f"vocabulary must start with {list(RESERVED_TOKENS)} (the N-pair caption inputs, "
                          f"tf_twobranch.systems.npair.features), got {vocabulary[:FIRST_WORD_ID]}")
    for index, word in enumerate(vocabulary):
        if not isinstance(word, str) or not word.strip():
            raise ConfigError(f"vocabulary: entry {index} must be a non-empty string, got {word!r}")
    repeated = [word for word, count in collections.Counter(vocabulary).items() if count > 1]
    if repeated:
        raise ConfigError(f"vocabulary: words must be unique; repeated: {repeated[:5]}")
    return vocabulary


def heat_map_points(heat_maps, token_mask, image_size: int, rule: str = DEFAULT_POINT_RULE):
    """(B, T, 2) int32 (x, y) each (B, T, h, w) map points at in an image_size² input, by the pointing
    game's `rule` (`pointing_game.heat_map_maximum`, ties to the first in row-major order); (0, 0)
    where `token_mask` is False."""
    shape = tf.shape(heat_maps)
    height, width = shape[2], shape[3]

    def first_maximum(flat):
        # tf.argmax does not promise which of equal values it returns: take the smallest index at the maximum.
        at_max = tf.equal(flat, tf.reduce_max(flat, axis=1, keepdims=True))
        return tf.reduce_min(tf.where(at_max, tf.range(tf.shape(flat)[1])[None, :], tf.shape(flat)[1]), axis=1)

    if rule == "argmax":
        size = image_size
        flat_maps = tf.reshape(heat_maps, tf.concat([[-1], shape[2:], [1]], axis=0))
        first = first_maximum(tf.reshape(tf.image.resize(flat_maps, [size, size], method="bilinear"),
                                         [-1, size * size]))
        points = tf.stack([first % size, first // size], axis=1)
    else:
        cell = first_maximum(tf.reshape(heat_maps, [-1, height * width]))
        row, column = cell // width, cell % width
        # The centre pixel of the cell, in exact integers as the pointing game computes it.
        points = tf.stack([(2 * column + 1) * image_size // (2 * width),
                           (2 * row + 1) * image_size // (2 * height)], axis=1)
    points = tf.reshape(points, tf.concat([shape[:2], [2]], axis=0))
    return tf.where(tf.cast(token_mask, tf.bool)[:, :, None], points, tf.zeros_like(points))


def _first_true(condition):
    """Index of the first True of a (B,) bool tensor (0 when none)."""
    return tf.argmax(tf.cast(condition, tf.int32), output_type=tf.int32)


class NPairServingModule(tf.Module):
    """The N-pair model from image bytes and caption strings to scores, maps and points."""

    def __init__(self, model: NPairLocalizationModel, vocabulary: Sequence[str], *,
                 gallery: RetrievalGallery | None = None, gallery_block: int | None = None,
                 point_rule: str = DEFAULT_POINT_RULE):
        super().__init__(name="npair_localization_serving")
        cfg = model.config
        if point_rule not in POINT_RULES:
            raise ConfigError(f"point_rule must be one of {POINT_RULES}, got {point_rule!r}")
        self.point_rule = point_rule
        if model.backbone is None:
            raise ConfigError("export_npair_model needs the model's backbone (image -> spatial map): build the "
                              "model with build_npair_model(..., backbone=...)")
        self.vocabulary_words = _check_vocabulary(vocabulary, cfg.vocabulary_size)
        if cfg.max_tokens < 3:
            raise ConfigError(f"max_tokens must leave room for <start>, one word and <end>, got {cfg.max_tokens}")
        self.image_size = backbone_input_size(model.backbone)
        map_shape = tuple(model.backbone.output.shape)
        if map_shape[1:] != (cfg.map_size, cfg.map_size, cfg.map_channels):
            raise ConfigError(f"the backbone outputs maps of shape {map_shape[1:]} but the model expects "
                              f"({cfg.map_size}, {cfg.map_size}, {cfg.map_channels}) (map_size, map_channels)")
        self.max_tokens = int(cfg.max_tokens)
        self.max_words = self.max_tokens - 2
        self.config_json = tf.Variable(json.dumps(cfg.to_dict(), sort_keys=True), trainable=False,
                                       name="model_config")
        self.vocabulary = tf.Variable(self.vocabulary_words, trainable=False, dtype=tf.string, name="vocabulary")
        self.coder = TokenCoder(self.vocabulary_words, name="token_coder")
        # The layers the signature runs; the model object itself is not saved
        # (its optimizer and loss tracker are of no use to a server).
        self.backbone = model.backbone
        self.projection = model.projection
        self.word_embedding = model.word_embedding
        self.lstm = model.lstm
        serving.track_keras_variables(self, self.backbone, self.projection, self.word_embedding, self.lstm)

        image_spec = serving.jpeg_batch_spec("image_jpeg", static_shape=True)
        caption_spec = serving.string_batch_spec("caption", static_shape=True)

        @serving.signature_function(image_spec, caption_spec)
        def localize(image_jpeg, caption):
            pixels = self._pixels(image_jpeg)
            token_ids, token_mask = self._caption_ids(caption)
            same_batch = tf.debugging.Assert(
                tf.equal(tf.shape(pixels)[0], tf.shape(token_ids)[0]),
                ["image_jpeg and caption must have the same batch size (pair b is image b with caption b); got",
                 tf.shape(pixels)[0], "images and", tf.shape(token_ids)[0], "captions"])
            with tf.control_dependencies([same_batch]):
                pixels = tf.identity(pixels)
            # The model's own encoders and scorer, so the score is its `call`'s.
            maps = model.image_maps({"backbone_map": self.backbone(pixels, training=False)}, training=False)
            tokens = model.token_vectors(token_ids, training=False)
            maps, tokens = model.normalised(maps, tokens, token_mask)
            score = volume.paired_localization_scores(maps, tokens, token_mask, aggregator=cfg.aggregator,
                                                      token_average=cfg.token_average)
            heat_maps = tf.transpose(volume.localization_volume(maps, tokens), [0, 3, 1, 2])
            heat_maps = tf.where(token_mask[:, :, None, None], heat_maps, tf.zeros_like(heat_maps))
            words = tf.gather(tf.constant(self.vocabulary_words, tf.string), token_ids)
            return {"score": score, "heat_maps": heat_maps, "token_mask": token_mask,
                    "tokens": tf.where(token_mask, words, tf.fill(tf.shape(words), "")),
                    "points": heat_map_points(heat_maps, token_mask, self.image_size, self.point_rule)}

        self.localize = localize
        depth = int(cfg.embed_dim)

        def query_maps(image_jpeg):
            # As `localization_maps.evaluation_maps`: a map's normalisation reads only that map.
            maps = model.image_maps({"backbone_map": self.backbone(self._pixels(image_jpeg), training=False)},
                                    training=False)
            return model.normalised(maps, tf.zeros([1, 1, depth]), tf.ones([1, 1], tf.bool))[0]

        def query_tokens(caption):
            # As `localization_maps.token_vector_rows`: a caption's normalisation reads only that caption.
            token_ids, token_mask = self._caption_ids(caption)
            tokens = model.token_vectors(token_ids, training=False)
            return model.normalised(tf.zeros([1, 1, 1, depth]), tokens, token_mask)[1], token_mask

        # What the retrieval signatures embed a query with (and a gallery of JPEGs / captions).
        self.query_specs = ([image_spec], [caption_spec])
        self.query_image, self.query_text = query_maps, query_tokens
        self.has_gallery = gallery is not None
        if gallery is not None:
            if gallery.caption_mask is None:
                raise ConfigError("an N-pair gallery holds the mask of its captions' words (npair_gallery builds it)")
            if gallery_block is None:
                products = int(np.prod(np.shape(gallery.image_embeddings)[1:3])) * self.max_tokens
                gallery_block = max(1, BLOCK_PRODUCTS // max(1, products))
            add_retrieval_signatures(
                self, gallery, image_spec=image_spec, text_spec=caption_spec, embed_image=query_maps,
                embed_text=query_tokens, block_rows=gallery_block,
                pair_scores=lambda maps, captions: volume.pairwise_localization_scores(
                    maps, *captions, aggregator=cfg.aggregator, token_average=cfg.token_average))

    def signatures(self) -> dict:
        out = {"serving_default": self.localize, "localize": self.localize}
        if self.has_gallery:
            out.update(retrieve_captions=self.retrieve_captions, retrieve_images=self.retrieve_images)
        return out

    # ------------------------------------------------------------------ inputs
    def _pixels(self, image_jpeg):
        """(B, S, S, 3) float32: the uint8 images of `load_images_at_size` (PIL's bilinear resize, bit for bit)."""
        pixels = serving.decode_jpeg_batch(image_jpeg, self.image_size, "image_jpeg", pil_resize=True)
        pixels.set_shape([None, self.image_size, self.image_size, 3])
        return pixels

    def _caption_ids(self, caption):
        """(B, max_tokens) ids ``<start> words <end> <end>...`` and the (B, max_tokens) mask of the words."""
        strings = serving.validate_strings(caption, "caption")
        codes = self.coder(strings)
        # The tokenizer never yields "<start>"/"<end>" (no "<"), but their ids must never count as words.
        codes = tf.ragged.boolean_mask(codes, codes >= FIRST_WORD_ID)
        # The rule evaluation applies (features.prepare_npair.kept_caption_words): the first max_words
        # known words, a longer caption clipped.
        codes = kept_caption_words(codes, self.max_words)
        lengths = tf.cast(codes.row_lengths(), tf.int32)
        no_word = tf.equal(lengths, 0)
        checks = [
            tf.debugging.Assert(
                tf.logical_not(tf.reduce_any(no_word)),
                ["caption has no word of the vocabulary (words outside it are dropped); first such element index:",
                 _first_true(no_word), "caption:", tf.gather(strings, _first_true(no_word))]),
        ]
        with tf.control_dependencies(checks):
            words = codes.to_tensor(default_value=END_ID, shape=[None, self.max_words])
            batch = tf.shape(words)[0]
        token_ids = tf.concat([tf.fill([batch, 1], START_ID), words, tf.fill([batch, 1], END_ID)], axis=1)
        no_token = tf.zeros([batch, 1], tf.bool)
        token_mask = tf.concat([no_token, tf.sequence_mask(lengths, self.max_words), no_token], axis=1)
        token_ids.set_shape([None, self.max_tokens])
        token_mask.set_shape([None, self.max_tokens])
        return token_ids, token_mask

    # ------------------------------------------------------------------ warm-up
    def warmup_requests(self) -> list[tuple[str, dict]]:
        """Two pairs: a grey S×S JPEG and one of another shape (the resize path), two captions."""
        words = [w for w in self.vocabulary_words[FIRST_WORD_ID:] if tokenize_caption(w) == [w]]
        if not words:
            raise ConfigError("the vocabulary has no word a caption can contain (every word changes under "
                              "tokenize_caption): nothing can be served")
        captions = [" ".join(words[:min(3, self.max_words)]), f"the {words[-1]} !"]
        images = [warmup_jpeg(self.image_size, self.image_size),
                  warmup_jpeg(self.image_size // 2 + 1, self.image_size + 3)]
        request = {"image_jpeg": images, "caption": captions}
        requests = [("localize", request), ("serving_default", request)]
        if self.has_gallery:
            requests += [("retrieve_captions", {"image_jpeg": images, "k": np.int32(1)}),
                         ("retrieve_images", {"caption": captions, "k": np.int32(1)})]
        return requests


def npair_gallery(model: NPairLocalizationModel, split, image_ids: Sequence[str],
                  caption_ids: Sequence[str]) -> RetrievalGallery:
    """The retrieval gallery of a test split (an `NPairEvaluationSplit`), computed as
    ``model.evaluate`` computes it: the projected maps and the token vectors, each normalised
    as the model's score normalises them (`localization_maps.evaluation_maps`,
    `localization_maps.token_vector_rows`), with the mask of the captions' words."""
    token_mask = getattr(split, "token_mask", None)
    if token_mask is None:
        raise ConfigError("an N-pair gallery is built from an NPairEvaluationSplit (backbone maps, token ids and "
                          "their token_mask): load_run(run_dir).evaluation_split() or "
                          "tf_twobranch.systems.npair.pipeline.evaluation_split")
    with tempfile.TemporaryDirectory(prefix=".npair_gallery_") as folder:
        maps = localization_maps.evaluation_maps(model, split.image, folder)
        images = np.array(maps.normalised, np.float32)       # copied out of the temporary files
        tokens = localization_maps.token_vector_rows(model, split.text, token_mask,
                                                     pathlib.Path(folder) / "token_vectors.npy")
        captions = np.array(tokens, np.float32)
        del maps, tokens
    return RetrievalGallery([str(i) for i in image_ids], images, [str(c) for c in caption_ids], captions,
                            caption_mask=np.asarray(token_mask, bool))


def export_npair_model(model: NPairLocalizationModel, export_dir, *, vocabulary: Sequence[str],
                       gallery: RetrievalGallery | None = None, gallery_block: int | None = None,
                       run_config: dict | None = None, overwrite: bool = True,
                       model_name: str = "npair",
                       point_rule: str = DEFAULT_POINT_RULE) -> pathlib.Path:
    """Writes the serving SavedModel of `model` to `export_dir` (atomically; see the module docstring).

    Args:
      model: a built (trained) `NPairLocalizationModel` with its backbone.
      export_dir: output directory (replaced when `overwrite`).
      vocabulary: ``["<pad>", "<unk>", "<start>", "<end>", words...]`` in the
        row order of the word vectors (``vocabulary_size`` entries), as
        `tf_twobranch.systems.npair.features.caption_inputs` builds it.
      gallery: `npair_gallery` of a split: adds ``retrieve_captions`` /
        ``retrieve_images`` (the model's score, as ``evaluate`` ranks).
      gallery_block: gallery items scored per step of a retrieval request
        (default: as many as keep a query's volume near 4M products).
      run_config: written to ``assets.extra/run_config.json`` (default
        ``{"model": model.config}``) with an ``"npair_export"`` entry: the
        vocabulary, the image size, max_words and the signatures.
      overwrite: replace an existing `export_dir`.
      model_name: ``model_spec.name`` in the warm-up requests.
      point_rule: how ``points`` are read off each heat map, as the run's pointing game
        (`pointing_game.POINT_RULES`: the arg-max cell's centre, or LocNet's first
        maximal pixel of the bilinear-upsampled map).

    The warm-up requests are run through the signatures before saving (a
    failure raises), as for every family (`save_module_atomically`).

    Returns:
      The export directory.

    Raises:
      ConfigError: no backbone, a backbone whose maps do not fit the model,
        or a vocabulary that does not fit the model (size, reserved tokens,
        empty or repeated words).
      FileExistsError: `export_dir` exists and not `overwrite`.
    """
    if pathlib.Path(export_dir).exists() and not overwrite:
        raise FileExistsError(f"{export_dir} exists")
    module = NPairServingModule(model, vocabulary, gallery=gallery, gallery_block=gallery_block,
                                point_rule=point_rule)
    config = dict(run_config) if run_config else {"model": model.config.to_dict()}
    config["npair_export"] = {
        "vocabulary": list(module.vocabulary_words), "image_size": module.image_size,
        "max_words": module.max_words, "max_tokens": module.max_tokens, "captions": CAPTION_LENGTH_RULE,
        "image_preprocessing": "whole image resized to image_size x image_size by PIL's bilinear rule "
                               "(features.images.tf_pil_resize, as load_images_at_size)",
        "points": "(x, y) = (column, row) in the image_size x image_size input; (0, 0) where token_mask is False",
        "point_rule": point_rule,
        "signatures": sorted(module.signatures())}
    if gallery is not None:
        config["npair_export"].update(gallery_images=len(gallery.image_ids), gallery_captions=len(gallery.caption_ids))
    return save_module_atomically(module, export_dir, config, overwrite=overwrite, model_name=model_name)


# ---------------------------------------------------------------------------- a finished run

def run_export(run) -> RunExport:
    """An N-pair localization run: JPEG bytes and captions in (S_MaxImage or the row's aggregator)."""
    vocabulary = run.config.get("vocabulary")
    recipe = (run.results or {}).get("recipe") or run.config.get("recipe") or {}

    def split_gallery():
        split = run.evaluation_split()
        return npair_gallery(run.model, split, list(split.image_ids),
                                  gallery_caption_ids(split.image_ids, split.caption_image))

    def write(export_dir, gallery, block):
        # A run recorded before --point_rule existed was scored by LocNet's argmax rule.
        return export_npair_model(run.model, export_dir, vocabulary=vocabulary, gallery=gallery, gallery_block=block,
                                  run_config={"model": run.model.config.to_dict(), "recipe": recipe},
                                  point_rule=recipe.get("point_rule", "argmax"))

    return RunExport("npair", recipe.get("eval_split", "test"), split_gallery,
                        lambda: NPairServingModule(run.model, vocabulary), write, text_inputs=plain_captions)
