"""SavedModel export of a dual-path CNN: JPEG bytes and raw strings in.

Signatures (validated in the graph, see `tf_twobranch.export.serving`):

* ``embed_images(image_jpeg: string[batch])`` → ``image_embedding`` — the
  image decoded, resized to the training crop size (the test protocol's
  whole-image view) and averaged with its horizontal flip (§6.2), L2-normalised;
* ``embed_texts(captions: string[batch])`` → ``text_embedding`` — tokenised
  in the graph with tensorflow-text, words outside the dictionary removed
  (§3.2), left-aligned to ``max_len``, L2-normalised.  A caption longer than
  ``max_len`` known words, or with no known word, is rejected with a clear
  InvalidArgument (the training data policy is "error" by default too);
* ``score(image_jpeg, captions)`` → ``scores`` (images × captions cosine);
* ``serving_default`` = ``score``;
* with a ``gallery`` (`tf_twobranch.export.retrieval_signatures`): ``retrieve_captions``
  (``image_jpeg``, ``k``) and ``retrieve_images`` (``captions``, ``k``) → the
  top-k gallery ids, indices and cosine scores.

Loading needs ``import tensorflow_text`` (its tokenizer ops).
"""
from __future__ import annotations

import json
import pathlib
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_twobranch.data.text_codes import TokenCoder
from tf_twobranch.export import serving
from tf_twobranch.errors import UserInputError
from tf_twobranch.export.retrieval_signatures import RetrievalGallery, add_retrieval_signatures
from tf_twobranch.export.run_gallery import RunExport, batched, caption_keys, gallery_caption_ids, plain_captions
from tf_twobranch.export.saved_model import TowerServingModule, save_module_atomically, warmup_jpeg
from tf_twobranch.systems.dual_path.model import DualPathModel
from tf_twobranch.vectors import l2_normalize_rows

__all__ = ["DualPathServingModule", "export_dual_path", "dual_path_gallery", "run_export"]

WARMUP_CAPTIONS = ("a red seven on the left", "two blue digits")


class DualPathServingModule(TowerServingModule):
    """The dual-path model's image and text towers behind validated signatures."""

    def __init__(self, model: DualPathModel, vocabulary: Sequence[str],
                 gallery: RetrievalGallery | None = None):
        super().__init__(name="dual_path_serving")
        cfg = model.config
        self.config_json = tf.Variable(json.dumps(cfg.to_dict()), trainable=False,
                                       name="model_config")
        self.image_size = int(cfg.image_size)
        self.max_len = int(cfg.max_len)
        self.embed_dim = int(cfg.embed_dim)
        self.vocabulary = list(vocabulary)
        self.image_tower = model.image_tower
        self.text_tower = model.text_tower
        self.coder = TokenCoder(self.vocabulary, name="token_coder")
        serving.track_keras_variables(self, self.image_tower, self.text_tower)

        # Declared (batch,): the graph's checks still name a wrong rank for callers that skip the spec.
        image_spec = serving.jpeg_batch_spec("image_jpeg", static_shape=True)
        text_spec = serving.string_batch_spec("captions", static_shape=True)

        @serving.signature_function(image_spec)
        def embed_images(image_jpeg):
            return {"image_embedding": self._image(image_jpeg)}

        @serving.signature_function(text_spec)
        def embed_texts(captions):
            return {"text_embedding": self._text(captions)}

        @serving.signature_function(image_spec, text_spec)
        def score(image_jpeg, captions):
            return {"scores": tf.matmul(self._image(image_jpeg), self._text(captions),
                                        transpose_b=True)}

        self.embed_images = embed_images
        self.embed_texts = embed_texts
        self.score = score
        self.query_specs = ([image_spec], [text_spec])
        self.has_gallery = gallery is not None
        if gallery is not None:
            add_retrieval_signatures(
                self, gallery, image_spec=image_spec, text_spec=text_spec, embed_image=self._image,
                embed_text=self._text, pair_scores=lambda a, b: tf.matmul(a, b, transpose_b=True))

    def signatures(self) -> dict:
        out = super().signatures()
        if self.has_gallery:
            out.update(retrieve_captions=self.retrieve_captions, retrieve_images=self.retrieve_images)
        return out

    def query_image(self, image_jpeg):
        """Embeddings of ``retrieve_captions``' query (those of ``embed_images``)."""
        return self._image(image_jpeg)

    def query_text(self, captions):
        """Embeddings of ``retrieve_images``' query (those of ``embed_texts``)."""
        return self._text(captions)

    def _image(self, jpeg):
        pixels = serving.decode_jpeg_batch(jpeg, self.image_size, "image_jpeg")
        features = tf.cast(self.image_tower(pixels, training=False), tf.float32)
        flipped = tf.cast(self.image_tower(tf.reverse(pixels, axis=[2]), training=False),
                          tf.float32)
        out = tf.math.l2_normalize(0.5 * (features + flipped), axis=1)
        out.set_shape([None, self.embed_dim])
        return out

    def _text(self, captions):
        strings = serving.validate_strings(captions, "captions")
        codes = self.coder(strings)
        lengths = codes.row_lengths()
        checks = [
            tf.debugging.assert_less_equal(
                lengths, tf.cast(self.max_len, lengths.dtype),
                message=f"captions: a caption has more than max_len={self.max_len} known words; "
                        f"shorten it (the model was trained on at most {self.max_len})"),
            tf.debugging.assert_positive(
                lengths, message="captions: a caption has no word of the model's dictionary"),
        ]
        with tf.control_dependencies(checks):
            ids = codes.to_tensor(default_value=0, shape=[None, self.max_len])
        out = tf.math.l2_normalize(tf.cast(self.text_tower(ids, training=False), tf.float32),
                                   axis=1)
        out.set_shape([None, self.embed_dim])
        return out

    def warmup_requests(self) -> list[tuple[str, dict]]:
        known = [w for w in self.vocabulary[2:6]] or ["a"]
        texts = [" ".join(known), known[0]]
        images = [warmup_jpeg(self.image_size, self.image_size)] * 2
        both = {"image_jpeg": images, "captions": texts}
        requests = [("embed_images", {"image_jpeg": images}), ("embed_texts", {"captions": texts}),
                    ("score", both), ("serving_default", both)]
        if self.has_gallery:
            requests += [("retrieve_captions", {"image_jpeg": images, "k": np.int32(1)}),
                         ("retrieve_images", {"captions": texts, "k": np.int32(1)})]
        return requests


