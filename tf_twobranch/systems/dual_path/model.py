"""Dual-path CNN image–text embedding with instance loss (Zheng et al. 2020).

An image CNN (ImageNet ResNet-50 / VGG-19 / ResNet-152 plus an FC head) and a
text CNN (word embedding + residual bottleneck blocks of 1×2 convolutions
along the words) map an image and a caption to 2048-d features f_img, f_text.
ONE classifier W_share (embed_dim → num_classes; a class per image/text group,
or per identity on CUHK-PEDES) classifies both: the instance loss is the
softmax cross-entropy of each branch (eqs. 5-8). Stage II adds the
bidirectional cosine ranking loss (eq. 4):
L = λ1·rank + λ2·instance(image) + λ3·instance(text) (eq. 9).

`DualPathModel` owns its loss (like `TwoBranchModel`): `train_step` follows
the global-batch contract of `tf_twobranch.distribute` (embeddings and labels
all-gathered for the ranking term; every term = sum over local rows / global
row count), and `evaluate` calls the shared core
`tf_twobranch.evaluation.retrieval`.

Choices (P = paper, R = reference code layumi/Image-Text-Embedding; the
paper is the default, the reference fills what the paper leaves open and is
available as the "reference" layouts):

=========================  ==================================================  =========
item                       choice                                              source
=========================  ==================================================  =========
image CNN                  ResNet-50 pool5 (2048), ImageNet weights from a     P §3.1
                           local file (random init logged otherwise)
image head ("paper")       FC 2048 (no bias) → BN → ReLU → FC embed_dim (bias) P Fig. 2
image head ("reference")   FC → BN → ReLU → FC → BN → ReLU, FCs without bias   R
text head ("paper")        pool → FC (no bias) → BN → ReLU → FC embed_dim      P Fig. 2
text head ("reference")    pool → FC (no bias) → BN → ReLU (one FC only)       R
FC bias before BN          none (BN's offset replaces it)                      R
dropout                    rate 0.75, only on the features fed to W_share      P rate, R
                           (the ranking loss and retrieval see features        place
                           without dropout)
W_share                    one Dense(num_classes) shared by both branches,     P eqs. 5-7
                           bias on by default (``classifier_use_bias``)        R (bias)
word embedding             lookup table = 1×1 conv on one-hot, (vocab, 300),   P §3.2
                           word2vec-initialised when a matrix is given; id 0
                           is padding and embeds to exactly 0 (masked); no
                           bias (R's 1×1 conv has one, which makes padding
                           non-zero)
after the embedding        batch norm (no ReLU)                                R (P silent)
text body ("paper")        3-4-6-3 bottleneck blocks (ResNet-50), widths       P §3.2
                           w→4w … 8w→32w (w = ``text_width`` = 64: 256 … 2048),
                           stage strides 1,2,2,2 (L=32 → 32,16,8,4); 1×2 conv
                           with Keras 'same' padding (an even kernel cannot
                           pad symmetrically: the zero goes after the last
                           word, so position t sees words t, t+1)
text body ("reference")    3-4-6-1 blocks, stage strides 1,2,2,1 (32 → 32,16,  R
                           8,8); causal 1×2 conv (one zero before the first
                           word: position t sees words t-1, t); the first
                           block of a stage is wider inside (2w, 8w, 16w, 32w)
downsampling               in the 1×2 conv of a stage's first block (a 1×1     R
                           stride-2 conv would skip every other word); the
                           projection shortcut is a 1×1 conv, same stride
pooling                    "paper": average over positions; "reference": max   P Fig. 2 / R
receptive field            ``text_receptive_field``: 53 words ("paper"), 37   computed
                           ("reference") — wider than 32, so every pooled
                           position sees most of the sentence
ranking loss               cosine, margin α = 1, negatives "in_batch" (mean    P eq. 4,
                           hinge over the gallery = eq. 4 in expectation over  §6.2
                           a random negative); "hardest" and "reference" (R:
                           hardest of N random captions per image, random
                           image per caption) via ``ranking_negatives``; the
                           batch may carry the N captions
                           (``negative_token_ids``)
λ (Stage II)               (1, 1, 1); R uses 2 : 1 : 0.1 (CUHK 2 : 1 : 0.5)   P §5
Stage I                    image backbone frozen (``trainable=False``, its BN  P §5
                           in inference mode), λ = (0, 1, 1); the image head
                           trains
test-time image feature    mean of the features of the image and its          P §6.2
                           horizontal flip; cosine ranking
=========================  ==================================================  =========

Changing the stage (`set_stage`) changes the trainable variables. Keras 3
optimizers are built for one variable list, so `set_stage` recompiles the
model with a fresh optimizer of the same class and configuration (momentum
slots start at zero, as when the reference starts its Stage II run) unless
you pass `optimizer=`; it also drops the traced train/test functions.
"""
from __future__ import annotations

