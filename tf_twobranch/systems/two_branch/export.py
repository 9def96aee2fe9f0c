"""SavedModel export of two-branch models, for TF Serving.

Signatures on the export's *main inputs* — the rawest input each side has:

* ``embed_images``: ``image_jpeg`` string (batch,) of JPEG/PNG bytes when
  exported with an ``image_backbone`` (the CNN that made the row's image
  features), else ``image_features`` float32 (batch, image_dim)
  → ``image_embedding`` float32 (batch, d). From bytes the graph computes
  exactly the offline features (`tf_twobranch.features.image_features.extract_image_features`
  with the row's ``ten_crop`` / ``crop_size`` / ``resize_to``): the image
  decoded as PIL decodes it, its views (the paper's ten crops — four corners,
  centre and their mirrors of ``crop_size`` out of the image resized to
  ``resize_to``², each resized to the backbone input — or the whole image
  resized to the backbone input) cut and resized bit-exactly as PIL does
  (`tf_twobranch.features.images.tf_image_views`), the backbone on every view
  (its own input scaling and feature layer, as offline), the views' outputs
  averaged, then the image tower.
* ``embed_texts``: ``captions`` string (batch,) of raw sentences for the LSTM
  text branch (tokenized inside the graph) and for feature models exported
  with a ``text_encoder`` (the fitted sentence encoder — Fisher vector
  HGLMM/GMM with its PCA, mean word vector, tf-idf — runs inside the graph,
  `tf_twobranch.features.tf_text_features`); otherwise ``text_features``
  float32 (batch, text_dim) → ``text_embedding`` float32 (batch, d).
* ``score``: the image and the text input → ``scores`` float32
  (num_images, num_texts), higher is better (dot product of the tower
  embeddings for the embedding network, the similarity network's logit
  otherwise).
* ``serving_default`` = ``score``.

Feature-vector signatures, for users with their own features, where a side
takes raw inputs (names as the fragment export's ``embed_image_fragments``
beside its ``embed_images``):

* ``embed_image_features``: ``image_features`` float32 (batch, image_dim)
  → ``image_embedding`` (with an ``image_backbone``);
* ``embed_text_features``: ``text_features`` float32 (batch, text_dim)
  → ``text_embedding`` (with a ``text_encoder``);
* ``score_features``: each side's feature input (``captions`` for the LSTM
  branch, which has no feature input) → ``scores``.

With a ``gallery`` (`tf_twobranch.export.retrieval_signatures`): ``retrieve_captions``
(the main image input, ``k``) and ``retrieve_images`` (the main text input,
``k``) → the top-k gallery ids, indices and scores, scored as the evaluation
core scores them.

Every input declares its fixed sizes (``saved_model_cli show``: ``(-1, image_dim)``,
``(-1, text_dim)``, ``(-1)`` for strings) and is validated inside the graph
too (`tf_twobranch.export.serving`): wrong rank or feature dimension, an
empty batch, NaN/inf features, empty or whitespace-only captions and bytes
that are not a JPEG/PNG fail with an ``InvalidArgumentError`` naming the
input, what was expected and the bad element's index. The run's
configuration (``run_config.json``, whose ``serving`` block names the inputs,
the image views and the text encoder) and a TF Serving warm-up file
(``tf_serving_warmup_requests``, one small request per signature, run once
before saving) are written to ``assets.extra``. Graphs with string inputs use
tensorflow-text ops: ``import tensorflow_text`` before loading. See
docs/SERVING.md.
"""
from __future__ import annotations

import json
import pathlib

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tf_twobranch.errors import ConfigError
from tf_twobranch.export import serving
from tf_twobranch.export.retrieval_signatures import RetrievalGallery, add_retrieval_signatures
from tf_twobranch.export.run_gallery import RunExport, batched, caption_keys, gallery_caption_ids, plain_captions
from tf_twobranch.export.saved_model import TowerServingModule, save_module_atomically, warmup_jpeg
from tf_twobranch.features.backbones import backbone_input_size
from tf_twobranch.features.image_features import view_settings
from tf_twobranch.features.images import tf_image_views
from tf_twobranch.features.text_features import TextEncoder
from tf_twobranch.features.tf_text_features import text_feature_layer_from_encoder
from tf_twobranch.systems.two_branch.text_towers import build_string_text_tower
from tf_twobranch.systems.two_branch.model import TwoBranchModel

