"""Mean word vectors against a linear image tower (8 × 8 thumbnails), hinge ranking loss."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch.evaluation import retrieval
from tf_twobranch.models.base import ModelConfig, SystemModel
from tf_twobranch.models.evaluation_input import as_evaluation_split


@dataclasses.dataclass
class MeanVectorConfig(ModelConfig):
    FAMILY: ClassVar[str] = "mean_vectors"
    FILE_NAME: ClassVar[str] = "mean_vectors_config.json"
    DESCRIPTION: ClassVar[str] = "mean-vector model configuration"

    vocabulary_size: int = 2
    image_size: int = 8
    max_len: int = 24
    word_dim: int = 16
    embed_dim: int = 16
    margin: float = 0.2


class MeanVectorModel(SystemModel):
    """Image (N, S, S, 3) pixels 0..255 → linear → unit vector; token ids (N, L), 0 = padding →
    mean word vector → linear → unit vector; the score is the cosine."""

    CONFIG_CLASS = MeanVectorConfig
    EVALUATION_OPTIONS = ("ks",)

    def __init__(self, config: MeanVectorConfig, **kwargs):
        super().__init__(config, name=kwargs.pop("name", "mean_vectors"), **kwargs)
        self.image_tower = keras.layers.Dense(config.embed_dim, name="image_tower")
        self.word_vectors = keras.layers.Embedding(config.vocabulary_size, config.word_dim, name="word_vectors")
        self.text_tower = keras.layers.Dense(config.embed_dim, name="text_tower")

    def build_all(self) -> "MeanVectorModel":
        c = self.config
        self.image_tower.build((None, c.image_size * c.image_size * 3))
        self.word_vectors.build((None, c.max_len))
        self.text_tower.build((None, c.word_dim))
        self.built = True
        return self

    def embed_images(self, pixels) -> tf.Tensor:
        size = self.config.image_size * self.config.image_size * 3
        x = tf.reshape(tf.cast(pixels, tf.float32) / 255.0, [-1, size])
        return tf.math.l2_normalize(self.image_tower(x), axis=1)

    def embed_texts(self, token_ids) -> tf.Tensor:
        token_ids = tf.convert_to_tensor(token_ids, tf.int32)
        mask = tf.cast(token_ids > 0, tf.float32)[..., None]
        total = tf.reduce_sum(self.word_vectors(token_ids) * mask, axis=1)
        mean = total / tf.maximum(tf.reduce_sum(mask, axis=1), 1.0)
        return tf.math.l2_normalize(self.text_tower(mean), axis=1)

    def call(self, batch, training=False):
        return self.embed_images(batch["image"]), self.embed_texts(batch["text"])

    def objective(self, batch, training=True) -> dict:
        """Sum of hinge violations over the batch's other captions and images (row b: a match)."""
        images, texts = self(batch, training=training)
        scores = tf.matmul(images, texts, transpose_b=True)
        positive = tf.linalg.diag_part(scores)
        off_diagonal = 1.0 - tf.eye(tf.shape(scores)[0])
        captions = tf.nn.relu(self.config.margin - positive[:, None] + scores) * off_diagonal
        images_ = tf.nn.relu(self.config.margin - positive[None, :] + scores) * off_diagonal
        count = tf.cast(tf.shape(scores)[0], tf.float32)
        return {"loss": (tf.reduce_sum(captions) + tf.reduce_sum(images_)) / count}

    def evaluate_split(self, x, protocol: str | None = None, *,
                       ks: Sequence[int] = retrieval.DEFAULT_KS) -> dict:
        split = as_evaluation_split(x, protocol)
        images = np.asarray(self.embed_images(split.image))
        texts = np.asarray(self.embed_texts(split.text))
        return retrieval.evaluate_protocol(images, texts, split.caption_image, split.protocol, ks=ks)


def build_model(config: MeanVectorConfig) -> MeanVectorModel:
    return MeanVectorModel(config).build_all()