import dataclasses
import os
from typing import ClassVar, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch import distribute
from tf_twobranch.batching import in_batches
from tf_twobranch.checkpoints import load_checkpoint
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.evaluation import retrieval
from tf_twobranch.features.backbones import build_backbone
from tf_twobranch.systems.dual_path import losses
from tf_twobranch.models.base import ModelConfig, SystemModel
from tf_twobranch.models.evaluation_input import as_evaluation_split
from tf_twobranch.vectors import l2_normalize_rows

__all__ = ["DualPathConfig", "DualPathModel", "PaddingMaskedEmbedding", "build_image_cnn",
           "build_text_cnn", "build_dual_path_model", "text_stage_specs",
           "text_receptive_field", "text_feature_length", "load_dual_path_model", "retrieval_metrics"]

IMAGE_BACKBONES = ("resnet50", "vgg19", "vgg16", "resnet152", "scene_cnn")
LAYOUTS = ("paper", "reference")


@dataclasses.dataclass
class DualPathConfig(ModelConfig):
    """Architecture, losses and stage of a dual-path model (JSON-serialisable).

    `vocabulary_size` counts the padding id 0; `num_classes` is the number of
    image/text groups (or identities). `text_blocks` overrides the number of
    blocks per stage of the layout (e.g. (1, 1, 1, 1) in tests); `text_width`
    is the bottleneck width of the first stage (64 as ResNet-50).
    """
    FAMILY: ClassVar[str] = "dual_path"
    FILE_NAME: ClassVar[str] = "dual_path_config.json"
    DESCRIPTION: ClassVar[str] = "dual-path model configuration"

    vocabulary_size: int
    num_classes: int
    image_backbone: str = "resnet50"
    image_size: int = 224
    image_weights: str | None = None
    text_layout: str = "paper"
    head_layout: str = "paper"
    text_width: int = 64
    text_blocks: Sequence[int] | None = None
    max_len: int = 32
    word_dim: int = 300
    hidden_dim: int = 2048
    embed_dim: int = 2048
    dropout: float = 0.75
    classifier_use_bias: bool = True
    margin: float = 1.0
    ranking_negatives: str = "in_batch"
    lambda_rank: float = 1.0
    lambda_image: float = 1.0
    lambda_text: float = 1.0
    stage: int = 1

    def __post_init__(self):
        if self.text_blocks is not None:
            try:
                self.text_blocks = tuple(int(b) for b in self.text_blocks)
            except (TypeError, ValueError):
                raise ConfigError(f"text_blocks must be a list of integers, got {self.text_blocks!r}") from None
        if self.image_weights is not None:
            self.image_weights = os.fspath(self.image_weights)
        self.validate()

    def validate(self) -> None:
        """Raises ConfigError when a value is unknown or out of range."""
        def check(cond, msg):
            if not cond:
                raise ConfigError(msg)

        def positive_int(name):
            value = getattr(self, name)
            check(isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1,
                  f"{name} must be a positive integer, got {value!r}")

        for name in ("num_classes", "text_width", "max_len", "word_dim", "hidden_dim",
                     "embed_dim", "image_size"):
            positive_int(name)
        check(isinstance(self.vocabulary_size, (int, np.integer)) and self.vocabulary_size >= 2,
              f"vocabulary_size must be an integer >= 2 (id 0 is padding), got {self.vocabulary_size!r}")
        check(self.image_backbone in IMAGE_BACKBONES,
              f"image_backbone must be one of {IMAGE_BACKBONES}, got {self.image_backbone!r}")
        check(self.image_size >= 32, f"image_size must be >= 32, got {self.image_size}")
        check(self.text_layout in LAYOUTS, f"text_layout must be one of {LAYOUTS}, got {self.text_layout!r}")
        check(self.head_layout in LAYOUTS, f"head_layout must be one of {LAYOUTS}, got {self.head_layout!r}")
        if self.text_blocks is not None:
            check(len(self.text_blocks) == 4 and all(b >= 1 for b in self.text_blocks),
                  f"text_blocks must be four positive block counts, got {self.text_blocks!r}")
        check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        check(self.margin >= 0, f"margin must be >= 0, got {self.margin}")
        check(self.ranking_negatives in losses.RANKING_NEGATIVES,
              f"ranking_negatives must be one of {losses.RANKING_NEGATIVES}, got {self.ranking_negatives!r}")
        for name in ("lambda_rank", "lambda_image", "lambda_text"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        check(self.stage in (1, 2), f"stage must be 1 or 2, got {self.stage!r}")
        if self.head_layout == "reference":
            check(self.hidden_dim == self.embed_dim,
                  "head_layout 'reference' ends with the hidden FC: hidden_dim must equal embed_dim")

    @classmethod
    def from_dict(cls, d: dict) -> "DualPathConfig":
        missing = {"vocabulary_size", "num_classes"} - set(d) if isinstance(d, dict) else ()
        if missing:
            raise ConfigError(f"dual-path config lacks {sorted(missing)}")
        return super().from_dict(d)

    def stage_lambdas(self, stage: int | None = None) -> tuple[float, float, float]:
        """(λ_rank, λ_image, λ_text) of a stage: Stage I uses the instance loss only."""
        stage = self.stage if stage is None else stage
        if stage == 1:
            return 0.0, 1.0, 1.0
        return float(self.lambda_rank), float(self.lambda_image), float(self.lambda_text)


# --- text CNN ----------------------------------------------------------------

def text_stage_specs(config: DualPathConfig) -> list[dict]:
    """Per stage: blocks, first-block and other bottleneck widths, output width, stride."""
    w = config.text_width
    mids = [w, 2 * w, 4 * w, 8 * w]
    outs = [4 * m for m in mids]
    if config.text_layout == "paper":
        blocks, strides, first_mids = [3, 4, 6, 3], [1, 2, 2, 2], mids
    else:
        blocks, strides, first_mids = [3, 4, 6, 1], [1, 2, 2, 1], [2 * w, 8 * w, 16 * w, 32 * w]
    if config.text_blocks is not None:
        blocks = list(config.text_blocks)
    return [dict(blocks=b, first_mid=fm, mid=m, out=o, stride=s)
            for b, fm, m, o, s in zip(blocks, first_mids, mids, outs, strides)]


def _left_pad(layout: str) -> int:
    # A 1×2 conv with Keras 'same' never pads before the first word (for any
    # length and stride 1 or 2); the reference pads one zero before it.
    return 0 if layout == "paper" else 1


def text_receptive_field(config: DualPathConfig) -> tuple[int, int, int]:
    """(size, jump, start) of the words seen by one position of the final text map.

    Position j of the feature map before pooling depends on the words
    ``start + j·jump … start + j·jump + size − 1`` (clipped to the sentence).
    Only the 1×2 convolutions widen it; shortcuts see a subset.
    """
    size, jump, start = 1, 1, 0
    pad = _left_pad(config.text_layout)
    for spec in text_stage_specs(config):
        for b in range(spec["blocks"]):
            stride = spec["stride"] if b == 0 else 1
            start -= pad * jump
            size += jump
            jump *= stride
    return size, jump, start


def text_feature_length(config: DualPathConfig) -> int:
    """Number of positions of the final text map (before pooling)."""
    length = config.max_len
    for spec in text_stage_specs(config):
        if spec["stride"] == 2:
            length = (length + 1) // 2
    return length


@keras.saving.register_keras_serializable(package="tf_twobranch")
class PaddingMaskedEmbedding(keras.layers.Layer):
    """Word lookup table (= the paper's 1×1 conv on one-hot words); id 0 → zeros."""

    def __init__(self, vocabulary_size: int, word_dim: int, embeddings_initializer="glorot_uniform",
                 **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size = int(vocabulary_size)
        self.word_dim = int(word_dim)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape):
        self.embeddings = self.add_weight(name="embeddings", shape=(self.vocabulary_size, self.word_dim),
                                          initializer=self.embeddings_initializer, trainable=True)

    def call(self, token_ids):
        token_ids = tf.cast(token_ids, tf.int32)
        table = tf.cast(self.embeddings, self.compute_dtype)
        vectors = tf.gather(table, token_ids)
        # Masking (not a zero row) keeps padding at zero while the table trains.
        return vectors * tf.cast(tf.not_equal(token_ids, 0), self.compute_dtype)[..., None]

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.word_dim,)

    def get_config(self):
        return {**super().get_config(), "vocabulary_size": self.vocabulary_size,
                "word_dim": self.word_dim,
                "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer)}


def _bn(name):
    return keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=name)


