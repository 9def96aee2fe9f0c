"""SavedModel export of two-branch models, for TF Serving.

The SavedModel has one signature per tower and one for scoring:

* ``embed_images``: ``image_features`` float32 (batch, image_dim) →
  ``image_embedding`` (batch, d).
* ``embed_texts``: ``text_features`` float32 (batch, text_dim) — or, for the
  LSTM text branch, ``captions`` string (batch,) tokenized inside the graph
  with tensorflow-text → ``text_embedding`` (batch, d).
* ``score``: both inputs → ``scores`` (num_images, num_texts), higher is
  better (cosine similarity for the embedding network, the similarity
  network's logit otherwise).
* ``serving_default`` = ``score``.

Inputs are validated inside the graph: NaN/inf features and empty captions
fail with an InvalidArgument error whose message says what is wrong.
The run's configuration is copied next to the SavedModel (``assets.extra``
is the TF Serving convention for such side files).
"""
from __future__ import annotations

import json
import pathlib
import shutil

import tensorflow as tf

from tf_twobranch.models.text_towers import build_string_text_tower
from tf_twobranch.models.two_branch import TwoBranchModel


def _check_features(x, name):
    return tf.debugging.assert_all_finite(x, f"{name} contains NaN or inf values")


def _check_captions(captions):
    stripped = tf.strings.strip(captions)
    tf.debugging.assert_greater(
        tf.strings.length(stripped), 0,
        message="captions must be non-empty strings (got an empty caption)")
    return captions


class TwoBranchServingModule(tf.Module):
    """Wraps a trained `TwoBranchModel` with serving signatures."""

    def __init__(self, model: TwoBranchModel):
        super().__init__(name="two_branch_serving")
        cfg = model.config
        self.config_json = tf.Variable(json.dumps(cfg.to_dict()), trainable=False,
                                       name="model_config")
        self.image_tower = model.image_tower
        self.uses_strings = cfg.text_encoder == "lstm"
        if self.uses_strings:
            self.text_tower = build_string_text_tower(model.text_tower, cfg.vocabulary,
                                                      cfg.max_len)
            text_spec = tf.TensorSpec([None], tf.string, name="captions")
        else:
            self.text_tower = model.text_tower
            text_spec = tf.TensorSpec([None, cfg.text_dim], tf.float32, name="text_features")
        self.similarity_head = model.similarity_head
        image_spec = tf.TensorSpec([None, cfg.image_dim], tf.float32, name="image_features")

        @tf.function(input_signature=[image_spec])
        def embed_images(image_features):
            return {"image_embedding": self._image(image_features)}

        @tf.function(input_signature=[text_spec])
        def embed_texts(texts):
            return {"text_embedding": self._text(texts)}

        @tf.function(input_signature=[image_spec, text_spec])
        def score(image_features, texts):
            img = self._image(image_features)
            txt = self._text(texts)
            if self.similarity_head is None:
                return {"scores": tf.matmul(img, txt, transpose_b=True)}
            joint = img[:, None, :] * txt[None, :, :]
            flat = tf.reshape(joint, [-1, tf.shape(img)[-1]])
            logits = self.similarity_head(flat, training=False)
            return {"scores": tf.reshape(logits, [tf.shape(img)[0], tf.shape(txt)[0]])}

        self.embed_images = embed_images
        self.embed_texts = embed_texts
        self.score = score

    def _image(self, x):
        with tf.control_dependencies([_check_features(x, "image_features")]):
            return self.image_tower(tf.identity(x), training=False)

    def _text(self, x):
        if self.uses_strings:
            with tf.control_dependencies([_check_captions(x)]):
                return self.text_tower(tf.identity(x), training=False)
        with tf.control_dependencies([_check_features(x, "text_features")]):
            return self.text_tower(tf.identity(x), training=False)

    def signatures(self):
        return {"serving_default": self.score, "score": self.score,
                "embed_images": self.embed_images, "embed_texts": self.embed_texts}


def save_module_atomically(module: tf.Module, export_dir, run_config: dict, *,
                           overwrite: bool = True) -> pathlib.Path:
    """Writes `module` with its signatures and `assets.extra/run_config.json`.

    The SavedModel is written next to `export_dir` and renamed into place, so
    a reader (or TF Serving polling the folder) never sees a half-written one.
    """
    export_dir = pathlib.Path(export_dir)
    if export_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{export_dir} exists")
        shutil.rmtree(export_dir)
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tf.saved_model.save(module, str(tmp), signatures=module.signatures())
    extra = tmp / "assets.extra"
    extra.mkdir(exist_ok=True)
    (extra / "run_config.json").write_text(
        json.dumps(run_config, indent=2, sort_keys=True, default=str), encoding="utf-8")
    tmp.rename(export_dir)
    return export_dir


def export_saved_model(model: TwoBranchModel, export_dir, *, run_config: dict | None = None,
                       overwrite: bool = True) -> pathlib.Path:
    """Writes a SavedModel with tower and scoring signatures to `export_dir`."""
    if pathlib.Path(export_dir).exists() and not overwrite:
        raise FileExistsError(f"{export_dir} exists")
    return save_module_atomically(TwoBranchServingModule(model), export_dir,
                                  run_config or {"model": model.config.to_dict()},
                                  overwrite=overwrite)