__all__ = ["TwoBranchServingModule", "export_saved_model", "retrieval_gallery", "retrieval_run_export"]

WARMUP_CAPTION = "a photo of a dog"


class TwoBranchServingModule(TowerServingModule):
    """Wraps a trained `TwoBranchModel` with validated serving signatures.

    Args:
      model: the trained model.
      text_layer: optional in-graph sentence encoder (raw strings →
        (batch, text_dim) features) for a model on text features; then
        ``embed_texts`` takes ``captions`` strings.
      image_backbone: optional CNN (float RGB 0..255 (batch, S, S, 3) →
        (batch, image_dim)); then ``embed_images`` takes ``image_jpeg`` bytes.
      image_views: how the backbone sees an image, as `extract_image_features`
        takes it: ``ten_crop``, ``crop_size``, ``resize_to`` (resolved by
        `tf_twobranch.features.image_features.view_settings`; default: its
        defaults, ten crops).
      gallery: optional `RetrievalGallery` (the model's tower outputs of a
        gallery): adds ``retrieve_captions`` and ``retrieve_images``.
    """

    def __init__(self, model: TwoBranchModel, *, text_layer: keras.layers.Layer | None = None,
                 image_backbone: keras.Model | None = None, image_views: dict | None = None,
                 gallery: RetrievalGallery | None = None):
        super().__init__(name="two_branch_serving")
        cfg = model.config
        self.config_json = tf.Variable(json.dumps(cfg.to_dict()), trainable=False, name="model_config")
        self.embed_dim = int(cfg.embed_dim)
        self.image_dim = int(cfg.image_dim)
        self.text_dim = int(cfg.text_dim)
        self.image_tower = model.image_tower
        self.image_backbone = image_backbone
        image_feature_spec = serving.feature_batch_spec("image_features", self.image_dim)
        self.image_views = None
        if image_backbone is not None:
            self.image_views = view_settings(image_backbone, **(image_views or {}))
            self.image_input = "image_jpeg"
            image_spec = serving.jpeg_batch_spec(self.image_input, static_shape=True)
        else:
            self.image_input = "image_features"
            image_spec = image_feature_spec
        self.text_layer = None
        text_feature_spec = None
        if cfg.text_encoder == "lstm":
            if text_layer is not None:
                raise ConfigError("text_encoder is for models on text features; the LSTM branch tokenizes "
                                  "captions itself")
            self.text_tower = build_string_text_tower(model.text_tower, cfg.vocabulary, cfg.max_len)
            self.text_input = "captions"
        else:
            self.text_tower = model.text_tower
            self.text_layer = text_layer
            self.text_input = "captions" if text_layer is not None else "text_features"
            text_feature_spec = serving.feature_batch_spec("text_features", self.text_dim)
        text_spec = (serving.string_batch_spec(self.text_input, static_shape=True)
                     if self.text_input == "captions" else text_feature_spec)
        self.similarity_head = model.similarity_head
        serving.track_keras_variables(self, self.image_backbone, self.image_tower, self.text_layer,
                                      self.text_tower, self.similarity_head)
        self.query_specs = ([image_spec], [text_spec])

        @serving.signature_function(image_spec)
        def embed_images(images):
            return {"image_embedding": self._image(images)}

        @serving.signature_function(text_spec)
        def embed_texts(texts):
            return {"text_embedding": self._text(texts)}

        @serving.signature_function(image_spec, text_spec)
        def score(images, texts):
            return {"scores": self._pair_scores(self._image(images), self._text(texts))}

        self.embed_images = embed_images
        self.embed_texts = embed_texts
        self.score = score

        # Feature-vector signatures beside the raw ones (none when no side is raw).
        self.feature_signature_names = []
        if image_backbone is not None:
            @serving.signature_function(image_feature_spec)
            def embed_image_features(image_features):
                return {"image_embedding": self._image_tower(image_features)}

            self.embed_image_features = embed_image_features
            self.feature_signature_names.append("embed_image_features")
        if text_layer is not None:
            @serving.signature_function(text_feature_spec)
            def embed_text_features(text_features):
                return {"text_embedding": self._text_tower(text_features)}

            self.embed_text_features = embed_text_features
            self.feature_signature_names.append("embed_text_features")
        if self.feature_signature_names:
            self.text_feature_input = "text_features" if text_feature_spec is not None else "captions"

            @serving.signature_function(image_feature_spec, text_feature_spec or text_spec)
            def score_features(image_features, texts):
                texts = self._text_tower(texts) if text_feature_spec is not None else self._text(texts)
                return {"scores": self._pair_scores(self._image_tower(image_features), texts)}

            self.score_features = score_features
            self.feature_signature_names.append("score_features")

        self.has_gallery = gallery is not None
        if gallery is not None:
            if gallery.image_embeddings.shape[1] != self.embed_dim:
                raise ConfigError(f"the gallery holds {gallery.image_embeddings.shape[1]}-d embeddings; "
                                  f"the model's are {self.embed_dim}-d")
            add_retrieval_signatures(self, gallery, image_spec=image_spec, text_spec=text_spec,
                                     embed_image=self._image, embed_text=self._text,
                                     pair_scores=self._pair_scores)

    def signatures(self) -> dict:
        out = super().signatures()
        out.update({name: getattr(self, name) for name in self.feature_signature_names})
        if self.has_gallery:
            out.update(retrieve_captions=self.retrieve_captions, retrieve_images=self.retrieve_images)
        return out

    def query_image(self, images):
        """Tower outputs of ``retrieve_captions``' query (that of ``embed_images``)."""
        return self._image(images)

    def query_text(self, texts):
        """Tower outputs of ``retrieve_images``' query (that of ``embed_texts``)."""
        return self._text(texts)

    def _pair_scores(self, img, txt):
        """(num_images, num_texts) scores, higher = better, as the evaluation core scores them."""
        if self.similarity_head is None:
            return tf.matmul(img, txt, transpose_b=True)
        joint = img[:, None, :] * txt[None, :, :]
        flat = tf.reshape(joint, [-1, self.embed_dim])
        logits = self.similarity_head(flat, training=False)
        return tf.reshape(logits, [tf.shape(img)[0], tf.shape(txt)[0]])

    def _backbone_features(self, jpeg_bytes):
        """The offline image features of every image: its views through the backbone, averaged."""
        views = self.image_views
        count, size = (10 if views["ten_crop"] else 1), views["input_size"]
        (pixels,) = serving.map_decoded_images(
            jpeg_bytes, self.image_input, lambda image: (tf_image_views(image, **views),),
            [(tf.float32, [count, size, size, 3])])
        outputs = self.image_backbone(tf.reshape(pixels, [-1, size, size, 3]), training=False)
        features = tf.reduce_mean(tf.reshape(tf.cast(outputs, tf.float32), [-1, count, self.image_dim]), axis=1)
        features.set_shape([None, self.image_dim])
        return features

    def _embedded(self, tower, inputs):
        """A tower's output with its static width declared (the signatures' outputs carry it)."""
        out = tower(inputs, training=False)
        out.set_shape([None, self.embed_dim])
        return out

    def _image_tower(self, features):
        return self._embedded(self.image_tower,
                              serving.validate_features(features, self.image_dim, "image_features"))

    def _image(self, x):
        if self.image_backbone is None:
            return self._image_tower(x)
        return self._embedded(self.image_tower, self._backbone_features(x))

    def _text_tower(self, features):
        return self._embedded(self.text_tower,
                              serving.validate_features(features, self.text_dim, "text_features"))

    def _text(self, x):
        if self.text_input != "captions":
            return self._text_tower(x)
        strings = serving.validate_strings(x, self.text_input)
        return self._embedded(self.text_tower,
                              strings if self.text_layer is None else self.text_layer(strings))

    def warmup_requests(self) -> list[tuple[str, dict]]:
        """One small valid request per signature (two images, two texts)."""
        features = np.zeros((2, self.image_dim), np.float32)
        if self.image_backbone is not None:
            size = self.image_views["input_size"]
            images = [warmup_jpeg(size, size)] * 2
        else:
            images = features
        captions = [WARMUP_CAPTION, "a man rides a horse"]
        text_features = np.zeros((2, self.text_dim), np.float32)
        texts = captions if self.text_input == "captions" else text_features
        both = {self.image_input: images, self.text_input: texts}
        requests = [("embed_images", {self.image_input: images}), ("embed_texts", {self.text_input: texts}),
                    ("score", both), ("serving_default", both)]
        if "embed_image_features" in self.feature_signature_names:
            requests.append(("embed_image_features", {"image_features": features}))
        if "embed_text_features" in self.feature_signature_names:
            requests.append(("embed_text_features", {"text_features": text_features}))
        if "score_features" in self.feature_signature_names:
            requests.append(("score_features", {
                "image_features": features,
                self.text_feature_input: text_features if self.text_feature_input == "text_features" else captions}))
        if self.has_gallery:
            one = np.int32(1)
            requests += [("retrieve_captions", {self.image_input: images, "k": one}),
                         ("retrieve_images", {self.text_input: texts, "k": one})]
        return requests

    def serving_description(self) -> dict:
        """The ``serving`` block of ``run_config.json``: what each signature takes."""
        return {"embed_images_input": self.image_input, "embed_texts_input": self.text_input,
                "signatures": sorted(self.signatures()),
                "feature_signatures": list(self.feature_signature_names),
                "image_features_dim": self.image_dim,
                "text_features_dim": None if self.text_input == "captions" and self.text_layer is None
                else self.text_dim,
                "image_backbone": None if self.image_backbone is None else self.image_backbone.name,
                "image_views": self.image_views,
                "text_encoder": None if self.text_layer is None else type(self.text_layer).__name__}