def _bottleneck(x, mid: int, out: int, stride: int, layout: str, name: str):
    """1×1 → 1×2 (stride) → 1×1 bottleneck with a shortcut (Fig. 3, ResNet v1 order)."""
    shortcut = x
    if stride != 1 or x.shape[-1] != out:
        shortcut = keras.layers.Conv1D(out, 1, strides=stride, use_bias=False, name=f"{name}_proj")(x)
        shortcut = _bn(f"{name}_proj_bn")(shortcut)
    y = keras.layers.Conv1D(mid, 1, use_bias=False, name=f"{name}_conv1")(x)
    y = keras.layers.ReLU(name=f"{name}_relu1")(_bn(f"{name}_bn1")(y))
    if layout == "paper":
        y = keras.layers.Conv1D(mid, 2, strides=stride, padding="same", use_bias=False,
                                name=f"{name}_conv2")(y)
    else:
        y = keras.layers.ZeroPadding1D((1, 0), name=f"{name}_pad2")(y)
        y = keras.layers.Conv1D(mid, 2, strides=stride, padding="valid", use_bias=False,
                                name=f"{name}_conv2")(y)
    y = keras.layers.ReLU(name=f"{name}_relu2")(_bn(f"{name}_bn2")(y))
    y = keras.layers.Conv1D(out, 1, use_bias=False, name=f"{name}_conv3")(y)
    y = _bn(f"{name}_bn3")(y)
    y = keras.layers.Add(name=f"{name}_add")([shortcut, y])
    return keras.layers.ReLU(name=f"{name}_out")(y)


