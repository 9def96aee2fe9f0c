"""SavedModel export of two-branch models, for TF Serving.

The SavedModel has one signature per tower and one for scoring:

* ``embed_images``: ``image_features`` float32 (batch, image_dim) — or, when
  exported with an ``image_backbone`` (a CNN on pixels), ``image_jpeg``
  string (batch,) of JPEG/PNG bytes decoded and resized inside the graph —
  → ``image_embedding`` float32 (batch, d).
* ``embed_texts``: ``captions`` string (batch,) of raw sentences for the LSTM
  text branch (tokenized inside the graph) and for feature models exported
  with a ``text_encoder`` (the fitted sentence encoder runs inside the graph,
  `tf_twobranch.features.tf_text_features`); otherwise ``text_features``
  float32 (batch, text_dim) → ``text_embedding`` float32 (batch, d).
* ``score``: the image and the text input → ``scores`` float32
  (num_images, num_texts), higher is better (dot product of the tower
  embeddings for the embedding network, the similarity network's logit
  otherwise).
* ``serving_default`` = ``score``.
* with a ``gallery`` (`tf_twobranch.export.retrieval`): ``retrieve_captions``
  (the image input, ``k``) and ``retrieve_images`` (the text input, ``k``) →
  the top-k gallery ids, indices and scores, scored as the evaluation core
  scores them.

Every input is validated inside the graph (`tf_twobranch.export.serving`): wrong
rank or feature dimension, an empty batch, NaN/inf features, empty or
whitespace-only captions and bytes that are not a JPEG/PNG fail with an
``InvalidArgumentError`` naming the input and what was expected. The run's
configuration (``run_config.json``) and a TF Serving warm-up file
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

from tf_twobranch.errors import ConfigError
from tf_twobranch.export import serving
from tf_twobranch.export.retrieval import RetrievalGallery, add_retrieval_signatures
from tf_twobranch.export.saved_model import TowerServingModule, save_module_atomically, warmup_jpeg
from tf_twobranch.features.backbones import backbone_input_size
from tf_twobranch.features.text_features import TextEncoder
from tf_twobranch.features.tf_text_features import text_feature_layer_from_encoder
from tf_twobranch.models.text_towers import build_string_text_tower
from tf_twobranch.models.two_branch import TwoBranchModel

__all__ = ["TwoBranchServingModule", "export_saved_model"]

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
      image_size: side the images are resized to; default the backbone input.
      gallery: optional `RetrievalGallery` (the model's tower outputs of a
        gallery): adds ``retrieve_captions`` and ``retrieve_images``.
    """

    def __init__(self, model: TwoBranchModel, *, text_layer: keras.layers.Layer | None = None,
                 image_backbone: keras.Model | None = None, image_size: int | None = None,
                 gallery: RetrievalGallery | None = None):
        super().__init__(name="two_branch_serving")
        cfg = model.config
        self.config_json = tf.Variable(json.dumps(cfg.to_dict()), trainable=False, name="model_config")
        self.embed_dim = int(cfg.embed_dim)
        self.image_dim = int(cfg.image_dim)
        self.text_dim = int(cfg.text_dim)
        self.image_tower = model.image_tower
        self.image_backbone = image_backbone
        if image_backbone is not None:
            self.image_size = int(image_size or backbone_input_size(image_backbone))
            self.image_input = "image_jpeg"
            image_spec = serving.jpeg_batch_spec(self.image_input)
        else:
            self.image_input = "image_features"
            image_spec = serving.feature_batch_spec(self.image_input)
        self.text_layer = None
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
        text_spec = (serving.string_batch_spec(self.text_input) if self.text_input == "captions"
                     else serving.feature_batch_spec(self.text_input))
        self.similarity_head = model.similarity_head
        serving.track_keras_variables(self, self.image_backbone, self.image_tower, self.text_layer,
                                      self.text_tower, self.similarity_head)

        @tf.function(input_signature=[image_spec])
        def embed_images(images):
            return {"image_embedding": self._image(images)}

        @tf.function(input_signature=[text_spec])
        def embed_texts(texts):
            return {"text_embedding": self._text(texts)}

        @tf.function(input_signature=[image_spec, text_spec])
        def score(images, texts):
            return {"scores": self._pair_scores(self._image(images), self._text(texts))}

        self.embed_images = embed_images
        self.embed_texts = embed_texts
        self.score = score
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
        if self.has_gallery:
            out.update(retrieve_captions=self.retrieve_captions, retrieve_images=self.retrieve_images)
        return out

    def _pair_scores(self, img, txt):
        """(num_images, num_texts) scores, higher = better, as the evaluation core scores them."""
        if self.similarity_head is None:
            return tf.matmul(img, txt, transpose_b=True)
        joint = img[:, None, :] * txt[None, :, :]
        flat = tf.reshape(joint, [-1, self.embed_dim])
        logits = self.similarity_head(flat, training=False)
        return tf.reshape(logits, [tf.shape(img)[0], tf.shape(txt)[0]])

    def _image(self, x):
        if self.image_backbone is not None:
            pixels = serving.decode_jpeg_batch(x, self.image_size, self.image_input)
            features = tf.ensure_shape(self.image_backbone(pixels, training=False), [None, self.image_dim])
        else:
            features = serving.validate_features(x, self.image_dim, self.image_input)
        out = self.image_tower(features, training=False)
        out.set_shape([None, self.embed_dim])
        return out

    def _text(self, x):
        if self.text_input == "captions":
            strings = serving.validate_strings(x, self.text_input)
            if self.text_layer is not None:
                out = self.text_tower(self.text_layer(strings), training=False)
            else:
                out = self.text_tower(strings, training=False)
        else:
            out = self.text_tower(serving.validate_features(x, self.text_dim, self.text_input), training=False)
        out.set_shape([None, self.embed_dim])
        return out

    def warmup_requests(self) -> list[tuple[str, dict]]:
        """One small valid request per signature (two images, two texts)."""
        if self.image_backbone is not None:
            images = [warmup_jpeg(self.image_size, self.image_size)] * 2
        else:
            images = np.zeros((2, self.image_dim), np.float32)
        texts = ([WARMUP_CAPTION, "a man rides a horse"] if self.text_input == "captions"
                 else np.zeros((2, self.text_dim), np.float32))
        both = {self.image_input: images, self.text_input: texts}
        requests = [("embed_images", {self.image_input: images}), ("embed_texts", {self.text_input: texts}),
                    ("score", both), ("serving_default", both)]
        if self.has_gallery:
            one = np.int32(1)
            requests += [("retrieve_captions", {self.image_input: images, "k": one}),
                         ("retrieve_images", {self.text_input: texts, "k": one})]
        return requests


