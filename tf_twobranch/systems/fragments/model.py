"""Deep fragment embeddings (Karpathy, Joulin & Fei-Fei, NIPS 2014).

* Image fragments (§3.2): v = W_m·CNN(I_b) + b_m, a linear map of each
  fragment's CNN feature (the top detections and the whole image).
* Sentence fragments (§3.1, eq. 1): s = ReLU(W_R [W_e w1; W_e w2] + b_R)
  for a triplet (R, w1, w2), with W_e frozen word vectors and one W_R, b_R
  per relation type (the paper) or one shared pair (the authors' code:
  ``shared_relation_weights=True``).
* Objective (eq. 3): C_F + β·C_G + α‖θ‖² (`tf_twobranch.systems.fragments.losses`),
  C_F the fragment alignment objective with MIL labels once ``mil`` is on
  (the experiment switches it on for the paper's second stage). θ holds the
  trainable kernels, and with ``decay_biases`` the biases too (the paper's
  ‖θ‖² and the authors' code, whose biases are columns of its matrices).
  The objective is computed in float32 (the variables' dtype) whatever the
  compute dtype of the towers (Keras mixed precision).
* CNN fine-tuning (§4, the second stage): with ``image_head_dim`` the image
  input is the activation *below* the CNN's top layer and the model owns that
  layer (`image_head`, initialised from the CNN, frozen in the first stage),
  so the top of the CNN is trained with the embedding.
* The DeViSE baseline (§4.1, ``representation="devise"``): one fragment per
  side, the mean of an image's fragment CNN features (mapped by W_m into the
  word space) and the mean of a sentence's L2-normalised word vectors, with
  the global objective only.

Inputs are padded batches: ``image_fragments`` (B, M, D) float with
``image_mask`` (B, M); ``relation``, ``word1``, ``word2`` (B, F) int with
``sentence_mask`` (B, F). Image k is paired with sentence k.

`FragmentEmbeddingModel.evaluate(split)` ranks a test split by S_kl through
the one evaluation core (`evaluation.fragment_retrieval`). Its
`EvaluationSplit` holds fragments, not one row per image or caption:
``image`` = {"fragments": (N, M, D) image inputs (any row-indexable array,
read a chunk at a time), "mask": (N, M)}, ``text`` = {"relation", "word1",
"word2": (total,) ids, "row_splits": (captions + 1,)} (caption l owns
fragments ``row_splits[l]:row_splits[l + 1]``), and ``caption_image``
(`tf_twobranch.systems.fragments.pipeline.evaluation_split` builds it).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.systems.fragments.retrieval import evaluate_fragment_retrieval
from tf_twobranch.models.base import ModelConfig, SystemModel
from tf_twobranch.models.evaluation_input import as_evaluation_split
from tf_twobranch.systems.fragments import losses as fragment_losses
from tf_twobranch.systems.fragments.sampling import padded_sentence_arrays

REPRESENTATIONS = ("fragments", "devise")

__all__ = ["REPRESENTATIONS", "FragmentEmbeddingConfig", "SentenceFragmentEncoder", "FragmentEmbeddingModel",
           "build_fragment_model"]


@dataclasses.dataclass
class FragmentEmbeddingConfig(ModelConfig):
    FAMILY: ClassVar[str] = "fragments"
    FILE_NAME: ClassVar[str] = "fragment_config.json"
    DESCRIPTION: ClassVar[str] = "fragment-model configuration"

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
    mil_zero_score: str = "negative"   # "ignored": the code's sign(0) = 0, such pairs unweighted
    global_score: str = "sum_relu"     # S_kl's accumulation (losses.fragment.GLOBAL_SCORES)
    decay_biases: bool = False     # α‖θ‖² over the biases too (the paper, the code)
    use_fragment_objective: bool = True
    use_global_objective: bool = True
    representation: str = "fragments"   # "devise": one mean fragment per side (§4.1)
    image_head_dim: int = 0        # > 0: the CNN's top layer (image_dim -> this) is part of the model
    cnn_learning_rate_scale: float = 1.0   # the CNN top layer's rate relative to the embedding's

    def validate(self) -> None:
        for name in ("image_dim", "num_relations", "vocabulary_size", "word_dim", "embed_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.normaliser not in fragment_losses.NORMALISERS:
            raise ConfigError(f"normaliser must be one of {fragment_losses.NORMALISERS}, "
                              f"got {self.normaliser!r}")
        if self.mil_zero_score not in fragment_losses.MIL_ZERO_SCORES:
            raise ConfigError(f"mil_zero_score must be one of {fragment_losses.MIL_ZERO_SCORES}, "
                              f"got {self.mil_zero_score!r}")
        if self.global_score not in fragment_losses.GLOBAL_SCORES:
            raise ConfigError(f"global_score must be one of {fragment_losses.GLOBAL_SCORES}, "
                              f"got {self.global_score!r}")
        if not (self.use_fragment_objective or self.use_global_objective):
            raise ConfigError("at least one of the fragment and global objectives must be on")
        if self.representation not in REPRESENTATIONS:
            raise ConfigError(f"representation must be one of {REPRESENTATIONS}, got {self.representation!r}")
        if self.image_head_dim < 0:
            raise ConfigError(f"image_head_dim must be >= 0, got {self.image_head_dim}")

    @property
    def joint_dim(self) -> int:
        """Size of the fragment embeddings: h, or the word-vector size for DeViSE."""
        return self.word_dim if self.representation == "devise" else self.embed_dim

    def score_options(self) -> dict:
        """S_kl's settings, as `global_scores` and the retrieval scorer take them."""
        return {"smoothing": self.smoothing, "normaliser": self.normaliser, "global_score": self.global_score}



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
        if self.shared_relation_weights:
            out = tf.tensordot(words, self.relation_kernel[0], axes=1) + self.relation_bias[0]
        else:
            # Fragments grouped by relation, one matmul per relation, then put
            # back in place: exactly one W_R product per fragment. (An einsum
            # over all relations costs R times the work, and its gradient
            # materialises a fragments x R x 2d x h tensor.)
            shape = tf.shape(relation)
            flat_words = tf.reshape(words, [-1, 2 * self.word_dim])
            flat_relation = tf.reshape(tf.cast(relation, tf.int32), [-1])
            positions = tf.range(tf.shape(flat_relation)[0])
            groups = tf.dynamic_partition(flat_words, flat_relation, self.num_relations)
            places = tf.dynamic_partition(positions, flat_relation, self.num_relations)
            outs = [tf.matmul(g, self.relation_kernel[r]) + self.relation_bias[r] for r, g in enumerate(groups)]
            out = tf.reshape(tf.dynamic_stitch(places, outs), tf.concat([shape, [self.units]], 0))
        return tf.nn.relu(out)

    def get_config(self):
        return {**super().get_config(), "vocabulary_size": self.vocabulary_size, "word_dim": self.word_dim,
                "num_relations": self.num_relations, "units": self.units,
                "shared_relation_weights": self.shared_relation_weights}