def _head(x, config: DualPathConfig, prefix: str):
    """FC head after pooling: "paper" FC→BN→ReLU→FC, "reference" (see module table)."""
    x = keras.layers.Dense(config.hidden_dim, use_bias=False, name=f"{prefix}_fc1")(x)
    x = keras.layers.ReLU(name=f"{prefix}_relu1")(_bn(f"{prefix}_fc1_bn")(x))
    if config.head_layout == "paper":
        return keras.layers.Dense(config.embed_dim, name=f"{prefix}_fc2")(x)
    if prefix == "image":
        x = keras.layers.Dense(config.embed_dim, use_bias=False, name=f"{prefix}_fc2")(x)
        x = keras.layers.ReLU(name=f"{prefix}_relu2")(_bn(f"{prefix}_fc2_bn")(x))
    return x


def _check_word_vectors(word_vectors, config: DualPathConfig) -> np.ndarray:
    vectors = np.asarray(word_vectors)
    expected = (config.vocabulary_size, config.word_dim)
    if vectors.shape != expected:
        raise ConfigError(f"word_vectors must have shape (vocabulary_size, word_dim) = {expected}, "
                          f"got {vectors.shape}")
    if not np.issubdtype(vectors.dtype, np.floating) or not np.all(np.isfinite(vectors)):
        raise ConfigError("word_vectors must be a finite float matrix")
    return vectors.astype(np.float32)


