"""Deep fragment embeddings (Karpathy, Joulin & Fei-Fei, NIPS 2014).

* Image fragments (§3.2): v = W_m·CNN(I_b) + b_m, a linear map of each
  fragment's CNN feature (the top detections and the whole image).
* Sentence fragments (§3.1, eq. 1): s = ReLU(W_R [W_e w1; W_e w2] + b_R)
  for a triplet (R, w1, w2), with W_e frozen word vectors and one W_R, b_R
  per relation type (the paper) or one shared pair (the authors' code:
  ``shared_relation_weights=True``).
* Objective (eq. 3): C_F + β·C_G + α‖θ‖² (`tf_twobranch.losses.fragment`),
  C_F the fragment alignment objective with MIL labels once ``mil`` is on
  (the experiment switches it on for the paper's second stage).

Inputs are padded batches: ``image_fragments`` (B, M, D) float with
``image_mask`` (B, M); ``relation``, ``word1``, ``word2`` (B, F) int with
``sentence_mask`` (B, F). Image k is paired with sentence k.
"""
from __future__ import annotations

import dataclasses
import json

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError, DataFormatError
from tf_twobranch.json_files import read_json_object
from tf_twobranch.losses import fragment as fragment_losses

__all__ = ["FragmentEmbeddingConfig", "SentenceFragmentEncoder", "FragmentEmbeddingModel",
           "build_fragment_model", "save_fragment_config", "load_fragment_config"]