def export_saved_model(model: TwoBranchModel, export_dir, *, text_encoder=None,
                       image_backbone: keras.Model | None = None, ten_crop: bool = True,
                       crop_size: int | None = None, resize_to: int | None = None,
                       image_size: int | None = None, run_config: dict | None = None,
                       model_name: str = "two_branch", overwrite: bool = True,
                       gallery: RetrievalGallery | None = None) -> pathlib.Path:
    """Writes a SavedModel with tower and scoring signatures to `export_dir`.

    Args:
      model: a trained `TwoBranchModel`.
      export_dir: output directory (replaced when `overwrite`).
      text_encoder: for a model on text features, the fitted numpy sentence
        encoder (`FisherVectorEncoder`, `MeanWordVectorEncoder`,
        `TfidfEncoder`) or its `tf_text_features` layer: ``embed_texts`` then
        takes raw ``captions`` (and ``embed_text_features`` the features).
      image_backbone: the CNN that produced the image features: ``embed_images``
        then takes ``image_jpeg`` bytes (and ``embed_image_features`` the features).
      ten_crop, crop_size, resize_to: the views the backbone saw, exactly as
        given to `extract_image_features` (same defaults: ten crops of the
        backbone input out of the image resized to 256/224 of it); a row's
        are `tf_twobranch.features.prepare.image_view_options`.
      image_size: the backbone input side; only checked (the backbone fixes it).
      run_config: written to ``assets.extra/run_config.json`` (default
        ``{"model": model.config}``); its ``serving`` block is completed with
        what the export takes (`TwoBranchServingModule.serving_description`).
      model_name: ``model_spec.name`` in the warm-up requests.
      gallery: a `RetrievalGallery` (`run_export.gallery_from_model`):
        adds the ``retrieve_captions`` / ``retrieve_images`` signatures.

    Raises:
      ConfigError: the encoder or backbone does not fit the model, or invalid view sizes.
      FileExistsError: `export_dir` exists and not `overwrite`.
    """
    if pathlib.Path(export_dir).exists() and not overwrite:
        raise FileExistsError(f"{export_dir} exists")
    cfg = model.config
    text_layer = None
    if text_encoder is not None:
        text_layer = (text_feature_layer_from_encoder(text_encoder) if isinstance(text_encoder, TextEncoder)
                      else text_encoder)
        if not hasattr(text_layer, "output_dim"):
            raise ConfigError(f"text_encoder must be a fitted text encoder or a tf_text_features layer, "
                              f"got {type(text_encoder).__name__}")
        if cfg.text_encoder == "features" and int(text_layer.output_dim) != cfg.text_dim:
            raise ConfigError(f"the text encoder outputs {text_layer.output_dim}-d features but the model's "
                              f"text_dim is {cfg.text_dim}")
    if image_backbone is not None:
        if int(image_backbone.output_shape[-1]) != cfg.image_dim:
            raise ConfigError(f"the image backbone outputs {image_backbone.output_shape[-1]}-d features but the "
                              f"model's image_dim is {cfg.image_dim}")
        if image_size is not None and int(image_size) != backbone_input_size(image_backbone):
            raise ConfigError(f"image_size={image_size} but the backbone takes "
                              f"{backbone_input_size(image_backbone)}-pixel images")
    module = TwoBranchServingModule(model, text_layer=text_layer, image_backbone=image_backbone,
                                    image_views=dict(ten_crop=ten_crop, crop_size=crop_size, resize_to=resize_to),
                                    gallery=gallery)
    config = dict(run_config) if run_config else {"model": cfg.to_dict()}
    config["serving"] = {**config.get("serving", {}), **module.serving_description()}
    if gallery is not None:
        config["serving"]["gallery"] = {"num_images": len(gallery.image_ids),
                                        "num_captions": len(gallery.caption_ids)}
    return save_module_atomically(module, export_dir, config, overwrite=overwrite, model_name=model_name)