def build_text_cnn(config: DualPathConfig, word_vectors: np.ndarray | None = None) -> keras.Model:
    """Deep text CNN: int32 token ids (batch, max_len), 0 = padding → (batch, embed_dim).

    `word_vectors` (vocabulary_size, word_dim), e.g. word2vec rows of the
    dictionary, initialises the lookup table; otherwise it is random
    (Glorot). The pre-pooling map is the output of the layer
    ``text_feature_map``.
    """
    init = "glorot_uniform"
    if word_vectors is not None:
        init = keras.initializers.Constant(_check_word_vectors(word_vectors, config))
    token_ids = keras.Input((config.max_len,), dtype="int32", name="token_ids")
    x = PaddingMaskedEmbedding(config.vocabulary_size, config.word_dim, embeddings_initializer=init,
                               name="word_embedding")(token_ids)
    x = _bn("word_embedding_bn")(x)
    for s, spec in enumerate(text_stage_specs(config), start=2):
        for b in range(spec["blocks"]):
            first = b == 0
            x = _bottleneck(x, spec["first_mid"] if first else spec["mid"], spec["out"],
                            spec["stride"] if first else 1, config.text_layout,
                            name=f"text_stage{s}_block{b + 1}")
    x = keras.layers.Identity(name="text_feature_map")(x)
    if config.text_layout == "paper":
        x = keras.layers.GlobalAveragePooling1D(name="text_pool")(x)
    else:
        x = keras.layers.GlobalMaxPooling1D(name="text_pool")(x)
    features = _head(x, config, "text")
    return keras.Model(token_ids, features, name="text_cnn")


def build_image_cnn(config: DualPathConfig) -> keras.Model:
    """Deep image CNN: float RGB 0..255 (batch, S, S, 3) → (batch, embed_dim).

    The backbone (`build_backbone`, ImageNet preprocessing inside) is the
    layer ``image_backbone``; without `config.image_weights` it starts from a
    random initialisation (logged by `build_backbone`).
    """
    backbone = build_backbone(config.image_backbone, weights_path=config.image_weights,
                              input_size=config.image_size)
    backbone.name = "image_backbone"
    images = keras.Input((config.image_size, config.image_size, 3), name="images")
    x = backbone(images)
    features = _head(x, config, "image")
    return keras.Model(images, features, name="image_cnn")


# --- the model -----------------------------------------------------------------

