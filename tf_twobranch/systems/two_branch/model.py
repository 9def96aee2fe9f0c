"""The embedding network and the similarity network (TPAMI §3).

Both are `TwoBranchModel`s: an image tower and a text tower (separate Keras
models, exported separately), plus — for the similarity network — a head on
the element-wise product of the two embeddings. The model owns its loss
(a "task", as in TensorFlow Recommenders): `train_step` computes the
bi-directional ranking loss (embedding network) or the logistic loss on
balanced pairs (similarity network), and `evaluate` runs the shared
retrieval evaluation core and returns recall metrics.

Everything needed to rebuild a model is in `TwoBranchConfig`, which the
trainer writes next to the weights as JSON.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch import distribute
from tf_twobranch.batching import in_batches, inference_function
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.models.base import ModelConfig, SystemModel
from tf_twobranch.systems.two_branch import losses, region_phrase_losses
from tf_twobranch.systems.two_branch.branches import BRANCH_LAYOUTS, build_feature_branch
from tf_twobranch.models.evaluation_input import as_evaluation_split
from tf_twobranch.systems.two_branch.text_towers import build_lstm_text_tower

MODEL_KINDS = ("embedding", "similarity")
TEXT_ENCODERS = ("features", "lstm")


@dataclasses.dataclass
class TwoBranchConfig(ModelConfig):
    """Architecture and loss of a two-branch model (JSON-serialisable)."""
    FAMILY: ClassVar[str] = "two_branch"
    FILE_NAME: ClassVar[str] = "run_config.json"
    DESCRIPTION: ClassVar[str] = "two-branch model configuration"
    kind: str = "embedding"
    image_dim: int = 4096
    text_dim: int = 6000          # ignored by the LSTM text encoder
    image_hidden: Sequence[int] = (2048,)
    text_hidden: Sequence[int] = (2048,)
    embed_dim: int = 512
    layout: str = "original"
    dropout: float = 0.5
    text_encoder: str = "features"
    vocabulary: Sequence[str] | None = None   # LSTM only
    max_len: int = 32
    word_dim: int = 256
    lstm_units: int = 512
    similarity_head: Sequence[int] = (512, 256)
    # Ranking loss (embedding network), TPAMI eq. 6 / the original code.
    margin: float = 0.05
    top_k: int = 10
    image_anchor_weight: float = 1.0
    text_anchor_weight: float = 1.5
    image_neighbour_weight: float = 0.0
    text_neighbour_weight: float = 0.05

    def __post_init__(self):
        self.image_hidden = tuple(int(d) for d in self.image_hidden)
        self.text_hidden = tuple(int(d) for d in self.text_hidden)
        self.similarity_head = tuple(int(d) for d in self.similarity_head)
        if self.vocabulary is not None:
            self.vocabulary = list(self.vocabulary)
        self.validate()

    def validate(self):
        def check(cond, msg):
            if not cond:
                raise ConfigError(msg)
        check(self.kind in MODEL_KINDS, f"kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        check(self.layout in BRANCH_LAYOUTS,
              f"layout must be one of {BRANCH_LAYOUTS}, got {self.layout!r}")
        check(self.text_encoder in TEXT_ENCODERS,
              f"text_encoder must be one of {TEXT_ENCODERS}, got {self.text_encoder!r}")
        check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        check(self.margin >= 0, f"margin must be >= 0, got {self.margin}")
        check(self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}")
        check(self.embed_dim >= 1 and self.image_dim >= 1, "dimensions must be positive")
        for name in ("image_anchor_weight", "text_anchor_weight",
                     "image_neighbour_weight", "text_neighbour_weight"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        if self.text_encoder == "lstm":
            check(bool(self.vocabulary) and len(self.vocabulary) > 2,
                  "the LSTM text encoder needs a vocabulary")
        else:
            check(self.text_dim >= 1, "text_dim must be positive")

    def loss_kwargs(self) -> dict:
        return dict(margin=self.margin, top_k=self.top_k,
                    image_anchor_weight=self.image_anchor_weight,
                    text_anchor_weight=self.text_anchor_weight,
                    image_neighbour_weight=self.image_neighbour_weight,
                    text_neighbour_weight=self.text_neighbour_weight)


def build_similarity_head(embed_dim: int, hidden: Sequence[int]) -> keras.Model:
    """FC layers on the element-wise product; TPAMI: 512→512→256→1 with ReLU."""
    x_in = keras.Input(shape=(embed_dim,), name="joint")
    x = x_in
    for i, dim in enumerate(hidden, start=1):
        x = keras.layers.Dense(dim, activation="relu", name=f"sim_fc{i}")(x)
    logit = keras.layers.Dense(1, name=f"sim_fc{len(hidden) + 1}")(x)
    return keras.Model(x_in, logit, name="similarity_head")


class TwoBranchModel(SystemModel):
    """Image tower + text tower (+ similarity head), with its own loss.

    Batches for `fit` are dicts: ``image`` (num_images, image_dim),
    ``text`` (num_texts, text_dim) float features or int token ids, and
    ``labels``: for the embedding network a bool (num_texts, num_images)
    positive mask; for the similarity network a (num_pairs,) 0/1 vector with
    ``image`` and ``text`` aligned row by row.
    """

    CONFIG_CLASS = TwoBranchConfig
    EVALUATION_OPTIONS = ("batch_size", "ks")
    GLOBAL_LOSS = True

    def __init__(self, config: TwoBranchConfig, **kwargs):
        super().__init__(config, name=kwargs.pop("name", f"two_branch_{config.kind}"), **kwargs)
        self.image_tower = build_feature_branch(
            config.image_dim, hidden_dims=config.image_hidden, output_dim=config.embed_dim,
            layout=config.layout, dropout=config.dropout, name="image")
        if config.text_encoder == "lstm":
            self.text_tower = build_lstm_text_tower(
                len(config.vocabulary), max_len=config.max_len, word_dim=config.word_dim,
                lstm_units=config.lstm_units, hidden_dims=config.text_hidden,
                output_dim=config.embed_dim, layout=config.layout, dropout=config.dropout,
                name="text")
        else:
            self.text_tower = build_feature_branch(
                config.text_dim, hidden_dims=config.text_hidden, output_dim=config.embed_dim,
                layout=config.layout, dropout=config.dropout, name="text")
        self.similarity_head = (build_similarity_head(config.embed_dim, config.similarity_head)
                                if config.kind == "similarity" else None)
        self._xla_apply = None

    def compile(self, optimizer="adam", *, xla_optimizer_update: bool | None = None, **kwargs):
        """Keras compile; the optimizer update can be XLA-compiled on its own.

        XLA fuses Adam's element-wise update of the 22.7M parameters of the
        paper-size network (87 → 25 ms per step here, benchmarks/), while
        the towers stay on the default kernels (XLA's CPU matmuls are several
        times slower here). Default: on outside any tf.distribute strategy,
        off under one — also a one-replica MirroredStrategy (one GPU), whose
        optimizer update is a cross-replica merge_call that cannot run
        inside the nested XLA function.
        """
        super().compile(optimizer=optimizer, **kwargs)
        if xla_optimizer_update is None:
            xla_optimizer_update = (not tf.distribute.has_strategy()
                                    and kwargs.get("jit_compile") is not True)
        self._xla_apply = None
        if xla_optimizer_update:
            self.optimizer.build(self.trainable_variables)
            variables = self.trainable_variables

            @tf.function(jit_compile=True)
            def xla_apply(grads):
                self.optimizer.apply(grads, variables)
            self._xla_apply = xla_apply

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Under a tf.distribute strategy Keras builds the model by averaging
        # the first distributed batch, which fails on this model's boolean
        # label masks.  The towers are built when the model is constructed, so
        # only the optimizer may still need its slots.
        if all(layer.built for layer in self._flatten_layers()):
            if self.optimizer is not None and not self.optimizer.built:
                with self.distribute_strategy.scope():
                    self.optimizer.build(self.trainable_variables)
            return
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    # --- forward -----------------------------------------------------------
    def call(self, inputs, training=False):
        image = self.image_tower(inputs["image"], training=training)
        text = self.text_tower(inputs["text"], training=training)
        out = {"image_embedding": image, "text_embedding": text}
        if self.similarity_head is not None and inputs.get("paired", True):
            out["logits"] = tf.squeeze(self.similarity_head(image * text, training=training), -1)
        # Under a mixed-precision policy the towers compute in bfloat16/float16;
        # losses, gathers and evaluation stay in float32.
        return {k: tf.cast(v, tf.float32) for k, v in out.items()}

    def build_all(self):
        """Creates every variable (needed before loading weights)."""
        image = tf.zeros([2, self.config.image_dim])
        if self.config.text_encoder == "lstm":
            text = tf.zeros([2, self.config.max_len], tf.int32)
        else:
            text = tf.zeros([2, self.config.text_dim])
        self({"image": image, "text": text})
        return self

    # --- training ------------------------------------------------------------
    def objective(self, batch, training=True) -> dict:
        """The loss terms of one (global) batch (``"loss"``: the total); the batch's keys say which task.

        * ``labels`` (texts × images) — image–sentence triplets (TPAMI §5.1);
        * ``phrase_region_positive`` — Algorithm 1 region–phrase triplets
          (λ1 region anchor, λ2 phrase anchor, λ3/λ4 neighbourhoods);
        * similarity network: ``labels`` per pair, with ``pair_mask`` for
          Algorithm 1's padded pair batches.

        Under a multi-replica strategy the batch holds this replica's tower
        inputs (`distribute.split_global_batch`) and the global label
        matrices; the replicas' outputs are all-gathered (differentiably) so
        the ranking terms see every in-batch negative of the global batch, and
        every replica computes the same global loss (``GLOBAL_LOSS``: Keras
        sums the replicas' gradients, the all-gather's gradient routes each
        row's share back to the replica that embedded it, and the base scales
        by 1/replicas, so the update is that of the single-device batch).
        """
        out = self(batch, training=training)
        if distribute.num_replicas() > 1:
            out = {k: distribute.cross_replica_concat(v) for k, v in out.items()}
        return {"loss": self._loss_from_outputs(out, batch)}

    def _loss_from_outputs(self, out: dict, batch: dict) -> tf.Tensor:
        """The task's loss given the towers' outputs for the whole batch.

        The ranking terms use their static-shape forms (`static_shapes=True`
        of `tf_twobranch.losses`) where XLA needs them: the image–sentence
        loss always (same value for any labels, and not slower than the
        `tf.where`-gather form: median 56 vs 61 ms loss+gradient at 1000
        texts × 500 images, 512-d, on 2 loaded CPU cores), the
        phrase-localization loss only under `jit_compile=True` (without XLA
        its static form is slower, 63 vs 44 ms at 200 phrases × 1300
        regions, and its region-anchor term caps the positive regions per
        phrase in very large batches).
        """
        cfg = self.config
        if cfg.kind == "embedding":
            if "phrase_region_positive" in batch:
                return region_phrase_losses.phrase_localization_batch_loss(
                    out["image_embedding"], out["text_embedding"], batch, margin=cfg.margin,
                    top_k=cfg.top_k, region_anchor_weight=cfg.image_anchor_weight,
                    phrase_anchor_weight=cfg.text_anchor_weight,
                    region_neighbour_weight=cfg.image_neighbour_weight,
                    phrase_neighbour_weight=cfg.text_neighbour_weight,
                    static_shapes=getattr(self, "jit_compile", False) is True)
            return losses.bidirectional_ranking_loss(
                out["image_embedding"], out["text_embedding"], batch["labels"],
                static_shapes=True, **cfg.loss_kwargs())
        if "pair_mask" in batch:
            return losses.masked_logistic_pair_loss(out["logits"], batch["labels"],
                                                    batch["pair_mask"])
        return losses.logistic_pair_loss(out["logits"], batch["labels"])

    def apply_gradients(self, grads) -> None:
        if self._xla_apply is not None:
            self._xla_apply(grads)
        else:
            self.optimizer.apply(grads, self.trainable_variables)

    # --- embedding and scoring ---------------------------------------------------
    def embed_images(self, image_features, batch_size: int = 1024) -> np.ndarray:
        return in_batches(inference_function(self.image_tower), image_features, batch_size)

    def embed_texts(self, texts, batch_size: int = 1024) -> np.ndarray:
        return in_batches(inference_function(self.text_tower), texts, batch_size)

    def score_fn(self, image_embeds: np.ndarray, text_embeds: np.ndarray,
                 pair_batch: int = 262144):
        """A `score_fn(start, stop)` for the evaluation core (higher = better)."""
        if self.similarity_head is None:
            def dot_scores(a, b):
                return image_embeds @ text_embeds[a:b].T
            return dot_scores
        head = self.similarity_head

        @tf.function(reduce_retracing=True)
        def head_scores(img, txt):
            joint = tf.reshape(img[:, None, :] * txt[None, :, :], [-1, img.shape[-1]])
            return tf.reshape(head(joint, training=False), [tf.shape(img)[0], -1])

        images_t = tf.constant(image_embeds)
        cols = max(1, min(len(text_embeds), pair_batch // max(1, len(image_embeds))))

        def score(a, b):
            blocks = []
            for c in range(a, b, cols):
                texts = text_embeds[c:min(c + cols, b)]
                width = len(texts)
                # Every head call gets the same shape, so identical (image,
                # caption) pairs score identically wherever they fall: rounding
                # depends on the call's shapes, and ties must stay exact.
                if width < cols:
                    texts = np.concatenate([texts, np.zeros((cols - width, texts.shape[1]), texts.dtype)])
                blocks.append(head_scores(images_t, tf.constant(texts)).numpy()[:, :width])
            return np.concatenate(blocks, axis=1)
        # The evaluation core sizes its caption windows by this (`retrieval.score_window`).
        score.columns_per_call = cols
        return score

    def evaluate_split(self, x, protocol: str | None = None, *, batch_size: int = 1024,
                       ks: Sequence[int] = retrieval.DEFAULT_KS) -> dict:
        """Image–text retrieval metrics on a test split via the shared core.

        `x` is an `EvaluationSplit` (e.g. `load_run(...).evaluation_split()`),
        a dict with ``image`` (num_images, ...) inputs, ``text``
        (num_captions, ...) inputs and ``caption_image`` (num_captions,), or
        any object with those attributes (`models.evaluation_input`).
        Returns R@K in both directions, median/mean rank and rsum under
        `protocol` (default: the split's, else "full"), the same numbers as
        `tf_twobranch.evaluation.retrieval` on the model's embeddings (through
        the similarity head's scores for the similarity network).
        """
        split = as_evaluation_split(x, protocol)
        if split.caption_of_row is not None or split.image_class is not None:
            raise UserInputError("caption_of_row / image_class are dual-path evaluation inputs; "
                                 "a two-branch model takes one text row per caption")
        image_embeds = self.embed_images(split.image, batch_size)
        text_embeds = self.embed_texts(split.text, batch_size)
        return retrieval.evaluate_protocol(
            image_embeds, text_embeds, split.caption_image, split.protocol, ks=ks,
            score_fn_factory=None if self.similarity_head is None else self.score_fn)

    def sentence_retrieval(self, texts, caption_image, batch_size: int = 1024) -> dict:
        """Sentence-to-sentence retrieval R@K (TPAMI Table 4) in the text space."""
        return retrieval.sentence_retrieval_metrics(self.embed_texts(texts, batch_size),
                                                    caption_image)


def build_model(config: TwoBranchConfig | dict) -> TwoBranchModel:
    if isinstance(config, dict):
        config = TwoBranchConfig.from_dict(config)
    return TwoBranchModel(config).build_all()