# ---------------------------------------------------------------------------- a finished run

def retrieval_gallery(model, split, image_ids, caption_ids) -> RetrievalGallery:
    """The tower outputs of `split` (an `EvaluationSplit` or a dict with ``image``, ``text`` and
    ``caption_image``), as ``evaluate`` embeds it; one id per image row and per caption."""
    from tf_twobranch.models.evaluation_input import as_evaluation_split

    split = as_evaluation_split(split)
    return RetrievalGallery([str(i) for i in image_ids], np.asarray(model.embed_images(split.image), np.float32),
                            [str(c) for c in caption_ids], np.asarray(model.embed_texts(split.text), np.float32))


def retrieval_run_export(run) -> RunExport:
    """An image–sentence row: raw inputs where the pipeline knows the row's feature pieces."""
    from tf_twobranch.data.retrieval_data import load_caption_splits
    from tf_twobranch.systems.two_branch import pipeline

    recipe = pipeline.RetrievalRecipe.from_record(run.results or run.config, str(run.run_dir / "results.json"))
    layout = pipeline.dataset_layout(recipe)
    corpora = load_caption_splits(layout)
    splits = {s: corpora[s] for s in ("train", "test")}
    raw_inputs, notes = pipeline.serving_inputs(recipe, layout, splits)
    for note in notes:
        logging.info("export: %s", note)
    views = {k: raw_inputs[k] for k in ("ten_crop", "crop_size", "resize_to") if k in raw_inputs}
    text_encoder = raw_inputs.get("text_encoder")

    def module():
        layer = None if text_encoder is None else text_feature_layer_from_encoder(text_encoder)
        return TwoBranchServingModule(run.model, text_layer=layer, image_backbone=raw_inputs.get("image_backbone"),
                                      image_views=views)

    def split_gallery():
        test = splits["test"]
        return retrieval_gallery(run.model, run.evaluation_split(), list(test.image_ids), caption_keys(test))

    def write(export_dir, gallery, _block):
        return export_saved_model(run.model, export_dir, **raw_inputs, gallery=gallery,
                                  run_config={**run.config, "serving": {"notes": notes}})

    feature_side = {n.split(":")[0]: n for n in notes}
    return RunExport(
        "two_branch", "test", split_gallery, module, write, text_inputs=plain_captions,
        no_image_gallery=("the export takes image_features (" + feature_side["image side"] + ")"
                          if "image_backbone" not in raw_inputs else None),
        no_caption_gallery=("the export takes text_features (" + feature_side["text side"] + ")"
                            if "text side" in feature_side else None))