class DualPathModel(SystemModel):
    """Image CNN + text CNN + shared classifier W_share, with its own loss.

    Batches for `fit` are dicts: ``image`` float32 (B, S, S, 3) RGB 0..255,
    ``token_ids`` int32 (B, L), ``label`` int32 (B,) (row b is a matching
    image–caption pair of group/identity ``label[b]``) and optionally
    ``negative_token_ids`` int32 (N, L) (further negative captions for the
    image anchors; ``negative_label`` (N,) optionally masks same-group ones).
    """

    CONFIG_CLASS = DualPathConfig
    LOGGED_TERMS = ("loss", "rank_loss", "image_instance_loss", "text_instance_loss")
    EVALUATION_OPTIONS = ("batch_size", "flip_average", "ks")

    def __init__(self, config: DualPathConfig, word_vectors: np.ndarray | None = None, **kwargs):
        super().__init__(config, name=kwargs.pop("name", "dual_path"), **kwargs)
        self.image_tower = build_image_cnn(config)
        self.text_tower = build_text_cnn(config, word_vectors)
        self.classifier = keras.layers.Dense(config.num_classes, use_bias=config.classifier_use_bias,
                                             name="w_share")
        self.image_dropout = keras.layers.Dropout(config.dropout, name="image_dropout")
        self.text_dropout = keras.layers.Dropout(config.dropout, name="text_dropout")
        self.image_accuracy = keras.metrics.SparseCategoricalAccuracy(name="image_accuracy")
        self.text_accuracy = keras.metrics.SparseCategoricalAccuracy(name="text_accuracy")
        self._embed_fns = {}
        self._compile_kwargs = {}
        self.stage = None
        self.lambdas = config.stage_lambdas()
        self._apply_stage(config.stage)

    @property
    def image_backbone(self) -> keras.Model:
        return self.image_tower.get_layer("image_backbone")

    # --- stages --------------------------------------------------------------
    def _apply_stage(self, stage: int):
        self.stage = int(stage)
        self.image_backbone.trainable = self.stage == 2
        self.lambdas = self.config.stage_lambdas(self.stage)

    def set_stage(self, stage: int, optimizer: keras.optimizers.Optimizer | None = None) -> "DualPathModel":
        """Switches to Stage I (backbone frozen, λ = (0,1,1)) or II (all trainable, config λ).

        The trainable variables change, so a compiled model is recompiled
        with `optimizer`, or with a fresh optimizer of the current one's
        class and configuration (its slots restart from zero). Traced
        train/test functions are dropped so the new λ take effect.
        """
        if stage not in (1, 2):
            raise ConfigError(f"stage must be 1 or 2, got {stage!r}")
        self._apply_stage(stage)
        self.config.stage = self.stage
        if getattr(self, "compiled", False) or optimizer is not None:
            if optimizer is None:
                old = self.optimizer
                optimizer = old.__class__.from_config(old.get_config())
            self.compile(optimizer=optimizer, **self._compile_kwargs)
        self.train_function = self.test_function = self.predict_function = None
        return self

    def compile(self, optimizer="sgd", **kwargs):
        """Keras compile; the loss is the model's own (pass an optimizer, jit_compile, run_eagerly...).

        The keyword arguments are kept so that `set_stage` recompiles alike.
        """
        self._compile_kwargs = dict(kwargs)
        super().compile(optimizer=optimizer, **kwargs)

    # --- forward -------------------------------------------------------------------
    def call(self, inputs, training=False):
        """Features and W_share logits of both branches, float32."""
        image = self.image_tower(inputs["image"], training=training)
        text = self.text_tower(inputs["token_ids"], training=training)
        out = self._logits(image, text, training)
        return {k: tf.cast(v, tf.float32) for k, v in out.items()}

    def _logits(self, image, text, training):
        return {"image_features": image, "text_features": text,
                "image_logits": self.classifier(self.image_dropout(image, training=training)),
                "text_logits": self.classifier(self.text_dropout(text, training=training))}

    def build_all(self) -> "DualPathModel":
        """Creates every variable (needed before loading weights)."""
        s, n = self.config.image_size, 2
        self({"image": tf.zeros([n, s, s, 3]), "token_ids": tf.ones([n, self.config.max_len], tf.int32)})
        return self

    def objective(self, batch: dict, training: bool = True) -> dict:
        """This replica's share of every loss term (sum over local rows / global rows)."""
        labels = tf.cast(tf.reshape(batch["label"], [-1]), tf.int32)
        token_ids = tf.cast(batch["token_ids"], tf.int32)
        num_texts = tf.shape(token_ids)[0]
        negatives = batch.get("negative_token_ids")
        if negatives is not None:
            token_ids = tf.concat([token_ids, tf.cast(negatives, tf.int32)], axis=0)
        image = tf.cast(self.image_tower(batch["image"], training=training), tf.float32)
        all_text = tf.cast(self.text_tower(token_ids, training=training), tf.float32)
        text = all_text[:num_texts]
        out = {k: tf.cast(v, tf.float32) for k, v in self._logits(image, text, training).items()}

        count = distribute.global_count(tf.shape(labels)[0])
        image_instance = tf.reduce_sum(losses.instance_loss(out["image_logits"], labels)) / count
        text_instance = tf.reduce_sum(losses.instance_loss(out["text_logits"], labels)) / count

        extra, extra_labels = None, None
        if negatives is not None:
            extra = distribute.cross_replica_concat(all_text[num_texts:])
            if batch.get("negative_label") is not None:
                extra_labels = distribute.cross_replica_concat(
                    tf.cast(tf.reshape(batch["negative_label"], [-1]), tf.int32))
        gallery_labels = distribute.cross_replica_concat(labels)
        rank_rows = losses.cosine_ranking_loss(
            image, text, labels, labels,
            gallery_image_embeds=distribute.cross_replica_concat(image),
            gallery_text_embeds=distribute.cross_replica_concat(text),
            gallery_image_labels=gallery_labels, gallery_text_labels=gallery_labels,
            extra_negative_text_embeds=extra, extra_negative_text_labels=extra_labels,
            margin=self.config.margin, negatives=self.config.ranking_negatives, per_example=True)
        rank = tf.reduce_sum(rank_rows) / count
        lam_rank, lam_image, lam_text = self.lambdas
        total = lam_rank * rank + lam_image * image_instance + lam_text * text_instance
        return {"loss": total, "rank_loss": rank, "image_instance_loss": image_instance,
                "text_instance_loss": text_instance, "labels": labels,
                "image_logits": out["image_logits"], "text_logits": out["text_logits"]}

    def update_metrics(self, terms: dict) -> dict:
        # Each replica holds its share (sum/global count); Mean metrics average
        # over replicas, so scaling by the replica count logs the global value.
        replicas = float(distribute.num_replicas())
        self.image_accuracy.update_state(terms["labels"], terms["image_logits"])
        self.text_accuracy.update_state(terms["labels"], terms["text_logits"])
        return super().update_metrics({key: terms[key] * replicas for key in self.LOGGED_TERMS})

    @property
    def metrics(self):
        return super().metrics + [self.image_accuracy, self.text_accuracy]

    # --- embedding and evaluation -----------------------------------------------------
    def embed_images(self, images, flip_average: bool = True, batch_size: int = 32) -> np.ndarray:
        """f_img of float RGB 0..255 images (N, S, S, 3), not normalised.

        With `flip_average` (the paper's test protocol) the feature is the
        mean of the features of the image and of its horizontal flip.
        """
        images = np.asarray(images)
        s = self.config.image_size
        if images.ndim != 4 or images.shape[1:] != (s, s, 3):
            raise UserInputError(f"images must have shape (N, {s}, {s}, 3), got {images.shape}")
        key = ("image", bool(flip_average))
        if key not in self._embed_fns:
            tower = self.image_tower

            @tf.function(reduce_retracing=True)
            def embed(x):
                features = tf.cast(tower(x, training=False), tf.float32)
                if flip_average:
                    flipped = tf.cast(tower(tf.reverse(x, axis=[2]), training=False), tf.float32)
                    features = 0.5 * (features + flipped)
                return features
            self._embed_fns[key] = embed
        return in_batches(self._embed_fns[key], images.astype(np.float32), batch_size)

    def embed_texts(self, token_ids, batch_size: int = 256) -> np.ndarray:
        """f_text of int token ids (N, max_len), 0 = padding, not normalised."""
        token_ids = np.asarray(token_ids)
        if token_ids.ndim != 2 or token_ids.shape[1] != self.config.max_len:
            raise UserInputError(f"token_ids must have shape (N, {self.config.max_len}), "
                                 f"got {token_ids.shape}")
        if not np.issubdtype(token_ids.dtype, np.integer):
            raise UserInputError(f"token_ids must be integers, got dtype {token_ids.dtype}")
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= self.config.vocabulary_size):
            row = int(np.argwhere((token_ids < 0) | (token_ids >= self.config.vocabulary_size))[0, 0])
            raise UserInputError(f"token_ids row {row} has ids outside [0, "
                                 f"{self.config.vocabulary_size})")
        if "text" not in self._embed_fns:
            tower = self.text_tower

            @tf.function(reduce_retracing=True)
            def embed(x):
                return tf.cast(tower(x, training=False), tf.float32)
            self._embed_fns["text"] = embed
        return in_batches(self._embed_fns["text"], token_ids.astype(np.int32), batch_size)

    def retrieval_embeddings(self, x, *, batch_size: int = 32,
                             flip_average: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """L2-normalised (image, caption) embeddings of a test split (see `evaluate`).

        With ``caption_of_row`` (several token rows per caption: the
        reference code's test-time position shifts) a caption's feature is
        the mean of its rows' features. Image rows are normalised in float64
        (the experiments' convention since the first Table 1 figures), text
        rows in float32.
        """
        split = as_evaluation_split(x)
        if split.image is None or split.text is None:
            raise UserInputError("evaluate() needs the 'image' and 'text' arrays, got None")
        image_embeds = l2_normalize_rows(self.embed_images(split.image, flip_average, batch_size),
                                         dtype=np.float64)
        text_embeds = self.embed_texts(split.text)
        if split.caption_of_row is not None:
            rows = np.asarray(split.caption_of_row)
            if rows.shape != (len(text_embeds),):
                raise UserInputError(f"caption_of_row needs one caption index per text row "
                                     f"({len(text_embeds)}), got shape {rows.shape}")
            sums = np.zeros((split.num_captions, text_embeds.shape[1]), np.float64)
            np.add.at(sums, rows, text_embeds)
            counts = np.bincount(rows, minlength=split.num_captions)
            if counts.min() == 0:
                raise UserInputError(f"caption {int(np.argmin(counts))} has no text row in "
                                     "caption_of_row")
            text_embeds = (sums / counts[:, None]).astype(np.float32)
        elif len(text_embeds) != split.num_captions:
            raise UserInputError(f"{len(text_embeds)} text rows for {split.num_captions} captions; "
                                 "pass caption_of_row when captions have several rows")
        return image_embeds, l2_normalize_rows(text_embeds)

    def evaluate_split(self, x, protocol: str | None = None, *, batch_size: int = 32,
                       flip_average: bool = True, ks: Sequence[int] = retrieval.DEFAULT_KS) -> dict:
        """Image↔text retrieval metrics (cosine) from the one evaluation core.

        `x` is an `EvaluationSplit` (e.g. `load_run(...).evaluation_split()`),
        a dict or an object with ``image`` float RGB 0..255 images
        (num_images, S, S, 3), ``text`` token ids (rows, L) and
        ``caption_image`` (num_captions,), as for every model
        (`models.evaluation_input`); optionally ``caption_of_row`` (see
        `retrieval_embeddings`) and ``image_class`` (CUHK-PEDES: a caption's
        positives are all images of its identity; text→image metrics only).
        `protocol` defaults to the split's, else "full".
        """
        split = as_evaluation_split(x, protocol)
        image_embeds, text_embeds = self.retrieval_embeddings(split, batch_size=batch_size,
                                                              flip_average=flip_average)
        return retrieval_metrics(split, image_embeds, text_embeds, ks=ks)

    def evaluate_text_to_image(self, images, token_ids, caption_identity, image_identity, *,
                               batch_size: int = 32, flip_average: bool = True,
                               ks: Sequence[int] = retrieval.DEFAULT_KS) -> dict:
        """Text→image retrieval where a caption's positives are its identity's images (CUHK-PEDES).

        Returns ``t2i_r1 … t2i_medr, t2i_meanr`` from `retrieval.group_ranks`.
        """
        caption_identity = np.asarray(caption_identity)
        image_identity = np.asarray(image_identity)
        if caption_identity.shape != (len(token_ids),) or image_identity.shape != (len(images),):
            raise UserInputError("caption_identity / image_identity need one id per caption / image")
        image_embeds = l2_normalize_rows(self.embed_images(images, flip_average, batch_size))
        text_embeds = l2_normalize_rows(self.embed_texts(token_ids))
        ranks = retrieval.group_ranks(text_embeds, image_embeds, caption_identity, image_identity)
        return retrieval.metrics_from_ranks(ranks, ks, prefix="t2i_")


def retrieval_metrics(split, image_embeds, text_embeds,
                      ks: Sequence[int] = retrieval.DEFAULT_KS) -> dict:
    """The metrics of `DualPathModel.evaluate` from the split's embeddings
    (`DualPathModel.retrieval_embeddings`): the one evaluation core under the
    split's protocol, or text→image ranks by identity when it has ``image_class``."""
    split = as_evaluation_split(split)
    if split.image_class is not None:
        image_class = np.asarray(split.image_class)
        ranks = retrieval.group_ranks(text_embeds, image_embeds,
                                      image_class[split.caption_image], image_class)
        return retrieval.metrics_from_ranks(ranks, ks, prefix="t2i_")
    return retrieval.evaluate_protocol(image_embeds, text_embeds, split.caption_image,
                                       split.protocol, ks=ks)


def build_dual_path_model(config: DualPathConfig | dict,
                          word_vectors: np.ndarray | None = None) -> DualPathModel:
    """A built `DualPathModel` (all variables created)."""
    if isinstance(config, dict):
        config = DualPathConfig.from_dict(config)
    return DualPathModel(config, word_vectors).build_all()


def load_dual_path_model(config_path, weights_path) -> DualPathModel:
    """Rebuilds a model from its JSON config and loads its ``.weights.h5`` file."""
    config, _ = DualPathModel.load_config(config_path)
    # Every weight, the backbone's included, comes from the weights file.
    if config.image_backbone != "scene_cnn":  # its .keras file also holds the architecture
        config.image_weights = None
    model = build_dual_path_model(config)
    load_checkpoint(model, weights_path, expected=f"a dual-path model of {config_path}")
    return model
