"""Caption–image retrieval whose joint space localizes words and phrases (Das et al.).

* Image branch (§3.1, §4.1): a CNN's spatial map (VGG-19 ``block5_conv4`` at
  224² → 14×14×512 in the paper; the embedded data's scene CNN's last conv
  map) projected to d channels by a 3×3 convolution + batch norm + ReLU (the
  authors' code; the paper does not say how 512 becomes 1024), or by the
  "centred" projection: a 1×1 convolution of each cell's vector beside the
  mean of its k×k neighbourhood, + batch norm + ReLU. S(I, T) does not change
  when the projected map is translated, so a k×k convolution may learn a
  shifted map (on the embedded 6×6 maps it did, by up to a cell); the
  centred projection is mirror-symmetric about each cell and cannot.
  ``a_{r,c}`` is the d-vector at location (r, c).
* Caption branch: word vectors (GloVe from a local file, or PPMI-SVD vectors;
  frozen as in the code, ``train_word_vectors`` to fine-tune them) → one LSTM
  layer → a d-vector ``s_t`` per token. Captions are ``<start> words <end>``
  padded to ``max_tokens`` (the code: 20 words, 22 positions); the mask marks
  the words.
* Localization volume m_{r,c,t} = a_{r,c}·s_t and the score S(I, T) =
  `tf_twobranch.systems.npair.heat_map_volume.pairwise_localization_scores`
  (eq. 1, S_MaxImage, by default).
* Loss: the N-pair loss over the batch's N×N score matrix (eqs. 5–7), or the
  triplet loss with hardest in-batch negatives (eqs. 2–4), under the
  package's global-batch contract (`tf_twobranch.systems.npair.losses.localization_batch_loss`).

Training batches are dicts: ``backbone_map`` (B, h, w, C) precomputed CNN
maps (frozen CNN) or ``image`` (B, S, S, 3) RGB 0..255 (CNN trained end to
end, ``train_backbone``); ``token_ids`` (B, T) int32 (or ``word_inputs`` (B, T, word_dim):
phrase-parsed captions) and ``token_mask`` (B, T).
Image b is paired with caption b.

Evaluation (the family contract's ``evaluate(split)``): an `NPairEvaluationSplit`
holds the test split's backbone maps (``image``, memory-mapped where cached),
its captions' token rows (``text``, ``token_mask``) and, where the dataset has
Flickr30K Entities, the pointing-game phrases (``queries``).
`NPairLocalizationModel.evaluate` returns retrieval under the split's protocol
(`evaluation.localization_retrieval`) and the pointing accuracy in the
split's parse mode (`evaluation.localization_maps`), the ``metrics`` the
experiment writes into results.json; `evaluation_results` gives every
protocol asked for and both parse modes (results.json ``retrieval`` and
``pointing``).
"""
from __future__ import annotations

import dataclasses
import pathlib
import tempfile
from typing import ClassVar, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_twobranch.data.tokenize import END_TOKEN, START_TOKEN
from tf_twobranch.errors import ConfigError, UserInputError
from tf_twobranch.evaluation import pointing_game
from tf_twobranch.systems.npair import heat_maps as localization_maps
from tf_twobranch.systems.npair.retrieval import evaluate_localization_retrieval
from tf_twobranch.evaluation.split import EvaluationSplit
from tf_twobranch.models.base import ModelConfig, SystemModel
from tf_twobranch.systems.npair import losses as npair_losses
from tf_twobranch.systems.npair import heat_map_volume as volume

LOSSES = ("npair", "triplet")
# How the backbone map becomes a_{r,c}: "conv", a k×k convolution (the authors' code: 3×3), or
# "centred", a 1×1 convolution of each cell's own vector beside the mean of its k×k neighbourhood
# (symmetric: it cannot translate the map). Either is followed by batch norm and ReLU.
PROJECTIONS = ("conv", "centred")

__all__ = ["LOSSES", "START_TOKEN", "END_TOKEN", "NPairLocalizationConfig", "NPairLocalizationModel",
           "NPairEvaluationSplit", "headline_metrics", "build_npair_model"]