@dataclasses.dataclass
class FragmentEmbeddingConfig:
    image_dim: int                 # CNN feature size of an image fragment (4096 for RCNN fc7)
    num_relations: int
    vocabulary_size: int
    word_dim: int = 200            # W_e: frozen word vectors (the paper: 200-d)
    embed_dim: int = 1000          # h (the paper: "approximately 1000")
    shared_relation_weights: bool = False   # the code's one W_R for all relations
    global_weight: float = 1.0     # β
    weight_decay: float = 1e-4     # α (α‖θ‖² over the trainable weights)
    fragment_margin: float = 1.0   # the hinge's 1 in eq. 4
    global_margin: float = 0.1     # Δ
    smoothing: float = 5.0         # n of eq. 6
    normaliser: str = "paper"      # "paper": 1/(|g_k|(|g_l|+n)); "code": 1/(|g_l|+n)
    class_balanced: bool = False   # the code's weighting of C_0
    use_fragment_objective: bool = True
    use_global_objective: bool = True

    def validate(self) -> None:
        for name in ("image_dim", "num_relations", "vocabulary_size", "word_dim", "embed_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.normaliser not in fragment_losses.NORMALISERS:
            raise ConfigError(f"normaliser must be one of {fragment_losses.NORMALISERS}, "
                              f"got {self.normaliser!r}")
        if not (self.use_fragment_objective or self.use_global_objective):
            raise ConfigError("at least one of the fragment and global objectives must be on")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FragmentEmbeddingConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown fragment-model configuration keys {unknown}")
        return cls(**d)


@keras.saving.register_keras_serializable(package="tf_twobranch")
class SentenceFragmentEncoder(keras.layers.Layer):
    """s = ReLU(W_R [W_e w1; W_e w2] + b_R) for every triplet (eq. 1)."""

    def __init__(self, vocabulary_size: int, word_dim: int, num_relations: int, units: int,
                 shared_relation_weights: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size, self.word_dim = int(vocabulary_size), int(word_dim)
        self.num_relations, self.units = int(num_relations), int(units)
        self.shared_relation_weights = bool(shared_relation_weights)

    def build(self, input_shape=None):
        self.word_vectors = self.add_weight(name="word_vectors", shape=(self.vocabulary_size, self.word_dim),
                                            initializer="zeros", trainable=False)
        kinds = 1 if self.shared_relation_weights else self.num_relations
        self.relation_kernel = self.add_weight(name="relation_kernel",
                                               shape=(kinds, 2 * self.word_dim, self.units),
                                               initializer="glorot_uniform")
        self.relation_bias = self.add_weight(name="relation_bias", shape=(kinds, self.units),
                                             initializer="zeros")
        self.built = True

    def set_word_vectors(self, vectors: np.ndarray) -> None:
        vectors = np.asarray(vectors, np.float32)
        if vectors.shape != (self.vocabulary_size, self.word_dim):
            raise ConfigError(f"word vectors must be ({self.vocabulary_size}, {self.word_dim}), "
                              f"got {vectors.shape}")
        self.word_vectors.assign(vectors)

    def call(self, relation, word1, word2):
        words = tf.concat([tf.gather(self.word_vectors, word1), tf.gather(self.word_vectors, word2)],
                          axis=-1)                                  # (..., 2d)
        kind = tf.zeros_like(relation) if self.shared_relation_weights else relation
        if self.shared_relation_weights:
            out = tf.tensordot(words, self.relation_kernel[0], axes=1) + self.relation_bias[0]
        else:
            # One matmul for every relation's weights, then each triplet keeps
            # its own relation's row: (..., R, h) is small next to W_R itself.
            per_relation = tf.einsum("...d,rdh->...rh", words, self.relation_kernel) + self.relation_bias
            out = tf.gather(per_relation, kind, batch_dims=len(kind.shape))
        return tf.nn.relu(out)

    def get_config(self):
        return {**super().get_config(), "vocabulary_size": self.vocabulary_size, "word_dim": self.word_dim,
                "num_relations": self.num_relations, "units": self.units,
                "shared_relation_weights": self.shared_relation_weights}


class FragmentEmbeddingModel(keras.Model):
    """Image- and sentence-fragment embeddings trained with C_F + β·C_G + α‖θ‖²."""

    def __init__(self, config: FragmentEmbeddingConfig, **kwargs):
        super().__init__(**kwargs)
        config.validate()
        self.config = config
        self.image_projection = keras.layers.Dense(config.embed_dim, name="image_projection")
        self.sentence_encoder = SentenceFragmentEncoder(
            config.vocabulary_size, config.word_dim, config.num_relations, config.embed_dim,
            config.shared_relation_weights, name="sentence_encoder")
        # MIL labels (eq. 5) from the second stage on; a variable so that the
        # switch needs no retracing.
        self.mil = tf.Variable(False, trainable=False, name="mil")
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.fragment_tracker = keras.metrics.Mean(name="fragment_objective")
        self.global_tracker = keras.metrics.Mean(name="global_objective")

    def build_all(self) -> "FragmentEmbeddingModel":
        self.image_projection.build((None, None, self.config.image_dim))
        self.sentence_encoder.build()
        self.built = True
        return self

    # ------------------------------------------------------------------ towers
    def embed_image_fragments(self, image_fragments, training=False):
        return self.image_projection(image_fragments, training=training)

    def embed_sentence_fragments(self, relation, word1, word2, training=False):
        return self.sentence_encoder(relation, word1, word2, training=training)

    def call(self, inputs, training=False):
        v = self.embed_image_fragments(inputs["image_fragments"], training)
        s = self.embed_sentence_fragments(inputs["relation"], inputs["word1"], inputs["word2"], training)
        return fragment_losses.global_scores(v, inputs["image_mask"], s, inputs["sentence_mask"],
                                             smoothing=self.config.smoothing,
                                             normaliser=self.config.normaliser)

    # ------------------------------------------------------------------ loss
    def objective(self, batch, training=True) -> dict:
        c = self.config
        v = self.embed_image_fragments(batch["image_fragments"], training)
        s = self.embed_sentence_fragments(batch["relation"], batch["word1"], batch["word2"], training)
        scores = fragment_losses.fragment_scores(v, s)
        terms = {"fragment_objective": tf.constant(0.0), "global_objective": tf.constant(0.0)}
        if c.use_fragment_objective:
            labels = tf.cond(self.mil,
                             lambda: fragment_losses.fragment_alignment_labels(
                                 scores, batch["image_mask"], batch["sentence_mask"], mil=True),
                             lambda: fragment_losses.fragment_alignment_labels(
                                 scores, batch["image_mask"], batch["sentence_mask"], mil=False))
            terms["fragment_objective"] = fragment_losses.fragment_alignment_objective(
                scores, labels, batch["image_mask"], batch["sentence_mask"],
                margin=c.fragment_margin, class_balanced=c.class_balanced)
        if c.use_global_objective:
            global_scores = fragment_losses.global_scores_from_fragment_scores(
                scores, batch["image_mask"], batch["sentence_mask"], smoothing=c.smoothing,
                normaliser=c.normaliser)
            terms["global_objective"] = fragment_losses.global_ranking_objective(
                global_scores, margin=c.global_margin)
        regulariser = tf.add_n([tf.reduce_sum(tf.square(w)) for w in self.trainable_weights
                                if "bias" not in w.path])
        terms["loss"] = (terms["fragment_objective"] + c.global_weight * terms["global_objective"]
                         + c.weight_decay * regulariser)
        return terms

    def train_step(self, data):
        with tf.GradientTape() as tape:
            terms = self.objective(data, training=True)
            scaled = self.optimizer.scale_loss(terms["loss"])
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return self._track(terms)

    def test_step(self, data):
        return self._track(self.objective(data, training=False))

    def _track(self, terms):
        self.loss_tracker.update_state(terms["loss"])
        self.fragment_tracker.update_state(terms["fragment_objective"])
        self.global_tracker.update_state(terms["global_objective"])
        return {m.name: m.result() for m in self.metrics}

    @property
    def metrics(self):
        return [self.loss_tracker, self.fragment_tracker, self.global_tracker]


def build_fragment_model(config: FragmentEmbeddingConfig | dict,
                         word_vectors: np.ndarray | None = None) -> FragmentEmbeddingModel:
    """A built model; `word_vectors` (vocabulary_size, word_dim) fill the frozen W_e."""
    if isinstance(config, dict):
        config = FragmentEmbeddingConfig.from_dict(config)
    model = FragmentEmbeddingModel(config).build_all()
    if word_vectors is not None:
        model.sentence_encoder.set_word_vectors(word_vectors)
    return model


def save_fragment_config(path, config: FragmentEmbeddingConfig, **extra) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"model": config.to_dict(), **extra}, f, indent=2, sort_keys=True)


def load_fragment_config(path) -> tuple[FragmentEmbeddingConfig, dict]:
    """The configuration written by `save_fragment_config` and its extra entries."""
    data = read_json_object(path, "fragment-model configuration")
    if not isinstance(data.get("model"), dict):
        raise DataFormatError(path, "expected a JSON object with a 'model' object")
    try:
        return FragmentEmbeddingConfig.from_dict(data.pop("model")), data
    except ConfigError as err:
        raise DataFormatError(path, str(err), record="model") from None