def export_dual_path(model: DualPathModel, vocabulary: Sequence[str], export_dir, *,
                     run_config: dict | None = None, resize_to: int | None = None,
                     gallery: RetrievalGallery | None = None) -> pathlib.Path:
    """Writes the serving SavedModel (with warm-up file and run config) atomically; with a
    `gallery` (`run_export.gallery_from_model`) it also serves ``retrieve_*``."""
    module = DualPathServingModule(model, vocabulary, gallery)
    config = {**(run_config or {}), "vocabulary": list(vocabulary),
              "test_image": "whole image resized to image_size, averaged with its flip"}
    if resize_to is not None:
        config["resize_to"] = int(resize_to)
    return save_module_atomically(module, export_dir, config)


def embed_with_keras(model: DualPathModel, jpeg_bytes: Sequence[bytes], codes: np.ndarray):
    """Reference embeddings computed with the Keras towers (tests compare to the SavedModel)."""
    pixels = serving.decode_jpeg_batch(tf.constant(list(jpeg_bytes)), model.config.image_size,
                                       "image_jpeg").numpy()
    images = model.embed_images(pixels, flip_average=True)
    texts = model.embed_texts(codes)
    return l2_normalize_rows(images), l2_normalize_rows(texts)


# ---------------------------------------------------------------------------- a finished run

def dual_path_gallery(model, split, image_ids, caption_ids) -> RetrievalGallery:
    """The L2-normalised, flip-averaged embeddings of `split`, as ``evaluate`` ranks them."""
    from tf_twobranch.models.evaluation_input import as_evaluation_split

    images, texts = model.retrieval_embeddings(as_evaluation_split(split))
    return RetrievalGallery([str(i) for i in image_ids], np.asarray(images, np.float32),
                            [str(c) for c in caption_ids], np.asarray(texts, np.float32))


def run_export(run) -> RunExport:
    """A dual-path run: JPEG bytes and captions in; the gallery is its recorded test recipe."""
    from tf_twobranch.systems.dual_path.run_split import dual_path_test_split, rebuild_dual_path_data

    record = (run.results or {}).get("evaluation") or {}
    vocabulary = run.config.get("vocabulary")
    if record.get("kind") != "dual_path" or not vocabulary:
        raise UserInputError(f"{run.run_dir}: a dual-path run needs results.json 'evaluation' (its test recipe) "
                             "and run_config.json 'vocabulary' (written by the experiment when it finishes)")

    def split_gallery():
        data = rebuild_dual_path_data(record, vocabulary)
        return dual_path_gallery(run.model, dual_path_test_split(record, data), list(data.image_ids),
                                  gallery_caption_ids(data.image_ids, data.caption_image))

    def write(export_dir, gallery, _block):
        return export_dual_path(run.model, vocabulary, export_dir, resize_to=record.get("resize_to"),
                                run_config={key: run.config[key] for key in ("model", "typed_flags", "flags", "recipe")
                                            if key in run.config}, gallery=gallery)

    return RunExport("dual_path", record["split"], split_gallery,
                        lambda: DualPathServingModule(run.model, vocabulary), write, text_inputs=plain_captions)