def export_saved_model(model: TwoBranchModel, export_dir, *, text_encoder=None,
                       image_backbone: keras.Model | None = None, image_size: int | None = None,
                       run_config: dict | None = None, model_name: str = "two_branch",
                       overwrite: bool = True, gallery: RetrievalGallery | None = None) -> pathlib.Path:
    """Writes a SavedModel with tower and scoring signatures to `export_dir`.

    Args:
      model: a trained `TwoBranchModel`.
      export_dir: output directory (replaced when `overwrite`).
      text_encoder: for a model on text features, the fitted numpy sentence
        encoder (`FisherVectorEncoder`, `MeanWordVectorEncoder`,
        `TfidfEncoder`) or its `tf_text_features` layer: ``embed_texts`` then
        takes raw ``captions``.
      image_backbone: the CNN that produced the image features: ``embed_images``
        then takes ``image_jpeg`` bytes.
      image_size: side images are resized to (default: the backbone input).
      run_config: written to ``assets.extra/run_config.json`` (default
        ``{"model": model.config}``).
      model_name: ``model_spec.name`` in the warm-up requests.
      gallery: a `RetrievalGallery` (`export.retrieval.gallery_from_model`):
        adds the ``retrieve_captions`` / ``retrieve_images`` signatures.

    Raises:
      ConfigError: the encoder or backbone does not fit the model.
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
    if image_backbone is not None and int(image_backbone.output_shape[-1]) != cfg.image_dim:
        raise ConfigError(f"the image backbone outputs {image_backbone.output_shape[-1]}-d features but the "
                          f"model's image_dim is {cfg.image_dim}")
    module = TwoBranchServingModule(model, text_layer=text_layer, image_backbone=image_backbone,
                                    image_size=image_size, gallery=gallery)
    config = dict(run_config) if run_config else {"model": cfg.to_dict()}
    config["serving"] = {"embed_images_input": module.image_input, "embed_texts_input": module.text_input,
                         "signatures": sorted(module.signatures())}
    if gallery is not None:
        config["serving"]["gallery"] = {"num_images": len(gallery.image_ids),
                                        "num_captions": len(gallery.caption_ids)}
    return save_module_atomically(module, export_dir, config, overwrite=overwrite, model_name=model_name)
