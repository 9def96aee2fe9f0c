"""The fifth system's SavedModel: JPEG bytes and caption strings in, validated in the graph."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import tensorflow as tf

from tf_twobranch.data.text_codes import TokenCoder
from tf_twobranch.export import serving
from tf_twobranch.export.retrieval_signatures import RetrievalGallery, add_retrieval_signatures
from tf_twobranch.export.run_gallery import RunExport, gallery_caption_ids, plain_captions
from tf_twobranch.export.saved_model import TowerServingModule, save_module_atomically, warmup_jpeg


class MeanVectorServingModule(TowerServingModule):
    def __init__(self, model, vocabulary, gallery: RetrievalGallery | None = None):
        super().__init__(name="mean_vectors_serving")
        self.config_json = tf.Variable(json.dumps(model.config.to_dict()), trainable=False, name="model_config")
        self.model_ref = model
        self.size = int(model.config.image_size)
        self.max_len = int(model.config.max_len)
        self.coder = TokenCoder(list(vocabulary), max_len=self.max_len, name="token_coder")
        serving.track_keras_variables(self, model.image_tower, model.word_vectors, model.text_tower)
        image_spec = serving.jpeg_batch_spec("image_jpeg", static_shape=True)
        text_spec = serving.string_batch_spec("captions", static_shape=True)

        @serving.signature_function(image_spec)
        def embed_images(image_jpeg):
            return {"image_embedding": self.query_image(image_jpeg)}

        @serving.signature_function(text_spec)
        def embed_texts(captions):
            return {"text_embedding": self.query_text(captions)}

        @serving.signature_function(image_spec, text_spec)
        def score(image_jpeg, captions):
            return {"scores": tf.matmul(self.query_image(image_jpeg), self.query_text(captions), transpose_b=True)}

        self.embed_images, self.embed_texts, self.score = embed_images, embed_texts, score
        self.has_gallery = gallery is not None
        if gallery is not None:
            add_retrieval_signatures(self, gallery, image_spec=image_spec, text_spec=text_spec,
                                     embed_image=self.query_image, embed_text=self.query_text,
                                     pair_scores=lambda a, b: tf.matmul(a, b, transpose_b=True))

    def signatures(self) -> dict:
        out = super().signatures()
        if self.has_gallery:
            out.update(retrieve_captions=self.retrieve_captions, retrieve_images=self.retrieve_images)
        return out

    def warmup_requests(self):
        request = {"image_jpeg": [warmup_jpeg(self.size, self.size)], "captions": ["a red square"]}
        out = [("score", request)]
        if self.has_gallery:
            out.append(("retrieve_captions", {"image_jpeg": request["image_jpeg"], "k": np.int32(1)}))
        return out

    def query_image(self, image_jpeg):
        pixels = serving.decode_jpeg_batch(image_jpeg, self.size, "image_jpeg", pil_resize=True)
        return self.model_ref.embed_images(pixels)

    def query_text(self, captions):
        codes = self.coder(serving.validate_strings(captions, "captions"))
        return self.model_ref.embed_texts(codes.to_tensor(0, shape=[None, self.max_len]))


def split_gallery(model, split, image_ids, caption_ids) -> RetrievalGallery:
    """The gallery of an evaluated split, embedded as `evaluate` embeds it."""
    return RetrievalGallery(list(image_ids), np.asarray(model.embed_images(split.image)), list(caption_ids),
                            np.asarray(model.embed_texts(split.text)))


def write_export(model, export_dir, vocabulary, run_config: dict, gallery: RetrievalGallery | None = None):
    return save_module_atomically(MeanVectorServingModule(model, vocabulary, gallery), export_dir,
                                  {"model": model.config.to_dict(), "vocabulary": list(vocabulary),
                                   "task": run_config.get("task")})


def run_export(run) -> RunExport:
    from tf_twobranch.data.from_flags import dataset_folder
    from tf_twobranch.data.layout import resolve_dataset
    from tf_twobranch.data.retrieval_data import load_caption_splits

    vocabulary = run.config["vocabulary"]
    split = run.evaluation_split()
    flags = (run.results or {}).get("flags", {})
    test = load_caption_splits(resolve_dataset(dataset_folder(flags.get("dataset_dir") or None,
                                                              with_proposals=False)))["test"]
    return RunExport(
        "mean_vectors", "test",
        lambda: split_gallery(run.model, split, test.image_ids, gallery_caption_ids(test.image_ids,
                                                                                   test.caption_image)),
        lambda: MeanVectorServingModule(run.model, vocabulary),
        lambda export_dir, gallery, _block: write_export(run.model, pathlib.Path(export_dir), vocabulary,
                                                         run.config, gallery),
        text_inputs=plain_captions)