@dataclasses.dataclass
class NPairLocalizationConfig(ModelConfig):
    FAMILY: ClassVar[str] = "npair"
    FILE_NAME: ClassVar[str] = "npair_config.json"
    DESCRIPTION: ClassVar[str] = "N-pair localization model configuration"

    vocabulary_size: int
    map_channels: int               # C of the backbone map (512 for VGG-19 block5_conv4)
    map_size: int = 14              # h = w of the backbone map
    word_dim: int = 300             # GloVe 300-d
    embed_dim: int = 1024           # d
    max_tokens: int = 22            # <start> + 20 words + <end>
    projection_kernel: int = 3      # the code's 3x3 conv on conv5_4
    projection: str = "conv"        # PROJECTIONS
    loss: str = "npair"
    aggregator: str = "max_image"
    token_average: str = "real"
    normalisation: str = "vector"
    temperature: float = npair_losses.DEFAULT_TEMPERATURE   # eqs. 5-6 and LocNet: 1
    margin: float = 0.1             # η of eqs. 2-3 (the code's 0.1)
    train_word_vectors: bool = False
    train_backbone: bool = False

    def validate(self) -> None:
        for name in ("vocabulary_size", "map_channels", "map_size", "word_dim", "embed_dim",
                     "max_tokens", "projection_kernel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name, allowed in (("loss", LOSSES), ("projection", PROJECTIONS), ("aggregator", volume.AGGREGATORS),
                              ("token_average", volume.TOKEN_AVERAGES),
                              ("normalisation", volume.NORMALISATIONS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}")
        if self.margin < 0:
            raise ConfigError(f"margin must be >= 0, got {self.margin}")


@dataclasses.dataclass
class NPairEvaluationSplit(EvaluationSplit):
    """An `EvaluationSplit` of the N-pair family: ``image`` (num_images, h, w, C) backbone maps,
    ``text`` (num_captions, T) token ids, ``caption_image``, ``protocol``, and

    * ``token_mask`` (num_captions, T): the caption's words among its T positions;
    * ``image_ids``: the id of each image row (the pointing game finds a phrase's image by id);
    * ``queries``: the split's Flickr30K Entities phrases (`evaluation.pointing_game.PointingQuery`),
      None where the dataset has none (retrieval only);
    * ``vocabulary``, ``max_words``: how a phrase's words become the caption branch's inputs
      (the model's vocabulary, the captions' clip);
    * ``parse_mode``, ``pointing_counting``, ``point_rule``: the pointing game reported
      (`localization_maps`; ``point_rule`` the pixel a heat map points at, `pointing_game.POINT_RULES`);
    * ``score_dtype``: matmul dtype of the retrieval scores (float32, or bfloat16 for S_MaxImage).
    """
    token_mask: np.ndarray | None = None
    image_ids: Sequence[str] = ()
    queries: list | None = None
    vocabulary: Sequence[str] = ()
    max_words: int = 20
    parse_mode: str = "word"
    pointing_counting: str = "phrase"
    point_rule: str = pointing_game.DEFAULT_POINT_RULE
    score_dtype: str = "float32"


def headline_metrics(results: dict, protocol: str, parse_mode: str) -> dict:
    """A row's metrics from its evaluation results (`evaluation_results`, or a baseline's
    ``{"pointing": {"baseline": ...}}``): retrieval under `protocol`, and the pointing accuracy in
    `parse_mode` where the pointing game was played."""
    metrics = dict(results.get("retrieval", {}).get(protocol, {}))
    pointing = results.get("pointing")
    if pointing:
        metrics["pointing_accuracy"] = pointing.get(parse_mode, pointing.get("baseline"))["accuracy"]
    return metrics


class NPairLocalizationModel(SystemModel):
    """The two branches and their localization volume, trained on retrieval alone."""

    CONFIG_CLASS = NPairLocalizationConfig
    EVALUATION_OPTIONS = ("work_dir",)

    def __init__(self, config: NPairLocalizationConfig, backbone: keras.Model | None = None, **kwargs):
        config.validate()
        if config.train_backbone and backbone is None:
            raise ConfigError("train_backbone needs the backbone model (image -> spatial map)")
        super().__init__(config, **kwargs)
        self.backbone = backbone
        if backbone is not None:
            backbone.trainable = config.train_backbone
        self.projection = _build_projection(config)
        self.word_embedding = keras.layers.Embedding(config.vocabulary_size, config.word_dim,
                                                     trainable=config.train_word_vectors,
                                                     name="word_vectors")
        self.lstm = keras.layers.LSTM(config.embed_dim, return_sequences=True, name="caption_lstm")

    def build_all(self) -> "NPairLocalizationModel":
        c = self.config
        self.projection.build((None, c.map_size, c.map_size, c.map_channels))
        self.word_embedding.build((None, c.max_tokens))
        self.lstm.build((None, c.max_tokens, c.word_dim))
        self.built = True
        return self

    def set_word_vectors(self, vectors: np.ndarray) -> None:
        vectors = np.asarray(vectors, np.float32)
        want = (self.config.vocabulary_size, self.config.word_dim)
        if vectors.shape != want:
            raise ConfigError(f"word vectors must be {want}, got {vectors.shape}")
        self.word_embedding.embeddings.assign(vectors)

    # ------------------------------------------------------------- branches
    def backbone_maps(self, images, training=False):
        if self.backbone is None:
            raise ConfigError("this model has no backbone: pass precomputed backbone maps")
        return self.backbone(images, training=training and self.config.train_backbone)

    def image_maps(self, batch, training=False):
        """(B, h, w, d) a_{r,c} from ``backbone_map`` or, through the backbone, ``image``."""
        maps = batch["backbone_map"] if "backbone_map" in batch else self.backbone_maps(batch["image"], training)
        return self.projection(maps, training=training)

    def token_vectors_from_inputs(self, word_inputs, training=False):
        """(B, T, d) s_t from (B, T, word_dim) LSTM inputs (phrase mode feeds averaged vectors)."""
        return self.lstm(word_inputs, training=training)

    def token_vectors(self, token_ids, training=False):
        return self.token_vectors_from_inputs(self.word_embedding(token_ids), training)

    def normalised(self, maps, tokens, token_mask):
        return volume.normalise_localization_inputs(maps, tokens, token_mask, self.config.normalisation)

    def encode(self, batch, training=False):
        maps = self.image_maps(batch, training)
        # Phrase-parsed captions (the code's parse_mode="phrase") come as LSTM inputs: a phrase is
        # one input, the mean of its words' vectors.
        tokens = (self.token_vectors_from_inputs(batch["word_inputs"], training) if "word_inputs" in batch
                  else self.token_vectors(batch["token_ids"], training))
        maps, tokens = self.normalised(maps, tokens, batch["token_mask"])
        return maps, tokens

    def call(self, inputs, training=False):
        """S(I_b, T_b) of each pair of the batch."""
        maps, tokens = self.encode(inputs, training)
        c = self.config
        return volume.paired_localization_scores(maps, tokens, inputs["token_mask"], aggregator=c.aggregator,
                                                 token_average=c.token_average)

    # ---------------------------------------------------------------- loss
    def objective(self, batch, training=True) -> dict:
        c = self.config
        maps, tokens = self.encode(batch, training)
        return {"loss": npair_losses.localization_batch_loss(
            maps, tokens, batch["token_mask"], loss=c.loss, aggregator=c.aggregator,
            token_average=c.token_average, temperature=c.temperature, margin=c.margin)}

    # ----------------------------------------------------------- evaluation
    def evaluation_results(self, split: NPairEvaluationSplit, *, protocols: Sequence[str] | None = None,
                           work_dir=None) -> dict:
        """``{"retrieval": {protocol: metrics}, "pointing": {parse mode: results}}`` of a split.

        The split's projected maps and token vectors are written once, chunk by chunk, to a
        temporary folder in `work_dir` (default: the system's), read by every protocol (default:
        the split's) and the pointing game (both parse modes, when the split has ``queries``),
        and removed when done: memory holds a chunk, not the split.
        """
        if not isinstance(split, EvaluationSplit) or getattr(split, "token_mask", None) is None:
            raise UserInputError("an N-pair localization model is evaluated on an NPairEvaluationSplit (backbone "
                                 "maps, token ids and their token_mask): load_run(run_dir).evaluation_split() or "
                                 "tf_twobranch.systems.npair.pipeline.evaluation_split")
        c = self.config
        out = {}
        with tempfile.TemporaryDirectory(dir=work_dir, prefix=".evaluation_") as folder:
            image_maps = localization_maps.evaluation_maps(self, split.image, folder)
            vectors = localization_maps.token_vector_rows(self, split.text, split.token_mask,
                                                          pathlib.Path(folder) / "token_vectors.npy")
            out["retrieval"] = {p: evaluate_localization_retrieval(
                image_maps.normalised, vectors, split.token_mask, split.caption_image, p,
                aggregator=c.aggregator, token_average=c.token_average, score_dtype=split.score_dtype)
                for p in (protocols or [split.protocol])}
            if split.queries is not None:
                by_image = localization_maps.RowsById(split.image_ids, image_maps.projected)
                out["pointing"] = {mode: localization_maps.pointing_results(
                    split.queries, localization_maps.query_heat_maps(
                        self, by_image, split.queries, split.vocabulary, mode=mode, max_words=split.max_words),
                    counting=split.pointing_counting, point_rule=split.point_rule)
                    for mode in localization_maps.PARSE_MODES}
            del image_maps, vectors
        return out

    def evaluate_split(self, x, protocol: str | None = None, *, work_dir=None) -> dict:
        """The family contract: the metrics of a test split (`NPairEvaluationSplit`, e.g.
        `load_run(run_dir).evaluation_split()`): R@K both ways, median/mean rank and rsum of
        S(I, T) under `protocol` (default: the split's), and ``pointing_accuracy`` in the split's
        parse mode where it has Entities phrases — the ``metrics`` of the run's results.json."""
        protocol = protocol or getattr(x, "protocol", None) or "full"
        results = self.evaluation_results(x, protocols=[protocol], work_dir=work_dir)
        return headline_metrics(results, protocol, x.parse_mode)


def _build_projection(config: NPairLocalizationConfig) -> keras.Model:
    """(B, h, w, C) backbone map -> (B, h, w, d) a_{r,c} ("same" padding: h × w kept)."""
    tail = [keras.layers.BatchNormalization(name="projection_bn"), keras.layers.ReLU(name="projection_relu")]
    if config.projection == "conv":
        return keras.Sequential([keras.layers.Conv2D(config.embed_dim, config.projection_kernel, padding="same",
                                                     name="projection_conv")] + tail, name="image_projection")
    maps = keras.Input((None, None, config.map_channels), name="backbone_map")
    # Average pooling with "same" padding averages the cells inside the map only: the neighbourhood
    # mean is centred on the cell at the borders too.
    context = keras.layers.AveragePooling2D(config.projection_kernel, strides=1, padding="same",
                                            name="projection_context")(maps)
    x = keras.layers.Concatenate(name="projection_inputs")([maps, context])
    x = keras.layers.Conv2D(config.embed_dim, 1, name="projection_conv")(x)
    for layer in tail:
        x = layer(x)
    return keras.Model(maps, x, name="image_projection")


def build_npair_model(config: NPairLocalizationConfig | dict, word_vectors: np.ndarray | None = None,
                      backbone: keras.Model | None = None) -> NPairLocalizationModel:
    """A built model; `word_vectors` (vocabulary_size, word_dim) fill the word-vector table."""
    if isinstance(config, dict):
        config = NPairLocalizationConfig.from_dict(config)
    model = NPairLocalizationModel(config, backbone=backbone).build_all()
    if word_vectors is not None:
        model.set_word_vectors(word_vectors)
    return model