class FragmentEmbeddingModel(SystemModel):
    """Image- and sentence-fragment embeddings trained with C_F + β·C_G + α‖θ‖²."""

    CONFIG_CLASS = FragmentEmbeddingConfig
    LOGGED_TERMS = ("loss", "fragment_objective", "global_objective")
    EVALUATION_OPTIONS = ("ks",)

    def __init__(self, config: FragmentEmbeddingConfig, **kwargs):
        config.validate()
        super().__init__(config, **kwargs)
        self.image_head = (keras.layers.Dense(config.image_head_dim, name="image_head")
                           if config.image_head_dim else None)
        self.image_projection = keras.layers.Dense(config.joint_dim, name="image_projection")
        self.sentence_encoder = SentenceFragmentEncoder(
            config.vocabulary_size, config.word_dim, config.num_relations, config.embed_dim,
            config.shared_relation_weights, name="sentence_encoder")
        if config.representation == "devise":
            # DeViSE's sentence side is the fixed mean word vector: no W_R to train.
            self.sentence_encoder.trainable = False
        # MIL labels (eq. 5) from the second stage on; a variable so that the
        # switch needs no retracing.
        self.mil = tf.Variable(False, trainable=False, name="mil")

    def build_all(self) -> "FragmentEmbeddingModel":
        cnn_dim = self.config.image_dim
        if self.image_head is not None:
            self.image_head.build((None, None, cnn_dim))
            cnn_dim = self.config.image_head_dim
        self.image_projection.build((None, None, cnn_dim))
        self.sentence_encoder.build()
        self.built = True
        return self

    # ------------------------------------------------------------------ towers
    @property
    def output_dtype(self):
        """The variables' dtype: embeddings, scores and the objective leave the towers in it.

        Under a mixed policy the towers compute in bfloat16/float16 and the
        rest stays float32, as Keras expects of losses.
        """
        return tf.as_dtype(self.dtype_policy.variable_dtype)

    def embed_image_fragments(self, image_fragments, training=False):
        """v of every image fragment: (..., image_dim) CNN inputs -> (..., joint_dim)."""
        x = image_fragments
        if self.image_head is not None:
            x = self.image_head(x, training=training)
        return tf.cast(self.image_projection(x, training=training), self.output_dtype)

    def embed_sentence_fragments(self, relation, word1, word2, training=False):
        """s of every sentence fragment (eq. 1)."""
        return tf.cast(self.sentence_encoder(relation, word1, word2, training=training), self.output_dtype)

    def embed_images(self, image_fragments, image_mask, training=False):
        """(v (B, M, h), mask (B, M)); DeViSE: one fragment, the mean CNN feature, (B, 1, h)."""
        if self.config.representation != "devise":
            return self.embed_image_fragments(image_fragments, training), tf.cast(image_mask, tf.bool)
        weights = tf.cast(image_mask, image_fragments.dtype)[..., None]
        mean = tf.reduce_sum(image_fragments * weights, axis=1, keepdims=True) / tf.maximum(
            tf.reduce_sum(weights, axis=1, keepdims=True), 1.0)
        return (self.embed_image_fragments(mean, training),
                tf.reduce_any(tf.cast(image_mask, tf.bool), axis=1, keepdims=True))

    def embed_sentences(self, relation, word1, word2, sentence_mask, training=False):
        """(s (B, F, h), mask (B, F)); DeViSE: the mean of the L2-normalised vectors of the
        fragments' first words (one per word with BOW fragments), (B, 1, word_dim)."""
        if self.config.representation != "devise":
            return (self.embed_sentence_fragments(relation, word1, word2, training),
                    tf.cast(sentence_mask, tf.bool))
        words = tf.math.l2_normalize(tf.cast(tf.gather(self.sentence_encoder.word_vectors, word1),
                                             self.output_dtype), axis=-1)
        weights = tf.cast(sentence_mask, words.dtype)[..., None]
        mean = tf.reduce_sum(words * weights, axis=1, keepdims=True) / tf.maximum(
            tf.reduce_sum(weights, axis=1, keepdims=True), 1.0)
        return mean, tf.reduce_any(tf.cast(sentence_mask, tf.bool), axis=1, keepdims=True)

    def embed_split(self, image_fragments, image_mask, fragments, chunk: int = 256):
        """Embedded fragments of a split: v (N, M', h), mask (N, M'), s (total, h), row_splits.

        `image_fragments` (N, M, D) is read `chunk` images at a time (a memory
        map of the raw features is never loaded whole: 5,000 × 20 × 4,096
        floats are 1.6 GB, their embeddings at h = 1,000 0.4 GB). `fragments`:
        a dict or an object with ``relation``, ``word1``, ``word2`` (total,)
        and ``row_splits``. DeViSE: one fragment per image and per caption
        (a caption without words has none).
        """
        relation, word1, word2, row_splits = (
            np.asarray(fragments[k] if isinstance(fragments, dict) else getattr(fragments, k))
            for k in ("relation", "word1", "word2", "row_splits"))
        image_mask = np.asarray(image_mask)
        vs, vms = [], []
        for i in range(0, len(image_fragments), chunk):
            v, vm = self.embed_images(np.asarray(image_fragments[i:i + chunk], np.float32), image_mask[i:i + chunk])
            vs.append(np.asarray(v))
            vms.append(np.asarray(vm))
        if self.config.representation == "devise":
            padded = padded_sentence_arrays(relation, word1, word2, row_splits)
            s, sm = self.embed_sentences(padded["relation"], padded["word1"], padded["word2"],
                                         padded["sentence_mask"])
            keep = np.asarray(sm)[:, 0]
            row_splits = np.concatenate([[0], np.cumsum(keep)]).astype(np.int64)
            return np.concatenate(vs), np.concatenate(vms), np.asarray(s)[keep, 0], row_splits
        s = [np.asarray(self.embed_sentence_fragments(relation[i:i + 65536], word1[i:i + 65536],
                                                      word2[i:i + 65536]))
             for i in range(0, max(1, len(relation)), 65536)]
        return np.concatenate(vs), np.concatenate(vms), np.concatenate(s), row_splits

    def evaluate_split(self, x, protocol: str | None = None, *,
                       ks: Sequence[int] = retrieval.DEFAULT_KS) -> dict:
        """Retrieval metrics of S_kl on a test split (module docstring) through the one evaluation core.

        Returns R@K in both directions, median/mean rank and rsum under
        `protocol` (default: the split's), with the model's S_kl settings
        (`FragmentEmbeddingConfig.score_options`).
        """
        split = as_evaluation_split(x, protocol)
        if split.caption_of_row is not None or split.image_class is not None:
            raise UserInputError("caption_of_row / image_class are dual-path evaluation inputs; "
                                 "a fragment model takes one fragment list per caption")
        if not (isinstance(split.image, dict) and isinstance(split.text, dict)):
            raise UserInputError("a fragment model's split has image={'fragments', 'mask'} and text="
                                 "{'relation', 'word1', 'word2', 'row_splits'} (tf_twobranch.systems."
                                 "fragments.pipeline.evaluation_split)")
        v, vm, s, row_splits = self.embed_split(split.image["fragments"], split.image["mask"], split.text)
        return evaluate_fragment_retrieval(v, vm, s, row_splits, split.caption_image, split.protocol, ks=ks,
                                           **self.config.score_options())

    def call(self, inputs, training=False):
        v, vm = self.embed_images(inputs["image_fragments"], inputs["image_mask"], training)
        s, sm = self.embed_sentences(inputs["relation"], inputs["word1"], inputs["word2"],
                                     inputs["sentence_mask"], training)
        return fragment_losses.global_scores(v, vm, s, sm, **self.config.score_options())

    # ------------------------------------------------------------------ loss
    def objective(self, batch, training=True) -> dict:
        """C_F, C_G, ‖θ‖² (the decayed weights') and the loss C_F + β·C_G + α‖θ‖², in `output_dtype`."""
        c = self.config
        v, image_mask = self.embed_images(batch["image_fragments"], batch["image_mask"], training)
        s, sentence_mask = self.embed_sentences(batch["relation"], batch["word1"], batch["word2"],
                                                batch["sentence_mask"], training)
        scores = fragment_losses.fragment_scores(v, s)
        zero = tf.zeros((), self.output_dtype)
        terms = {"fragment_objective": zero, "global_objective": zero}
        if c.use_fragment_objective:
            labels = tf.cond(self.mil,
                             lambda: fragment_losses.fragment_alignment_labels(
                                 scores, image_mask, sentence_mask, mil=True,
                                 mil_zero_score=c.mil_zero_score),
                             lambda: fragment_losses.fragment_alignment_labels(
                                 scores, image_mask, sentence_mask, mil=False))
            terms["fragment_objective"] = fragment_losses.fragment_alignment_objective(
                scores, labels, image_mask, sentence_mask,
                margin=c.fragment_margin, class_balanced=c.class_balanced)
        if c.use_global_objective:
            global_scores = fragment_losses.global_scores_from_fragment_scores(
                scores, image_mask, sentence_mask, **c.score_options())
            terms["global_objective"] = fragment_losses.global_ranking_objective(
                global_scores, margin=c.global_margin)
        terms["regulariser"] = tf.add_n([zero] + [tf.reduce_sum(tf.square(tf.cast(w, self.output_dtype)))
                                                  for w in self.decayed_weights])
        terms["loss"] = (terms["fragment_objective"] + c.global_weight * terms["global_objective"]
                         + c.weight_decay * terms["regulariser"])
        return terms

    @property
    def decayed_weights(self) -> list:
        """The weights of α‖θ‖²: every trainable weight, or its kernels only (``decay_biases=False``)."""
        return [w for w in self.trainable_weights if self.config.decay_biases or "bias" not in w.path]

    def apply_gradients(self, grads) -> None:
        if self.image_head is not None and self.config.cnn_learning_rate_scale != 1.0:
            # A smaller step for the pretrained CNN layer (SGD: the same as its own rate).
            head = {id(v) for v in self.image_head.trainable_variables}
            grads = [g * self.config.cnn_learning_rate_scale if id(v) in head and g is not None else g
                     for g, v in zip(grads, self.trainable_variables)]
        super().apply_gradients(grads)


def build_fragment_model(config: FragmentEmbeddingConfig | dict,
                         word_vectors: np.ndarray | None = None) -> FragmentEmbeddingModel:
    """A built model; `word_vectors` (vocabulary_size, word_dim) fill the frozen W_e."""
    if isinstance(config, dict):
        config = FragmentEmbeddingConfig.from_dict(config)
    model = FragmentEmbeddingModel(config).build_all()
    if word_vectors is not None:
        model.sentence_encoder.set_word_vectors(word_vectors)
    return model

